"""Startup validation and the config changes a hisparse run needs (called from the platform's
``check_and_update_config`` while vLLM builds its VllmConfig, in the front-end process)."""
from __future__ import annotations

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import gpu_pools, indexers
from vllm_hisparse.core.deployment import STOCK_SERVES
from vllm_hisparse.config import HiSparseConfigError as Refused   # a ValueError; the CLI prints its
                                                                  # line alone (cli_check.py)

from . import graph_mode
from .compat import KVTransferConfig, init_logger
from .deployment import config_of, deployment_of, ngram_drafts

logger = init_logger(__name__)
SUPPORTED = ("hisparse supports decoder-only GQA/MHA models (Llama, Qwen, Mistral style) with "
             "tensor parallelism only, and MLA models with a DSA indexer (DeepSeek-V3.2 style) on "
             "one GPU")


def check_served(cfg: HiSparseConfig) -> None:
    """Refuse settings the serving runtime does not implement (needs no model: the command line
    runs it before vLLM builds anything, cli_check.py)."""
    from vllm_hisparse.slots import served
    if cfg.policy not in served():
        raise Refused(f"hisparse: policy={cfg.policy!r} is available in the simulator (hisparse "
                      f"sim) and the core, not in the serving runtime (the RESOLVE kernel "
                      f"implements {', '.join(served())}); use \"lru\" (the default) or \"crf\"")
    if cfg.prefetch:
        raise Refused("hisparse: prefetch=True is not implemented in the serving runtime yet; "
                      "use false (misses are fetched inside RESOLVE)")


def prepare_config(vllm_config) -> None:
    """Validate the hisparse setup and make the config changes it needs. The plugin's first look
    at this VllmConfig: ``config_of`` parses the hisparse settings here, once, and keeps the result
    on the config, from which every process reads it (vllm/deployment.py). Sizes left auto are
    resolved here too (core/auto_size.py), so every check below sees the sizes the engine uses."""
    cfg = config_of(vllm_config)          # validated: errors name field, value and fix
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    check_served(cfg)
    if mc is not None and getattr(mc, "use_mla", False):
        # DeepSeek-V3.2 style: the latent pool behind vLLM's sparse-MLA backend (docs/dsa.md)
        from .mla_setup import prepare_mla

        cfg = deployment_of(vllm_config).cfg        # auto sizes filled in
        prepare_mla(cfg, vllm_config, logger)
        if cfg.host_tier:
            check_host_memory(cfg, vllm_config)
        copy_env_to_ray_workers()
        logger.info("hisparse: %s", cfg.to_dict())
        return
    if indexers.get(cfg.indexer).serves != "gqa":
        raise Refused(f"hisparse: indexer={cfg.indexer!r} needs an MLA model with a DSA indexer "
                      f"(DeepSeek-V3.2 style, docs/dsa.md); this model is not MLA: use "
                      f"\"quest\"")
    if mc is not None:
        cfg.check_layers(mc.get_num_layers(pc))     # refused whether or not a request can be sparse
        if not gpu_pools.sparse_possible(cfg, mc.max_model_len):
            serve_as_stock(vllm_config, cfg, mc.max_model_len)  # whatever stock serves (dtypes...)
            return
    check_kv_cache_dtype(cfg, cc)
    if mc is not None:
        if getattr(mc, "is_encoder_decoder", False):
            raise Refused(f"hisparse: encoder-decoder models are not supported; {SUPPORTED}")
        cfg = deployment_of(vllm_config).cfg        # auto sizes filled in
    dc = getattr(vllm_config, "device_config", None)
    if getattr(dc, "device_type", None) == "cuda" and getattr(vllm_config, "use_v2_model_runner",
                                                             False):
        # vLLM 0.26 picks its V2 model runner for dense models on CUDA; every GPU check of hisparse
        # (exactness, graphs, serving) ran the V1 runner, whose host block table the builder reads
        raise Refused("hisparse: vLLM chose its V2 GPU model runner, which hisparse is not "
                      "verified with; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0")
    if pc.pipeline_parallel_size > 1:
        raise Refused(f"hisparse: pipeline parallelism is not supported; {SUPPORTED}")
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if getattr(pc, name, 1) > 1:         # a rank's non-local tokens carry slot -1
            raise Refused(f"hisparse: {name}={getattr(pc, name)} (context parallelism) is not "
                          f"supported; set it to 1 ({SUPPORTED})")
    why = graph_mode.blocker(vllm_config)
    if cfg.full_decode_graphs and why:
        raise Refused(f"hisparse: full_decode_graphs=true cannot run: {why}")
    if cfg.full_decode_graphs is None and why:
        logger.info("hisparse: FULL decode CUDA graphs off (%s)", why)
    if graph_mode.full_graphs(vllm_config):
        graph_mode.capture_full_batch(vllm_config, logger)
    if getattr(cc, "user_specified_block_size", False) and cc.block_size not in (None, cfg.page_size):
        raise Refused(f"hisparse: --block-size {cc.block_size} must equal the hisparse "
                      f"page_size={cfg.page_size} (one vLLM block = one Quest page = one slot)")
    cc.block_size = cfg.page_size
    cc.user_specified_block_size = True
    check_speculative(cfg, getattr(vllm_config, "speculative_config", None))
    # vLLM's prefix caching stays the user's choice (docs/design/prefix-caching.md, steps 1, 2a):
    # vllm/spec.py copies a hit's private floor (block 0, or the S hot slots with the host tier)
    # and donates a request's hashed slots before they are overwritten; core/sparse_runtime.py
    # fills a hit's Quest row and host / dense-pool pages from its GPU blocks at its first step.
    # Host pages stay private per request (a hit saves the prefill, not host memory).
    dep = deployment_of(vllm_config) if mc is not None else None
    if dep is not None and dep.auto:
        logger.info("hisparse: sized from this machine (%s): %s", ", ".join(dep.auto),
                    ", ".join(f"{f}={getattr(cfg, f)}" for f in dep.auto))
    if cfg.host_tier and dep is not None and dep.sparse_possible:
        tp = dep.limits.tensor_parallel_size
        pb = dep.page_bytes                                      # one page of one layer, per rank
        # host_pool_gib is the engine's total: a request's pages take pb on every rank
        cfg.check_host_pool(mc.max_model_len, pb // cfg.page_size * tp, len(dep.host_layers))
        check_host_memory(cfg, vllm_config)
        cfg.check_dense_pool(mc.max_model_len, pb // cfg.page_size)
        if dep.dense_layer_ids and not cfg.uses_dense_pool:
            logger.warning("hisparse: dense_layers=%s without dense_pool_gib: those layers read the "
                           "given-back pages of long requests from the host pool every decode step "
                           "(exact, but PCIe-bound); set dense_pool_gib to keep them on the GPU",
                           list(cfg.dense_layers))
    # kv_producer, not kv_both: with a consumer connector and async scheduling vLLM defers the
    # free of a preempted request's blocks until its in-flight step is processed
    # (Scheduler.defer_block_free), so one missing block preempts every running request after
    # the one asking. Our worker writes vLLM's blocks only on the
    # forward's stream, as stock vLLM does, so nothing needs the deferral.
    ktc = vllm_config.kv_transfer_config
    if ktc is None or ktc.kv_connector is None:
        vllm_config.kv_transfer_config = KVTransferConfig(
            kv_connector="HiSparseConnector", kv_connector_module_path="vllm_hisparse.vllm.connector",
            kv_role="kv_producer")
    elif ktc.kv_connector != "HiSparseConnector":
        raise Refused(f"hisparse brings its own KV connector; drop --kv-transfer-config "
                      f"({ktc.kv_connector})")
    elif ktc.is_kv_consumer:
        logger.info("hisparse: kv_role %s -> kv_producer (the connector loads nothing into "
                    "vLLM's blocks)", ktc.kv_role)
        ktc.kv_role = "kv_producer"
    copy_env_to_ray_workers()
    logger.info("hisparse: %s", cfg.to_dict())


def check_kv_cache_dtype(cfg: HiSparseConfig, cc) -> None:
    """GQA: the KV tiers hold the model's dtype or fp8 e4m3 (ops/fp8.py); refuse the rest, and
    what an fp8 cache does not run with yet."""
    from .backend import kv_cache_dtype_error

    dt = getattr(cc, "cache_dtype", "auto")
    why = kv_cache_dtype_error(dt)
    if why:
        raise Refused(f"hisparse: {why}")
    if dt == "auto":
        return
    if getattr(cc, "kv_cache_dtype_skip_layers", None):
        raise Refused(f"hisparse: kv_cache_dtype_skip_layers={cc.kv_cache_dtype_skip_layers} is "
                      f"not supported (every hisparse tier holds one dtype); drop "
                      f"--kv-cache-dtype-skip-layers")
    if cfg.split_dense_decode is False:
        raise Refused(f"hisparse: split_dense_decode=false sends dense rows to FlashAttention, "
                      f"which hisparse does not run over an fp8 cache ({dt}) yet; leave "
                      f"split_dense_decode unset")


def check_speculative(cfg: HiSparseConfig, sc) -> None:
    """Speculative decoding (vLLM's ``speculative_config``): ngram only (a draft model's attention
    layers would run through hisparse as well; unverified), with its verify rows (1 +
    num_speculative_tokens tokens, core/spec_rows.py) on at most two pages."""
    if sc is None:
        return
    k = ngram_drafts(sc, " (only ngram: no draft model)")
    if k + 1 > cfg.page_size:
        raise Refused(f"hisparse: speculative_config num_speculative_tokens={k} must be below "
                      f"page_size={cfg.page_size} (a verify row spans at most two pages); lower it")
    logger.info("hisparse: ngram speculation, %d draft tokens: verify rows of sparse requests "
                "attend one selection per request (core/spec_rows.py)", k)


def serve_as_stock(vllm_config, cfg: HiSparseConfig, max_model_len: int) -> None:
    """A request runs sparse once its context reaches min_context (core/residency.py): with a
    max_model_len below it no request ever does, so hisparse has nothing to add (no sparse step, no
    host tier) and the engine is stock vLLM: the attention backend goes back to vLLM's own choice
    and no hisparse connector, KV spec or runtime is installed (every hisparse hook asks
    ``plugin.selected``, now False). One line says so. The hisparse settings are validated all the
    same (config_of: a wrong field is refused whatever max_model_len)."""
    unset = "" if cfg.min_context is not None else " (unset: 2 x device_buffer_size)"
    logger.warning("hisparse: max_model_len=%d is below min_context=%d%s: no request can ever be "
                   "sparse, so %s (stock vLLM: no hisparse pool, connector or runtime); set "
                   "min_context below max_model_len (0 = every request sparse) to serve with "
                   "hisparse", max_model_len, cfg.min_context_tokens, unset, STOCK_SERVES)
    vllm_config.attention_config.backend = None
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):          # plugin.asked: the prompt-id guard stays on
        extra[AS_STOCK] = True


HOST_CHECKED = "hisparse_host_room_checked"     # additional_config key: check_host_memory ran
AS_STOCK = "hisparse_served_as_stock"           # additional_config key: serve_as_stock ran


def check_host_memory(cfg, vllm_config) -> None:
    """Before any worker allocates: the host pools of every rank on this host (each tensor-parallel
    rank pins host_pool_gib / TP; each local data-parallel engine has its own) must fit this host's
    available RAM and container limit; refused in one line naming host_pool_gib and a value that
    fits (core/host_pool.check_host_room).

    Once per engine: vLLM's engine core runs the platform's config check again after its workers
    have built the model and pinned the pools (``EngineCore._perform_handshakes`` ends with
    ``vllm_config.__post_init__()``), when the available RAM no longer counts them; checked there
    again, a pool bigger than half the host would refuse itself. The mark travels with the config
    to the engine core's process."""
    from vllm_hisparse.core import capacity
    from vllm_hisparse.core.host_pool import check_host_room

    extra = vllm_config.additional_config
    if isinstance(extra, dict) and extra.get(HOST_CHECKED):
        return
    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    local = getattr(pc, "local_world_size", pc.world_size) * max(1, pc.data_parallel_size_local)
    cuda = getattr(getattr(vllm_config, "device_config", None), "device_type", None) == "cuda"
    check_host_room(cfg.host_pool_gib, capacity.host_pool_rank_bytes(cfg.host_pool_bytes, tp),
                    tp, local, pinned=cuda)
    if isinstance(extra, dict):
        extra[HOST_CHECKED] = True


RAY_PREFIXES = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"


def copy_env_to_ray_workers() -> None:
    """vLLM's Ray executor copies only VLLM_*, HF_*, NCCL_* ... variables to its workers
    (vllm/ray/ray_env.py); adding HISPARSE_ to its documented extra prefixes makes HISPARSE_*
    settings (HISPARSE_STATS_FILE, HISPARSE_PDL) reach them too. Set in this process's environment,
    which the engine process inherits before it starts Ray."""
    import os

    have = [p.strip() for p in os.environ.get(RAY_PREFIXES, "").split(",") if p.strip()]
    if "HISPARSE_" not in have:
        os.environ[RAY_PREFIXES] = ",".join(have + ["HISPARSE_"])
