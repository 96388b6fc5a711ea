"""Build the tiny random Llama used by the vLLM tests and the demo (see vllm_hisparse/tiny_model.py).

    python scripts/make_tiny_model.py [OUT_DIR]      # default: models/tiny-llama (git-ignored)
"""
import os
import sys

from vllm_hisparse import tiny_model

if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.exit(tiny_model.main(sys.argv[1:] or [os.path.join(root, "models", "tiny-llama")]))
