"""The DSA latent pool leaving vLLM no KV cache (issue 46, the ninth box's util-0.52 start): the
suggested settings fit by vLLM's own arithmetic (core/latent_fit.py), and the worker's check
(vllm/kv_room.py) reaches `vllm serve`'s user as one line and exit 2 across the engine's process
boundary (cli_check.report / guard), without a GPU."""
from __future__ import annotations

import math
import multiprocessing
import sys
from types import SimpleNamespace

import pytest

from vllm_hisparse.config import HiSparseConfigError
from vllm_hisparse.core.deployment import LatentSizes
from vllm_hisparse.core.latent_fit import LatentFit, message

GIB = 1 << 30
H100 = dict(total=int(79.19 * GIB), free=int(78.7 * GIB))
# the ninth box's first try (docs/gpu-results.md): 16 layers, max_model_len 32K + 2K, B = 4096,
# quest_rows 44, prefill_slots 2; vLLM said "Available KV cache memory: -1.75 GiB"
LAYERS, MML, B = 16, 34816, 4096
REQUEST = LAYERS * math.ceil(MML / 64) * 64 * (16 + 132)     # stub + indexer K, vLLM's blocks


def ninth_box(**over) -> LatentFit:
    from vllm_hisparse.vllm.mla_worker import pool_bytes

    s = LatentSizes(row_bytes=1152, row_sets=1, regions=0, host_rows=0, resident=False)
    kw = dict(available=int(-1.75 * GIB), request=REQUEST, quest_rows=44,
              row_bytes=pool_bytes(s, LAYERS, MML, B), prefill_slots=2,
              slot_bytes=LAYERS * MML * 1152, util=0.52, **H100)
    return LatentFit(**dict(kw, **over))


def room(f: LatentFit, q=None, p=None, u=None) -> int:
    """vLLM's KV bytes, written out again (not through LatentFit.room)."""
    q, p, u = (f.quest_rows if q is None else q), (f.prefill_slots if p is None else p), (
        f.util if u is None else u)
    return (f.available + (f.quest_rows - q) * f.row_bytes + (f.prefill_slots - p) * f.slot_bytes
            + math.ceil(f.total * u) - math.ceil(f.total * f.util))


def enough(f: LatentFit, q=None, p=None, u=None) -> bool:
    r = room(f, q, p, u)
    return r > 0 and r >= max(f.quest_rows if q is None else q, 1) * f.request


# ---- the arithmetic -----------------------------------------------------------------------------
def test_the_ninth_box_line():
    f = ninth_box()
    assert f.short() and f.fitting_quest_rows() == 9 and f.needed_util() == 0.59
    assert message(f, f"2 prefill regions of {MML:,} rows + 44 row sets of B={B}", LAYERS, MML) == (
        "hisparse: the DSA latent pool (4.41 GiB: 2 prefill regions of 34,816 rows + 44 row sets "
        "of B=4096, 16 layers) leaves vLLM -1.75 GiB for its KV cache at "
        "gpu_memory_utilization=0.52 (it needs 0.08 GiB for each of the pool's 44 requests of "
        "34,816 tokens); lower quest_rows to 9 (or prefill_slots / device_buffer_size), or raise "
        "gpu_memory_utilization to 0.59")


SIZES = [   # available, request, quest_rows, row_bytes, prefill_slots, slot_bytes (MiB)
    (-1792, 78, 44, 75, 2, 612),       # the ninth box, rounded
    (-1, 10, 2, 100, 1, 50),           # 1 MiB short, two row sets: one is enough
    (0, 10, 40, 1, 3, 100),            # vLLM's "<= 0": 0 left, row sets small, regions big
    (5, 10, 8, 2, 1, 10),              # room for less than one request
    (-500, 20, 300, 3, 4, 200),        # many small row sets
]


@pytest.mark.parametrize("avail,req,q,rb,p,sb", SIZES)
def test_each_suggestion_is_the_largest_that_fits(avail, req, q, rb, p, sb):
    f = LatentFit(available=avail * 2**20, request=req * 2**20, quest_rows=q, row_bytes=rb * 2**20,
                  prefill_slots=p, slot_bytes=sb * 2**20, util=0.5, **H100)
    assert f.short()
    n = f.fitting_quest_rows()
    if n is not None:
        assert enough(f, q=n) and not any(enough(f, q=k) for k in range(n + 1, q))
    else:
        assert not any(enough(f, q=k) for k in range(1, q))
    s = f.fitting_prefill_slots()
    assert s is None or (enough(f, p=s) and not any(enough(f, p=k) for k in range(s + 1, p)))
    u = f.needed_util()
    assert enough(f, u=u) and not enough(f, u=round(u - 0.01, 2))
    line = message(f, "x", 4, 1024)
    assert "\n" not in line and (f"lower quest_rows to {n} " in line if n else
                                 "no quest_rows value fits" in line)
    assert f"raise gpu_memory_utilization to {u:g}" in line


def test_no_quest_rows_value_fits():
    """A region alone leaves vLLM nothing: the line names the other fields and the utilization."""
    f = ninth_box(available=int(-6 * GIB))
    assert f.fitting_quest_rows() is None and f.fitting_prefill_slots() is None
    assert not enough(f, q=1)
    u = f.needed_util()
    assert enough(f, u=u) and not enough(f, u=round(u - 0.01, 2))
    assert message(f, "x", LAYERS, MML).endswith(
        f"; no quest_rows value fits: lower prefill_slots or device_buffer_size, or raise "
        f"gpu_memory_utilization to {u:g}")
    f = ninth_box(available=-GIB // 2, quest_rows=1)       # 1 row set: only the region helps
    assert f.fitting_quest_rows() is None and f.fitting_prefill_slots() == 1
    assert enough(f, p=1) and "no quest_rows value fits: lower prefill_slots to 1 or " \
                              "device_buffer_size, or raise" in message(f, "x", LAYERS, MML)


def test_a_utilization_the_gpu_cannot_give():
    f = ninth_box(free=int(0.53 * H100["total"]))         # another process holds the rest
    assert not f.util_possible(f.needed_util())
    assert message(f, "x", LAYERS, MML).endswith(
        "lower quest_rows to 9 (or prefill_slots / device_buffer_size), or free GPU memory "
        "(gpu_memory_utilization=0.59 would fit; only 0.53 of the GPU was free)")
    f = ninth_box(available=int(-70 * GIB))               # not even all of it
    assert f.needed_util() is None and "gpu_memory_utilization to" not in message(f, "x", 1, 1)


def test_resident_mode_names_quest_rows_and_max_model_len():
    region = LAYERS * MML * 1152
    f = LatentFit(available=-GIB, request=REQUEST, quest_rows=8, row_bytes=region,
                  prefill_slots=0, slot_bytes=0, util=0.5, **H100)
    n = f.fitting_quest_rows()
    assert n == 5 and enough(f, q=5) and not enough(f, q=6)
    assert "; lower quest_rows to 5 (or --max-model-len), or raise" in message(f, "x", 16, MML)


def test_enough_room_is_not_short():
    assert not ninth_box(available=REQUEST).short() and ninth_box(available=REQUEST - 1).short()
    assert ninth_box(available=0, request=0).short()       # vLLM's "<= 0" even without a request


# ---- the worker's check and the front end's line -----------------------------------------------
def served_config(tmp_path, monkeypatch, **cache):
    """A DSA engine's config as prepare_config leaves it (test_dsa_setup's fake model)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_dsa_setup import mla_config

    from vllm_hisparse.vllm.setup_check import prepare_config

    cfg = mla_config({"quest_rows": 4, "prefill_slots": 2})
    prepare_config(cfg)
    for k, v in {"gpu_memory_utilization": 0.52, "kv_cache_memory_bytes": None, **cache}.items():
        setattr(cfg.cache_config, k, v)
    return cfg


class FakeSpec:
    def __init__(self, nbytes):
        self.nbytes = nbytes

    def max_memory_usage_bytes(self, vllm_config):
        return self.nbytes


def fake_worker_cls(available):
    """vLLM's GPU Worker as kv_room reads it: its config, its start snapshot, its layers' specs,
    and determine_available_memory returning what the profile found."""
    class Worker:
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config
            self.init_snapshot = SimpleNamespace(total_memory=100 * GIB, free_memory=99 * GIB)

        def get_kv_cache_spec(self):
            return {f"layers.{i}.attn": FakeSpec(64 << 10) for i in range(4)}

        def determine_available_memory(self):
            return available

    return Worker


@pytest.fixture
def front_end(tmp_path, monkeypatch):
    """What check_namespace does for `vllm serve`: a file named for the engine's reports."""
    from vllm_hisparse.vllm import cli_check

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv(cli_check.ENGINE_ERROR_ENV, "")           # restored after the test
    cli_check.expect_engine_errors()
    return cli_check


def test_engine_start_failure_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, front_end):
    """The engine core (a forked child here) fails in the wrapped determine_available_memory; the
    front end sees only vLLM's RuntimeError and prints the child's line, exit 2."""
    from vllm_hisparse.vllm import kv_room

    cfg = served_config(tmp_path, monkeypatch)
    Worker = fake_worker_cls(-(1 << 20))                          # 1 MiB short
    kv_room.install(Worker)
    kv_room.install(Worker)                                       # idempotent

    def engine_core():
        Worker(cfg).determine_available_memory()

    def serve():
        child = multiprocessing.get_context("fork").Process(target=engine_core)
        child.start()
        child.join()
        raise RuntimeError("Engine core initialization failed. See root cause above. Failed core "
                           f"proc(s): {{'EngineCore': {child.exitcode}}}")

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        front_end.guard(serve)()
    err = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2
    assert err == (
        "hisparse: the DSA latent pool (0.01 GiB: 2 prefill regions of 1,024 rows + 4 row sets of "
        "B=128, 4 layers) leaves vLLM -1.0 MiB for its KV cache at gpu_memory_utilization=0.52 (it "
        "needs 0.2 MiB for each of the pool's 4 requests of 1,024 tokens); lower quest_rows to 1 "
        "(or prefill_slots to 1 / device_buffer_size), or raise gpu_memory_utilization to 0.53")
    with pytest.raises(HiSparseConfigError) as raised:            # the same line, in-process
        Worker(cfg).determine_available_memory()
    assert str(raised.value) == err
    assert front_end.engine_error() == err and front_end.engine_error() is None   # read once


def test_suggestion_from_the_worker_fits(tmp_path, monkeypatch):
    from vllm_hisparse.vllm import kv_room
    from vllm_hisparse.vllm.deployment import deployment_of
    from vllm_hisparse.vllm.mla_worker import pool_bytes

    cfg = served_config(tmp_path, monkeypatch)
    w = fake_worker_cls(-GIB)(cfg)
    fit, pool = kv_room.fit_of(w, -GIB)
    dep = deployment_of(cfg)
    assert fit.quest_rows * fit.row_bytes + fit.prefill_slots * fit.slot_bytes == pool_bytes(
        dep.latent, dep.limits.num_layers, 1024, dep.cfg.device_buffer_size)
    assert (fit.quest_rows, fit.prefill_slots, fit.request) == (4, 2, 256 << 10)
    assert pool == "2 prefill regions of 1,024 rows + 4 row sets of B=128"


def test_no_error_with_room_or_a_fixed_kv_size(tmp_path, monkeypatch, front_end):
    from vllm_hisparse.vllm import kv_room

    cfg = served_config(tmp_path, monkeypatch)
    Worker = fake_worker_cls(256 << 10)                           # one request: vLLM starts
    kv_room.install(Worker)
    assert Worker(cfg).determine_available_memory() == 256 << 10
    cfg = served_config(tmp_path, monkeypatch, kv_cache_memory_bytes=GIB)
    Worker = fake_worker_cls(-GIB)                                # no profile: not ours to judge
    kv_room.install(Worker)
    assert Worker(cfg).determine_available_memory() == -GIB
    assert front_end.engine_error() is None


def test_other_engine_failures_keep_their_traceback(front_end):
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        front_end.guard(lambda: (_ for _ in ()).throw(
            RuntimeError("Engine core initialization failed")))()


def test_without_a_front_end_the_error_is_raised_only(tmp_path, monkeypatch):
    """An LLM in a script: no file is named, the engine's traceback ends in the line."""
    from vllm_hisparse.vllm import cli_check, kv_room

    monkeypatch.delenv(cli_check.ENGINE_ERROR_ENV, raising=False)
    cfg = served_config(tmp_path, monkeypatch)
    Worker = fake_worker_cls(-GIB)
    kv_room.install(Worker)
    with pytest.raises(HiSparseConfigError, match="^hisparse: the DSA latent pool"):
        Worker(cfg).determine_available_memory()
    assert cli_check.engine_error() is None and not list(tmp_path.iterdir())


def test_check_namespace_names_the_file(tmp_path, monkeypatch):
    from vllm_hisparse.vllm import cli_check

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv(cli_check.ENGINE_ERROR_ENV, "")
    ns = SimpleNamespace(attention_backend="hisparse", dispatch_function=lambda args: 0,
                         additional_config={"hisparse": {"indexer": "dsa", "top_k": 64,
                                                         "device_buffer_size": 128}})
    cli_check.check_namespace(ns)
    assert getattr(ns.dispatch_function, "_hisparse", False)
    path = __import__("os").environ[cli_check.ENGINE_ERROR_ENV]
    assert path.startswith(str(tmp_path)) and path.endswith(".txt")


def test_install_wraps_vllms_gpu_worker(monkeypatch):
    """The symbol exists in this vLLM and the wrap calls the original first (restored after)."""
    from vllm_hisparse.vllm import kv_room
    from vllm_hisparse.vllm.compat import gpu_worker_cls

    Worker = gpu_worker_cls()
    assert Worker.__module__ == "vllm.v1.worker.gpu_worker"
    monkeypatch.setattr(Worker, "determine_available_memory", lambda self: 7)
    kv_room.install()
    wrapped = Worker.determine_available_memory
    assert wrapped._hisparse and wrapped.__wrapped__(None) == 7
    seen = []
    monkeypatch.setattr(kv_room, "check", lambda w, avail: seen.append(avail))
    assert wrapped(SimpleNamespace()) == 7 and seen == [7]


def test_pool_over_its_budget_at_start_is_one_line_for_the_front_end(front_end):
    """LatentWorker.start's earlier check (the pool against half of what vLLM may still use,
    before the profile): the same road as kv_room's, one line left for the front end and raised
    as a config error; a pool within its budget passes."""
    from vllm_hisparse.vllm.mla_worker import pool_bytes, refuse_over_budget

    s = LatentSizes(row_bytes=1152, row_sets=44, regions=2, host_rows=0, resident=False)
    need = pool_bytes(s, LAYERS, MML, B)
    refuse_over_budget(need, need, s, B, MML, LAYERS)              # at the budget: no error
    assert front_end.engine_error() is None
    with pytest.raises(HiSparseConfigError) as raised:
        refuse_over_budget(need, need - 1, s, B, MML, LAYERS)
    line = str(raised.value)
    assert "\n" not in line and line.startswith("hisparse: the latent pool needs ")
    assert f"regions=2 x max_model_len={MML}, row sets=44 x device_buffer_size={B}" in line
    assert "lower prefill_slots, quest_rows or --max-model-len" in line
    assert front_end.engine_error() == line
