"""The selection-trace format (other tools read it: keep it exactly).

A trace is one compressed ``.npz`` file with three arrays:

  positions:   int32 (steps, layers, k_max)  selected logical units of each decode step and row,
               best first, -1 = padding (only after the valid entries). Units are tokens for
               token-level indexers, pages/blocks for page indexers (``meta["unit"]`` tokens each).
               "layers" may hold more rows than model layers (e.g. layers x KV heads); ``meta``
               says how (``rows``).
  context_len: int32 (steps,)  tokens in the context at each step, the current token included.
  meta:        a JSON string: model, text (source), indexer, unit, k_max, and optional extras
               (rows, kv_heads, decode, ...).

A smaller k is the first k entries of each row.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

REQUIRED_META = ("model", "text", "indexer", "unit", "k_max")


class TraceError(ValueError):
    """A trace file that does not follow the format; the message names the array and the fix."""


@dataclass
class Trace:
    positions: np.ndarray          # (steps, layers, k_max) int32, -1 = padding
    context_len: np.ndarray        # (steps,) int32
    meta: dict = field(default_factory=dict)
    path: str = ""

    @property
    def steps(self) -> int:
        return self.positions.shape[0]

    @property
    def layers(self) -> int:
        return self.positions.shape[1]

    @property
    def k_max(self) -> int:
        return self.positions.shape[2]

    @property
    def unit(self) -> int:
        return int(self.meta.get("unit", 1))

    @property
    def name(self) -> str:
        base = os.path.basename(self.path) if self.path else self.meta.get("name", "trace")
        return base[:-4] if base.endswith(".npz") else base

    def max_units(self) -> int:
        """Units needed to index every position of the trace (page-table width)."""
        top = int(self.positions.max(initial=-1)) + 1
        last = (int(self.context_len.max(initial=0)) + self.unit - 1) // self.unit
        return max(top, last, 1)

    def first_k(self, k: int) -> np.ndarray:
        """(steps, layers, k) int32: the best k units of each row."""
        if k > self.k_max:
            raise TraceError(f"k={k} exceeds the trace's k_max={self.k_max} ({self.name}); "
                             f"pass --k values <= {self.k_max}")
        return self.positions[:, :, :k]


def validate(positions, context_len, meta) -> None:
    """Raise TraceError naming the first thing that is wrong."""
    if not isinstance(positions, np.ndarray) or positions.dtype != np.int32 or positions.ndim != 3:
        raise TraceError(f"positions must be an int32 array (steps, layers, k_max); got "
                         f"{getattr(positions, 'dtype', type(positions))} with shape "
                         f"{getattr(positions, 'shape', None)}")
    if not isinstance(context_len, np.ndarray) or context_len.dtype != np.int32 \
            or context_len.shape != positions.shape[:1]:
        raise TraceError(f"context_len must be int32 of shape (steps,) = {positions.shape[:1]}; got "
                         f"{getattr(context_len, 'dtype', None)} {getattr(context_len, 'shape', None)}")
    if not isinstance(meta, dict):
        raise TraceError("meta must be a JSON object (dict)")
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing:
        raise TraceError(f"meta lacks {', '.join(missing)}; required keys: {', '.join(REQUIRED_META)}")
    if int(meta["k_max"]) != positions.shape[2]:
        raise TraceError(f"meta k_max={meta['k_max']} but positions has k_max={positions.shape[2]}")
    unit = int(meta["unit"])
    if unit < 1:
        raise TraceError(f"meta unit={unit} must be >= 1 (tokens per unit)")
    if positions.size == 0:
        return
    if int(positions.min()) < -1:
        raise TraceError(f"positions has values < -1 (min {int(positions.min())}); -1 is the only padding")
    valid = positions >= 0
    if (valid[..., 1:] & ~valid[..., :-1]).any():
        raise TraceError("positions has a unit after a -1: padding must come last in each row")
    limit = (context_len.astype(np.int64)[:, None, None] + unit - 1) // unit
    if (positions >= limit).any():
        s = int(np.argwhere(positions >= limit)[0][0])
        raise TraceError(f"step {s} selects unit {int(positions[s].max())} beyond its context of "
                         f"{int(context_len[s])} tokens (unit {unit}); check context_len")
    srt = np.sort(positions, axis=-1)
    if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
        raise TraceError("positions repeats a unit within one row; selections must be unique")


def save(path: str, positions, context_len, meta: dict) -> str:
    """Validate and write a compressed trace; returns the path."""
    positions = np.asarray(positions)
    context_len = np.asarray(context_len)
    meta = dict(meta)
    meta.setdefault("k_max", int(positions.shape[2]) if positions.ndim == 3 else None)
    validate(positions, context_len, meta)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez_compressed(path, positions=positions, context_len=context_len,
                        meta=np.array(json.dumps(meta, sort_keys=True)))
    return path


def load(path: str) -> Trace:
    """Read and validate a trace file."""
    if not os.path.exists(path):
        raise TraceError(f"trace file {path!r} not found; record one with "
                         f"`python -m vllm_hisparse.sim.record` or omit TRACE for the shipped one")
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [key for key in ("positions", "context_len", "meta") if key not in z.files]
            if missing:
                raise TraceError(f"{path}: missing array(s) {', '.join(missing)}; a trace holds "
                                 f"positions, context_len and meta")
            positions, context_len, raw = z["positions"], z["context_len"], z["meta"]
    except (OSError, ValueError) as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"{path}: not a readable .npz trace ({e})") from e
    try:
        meta = json.loads(str(raw[()]))
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: meta is not a JSON string ({e})") from e
    try:
        validate(positions, context_len, meta)
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None
    return Trace(positions, context_len, meta, path)


def default_trace_path() -> str:
    """The small real trace shipped with the package (sim/data/)."""
    return os.path.join(os.path.dirname(__file__), "data", "smollm2-gpl3-topk.npz")
