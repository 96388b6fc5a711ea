"""Startup checks and config changes of a hisparse run on an MLA model with a DSA indexer
(DeepSeek-V3.2 style; docs/dsa.md section 1), called from ``setup_check.prepare_config`` in the
front-end process while vLLM builds its VllmConfig. Every refusal is one line naming the setting
and the fix."""
from __future__ import annotations

from vllm_hisparse.config import HiSparseConfig, gib_at_least
from vllm_hisparse.config import HiSparseConfigError as Refused
from vllm_hisparse.core import indexers, latent_spec
from vllm_hisparse.core.capacity_mla import MLA_BLOCK

from .deployment import deployment_of, ngram_drafts

# the one connector of every hisparse run (plugin.CONNECTOR): it picks the MLA halves (connector.py)
CONNECTOR = ("HiSparseConnector", "vllm_hisparse.vllm.connector")
LATENT_DTYPES = ("auto", "bfloat16", "float16", "fp8_ds_mla")   # fp8_ds_mla: mla_fp8_backend.py


def check_speculative(cfg: HiSparseConfig, sc, topk: int) -> None:
    """Speculative decoding on the DSA path: ngram's k drafts make a request's decode step k + 1
    query tokens, resolved as ONE union into its row set (core/latent_spec.py), which needs
    device_buffer_size >= (k + 1) x index_topk. MTP is refused: its draft layer is an MLA layer
    with its own indexer and KV cache, which the latent pool does not hold."""
    if sc is None:
        return
    k = ngram_drafts(sc, " with indexer 'dsa' (only ngram: an MTP draft layer's latent is not in "
                         "the plugin's pool)")
    try:
        latent_spec.check_buffer(cfg.device_buffer_size, topk, k)
    except ValueError as e:
        raise Refused(f"hisparse: {e}") from None


def check_latent_dtype(cfg: HiSparseConfig, cache_dtype: str, max_model_len: int) -> None:
    """bf16/fp16 latent rows (FLASH_ATTN_MLA_SPARSE's), or fp8_ds_mla's 656 B rows
    (FLASHMLA_SPARSE's), whose pool is read as vLLM's cache of 64-token blocks: regions
    (max_model_len rows) and row sets (device_buffer_size rows) must start on a block."""
    if cache_dtype not in LATENT_DTYPES:
        raise Refused(f"hisparse: kv_cache_dtype={cache_dtype!r} is not supported with indexer "
                      f"'dsa' (the latent pool holds bf16/fp16 rows or fp8_ds_mla's 656 B rows); "
                      f"use --kv-cache-dtype auto or fp8_ds_mla")
    if cache_dtype != "fp8_ds_mla":
        return
    for name, value in (("--max-model-len", max_model_len),
                        ("device_buffer_size", cfg.device_buffer_size)):
        if value % MLA_BLOCK:
            up = -(-value // MLA_BLOCK) * MLA_BLOCK
            raise Refused(f"hisparse: {name} {value} must be a multiple of {MLA_BLOCK} with "
                          f"kv_cache_dtype fp8_ds_mla (the pool is read in {MLA_BLOCK}-token "
                          f"blocks); set it to {up}")


def check_mla(cfg: HiSparseConfig, vllm_config) -> None:
    """Refuse what the DSA path does not run (no config change here)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    topk = getattr(mc.hf_config, "index_topk", None)
    if topk is None:
        raise Refused("hisparse: this MLA model has no DSA indexer (no index_topk in its config: "
                      "DeepSeek-V3 style dense MLA); hisparse serves MLA models with a DSA indexer "
                      "(DeepSeek-V3.2 style) and GQA/MHA models; serve it without "
                      "--attention-backend hisparse")
    if indexers.get(cfg.indexer).serves != "mla":       # the registry's (core/indexers)
        hint = " or ".join(f'"{n}"' for n in indexers.serving("mla"))
        raise Refused(f"hisparse: indexer={cfg.indexer!r} cannot select for an MLA model with a "
                      f"DSA indexer (its own indexer selects); set \"indexer\": {hint}")
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device != "cuda":
        raise Refused(f"hisparse: indexer='dsa' runs on CUDA only (vLLM's {device} platform has no "
                      f"sparse MLA attention backend); serve this model on an NVIDIA GPU (SM90)")
    if cfg.dense_layers:
        raise Refused(f"hisparse: dense_layers={list(cfg.dense_layers)} must be [] for indexer "
                      f"'dsa' (every MLA layer reads the latent pool); set \"dense_layers\": []")
    if cfg.device_buffer_size < topk:
        raise Refused(f"hisparse: device_buffer_size={cfg.device_buffer_size} must be >= the "
                      f"model's index_topk={topk} (one step's selection fits in the hot slots); "
                      f"{2 * topk} (2 x index_topk) is a good start")
    if cfg.top_k != topk:              # the model's indexer picks index_topk tokens: a trained constant
        raise Refused(f"hisparse: top_k={cfg.top_k} differs from the model's index_topk={topk}; "
                      f"with indexer 'dsa' the model's own indexer selects index_topk tokens a "
                      f"step; set \"top_k\": {topk}")
    check_latent_dtype(cfg, cc.cache_dtype, mc.max_model_len)
    if getattr(cc, "user_specified_block_size", False) and cc.block_size not in (None, MLA_BLOCK):
        raise Refused(f"hisparse: --block-size {cc.block_size} must be {MLA_BLOCK} for indexer "
                      f"'dsa' (FLASH_ATTN_MLA_SPARSE's block); drop --block-size")
    check_speculative(cfg, getattr(vllm_config, "speculative_config", None), topk)
    for name, value in (("pipeline_parallel_size", pc.pipeline_parallel_size),
                        ("tensor_parallel_size", pc.tensor_parallel_size),
                        ("decode_context_parallel_size",
                         getattr(pc, "decode_context_parallel_size", 1)),
                        ("prefill_context_parallel_size",
                         getattr(pc, "prefill_context_parallel_size", 1))):
        if value > 1:
            raise Refused(f"hisparse: {name}={value} is not supported with indexer 'dsa' yet "
                          f"(one GPU); set it to 1")
    # no policy check here: setup_check.check_served refused those without a RESOLVE kernel branch
    unused = [f"{k}={v!r}" for k, v, unset in (
        ("full_decode_graphs", cfg.full_decode_graphs, (None,)),
        ("split_dense_decode", cfg.split_dense_decode, (None,)),
        ("trace_dir", cfg.trace_dir, (None,)),
        ("dense_pool_gib", cfg.dense_pool_gib, (None, 0.0))) if v not in unset]
    if unused:
        raise Refused(f"hisparse: {', '.join(unused)} are Quest (GQA) settings, not used by "
                      f"indexer 'dsa' (vLLM's --compilation-config decides its CUDA graphs); drop "
                      f"them")
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise Refused("hisparse: vLLM chose its V2 GPU model runner, which hisparse is not "
                      "verified with; start vLLM with VLLM_USE_V2_MODEL_RUNNER=0")
    if cfg.host_tier:
        dep = deployment_of(vllm_config)
        layers, row = dep.limits.num_layers, dep.latent.row_bytes   # 1152 B a row for V3.2
        if dep.latent.host_rows < mc.max_model_len:
            need = mc.max_model_len * layers * row
            raise Refused(f"hisparse: host_pool_gib={cfg.host_pool_gib} cannot hold one request of "
                          f"max_model_len={mc.max_model_len} ({layers} layers x {row} B a token); "
                          f"set host_pool_gib to at least {gib_at_least(need)} or lower "
                          f"--max-model-len")


def prepare_mla(cfg: HiSparseConfig, vllm_config, logger) -> None:
    """Check, then make the changes the DSA path needs: block size 64, prefix caching off (the
    latent is not in vLLM's blocks), every prefill token through ``forward_mqa`` (the dense-MHA
    prefill reads vLLM's blocks: ``attention_config.sparse_mla_force_mqa``), our KV connector
    (``HiSparseConnector``, as on GQA models; kv_both here)."""
    from .compat import KVTransferConfig

    check_mla(cfg, vllm_config)
    cc = vllm_config.cache_config
    cc.block_size = MLA_BLOCK
    cc.user_specified_block_size = True
    if cc.enable_prefix_caching:
        logger.warning("hisparse: prefix caching is switched off (the latent rows live in the "
                       "plugin's pool, not in vLLM's blocks)")
        cc.enable_prefix_caching = False
    ac = getattr(vllm_config, "attention_config", None)
    if ac is not None and not getattr(ac, "sparse_mla_force_mqa", False):
        ac.sparse_mla_force_mqa = True
        logger.info("hisparse: sparse_mla_force_mqa on (prefill attends through the latent pool)")
    ktc = vllm_config.kv_transfer_config
    if ktc is None or ktc.kv_connector is None:
        vllm_config.kv_transfer_config = KVTransferConfig(
            kv_connector=CONNECTOR[0], kv_connector_module_path=CONNECTOR[1], kv_role="kv_both")
    elif ktc.kv_connector != CONNECTOR[0]:
        raise Refused(f"hisparse brings its own KV connector; drop --kv-transfer-config "
                      f"({ktc.kv_connector})")
