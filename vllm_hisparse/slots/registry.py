"""The cache-policy registry: ``make(name)`` builds a policy by its name; the built-in policies are
listed in ``_load_builtin`` (one line each) and loaded on first use; ``register`` adds another
(a class with ``name``, ``offline`` and ``kernel``). The policy modules do not import this one, so
the registry and its policies form no import circle."""
from __future__ import annotations

from .base import Policy

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
    # A flag, not "is the registry empty": a policy registered from outside may come first.
    # Loaded on first use, so that importing the slot engine does not import every policy.
    if _LOADED:
        return
    _LOADED.append(True)
    from .belady import Belady
    from .crf import CRF
    from .fifo import FIFO
    from .lru import LRU
    from .random_policy import Random
    from .vanilla import Vanilla
    for cls in (LRU, FIFO, Random, Vanilla, Belady, CRF):
        register(cls)
