"""Trace mode of the serving runtime (``cfg.trace_dir``): every sparse layer's selection of every
decode row appended to a per-request trace through the writer the adapter passes
(``sim.recorder_hook.TraceWriter``; format ``sim/trace.py``, unit = one page, rows = the sparse
layers in order, each row the newest page then the selected complete pages), written to
``<trace_dir>/<request id>.npz`` when the request finishes. Core imports no sim: the writer class
comes in as an argument."""
from __future__ import annotations

import torch


class DecodeTrace:
    def __init__(self, writer_cls, cfg, ix, num_layers: int, dense_layers, num_kv_heads: int,
                 head_dim: int):
        if writer_cls is None:
            raise ValueError("hisparse runtime: trace_dir is set but no trace_writer was passed "
                             "(pass sim.recorder_hook.TraceWriter, as the vLLM adapter does)")
        self.P = cfg.page_size
        sparse = [i for i in range(num_layers) if i not in dense_layers]
        self.row_of = {layer: j for j, layer in enumerate(sparse)}
        self.steps: dict[str, int] = {}           # req_id -> decode steps so far
        self.writer = writer_cls(cfg.trace_dir, meta={
            "model": "served by vLLM (hisparse runtime)", "text": "served requests",
            "indexer": (f"{cfg.indexer} selection ({ix.state_name}, unit {ix.P} tokens, newest "
                        f"page first), hisparse serving runtime"),
            "unit": self.P, "page_size": self.P, "top_k": cfg.top_k,
            "device_buffer_size": cfg.device_buffer_size, "policy": cfg.policy,
            "num_layers": num_layers, "sparse_layers": sparse, "kv_heads": num_kv_heads,
            "head_dim": head_dim, "decode": "as served"})

    def restart(self, req_id: str) -> None:
        """A (re)started request traces from decode step 0: what an earlier run of it recorded
        (before a preemption) is written now and dropped; finish overwrites it with the new run."""
        if self.steps.pop(req_id, None) is not None:
            self.writer.finish(req_id)

    def finish(self, req_id: str) -> None:
        self.steps.pop(req_id, None)
        self.writer.finish(req_id)

    def number_steps(self, db) -> None:
        """The decode-step index of each sparse row of the decode batch db (counted here)."""
        db.trace_steps = []
        for s in db.steps:
            if s.sparse:
                n = self.steps.get(s.req_id, 0)
                db.trace_steps.append(n)
                self.steps[s.req_id] = n + 1

    def decode(self, layer: int, db, sel: torch.Tensor) -> None:
        """Append the layer's selections of the batch's sparse rows (newest page first, then the
        indexer's choice; one host copy)."""
        sp = [i for i, s in enumerate(db.steps) if s.sparse]
        if not sp:
            return
        st = [db.steps[i] for i in sp]
        newest = torch.tensor([(s.seq_len - 1) // self.P for s in st], dtype=torch.int64)
        pos = torch.cat([newest[:, None], sel[sp].cpu().long()], 1)
        self.writer.append_batch([s.req_id for s in st], self.row_of[layer], db.trace_steps, pos,
                                 [s.seq_len for s in st])
