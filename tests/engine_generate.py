"""One offline engine run of scripts/hisparse_generate.py per config, as the engine tests start
them: (argv, env) of a run, its result read back, and several run side by side in the session's
kept engine processes (tests/engine_jobs.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
MAX_TOKENS = 40          # the engine tests' greedy tokens a request


def generate_job(tmp, model: str, cfg: dict, batches: list[list], tag: str, extra=(),
                 max_tokens: int = MAX_TOKENS) -> tuple:
    """(argv, env) of one engine run through scripts/hisparse_generate.py (its prompt files
    written to tmp); ``finish`` reads what it wrote."""
    args = [PY, os.path.join(ROOT, "scripts", "hisparse_generate.py"), "--model", model,
            "--config", json.dumps(cfg), "--max-tokens", str(max_tokens),
            "--out", str(tmp / f"{tag}.json"), *extra]
    for i, b in enumerate(batches):
        path = tmp / f"{tag}-prompts{i}.json"
        path.write_text(json.dumps(b))
        args += ["--prompts", str(path)]
    return args, dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")


def finish(tmp, tag: str, r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    res = json.loads((tmp / f"{tag}.json").read_text())
    res["log"] = r.stdout + r.stderr
    return res


def generate(tmp, model: str, cfg: dict, batches: list[list], tag: str, extra=()) -> dict:
    args, env = generate_job(tmp, model, cfg, batches, tag, extra)
    return finish(tmp, tag, subprocess.run(args, capture_output=True, text=True, env=env,
                                           timeout=600))


def generate_all(tmp, model: str, runs: dict) -> dict:
    """{tag: (cfg, batches, extra)} run side by side in the session's kept engine processes
    (tests/engine_jobs.py, run_pooled), longest first; {tag: a function giving the run's result}:
    a run that failed fails only the tests that read it."""
    from engine_jobs import run_pooled

    done = run_pooled({tag: generate_job(tmp, model, cfg, batches, tag, extra)
                    for tag, (cfg, batches, extra) in runs.items()})
    return {tag: (lambda tag=tag: finish(tmp, tag, done[tag])) for tag in runs}
