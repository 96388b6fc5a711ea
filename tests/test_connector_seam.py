"""One connector seam (issue 44 item 3): ``HiSparseConnector`` (vllm/connector.py) is the one
vLLM-facing connector of GQA and MLA/DSA models, picks its two halves from the deployment's
attention kind, and does no work itself: every public connector method it defines hands its
arguments to the half of its role and returns what the half returns. Stand-in halves record each
call, so a facade method that reads an argument, loops, or answers without its half fails here."""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm

# facade methods whose half method has another name (vLLM's HMA name; the metrics' name)
RENAMED = {"request_finished_all_groups": "request_finished", "get_kv_connector_stats": "stats"}
BOTH_ROLES = {"get_kv_connector_stats"}      # vLLM asks the connector of each role
KINDS = ("gqa", "mla")


class Recorder:
    """A stand-in half: any method, each call recorded as (name, args, kwargs), answering a fresh
    object."""

    def __init__(self, kind: str, role: str, vllm_config, dep):
        self.kind, self.role, self.calls = kind, role, []
        self.worker = ("worker of", kind)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def method(*args, **kwargs):
            out = object()
            self.calls.append((name, args, kwargs, out))
            return out
        return method


@pytest.fixture
def seam(monkeypatch):
    """connector.HALVES with Recorder halves per kind; the deployment's kind set by the config."""
    from vllm_hisparse.vllm import connector

    def halves(kind):
        return connector.Halves(lambda vc, dep: Recorder(kind, "scheduler", vc, dep),
                                lambda vc, dep: Recorder(kind, "worker", vc, dep),
                                prom_metrics=kind == "gqa")

    monkeypatch.setattr(connector, "HALVES", {k: halves(k) for k in KINDS})
    monkeypatch.setattr(connector, "deployment_of",
                        lambda vc: SimpleNamespace(limits=SimpleNamespace(mla=vc.mla)))
    return connector


def make(connector, kind: str, role: str):
    from vllm_hisparse.vllm.compat import KVConnectorRole

    vc = SimpleNamespace(mla=kind == "mla", kv_transfer_config=SimpleNamespace())
    r = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    return connector.HiSparseConnector(vc, r, None)


def facade_methods(cls) -> list[str]:
    """The public instance methods the facade class itself defines."""
    return sorted(n for n, v in vars(cls).items()
                  if not n.startswith("_") and inspect.isfunction(v))


@pytest.mark.parametrize("kind", KINDS)
def test_the_deployment_picks_the_halves_of_one_facade(seam, kind):
    for role in ("scheduler", "worker"):
        c = make(seam, kind, role)
        half = c.connector_scheduler if role == "scheduler" else c.connector_worker
        other = c.connector_worker if role == "scheduler" else c.connector_scheduler
        assert (half.kind, half.role, other) == (kind, role, None)
    assert make(seam, kind, "worker").worker == ("worker of", kind)
    assert make(seam, kind, "scheduler").worker is None


@pytest.mark.parametrize("kind", KINDS)
def test_every_public_method_only_forwards_to_its_half(seam, kind):
    names = facade_methods(seam.HiSparseConnector)
    assert {"get_num_new_matched_tokens", "build_connector_meta", "request_finished",
            "bind_connector_metadata", "start_load_kv", "get_finished",
            "save_kv_layer"} <= set(names)
    for name in names:
        served = []
        for role in ("scheduler", "worker"):
            c = make(seam, kind, role)
            half = c.connector_scheduler if role == "scheduler" else c.connector_worker
            fn = getattr(c, name)
            args = [object() for p in inspect.signature(fn).parameters.values()
                    if p.kind is p.POSITIONAL_OR_KEYWORD]
            try:
                got = fn(*args)
            except AttributeError:      # the other role's half is None: not this role's method
                got = None
            if not half.calls:          # not this role's (a hook of the other role answers None)
                assert got is None, (name, role)
                continue
            served.append(role)
            assert len(half.calls) == 1, (name, role, half.calls)
            called, cargs, ckw, out = half.calls[0]
            assert called == RENAMED.get(name, name), (name, called)
            assert got is out, f"{name}: the facade must return what its half returns"
            it = iter(args)             # the half gets the facade's arguments, in order, as given
            assert all(any(a is b for b in it) for a in cargs) and not ckw, (name, cargs)
        want = 2 if name in BOTH_ROLES else 1
        assert len(served) == want, f"{name} is served by {served or 'no'} role"


def test_a_hook_a_half_leaves_out_is_vllms_default(seam):
    """GQA's worker half has no per-layer hooks: the facade answers vLLM's base default."""
    c = make(seam, "gqa", "worker")
    c.connector_worker = SimpleNamespace()
    assert c.wait_for_layer_load("l") is None and c.wait_for_save() is None
    assert c.save_kv_layer("l", None, None) is None


def test_bind_connector_metadata_keeps_vllms_record(seam):
    c = make(seam, "mla", "worker")
    md = object()
    c.bind_connector_metadata(md)
    assert c._get_connector_metadata() is md


def test_dsa_path_exports_no_prometheus_series(seam):
    vc = SimpleNamespace(mla=True)
    assert seam.HiSparseConnector.build_prom_metrics(vc, {}, [], {}) is None


def test_the_real_halves_serve_their_kind():
    from vllm_hisparse.vllm import connector
    from vllm_hisparse.vllm.connector_scheduler import ConnectorScheduler
    from vllm_hisparse.vllm.mla_connector import LatentConnectorScheduler, LatentConnectorWorker

    assert connector.HALVES["gqa"].scheduler is ConnectorScheduler
    assert connector.HALVES["mla"].scheduler is LatentConnectorScheduler
    assert connector.HALVES["mla"].worker is LatentConnectorWorker
    for kind, mla in (("gqa", False), ("mla", True)):
        dep = SimpleNamespace(limits=SimpleNamespace(mla=mla))
        assert connector.kind_of(dep) == kind


# ---- the KV manager's floor copy-on-write (prefix caching step 1) -------------------------------
# vllm/spec.py:HiSparseManager overrides these vLLM 0.26 SingleTypeKVCacheManager methods and calls
# super with these parameter names (docs/design/prefix-caching.md, sections 3.1 and 6).
OVERRIDDEN = {
    "get_num_blocks_to_allocate": ("request_id", "num_tokens", "new_computed_blocks",
                                   "total_computed_tokens", "num_local_computed_tokens",
                                   "num_tokens_main_model", "apply_admission_cap"),
    "add_local_computed_blocks": ("request_id", "new_computed_blocks",
                                  "num_local_computed_tokens", "num_external_computed_tokens"),
    "allocate_new_blocks": ("request_id", "num_tokens", "num_tokens_main_model"),
    "cache_blocks": ("request", "num_tokens", "retention_interval"),
    "new_step_starts": (),
    "pop_blocks_for_free": ("request_id",),
}
# private methods it calls (positionally) and instance attributes it reads or writes
CALLED = {"_apply_cow": ("request_id", "block_idx", "source_block", "cow_block"),
          "_has_partial_local_hit": ("new_computed_blocks", "num_local_computed_tokens")}
ATTRIBUTES = ("_pending_cow_copies", "_partial_hit_reqs", "_record_new_block_ids",
              "new_block_ids", "num_cached_block", "req_to_blocks", "block_pool", "block_size")


def _params(fn) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


def _vllm_base_method(name: str):
    """vLLM's own definition of ``name`` (the first class after HiSparseManager in its MRO)."""
    from vllm_hisparse.vllm.spec import HiSparseManager

    for cls in HiSparseManager.__mro__[1:]:
        if name in vars(cls):
            return getattr(cls, name)
    raise AssertionError(f"vLLM's SingleTypeKVCacheManager has no {name}: HiSparseManager's floor "
                         f"copy-on-write (vllm/spec.py) overrides it; vLLM renamed or removed it")


def test_floor_cow_seam_methods_keep_their_vllm_names_and_parameters():
    from vllm_hisparse.vllm.spec import HiSparseManager

    for name, want in OVERRIDDEN.items():
        base = _vllm_base_method(name)
        assert _params(base) == want, (
            f"vLLM's SingleTypeKVCacheManager.{name}{_params(base)} changed (vllm/spec.py "
            f"HiSparseManager.{name} passes {want})")
        assert _params(getattr(HiSparseManager, name)) == want, name
    for name, want in CALLED.items():
        base = _vllm_base_method(name)
        assert _params(base) == want, (
            f"vLLM's SingleTypeKVCacheManager.{name}{_params(base)} changed (vllm/spec.py "
            f"HiSparseManager's floor copy-on-write calls it with {want})")


def test_floor_cow_seam_attributes_and_the_copies_path_exist():
    """The instance state the floor reads, on a real manager, and the way vLLM hands the queued
    copies to the worker: KVCacheManager.take_kv_cache_block_copies ->
    SchedulerOutput.kv_cache_block_copies, retained endpoints freed by
    Scheduler._free_cow_retained_blocks."""
    import dataclasses

    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler

    from test_floor_cow import manager

    m, pool = manager(8)
    for name in ATTRIBUTES:
        assert hasattr(m, name), (f"vLLM's SingleTypeKVCacheManager has no attribute {name} "
                                  f"(vllm/spec.py HiSparseManager's floor copy-on-write uses it)")
    assert isinstance(m._pending_cow_copies, list) and isinstance(m._partial_hit_reqs, dict)
    assert isinstance(m.num_cached_block, dict) and isinstance(m.new_block_ids, list)
    assert callable(getattr(pool, "get_new_blocks", None)) and pool.num_gpu_blocks == 8
    for cls, name in ((KVCacheManager, "take_kv_cache_block_copies"),
                      (Scheduler, "_free_cow_retained_blocks")):
        assert callable(getattr(cls, name, None)), (
            f"vLLM's {cls.__name__}.{name} is gone: the floor copy-on-write's copies "
            f"(vllm/spec.py) reach the worker through it")
    fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert "kv_cache_block_copies" in fields, (
        "vLLM's SchedulerOutput.kv_cache_block_copies is gone: the floor copy-on-write's copies "
        "(vllm/spec.py) run on the worker from it")


# ---- the donation of hashed hot slots (prefix caching step 2a, the host tier) ---------------------
# vllm/spec.py:HiSparseManager overrides take_pending_cow_copies (once per step, after every
# allocation: its donations are queued there) and calls these BlockPool methods with these
# parameters; the worker's start of a request is its Request.num_computed_tokens at cache_blocks.
POOL_CALLED = {"move_block_hashes": ("src_block", "dst_block"), "evict_blocks": ("block_ids",),
               "get_new_blocks": ("num_blocks",), "free_blocks": ("ordered_blocks",),
               "get_num_free_blocks": (), "get_cached_block": ("block_hash", "kv_cache_group_ids")}


def test_donation_seam_keeps_its_vllm_names():
    import inspect

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from vllm_hisparse.vllm.spec import HiSparseManager

    base = _vllm_base_method("take_pending_cow_copies")
    assert _params(base) == () == _params(HiSparseManager.take_pending_cow_copies), (
        f"vLLM's SingleTypeKVCacheManager.take_pending_cow_copies{_params(base)} changed "
        f"(vllm/spec.py HiSparseManager queues its donations there)")
    for name, want in POOL_CALLED.items():
        fn = getattr(BlockPool, name, None)
        assert fn is not None and _params(fn) == want, (
            f"vLLM's BlockPool.{name} changed or is gone (vllm/spec.py HiSparseManager's donation "
            f"calls it with {want})")
    for owner, fn, calls in ((Scheduler, "schedule", "take_kv_cache_block_copies"),
                             (KVCacheManager, "take_kv_cache_block_copies",
                              "take_pending_cow_copies")):
        assert calls in inspect.getsource(getattr(owner, fn)), (
            f"vLLM's {owner.__name__}.{fn} no longer calls {calls}: vllm/spec.py "
            f"HiSparseManager's donations (take_pending_cow_copies) would never be queued")
    blk = KVCacheBlock(3)
    for name in ("ref_cnt", "block_hash", "block_id", "is_null"):
        assert hasattr(blk, name), f"vLLM's KVCacheBlock.{name} is gone (vllm/spec.py uses it)"
    init = inspect.getsource(Request.__init__)
    for name in ("num_computed_tokens", "num_prompt_tokens"):
        assert f"self.{name}" in init, f"vLLM's Request.{name} is gone (vllm/spec.py reads it)"
    from test_prefix_host_pool import manager

    m, pool = manager(8)
    assert isinstance(pool.blocks, list) and pool.blocks[3].block_id == 3
    assert m.floor_blocks == m.hs_cfg.num_slots


# ---- shared host pages (prefix caching step 2b) ----------------------------------------------------
# vllm/host_page_admission.py reads Request.block_hashes (page p's hash: one KV-cache group) and
# num_computed_tokens at build_connector_meta (before _update_after_schedule advances it: the
# tokens of earlier steps, complete); reset_prefix_cache(reset_connector=True) reaches the
# connector's reset_cache.
def test_shared_host_pages_seam_keeps_its_vllm_names():
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    assert "self.block_hashes" in inspect.getsource(Request.__init__), (
        "vLLM's Request.block_hashes is gone (vllm/host_page_admission.py shares host pages by it)")
    sched = inspect.getsource(Scheduler.schedule)
    assert sched.index("_build_kv_connector_meta") < sched.index("_update_after_schedule("), (
        "vLLM's Scheduler.schedule now advances num_computed_tokens before build_connector_meta: "
        "vllm/host_page_admission.py would publish host pages of the step being scheduled")
    assert "connector.reset_cache()" in inspect.getsource(Scheduler.reset_connector_cache), (
        "vLLM's Scheduler.reset_connector_cache no longer calls the connector's reset_cache "
        "(the host page index, vllm/host_page_admission.py, would outlive a reset)")


def test_publish_guard_seam_keeps_its_vllm_names():
    """vllm/publish_guard.py asks BlockPool.cached_block_hash_to_block ``contain(key, block_id)``
    and ``get_one_block(key)`` (the block a hit reads: the first cached of duplicates) and strips
    the group id with kv_cache_utils.get_block_hash."""
    from vllm.v1.core.block_pool import BlockHashToBlockMap
    from vllm.v1.core.kv_cache_utils import (KVCacheBlock, get_block_hash,
                                             make_block_hash_with_group_id)

    m = BlockHashToBlockMap()
    key = make_block_hash_with_group_id(b"h" * 32, 0)
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    m.insert(key, a)
    m.insert(key, b)
    assert m.get_one_block(key) is a and m.contain(key, 2) and not m.contain(key, 3), (
        "vLLM's BlockHashToBlockMap.get_one_block / contain changed (vllm/publish_guard.py)")
    assert get_block_hash(key) == b"h" * 32, "vLLM's get_block_hash changed (publish_guard)"


def test_the_worker_hooks_are_named_spans_only_under_a_profiler(seam):
    """bind_connector_metadata / start_load_kv show in a torch profile as hisparse.bind /
    hisparse.plan (bench.idle_gaps names the host work the GPU waits for by them), each around its
    half's call; without a profiler no span is opened (profile_span.span is a no-op)."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from vllm_hisparse.vllm.profile_span import span

    assert isinstance(span("x"), contextlib.nullcontext)
    c = make(seam, "mla", "worker")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        c.bind_connector_metadata(object())
        c.start_load_kv(None)
    assert type(span("x")).__name__ == "nullcontext"          # off again after the profile
    names = [e.name for e in prof.events()]
    assert names.count("hisparse.bind") == 1 and names.count("hisparse.plan") == 1
    assert [n for n, *_ in c.connector_worker.calls] == ["bind_connector_metadata",
                                                         "start_load_kv"]
