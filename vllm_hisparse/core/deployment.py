"""The deployment: one config resolved against one engine's model and vLLM limits, once.

``resolve(cfg, limits)`` decides every size hisparse allocates or admits by: the selection unit,
the hot slots S, the units K a decode row attends, the indexer rows, the host and dense pool
pages, how many requests of ``max_model_len`` tokens each tier admits at once, and, on an MLA +
DSA model, the latent pool's row sets, regions and host rows. The vLLM adapter resolves it where
the plugin first sees vLLM's config (vllm/deployment.py) and hands the one frozen object to the
scheduler's connector and KV manager, the worker's runtime and pools and the startup check;
``hisparse calc`` resolves the same function, so calc and the server cannot disagree. Sizes the
config leaves out (host_pool_gib, quest_rows, dense_pool_gib absent or "auto") are computed here
from the machine the limits carry (core/auto_size.py); ``Deployment.cfg`` has them filled in.

Names are the config's wherever the quantity is the config's (``top_k``, ``device_buffer_size``,
``page_size``, ``quest_rows``, ``prefill_slots``); a derived quantity has one name here that the
runtime uses too (``num_slots`` = S, ``top_k_units`` = K, ``indexer_rows``, ``host_pages``,
``dense_pool_pages``).

Which process: none in particular (plain data, picklable: it travels inside vLLM's pickled config
to the engine core and the workers).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_hisparse.config import HiSparseConfig, _size
from vllm_hisparse.core import auto_size, capacity, gpu_pools, indexers
from vllm_hisparse.core.auto_size import Machine

# what an engine where no request can turn sparse is (vllm/setup_check.serve_as_stock): said by
# its startup warning and by room(); bench.serving's capacity looks for it in a server's log
STOCK_SERVES = "vLLM's own attention backend serves every layer"


@dataclass(frozen=True)
class EngineLimits:
    """What the model and vLLM fix for one tensor-parallel rank: the inputs of ``resolve``.

    num_kv_heads, head_dim: this rank's KV heads (vLLM's ``get_num_kv_heads``) and head size; 0 on
        an MLA model, whose latent rows have ``latent_row`` values (kv_lora_rank +
        qk_rope_head_dim; 0 on a GQA model).
    dtype_bytes: bytes of one value in the model dtype: the indexer's state (Quest's page bounds
        stay in the model dtype whatever the KV cache's).
    kv_dtype_bytes: bytes of one KV value in every KV tier (GPU blocks, host pool, dense pool,
        latent rows): 1 with ``--kv-cache-dtype fp8``; 0 = dtype_bytes (filled in).
    machine: the host RAM and GPU KV budget the auto sizes come from (core/auto_size.py); None
        outside vLLM and calc (the fixed sizes of before).
    max_num_batched_tokens, watermark: vLLM's scheduler settings, for the spill reserve R the
        connector keeps beside host-less requests (auto rows: core/auto_size.py rule 1).
    latent_row_bytes: bytes of one latent row (one token of one layer) on an MLA model: 0 =
        latent_row x kv_dtype_bytes (filled in); 656 with ``--kv-cache-dtype fp8_ds_mla``
        (ops/fp8_ds_mla.py: fp8 nope, fp32 scales, bf16 rope).
    spec_tokens: vLLM's ``num_speculative_tokens`` (0 = no speculative decoding): a step may
        compute that many tokens past a request's max_tokens (admission counts them) and a
        request's decode step has up to spec_tokens + 1 query tokens (verify rows).
    """
    num_layers: int
    max_model_len: int
    max_num_seqs: int
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    tensor_parallel_size: int = 1
    latent_row: int = 0
    machine: Machine | None = None
    max_num_batched_tokens: int = 0
    watermark: float = 0.0
    kv_dtype_bytes: int = 0
    latent_row_bytes: int = 0
    spec_tokens: int = 0

    def __post_init__(self):
        if self.kv_dtype_bytes < 0:
            raise ValueError(f"hisparse: kv_dtype_bytes={self.kv_dtype_bytes} must be >= 0 "
                             f"(0: the model dtype's)")
        if not self.kv_dtype_bytes:        # frozen: set once here, so equal limits compare equal
            object.__setattr__(self, "kv_dtype_bytes", self.dtype_bytes)
        if not self.latent_row_bytes:
            object.__setattr__(self, "latent_row_bytes", self.latent_row * self.kv_dtype_bytes)
        for name in ("num_layers", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"hisparse: {name}={getattr(self, name)} must be >= 1")
        if self.max_num_seqs < 0 or self.tensor_parallel_size < 1:
            raise ValueError(f"hisparse: max_num_seqs={self.max_num_seqs} must be >= 0 and "
                             f"tensor_parallel_size={self.tensor_parallel_size} >= 1")

    @property
    def mla(self) -> bool:
        return self.latent_row > 0


@dataclass(frozen=True)
class LatentSizes:
    """The DSA path's latent pool (docs/dsa.md): what the scheduler's ledger and the worker's pool
    agree on. row_sets: requests with hot rows at once (quest_rows, else max_num_seqs); regions:
    full-length prefill regions (prefill_slots; every request's in resident mode); host_rows:
    latent rows (one token of every layer) the host pool holds (0 in resident mode); lend: a
    complete prompt keeps its region, decoding from it, until an admission needs it
    (resident_first; core/latent_ledger.py)."""
    row_bytes: int
    row_sets: int
    regions: int
    host_rows: int
    resident: bool
    lend: bool = False


@dataclass(frozen=True)
class Deployment:
    """A config resolved for one engine (``resolve``); every field is one rank's.

    unit_tokens: tokens per selection unit and per hot slot (the indexer's: a page for Quest, one
        token for DSA). num_slots: S, hot slots per request per layer. top_k_units: K, units a
        decode row attends. min_context: the context (tokens) at which a request turns sparse.
    sparse_possible: some request can turn sparse (max_model_len >= min_context); when False no
        indexer row, dense pool or host pool is reserved (core/gpu_pools.py).
    indexer_rows: indexer rows besides the scratch row = sparse requests at once;
        indexer_rows_set_by: the setting that gave it (for startup lines and errors);
        indexer_row_bytes: device bytes of one row (``Indexer.row_bytes``; 0 on an MLA model).
    dense_layer_ids: the model's dense layers (cfg.dense_layers within its layer count).
    page_bytes: one page of one layer (K and V). host_layers: the layers the host pool holds.
    host_pages: pages of each rank's host pool (each a page of every host layer; 0 when no
        request can be sparse). dense_pool_pages: pages of the GPU dense pool (None without one).
    admit_pages: pages admission counts (a sparse request takes as many in the host pool as in
        the dense pool); admit_bound: the pool that bounds them ("host" or "GPU dense").
    latent: the DSA path's latent pool sizes (None on a GQA model).
    auto: the config's fields sized from the machine (core/auto_size.py); cfg has their values.
    gpu_requests: requests of max_model_len tokens the machine's GPU KV budget runs with the
        indexer rows and dense pool reserved (None: budget unknown).
    hostless_requests: L, the host-less requests of max_model_len the connector admits beyond
        the H host-backed ones (``room``): the auto rows include them (core/auto_size.py rule 1),
        else they run on the idle rows ("sparse") or without one ("dense"); None: not counted
        (GPU budget unknown, no host tier or none can be sparse, "wait" with rows it did not size).
    """
    cfg: HiSparseConfig
    limits: EngineLimits
    unit_tokens: int
    num_slots: int
    top_k_units: int
    min_context: int
    sparse_possible: bool
    indexer_rows: int
    indexer_rows_set_by: str
    indexer_row_bytes: int
    dense_layer_ids: tuple
    page_bytes: int
    host_layers: tuple
    host_pages: int
    dense_pool_pages: int | None
    admit_pages: int
    admit_bound: str
    latent: LatentSizes | None = None
    auto: tuple = ()
    gpu_requests: int | None = None
    hostless_requests: int | None = None

    @property
    def dense_pool_bytes(self) -> int:
        """GPU bytes of the dense pool (0 without one)."""
        if self.dense_pool_pages is None:
            return 0
        return self.dense_pool_pages * self.page_bytes * len(self.cfg.dense_layers)

    @property
    def pages_per_request(self) -> int:
        """Pages of a request of max_model_len tokens."""
        return capacity.cdiv(self.limits.max_model_len, self.cfg.page_size)

    def tier_requests(self) -> dict[str, int | None]:
        """Sparse requests of max_model_len tokens each tier holds at once: the indexer rows, the
        host pool and the GPU dense pool (None: the tier does not bound them, i.e. resident mode
        or no dense pool)."""
        per_req = self.pages_per_request
        pools = self.cfg.host_tier and self.sparse_possible
        return {"indexer_rows": self.indexer_rows,
                "host_pool": self.host_pages // per_req if pools else None,
                "dense_pool": (self.dense_pool_pages // per_req
                               if pools and self.dense_pool_pages is not None else None)}

    def room(self) -> tuple[int, str]:
        """(requests of max_model_len tokens admission lets run at once, why: each tier's size and
        requests, "auto" after a size core/auto_size.py chose): the server's startup line
        (``room_line``) and ``hisparse calc``'s, which reads H and L here. With
        ``hostless_requests`` set the count is H host-backed (the least tier) + L host-less, and
        the line says both."""
        if not self.sparse_possible:
            return self.limits.max_num_seqs, (
                f"no request can turn sparse: max_model_len < min_context={self.min_context}, so "
                f"{STOCK_SERVES} (stock vLLM); its KV blocks bound them")
        tiers = self.tier_requests()
        backed = min(n for n in tiers.values() if n is not None)
        room = backed + (self.hostless_requests or 0)
        per = self.pages_per_request
        parts = [] if self.hostless_requests is None else [
            f"{backed} host-backed + {self.hostless_requests} host-less "
            f"(hostless={self.cfg.hostless})"]
        parts += [f"quest_rows={self.indexer_rows}{self._auto('quest_rows')}"]
        if tiers["host_pool"] is not None:
            parts.append(f"host pool {_size(self.cfg.host_pool_bytes)}"
                         f"{self._auto('host_pool_gib')}: {self.host_pages} pages = "
                         f"{tiers['host_pool']} requests of {per}")
        if tiers["dense_pool"] is not None:
            parts.append(f"GPU dense pool {_size(self.dense_pool_bytes)}"
                         f"{self._auto('dense_pool_gib')}: {self.dense_pool_pages} pages = "
                         f"{tiers['dense_pool']} requests")
        m = self.limits.machine
        if self.gpu_requests is not None:
            parts.append(f"GPU KV {_size(m.gpu_kv_bytes)} ({m.gpu_kv_source}): "
                         f"{self.gpu_requests} requests")
        if "host_pool_gib" in self.auto and m.host_available_bytes is not None:
            parts.append(f"host RAM available {_size(m.host_available_bytes)}")
        return room, "; ".join(parts)

    def _auto(self, field: str) -> str:
        return " auto" if field in self.auto else ""

    def room_line(self) -> str:
        n, why = self.room()
        return (f"hisparse: room for {n} requests of max_model_len={self.limits.max_model_len} "
                f"tokens at once ({why})")

    def idle_rows_note(self) -> str | None:
        """Startup advice when the indexer reserves rows the pool cannot fill at max_model_len
        (``gpu_pools.idle_rows_note``); None when every row can be used or there is no pool."""
        if not self.sparse_possible or not self.cfg.host_tier:
            return None
        on_rows = self.hostless_requests if self.cfg.hostless == "sparse" else None
        note = gpu_pools.idle_rows_note(       # the rows the host-less requests take are not idle
            self.indexer_rows - (on_rows or 0), self.admit_pages // self.pages_per_request,
            self.limits.max_model_len, self.admit_bound,
            "quest_rows auto" if "quest_rows" in self.auto else
            "quest_rows" if self.cfg.quest_rows else "max_num_seqs: quest_rows unset")
        if note and self.cfg.hostless == "sparse":     # core/hostless.py
            note += ("; with hostless \"sparse\" those rows also serve host-less requests while the "
                     "GPU's KV blocks hold their whole lives")
        return note


def resolve(cfg: HiSparseConfig, limits: EngineLimits) -> Deployment:
    """Every size of ``cfg`` on an engine of ``limits``; pure (no allocation, no parse). Auto
    sizes come from ``limits.machine`` (core/auto_size.py); explicit ones are kept."""
    ix = indexers.get(cfg.indexer)
    unit = ix.unit_tokens(cfg)
    mml, P = limits.max_model_len, cfg.page_size
    possible = gpu_pools.sparse_possible(cfg, mml)
    auto = cfg.auto_fields
    gpu_n = hostless = None
    if limits.mla:
        cfg = _latent_sizes(cfg, limits)
        latent = _latent(cfg, limits)
        rows = latent.row_sets
        set_by = "quest_rows" if cfg.quest_rows else "max_num_seqs"
        row_bytes = page_bytes = host = 0
        dense = None
        host_layers: tuple = ()
        dense_ids: tuple = ()
    else:
        latent = None
        dense_ids = tuple(i for i in range(limits.num_layers) if i in cfg.dense_layers)
        # KV pages at the cache's width (fp8: 1 byte), the indexer's rows at the model dtype's
        shape = capacity.ModelShape(limits.num_layers, limits.num_kv_heads, limits.head_dim,
                                    limits.kv_dtype_bytes)
        row_bytes = ix.row_bytes(limits.num_layers - len(dense_ids), limits.num_kv_heads,
                                 limits.head_dim, limits.dtype_bytes, mml, P)
        page_bytes = shape.token_bytes_per_layer * P
        pool = (cfg.host_tier and bool(dense_ids) and possible
                and (cfg.dense_pool_gib is None or cfg.dense_pool_gib > 0))
        gpu = auto_size.GpuModel(cfg, limits.machine, limits.num_layers, mml, page_bytes,
                                 row_bytes, len(dense_ids), pool, limits.max_num_batched_tokens,
                                 limits.watermark)
        cfg, gpu_n, hostless = auto_size.size_gqa(cfg, limits.machine, possible, limits.max_num_seqs,
                                        limits.tensor_parallel_size, gpu)
        rows = gpu_pools.quest_rows(cfg, limits.max_num_seqs, mml)
        set_by = ((("quest_rows auto" if "quest_rows" in auto else "quest_rows")
                   if cfg.quest_rows else "max_num_seqs") if possible else
                  "rows (no request can turn sparse: max_model_len < min_context)")
        host_layers = tuple(cfg.host_pool_layers(limits.num_layers))
        share = capacity.host_pool_rank_bytes(cfg.host_pool_bytes, limits.tensor_parallel_size)
        host = share // (page_bytes * len(host_layers)) if possible and host_layers else 0
        dense = gpu_pools.dense_pool_pages(cfg, page_bytes, limits.max_num_seqs, mml)
    admit = host if dense is None else min(host, dense)
    bound = "host" if dense is None or host <= dense else "GPU dense"
    dep = Deployment(cfg=cfg, limits=limits, unit_tokens=unit,
                     num_slots=cfg.device_buffer_size // unit,
                     top_k_units=-(-cfg.top_k // unit), min_context=cfg.min_context_tokens,
                     sparse_possible=possible, indexer_rows=rows, indexer_rows_set_by=set_by,
                     indexer_row_bytes=row_bytes, dense_layer_ids=dense_ids,
                     page_bytes=page_bytes, host_layers=host_layers,
                     host_pages=host, dense_pool_pages=dense, admit_pages=admit,
                     admit_bound=bound, latent=latent,
                     auto=auto if limits.machine is not None else (), gpu_requests=gpu_n,
                     hostless_requests=hostless)
    if (hostless is None and gpu_n is not None and possible and cfg.host_tier
            and cfg.hostless != "wait"):       # rows rule 1 did not size for host-less requests
        backed = min(n for n in dep.tier_requests().values() if n is not None)
        dep = replace(dep, hostless_requests=gpu.hostless_beside(
            backed, rows, limits.max_num_seqs, cfg.hostless == "sparse"))
    return dep


def _latent_sizes(cfg: HiSparseConfig, limits: EngineLimits) -> HiSparseConfig:
    """The DSA path's auto sizes: row sets = max_num_seqs (as quest_rows 0), no dense pool, and a
    host pool of ``auto_size.HOST_SHARE`` of the RAM (rule 3), at most the row sets' requests."""
    auto, m = cfg.auto_fields, limits.machine
    if m is None:
        return cfg.with_sizes(**{f: auto_size.FIXED[f] for f in auto})
    sizes = {"quest_rows": 0, "dense_pool_gib": 0.0}
    sizes = {f: v for f, v in sizes.items() if f in auto}
    if "host_pool_gib" in auto:
        token = limits.latent_row_bytes * limits.num_layers
        rows = (cfg.quest_rows or limits.max_num_seqs) * limits.max_model_len
        if m.host_available_bytes is not None:
            rows = min(rows, auto_size.host_rank_room(m) // token)
        sizes["host_pool_gib"] = rows * token / (1 << 30) if cfg.host_tier else 0.0
    return cfg.with_sizes(**sizes)


def _latent(cfg: HiSparseConfig, limits: EngineLimits) -> LatentSizes:
    row_bytes = limits.latent_row_bytes
    n = cfg.quest_rows or limits.max_num_seqs
    host = cfg.host_pool_bytes // (row_bytes * limits.num_layers) if cfg.host_tier else 0
    return LatentSizes(row_bytes=row_bytes, row_sets=n,
                       regions=cfg.prefill_slots if cfg.host_tier else n, host_rows=host,
                       resident=not cfg.host_tier, lend=cfg.host_tier and cfg.resident_first)
