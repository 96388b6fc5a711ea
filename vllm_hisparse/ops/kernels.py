"""Dispatch to the compiled CUDA ops (vllm_hisparse._C) with the plain-torch references as the
CPU path. Each public function has the signature of its reference in ops/reference.py."""
from __future__ import annotations

import torch

from . import reference
from .head_sizes import DENSE_DECODE_HEAD_SIZES  # noqa: F401  (public here as before)

_ext = None
_err: str | None = None
try:
    from vllm_hisparse import _C as _ext  # noqa: F401  (registers torch.ops.hisparse.*)
except Exception as e:  # noqa: BLE001 - report any import failure verbatim
    _err = f"{type(e).__name__}: {e}"


def available() -> bool:
    return _ext is not None


def import_error() -> str | None:
    return _err


def use_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and _ext is not None


def device_alias(t: torch.Tensor | None, dev: torch.device) -> torch.Tensor | None:
    """A pinned CPU pool as a CUDA tensor over the same memory (UVA), for the Triton kernels."""
    if t is None or t.device == dev:
        return t
    if not available():
        raise RuntimeError(f"hisparse: reading the pinned host pool from a Triton kernel needs the "
                           f"compiled extension (vllm_hisparse._C): {import_error()}")
    return torch.ops.hisparse.uva_view(t)


def add_one(x: torch.Tensor) -> torch.Tensor:
    """Pipeline probe: x + 1 through the extension (CUDA) or torch (CPU)."""
    if use_cuda(x):
        out = torch.empty_like(x)
        torch.ops.hisparse.add_one(x, out)
        return out
    return x + 1


if _ext is not None:
    @torch.library.register_fake("hisparse::resolve_lru")
    def _resolve_lru_fake(selection, slot_unit, unit_slot, lru_order, slot_map, buffer, host,
                          host_page_table, device_locs, io_chunk_bytes=64):
        return None

    @torch.library.register_fake("hisparse::select_resolve")
    def _select_resolve_fake(scores, seq, num_full, hot, rows, block_table, slot_unit, unit_slot,
                             pol, counts, sel, locs, missed, k, has_hot, policy, shift, hit,
                             threads):
        return None          # writes its outputs in place (ops/decode_ops.select_resolve)


def resolve_lru(selection: torch.Tensor, slot_unit: torch.Tensor, unit_slot: torch.Tensor,
                lru_order: torch.Tensor, slot_map: torch.Tensor, buffer: torch.Tensor,
                host: torch.Tensor, host_page_table: torch.Tensor, device_locs: torch.Tensor,
                io_chunk_bytes: int = 64) -> None:
    """One LRU resolve step for a batch of rows, in place (contract: reference.resolve_lru).

    selection: (R, k) int32 unique logical units, -1 = padding anywhere; all -1 rows are no-ops
    slot_unit, lru_order, slot_map: (R, S) int32 (-1 = empty slot; order MRU first); S <= 32768
    unit_slot: (R, U) int32 page table (-1 = not resident); every selected unit must be < U
    buffer: (N, *unit_shape) device hot buffer, any dtype, contiguous; one unit = one opaque byte row
    host: (P, *unit_shape) pinned CPU (or CUDA) pool, contiguous; host_page_table: (R, Umax) int32
    device_locs: (R, k) int32 out, physical slot of each selected unit, -1 for padding
    io_chunk_bytes: bytes each thread has in flight per IO step (16..256), CUDA only.
    CUDA path: two launches, no host sync, no allocation (CUDA-graph capturable).
    """
    if use_cuda(selection):
        torch.ops.hisparse.resolve_lru(selection, slot_unit, unit_slot, lru_order, slot_map, buffer,
                                       host, host_page_table, device_locs, io_chunk_bytes)
        return
    reference.resolve_lru(selection, slot_unit, unit_slot, lru_order, slot_map, buffer, host,
                          host_page_table, device_locs)


def sparse_decode_attention(q: torch.Tensor, kv: torch.Tensor, locs: torch.Tensor, units: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, extra_kv: torch.Tensor | None = None,
                            extra_lens: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Sparse GQA decode attention (contract: reference.sparse_decode_attention).

    q: (R, Hq, D) bf16/fp16, D in {64, 128, 256}; kv: (N, 2, unit, Hkv, D); locs, units: (R, k)
    int32 (-1 = padding); seq_lens: (R,) int32; extra_kv: (R, E, 2, Hkv, D) + extra_lens (R,) int32;
    out: (R, Hq, D) q's dtype. CUDA: the Triton kernel (ops/triton_attention.py), whose result depends
    only on the gathered values and their order (HiSparse == resident, bit for bit).
    """
    if q.is_cuda:
        from . import triton_attention
        return triton_attention.sparse_decode_attention(q, kv, locs, units, seq_lens, scale, extra_kv,
                                                        extra_lens, out)
    return reference.sparse_decode_attention(q, kv, locs, units, seq_lens, scale, extra_kv, extra_lens, out)


def dense_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_k: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, max_k: int | None = None,
                           table_rows: torch.Tensor | None = None,
                           work: tuple | None = None) -> torch.Tensor:
    """One query per row over its first seq_k keys through its block table (see
    reference.dense_decode_attention); on CUDA the batch-invariant split-KV Triton kernel
    (ops/triton_dense_decode.py). table_rows (R,) int64: row r reads block_table[table_rows[r]].
    work: the kernel's preallocated partials; with it (also on CPU) rows with seq_k 0 leave their
    out rows as they are (another call's rows)."""
    if q.is_cuda:
        from . import triton_dense_decode
        return triton_dense_decode.dense_decode_attention(q, k_cache, v_cache, block_table, seq_k,
                                                          scale, out, max_k, table_rows, work)
    if work is None:
        bt = block_table if table_rows is None else block_table[table_rows]
        return reference.dense_decode_attention(q, k_cache, v_cache, bt, seq_k, scale, out)
    live = torch.nonzero(seq_k > 0)[:, 0]            # the other rows are another call's
    bt = block_table[live if table_rows is None else table_rows[live]]
    out[live] = reference.dense_decode_attention(q[live], k_cache, v_cache, bt, seq_k[live],
                                                 scale).to(out.dtype)
    return out


def dense_decode_two(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                     seq_k: torch.Tensor, kv2: torch.Tensor, table2: torch.Tensor,
                     rows2: torch.Tensor, seq2: torch.Tensor, scale: float, out: torch.Tensor,
                     work: tuple) -> torch.Tensor:
    """A dense layer over two caches: rows with seq2 > 0 as ``dense_decode_attention(q, kv2[:, 0],
    kv2[:, 1], table2, seq2, table_rows=rows2)``, the others with seq_k > 0 as
    ``dense_decode_attention(q, kv[:, 0], kv[:, 1], block_table, seq_k)``, the rest of out left as
    it is. CUDA: one split and one combine launch (ops/triton_dense_decode.py); CPU: the two calls
    (the references), seq2's rows last."""
    if q.is_cuda:
        from . import triton_dense_decode
        return triton_dense_decode.dense_decode_two(q, kv, block_table, seq_k, kv2, table2, rows2,
                                                    seq2, scale, out, work)
    first = torch.where(seq2 > 0, torch.zeros_like(seq_k), seq_k)
    dense_decode_attention(q, kv[:, 0], kv[:, 1], block_table, first, scale, out, work=work)
    return dense_decode_attention(q, kv2[:, 0], kv2[:, 1], table2, seq2, scale, out,
                                  table_rows=rows2, work=work)


def decode_attention(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor,
                     locs: torch.Tensor, units: torch.Tensor, sp_seq: torch.Tensor,
                     newest: torch.Tensor, dn_seq: torch.Tensor, scale: float, out: torch.Tensor,
                     work: tuple, miss: tuple | None = None) -> torch.Tensor:
    """A decode batch's sparse-layer attention: rows with sp_seq > 0 as
    ``sparse_decode_attention_newest(q, kv, locs, units, sp_seq, newest)``, rows with dn_seq > 0
    as ``dense_decode_attention(q, kv[:, 0], kv[:, 1], block_table, dn_seq)``, the others' out
    rows left as they are. CUDA: both kinds in one split and one combine launch
    (ops/triton_decode_attention.py; work = its partials); CPU: those two functions' references.

    miss (rows, host_pt, host, missed): the sparse rows' locs may hold misses that
    ``select_resolve(fetch=False)`` marked ``-2 - block`` (missed[r], the select's: 0 for a row
    without one, whose split programs skip the check on CUDA): each such page is
    host[host_pt[rows[r], units[r, j]]] and lands in kv[block] as well (``reference.fetch_marked``
    and then the attention; on CUDA the split launch reads those pages' tokens from the pinned
    pool itself and writes them into their blocks). locs is left as it is."""
    if q.is_cuda:
        from . import triton_decode_attention
        if miss is not None:
            miss = (*miss[:2], device_alias(miss[2], q.device), miss[3])
        return triton_decode_attention.decode_attention(q, kv, block_table, locs, units, sp_seq,
                                                        newest, dn_seq, scale, out, work, miss)
    if miss is not None:
        locs = reference.fetch_marked(kv, locs, units, sp_seq, *miss[:3])
    sparse_decode_attention_newest(q, kv, locs, units, sp_seq, newest, scale, out, work=())
    return dense_decode_attention(q, kv[:, 0], kv[:, 1], block_table, dn_seq, scale, out,
                                  work=())


def sparse_decode_attention_newest(q: torch.Tensor, kv: torch.Tensor, locs: torch.Tensor,
                                   units: torch.Tensor, seq_lens: torch.Tensor,
                                   newest_blocks: torch.Tensor, scale: float,
                                   out: torch.Tensor | None = None,
                                   work: tuple | None = None) -> torch.Tensor:
    """sparse_decode_attention whose extra rows are each row's newest page, read from kv in place.

    Equal to sparse_decode_attention(..., extra_kv=kv[newest_blocks].transpose(1, 2) (R, unit, 2,
    Hkv, D), extra_lens=(seq_lens - 1) % unit + 1 (floor modulo)): the same bits on CUDA, where
    the Triton kernel reads block newest_blocks[r] itself (two launches in all, no gather);
    exactly that on CPU. newest_blocks: (R,) int32/int64 on q's device; on CUDA -1 means no extra
    rows (a padding row). Other args as sparse_decode_attention. work: the kernel's preallocated
    partials (triton_attention.partials_shape); with it (also on CPU) rows with seq_lens 0 leave
    their out rows as they are (another call's rows).
    """
    if q.is_cuda:
        from . import triton_attention
        return triton_attention.sparse_decode_attention_newest(q, kv, locs, units, seq_lens,
                                                               newest_blocks, scale, out, work)
    unit = kv.shape[2]
    extra = kv[newest_blocks.long()].transpose(1, 2).contiguous()       # (R, unit, 2, Hkv, D)
    extra_lens = ((seq_lens.long() - 1) % unit + 1).to(torch.int32)
    if work is None:
        return reference.sparse_decode_attention(q, kv, locs, units, seq_lens, scale, extra,
                                                 extra_lens, out)
    live = torch.nonzero(seq_lens > 0)[:, 0]         # the other rows are another call's
    out[live] = reference.sparse_decode_attention(
        q[live], kv, locs[live], units[live], seq_lens[live], scale, extra[live],
        extra_lens[live]).to(out.dtype)
    return out
