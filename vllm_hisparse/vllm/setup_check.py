"""Startup validation and the config changes a hisparse run needs (called from the platform's
``check_and_update_config`` while vLLM builds its VllmConfig, in the front-end process)."""
from __future__ import annotations

from .compat import KVTransferConfig, hisparse_config_of, init_logger

logger = init_logger(__name__)
SUPPORTED = ("hisparse supports decoder-only GQA/MHA models (Llama, Qwen, Mistral style) with "
             "tensor parallelism only")


def prepare_config(vllm_config) -> None:
    cfg = hisparse_config_of(vllm_config)          # validated: errors name field, value and fix
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if cfg.indexer != "quest":
        raise ValueError(f"hisparse: indexer={cfg.indexer!r} is not wired into vLLM yet; use "
                         f"\"quest\"")
    if cfg.policy != "lru":
        raise ValueError(f"hisparse: policy={cfg.policy!r} is available in the simulator (hisparse "
                         f"sim) and the core, not yet in the serving runtime (the RESOLVE kernel "
                         f"implements 'lru'); use \"lru\"")
    if cfg.prefetch:
        raise ValueError("hisparse: prefetch=True is not implemented in the serving runtime yet; "
                         "use false (misses are fetched inside RESOLVE)")
    if mc is not None:
        if getattr(mc, "use_mla", False):
            raise ValueError(f"hisparse: MLA models are not supported; {SUPPORTED}")
        if getattr(mc, "is_encoder_decoder", False):
            raise ValueError(f"hisparse: encoder-decoder models are not supported; {SUPPORTED}")
        cfg.check_layers(mc.get_num_layers(pc))
    dc = getattr(vllm_config, "device_config", None)
    if getattr(dc, "device_type", None) == "cuda" and getattr(vllm_config, "use_v2_model_runner",
                                                             False):
        # vLLM 0.26 picks its V2 model runner for dense models on CUDA; every GPU check of hisparse
        # (exactness, graphs, serving) ran the V1 runner, whose host block table the builder reads
        raise ValueError("hisparse: vLLM chose its V2 GPU model runner, which hisparse is not "
                         "verified with; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0")
    if pc.pipeline_parallel_size > 1:
        raise ValueError(f"hisparse: pipeline parallelism is not supported; {SUPPORTED}")
    if cfg.full_decode_graphs and (getattr(pc, "data_parallel_size", 1) > 1
                                   or getattr(pc, "use_ubatching", False)):
        # an idle data-parallel rank replays a FULL graph on a dummy batch without the connector
        # (stale static buffers); micro-batches would share one set of them
        raise ValueError("hisparse: full_decode_graphs does not support data parallelism or "
                         "micro-batching (DBO) yet; set full_decode_graphs false")
    if getattr(cc, "user_specified_block_size", False) and cc.block_size not in (None, cfg.page_size):
        raise ValueError(f"hisparse: --block-size {cc.block_size} must equal the hisparse "
                         f"page_size={cfg.page_size} (one vLLM block = one Quest page = one slot)")
    cc.block_size = cfg.page_size
    cc.user_specified_block_size = True
    if cc.enable_prefix_caching:
        logger.warning("hisparse: prefix caching is switched off (not compatible yet)")
        cc.enable_prefix_caching = False
    if cfg.host_tier and mc is not None:
        from vllm_hisparse.core.host_pool import HostKVPool

        tp = pc.tensor_parallel_size
        pb = HostKVPool.page_bytes(cfg.page_size, mc.get_num_kv_heads(pc), mc.get_head_size(),
                                   mc.dtype)                     # one page of one layer, per rank
        # host_pool_gib is the engine's total: a request's pages take pb on every rank
        cfg.check_host_pool(mc.max_model_len, pb // cfg.page_size * tp,
                            len(cfg.host_pool_layers(mc.get_num_layers(pc))))
        check_host_memory(cfg, vllm_config)
        cfg.check_dense_pool(mc.max_model_len, pb // cfg.page_size)
        if cfg.dense_layers and not cfg.uses_dense_pool:
            logger.warning("hisparse: dense_layers=%s without dense_pool_gib: those layers read the "
                           "given-back pages of long requests from the host pool every decode step "
                           "(exact, but PCIe-bound); set dense_pool_gib to keep them on the GPU",
                           list(cfg.dense_layers))
    ktc = vllm_config.kv_transfer_config
    if ktc is None or ktc.kv_connector is None:
        vllm_config.kv_transfer_config = KVTransferConfig(
            kv_connector="HiSparseConnector", kv_connector_module_path="vllm_hisparse.vllm.connector",
            kv_role="kv_both")
    elif ktc.kv_connector != "HiSparseConnector":
        raise ValueError(f"hisparse brings its own KV connector; drop --kv-transfer-config "
                         f"({ktc.kv_connector})")
    copy_env_to_ray_workers()
    logger.info("hisparse: %s", cfg.to_dict())


def check_host_memory(cfg, vllm_config) -> None:
    """Before any worker allocates: the host pools of every rank on this host (each tensor-parallel
    rank pins host_pool_gib / TP; each local data-parallel engine has its own) must fit this host's
    available RAM and container limit; refused in one line naming host_pool_gib and a value that
    fits (core/host_pool.check_host_room)."""
    from vllm_hisparse.core import capacity
    from vllm_hisparse.core.host_pool import check_host_room

    pc = vllm_config.parallel_config
    tp = pc.tensor_parallel_size
    local = getattr(pc, "local_world_size", pc.world_size) * max(1, pc.data_parallel_size_local)
    cuda = getattr(getattr(vllm_config, "device_config", None), "device_type", None) == "cuda"
    check_host_room(cfg.host_pool_gib, capacity.host_pool_rank_bytes(cfg.host_pool_bytes, tp),
                    tp, local, pinned=cuda)


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
