"""The DSA path's in-engine exactness check (``HISPARSE_TEST_SHADOW=1``; test-only, refused by
``vllm serve`` as the negative control is): beside the hisparse runtime, a resident twin
(``LatentRuntime`` with every admitted request in a full-length region, no host pool) gets the same
events, plans, writes and selections, and at every layer of every step the rows the hisparse
conversion hands each decode token (hot slots, after RESOLVE and its host fetches) are compared
byte for byte with the rows the twin hands it for the same selection, and their -1 pattern too.

Why: two runs of the DSA test model with attention that matters do not reproduce each other on the
GPU (docs/gpu-results.md, 2026-12-06, fifth box), so comparing a hisparse engine's tokens with a
resident engine's cannot tell hisparse's errors from the model's run-to-run noise. Inside one engine
both sides see the same q, the same indexer top-k, the same new rows: a difference can only be
hisparse's. Equal rows in equal order give equal attention (the same kernel reads the same values
in the same order). ``counts`` = [decode tokens compared, tokens with a differing row or pattern],
on the device (no sync; ``LatentRuntime.stats`` reads them). Costs the twin's regions
(``row_sets x max_model_len`` rows a layer) and a gather of the compared rows a layer.
"""
from __future__ import annotations

import torch

from vllm_hisparse.knobs import env_flag

SHADOW_ENV = "HISPARSE_TEST_SHADOW"


def shadow_on() -> bool:
    """The in-engine check's knob (read when the runtime is built)."""
    return env_flag(SHADOW_ENV, False,
                    on="a resident twin of the DSA runtime checks every decode token's rows "
                       "(test-only: its own full-length regions)",
                    off="no twin")


def compare_rows(counts: torch.Tensor, toks: torch.Tensor, out_h: torch.Tensor,
                 rows_h: torch.Tensor, out_r: torch.Tensor, rows_r: torch.Tensor) -> None:
    """Add to counts (2,) int64: the tokens ``toks`` (E,) int64 (>= T: padding, skipped) compared,
    and those whose pool rows differ between out_h (T, K) into rows_h (M, W) and out_r (T, K)
    into rows_r (M', W) in bytes or in where they are -1. Fixed shapes, no host sync."""
    T = out_h.shape[0]
    if T == 0 or toks.numel() == 0:
        return
    live = toks < T
    t = toks.clamp(max=T - 1)
    a, b = out_h[t], out_r[t]                                    # (E, K)
    ok_a, ok_b = a >= 0, b >= 0
    ra = rows_h[a.clamp(min=0).long()]
    rb = rows_r[b.clamp(min=0).long()]
    differ = (ra != rb).reshape(*a.shape, -1).any(-1)            # (E, K)
    bad = (ok_a != ok_b).any(1) | (differ & ok_a & ok_b).any(1)
    counts[0] += live.sum()
    counts[1] += (bad & live).sum()
