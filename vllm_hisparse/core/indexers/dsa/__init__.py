"""DSA (token-level): DeepSeek-V3.2's lightning indexer over its own fp8 K cache."""
