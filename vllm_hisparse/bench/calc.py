"""`hisparse calc`: how many requests of a given context fit, stock full KV vs hisparse.

    hisparse calc --model CONFIG_DIR_OR_JSON --context 32768 --top-k 2048 --buffer 4096 \
        --gpu-kv-gib 40 --host-gib 100 [--page-size 16 --dtype bf16 --dense-layers 2] [--json]
"""
from __future__ import annotations

import json

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import capacity as cap

GIB = 1 << 30


def add_arguments(p):
    p.add_argument("--model", required=True, help="HF model directory or config.json")
    p.add_argument("--context", type=int, required=True, help="tokens per request (prompt + output)")
    p.add_argument("--top-k", type=int, default=2048, help="tokens attended per step (default 2048)")
    p.add_argument("--buffer", type=int, default=4096, help="hot-buffer tokens B (default 4096)")
    p.add_argument("--gpu-kv-gib", type=float, required=True, help="GPU memory for KV cache, GiB")
    p.add_argument("--host-gib", type=float, required=True, help="host pool size, GiB")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page/block (default 16)")
    p.add_argument("--dtype", default=None, help="KV dtype (default: the model's, else bf16)")
    p.add_argument("--dense-layers", type=int, default=2,
                   help="layers kept fully resident and dense (default 2, as Quest)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def compute(args) -> dict:
    HiSparseConfig(top_k=args.top_k, device_buffer_size=args.buffer, page_size=args.page_size,
                   host_pool_gib=args.host_gib, dense_layers=tuple(range(args.dense_layers)))
    m = cap.ModelShape.from_hf_config(args.model, args.dtype)
    if args.dense_layers > m.num_layers:
        raise SystemExit(f"--dense-layers {args.dense_layers} exceeds the model's {m.num_layers} layers")
    gpu, host = args.gpu_kv_gib * GIB, args.host_gib * GIB
    b_gpu = cap.baseline_gpu_bytes(m, args.context, args.page_size)
    n_b, by_b = cap.max_requests(gpu, b_gpu)
    h_gpu = cap.hisparse_gpu_bytes(m, args.context, args.buffer, args.page_size, args.dense_layers)
    h_host = cap.hisparse_host_bytes(m, args.context, args.page_size, args.dense_layers)
    n_h, by_h = cap.max_requests(gpu, h_gpu, host, h_host)
    return {
        "baseline": {"gpu_bytes_per_request": b_gpu, "host_bytes_per_request": 0,
                     "max_requests": n_b, "bound_by": by_b},
        "hisparse": {"gpu_bytes_per_request": h_gpu, "host_bytes_per_request": h_host,
                     "max_requests": n_h, "bound_by": by_h},
    }


def run(args) -> int:
    r = compute(args)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"context {args.context} tokens, B={args.buffer}, top_k={args.top_k}, "
          f"GPU KV {args.gpu_kv_gib} GiB, host pool {args.host_gib} GiB")
    print(f"{'':10s} {'GPU/request':>14s} {'host/request':>14s} {'max requests':>13s}  bound by")
    for name, v in r.items():
        print(f"{name:10s} {v['gpu_bytes_per_request'] / GIB:11.3f} GiB {v['host_bytes_per_request'] / GIB:10.3f} GiB"
              f" {v['max_requests']:13d}  {v['bound_by']}")
    b, h = r["baseline"]["max_requests"], r["hisparse"]["max_requests"]
    if b:
        print(f"hisparse fits {h / b:.1f}x the requests of stock full KV")
    return 0
