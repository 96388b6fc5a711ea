"""vllm-hisparse: HiSparse hierarchical KV cache for top-k sparse-attention decoding (vLLM plugin)."""
from vllm_hisparse.config import HiSparseConfig, HiSparseConfigError

__version__ = "0.1.0"
__all__ = ["HiSparseConfig", "HiSparseConfigError", "__version__"]
