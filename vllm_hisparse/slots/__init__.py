"""The slot engine: hot-buffer state, the resolve step and the replacement policies behind a small
registry. The lowest layer of the package (it imports torch only): the runtime (core/), the
plain-torch references of the kernels (ops/reference.py), the simulator (sim/) and the config's
validation all use this one engine.

A policy is one file here: a ``Policy`` subclass decorated with ``@register``. A policy that the
served RESOLVE kernel implements (ops/triton_select.py) sets ``kernel`` to its branch id there;
``served()`` lists those, the values config ``policy`` accepts.
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


def served() -> list[str]:
    """Policies the served RESOLVE kernel implements (config ``policy``)."""
    _load_builtin()
    return sorted(n for n, c in _REGISTRY.items() if c.kernel is not None)


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


from .engine import HotBufferState, fetch_misses, resolve, write_resident  # noqa: E402

__all__ = ["Policy", "StepInfo", "register", "available", "online", "served", "make",
           "HotBufferState", "resolve", "fetch_misses", "write_resident"]
