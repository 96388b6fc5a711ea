"""Startup failures that used to die in raw CUDA errors now say what to change (CPU tests):
pinning the host pool (host_pool_gib too large for the machine) and reserving the Quest page
bounds (max_num_seqs x max_model_len too large for the GPU)."""
import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core import capacity as cap
from vllm_hisparse.core import host_pool
from vllm_hisparse.core.host_pool import HostKVPool, HostPoolPinError

GIB, MIB = 1 << 30, 1 << 20
LLAMA3_8B = cap.ModelShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
MEM = {"total": int(125.8 * GIB), "available": 100 * GIB}      # a 128 GiB box, 100 GiB available
H200 = {"free": 139 * GIB, "total": 140 * GIB}


# ---- host pool pinning --------------------------------------------------------------------------
@pytest.fixture
def pin_fails(monkeypatch):
    """Pinning the pool (core/pinned.py) raises what CUDA raised on the H200; the rest is real."""
    def pinned_empty(shape, dtype):
        raise torch.AcceleratorError("CUDA error: out of memory\nSearch for `cudaErrorMemory...")

    monkeypatch.setattr(host_pool, "pinned_empty", pinned_empty)
    monkeypatch.setattr(host_pool, "host_memory", lambda: dict(MEM))


def test_pin_failure_says_size_ram_and_fix(pin_fails):
    pages = 80 * GIB // (32 * HostKVPool.page_bytes(16, 8, 128, torch.bfloat16))   # 80 GiB, Llama-3-8B
    with pytest.raises(HostPoolPinError) as e:
        HostKVPool(32, pages, 16, 8, 128, torch.bfloat16, pin=True)
    assert str(e.value) == (
        "hisparse: could not pin 80.00 GiB of host memory for the host KV pool (set by "
        "host_pool_gib): this machine has 125.8 GiB of RAM, 100.0 GiB available now; lower "
        "host_pool_gib to about 60 (60% of the available memory) (torch: CUDA error: out of memory)")
    assert isinstance(e.value, RuntimeError) and isinstance(e.value.__cause__, torch.AcceleratorError)
    assert e.value.nbytes == 80 * GIB


def test_pin_failure_with_the_config_value(pin_fails):
    """The connector re-raises with host_pool_gib's value (it knows the config, the pool does not)."""
    err = HostPoolPinError(80 * GIB, "CUDA error: out of memory", host_pool_gib=80)
    assert "pin 80.00 GiB of host memory for the host KV pool (host_pool_gib=80):" in str(err)


@pytest.mark.parametrize("mem,fix", [
    (dict(MEM, limit=64 * GIB), "container memory limit of 64.0 GiB; lower host_pool_gib to about 38 "),
    ({"total": 4 * GIB, "available": GIB}, "lower host_pool_gib to about 0.6 "),
    ({"total": 4 * GIB, "available": 0}, "free host memory (other processes hold it) or lower "),
    ({}, "an unknown amount of RAM; lower host_pool_gib (torch"),
])
def test_pin_failure_message_cases(mem, fix):
    msg = host_pool.pin_failure_message(GIB, "x", 1.0, True, mem)
    assert fix in msg and "\n" not in msg


def test_host_memory_reads_this_machine():
    mem = host_pool.host_memory()
    assert mem["total"] > 0 and 0 <= mem["available"] <= mem["total"]


def test_unpinned_pool_is_unchanged():
    pool = HostKVPool(2, 3, 4, 1, 8, torch.float32, pin=False)
    assert pool.data.shape == (2, 3, 2, 4, 1, 8) and not pool.data.is_pinned()


# ---- Quest page bounds --------------------------------------------------------------------------
ROW = cap.indexer_row_bytes("quest", LLAMA3_8B, 32768, 16, 2)             # 240 MiB per sequence


def test_quest_budget_is_half_of_what_vllm_may_use():
    # 139 GiB free of 140; gpu_memory_utilization=0.9 leaves 14 GiB to others: half of 125 GiB
    assert cap.reservation_budget_bytes(H200["free"], H200["total"], 0.9) == int(62.5 * GIB)
    assert cap.reservation_budget_bytes(H200["free"], H200["total"]) == int(69.5 * GIB)
    assert cap.reservation_budget_bytes(10 * GIB, H200["total"], 0.9) == 0    # others hold the rest


def test_quest_budget_of_an_engine_sharing_the_gpu():
    """Engines side by side on one GPU (the exactness runs: 0.12 each): another engine's memory
    is not this one's to count; this one may take its share less what it holds, within the free."""
    total, free, used = H200["total"], 100 * GIB, 2 * GIB
    own = int(0.12 * total) - used
    assert cap.reservation_budget_bytes(free, total, 0.12, used) == int(own * 0.5)
    assert cap.reservation_budget_bytes(free, total, 0.12) == 0         # counted as this one's
    assert cap.reservation_budget_bytes(own // 2, total, 0.12, used) == int(own // 2 * 0.5)
    alone = H200["total"] - H200["free"]              # one engine: what it holds is total - free
    assert cap.reservation_budget_bytes(H200["free"], total, 0.9, alone) == int(62.5 * GIB)


def test_quest_reservation_names_flags_and_largest_fit():
    budget = cap.reservation_budget_bytes(H200["free"], H200["total"], 0.9)
    assert ROW == 240 * MIB
    with pytest.raises(ValueError) as e:
        cap.check_indexer_reservation(1024, ROW, budget, 32768, 16)    # vLLM's default on an H200
    assert str(e.value) == (
        "hisparse: the Quest page bounds for max_num_seqs=1024 sequences of max_model_len=32768 "
        "tokens (page_size=16) need 240.23 GiB of GPU memory (240.0 MiB per sequence), more than "
        "the 62.50 GiB allowed (50% of the GPU memory vLLM may still use); set the hisparse config's "
        "quest_rows to 265 (the most within that limit: long requests beyond it wait) or lower "
        "--max-num-seqs or --max-model-len")                          # + the scratch row
    cap.check_indexer_reservation(265, ROW, budget, 32768, 16)         # the suggestion fits
    with pytest.raises(ValueError, match="quest_rows to 265 "):
        cap.check_indexer_reservation(266, ROW, budget, 32768, 16)


def test_quest_reservation_when_not_one_sequence_fits():
    with pytest.raises(ValueError, match=r"lower --max-model-len \(not even one sequence fits\)$"):
        cap.check_indexer_reservation(1, ROW, ROW - 1, 32768, 16)


class _Reservations:
    """A fresh worker object's reservations (vllm/gqa_worker.py ``HiSparseWorker``) for an engine
    of the given limits; the last one's indexer state and dense pool stay readable here."""

    def __init__(self, gqa_worker):
        self.mod, self.logger = gqa_worker, gqa_worker.logger
        self.indexer_state = self.dense_pool = None

    def _worker(self, cfg, layers, mml, rows, heads, head_dim, dtype):
        from vllm_hisparse.core.deployment import EngineLimits, resolve

        return self.mod.HiSparseWorker(resolve(cfg, EngineLimits(layers, mml, rows, heads,
                                                                 head_dim, dtype.itemsize)))

    def ensure_indexer_state(self, cfg, num_layers, rows, max_model_len, num_kv_heads, head_dim,
                             dtype, gpu_memory_utilization=None):
        w = self._worker(cfg, num_layers, max_model_len, rows, num_kv_heads, head_dim, dtype)
        w.reserve_indexer_state(dtype, gpu_memory_utilization)
        self.indexer_state = w.indexer_state

    def ensure_dense_pool(self, cfg, num_kv_heads, head_dim, dtype, max_num_seqs, max_model_len,
                          gpu_memory_utilization=None):
        layers = max(cfg.dense_layers, default=0) + 1       # enough layers for every dense one
        w = self._worker(cfg, layers, max_model_len, max_num_seqs, num_kv_heads, head_dim, dtype)
        w.reserve_dense_pool(dtype, gpu_memory_utilization)
        self.dense_pool = w.dense_pool


@pytest.fixture
def worker_state():
    pytest.importorskip("vllm")
    from vllm_hisparse.vllm import gqa_worker

    return _Reservations(gqa_worker)


def test_ensure_indexer_state_fails_before_allocating(worker_state, monkeypatch):
    """On CUDA the check runs before any tensor is made (a fake device: none exists here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (H200["free"], H200["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: H200["total"] - H200["free"])
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated before the check"))
    with pytest.raises(ValueError, match=r"max_num_seqs=1024 .* 240\.23 GiB .*quest_rows to 265 "):
        worker_state.ensure_indexer_state(HiSparseConfig(), 32, 1024, 32768, 8, 128, torch.bfloat16,
                                       gpu_memory_utilization=0.9)
    assert worker_state.indexer_state is None


def test_ensure_indexer_state_logs_the_reservation(worker_state, monkeypatch):
    lines = []
    monkeypatch.setattr(worker_state.logger, "info", lambda fmt, *a: lines.append(fmt % a))
    cfg = HiSparseConfig(top_k=16, device_buffer_size=16, page_size=16, dense_layers=(0,))
    worker_state.ensure_indexer_state(cfg, 3, 4, 100, 2, 8, torch.float32)
    kmin, kmax = worker_state.indexer_state
    assert kmin[0] is None and kmin[1].shape == kmax[2].shape == (5, 7, 2, 8)   # + scratch row
    row = cap.indexer_row_bytes("quest", cap.ModelShape(3, 2, 8, 4), 100, 16, 1)
    assert sum(t.numel() * 4 for t in kmin + kmax if t is not None) == 5 * row
    assert lines == [f"hisparse: Quest page bounds reserve {5 * row / GIB:.2f} GiB on cpu "
                     f"(max_num_seqs=4 + 1 scratch row x {row / MIB:.1f} MiB: 7 pages x 2 sparse "
                     f"layers)"]


def test_no_quest_row_when_nothing_can_be_sparse(worker_state, monkeypatch):
    """max_model_len 31 below min_context 32 (2 x B): the scratch row only, whatever quest_rows
    and max_num_seqs say, and the log line says why."""
    lines = []
    monkeypatch.setattr(worker_state.logger, "info", lambda fmt, *a: lines.append(fmt % a))
    cfg = HiSparseConfig(top_k=16, device_buffer_size=16, page_size=16, dense_layers=(0,),
                         quest_rows=5)
    worker_state.ensure_indexer_state(cfg, 3, 64, 31, 2, 8, torch.float32)
    kmin, kmax = worker_state.indexer_state
    assert kmin[0] is None and kmin[1].shape == kmax[2].shape == (1, 2, 2, 8)
    assert "no request can turn sparse" in lines[0] and "=0 + 1 scratch row" in lines[0]


def test_quest_rows_sizes_the_reservation(worker_state, monkeypatch):
    """quest_rows set: that many rows (+ scratch) whatever --max-num-seqs says; too many is refused
    naming quest_rows."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (H200["free"], H200["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: H200["total"] - H200["free"])
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("allocated before the check"))
    with pytest.raises(ValueError, match=r"quest_rows=300 .*quest_rows to 265 "):
        worker_state.ensure_indexer_state(HiSparseConfig(quest_rows=300), 32, 1024, 32768, 8, 128,
                                       torch.bfloat16, gpu_memory_utilization=0.9)
    monkeypatch.undo()
    monkeypatch.setattr(worker_state, "indexer_state", None)
    cfg = HiSparseConfig(top_k=16, device_buffer_size=16, page_size=16, dense_layers=(0,),
                         quest_rows=2)
    worker_state.ensure_indexer_state(cfg, 3, 1024, 100, 2, 8, torch.float32)
    kmin, _ = worker_state.indexer_state
    assert kmin[1].shape == (3, 7, 2, 8)                               # 2 rows + the scratch row


def test_dense_pool_too_large_is_refused(worker_state, monkeypatch):
    monkeypatch.setattr(worker_state, "dense_pool", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (H200["free"], H200["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: H200["total"] - H200["free"])
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("allocated before the check"))
    with pytest.raises(ValueError, match=r"dense_pool_gib=100 is more than the 62\.50 GiB allowed"):
        # 256 rows of 128K tokens could fill 256 GiB: the pool stays 100 GiB (core/gpu_pools.py)
        worker_state.ensure_dense_pool(HiSparseConfig(dense_pool_gib=100), 8, 128, torch.bfloat16,
                                       256, 131072, gpu_memory_utilization=0.9)


def test_dense_pool_not_reserved_when_nothing_can_be_sparse(worker_state, monkeypatch):
    """max_model_len below min_context: an empty pool (no page), whatever dense_pool_gib says, and
    no refusal however large it is."""
    monkeypatch.setattr(worker_state, "dense_pool", None)
    worker_state.ensure_dense_pool(HiSparseConfig(dense_pool_gib=100), 8, 128, torch.bfloat16,
                                   256, 4624, gpu_memory_utilization=0.9)
    assert worker_state.dense_pool.num_pages == 0 and worker_state.dense_pool.data.numel() == 0
