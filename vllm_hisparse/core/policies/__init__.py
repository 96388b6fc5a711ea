"""Hot-buffer replacement policies, one per file, behind a small registry.

Every policy works on the batched hot-buffer state (rows = (request, layer) pairs) with torch ops
only, so the runtime's CPU path, the simulator and the tests run the very same code. The CUDA
RESOLVE kernel implements ``lru`` with identical semantics.
"""
from __future__ import annotations

from .base import Policy, StepInfo

_REGISTRY: dict[str, type] = {}


def register(cls):
    """Class decorator: make a policy available under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def online() -> list[str]:
    """Policies usable at serving time (no future knowledge)."""
    _load_builtin()
    return sorted(n for n, c in _REGISTRY.items() if not c.offline)


def make(name: str, **kw) -> Policy:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kw)


_LOADED = []


def _load_builtin():
    # A flag, not "is the registry empty": importing one policy module directly (e.g. belady's NEVER)
    # registers it before the others are loaded.
    if _LOADED:
        return
    _LOADED.append(True)
    from . import lru, fifo, random_policy, vanilla, belady, crf  # noqa: F401  (they register themselves)


__all__ = ["Policy", "StepInfo", "register", "available", "online", "make"]
