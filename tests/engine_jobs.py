"""Engine processes side by side: what the engine tests share to start their vLLM CPU engines
(each in a process of its own) a few at a time instead of one after the other.

An engine process of the tiny model is one busy Python thread (its tensors are too small for
torch's intra-op threads), so on the 2-core CI machine two engines side by side take the wall time
of about one. Each engine still runs alone in its own process with the same settings and the same
requests as before, so its tokens and logprobs are what a run alone gives: only the wall clock is
shared. ``HISPARSE_TEST_ENGINES=1`` runs them one at a time (e.g. to read one engine's log)."""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor


def width() -> int:
    """How many engine processes run at once: HISPARSE_TEST_ENGINES, else the cores this process
    may use (at most 4: each engine holds its own 1 GiB CPU KV cache)."""
    if os.environ.get("HISPARSE_TEST_ENGINES"):
        return max(1, int(os.environ["HISPARSE_TEST_ENGINES"]))
    return max(1, min(4, len(os.sched_getaffinity(0))))


def run_all(jobs: dict, timeout: float = 600) -> dict:
    """jobs: {name: (argv, env)}, started in the order given (put the longest first), ``width()``
    at a time. Returns {name: subprocess.CompletedProcess} (text stdout / stderr captured); a job
    past ``timeout`` seconds is killed and gets returncode -9 and "timed out" in its stderr, so
    that only the tests that read it fail."""
    def one(job):
        argv, env = job
        try:
            return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            return subprocess.CompletedProcess(argv, -9, out or "",
                                               (err or "") + f"\ntimed out after {timeout} s")

    with ThreadPoolExecutor(max_workers=width()) as pool:
        futures = {name: pool.submit(one, job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}
