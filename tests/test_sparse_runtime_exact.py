"""SparseRuntime without vLLM, the adapter's job in miniature: chunked prefill, mixed prefill +
decode batches, short (resident) requests, dense layers. Blocks the scheduler would free are
poisoned with NaN after every step, so a runtime that read one would fail. hisparse mode must equal
resident mode bit for bit, every layer, every step; the sync-free Quest update must equal the
reference's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.ops.quest_update import quest_update_pages
from vllm_hisparse.core.residency import freed_pages
from vllm_hisparse.core.sparse_runtime import SparseRuntime
from vllm_hisparse.ops import reference
from vllm_hisparse.sim.recorder_hook import TraceWriter

P, L, HKV, D, HQ, W = 8, 3, 2, 8, 4, 40          # W pages per request (max_model_len 320)


class Driver:
    """The adapter's job in miniature: block tables (block 0 left as vLLM's null block), slot
    mapping, one plan per step, every layer; blocks the scheduler would free are poisoned.
    device/dtype/dims: a GPU variant needs a head size the Triton attention kernel takes
    (64/128/256) and fp16/bf16. shape: (page, layers, pages per request) for other tests.
    full: steps whose rows all have one token go as vLLM's FULL-graph steps do (plan_full, the
    batch padded to a power of two with junk rows, full_layer per layer)."""

    def __init__(self, cfg, rows=4, seed=0, device="cpu", dtype=torch.float32, dims=(HQ, HKV, D),
                 shape=(P, L, W), pad=0, full=False):
        self.cfg, self.full = cfg, full
        # pad: vLLM-style padding tokens after the real ones (slot -1, junk q/k/v drawn from another
        # generator, so the real tokens draw what an unpadded driver draws)
        self.pad, self.pad_g = pad, torch.Generator().manual_seed(7)
        self.hq, self.hkv, self.d = dims
        self.P, self.L, self.W = shape
        self.dev, self.dt = torch.device(device), dtype
        self.rt = SparseRuntime(cfg, self.L, self.hkv, self.d, dtype, self.dev, rows,
                                self.W * self.P, host_pages=400, trace_writer=TraceWriter)
        self.kv = [torch.zeros(1 + rows * self.W, 2, self.P, self.hkv, self.d, dtype=dtype,
                               device=self.dev) for _ in range(self.L)]    # block 0: vLLM's null
        self.rt.bind_kv_caches(self.kv)
        self.blocks, self.lens, self.prompt = {}, {}, {}
        self.keep: dict[str, int] = {}          # resident_first: what the scheduler spilled
        self.g = torch.Generator().manual_seed(seed)
        self.outs: list[torch.Tensor] = []

    def add(self, rid, n_prompt):
        self.rt.add(rid, n_prompt)
        i = len(self.blocks)
        self.blocks[rid] = torch.arange(1 + i * self.W, 1 + (i + 1) * self.W, dtype=torch.int32)
        self.lens[rid], self.prompt[rid] = 0, n_prompt

    def spill(self, rid, keep=0):
        """The scheduler gives the request's blocks beyond its hot buffer back but its ``keep``
        newest complete pages (resident_first)."""
        self.keep[rid] = keep
        self.rt.spill(rid, keep)

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.g).to(self.dev, self.dt)

    def step(self, todo: dict[str, int]):
        ids = list(todo)
        qsl, seq, slots = [0], [], []
        for rid in ids:
            start, n = self.lens[rid], self.lens[rid] + todo[rid]
            pos = torch.arange(start, n)
            slots.append(self.blocks[rid][pos // self.P].long() * self.P + pos % self.P)
            qsl.append(qsl[-1] + todo[rid])
            seq.append(n)
            self.lens[rid] = n
        slots.append(torch.full((self.pad,), -1, dtype=torch.long))
        bt = torch.stack([self.blocks[r] for r in ids]).to(self.dev)
        T = qsl[-1]
        if self.full and T == len(ids):
            self._full_step(ids, seq, bt)
        else:
            self._step(ids, qsl, seq, bt, torch.cat(slots).to(self.dev))
        self.rt.end_step()                       # the adapter's wait_for_save
        self.free(ids)

    def freed_blocks(self, ids) -> list[torch.Tensor]:
        """The blocks the scheduler frees after a step, request by request."""
        out = []
        for rid in ids:
            keep = self.keep.get(rid) if self.cfg.resident_first else 0
            lo, hi = freed_pages(self.cfg, self.lens[rid], self.prompt[rid], keep)
            out.append(self.blocks[rid][lo:hi].long())
        return out

    def free(self, ids):
        """What the scheduler frees after a step, nobody may read: poisoned."""
        for blocks in self.freed_blocks(ids):
            for kv in self.kv:
                kv[blocks] = float("nan")

    def _full_step(self, ids, seq, bt):
        n = len(ids)
        N = 1 << (n - 1).bit_length()
        self.rt.plan_full(ids, seq, N, bt)
        junk = torch.randint(0, 1 + len(self.blocks) * self.W, (N - n, bt.shape[1]),
                             generator=self.pad_g, dtype=torch.int32).to(self.dev)
        btp = torch.cat([bt, junk])                 # vLLM's padding rows: stale tables
        for layer in range(self.L):
            q, k, v = self._rand(n, self.hq, self.d), self._rand(n, self.hkv, self.d), \
                self._rand(n, self.hkv, self.d)
            q, k, v = (torch.cat([x, torch.randn(N - n, *x.shape[1:], generator=self.pad_g)
                                  .to(x)]) for x in (q, k, v))
            out = torch.full((N, self.hq, self.d), float("nan"), dtype=self.dt, device=self.dev)
            self.rt.full_layer(layer, N, q, k, v, self.kv[layer], btp, self.d ** -0.5, out)
            self.outs.append(out[:n])

    def _step(self, ids, qsl, seq, bt, slot_mapping):
        plan = self.rt.plan(ids, qsl, seq, bt, slot_mapping)
        T = qsl[-1]
        for layer in range(self.L):
            q, k, v = self._rand(T, self.hq, self.d), self._rand(T, self.hkv, self.d), \
                self._rand(T, self.hkv, self.d)
            if self.pad:
                q, k, v = (torch.cat([x, torch.randn(self.pad, *x.shape[1:], generator=self.pad_g)
                                      .to(x)]) for x in (q, k, v))
            out = torch.full((T + self.pad, self.hq, self.d), float("nan"), dtype=self.dt,
                             device=self.dev)
            self.rt.forward_layer(layer, plan, q, k, v, self.kv[layer], self.d ** -0.5, out)
            out = out[:T]
            self.outs.append(out)


def run(host_tier: bool, dense_layers=(0,), dense_pool_gib=0.0, quest_rows=0, split=False,
        full=False, policy="lru", resident_first=False, spills=None, driver=None):
    """spills: {decode step i: request ids the scheduler spills before it, or (id, keep) pairs
    for a partial spill} (resident_first). driver: the Driver class (tests/test_write_behind.py)."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=dense_layers,
                         min_context=40, host_pool_gib=0.01, host_tier=host_tier,
                         dense_pool_gib=dense_pool_gib, quest_rows=quest_rows,
                         split_dense_decode=split, policy=policy, resident_first=resident_first)
    d = (driver or Driver)(cfg, rows=5, full=full)
    # "short" finishes below min_context (dense all its life); "grow" turns sparse at 40 tokens
    prompts = {"a": 150, "b": 93, "short": 20, "c": 61, "grow": 9}
    for rid, n in prompts.items():
        d.add(rid, n)
    d.step({"a": 64, "b": 93, "short": 20, "grow": 9})         # chunked: "a" takes three steps
    d.step({"a": 64, "b": 1, "short": 1, "c": 61, "grow": 1})
    d.step({"a": 22, "b": 1, "short": 1, "c": 1, "grow": 1})
    live = dict(prompts)
    for i in range(40):
        for rid in (spills or {}).get(i, ()):
            d.spill(*((rid,) if isinstance(rid, str) else rid))
        if i == 15:                                          # at 37 tokens
            assert not d.rt.reqs["short"].sparse and d.rt.finish("short")
            del live["short"]
        d.step({rid: 1 for rid in live})
    assert d.rt.reqs["grow"].sparse
    stats = d.rt.stats_dict()
    for rid in live:
        assert d.rt.finish(rid)
    assert d.rt.host_pages_used == 0
    assert d.rt.stats_dict()["dense_pool_pages_used"] == 0
    return d.outs, stats


_RUNS: dict = {}


def shared_run(host_tier: bool, dense_layers=(0,), dense_pool_gib=0.0, full=False, policy="lru",
               resident_first=False):
    """``run`` without spills, once per argument set for this module: the runs are deterministic
    (fixed seeds, CPU), so the resident reference and the spill-at-once run that several tests
    compare against are computed once and shared, as an engine is. A run that fails raises in
    every test that asks for it (nothing is kept). Tests that patch the runtime call ``run``."""
    key = (host_tier, tuple(dense_layers), dense_pool_gib, full, policy, resident_first)
    if key not in _RUNS:
        _RUNS[key] = run(host_tier, dense_layers, dense_pool_gib, full=full, policy=policy,
                         resident_first=resident_first)
    return _RUNS[key]


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("dense_layers,dense_pool_gib", [((0,), 0.0), ((), 0.0), ((0, 2), 0.001)])
def test_hisparse_equals_resident_with_freed_blocks_poisoned(dense_layers, dense_pool_gib, full):
    hs, stats = shared_run(True, dense_layers, dense_pool_gib, full=full)
    res, _ = shared_run(False, dense_layers, full=full)
    assert len(hs) == len(res)
    for i, (a, b) in enumerate(zip(hs, res)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN (read a freed block or missed a row)"
        assert torch.equal(a, b), f"step/layer {i} differs"
    assert stats["misses"] > 0 and stats["hits"] > 0
    if dense_pool_gib:                     # the long requests' dense layers lived in the pool
        # ... and the host pool held only the sparse layers (the runtime builds it from cfg)
        assert stats["dense_pool_pages_used"] == sum(-(-n // P) for n in (150 + 40, 93 + 42, 61 + 41,
                                                                          9 + 42))


@pytest.mark.parametrize("full", [False, True])
def test_crf_equals_lru_and_resident(full):
    """The served crf policy changes where pages sit, never what is attended: every layer's output
    of every step equals the LRU run's and resident mode's; the same lookups, other misses."""
    crf, s_crf = run(True, full=full, policy="crf")
    lru, s_lru = shared_run(True, full=full)
    res, _ = shared_run(False, full=full)
    for i, (a, b, c) in enumerate(zip(crf, lru, res, strict=True)):
        assert torch.equal(a, b) and torch.equal(a, c), f"step/layer {i} differs"
    assert s_crf["policy"] == "crf" and s_lru["policy"] == "lru"
    assert s_crf["resolved_units"] == s_lru["resolved_units"] > 0
    assert s_crf["misses"] != s_lru["misses"]        # the policy really ran (fixed seeds)


# decode step -> requests spilled before it: "a" early, "b" mid-run, "grow" right after it turned
# sparse (step 28: 9 + 3 + 28 = 40 tokens), "c" never (resident to the end)
SPILLS = {2: ["a"], 17: ["b"], 29: ["grow"]}


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("dense_layers,dense_pool_gib", [((0,), 0.0), ((0, 2), 0.001)])
def test_resident_first_with_forced_spills_equals_resident(dense_layers, dense_pool_gib, full):
    """resident_first: sparse requests keep their blocks (resolved through the block table) until
    the scheduler spills them, mid-run, one by one; the blocks it gives back are poisoned from then
    on. Every layer's output of every step equals resident mode's and the spill-at-once run's;
    pools empty afterwards."""
    rf, s_rf = run(True, dense_layers, dense_pool_gib, full=full, resident_first=True,
                   spills=SPILLS)
    now, s_now = shared_run(True, dense_layers, dense_pool_gib, full=full)
    res, _ = shared_run(False, dense_layers, full=full)
    for i, (a, b, c) in enumerate(zip(rf, now, res, strict=True)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN (read a given-back block)"
        assert torch.equal(a, c) and torch.equal(b, c), f"step/layer {i} differs"
    assert s_rf["spills"] == 3 and s_now["spills"] == 0
    assert s_rf["resident_rows"] > s_now["resident_rows"]
    assert 0 < s_rf["misses"] < s_now["misses"]
    assert s_rf["resolved_units"] < s_now["resolved_units"]    # resident rows resolve nothing


# partial spills: the window of newest pages shrinks step by step ("a": 15 complete pages beyond
# the floor of 4 at step 2), "b" partially then to its floor, "grow" keeps one page
PARTIAL = {2: [("a", 12)], 6: [("a", 9)], 11: [("a", 2), ("b", 5)], 20: [("b", 0)],
           29: [("grow", 1)]}


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("dense_layers,dense_pool_gib", [((0,), 0.0), ((0, 2), 0.001)])
def test_resident_first_with_partial_spills_equals_resident(dense_layers, dense_pool_gib, full):
    """Partial spills: a request keeps a window of its newest pages (resolved through the block
    table) beside its hot slots (the older pages), the window shrinking at each spill; the blocks
    given back are poisoned. Every layer's output equals resident mode's; fewer misses than
    spilling to the floor at the same steps, pages taken through the block table counted."""
    part, s_part = run(True, dense_layers, dense_pool_gib, full=full, resident_first=True,
                       spills=PARTIAL)
    floor, s_floor = run(True, dense_layers, dense_pool_gib, full=full, resident_first=True,
                         spills={i: [r for r, _ in v] for i, v in PARTIAL.items()})
    res, _ = shared_run(False, dense_layers, full=full)
    for i, (a, b, c) in enumerate(zip(part, floor, res, strict=True)):
        assert not torch.isnan(a).any(), f"step/layer {i}: NaN (read a given-back block)"
        assert torch.equal(a, c) and torch.equal(b, c), f"step/layer {i} differs"
    assert s_part["spills"] == s_floor["spills"] == 3 and s_part["shrinks"] == 6
    assert s_part["partial_rows"] > 0 and s_floor["partial_rows"] == 0
    assert 0 < s_part["misses"] < s_floor["misses"]
    # every selected page of a sparse row is a hit, a miss or a block-table page, in both runs
    assert (s_part["resolved_units"] + s_part["resident_units"]
            == s_floor["resolved_units"] + s_floor["resident_units"])
    assert s_part["resident_units"] > s_floor["resident_units"]


def test_resident_first_without_pressure_never_misses():
    """No spill: every sparse decode row resolves through the block table, zero misses."""
    rf, s = run(True, resident_first=True)
    res, _ = shared_run(False)
    assert all(torch.equal(a, b) for a, b in zip(rf, res, strict=True))
    assert s["misses"] == s["hits"] == 0 and s["resident_rows"] > 0 and s["decode_rows"] > 0


def test_padding_tokens_at_the_tail_change_nothing():
    """vLLM pads a step's tokens at the tail with slot -1: the plan drops them (known from the
    query offsets, no host sync) and every real token's output and the caches are unchanged."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01)
    outs = []
    for pad in (0, 3):
        d = Driver(cfg, pad=pad)
        for rid, n in {"a": 150, "short": 20}.items():
            d.add(rid, n)
        d.step({"a": 64, "short": 20})
        d.step({"a": 86, "short": 1})
        for _ in range(12):
            d.step({"a": 1, "short": 1})
        outs.append((d.outs, d.kv))
    (o1, kv1), (o2, kv2) = outs
    assert len(o1) == len(o2)
    for i, (a, b) in enumerate(zip(o1, o2)):
        assert torch.equal(a, b), f"step/layer {i} differs"
    for a, b in zip(kv1, kv2):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())


def test_dense_layers_never_read_the_host_with_a_dense_pool(monkeypatch):
    """With dense_pool_gib the dense layers attend from the GPU pool: the host read-back path of
    dense layers is never taken (and the host pool holds only what sparse layers need)."""
    from vllm_hisparse.core import prefill

    def boom(*a, **k):
        raise AssertionError("dense layer read the host pool")
    monkeypatch.setattr(prefill, "attend_from_host", boom)
    outs, _ = run(True, (0, 2), 0.001)
    assert not any(torch.isnan(o).any() for o in outs)


def test_quest_update_pages_equals_reference():
    g = torch.Generator().manual_seed(1)
    R, U = 3, 12
    ref_min, ref_max = torch.randn(R, U, HKV, D, generator=g), torch.randn(R, U, HKV, D, generator=g)
    mn, mx = ref_min.clone(), ref_max.clone()
    # row 0 continues page 2 mid-page and crosses into 3..5; row 2 starts at 0; row 1 one token
    spans = [(0, 21, 45), (1, 30, 31), (2, 0, 17)]
    rows, pos, qp, qn, qtp, base = [], [], [], [], [], 0
    for r, s, e in spans:
        p = torch.arange(s, e)
        rows.append(torch.full((e - s,), r))
        pos.append(p)
        pages = torch.arange(s // P, (e - 1) // P + 1)
        qtp.append(p // P - s // P + base)
        qp.append(r * U + pages)
        qn.append(pages * P >= s)
        base += len(pages)
    rows, pos = torch.cat(rows), torch.cat(pos)
    k = torch.randn(len(pos), HKV, D, generator=g)
    reference.quest_update(ref_min, ref_max, rows, pos, k, P)
    quest_update_pages(mn, mx, torch.cat(qp), torch.cat(qn), torch.cat(qtp), k)
    assert torch.equal(mn, ref_min) and torch.equal(mx, ref_max)


def test_quest_rows_only_for_sparse_requests():
    """quest_rows=4 with 5 runtime rows: the three long requests and the one turning sparse take
    the four Quest rows, the short one needs none; results as with a row each; a further long
    request finds no Quest row (the connector keeps it waiting), and a finished request gives its
    row back."""
    hs, _ = run(True, quest_rows=4)
    res, _ = run(False, quest_rows=4)
    for i, (a, b) in enumerate(zip(hs, res)):
        assert torch.equal(a, b), f"step/layer {i} differs"
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, min_context=40,
                         host_pool_gib=0.01, quest_rows=1)
    d = Driver(cfg)
    assert d.rt.ix.kmin[2].shape[0] == 2                   # 1 row + the scratch row (layer 0 dense)
    d.add("long", 100)
    d.add("short", 10)
    with pytest.raises(RuntimeError, match="no free indexer row .*quest_rows=1"):
        d.add("long2", 100)
    assert d.rt.finish("long")
    d.add("long2", 100)
    assert d.rt.reqs["long2"].irow == 0


def test_host_pool_holds_sparse_layers_only_with_a_dense_pool():
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0, 2),
                         min_context=40, host_pool_gib=0.01, dense_pool_gib=0.001)
    rt = Driver(cfg).rt
    assert rt.pool.data.shape[0] == 1 and rt.dpool.data.shape[0] == 2       # L = 3 layers
    assert rt.host_layer(0) is None and rt.host_layer(2) is None
    assert rt.host_layer(1).data_ptr() == rt.pool.data[0].data_ptr()


def test_host_time_is_counted_per_kind():
    """stats_dict's host_ms_* totals: plan and each kind of layer (dense, sparse in eager steps,
    the decode batch's layers of FULL-graph steps) grow with the steps that ran them, and only
    those."""
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, dense_layers=(0,),
                         min_context=0, host_pool_gib=0.01)
    d = Driver(cfg, full=True)
    s0 = d.rt.stats_dict()
    kinds = ("plan", "dense_layers", "sparse_layers", "full_layers")
    assert all(s0[f"host_ms_{k}"] == 0 for k in kinds)
    d.add("a", 100)
    d.step({"a": 100})                                   # prefill: eager
    s1 = d.rt.stats_dict()
    assert s1["host_ms_plan"] > 0 and s1["host_ms_dense_layers"] > 0
    assert s1["host_ms_sparse_layers"] > 0 and s1["host_ms_full_layers"] == 0
    for _ in range(3):
        d.step({"a": 1})                                 # decode: FULL-graph steps
    s2 = d.rt.stats_dict()
    grew = {k: s2[f"host_ms_{k}"] > s1[f"host_ms_{k}"] for k in kinds}
    assert grew == {"plan": True, "dense_layers": False, "sparse_layers": False,
                    "full_layers": True}
    assert s2["full_steps"] == 3 and s2["decode_rows"] == 3


@pytest.mark.parametrize("value,device,head_dim,want", [
    (None, "cuda", 128, True), (None, "cuda", 64, True), (None, "cuda", 256, True),
    (None, "cuda", 96, False),      # a head size the kernel lacks: FlashAttention, as before
    (None, "cpu", 128, False), (True, "cpu", 128, True), (False, "cuda", 128, False),
])
def test_split_dense_decode_default_resolves_per_device_and_head_size(value, device, head_dim, want):
    from vllm_hisparse.core.dense_groups import split_enabled

    cfg = HiSparseConfig(split_dense_decode=value)
    assert split_enabled(cfg, torch.device(device), head_dim) is want


def test_runtime_on_cpu_leaves_split_dense_decode_off_by_default():
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=P, host_pool_gib=0.01)
    assert cfg.split_dense_decode is None
    assert Driver(cfg).rt.split_dense is False
    assert Driver(dataclasses.replace(cfg, split_dense_decode=True)).rt.split_dense is True
