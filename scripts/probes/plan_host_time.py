"""Host time of the runtime's plan (and layers) per step for a dense-only batch of 40 one-token rows,
host tier on vs off, split dense decode off vs on — the Python cost alone (on the CPU the layers'
figures are the reference ops' compute, not launch cost). Uses the tests' Driver (tests/ on the path).

    python scripts/probes/plan_host_time.py [--device cuda]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from test_sparse_runtime_exact import Driver  # noqa: E402

from vllm_hisparse.config import HiSparseConfig  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cpu")
ap.add_argument("--rows", type=int, default=40)
ap.add_argument("--steps", type=int, default=20)
args = ap.parse_args()
for host_tier in (True, False):
    for split in (False, True):
        cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=8, min_context=10**6,
                             host_pool_gib=0.05, host_tier=host_tier, dense_layers=(0,),
                             split_dense_decode=split, dense_pool_gib=0.01 if host_tier else 0.0)
        gpu = args.device == "cuda"            # the GPU kernels' shapes: 8B attention, bf16
        d = Driver(cfg, rows=args.rows, shape=(8, 3, 40), device=args.device,
                   **({"dims": (32, 8, 128), "dtype": torch.bfloat16} if gpu else {}))
        ids = [f"r{i}" for i in range(args.rows)]
        for r in ids:
            d.add(r, 200)
        d.step({r: 200 for r in ids})
        for _ in range(3):
            d.step({r: 1 for r in ids})
        for k in d.rt._host_s:
            d.rt._host_s[k] = 0.0
        for _ in range(args.steps):
            d.step({r: 1 for r in ids})
        print(f"host_tier {host_tier} split {split}: ms per step",
              {k: round(v / args.steps * 1e3, 3) for k, v in d.rt._host_s.items() if v})
