"""vLLM general-plugin entry point (``vllm.general_plugins``: hisparse = ...plugin:register).

``register()`` runs in every vLLM process (API server / LLM, EngineCore, workers); it is idempotent
and only acts when a run selects the backend (``--attention-backend hisparse``): stock runs in the
same environment are untouched. What it installs (patches/README.md lists the runtime wraps: why
each is needed and which upstream change would remove it):
  * the backend as ``AttentionBackendEnum.CUSTOM`` plus the alias ``HISPARSE``;
  * the KV connector ``HiSparseConnector`` in vLLM's connector factory;
  * ``HiSparseSpec`` -> ``HiSparseManager`` in the KV-cache spec registry;
  * a wrap of ``Attention.get_kv_cache_spec`` (hisparse layers get ``HiSparseSpec``);
  * a wrap of the platform's ``check_and_update_config`` (validates the setup, block_size ==
    page_size, prefix caching off on the MLA path only, our KV connector on);
  * on CPU, a wrap of ``CpuPlatform.get_attn_backend_cls`` (it otherwise always picks CPU_ATTN);
  * on CUDA, a wrap of the platform's ``get_attn_backend_cls``: CUSTOM on an MLA layer with a
    sparse indexer (DeepSeek-V3.2 style) is the MLA backend (``route``), anything else the GQA one;
  * a wrap of ``MLAAttention.get_kv_cache_spec`` (hisparse MLA layers get a stub latent spec,
    docs/dsa.md section 1);
  * a wrap of ``InputProcessor._validate_model_input``: prompt token ids outside [0, vocab size)
    are refused with a ValueError (HTTP 400) instead of crashing the engine (``prompt_id_error``);
  * ``--hisparse-config FILE.json`` on vLLM's command line (cli_flag.py), and one-line errors
    with exit code 2 for bad hisparse input there (cli_check.py);
  * ``load_format="scaled_dummy"`` in vLLM's model-loader registry (scaled_weights.py: random
    weights whose attention matters; vLLM's documented ``register_model_loader``, not a wrap).
"""
from __future__ import annotations

BACKEND_PATH = "vllm_hisparse.vllm.backend.HiSparseBackend"
MLA_BACKEND_PATH = "vllm_hisparse.vllm.mla_backend.HiSparseMLASparseBackend"
MLA_FP8_BACKEND_PATH = "vllm_hisparse.vllm.mla_fp8_backend.HiSparseFlashMLASparseBackend"
CONNECTOR = ("HiSparseConnector", "vllm_hisparse.vllm.connector")


def register() -> None:
    """Install everything listed above. Each step is idempotent on its own (a registry entry
    set again to the same value, a wrap that finds its own marker), so calling it again is a
    no-op; nothing records that it ran."""
    from . import compat as c

    c.register_backend(c.AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    c.AttentionBackendEnum._member_map_.setdefault("HISPARSE", c.AttentionBackendEnum.CUSTOM)

    from .spec import HiSparseManager, HiSparseSpec

    c.KVCacheSpecRegistry._ensure_registered()    # else the built-ins are never registered
    c.KVCacheSpecRegistry.register(HiSparseSpec, HiSparseManager,
                                   uniform_type_base_spec=c.FullAttentionSpec)
    if CONNECTOR[0] not in c.KVConnectorFactory._registry:     # registering twice raises
        c.KVConnectorFactory.register_connector(CONNECTOR[0], CONNECTOR[1], CONNECTOR[0])
    _wrap_get_kv_cache_spec(c)
    _wrap_mla_kv_cache_spec(c)
    _wrap_platform(c)
    _wrap_prompt_check(c)
    _wrap_cli()
    from . import scaled_weights

    scaled_weights.register()


def _wrap_cli() -> None:
    """``--hisparse-config FILE.json`` on the vLLM command line (see cli_flag.py), and bad hisparse
    input there ending in one line and exit code 2 (cli_check.py)."""
    import sys

    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from .cli_check import check_argv, check_namespace
    from .cli_flag import rewrite

    orig = FlexibleArgumentParser.parse_args
    if getattr(orig, "_hisparse", False):
        return

    def parse_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        check_argv(args)
        return check_namespace(orig(self, rewrite(args), namespace))

    parse_args._hisparse = True
    FlexibleArgumentParser.parse_args = parse_args


def selected(vllm_config) -> bool:
    """True when this run uses the hisparse backend."""
    from . import compat as c

    be = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return be == c.AttentionBackendEnum.CUSTOM and c.AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH


def asked(vllm_config) -> bool:
    """This run asked for hisparse: it runs the hisparse backend, or it is stock vLLM because no
    request can be sparse (setup_check.serve_as_stock marked it); what only guards vLLM keys on
    this (the prompt-id check), what runs hisparse on ``selected``."""
    from .setup_check import AS_STOCK

    extra = getattr(vllm_config, "additional_config", None)
    return selected(vllm_config) or (isinstance(extra, dict) and bool(extra.get(AS_STOCK)))


def route(use_mla: bool, use_sparse: bool, kv_cache_dtype: str = "auto") -> str:
    """The hisparse backend class path for a layer that selected CUSTOM: an MLA layer with a sparse
    indexer goes to the MLA backend (docs/dsa.md: FLASH_ATTN_MLA_SPARSE's subclass, or with the
    fp8_ds_mla cache FLASHMLA_SPARSE's); every other layer to the GQA backend, whose
    ``validate_configuration`` refuses MLA without an indexer in one line."""
    if use_mla and use_sparse:
        return MLA_FP8_BACKEND_PATH if kv_cache_dtype == "fp8_ds_mla" else MLA_BACKEND_PATH
    return BACKEND_PATH


def _is_ours(backend_cls) -> bool:
    return getattr(backend_cls, "is_hisparse", False)


def _wrap_spec(layer_cls, convert) -> None:
    """Wrap ``layer_cls.get_kv_cache_spec``: a layer whose backend is ours gets
    ``convert(layer, spec, vllm_config)`` instead of vLLM's spec (once per class)."""
    orig = layer_cls.get_kv_cache_spec
    if getattr(orig, "_hisparse", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = orig(self, vllm_config)
        if spec is None or not _is_ours(getattr(self, "attn_backend", None)):
            return spec
        return convert(self, spec, vllm_config)

    get_kv_cache_spec._hisparse = True
    layer_cls.get_kv_cache_spec = get_kv_cache_spec


def _wrap_get_kv_cache_spec(c) -> None:
    """GQA layers: the bounded HiSparseSpec (spec.py) in place of vLLM's FullAttentionSpec."""
    def convert(layer, spec, vllm_config):
        if type(spec) is not c.FullAttentionSpec or spec.sliding_window is not None:
            raise ValueError(f"hisparse supports full-attention decoder layers only; layer "
                             f"{getattr(layer, 'layer_name', '?')} has {type(spec).__name__}")
        from .deployment import deployment_of
        from .spec import HiSparseSpec

        fields = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
        return HiSparseSpec(**fields, deployment=deployment_of(vllm_config))

    _wrap_spec(c.Attention, convert)


def _wrap_mla_kv_cache_spec(c) -> None:
    """hisparse MLA layers keep their latent in the plugin's pool: vLLM's blocks get a stub
    (``mla_spec.stub_spec``), so its KV budget holds the indexer K and 16 B per token per layer."""
    def convert(layer, spec, vllm_config):
        from .mla_spec import stub_spec

        return stub_spec(spec)

    _wrap_spec(c.MLAAttention, convert)


def _wrap_platform(c) -> None:
    plat = c.current_platform_cls()
    orig_check = plat.check_and_update_config          # bound to plat; may live on a base class
    if getattr(orig_check, "_hisparse", False):
        return

    def check_and_update_config(cls, vllm_config):
        if selected(vllm_config):
            from .setup_check import prepare_config

            prepare_config(vllm_config)
        return orig_check(vllm_config)

    check_and_update_config._hisparse = True
    plat.check_and_update_config = classmethod(check_and_update_config)

    if plat.__name__ == "CpuPlatform":
        orig_sel = plat.get_attn_backend_cls.__func__

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if selected_backend == c.AttentionBackendEnum.CUSTOM and \
                    c.AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH:
                from .backend import HiSparseBackend

                why = HiSparseBackend.validate_configuration(
                    device_capability=None, **attn_selector_config._asdict())
                if why:
                    raise ValueError("hisparse cannot run this model: " + "; ".join(why))
                return BACKEND_PATH
            return orig_sel(cls, selected_backend, attn_selector_config, num_heads)

        plat.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    elif getattr(plat, "device_name", None) == "cuda":
        _wrap_cuda_selection(c, plat)


def _wrap_cuda_selection(c, plat) -> None:
    """CUSTOM is one enum member with one class path (the GQA backend); an MLA layer with a sparse
    indexer that selects it gets the MLA backend instead (``route``), validated as vLLM validates
    a selected backend."""
    orig_sel = plat.get_attn_backend_cls.__func__
    if getattr(orig_sel, "_hisparse", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if (selected_backend == c.AttentionBackendEnum.CUSTOM
                and c.AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH):
            path = route(attn_selector_config.use_mla, attn_selector_config.use_sparse,
                         attn_selector_config.kv_cache_dtype)
            if path != BACKEND_PATH:
                if path == MLA_FP8_BACKEND_PATH:
                    from .mla_fp8_backend import HiSparseFlashMLASparseBackend as cls_
                else:
                    from .mla_backend import HiSparseMLASparseBackend as cls_
                why = cls_.validate_configuration(
                    device_capability=cls.get_device_capability(),
                    **attn_selector_config._asdict())
                if why:
                    raise ValueError("hisparse cannot run this MLA model: " + "; ".join(why))
                return path
        return orig_sel(cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._hisparse = True
    plat.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def prompt_id_error(prompt_ids, vocab_size: int, upper: bool = True) -> str | None:
    """Why ``prompt_ids`` cannot reach the model's embedding (an id < 0, or, with ``upper``, >=
    ``vocab_size``), as the 400's message; None when every id is in range."""
    if not prompt_ids:
        return None
    lo, hi = min(prompt_ids), max(prompt_ids)
    bad = lo if lo < 0 else hi if upper and hi >= vocab_size else None
    if bad is None:
        return None
    return (f"Token id {bad} is out of vocabulary: this model's prompt token ids are 0 to "
            f"{vocab_size - 1}")


def _wrap_prompt_check(c) -> None:
    """vLLM 0.26 bounds a prompt's token ids by ``max(tokenizer.max_token_id, vocab_size - 1)``
    only, and an HF tokenizer's ``max_token_id`` is at least its ``vocab_size`` (one past its last
    id: vllm/tokenizers/hf.py): the id ``vocab_size``, and any negative id (from ``LLM``; the
    OpenAI schema refuses those), pass and then index the embedding out of bounds in the worker,
    which kills the engine and every request in flight. A hisparse run refuses them here, in the
    front end's input processor, with a ValueError (the OpenAI server's 400). A multimodal model
    keeps vLLM's upper bound: its tokenizer may name placeholder ids above the text vocabulary."""
    cls = c.InputProcessor
    orig = cls._validate_model_input
    if getattr(orig, "_hisparse", False):
        return

    def _validate_model_input(self, prompt_input, prompt_type):
        orig(self, prompt_input, prompt_type)
        if prompt_input["type"] == "embeds" or not asked(self.vllm_config):
            return
        mc = self.model_config
        why = prompt_id_error(prompt_input["prompt_token_ids"], mc.get_vocab_size(),
                              upper=not mc.is_multimodal_model)
        if why:
            raise ValueError(why)

    _validate_model_input._hisparse = True
    cls._validate_model_input = _validate_model_input
