"""`hisparse calc`: how many requests of a given context fit, stock full KV vs hisparse as the engine
implements it today (the formulas and what they model: ``vllm_hisparse.core.capacity``).

    hisparse calc --model CONFIG_DIR_OR_JSON --context 32768 --top-k 2048 --buffer 4096 \
        --gpu-kv-gib 40 --host-gib 100 [--page-size 16 --dtype bf16 --kv-cache-dtype fp8 \
        --dense-layers 2 \
        --max-num-seqs N --max-model-len M --min-context C --max-num-batched-tokens T \
        --no-resident-first] [--json]

``--buffer auto`` picks the largest B that keeps as many requests as B = 2 x top_k.

It also prints the two capacity lines vLLM logs at startup ("GPU KV cache size", "Maximum
concurrency"), computed the way vLLM computes them, so the two can be compared line by line.
A config with ``kv_lora_rank`` (MLA) and ``index_topk`` (DSA: DeepSeek-V3.2) goes to
bench/calc_mla.py: stock FLASH_ATTN_MLA_SPARSE vs the design of docs/dsa.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.bench import calc_mla, calc_report
from vllm_hisparse.bench.calc_args import (_opt, add_arguments, kv_dtype_bytes,  # noqa: F401
                                            machine)
from vllm_hisparse.bench.calc_report import gib_str as _gib
from vllm_hisparse.core import capacity as cap
from vllm_hisparse.core.auto_size import host_rank_room
from vllm_hisparse.core.deployment import EngineLimits, resolve
from vllm_hisparse.core.residency import may_turn_sparse

GIB = 1 << 30

def _hf_config(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"--model {path}: no config.json there (give a HF model directory "
                         f"or its config.json)") from None


def compute(args) -> dict:
    hf = _hf_config(args.model)
    if args.buffer == "auto":
        return _auto_buffer(args, hf)
    return _compute(args, hf)


def _auto_buffer(args, hf: dict) -> dict:
    """The largest B, a multiple of the page from 2 x top_k up to max_model_len, at which max
    requests are still those at 2 x top_k (the first B that loses one ends the search)."""
    P, mml = args.page_size, args.max_model_len or args.context
    first = cap.cdiv(2 * args.top_k, P) * P
    # min_context follows B when unset: pin the reference's, so the sweep keeps which requests
    # are sparse
    mc = args.min_context if args.min_context is not None else HiSparseConfig(
        top_k=args.top_k, device_buffer_size=first, page_size=P).min_context_tokens

    def at(b: int) -> dict:
        return _compute(argparse.Namespace(**{**vars(args), "buffer": b, "min_context": mc}), hf)

    best, r = first, at(first)
    want = r["hisparse"]["max_requests"]
    if want == 0:
        raise SystemExit(f"--buffer auto: not one request fits at B = 2 x top_k = {first}; raise "
                         f"--gpu-kv-gib / --host-gib or lower --context")
    for b in range(first + P, mml + 1, P):
        rb = at(b)
        if rb["hisparse"]["max_requests"] < want:
            break
        best, r = b, rb
    r["buffer"], r["buffer_auto"] = best, {"buffer": best, "num_slots": best // P, "max_requests": want,
                        "reference_buffer": first, "capped": best + P > mml}
    return r


def _compute(args, hf: dict) -> dict:
    kv_dtype = getattr(args, "kv_cache_dtype", "auto")
    if (args.dtype or "").lower().startswith("fp8"):
        raise SystemExit(f"--dtype {args.dtype}: --dtype is the model dtype (the Quest bounds stay "
                         f"in it); for an fp8 KV cache pass --kv-cache-dtype fp8")
    if "kv_lora_rank" in hf:
        if kv_dtype not in ("auto", "fp8_ds_mla"):
            raise SystemExit(f"--kv-cache-dtype {kv_dtype}: an MLA/DSA model's latent is auto "
                             f"(the model dtype) or fp8_ds_mla (656 B rows)")
        if args.host_gib == "auto":      # the RAM share, as core/deployment._latent_sizes
            room = host_rank_room(machine(args, 0, args.tensor_parallel_size))
            if room <= 0:
                raise SystemExit("--host-gib auto: the host has no RAM to give; pass --host-gib")
            args.host_gib = int(room * args.tensor_parallel_size / GIB * 100) / 100   # 0.01 GiB
        return calc_mla.compute(args, hf)
    if kv_dtype == "fp8_ds_mla":
        raise SystemExit("--kv-cache-dtype fp8_ds_mla: the latent format of MLA + DSA models "
                         "(kv_lora_rank in config.json); for a GQA/MHA model pass fp8")
    mml = args.max_model_len or args.context
    asked = HiSparseConfig(top_k=args.top_k, device_buffer_size=args.buffer,
                           page_size=args.page_size, host_pool_gib=_opt(args.host_gib),
                           dense_layers=tuple(range(args.dense_layers)),
                           min_context=args.min_context, dense_pool_gib=_opt(args.dense_pool_gib),
                           quest_rows=_opt(args.quest_rows), resident_first=args.resident_first,
                           hostless=getattr(args, "hostless", "sparse"))
    try:
        m = cap.ModelShape.from_hf_config(hf, args.dtype)
    except (ValueError, KeyError) as e:
        raise SystemExit(f"--model {args.model}: {e}") from None
    tp = args.tensor_parallel_size
    if tp < 1 or (m.num_kv_heads % tp and tp % m.num_kv_heads):
        raise SystemExit(f"--tensor-parallel-size {tp}: vLLM splits the model's {m.num_kv_heads} "
                         f"KV heads over the ranks; use a divisor or a multiple of it")
    # from here on, m is one rank's shape (its KV heads) at the KV cache's width (fp8: 1 byte):
    # every GPU figure is per GPU; the Quest bounds stay at the model dtype's (engine below)
    model_bytes, kv_bytes = m.dtype_bytes, kv_dtype_bytes(kv_dtype, m.dtype_bytes)
    m = cap.ModelShape(m.num_layers, cap.rank_kv_heads(m.num_kv_heads, tp), m.head_dim, kv_bytes)
    if args.dense_layers > m.num_layers:
        raise SystemExit(f"--dense-layers {args.dense_layers} exceeds the model's {m.num_layers} layers")
    if args.context > mml:
        raise SystemExit(f"--context {args.context} exceeds --max-model-len {mml}")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise SystemExit(f"--max-num-seqs {args.max_num_seqs}: use 1 or more, or leave it out")
    P, seqs, gpu = args.page_size, args.max_num_seqs, int(args.gpu_kv_gib * GIB)
    # the auto sizes first, as the server resolves them (core/auto_size.py); then as if given
    engine = EngineLimits(m.num_layers, mml, 0, m.num_kv_heads, m.head_dim, model_bytes, tp,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          watermark=args.watermark, kv_dtype_bytes=kv_bytes)
    sized = resolve(asked, dataclasses.replace(engine, max_num_seqs=seqs or 0,
                                               machine=machine(args, gpu, tp)))
    cfg, S = sized.cfg, sized.cfg.num_slots
    quest_rows = cfg.quest_rows or None        # 0 (= max_num_seqs): as unset below
    host = cap.host_pool_rank_bytes(cfg.host_pool_bytes, tp)
    prompt = args.context if args.prompt is None else args.prompt
    if not 0 < prompt <= args.context:
        raise SystemExit(f"--prompt {prompt}: use 1..--context ({args.context}), or leave it out")
    # the connector's admission rule: sparse at some step of its life
    sparse = may_turn_sparse(cfg, prompt, args.context - prompt)

    def vllm_lines(blocks: int, blocks_per_req_at_mml: int) -> dict:
        conc = cap.vllm_max_concurrency(blocks, blocks_per_req_at_mml)
        return {"vllm_max_concurrency": conc, "vllm_kv_cache_tokens": int(conc * mml)}

    # stock: the whole budget is KV; the last request admitted wants vLLM's watermark free too
    b_blocks, b_bpr = cap.num_blocks(gpu, m, P), cap.baseline_blocks(args.context, P)
    # (a stock request never shrinks: the last one needs its whole context too)
    n_b, by_b = cap.max_requests({"gpu": cap.gpu_requests(
        b_blocks, b_bpr, b_bpr + cap.watermark_blocks(b_blocks, args.watermark)),
        "max_num_seqs": seqs})
    baseline = {"gpu_bytes_per_request": cap.baseline_gpu_bytes(m, args.context, P),
                "host_bytes_per_request": 0, "max_requests": n_b, "bound_by": by_b,
                "kv_cache_bytes": gpu, "num_blocks": b_blocks,
                **vllm_lines(b_blocks, cap.baseline_blocks(mml, P))}

    # hisparse: the engine's own sizing (core/deployment.py) on this rank's shape; the Quest rows
    # are max_num_seqs here (quest_rows 0), so a deployment per candidate row count
    def deployment(rows: int):
        return resolve(cfg.with_sizes(quest_rows=0), dataclasses.replace(engine,
                                                                         max_num_seqs=rows))

    dep = deployment(0)
    row = dep.indexer_row_bytes                        # KV budget minus the Quest rows
    h_bpr = cap.hisparse_blocks(args.context, P, S, sparse)
    host_layers = len(dep.host_layers)                 # the sparse ones with a dense pool
    possible = dep.sparse_possible
    if not possible:                   # no host pool is pinned: nothing would ever use it
        host = 0
    host_pages = dep.host_pages
    h_pages = cap.hisparse_host_pages(args.context, P, sparse)
    n_host = host_pages // h_pages if h_pages else None
    # the GPU pools: none when no request can turn sparse; else the dense pool
    # (cfg.uses_dense_pool) is dense_pool_gib, at most what the Quest rows' requests can fill; a
    # sparse request takes as many pages there (its dense layers) as in the host pool

    def dense_pool(rows: int) -> tuple[int, int | None, int | None]:
        d = deployment(rows)
        pages = d.dense_pool_pages
        n = pages // h_pages if pages is not None and h_pages else None
        return d.dense_pool_bytes, pages, n

    dense_bytes, dense_pages, n_dense = dense_pool(1 << 40)     # dense_pool_gib (not yet capped)
    n_pools = min((x for x in (n_host, n_dense) if x is not None), default=None)
    gpu_kv = gpu - dense_bytes

    # the GPU bound (cap.gpu_requests): N-1 requests at h_bpr, the last admitted at its peak +
    # vLLM's watermark; resident_first: + the connector's 1 (a sparse request only: nothing else
    # spills); R is reported beside it (admission does not wait for it)
    peak = cap.hisparse_peak_blocks(prompt, args.context, P, S, cfg.min_context_tokens, sparse)
    spills = args.resident_first and sparse

    def gpu_terms(nb: int, max_num_seqs: int) -> dict:
        wm = cap.watermark_blocks(nb, args.watermark)
        return {"num_blocks": nb, "floor_blocks": h_bpr, "peak_blocks": peak, "watermark_blocks": wm,
                "admit_blocks": peak + wm + int(spills),
                # short prompts growing to min_context (None: the peak is a prefill, one at a time)
                "peak_together_requests": cap.peak_together_requests(nb, peak)
                if sparse and prompt < cfg.min_context_tokens else None,
                "spill_reserve_blocks": cap.spill_reserve_blocks(
                    args.max_num_batched_tokens, max_num_seqs, P, wm) if spills else 0}

    def fit_gpu(kv: int, max_num_seqs: int) -> int:
        nb = cap.num_blocks(kv, m, P)
        if not cap.hisparse_prefill_fits(nb, mml, P):
            return 0
        t = gpu_terms(nb, max_num_seqs)
        return cap.gpu_requests(nb, h_bpr, t["admit_blocks"])

    # Quest rows: quest_rows, else max_num_seqs, else the most that fit (+ one scratch row)
    auto = quest_rows is None and seqs is None and possible
    # no request can turn sparse: vLLM's own backend serves (setup_check.serve_as_stock), so not
    # even the scratch row is reserved: stock's KV
    scratch = int(possible)
    if not possible:
        n_seqs = 0
    elif quest_rows is not None:
        n_seqs = quest_rows
    elif seqs is None:
        n_seqs = cap.auto_max_num_seqs(gpu_kv - row, row, lambda kv, n: min(
            fit_gpu(kv, n), n_pools if n_pools is not None else 1 << 62))
    else:
        n_seqs = seqs
    # the max_num_seqs calc says to pass: the rows, or the room core/deployment.py counts when
    # that is more (host-less requests with no row, hostless "dense")
    vllm_seqs = (seqs if seqs is not None else max(n_seqs, sized.room()[0]) if cfg.quest_rows
                 else n_seqs)

    def at_rows(rows: int) -> tuple[int, dict]:
        """KV bytes and the limits other than the Quest rows with ``rows`` rows reserved."""
        d_bytes, _, n_d = dense_pool(rows)                      # what `rows` rows can fill
        kv_ = gpu if args.explicit_kv else gpu - d_bytes - (rows + scratch) * row
        return kv_, {"gpu": fit_gpu(kv_, vllm_seqs), "host": n_host, "dense_pool": n_d,
                     "max_num_seqs": seqs}

    dense_bytes, dense_pages, n_dense = dense_pool(n_seqs)
    kv, limits = at_rows(n_seqs)
    h_blocks = cap.num_blocks(kv, m, P)
    limits["quest_rows"] = n_seqs if possible else None
    if auto:               # n_seqs is the answer; say which resource stopped it growing
        n_h, by_h = n_seqs, ("host" if n_host is not None and n_seqs == n_host else
                             "dense_pool" if n_dense is not None and n_seqs == n_dense else "gpu")
    else:
        n_h, by_h = cap.max_requests(limits)
    # Quest rows beyond what the other limits admit: reserved, never used
    rows_warning = None
    if possible and n_h < n_seqs:
        fit_rows = n_h                    # the most rows that all fit once the rest is given back
        while fit_rows < n_seqs and fit_rows + 1 <= min(
                v for v in at_rows(fit_rows + 1)[1].values() if v is not None):
            fit_rows += 1
        unused = at_rows(n_h)[0] - kv
        rows_warning = {"unused_rows": n_seqs - n_h, "unused_bytes": unused,
                        "set_quest_rows": fit_rows, "text": (
            f"warning: {n_seqs - n_h} of the {n_seqs} Quest rows are never used ({by_h} admits "
            f"{n_h} requests): they take {_gib(unused)} from the KV cache; set quest_rows to "
            f"{fit_rows} ({fit_rows} requests)")}
    # the server's own startup line for these settings (connector._log_room prints the same
    # Deployment.room_line): the sizes as given (auto included), max_num_seqs as calc says to
    # pass it
    server = resolve(asked, dataclasses.replace(engine, max_num_seqs=vllm_seqs,
                                                machine=machine(args, gpu, tp)))
    hisparse = {"gpu_bytes_per_request": cap.hisparse_gpu_bytes(m, args.context, P, S, sparse),
                "peak_blocks_per_request": cap.hisparse_peak_blocks(
                    prompt, args.context, P, S, cfg.min_context_tokens, sparse),
                "sparse": sparse,
                "host_bytes_per_request": tp * cap.hisparse_host_bytes(m, args.context, P, sparse,
                                                                       host_layers),
                "max_requests": n_h, "bound_by": by_h,
                "quest_meta_bytes_per_request": row, "quest_rows": n_seqs,
                "max_num_seqs": seqs if seqs is not None or not possible else vllm_seqs,
                "quest_meta_bytes": (n_seqs + scratch) * row, "kv_cache_bytes": kv,
                "num_blocks": h_blocks,
                "prefill_fits": cap.hisparse_prefill_fits(h_blocks, mml, P),
                "gpu_bound": {**gpu_terms(h_blocks, vllm_seqs), "requests": limits["gpu"],
                              "max_num_batched_tokens": args.max_num_batched_tokens,
                              "resident_first": args.resident_first, "watermark": args.watermark},
                "quest_rows_warning": rows_warning, "startup_line": server.room_line(),
                "host_pool_pages": host_pages, "host_pool_bytes_per_rank": host,
                "dense_pool_bytes": dense_bytes, "dense_pool_pages": dense_pages,
                "dense_pool_bytes_per_request": (h_pages * P * m.token_bytes_per_layer
                                                 * args.dense_layers if dense_bytes else 0),
                # HiSparseSpec.max_memory_usage_bytes: S+1 blocks (whatever the prompt) when some
                # request can turn sparse, else every page
                **vllm_lines(h_blocks, cap.hisparse_blocks(mml, P, S, possible))}
    # beyond the host tier, host-less requests of their whole life in the GPU blocks: the
    # server's L (its startup line's; None: not counted)
    extra = server.hostless_requests or 0
    hisparse["hostless_requests"] = extra
    if rows_warning and cfg.hostless == "sparse" and extra:      # those rows serve host-less ones
        used = n_h + extra
        hisparse["quest_rows_warning"] = None if used >= n_seqs else {
            "unused_rows": n_seqs - used, "unused_bytes": at_rows(used)[0] - kv,
            "set_quest_rows": used, "text": (
                f"warning: {n_seqs - used} of the {n_seqs} Quest rows are never used ({by_h} "
                f"admits {n_h} requests, {extra} more run host-less): they take "
                f"{_gib(at_rows(used)[0] - kv)} from the KV cache; set quest_rows to {used}")}
    hisparse["auto"] = {f: getattr(cfg, f) for f in sized.auto}
    hisparse["host_ram_bytes"] = (sized.limits.machine.host_available_bytes
                                  if "host_pool_gib" in sized.auto else None)
    return {"max_model_len": mml, "tensor_parallel_size": tp, "min_context": cfg.min_context_tokens,
            "buffer": args.buffer, "kv_cache_dtype": kv_dtype, "kv_dtype_bytes": kv_bytes,
            "dtype_bytes": model_bytes, "baseline": baseline,
            "hisparse": hisparse}


def run(args) -> int:
    r = compute(args)
    if args.json:
        print(json.dumps(r))
        return 0
    args.buffer = r.get("buffer", args.buffer)
    if "buffer_auto" in r:
        a = r["buffer_auto"]
        print(f"B=auto: {a['buffer']} tokens (S={a['num_slots']}): the largest hot buffer that keeps "
              f"{a['max_requests']} requests, as B = 2 x top_k = {a['reference_buffer']}; "
              + ("max_model_len caps it" if a["capped"] else
                 f"B = {a['buffer'] + args.page_size} keeps fewer"))
    if r.get("model") == "mla-dsa":
        calc_mla.report(args, r)
        return 0
    calc_report.report(args, r)
    return 0
