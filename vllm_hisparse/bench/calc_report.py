"""`hisparse calc`'s text report of a GQA (Quest) config: what bench/calc.py computed, line by line
(``--json`` prints the same figures as one object)."""
from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20


def gib_str(x: int) -> str:
    """Bytes as MiB below 1 GiB, else GiB, 3 decimals."""
    return f"{x / MIB:.3f} MiB" if 0 < abs(x) < GIB else f"{x / GIB:.3f} GiB"


def report(args, r: dict) -> None:
    """Print calc's result ``r`` for the parsed arguments ``args``."""
    b, h, mml = r["baseline"], r["hisparse"], r["max_model_len"]
    tp = r["tensor_parallel_size"]
    per_gpu = f" per GPU x {tp} GPUs" if tp > 1 else ""
    print(f"context {args.context} tokens (max_model_len {mml}), B={args.buffer}, top_k={args.top_k}, "
          f"page {args.page_size}, GPU KV {args.gpu_kv_gib} GiB{per_gpu}, host pool "
          f"{h['host_pool_bytes_per_rank'] * tp / GIB:.2f} GiB"
          + (" (auto)" if "host_pool_gib" in h["auto"] else "")
          + (f" ({gib_str(h['host_pool_bytes_per_rank'])} pinned by each of {tp} ranks)" if tp > 1 else "")
          + f", KV {r['kv_cache_dtype']} ({r['kv_dtype_bytes']} B/value; Quest bounds "
            f"{r['dtype_bytes']} B)")
    print(f"{'':10s} {'GPU/request' if tp == 1 else 'GPU/req/GPU':>14s} {'host/request':>14s} "
          f"{'max requests':>13s}  bound by")
    for name, v in (("baseline", b), ("hisparse", h)):
        print(f"{name:10s} {gib_str(v['gpu_bytes_per_request']):>14s} {gib_str(v['host_bytes_per_request']):>14s}"
              f" {v['max_requests']:13d}  {v['bound_by']}")
    never = r["min_context"] > mml
    if never:
        print(f"hisparse: max_model_len {mml} < min_context {r['min_context']}: no request can "
              f"turn sparse, so vLLM's own attention backend serves this server (stock vLLM: no "
              f"Quest row, pool or host tier) -> KV cache {gib_str(h['kv_cache_bytes'])}, "
              f"{h['num_blocks']} blocks")
    else:
        how = ("auto, as the server sizes it: core/auto_size.py" if "quest_rows" in h["auto"] else
               "--quest-rows" if args.quest_rows else
               "--max-num-seqs" if args.max_num_seqs is not None else
               "the most that fit: pass it as the hisparse quest_rows")
        print(f"hisparse Quest bounds: {gib_str(h['quest_meta_bytes_per_request'])} per row x "
              f"({h['quest_rows']} + 1 scratch) rows ({how}) = {gib_str(h['quest_meta_bytes'])} out "
              f"of the KV budget -> KV cache {gib_str(h['kv_cache_bytes'])}, {h['num_blocks']} "
              f"blocks")
        dense = (f"the {args.dense_layers} dense layers also keep every page in a "
                 f"{gib_str(h['dense_pool_bytes'])} GPU dense pool ({h['dense_pool_pages']} pages, "
                 f"{gib_str(h['dense_pool_bytes_per_request'])} per request)"
                 if h["dense_pool_bytes"] else
                 "dense layers read given-back pages from the host (no --dense-pool-gib)")
        print(f"hisparse keeps S+1 = {args.buffer // args.page_size + 1} blocks per request in all "
              f"layers; {dense}; the host pool holds "
              f"{'the sparse layers' if h['dense_pool_bytes'] else 'every layer'} "
              f"({h['host_pool_pages']} pages)")
    g = h["gpu_bound"]
    print(f"GPU bound: {g['requests']} = 1 + (blocks {g['num_blocks']} - 1 null - "
          f"{g['admit_blocks']} for the last one admitted (peak {g['peak_blocks']} + watermark "
          f"{g['watermark_blocks']}{' + 1' if g['admit_blocks'] > g['peak_blocks'] + g['watermark_blocks'] else ''})"
          f") // {g['floor_blocks']} blocks per running request"
          + (f"; the KV manager spills to keep R {g['spill_reserve_blocks']} free (cdiv("
             f"{g['max_num_batched_tokens']}, {args.page_size}) + max_num_seqs + watermark), which "
             f"admission does not wait for" if g["spill_reserve_blocks"] else ""))
    if h["quest_rows_warning"]:
        print(h["quest_rows_warning"]["text"])
    if h["sparse"] and args.prompt is not None and args.prompt < args.context:
        print(f"a {args.prompt}-token prompt with {args.context - args.prompt} output tokens "
              f"holds up to {h['peak_blocks_per_request']} blocks (before it turns sparse at "
              f"min_context, or during its prefill), S+1 afterwards")
        if g["peak_together_requests"] is not None and g["peak_blocks"] > g["floor_blocks"]:
            print(f"sent together, such requests reach that peak together: "
                  f"{g['peak_together_requests']} fit at once (blocks {g['num_blocks']} - 1 null) "
                  f"// {g['peak_blocks']}; more are preempted on the way unless they arrive spread "
                  f"out (a min_context nearer B lowers the peak)")
    elif not h["sparse"]:
        print(f"a request of {args.context} tokens stays resident (below min_context "
              f"{r['min_context']}): "
              f"every page on the GPU, no host pages, no Quest row")
    if not h["prefill_fits"]:
        print(f"hisparse would not start: a max_model_len={mml} prompt does not fit the KV cache "
              f"during its prefill")
    if h["auto"]:
        ram = (f" and a host with {h['host_ram_bytes'] / GIB:.2f} GiB of RAM to give "
               f"(--host-ram-gib)" if h["host_ram_bytes"] is not None else "")
        print(f"auto sizes (from --gpu-kv-gib{ram}): "
              + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in h["auto"].items()))
    print(f"the server's line: {h['startup_line']}")
    for name, v in (("baseline", b), ("hisparse", h)):
        print(f"vLLM's lines, {name}: GPU KV cache size: {v['vllm_kv_cache_tokens']:,} tokens; "
              f"Maximum concurrency for {mml:,} tokens per request: {v['vllm_max_concurrency']:.2f}x")
    if h.get("hostless_requests"):
        mode = getattr(args, "hostless", "sparse")
        how = ("stock's outputs" if mode == "dense" else
               "each on a Quest row: the auto rows count them" if "quest_rows" in h["auto"] else
               "on idle Quest rows")
        print(f"hostless {mode}: {h['hostless_requests']} more requests run host-less "
              f"beside them (whole lives in the GPU blocks, {how}): "
              f"{h['max_requests'] + h['hostless_requests']} in all")
    if b["max_requests"]:
        n = h["max_requests"] + h.get("hostless_requests", 0)
        print(f"hisparse fits {n / b['max_requests']:.1f}x the requests of stock full KV")
