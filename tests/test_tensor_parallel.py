"""Tensor parallelism (issue 18): host_pool_gib is the engine's total, each rank allocates its share
(its own KV heads of the same page ids); startup refuses pools that the ranks on this host cannot
hold, naming host_pool_gib and a value that fits; HISPARSE_* settings reach Ray workers;
`hisparse calc --tensor-parallel-size`; and, on the CPU engine with vLLM's mp executor, hisparse at
TP=2 gives the tokens and logprobs of resident mode at TP=2.

The GPU run (two GPUs, mp and Ray executors) is scripts/gpu_tp.sh."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engine_jobs import tiny_model
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import capacity as cap
from vllm_hisparse.core import host_pool
from vllm_hisparse.core.host_pool import HostPoolTooLarge, check_host_room

GIB = 1 << 30
MEM = {"total": int(125.8 * GIB), "available": 120 * GIB}        # a 128 GiB GPU host


def test_each_rank_pins_its_share():
    assert cap.host_pool_rank_bytes(90 * GIB, 2) == 45 * GIB
    assert cap.host_pool_rank_bytes(90 * GIB + 1, 2) == 45 * GIB       # never more than the total
    assert [cap.rank_kv_heads(8, tp) for tp in (1, 2, 8, 16)] == [8, 4, 1, 1]   # 16: replicated


@pytest.mark.vllm
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_every_rank_has_the_pages_of_one_rank_engine(tp):
    """Scheduler and workers size the pool with the deployment's host_pages: at any TP it holds
    the pages of the same pool at TP=1 (Llama-3-8B, 8 KV heads), in 1/TP of the bytes per rank."""
    import torch

    from vllm_hisparse.vllm.deployment import deployment_of

    cfg = HiSparseConfig(host_pool_gib=90)
    mc = SimpleNamespace(get_num_layers=lambda pc: 32, get_head_size=lambda: 128,
                         get_num_kv_heads=lambda pc: cap.rank_kv_heads(8, pc.tensor_parallel_size),
                         dtype=torch.bfloat16, max_model_len=32768)

    def host_pages_capacity(cfg, mc, pc):
        return deployment_of(SimpleNamespace(additional_config={"hisparse": cfg}, model_config=mc,
                                             parallel_config=pc)).host_pages

    pages = host_pages_capacity(cfg, mc, SimpleNamespace(tensor_parallel_size=tp))
    assert pages == host_pages_capacity(cfg, mc, SimpleNamespace(tensor_parallel_size=1)) == 46080
    rank_bytes = pages * 32 * 2 * 16 * (8 // tp) * 128 * 2                 # what each rank allocates
    assert rank_bytes * tp == 90 * GIB


def test_ranks_on_one_host_are_refused_together():
    """TP=2 with the README's 90 GiB on a 128 GiB host fits (each rank 45 GiB); 180 GiB does not,
    and the value suggested in the message passes the same check."""
    check_host_room(90, cap.host_pool_rank_bytes(90 * GIB, 2), 2, 2, True, MEM)
    with pytest.raises(HostPoolTooLarge) as e:
        check_host_room(180, cap.host_pool_rank_bytes(180 * GIB, 2), 2, 2, True, MEM)
    assert str(e.value) == (
        "hisparse: host_pool_gib=180 needs 180.00 GiB of pinned host memory on this host "
        "(2 ranks x 90.00 GiB), more than 90% of the 120.00 GiB it can still give (this machine "
        "has 125.8 GiB of RAM, 120.0 GiB available now); lower host_pool_gib to about 72 (60% of "
        "the available memory)")
    check_host_room(72, cap.host_pool_rank_bytes(72 * GIB, 2), 2, 2, True, MEM)


@pytest.mark.parametrize("mem,ranks_here,fix", [
    # a container: 64 GiB limit, 10 GiB of it used, so 54 GiB of room whatever the host has
    (dict(MEM, limit=64 * GIB, used=10 * GIB), 2,
     "container memory limit of 64.0 GiB, 10.0 GiB of it in use); lower host_pool_gib to about 32 "),
    # two nodes, one rank each: this host pins half of the total
    (MEM, 1, "lower host_pool_gib to about 144 (60% of the available memory on this host)"),
])
def test_room_is_the_tighter_of_ram_and_container(mem, ranks_here, fix):
    with pytest.raises(HostPoolTooLarge) as e:
        check_host_room(300, cap.host_pool_rank_bytes(300 * GIB, 2), 2, ranks_here, True, mem)
    assert fix in str(e.value) and "\n" not in str(e.value)


def test_a_rank_that_cannot_pin_its_share_says_so():
    err = host_pool.HostPoolPinError(45 * GIB, "CUDA error: out of memory", 90, True, ranks=2)
    assert "pin 45.00 GiB of host memory for the host KV pool (host_pool_gib=90, this rank's " \
           "share of 2):" in str(err)


def test_unknown_room_is_not_checked():
    check_host_room(10 ** 6, 10 ** 6 * GIB, 1, 1, True, {})


@pytest.mark.vllm
def test_vllm_config_at_tp2_refuses_an_oversized_pool(monkeypatch):
    """Through vLLM's own config building (EngineArgs.create_engine_config, TP=2): refused before
    any worker starts; a pool that fits passes and sets no other limit."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_hisparse.vllm.plugin import register
    from vllm_hisparse.vllm.setup_check import RAY_PREFIXES

    register()
    monkeypatch.setattr(host_pool, "host_memory", lambda: dict(MEM))
    monkeypatch.setenv(RAY_PREFIXES, "")              # the startup check adds to it: restored after
    model = tiny_model()

    def config(gib):
        return EngineArgs(model=model, tensor_parallel_size=2, attention_backend="hisparse",
                          dtype="float32", max_model_len=256,
                          additional_config={"hisparse": {"top_k": 48, "device_buffer_size": 64,
                                                          "host_pool_gib": gib}}
                          ).create_engine_config()

    with pytest.raises(ValueError, match=r"hisparse: host_pool_gib=200 needs 200\.00 GiB of host "
                                         r"memory on this host \(2 ranks x 100\.00 GiB\).*lower "
                                         r"host_pool_gib to about 72 "):
        config(200)
    assert config(100).parallel_config.tensor_parallel_size == 2


@pytest.mark.vllm
def test_the_engine_cores_second_config_check_passes_its_own_pinned_pool(monkeypatch):
    """vLLM's engine core runs VllmConfig.__post_init__ (so our platform check) again after its
    workers pinned the pools, on the config it got pickled from the front end; the RAM still
    available then no longer holds the pool (on the H200 an 84 GiB pool on 125.8 GiB refused
    itself there). The room is checked once per engine: the second run passes; a new config on
    the same short memory is refused."""
    import pickle

    from vllm.engine.arg_utils import EngineArgs

    from vllm_hisparse.vllm.plugin import register
    from vllm_hisparse.vllm.setup_check import RAY_PREFIXES

    register()
    mem = dict(MEM)
    monkeypatch.setattr(host_pool, "host_memory", lambda: dict(mem))
    monkeypatch.setenv(RAY_PREFIXES, "")
    model = tiny_model()

    def config():
        return EngineArgs(model=model, attention_backend="hisparse", dtype="float32",
                          max_model_len=256,
                          additional_config={"hisparse": {"top_k": 48, "device_buffer_size": 64,
                                                          "host_pool_gib": 84}}
                          ).create_engine_config()

    vc = config()                                 # the front end: 84 of 120 GiB available
    mem["available"] -= 84 * GIB                  # the workers pinned it
    core = pickle.loads(pickle.dumps(vc))         # what the engine core process gets
    core.__post_init__()                          # EngineCore._perform_handshakes' last line
    with pytest.raises(ValueError, match=r"host_pool_gib=84 needs 84\.00 GiB"):
        config()


@pytest.mark.vllm
def test_hisparse_env_reaches_ray_workers(monkeypatch):
    """vLLM's Ray executor copies the variables get_env_vars_to_copy names (vllm/ray/ray_env.py,
    its own function, called here as the executor calls it); after the startup check it names
    HISPARSE_* too, keeping a user's own extra prefixes, once. (Ray is not installed on the CPU box:
    the GPU script scripts/gpu_tp.sh runs a Ray engine and checks each rank's stats file.)"""
    from vllm.ray.ray_env import get_env_vars_to_copy

    from vllm_hisparse.vllm.setup_check import RAY_PREFIXES, copy_env_to_ray_workers

    monkeypatch.setenv("HISPARSE_STATS_FILE", "/tmp/stats.json")
    monkeypatch.setenv(RAY_PREFIXES, "MYAPP_")
    assert "HISPARSE_STATS_FILE" not in get_env_vars_to_copy(exclude_vars=set())
    copy_env_to_ray_workers()
    copy_env_to_ray_workers()
    assert os.environ[RAY_PREFIXES] == "MYAPP_,HISPARSE_"
    names = get_env_vars_to_copy(exclude_vars=set())
    assert "HISPARSE_STATS_FILE" in names and RAY_PREFIXES in names


LLAMA3_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "torch_dtype": "bfloat16"}


def calc_json(model_dir, *argv):
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", str(model_dir),
                        *map(str, argv), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_calc_tensor_parallel(tmp_path):
    """TP=2: per-GPU KV bytes and Quest rows halve, the host pool keeps its pages (each rank pins
    half of --host-gib), a request's host bytes stay the engine's; with the same per-GPU KV twice
    the requests fit the GPUs, and the host pool still bounds hisparse at the same count."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ("--context", 32768, "--gpu-kv-gib", 100, "--host-gib", 90, "--max-num-seqs", 16,
            "--dense-pool-gib", 0, "--quest-rows", 0)    # the sizes given (no auto sizing)
    one = calc_json(tmp_path, *args)
    two = calc_json(tmp_path, *args, "--tensor-parallel-size", 2)
    h1, h2, b1, b2 = one["hisparse"], two["hisparse"], one["baseline"], two["baseline"]
    assert two["tensor_parallel_size"] == 2
    assert b2["gpu_bytes_per_request"] * 2 == b1["gpu_bytes_per_request"] == 4 * GIB
    assert h2["gpu_bytes_per_request"] * 2 == h1["gpu_bytes_per_request"]
    assert h2["quest_meta_bytes_per_request"] * 2 == h1["quest_meta_bytes_per_request"]
    assert h2["host_pool_pages"] == h1["host_pool_pages"] == 46080
    assert h2["host_pool_bytes_per_rank"] == 45 * GIB and h1["host_pool_bytes_per_rank"] == 90 * GIB
    assert h2["host_bytes_per_request"] == h1["host_bytes_per_request"] == 4 * GIB
    assert (b1["max_requests"], b2["max_requests"]) == (16, 16)          # --max-num-seqs 16
    assert calc_json(tmp_path, "--context", 32768, "--gpu-kv-gib", 100, "--host-gib", 90,
                     "--tensor-parallel-size", 2)["baseline"]["max_requests"] == 49   # 24 at TP=1
    for h in (h1, h2):
        assert (h["max_requests"], h["bound_by"]) == (16, "max_num_seqs")
    bad = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli", "calc", "--model", str(tmp_path),
                          "--context", "100", "--gpu-kv-gib", "1", "--host-gib", "1",
                          "--tensor-parallel-size", "3"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--tensor-parallel-size 3: vLLM splits the model's 8 KV heads" \
        in bad.stderr


# ---- the CPU engine at TP=2 (vLLM's mp executor: two worker processes) --------------------------
def _cpu_bind() -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for two CPU workers, one core each: vLLM's automatic binding wants
    a NUMA node per worker, and this box has one."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}|{cpus[1]}" if len(cpus) >= 2 else None


@pytest.mark.vllm
@pytest.mark.slow
def test_tp2_hisparse_equals_resident_on_cpu(tmp_path, monkeypatch):
    """Two engines at TP=2 (~75-95 s each on 2 cores): hisparse (misses on most steps) gives the
    tokens and logprobs of resident mode; each rank selected and fetched for its own KV head
    (hits differ between ranks, rows do not), allocated half of host_pool_gib for the pages of
    the whole pool, and ended with nothing held."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CPU engine test; two GPUs: scripts/gpu_tp.sh")
    bind = _cpu_bind()
    if bind is None:
        pytest.skip("needs two CPU cores")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    from engine_generate import MAX_TOKENS, generate
    from test_vllm_engine import CFG, MIN_CONTEXT, PAGE, prompts

    model = tiny_model()
    cfg = dict(CFG, min_context=MIN_CONTEXT)
    tp = ["--tensor-parallel-size", "2"]
    resident = generate(tmp_path, model, dict(cfg, host_tier=False), [prompts()], "tp-resident", tp)
    hisparse = generate(tmp_path, model, cfg, [prompts()], "tp-hisparse", tp)
    for i, (r, h) in enumerate(zip(resident["batches"][0], hisparse["batches"][0], strict=True)):
        assert len(h["tokens"]) == MAX_TOKENS
        assert h["tokens"] == r["tokens"], f"request {i}: tokens differ"
        assert h["logprobs"] == r["logprobs"], f"request {i}: logprobs differ"
    ranks = hisparse["rank_stats"]
    assert len(ranks) == 2
    share = cap.host_pool_rank_bytes(HiSparseConfig.from_dict(cfg).host_pool_bytes, 2)
    one_rank_page = 4 * 2 * PAGE * 1 * 32 * 4       # 4 layers, K+V, 1 of the 2 KV heads, D 32, fp32
    for s in ranks:
        assert s["misses"] > 0 and s["decode_rows"] == ranks[0]["decode_rows"] > 0
        assert s["host_pool_pages"] == share // one_rank_page
        assert share - one_rank_page < s["host_pool_bytes"] <= share
        assert s["host_pages_used"] == 0 and s["live_requests"] == 0
