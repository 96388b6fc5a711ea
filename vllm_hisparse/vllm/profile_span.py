"""Hisparse's host work in a step as named spans of a torch profile (``bench.idle_gaps`` names
what the GPU waited for by them): ``span(name)`` is ``record_function(name)`` while a profiler
records this thread, nothing otherwise (``record_function`` alone costs microseconds a call, a
cost no unprofiled step should pay)."""
from __future__ import annotations

import contextlib

from torch.autograd import _profiler_enabled
from torch.profiler import record_function


def span(name: str):
    """A context manager: the named span while profiling, else a no-op."""
    return record_function(name) if _profiler_enabled() else contextlib.nullcontext()
