"""The slot engine: hot-buffer state, the resolve step and the replacement policies behind a small
registry. The lowest layer of the package (it imports torch only): the runtime (core/), the
plain-torch references of the kernels (ops/reference.py), the simulator (sim/) and the config's
validation all use this one engine.

A policy is one file here (a ``Policy`` subclass) and a line in registry.py's ``_load_builtin``. A
policy that the served RESOLVE kernel implements (ops/triton_select.py) sets ``kernel`` to its
branch id there; ``served()`` lists those, the values config ``policy`` accepts.
"""
from __future__ import annotations

from .base import Policy, StepInfo
from .registry import available, make, online, register, served
from .engine import HotBufferState, fetch_misses, resolve, write_resident

__all__ = ["Policy", "StepInfo", "register", "available", "online", "served", "make",
           "HotBufferState", "resolve", "fetch_misses", "write_resident"]
