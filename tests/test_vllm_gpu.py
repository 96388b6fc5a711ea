"""GPU box: Llama-3-8B-shaped dummy model, 32K max length, CUDA graphs (PIECEWISE), bf16, the CUDA
RESOLVE kernel and Triton attention: hisparse == resident, token ids and logprobs, for every served
policy (scripts/gpu_exactness.py; figures in docs/gpu-results.md)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.cuda, pytest.mark.slow]
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "gpu_exactness.py")


@pytest.mark.parametrize("policy", ["lru", "crf"])
def test_llama3_8b_shape_exact_with_cuda_graphs(tmp_path, policy):
    extra = dict(json.loads(os.environ.get("HISPARSE_EXTRA", "{}")), policy=policy)
    env = dict(os.environ, HISPARSE_EXTRA=json.dumps(extra))
    for mode in ("resident", "hisparse"):
        r = subprocess.run([sys.executable, SCRIPT, "run", mode, str(tmp_path)], capture_output=True,
                           text=True, timeout=900, env=env)
        assert r.returncode == 0, r.stdout[-4000:]
        assert "PIECEWISE" in r.stdout          # CUDA graphs were captured
    r = subprocess.run([sys.executable, SCRIPT, "compare", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "EXACT" in r.stdout, r.stdout
