"""`hisparse calc` for MLA models with a DSA indexer (DeepSeek-V3.2 style): stock
FLASH_ATTN_MLA_SPARSE vs the HiSparse design of docs/dsa.md (formulas: core/capacity_mla.py).
calc.py hands a config with ``kv_lora_rank`` here.

Every DSA request is sparse under that design (the indexer's top-k of a request shorter than
top_k is all of it, and B >= top_k keeps it resident), so min_context does not apply; the latent
is replicated on every tensor-parallel rank (MLA has one KV head), so GPU figures do not shrink
with --tensor-parallel-size and every rank pins its own host pool of --host-gib / N.
"""
from __future__ import annotations

from vllm_hisparse.bench.calc_report import gib_str as _gib
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import capacity as cap
from vllm_hisparse.core import capacity_mla as mla

GIB = 1 << 30


def compute(args, hf: dict) -> dict:
    try:
        m = mla.MLAShape.from_hf_config(hf, args.dtype, getattr(args, "kv_cache_dtype", "auto"))
    except (ValueError, KeyError) as e:
        raise SystemExit(f"--model {args.model}: {e}") from None
    mml = args.max_model_len or args.context
    if args.context > mml:
        raise SystemExit(f"--context {args.context} exceeds --max-model-len {mml}")
    cfg = HiSparseConfig(indexer="dsa", top_k=args.top_k, device_buffer_size=args.buffer,
                         page_size=args.page_size, host_pool_gib=args.host_gib, dense_layers=(),
                         min_context=0)
    tp, seqs = args.tensor_parallel_size, args.max_num_seqs
    gpu = int(args.gpu_kv_gib * GIB)
    host = cap.host_pool_rank_bytes(cfg.host_pool_bytes, tp)
    blocks = -(-mml // mla.MLA_BLOCK)                        # per request at max_model_len

    # stock: one KV-cache group of latent + indexer K
    b_blocks = mla.stock_num_blocks(gpu, m)
    b_bpr = -(-args.context // mla.MLA_BLOCK)
    n_b, by_b = cap.max_requests({"gpu": max(b_blocks - 1, 0) // b_bpr, "max_num_seqs": seqs})
    conc = b_blocks / blocks
    baseline = {"gpu_bytes_per_request": mla.stock_gpu_bytes(m, args.context),
                "host_bytes_per_request": 0, "max_requests": n_b, "bound_by": by_b,
                "kv_cache_bytes": gpu, "num_blocks": b_blocks, "block_bytes": mla.stock_block_bytes(m),
                "vllm_max_concurrency": conc, "vllm_kv_cache_tokens": int(conc * mml)}

    # hisparse: minus the prefill regions and one latent row set per request admitted at once
    newest = args.newest_rows
    row = mla.latent_row_set_bytes(m, args.buffer, newest, mml)
    fixed = args.prefill_slots * mla.prefill_region_bytes(m, mml)
    n_host = host // (-(-args.context // args.page_size) * mla.host_page_bytes(m, args.page_size))

    def fit_gpu(kv: int) -> int:
        return max(mla.hisparse_num_blocks(kv, m) - 1, 0) // b_bpr

    if seqs is None:
        n_seqs = cap.auto_max_num_seqs(gpu - fixed, row, lambda kv, _seqs: min(fit_gpu(kv), n_host))
        n_h = n_seqs
        by_h = "host" if n_seqs == n_host else "gpu"
    else:
        n_seqs = seqs
        n_h, by_h = cap.max_requests({"gpu": fit_gpu(gpu - fixed - n_seqs * row), "host": n_host,
                                      "max_num_seqs": seqs})
    kv = gpu - fixed - n_seqs * row
    h_blocks = mla.hisparse_num_blocks(kv, m)
    hconc = h_blocks / blocks
    hisparse = {"gpu_bytes_per_request": mla.hisparse_gpu_bytes(m, args.context, args.buffer,
                                                                newest, mml),
                "host_bytes_per_request": tp * mla.hisparse_host_bytes(m, args.context,
                                                                       args.page_size),
                "max_requests": n_h, "bound_by": by_h, "latent_rows_per_request": args.buffer + newest,
                "latent_row_set_bytes": row, "latent_row_sets": n_seqs,
                "prefill_region_bytes": fixed, "kv_cache_bytes": kv, "num_blocks": h_blocks,
                "block_bytes": mla.index_block_bytes(m), "host_pool_bytes_per_rank": host,
                "vllm_max_concurrency": hconc, "vllm_kv_cache_tokens": int(hconc * mml)}
    return {"model": "mla-dsa", "max_model_len": mml, "tensor_parallel_size": tp,
            "kv_cache_dtype": "fp8_ds_mla" if m.fp8_ds_mla else "auto",
            "num_layers": m.num_layers, "latent_bytes_per_token_layer": m.latent_bytes,
            "index_bytes_per_token_layer": m.index_bytes, "baseline": baseline,
            "hisparse": hisparse}


def report(args, r: dict) -> None:
    b, h = r["baseline"], r["hisparse"]
    print(f"MLA + DSA model, {r['num_layers']} layers: latent {r['latent_bytes_per_token_layer']} B "
          f"+ indexer K {r['index_bytes_per_token_layer']} B per token per layer; context "
          f"{args.context} (max_model_len {r['max_model_len']}), B={args.buffer}, "
          f"top_k={args.top_k}, GPU KV {args.gpu_kv_gib} GiB, host pool {args.host_gib} GiB")
    print(f"{'':10s} {'GPU/request':>14s} {'host/request':>14s} {'max requests':>13s}  bound by")
    for name, v in (("baseline", b), ("hisparse", h)):
        print(f"{name:10s} {_gib(v['gpu_bytes_per_request']):>14s} "
              f"{_gib(v['host_bytes_per_request']):>14s} {v['max_requests']:13d}  {v['bound_by']}")
    if r.get("kv_cache_dtype") == "fp8_ds_mla":
        print("fp8_ds_mla: stock FLASHMLA_SPARSE serves it; hisparse's rows are modelled at the "
              "same 656 B but not served yet (issue 46)")
    print(f"hisparse (docs/dsa.md): latent pool = {args.prefill_slots} prefill "
          f"region(s) {_gib(h['prefill_region_bytes'])} + {h['latent_row_sets']} row sets x "
          f"{h['latent_rows_per_request']} rows x {r['num_layers']} layers "
          f"({_gib(h['latent_row_set_bytes'])} each); vLLM keeps the indexer K: "
          f"{_gib(h['kv_cache_bytes'])}, {h['num_blocks']} blocks of 64 tokens")
    for name, v in (("baseline", b), ("hisparse", h)):
        print(f"vLLM's lines, {name}: GPU KV cache size: {v['vllm_kv_cache_tokens']:,} tokens; "
              f"Maximum concurrency for {r['max_model_len']:,} tokens per request: "
              f"{v['vllm_max_concurrency']:.2f}x")
    if b["max_requests"]:
        print(f"hisparse fits {h['max_requests'] / b['max_requests']:.1f}x the requests of stock")
