"""The prefix-caching engine tests' engines, each run once per pytest run: tests/prefix_chat.py
(one engine per MODE, the same chat in every one) for test_prefix_resident.py and
test_prefix_host.py alike. Both compare against the same "on" (resident, prefix caching on) and
"stock" engines, which a run of the two files used to start twice with the same arguments.

Each test file names its modes (``PREFIX_MODES``); the first file's fixture runs every mode the
run's selected tests need (all files' ``PREFIX_MODES``, one batch side by side in the session's
kept engine processes, tests/engine_jobs.py) and the other reads the same results. Under
pytest-xdist the results live in the run's temporary folder shared by the workers, behind a file
lock: a worker that needs them while another runs them waits for those, and runs only what is
still missing. A mode's failed run (its exit status and log kept) fails only the tests that read
it, as before."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess

DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prefix_chat.py")
# The shortest runs, started last (engine_jobs: longest first): vLLM's own backend, and floor0,
# which RequestRows refuses at the first batch sharing block 0.
SHORT = ("floor0", "stock")


def runs(request, tmp_path_factory, modes) -> "Outputs":
    """{mode: CompletedProcess} for ``modes`` as engine_jobs.Outputs (``runs[mode]`` the JSON the
    driver wrote); runs first every mode of the selected tests' files not run yet."""
    from engine_jobs import Outputs, run_script, tiny_model

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent                       # the run's folder, above each worker's own
    folder = base / "prefix-engines"
    folder.mkdir(exist_ok=True)
    wanted = list(dict.fromkeys([*modes, *(m for item in request.session.items
                                           for m in getattr(getattr(item, "module", None),
                                                            "PREFIX_MODES", ()))]))
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)         # released when the file closes
        todo = sorted((m for m in wanted if not (folder / f"{m}.run.json").exists()),
                      key=lambda m: m in SHORT)
        if todo:
            model = tiny_model()
            for mode, r in run_script(DRIVER, folder, {m: [m, model] for m in todo}).items():
                with open(folder / f"{mode}.run.json", "w") as f:
                    json.dump({"returncode": r.returncode, "stdout": r.stdout,
                               "stderr": r.stderr}, f)
    done = {}
    for mode in modes:
        with open(folder / f"{mode}.run.json") as f:
            r = json.load(f)
        done[mode] = subprocess.CompletedProcess(mode, r["returncode"], r["stdout"], r["stderr"])
    return Outputs(done, {m: str(folder / f"{m}.json") for m in modes})
