"""The indexer interface: per-request selection state on the device and the three things the
runtime asks of it (allocate a row, fold new tokens in, score the units of a decode row).

An indexer owns, per sparse layer, state with one *row* per sparse request admitted at once plus a
scratch row (decode-batch padding points at it). Units are ``unit_tokens`` tokens (a page for
Quest, one token for DSA); a decode row's scores are one fp32 value per unit, and the runtime's
``select_resolve`` (ops/decode_ops.py) takes the top-k of them, RESOLVEs them into hot slots and
copies the misses. Which process: everything here runs in the worker, except the class-level
sizing (``row_bytes``), which capacity (``hisparse calc``) and admission use as well.

New tokens reach the indexer on two paths, both without host syncs on the device:

- several tokens per request (prefill chunks; the context of a request turning sparse):
  ``plan_tokens`` once per step turns the requests' token ranges into index arrays (numpy; the
  runtime ships them to the device in its one copy of the step) and ``update`` folds a layer's
  keys in with them;
- one token per decode row: ``decode_unit`` gives a row's value of the decode batch field
  ``i_unit`` and ``decode_write_kwargs`` the state the fused decode write updates
  (ops/decode_ops.decode_write), so the new token costs no extra launch; in a sparse layer
  ``write_and_score`` runs that write and the scores, in one launch where the indexer can.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_hisparse.ops import decode_ops


class Indexer:
    """Base class; subclasses set ``name`` and ``state_name`` and implement every method."""

    name = ""
    state_name = ""          # what the state is called in startup lines and errors
    serves = "gqa"           # the models vLLM serves it on: "gqa" (the runtime's decode body) or
                             # "mla" (DeepSeek-V3.2 style: ``mla_selection``, docs/dsa.md)

    # ---- sizing (class level: capacity, admission, startup checks) ------------------------------
    @staticmethod
    def unit_tokens(cfg) -> int:
        """Tokens per selection unit (and per hot slot)."""
        raise NotImplementedError

    @classmethod
    def row_bytes(cls, sparse_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                  max_model_len: int, page_size: int) -> int:
        """Device bytes the plugin reserves for one indexer row (one request, every sparse layer)
        for requests of up to max_model_len tokens (0: the state lives elsewhere)."""
        raise NotImplementedError

    @classmethod
    def allocate_state(cls, cfg, num_layers: int, rows: int, max_model_len: int,
                       num_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        """The state of ``rows`` rows + 1 scratch row, every layer (None for dense layers):
        allocated by the vLLM adapter before memory profiling, or by the runtime."""
        raise NotImplementedError

    # ---- the served MLA path (serves == "mla": vllm/mla_backend.py, class level) -----------------
    @classmethod
    def mla_selection(cls, topk_buffer: torch.Tensor, num_tokens: int, layer: int) -> torch.Tensor:
        """The logical positions each of the step's query tokens attends in ``layer``: (T, K) int32,
        -1 = none, T = num_tokens, which the latent runtime turns into pool rows
        (``LatentRuntime.convert``). topk_buffer: vLLM's (max_num_batched_tokens, K) int32
        ``topk_indices_buffer``, which the model's own indexer module fills before the layer's
        attention. Called from ``forward_mqa`` of every layer, also while vLLM captures a CUDA
        graph: device work on fixed shapes only, no host sync."""
        raise NotImplementedError(f"indexer {cls.name!r} does not serve MLA models")

    # ---- runtime --------------------------------------------------------------------------------
    def __init__(self, cfg, num_layers: int, rows: int, max_model_len: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device, state=None):
        self.cfg = cfg
        self.rows = rows
        self.scratch = rows                           # padding rows of a decode batch use it
        self.P = self.unit_tokens(cfg)
        self.U = -(-max_model_len // self.P)          # units of a max_model_len request
        if state is None:
            state = self.allocate_state(cfg, num_layers, rows, max_model_len, num_kv_heads,
                                        head_dim, dtype, device)
        self.check_state(state)
        self.state = state
        self._free = list(range(rows - 1, -1, -1))

    def check_state(self, state) -> None:
        """Raise ValueError when state given by the caller does not have rows + 1 rows."""

    def allocate(self) -> int:
        """A free row for a request turning sparse; -1 when every row is taken."""
        return self._free.pop() if self._free else -1

    def free(self, row: int) -> None:
        if row >= 0:
            self._free.append(row)

    def plan_tokens(self, start: np.ndarray, seq: np.ndarray, row: np.ndarray) -> dict:
        """Index arrays (name -> int64 numpy) folding in the tokens [start[i], seq[i]) of the
        requests with indexer rows row[i], in that order (the order of k in ``update``)."""
        raise NotImplementedError

    def device_update(self, arrays: dict) -> object:
        """The device copies of ``plan_tokens``'s arrays (same names), in the form ``update``
        reads; called once per step."""
        raise NotImplementedError

    def update(self, layer: int, upd, k: torch.Tensor) -> None:
        """Fold the keys k (T, Hkv, D) of the planned tokens into layer's state."""
        raise NotImplementedError

    def decode_unit(self, row: int, seq: int) -> int:
        """The decode batch's ``i_unit`` of a row whose new token makes seq keys."""
        raise NotImplementedError

    def decode_write_kwargs(self, layer: int, i_unit: torch.Tensor) -> dict:
        """Keyword arguments of ops/decode_ops.decode_write that fold each decode row's new key
        into layer's state (i_unit: the batch field)."""
        raise NotImplementedError

    def score(self, layer: int, q: torch.Tensor, rows: torch.Tensor, num_units: torch.Tensor,
              out: torch.Tensor) -> None:
        """out (R, U) fp32: the score of every unit of row rows[r] for query q[r]; units at or
        past num_units[r] are ignored by the selection (any value)."""
        raise NotImplementedError

    def write_and_score(self, layer: int, write: tuple, i_unit: torch.Tensor, q: torch.Tensor,
                        rows: torch.Tensor, num_units: torch.Tensor, out: torch.Tensor) -> None:
        """A sparse layer's decode write (write: ops/decode_ops.decode_write's kv, k, v,
        block_table, seq, newest, dst, dst_page; this indexer's state through
        ``decode_write_kwargs``) and then ``score``. num_units never reaches the unit the write
        folds a token into, and no two rows that write share an indexer row, so an indexer may run
        both in one launch (Quest does on CUDA)."""
        decode_ops.decode_write(*write, **self.decode_write_kwargs(layer, i_unit))
        self.score(layer, q, rows, num_units, out)
