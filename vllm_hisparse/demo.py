"""`hisparse demo --core`: the core on a built-in example, no vLLM needed.

A few requests of one layer decode with Quest selection through host pool + hot buffer + resolve;
every step's attention is checked bit for bit against the same attention over a fully resident KV,
and the hot-buffer hit rate is printed.
"""
from __future__ import annotations

import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.hot_buffer import HotBufferState, fetch_misses, resolve, write_resident
from vllm_hisparse.ops import reference as ref


def add_arguments(p):
    p.add_argument("--core", action="store_true", help="run the core-only example (no vLLM)")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="decode steps")
    p.add_argument("--config", default='{"top_k": 256, "device_buffer_size": 512, "page_size": 16}',
                   help="hisparse config (JSON string or file)")


def run(args) -> int:
    return run_core(args)


def run_core(args) -> int:
    cfg = HiSparseConfig.load(args.config)
    g = torch.Generator().manual_seed(0)
    R, unit, H, G, D = args.requests, cfg.page_size, 2, 4, 64
    U = -(-(args.context + args.steps) // unit)
    S, k = cfg.num_slots, cfg.top_k_units
    pool = HostKVPool(1, R * U, unit, H, D, dtype=torch.float32, pin=False)
    full = torch.zeros(R * U, 2, unit, H, D)
    state = HotBufferState.create(R, S, U, cfg.policy)
    buf = torch.zeros(R * S, 2, unit, H, D)
    slot_map = torch.arange(R * S, dtype=torch.int32).view(R, S)
    kmin, kmax = torch.zeros(R, U, H, D), torch.zeros(R, U, H, D)
    # Keys drift slowly along the sequence so that neighbouring steps pick similar pages.
    drift = torch.randn(U, H, D, generator=g).cumsum(0) * 0.02

    def write(r, pos):
        n = len(pos)
        kk = torch.randn(n, H, D, generator=g) + drift[pos // unit]
        vv = torch.randn(n, H, D, generator=g)
        pool.ensure(r, int(pos.max()) + 1)
        pool.write(r, 0, pos, kk, vv)
        full[r * U + pos // unit, 0, pos % unit] = kk
        full[r * U + pos // unit, 1, pos % unit] = vv
        write_resident(state, buf, slot_map, torch.full((n,), r), pos, kk, vv)
        ref.quest_update(kmin, kmax, torch.full((n,), r), pos, kk, unit)

    lens = torch.full((R,), args.context)
    for r in range(R):
        write(r, torch.arange(args.context))
    print(f"core demo: {R} requests x {args.context} tokens, top_k={cfg.top_k} tokens "
          f"({k} pages of {unit}), B={cfg.device_buffer_size} tokens, policy={cfg.policy}")
    hits = total = 0
    for step in range(args.steps):
        for r in range(R):
            write(r, lens[r:r + 1].clone())
        lens += 1
        q = 2 * torch.randn(R, H * G, D, generator=g) + drift[(lens - 1) // unit].repeat_interleave(G, 1)
        sel = torch.empty(R, k, dtype=torch.int32)
        ref.quest_select(ref.quest_scores(q, kmin, kmax, (lens + unit - 1) // unit), lens, unit, sel)
        locs, miss = resolve(state, sel)
        fetch_misses(buf, slot_map, locs, miss, sel,
                     lambda rr, uu: torch.stack([pool.data[0, pool.page_table(int(a))[int(b)]]
                                                 for a, b in zip(rr, uu)]))
        phys = torch.where(locs >= 0, torch.gather(slot_map.long(), 1, locs.clamp(min=0)), -1).int()
        res = torch.where(sel >= 0, torch.arange(R)[:, None] * U + sel, -1).int()
        a = ref.sparse_decode_attention(q, buf, phys, sel, lens.int(), D ** -0.5)
        b = ref.sparse_decode_attention(q, full, res, sel, lens.int(), D ** -0.5)
        if not torch.equal(a, b):
            print(f"step {step}: MISMATCH between hisparse and resident attention")
            return 1
        n_sel, n_miss = int((sel >= 0).sum()), int(miss.sum())
        hits, total = hits + n_sel - n_miss, total + n_sel
        if step < 4 or step == args.steps - 1:
            print(f"step {step:3d}: selected {n_sel} pages, misses {n_miss:4d}, "
                  f"hit rate {1 - n_miss / n_sel:.1%}  (bit-identical to resident: yes)")
    gpu = R * S * unit
    print(f"overall hit rate {hits / total:.1%} after warm-up misses; hot buffer {gpu} tokens on the "
          f"'GPU' vs {int(lens.sum())} resident; host pool pages used {pool.used_pages}")
    return 0
