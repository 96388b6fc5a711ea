"""Plugin registration and startup checks, without starting an engine."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

HS = {"hisparse": {"top_k": 32, "device_buffer_size": 64, "page_size": 16,
                   "host_pool_gib": 1, "resident_first": False}}   # small: the startup check compares pools with free RAM


def fake_config(**over):
    mc = SimpleNamespace(use_mla=False, is_encoder_decoder=False, max_model_len=1024,
                         dtype=__import__("torch").float32, get_num_layers=lambda pc: 4,
                         get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 32)
    cfg = SimpleNamespace(
        additional_config=dict(HS), model_config=mc,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1,
                                        world_size=1, local_world_size=1,
                                        data_parallel_size_local=1),
        cache_config=SimpleNamespace(block_size=None, user_specified_block_size=False,
                                     enable_prefix_caching=True),
        kv_transfer_config=None)
    for k, v in over.items():
        obj, attr = k.split("__")
        setattr(getattr(cfg, obj) if obj != "cfg" else cfg, attr, v)
    return cfg


def test_register_idempotent_and_alias_case_insensitive():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_hisparse.vllm.plugin import BACKEND_PATH, register

    register()
    register()
    for name in ("hisparse", "HiSparse", "HISPARSE"):
        assert AttentionConfig.validate_backend_before(name) is AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert "HiSparseConnector" in KVConnectorFactory._registry


def test_prepare_config_sets_block_size_connector_and_keeps_prefix_caching():
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = fake_config()
    prepare_config(cfg)
    assert cfg.cache_config.block_size == 16
    assert cfg.cache_config.enable_prefix_caching is True         # the user's (vLLM: on)
    assert cfg.kv_transfer_config.kv_connector == "HiSparseConnector"
    assert cfg.kv_transfer_config.kv_role == "kv_producer"   # no deferred frees


def test_an_engine_that_cannot_be_sparse_is_stock_vllm(monkeypatch):
    """max_model_len below min_context (2 x device_buffer_size = 128 here): no request can ever be
    sparse, so vLLM's own attention backend serves (backend back to auto, no connector, vLLM's
    block size), said in one line; at max_model_len = min_context hisparse serves; a wrong setting
    is refused either way."""
    from vllm_hisparse.config import HiSparseConfigError
    from vllm_hisparse.vllm import setup_check

    logs = []
    monkeypatch.setattr(setup_check.logger, "warning", lambda msg, *a: logs.append(msg % a))
    cfg = fake_config(model_config__max_model_len=127, cfg__attention_config=SimpleNamespace(
        backend="CUSTOM"))
    setup_check.prepare_config(cfg)
    assert cfg.attention_config.backend is None
    assert cfg.kv_transfer_config is None and cfg.cache_config.block_size is None
    assert cfg.additional_config[setup_check.AS_STOCK] is True       # plugin.asked
    assert logs == ["hisparse: max_model_len=127 is below min_context=128 (unset: 2 x "
                    "device_buffer_size): no request can ever be sparse, so vLLM's own attention "
                    "backend serves every layer (stock vLLM: no hisparse pool, connector or "
                    "runtime); set min_context below max_model_len (0 = every request sparse) to "
                    "serve with hisparse"]
    cfg = fake_config(model_config__max_model_len=127, cfg__attention_config=SimpleNamespace(
        backend="CUSTOM"), model_config__is_encoder_decoder=True)   # stock serves those
    setup_check.prepare_config(cfg)
    assert cfg.attention_config.backend is None
    cfg = fake_config(model_config__max_model_len=128, cfg__attention_config=SimpleNamespace(
        backend="CUSTOM"))
    setup_check.prepare_config(cfg)
    assert cfg.attention_config.backend == "CUSTOM"
    assert not any("below min_context" in line for line in logs[2:])
    assert cfg.kv_transfer_config.kv_connector == "HiSparseConnector"
    cfg = fake_config(model_config__max_model_len=127, cfg__attention_config=SimpleNamespace(
        backend="CUSTOM"))
    cfg.additional_config = {"hisparse": dict(HS["hisparse"], dense_layers=[0, 9])}
    with pytest.raises(HiSparseConfigError, match=r"dense_layers=\[0, 9\] is invalid"):
        setup_check.prepare_config(cfg)


@pytest.mark.parametrize("over, words", [
    ({"model_config__is_encoder_decoder": True}, "encoder-decoder"),
    ({"parallel_config__pipeline_parallel_size": 2}, "pipeline"),
    ({"parallel_config__prefill_context_parallel_size": 2},
     r"prefill_context_parallel_size=2 \(context parallelism\) is not supported; set it to 1"),
    ({"parallel_config__decode_context_parallel_size": 4}, "decode_context_parallel_size=4"),
])
def test_unsupported_setups_fail_with_what_is_supported(over, words):
    from vllm_hisparse.vllm.setup_check import prepare_config

    with pytest.raises(ValueError, match=words) as e:
        prepare_config(fake_config(**over))
    assert "supports decoder-only GQA/MHA" in str(e.value)


@pytest.mark.parametrize("field, value, words", [
    ("policy", "fifo", "policy='fifo' is available in the simulator"),
    ("prefetch", True, "prefetch=True is not implemented"),
    ("indexer", "dsa", "indexer='dsa' needs an MLA model with a DSA indexer"),
    ("io_chunk_bytes", 512, "io_chunk_bytes=512"),
])
def test_config_the_runtime_does_not_serve_is_refused(field, value, words):
    """Fields the serving runtime would otherwise ignore: refused at startup, one line each."""
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = fake_config()
    cfg.additional_config = {"hisparse": dict(HS["hisparse"], **{field: value})}
    with pytest.raises(ValueError, match=words) as e:
        prepare_config(cfg)
    assert "\n" not in str(e.value) and "use " in str(e.value)


@pytest.mark.parametrize("parallel, refused", [
    ({"data_parallel_size": 2, "use_ubatching": False}, True),
    ({"data_parallel_size": 1, "use_ubatching": True}, True),
    ({"data_parallel_size": 1, "use_ubatching": False}, False),
])
def test_full_decode_graphs_refuses_data_parallel_and_micro_batches(parallel, refused):
    """An idle data-parallel rank replays a FULL graph on a dummy batch without the connector, and
    micro-batches would share the decode batch's buffers: full_decode_graphs true is refused with
    the flag, one line; left unset, the graphs are off (vllm/graph_mode.py) and the run starts."""
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = fake_config(**{f"parallel_config__{k}": v for k, v in parallel.items()})
    cfg.additional_config = {"hisparse": dict(HS["hisparse"], full_decode_graphs=True,
                                              dense_layers=[])}
    if refused:
        with pytest.raises(ValueError, match="full_decode_graphs=true cannot run: data par") as e:
            prepare_config(cfg)
        assert "\n" not in str(e.value)
    else:
        prepare_config(cfg)
    unset = fake_config(**{f"parallel_config__{k}": v for k, v in parallel.items()})
    unset.additional_config = {"hisparse": dict(HS["hisparse"], dense_layers=[])}
    prepare_config(unset)
    from vllm_hisparse.vllm import graph_mode
    assert (graph_mode.blocker(unset) is not None) is refused


@pytest.mark.parametrize("device, v2, refused", [("cuda", True, True), ("cuda", False, False),
                                                 ("cpu", True, False)])
def test_v2_model_runner_refused_on_the_gpu(device, v2, refused):
    """vLLM 0.26 defaults to its V2 model runner for dense models on CUDA; hisparse was verified on
    the V1 runner only: refused there with the environment variable that selects V1."""
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = fake_config()
    cfg.device_config = SimpleNamespace(device_type=device)
    cfg.use_v2_model_runner = v2
    if refused:
        with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
            prepare_config(cfg)
    else:
        prepare_config(cfg)


def test_lru_and_no_prefetch_accepted():
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = fake_config()
    cfg.additional_config = {"hisparse": dict(HS["hisparse"], policy="lru", prefetch=False,
                                              io_chunk_bytes=256)}
    prepare_config(cfg)


def test_block_size_must_equal_page_size():
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = fake_config(cache_config__block_size=32, cache_config__user_specified_block_size=True)
    with pytest.raises(ValueError, match="page_size=16"):
        prepare_config(cfg)


def test_host_pool_too_small_for_one_request():
    from vllm_hisparse.config import HiSparseConfigError
    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = fake_config()
    cfg.additional_config = {"hisparse": dict(HS["hisparse"], host_pool_gib=0.0001)}
    with pytest.raises(HiSparseConfigError, match="host_pool_gib"):
        prepare_config(cfg)


def test_wrong_vllm_version_message():
    code = ("import vllm; vllm.__version__ = '0.27.1'\n"
            "try:\n    import vllm_hisparse.vllm.compat\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert "vllm-hisparse supports vLLM 0.26.x; found 0.27.1" in out


def test_hisparse_config_flag_rewrite(tmp_path):
    from vllm_hisparse.vllm.cli_flag import rewrite

    f = str(tmp_path / "hs.json")
    assert rewrite(["serve", "m", "--port", "1"]) == ["serve", "m", "--port", "1"]
    out = rewrite(["serve", "m", "--hisparse-config", f, "--additional-config", '{"x": 1}'])
    assert out[:2] == ["serve", "m"]
    i = out.index("--additional-config")
    assert json.loads(out[i + 1]) == {"x": 1, "hisparse": f}
    assert out[out.index("--attention-backend") + 1] == "hisparse"
    out = rewrite(["serve", "m", f"--hisparse-config={f}", "--attention-backend", "HISPARSE"])
    assert out.count("--attention-backend") == 1


def test_hisparse_config_flag_through_vllm_parser(tmp_path):
    """The real `vllm serve` parser (plugins load before it parses) accepts the shorthand."""
    f = tmp_path / "hs.json"
    f.write_text(json.dumps(HS["hisparse"]))
    code = ("import sys\n"
            "from vllm.entrypoints.cli.serve import ServeSubcommand\n"
            "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
            "from vllm.engine.arg_utils import AsyncEngineArgs\n"
            "p = FlexibleArgumentParser()\n"
            "AsyncEngineArgs.add_cli_args(p)\n"
            f"a = p.parse_args(['--model', 'm', '--hisparse-config', {str(f)!r}])\n"
            "print(a.attention_backend, a.additional_config)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "hisparse" in r.stdout and str(f) in r.stdout, r.stdout + r.stderr[-2000:]


def test_prompt_that_cannot_prefill_on_gpu_is_refused_at_startup():
    """A prompt is fully resident while it prefills: one max_model_len prompt must fit the blocks."""
    from types import SimpleNamespace

    from vllm_hisparse.config import HiSparseConfig
    from vllm_hisparse.vllm.connector_scheduler import ConnectorScheduler, check_prefill_fits

    cfg = HiSparseConfig(top_k=32, device_buffer_size=64, page_size=16)
    assert check_prefill_fits(cfg, 1000, 65) == 64               # 63 pages + the newest
    with pytest.raises(ValueError, match=r"holds 63 blocks of 16 tokens.*needs 64 during its own "
                                         r"prefill; lower --max-model-len"):
        check_prefill_fits(cfg, 1000, 64)
    resident = SimpleNamespace(cfg=HiSparseConfig(host_tier=False), max_model_len=10**6)
    ConnectorScheduler.bind_gpu_block_pool(resident, SimpleNamespace(num_gpu_blocks=2))


@pytest.mark.parametrize("sizes, max_size, n, want", [
    ([1, 2, 4, 8, 16, 24, 32, 40], 40, 22, [1, 2, 4, 8, 16, 22, 24, 32, 40]),
    ([1, 2, 4, 8, 16, 24, 32, 40], 40, 16, [1, 2, 4, 8, 16, 24, 32, 40]),      # already there
    ([1, 2, 4, 8], 8, 22, [1, 2, 4, 8]),                                      # beyond the largest
    ([], 0, 22, []),                                                          # no CUDA graphs
])
def test_max_num_seqs_becomes_a_capture_size(sizes, max_size, n, want):
    """vLLM captures FULL decode graphs for capture sizes <= max_num_seqs only, and pads a decode
    batch to the next capture size: a full batch of max_num_seqs rows must be one of them."""
    from types import SimpleNamespace

    from vllm_hisparse.vllm.graph_mode import capture_full_batch

    vc = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_capture_sizes=list(sizes),
                                                            max_cudagraph_capture_size=max_size),
                         scheduler_config=SimpleNamespace(max_num_seqs=n))
    capture_full_batch(vc)
    assert vc.compilation_config.cudagraph_capture_sizes == want


@pytest.mark.parametrize("dense_pool_gib, blocked", [(0, True), (0.5, False)])
def test_dense_layers_without_a_dense_pool_block_full_graphs(dense_pool_gib, blocked):
    """Default dense layers without a dense pool (dense_pool_gib 0: auto would size one) block
    FULL graphs (an engine where no request can be sparse is stock vLLM's: serve_as_stock)."""
    import torch

    from vllm_hisparse.vllm import graph_mode

    cfg = fake_config(model_config__max_model_len=1024, model_config__dtype=torch.bfloat16,
                      model_config__get_head_size=lambda: 128,
                      parallel_config__data_parallel_size=1, parallel_config__use_ubatching=False)
    cfg.additional_config = {"hisparse": dict(HS["hisparse"], dense_layers=[0, 1],
                                              dense_pool_gib=dense_pool_gib)}
    why = graph_mode.blocker(cfg)
    assert (why is not None) is blocked
    if blocked:
        assert "dense_pool_gib" in why


@pytest.mark.parametrize("ids, upper, bad", [
    ([0, 511], True, None), ([], True, None), ([5, 512, 7], True, 512), ([3, -1, 600], True, -1),
    ([5, 512], False, None), ([5, -2], False, -2),
])
def test_prompt_id_error(ids, upper, bad):
    from vllm_hisparse.vllm.plugin import prompt_id_error

    why = prompt_id_error(ids, 512, upper=upper)
    assert why == (None if bad is None else
                   f"Token id {bad} is out of vocabulary: this model's prompt token ids are 0 to 511")


@pytest.mark.parametrize("backend, multimodal, refused", [
    ("hisparse", False, [512, -1]), ("hisparse", True, [-1]), ("auto", False, []),
    ("as stock", False, [512, -1]),
])
def test_prompt_ids_checked_only_where_hisparse_runs(backend, multimodal, refused):
    """vLLM's own check lets the id vocab_size through (an HF tokenizer's max_token_id is its
    vocab_size); the wrapped one refuses it, and negative ids, in a run that asked for hisparse
    only, also where no request can be sparse and vLLM's own backend serves ("as stock":
    setup_check.serve_as_stock's mark)."""
    from vllm.config.attention import AttentionConfig
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_hisparse.vllm.plugin import register

    register()
    mc = SimpleNamespace(get_vocab_size=lambda: 512, is_multimodal_model=multimodal)
    from vllm_hisparse.vllm.setup_check import AS_STOCK

    stock = backend == "as stock"
    proc = SimpleNamespace(
        vllm_config=SimpleNamespace(attention_config=SimpleNamespace(
            backend=AttentionConfig.validate_backend_before("auto" if stock else backend)),
            additional_config={AS_STOCK: True} if stock else {}),
        model_config=mc, tokenizer=SimpleNamespace(max_token_id=512),
        _validate_prompt_len=lambda n, kind: None)
    for t in (511, 512, -1):
        inp = {"type": "token", "prompt_token_ids": [5, t, 7]}
        if t in refused:
            with pytest.raises(ValueError, match=f"Token id {t} is out of vocabulary: this model"):
                InputProcessor._validate_model_input(proc, inp, "decoder")
        else:
            InputProcessor._validate_model_input(proc, inp, "decoder")
