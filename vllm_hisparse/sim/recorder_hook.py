"""Runtime trace hook: record the indexer's selections per request while serving (config ``trace_dir``).

The vLLM adapter owns one ``TraceWriter`` per worker and calls it after each layer's indexer, off the
CUDA graph (it copies to host, so it is a debugging/measurement mode, not a serving mode):

    writer = TraceWriter(cfg.trace_dir, meta={"model": ..., "indexer": "dsa", "unit": 1})
    writer.append(request_id, layer, step, positions, context_len)        # one request
    writer.append_batch(request_ids, layer, step_of_each, positions, context_lens)   # a batch
    writer.finish(request_id)            # request done: writes <trace_dir>/<request_id>.npz
    writer.close()                       # shutdown: finishes every open request

Arguments:
  request_id: str, any characters (the file name is sanitised);
  layer: int >= 0, the model layer (rows of the trace);
  step: int >= 0, the request's decode-step counter (0 = first decode step);
  positions: (k,) int tensor/array of selected units, best first; -1 = padding, anywhere (moved
    last); batch form (B, k);
  context_len: int tokens in the request's context at that step, the current token included.

Files follow ``sim/trace.py`` exactly (positions (steps, layers, k_max) int32, context_len (steps,),
meta JSON). Missing (step, layer) cells stay -1. ``flush(request_id)`` writes what is there so far
and keeps recording. Memory: steps x layers x k int32 per open request on the host.
"""
from __future__ import annotations

import os
import re

import numpy as np

from . import trace


def _host(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").numpy()
    return np.asarray(x).astype(np.int32, copy=False)


class _Request:
    def __init__(self):
        self.cells: dict[tuple[int, int], np.ndarray] = {}     # (step, layer) -> (k,) int32
        self.context: dict[int, int] = {}                      # step -> context_len


class TraceWriter:
    def __init__(self, trace_dir: str, meta: dict | None = None):
        if not trace_dir:
            raise ValueError("TraceWriter needs trace_dir (the config field trace_dir); got an empty path")
        self.trace_dir = trace_dir
        self.meta = dict(meta or {})
        self.meta.setdefault("model", "unknown")
        self.meta.setdefault("text", "served requests")
        self.meta.setdefault("indexer", "unknown")
        self.meta.setdefault("unit", 1)
        self._open: dict[str, _Request] = {}

    def append(self, request_id: str, layer: int, step: int, positions, context_len: int) -> None:
        if layer < 0 or step < 0:
            raise ValueError(f"layer={layer} and step={step} must be >= 0")
        pos = _host(positions).reshape(-1)
        pos = np.concatenate([pos[pos >= 0], pos[pos < 0]])     # padding last, order kept
        req = self._open.setdefault(str(request_id), _Request())
        req.cells[(int(step), int(layer))] = np.where(pos >= 0, pos, -1).astype(np.int32)
        req.context[int(step)] = max(int(context_len), req.context.get(int(step), 0))

    def append_batch(self, request_ids, layer: int, steps, positions, context_lens) -> None:
        """Batch form: request_ids (B,), steps (B,) ints, positions (B, k), context_lens (B,)."""
        pos = _host(positions)
        steps, lens = _host(steps).reshape(-1), _host(context_lens).reshape(-1)
        if not (len(request_ids) == len(pos) == len(steps) == len(lens)):
            raise ValueError(f"append_batch: {len(request_ids)} ids, {len(pos)} position rows, "
                             f"{len(steps)} steps, {len(lens)} context lengths must match")
        for rid, p, s, n in zip(request_ids, pos, steps, lens):
            self.append(rid, layer, int(s), p, int(n))

    def path_of(self, request_id: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(request_id))[:200] or "request"
        return os.path.join(self.trace_dir, f"{safe}.npz")

    def flush(self, request_id: str) -> str | None:
        """Write the request's trace so far (overwriting); returns the path, None if nothing recorded."""
        req = self._open.get(str(request_id))
        if req is None or not req.cells:
            return None
        steps = max(s for s, _ in req.cells) + 1
        layers = max(layer for _, layer in req.cells) + 1
        k = max(len(v) for v in req.cells.values())
        positions = np.full((steps, layers, k), -1, np.int32)
        for (s, layer), v in req.cells.items():
            positions[s, layer, :len(v)] = v
        ctx = np.zeros(steps, np.int32)
        for s, n in req.context.items():
            ctx[s] = n
        ctx = np.maximum.accumulate(ctx)                        # steps never appended: carry forward
        meta = dict(self.meta, k_max=k, rows="layer", request_id=str(request_id))
        return trace.save(self.path_of(request_id), positions, ctx, meta)

    def finish(self, request_id: str) -> str | None:
        """Write the request's trace and forget the request."""
        path = self.flush(request_id)
        self._open.pop(str(request_id), None)
        return path

    def close(self) -> list[str]:
        return [p for p in (self.finish(r) for r in list(self._open)) if p]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
