"""plan_full's host time at 32K (1 and 8 rows, all at the same length) per config, with the steady
plan (core/steady_step.py) on and off, a cProfile of each, and the host cost of the CUDA calls a
plan makes. No vLLM, no kernels: the runtime alone, 32 layers (one KV head of 64: a plan does
not depend on the head shape).

    PYTHONPATH=. python scripts/probes/plan_box.py [cuda|cpu] OUT_DIR
"""
import cProfile, pstats, sys, time, io, json, os
import torch
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.sparse_runtime import SparseRuntime
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
out = sys.argv[2] if len(sys.argv) > 2 else "/tmp"

CFGS = {
    "resident": dict(host_tier=False),
    "elastic": dict(host_tier=True, resident_first=True),
    "elastic-nodp": dict(host_tier=True, resident_first=True, dense_layers=(), dense_pool_gib=0),
    "hisparse": dict(host_tier=True, resident_first=False),
}

def make(kw, rows):
    base = dict(host_pool_gib=1, quest_rows=rows + 1, dense_pool_gib=0.5 * rows)
    base.update(kw)
    cfg = HiSparseConfig(**base)
    L, hkv, d, P, mml = 32, 1, 64, 16, 40960
    rt = SparseRuntime(cfg, L, hkv, d, torch.bfloat16, dev, rows + 1, mml, host_pages=2600 * rows)
    W = mml // P
    # (no request turns sparse mid-decode here: the caches are never read by a plan)
    rt.bind_kv_caches([torch.zeros(2, 2, P, hkv, d, dtype=torch.bfloat16, device=dev)
                       for _ in range(L)])
    return rt, W

res = {}
for rows, name, steady in [(r, c, st) for r in (1, 8) for c in CFGS for st in (True, False)]:
    rt, W = make(CFGS[name], rows)
    rt.steady.enabled = steady
    n = 32768
    ids = [f"r{i}" for i in range(rows)]
    for r in ids:
        rt.add(r, n)
    bt = torch.arange(1, W * rows + 1, dtype=torch.int32, device=dev).view(rows, W)
    qsl = [i * n for i in range(rows + 1)]
    rt.plan(ids, qsl, [n] * rows, bt, torch.arange(n * rows, device=dev))
    seq = n
    N = 1 << (rows - 1).bit_length()
    for i in range(30):
        seq += 1; rt.plan_full(ids, [seq] * rows, N, bt)
    if dev == "cuda": torch.cuda.synchronize()
    ts = []
    for i in range(300):
        seq += 1
        t0 = time.perf_counter(); rt.plan_full(ids, [seq] * rows, N, bt); ts.append(time.perf_counter() - t0)
    ts.sort()
    pr = cProfile.Profile(); pr.enable()
    for i in range(300):
        seq += 1; rt.plan_full(ids, [seq] * rows, N, bt)
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    key = f"{name}-{rows}" + ("" if steady else "-nosteady")
    res[key] = dict(mean_us=sum(ts) / len(ts) * 1e6, median_us=ts[len(ts) // 2] * 1e6,
                    p10_us=ts[len(ts) // 10] * 1e6, p90_us=ts[9 * len(ts) // 10] * 1e6)
    print(key, json.dumps({k: round(v, 1) for k, v in res[key].items()}), flush=True)
    open(f"{out}/cprofile-{key}.txt", "w").write(s.getvalue())

# CUDA primitive costs (host µs per call)
if dev == "cuda":
    def tm(f, n=2000):
        for _ in range(50): f()
        t0 = time.perf_counter()
        for _ in range(n): f()
        return (time.perf_counter() - t0) / n * 1e6
    pin = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(4096, dtype=torch.uint8, device="cuda")
    ev = torch.cuda.Event(); ev.record()
    cpu = torch.zeros(512, dtype=torch.int64)
    prim = {
        "torch.empty cuda": tm(lambda: torch.empty(512, dtype=torch.int64, device="cuda")),
        "event.query": tm(lambda: ev.query()),
        "event.record": tm(lambda: ev.record()),
        "pinned copy_ 4KB": tm(lambda: pin[:4096].copy_(cpu.view(torch.uint8))),
        "h2d non_blocking 4KB": tm(lambda: d.copy_(pin, non_blocking=True)),
        "torch.tensor small list": tm(lambda: torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int64)),
        "is_current_stream_capturing": tm(lambda: torch.cuda.is_current_stream_capturing()),
        "python loop 1000 adds": tm(lambda: sum(range(1000)), 500),
    }
    for k, v in prim.items():
        print(f"prim {k}: {v:.2f} us", flush=True)
    res["prim"] = prim
json.dump(res, open(f"{out}/plan_box.json", "w"), indent=1)
