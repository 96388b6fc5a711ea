"""Question 2 of bench/dense_tune.py: does a row's decode attention output depend on the batch
it is computed in? For vLLM's FlashAttention with each num_splits of FA_SPLITS (0: its heuristic,
expected not invariant; fixed counts: the question), with our Triton kernel (ops/
triton_dense_decode.py, the module's current constants) beside it as a control that must be.

ROWS rows of random lengths (min_len .. max context) over random pages of the bench's cache, in one
call; then the same call again, each row alone, the rows permuted in one call, and the permuted rows
in calls of CHUNK: a row counts as equal where its output is bit-identical (``torch.equal``) to
its output in the first call. Also where vLLM's FlashAttention is imported and called (``load_fa``),
lazily: the Triton part runs without vLLM.
"""
from __future__ import annotations

import torch

from vllm_hisparse.ops import triton_dense_decode as td

ROWS = 32
CHUNK = 7
FA_SPLITS = (0, 1, 4, 8, 16, 32)      # 0: FlashAttention's heuristic (what stock vLLM runs)
CSV_FIELDS = ["impl", "num_splits", "rows", "repeat_equal", "alone_equal", "permuted_equal",
              "chunk_equal", "max_abs_diff", "invariant", "error"]


def load_fa():
    """vLLM's FlashAttention as fa(q, k, v, bt, seq, cu, max_k, scale, out, num_splits) -> out
    (as vllm/flash_dense.py calls it, one query per row), or None with the reason printed."""
    try:
        from vllm.v1.attention.backends.fa_utils import (flash_attn_varlen_func,
                                                          get_flash_attn_version)
        version = get_flash_attn_version()
    except Exception as e:  # noqa: BLE001 - no vLLM here: run without FlashAttention
        print(f"no FlashAttention ({type(e).__name__}: {e}); its rows are skipped", flush=True)
        return None
    print(f"FlashAttention version {version}", flush=True)

    def fa(q, k, v, bt, seq, cu, max_k, scale, out, num_splits):
        flash_attn_varlen_func(q=q, k=k, v=v, out=out, cu_seqlens_q=cu, max_seqlen_q=1,
                               seqused_k=seq, max_seqlen_k=max_k, softmax_scale=scale,
                               causal=True, block_table=bt, fa_version=version,
                               num_splits=num_splits)
        return out
    return fa


def check(attn, q: torch.Tensor, bt: torch.Tensor, seq: torch.Tensor, chunk: int = CHUNK,
          seed: int = 1) -> dict:
    """attn(q, bt, seq) -> a new (n, Hq, D) output of the rows given. Per way of batching, how
    many of the n rows keep the bits of the first full call."""
    n = q.shape[0]
    full = attn(q, bt, seq).clone()
    again = attn(q, bt, seq)
    alone = torch.cat([attn(q[r:r + 1], bt[r:r + 1], seq[r:r + 1]) for r in range(n)])
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(q.device)
    permuted = torch.empty_like(full)
    permuted[perm] = attn(q[perm], bt[perm], seq[perm])
    chunks = torch.empty_like(full)
    for i in range(0, n, chunk):
        idx = perm[i:i + chunk]
        chunks[idx] = attn(q[idx], bt[idx], seq[idx])
    res = {"rows": n}
    diff = 0.0
    for name, x in (("repeat", again), ("alone", alone), ("permuted", permuted),
                    ("chunk", chunks)):
        res[f"{name}_equal"] = sum(bool(torch.equal(x[r], full[r])) for r in range(n))
        diff = max(diff, float((x.float() - full.float()).abs().max()))
    res["max_abs_diff"] = f"{diff:.3g}"
    res["invariant"] = all(res[f"{k}_equal"] == n for k in ("repeat", "alone", "permuted", "chunk"))
    return res


def inputs(b, n: int, min_len: int, max_len: int, seed: int = 1):
    """n rows of random lengths in [min_len, max_len] over random pages of the bench b's cache
    (pages may repeat: attention does not care)."""
    g = torch.Generator().manual_seed(seed)
    W = -(-max_len // b.shape.page)
    seq = torch.randint(min_len, max_len + 1, (n,), generator=g, dtype=torch.int32)
    bt = torch.randint(0, b.pages, (n, W), generator=g, dtype=torch.int32)
    q = torch.randn(n, b.shape.hq, b.shape.d, generator=g).to(b.dtype)
    return q.to(b.device), bt.to(b.device), seq.to(b.device)


def triton_attn(b):
    return lambda q, bt, seq: td.dense_decode_attention(q, b.k, b.v, bt, seq, b.scale)


def fa_attn(b, fa, ns: int):
    def attn(q, bt, seq):
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return fa(q, b.k, b.v, bt, seq, cu, int(seq.max()), b.scale, torch.empty_like(q), ns)
    return attn


def run_all(b, fa, max_len: int, n_rows: int, min_len: int, emit) -> None:
    """The Triton control, then FlashAttention at each FA_SPLITS (fa None: the control only);
    emit(row) each."""
    q, bt, seq = inputs(b, n_rows, min(min_len, max_len), max_len)
    impls = [("triton", None, triton_attn(b))]
    if fa is not None:
        impls += [("fa", ns, fa_attn(b, fa, ns)) for ns in FA_SPLITS]
    for name, ns, attn in impls:
        row = {"impl": name, "num_splits": ns}
        try:
            row.update(check(attn, q, bt, seq))
        except Exception as e:  # noqa: BLE001 - reported in the row
            row.update(invariant=False, error=f"{type(e).__name__}: {str(e)[:200]}")
        emit(row)


def table(rows: list[dict]) -> str:
    """The verdicts as a printed table."""
    lines = [f"batch invariance: rows equal (bit for bit) to their output in the full call, of "
             f"{rows[0].get('rows', '?') if rows else '?'}",
             f"{'impl':<7} {'num_splits':>10} {'repeat':>6} {'alone':>5} {'permuted':>8} "
             f"{'chunks':>6} {'max|diff|':>9}  verdict"]
    for r in rows:
        ns = "-" if r["num_splits"] is None else r["num_splits"]
        verdict = ("INVARIANT" if r.get("invariant") else "not invariant") + (
            f" ({r['error']})" if r.get("error") else "")
        lines.append(f"{r['impl']:<7} {ns:>10} {r.get('repeat_equal', '-'):>6} "
                     f"{r.get('alone_equal', '-'):>5} {r.get('permuted_equal', '-'):>8} "
                     f"{r.get('chunk_equal', '-'):>6} {r.get('max_abs_diff', '-'):>9}  {verdict}")
    return "\n".join(lines)
