"""`hisparse calc`'s command line: its flags and their help (bench/calc.py computes, bench/
calc_report.py prints)."""
from __future__ import annotations

import argparse

from vllm_hisparse.core.auto_size import Machine

GIB = 1 << 30
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")  # GQA: what hisparse serves; MLA: 656 B rows

EPILOG = """\
--gpu-kv-gib is the KV memory a stock vLLM run gets on this GPU (its "Available KV cache memory"
line, or --kv-cache-memory-bytes). hisparse allocates its Quest page bounds for --max-num-seqs rows
(+ one scratch row) while the model is built, before vLLM profiles memory, so its KV cache gets that minus the
reservation. Without --max-num-seqs, calc picks the largest N such that N requests still fit once N
rows are reserved: pass that N to vLLM (its own default, 256, or 1024 on >=70 GiB GPUs, can
reserve more than the KV cache at long max_model_len). With an explicit N, N also caps both
backends' max requests (vLLM never runs more than max_num_seqs at once). A --max-model-len below
min_context is stock vLLM (no request can turn sparse: vLLM's own attention backend serves it,
setup_check.serve_as_stock), and the dense pool is at most the Quest rows' requests of
max_model_len tokens.

max requests counts decoding requests of --context tokens: whole blocks, vLLM's null block left out;
a hisparse request keeps S+1 = B/page+1 blocks in every layer after its prefill (dense layers
included: they are not kept resident yet) and all its pages during prefill. The GPU bound is the N
at which N-1 requests hold S+1 blocks while the last one admitted holds its peak (its whole prompt:
vLLM's scheduler_reserve_full_isl) + vLLM's watermark (+1 with resident_first: the connector's
admission_blocks): the engine's own admission. With resident_first the KV manager also tries to
keep R = cdiv(max_num_batched_tokens, page) + max_num_seqs + watermark blocks free by spilling
(connector.spill_reserve); admission does not wait for R, so it is reported, not subtracted.

--buffer auto: the largest B (a multiple of the page, up to max_model_len) whose max requests are
those at B = 2 x top_k: the GPU memory free at full capacity goes to a bigger hot buffer.

A request is sparse when its context (prompt + output) reaches min_context, whatever its prompt
(a short prompt turns sparse at the step its context does): then it holds host pages for its whole
context and a Quest row from admission on. With --prompt P shorter than min_context it holds every
page until then: "peak blocks" (per request; vLLM preempts when too many requests peak at once:
the report says how many fit when all of them hold that peak together, as requests sent at once do).

With --tensor-parallel-size N every GPU holds 1/N of the KV heads (or one head when there are fewer
heads than GPUs, as vLLM does): GPU bytes, blocks, Quest rows and vLLM's lines are per GPU, host
bytes per request are the engine's (all ranks), and each rank pins --host-gib / N."""


def add_arguments(p):
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", required=True, help="HF model directory or config.json")
    p.add_argument("--context", type=int, required=True,
                   help="tokens per request (prompt + output: max_tokens)")
    p.add_argument("--prompt", type=int, default=None,
                   help="prompt tokens of a request (default: --context): a prompt shorter than "
                        "min_context holds every page until its context reaches min_context")
    p.add_argument("--top-k", type=int, default=2048, help="tokens attended per step (default 2048)")
    p.add_argument("--buffer", type=_buffer, default=4096,
                   help="hot-buffer tokens B (default 4096), or auto: the largest B that keeps the "
                        "requests of B = 2 x --top-k")
    p.add_argument("--gpu-kv-gib", type=float, required=True,
                   help="KV memory a stock vLLM run gets, GiB (see below)")
    p.add_argument("--host-gib", type=_auto(float), default="auto",
                   help="host pool size, GiB (host_pool_gib; default auto: from --host-ram-gib, as "
                        "the server sizes it, core/auto_size.py)")
    p.add_argument("--host-ram-gib", type=float, default=None,
                   help="RAM the host can still give, GiB, that an auto host pool is sized from "
                        "(default: this machine's MemAvailable, or its container limit less use)")
    p.add_argument("--explicit-kv", action="store_true",
                   help="--gpu-kv-gib is an explicit KV cache size (vLLM's --kv-cache-memory-bytes, "
                        "VLLM_CPU_KVCACHE_SPACE): hisparse's reservations come on top of it")
    p.add_argument("--page-size", type=int, default=16,
                   help="tokens per page = vLLM block, both backends (default 16)")
    p.add_argument("--dtype", default=None,
                   help="model dtype: the KV cache's with --kv-cache-dtype auto, and always the "
                        "Quest bounds' (default: the model's, else bf16; fp8 is refused: use "
                        "--kv-cache-dtype)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="vLLM --kv-cache-dtype: fp8 (= fp8_e4m3) counts every KV tier (both "
                        "backends' GPU blocks, the host and dense pools) at 1 byte a value; the "
                        "Quest bounds stay in the model dtype (default auto: the model dtype); "
                        "fp8_ds_mla (MLA + DSA models only): 656 B latent rows in both backends' "
                        "tiers (FLASHMLA_SPARSE's format; not served by hisparse yet)")
    p.add_argument("--dense-layers", type=int, default=2,
                   help="how many leading layers attend densely (default 2, as Quest)")
    p.add_argument("--dense-pool-gib", type=_auto(float), default="auto",
                   help="hisparse dense_pool_gib: GPU pool keeping the dense layers of long requests "
                        "resident (0: they read the host pool; default auto: what the Quest rows' "
                        "requests fill)")
    p.add_argument("--quest-rows", type=_auto(int), default="auto",
                   help="hisparse quest_rows: Quest rows reserved = long requests at once (0: "
                        "--max-num-seqs, else the most that fit; default auto: as the server "
                        "sizes it, core/auto_size.py)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="vLLM --max-num-seqs: Quest rows reserved (default: the most that fit)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="vLLM --max-model-len: sizes the Quest rows and vLLM's lines "
                        "(default: --context)")
    p.add_argument("--min-context", type=int, default=None,
                   help="hisparse min_context: a request whose --context stays below this stays "
                        "resident "
                        "(default: the config's, 2 x --buffer)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM --tensor-parallel-size N: each GPU holds 1/N of the KV heads "
                        "(--gpu-kv-gib and --dense-pool-gib are per GPU); --host-gib is the "
                        "engine's total host pool, each rank pinning 1/N (default 1)")
    p.add_argument("--newest-rows", type=int, default=0,
                   help="MLA/DSA: latent rows per request per layer besides the B hot slots "
                        "(default 0: docs/dsa.md writes the newest token through to the host)")
    p.add_argument("--prefill-slots", type=int, default=1,
                   help="MLA/DSA: full-length latent regions for prompts in prefill (default 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="vLLM --max-num-batched-tokens, its step budget (default 8192): with "
                        "resident_first the KV manager tries to keep cdiv(this, page) + "
                        "max_num_seqs + watermark blocks free by spilling (reported as R)")
    p.add_argument("--resident-first", action=argparse.BooleanOptionalAction, default=True,
                   help="hisparse resident_first (default on, as the config): the connector's "
                        "extra admission block and the KV manager's reserve R")
    p.add_argument("--hostless", choices=("sparse", "wait", "dense"), default="sparse",
                   help="hisparse hostless (default sparse, as the config): requests beyond the "
                        "host tier run host-less while the GPU's blocks hold their whole lives, "
                        "counted as well; sparse: each on an idle Quest row; dense: no row "
                        "(stock's outputs); wait: none")
    p.add_argument("--watermark", type=float, default=0.0,
                   help="vLLM scheduler watermark, a fraction of the GPU blocks kept free at "
                        "admission (default 0.0, vLLM 0.26's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def kv_dtype_bytes(kv_cache_dtype: str, model_bytes: int) -> int:
    """Bytes of one KV value for --kv-cache-dtype (auto: the model dtype's)."""
    return model_bytes if kv_cache_dtype == "auto" else 1


def _auto(typ):
    def parse(v: str):
        if v == "auto":
            return v
        try:
            return typ(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v!r}: a number or auto") from None
    return parse


def _opt(v):
    """A flag's value as the config takes it (None: auto)."""
    return None if v == "auto" else v


def _buffer(v: str):
    if v == "auto":
        return v
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r}: a token count or auto") from None


def machine(args, gpu: int, tp: int) -> Machine:
    """What the auto sizes come from: --host-ram-gib (default: this machine's) and the GPU KV."""
    if args.host_ram_gib is None:
        from vllm_hisparse.core.host_pool import host_memory, host_room

        ram = host_room(host_memory())
    else:
        ram = int(args.host_ram_gib * GIB)
    return Machine(host_available_bytes=ram, host_ranks=tp, gpu_kv_bytes=gpu,
                   gpu_kv_fixed=args.explicit_kv, gpu_kv_source=(
                       "kv_cache_memory_bytes" if args.explicit_kv else "--gpu-kv-gib"))
