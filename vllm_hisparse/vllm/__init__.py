"""The vLLM adapter: the only package of vllm_hisparse that imports vLLM."""
