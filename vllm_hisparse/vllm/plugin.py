"""vLLM general-plugin entry point (``vllm.general_plugins``: hisparse)."""


def register() -> None:
    """Idempotent and lazy; filled in by the adapter."""
