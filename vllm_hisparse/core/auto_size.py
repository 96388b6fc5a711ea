"""The sizes a config leaves to the machine: ``host_pool_gib``, ``quest_rows`` and
``dense_pool_gib`` absent (or "auto"). ``core/deployment.resolve`` calls ``size_gqa`` once per
engine, on the ``Machine`` the vLLM adapter measured once (vllm/deployment.py) or ``hisparse calc``
was given, so the server and calc size the same way. Explicit values win, field by field.

The rule, in the order it is applied (every count is of requests of ``max_model_len`` tokens):

1. ``quest_rows`` = H + L, two tiers (core/residency.py):
   H, the *host-backed* requests: the most long requests the GPU KV budget admits: at most
   max_num_seqs (and, when the host pool is auto too, the requests rule 3's RAM share holds: a
   row it cannot fill would serve only shorter requests, at the GPU memory of a row), the largest
   H such that, with H indexer rows + the scratch row and H requests' dense pages taken out of the
   budget, the KV cache still runs H requests (H - 1 at their hot buffer's S + 1 blocks while the
   last one admitted holds its whole prompt: ``capacity.gpu_requests``), and those reservations
   take at most ``RESERVATION_SHARE`` of the budget (the worker's own startup check then passes).
   L, the *host-less* requests (only with every pool auto and ``hostless`` "sparse": each
   takes a row; "wait", "dense" and resident mode: 0): the largest L, with H + L at most
   max_num_seqs, such that with H + L rows + the scratch row and H requests' dense pages reserved
   (a host-less request reads its dense layers from its own GPU blocks: core/hostless.py) the
   connector admits the L-th host-less request beside the H at their floor: its whole life fits
   the usable blocks less the spill reserve R (``capacity.spill_reserve_blocks``, as
   ``connector.spill_reserve``; max_num_seqs unknown: R counts H + L), the H floors and the L - 1
   before it (``residency.hostless_fits``), again within ``RESERVATION_SHARE``.
   With an explicit KV cache size (``--kv-cache-memory-bytes``, a CPU run) vLLM gives the KV
   cache that size whatever hisparse reserves, so only the KV cache counts. Unknown budget:
   max_num_seqs (and the host's bound), L = 0. An explicit host pool does not cap the rows:
   requests shorter than max_model_len take fewer of its pages (the startup note says when rows
   stay idle at max_model_len). Where this rule does not size the rows for host-less requests
   (rows or host pool explicit, hostless "dense"), L is counted beside the rows as they are, with
   the same admission rule (``GpuModel.hostless_beside``, from core/deployment.resolve): "sparse"
   on the rows the host-backed requests leave idle, "dense" without a row.
2. ``dense_pool_gib``: the pages the H host-backed requests fill in the dense layers (H x
   cdiv(max_model_len, page_size) pages of each dense layer), i.e. what core/gpu_pools.py caps an
   explicit pool at with H rows; 0 without dense layers, without the host tier, or when no request
   can turn sparse.
3. ``host_pool_gib`` (the engine's total, each rank pinning 1/TP): ``HOST_SHARE`` of the RAM this
   host can still give (MemAvailable, or a container limit less its use) less ``HOST_RESERVE``,
   split over the ranks pinning on this host, in whole pages, at most what the H host-backed
   requests fill; refused in one line naming host_pool_gib when that holds not one request.
   Unknown RAM: what the H requests fill.

A runtime built without a machine (``EngineLimits.machine`` None: the core's tests and benches,
the simulator) gets the fixed sizes of before: 16 GiB of host pool, max_num_seqs rows, no dense
pool.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_hisparse.config import GIB, HiSparseConfig, _fail, gib_at_least
from vllm_hisparse.core import capacity, residency

HOST_SHARE = 0.8          # guess: leaves a fifth of the RAM free for the page cache the weights
                          # load through, and stays under host_pool.PIN_SHARE (0.9), so the startup
                          # check of all local ranks' pools always passes an auto size
HOST_RESERVE = 8 * GIB    # guess: vLLM's own processes (front end, engine core, one worker per
                          # rank with torch and a CUDA context: 1.5-3 GiB each) start after RAM is
                          # measured, so it is taken off before the share
FIXED = {"host_pool_gib": 16.0, "quest_rows": 0, "dense_pool_gib": 0.0}   # without a machine


@dataclass(frozen=True)
class Machine:
    """What the auto sizes are computed from, measured once per engine.

    host_available_bytes: RAM this host can still give (``host_pool.host_room``); None = unknown.
    host_ranks: ranks of this engine (and of other local data-parallel engines) pinning here.
    gpu_kv_bytes: one GPU's KV cache budget before hisparse's reservations (what stock vLLM gets);
        None = unknown. gpu_kv_fixed: it is an explicit KV cache size (``--kv-cache-memory-bytes``,
        ``VLLM_CPU_KVCACHE_SPACE``): the reservations come on top of it, not out of it.
    gpu_kv_source: where gpu_kv_bytes came from, for the startup line.
    """
    host_available_bytes: int | None = None
    host_ranks: int = 1
    gpu_kv_bytes: int | None = None
    gpu_kv_fixed: bool = False
    gpu_kv_source: str = ""


def host_rank_room(m: Machine) -> int:
    """Bytes one rank's auto host pool may take: ``HOST_SHARE`` x (available - ``HOST_RESERVE``),
    split over the ranks pinning on this host."""
    usable = max(m.host_available_bytes - HOST_RESERVE, 0)
    return int(HOST_SHARE * usable) // max(m.host_ranks, 1)


def largest_fit(cap: int, fits) -> int:
    """The largest r in [0, cap] with fits(r) (fits: true up to some r, false beyond)."""
    lo, hi = 0, cap + 1                        # invariant: lo fits (0 always), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class GpuModel:
    """One GPU's KV cache with rows reserved: the terms of rule 1 (bytes per rank).
    max_num_batched_tokens, watermark: vLLM's, for the spill reserve R of the host-less tier."""
    cfg: HiSparseConfig
    machine: Machine
    num_layers: int
    max_model_len: int
    page_bytes: int            # one page of one layer (K and V)
    row_bytes: int             # one indexer row
    num_dense: int             # dense layers of the model
    pool: bool                 # a dense pool is reserved (per request: pages x num_dense)
    max_num_batched_tokens: int = 0
    watermark: float = 0.0

    @property
    def per_request(self) -> int:
        return capacity.cdiv(self.max_model_len, self.cfg.page_size)

    def dense_pages(self, rows: int) -> int:
        if not self.pool:
            return 0
        fill = rows * self.per_request
        if self.cfg.dense_pool_gib is None:
            return fill
        return min(self.cfg.dense_pool_bytes // (self.page_bytes * self.num_dense), fill)

    def reserved(self, rows: int, dense_rows: int | None = None) -> int:
        """Bytes reserved for ``rows`` rows + the scratch row and the dense pages of
        ``dense_rows`` requests (default: rows; host-less requests take none)."""
        dense = self.dense_pages(rows if dense_rows is None else dense_rows)
        return (rows + 1) * self.row_bytes + dense * self.page_bytes * self.num_dense

    def within_share(self, rows: int, dense_rows: int | None = None) -> bool:
        return self.machine.gpu_kv_fixed or (
            self.reserved(rows, dense_rows) <= capacity.RESERVATION_SHARE * self.machine.gpu_kv_bytes)

    def blocks(self, rows: int, dense_rows: int | None = None) -> int:
        """vLLM's KV blocks (its null block included) with those reservations."""
        m = self.machine
        kv = m.gpu_kv_bytes if m.gpu_kv_fixed else m.gpu_kv_bytes - self.reserved(rows, dense_rows)
        return max(kv, 0) // (self.page_bytes * self.num_layers)

    def floor(self) -> int:
        """Blocks a sparse request keeps once spilled (S hot + the newest page); all its pages in
        resident mode."""
        return capacity.hisparse_blocks(self.max_model_len, self.cfg.page_size, self.cfg.num_slots,
                                        self.cfg.host_tier)

    def requests(self, rows: int, dense_rows: int | None = None) -> int:
        """Requests of max_model_len tokens the KV cache runs with ``rows`` rows reserved."""
        blocks, cfg = self.blocks(rows, dense_rows), self.cfg
        P, per = cfg.page_size, self.per_request
        if not capacity.hisparse_prefill_fits(blocks, self.max_model_len, P):
            return 0
        admit = per + int(cfg.resident_first and cfg.host_tier)   # whole prompt + connector's 1
        return capacity.gpu_requests(blocks, self.floor(), admit)

    def rows_fit(self, rows: int) -> bool:
        return self.within_share(rows) and rows <= self.requests(rows)

    def hostless_fit(self, backed: int, hostless: int, max_num_seqs: int) -> bool:
        """Rule 1's L: ``hostless`` host-less requests of max_model_len run beside ``backed``
        host-backed ones, with backed + hostless rows and backed requests' dense pages reserved:
        the connector admits the last of them (``residency.hostless_fits``: its whole life beside
        the backed floors, the hostless - 1 before it and R; max_num_seqs 0: R counts the rows)."""
        if hostless <= 0:
            return True
        rows = backed + hostless
        if not self.within_share(rows, backed):
            return False
        nb, P, per = self.blocks(rows, backed), self.cfg.page_size, self.per_request
        if not capacity.hisparse_prefill_fits(nb, self.max_model_len, P):
            return False
        reserve = capacity.spill_reserve_blocks(self.max_num_batched_tokens, max_num_seqs or rows,
                                                P, capacity.watermark_blocks(nb, self.watermark))
        return residency.hostless_fits(nb - 1, reserve, (hostless - 1) * per, backed,
                                       self.floor(), per)

    def hostless_beside(self, backed: int, rows: int, max_num_seqs: int, on_rows: bool) -> int:
        """L where rule 1 did not size the rows for it (rows or host pool explicit, hostless
        "dense"): the host-less requests of max_model_len the connector admits beside ``backed``
        host-backed ones at their floor, with the ``rows`` rows and their dense pages reserved as
        they are (``residency.hostless_fits``: the whole lives, the backed floors and R).
        on_rows ("sparse"): each takes an idle row, so at most rows - backed; else none. At most
        max_num_seqs - backed (0: vLLM's limit unknown; R then counts the rows or the requests
        that run, whichever is more)."""
        nb, P, per = self.blocks(rows, rows), self.cfg.page_size, self.per_request
        if not capacity.hisparse_prefill_fits(nb, self.max_model_len, P):
            return 0
        cap = rows - backed if on_rows else 1 << 20
        if max_num_seqs:
            cap = min(cap, max_num_seqs - backed)
        wm = capacity.watermark_blocks(nb, self.watermark)

        def fits(n: int) -> bool:
            reserve = capacity.spill_reserve_blocks(self.max_num_batched_tokens,
                                                    max_num_seqs or max(rows, backed + n), P, wm)
            return residency.hostless_fits(nb - 1, reserve, (n - 1) * per, backed, self.floor(),
                                           per)
        return largest_fit(max(cap, 0), fits)


def size_gqa(cfg: HiSparseConfig, machine: Machine | None, possible: bool, max_num_seqs: int,
             tensor_parallel_size: int, gpu: GpuModel
             ) -> tuple[HiSparseConfig, int | None, int | None]:
    """(cfg with its auto fields filled in, requests the GPU KV budget runs at the rows chosen or
    None when the budget is unknown, L: the host-less requests rule 1 gave rows to, or None when
    rule 1 did not count them: rows, host pool or a dense pool explicit, unknown budget, no host
    tier, hostless "dense"). gpu: the KV model of this rank (its cfg is ``cfg``)."""
    auto = cfg.auto_fields
    if machine is None:
        return cfg.with_sizes(**{f: FIXED[f] for f in auto}), None, None
    known = machine.gpu_kv_bytes is not None
    cap = max_num_seqs or (1 << 20)            # 0: vLLM's limit unknown (calc), no cap
    host_room = _host_room_pages(cfg, machine, possible, tensor_parallel_size, gpu)
    if host_room is not None and "host_pool_gib" in auto:
        cap = min(cap, host_room // gpu.per_request)       # >= 1: _host_room_pages refuses less
    hostless = None
    if cfg.quest_rows is not None:
        rows = (cfg.quest_rows or max_num_seqs) if possible else 0
    elif not possible:
        rows = 0
    elif not known:
        rows = min(max_num_seqs, cap)
    else:
        rows = largest_fit(cap, gpu.rows_fit)
        if rows == 0:
            kv = machine.gpu_kv_bytes / GIB
            _fail("quest_rows", "auto",
                  f"a GPU KV budget of {kv:.2f} GiB per GPU ({machine.gpu_kv_source}) runs no "
                  f"request of max_model_len={gpu.max_model_len} once its indexer row and dense "
                  f"pages are reserved; lower --max-model-len, raise --gpu-memory-utilization, or "
                  f"set quest_rows (and dense_pool_gib) yourself")
        if ("host_pool_gib" in auto and ("dense_pool_gib" in auto or not gpu.pool)
                and cfg.host_tier and cfg.hostless != "dense"):
            hostless = 0 if cfg.hostless == "wait" else largest_fit(
                max((max_num_seqs or (1 << 20)) - rows, 0),
                lambda n: gpu.hostless_fit(rows, n, max_num_seqs))
    extra = hostless or 0
    sizes: dict = {}
    if "quest_rows" in auto:
        sizes["quest_rows"] = rows + extra
    if "dense_pool_gib" in auto:                # 0 pages when none can be sparse: no pool
        sizes["dense_pool_gib"] = gpu.dense_pages(rows) * gpu.page_bytes * gpu.num_dense / GIB
    if "host_pool_gib" in auto:
        pages = rows * gpu.per_request if host_room is None else min(rows * gpu.per_request,
                                                                       host_room)
        sizes["host_pool_gib"] = pages * _page_all(gpu) * tensor_parallel_size / GIB
    return (cfg.with_sizes(**sizes), gpu.requests(rows + extra, rows) if known else None,
            hostless)


def _page_all(gpu: GpuModel) -> int:
    """One host page of every host layer, per rank (the dense layers stay out with a pool)."""
    return gpu.page_bytes * (gpu.num_layers - (gpu.num_dense if gpu.pool else 0))


def _host_room_pages(cfg: HiSparseConfig, m: Machine, possible: bool, tp: int,
                     gpu: GpuModel) -> int | None:
    """Pages of each rank's host pool: the explicit size's, or rule 3's RAM share (refused when
    it holds no request); None: no pool, or auto on an unknown RAM."""
    if not (cfg.host_tier and possible):
        return None
    page_all = _page_all(gpu)
    if cfg.host_pool_gib is not None:
        return capacity.host_pool_rank_bytes(cfg.host_pool_bytes, tp) // page_all
    if m.host_available_bytes is None:
        return None
    per = gpu.per_request
    room = host_rank_room(m) // page_all
    if room < per:
        need = per * page_all * tp
        _fail("host_pool_gib", "auto",
              f"this host can still give {m.host_available_bytes / GIB:.2f} GiB of RAM "
              f"({m.host_ranks} rank(s) pinning here); the auto pool, {HOST_SHARE:.0%} of it "
              f"less a {HOST_RESERVE // GIB} GiB reserve, cannot hold one request of "
              f"max_model_len={gpu.max_model_len} ({need / GIB:.2f} GiB over all ranks); free "
              f"host memory, lower --max-model-len, or set host_pool_gib yourself (at least "
              f"{gib_at_least(need)})")
    return room
