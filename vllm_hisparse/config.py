"""HiSparseConfig: the one frozen configuration of vllm-hisparse, validated at load.

Loaded from a dict (vLLM's ``--additional-config '{"hisparse": {...}}'``) or a JSON file
(``--hisparse-config FILE.json``). Every error is one line naming the field, the value and the fix.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

GIB = 1 << 30

# The indexers a config may name, each with its selection unit: "page" (page_size tokens) or
# "token" (one). core/indexers maps each name to its class; ``indexers.register`` adds a name to
# both (this table sits below core/ in the layers, so the config can check a name without it).
INDEXERS = {"quest": "page", "dsa": "token", "dsa_sorted": "token",
            "dsa_stable": "token"}
UNITS = ("page", "token")
HOSTLESS = ("sparse", "wait", "dense")   # a request the host tier cannot take (HiSparseConfig.hostless)
AUTO_FIELDS = ("host_pool_gib", "quest_rows", "dense_pool_gib")   # absent/"auto": core/auto_size


class HiSparseConfigError(ValueError):
    """A configuration value is wrong; the message names the field, the value and the fix."""


@dataclass(frozen=True)
class HiSparseConfig:
    """All knobs of HiSparse. Sizes in tokens unless the name says bytes/GiB.

    top_k: tokens attended per decode step per layer (Quest: rounded up to whole pages).
    device_buffer_size: B, hot-buffer tokens kept on the GPU per request per layer; >= top_k and a
        multiple of the selection unit (page_size for page indexers, 1 for token indexers).
    page_size: tokens per selection unit for page/block indexers (Quest/NSA) and per host-pool page.
    indexer: "quest" (page-level, any Llama/Qwen-style model) or "dsa" (token-level); the class
        comes from the registry in core/indexers (``indexers.register`` adds one; vLLM serves a
        GQA model with a page indexer such as "quest", and "dsa" on MLA models, docs/dsa.md;
        "dsa_sorted": DSA's selection sorted by position, core/indexers/dsa/sorted.py;
        "dsa_stable": that, with ties at the k-th score broken by position,
        core/indexers/dsa/stable.py).
    host_pool_gib: pinned host memory for the authoritative KV of every request, the engine's
        total (each tensor-parallel rank pins 1/TP). Absent or "auto" (None): from this host's
        available RAM, at most what the indexer rows' requests fill (core/auto_size.py).
    io_chunk_bytes: bytes one GPU thread moves per load loop when fetching misses from host.
    policy: hot-buffer replacement policy (vllm_hisparse.slots.available(); served: slots.served()).
    dense_layers: layers kept fully resident and dense (Quest skips the first two).
    dense_pool_gib: GPU memory reserved for the full KV of the dense_layers of long (sparse)
        requests, so those layers stay resident after the request's other GPU blocks are given
        back. 0 = no pool: a dense layer then reads the given-back pages from the host pool every
        step (exact, but PCIe-bound). Requests wait when the pool is full (``hostless``). Absent or
        "auto" (None): quest_rows x cdiv(max_model_len, page_size) pages (core/auto_size.py).
    min_context: a request is sparse from the step its context (prompt + generated tokens)
        reaches this (core/residency.py): a longer prompt from its first token, a shorter one from
        the step it grows past it; until then, and for requests that never reach it, fully resident
        and dense (no Quest, no host tier). None (default) = 2 x device_buffer_size: below that
        the hot buffer saves less than half of the request's KV. 0 = every request sparse.
    quest_rows: Quest page-bound rows on the GPU = long (sparse) requests admitted at once; each row
        is 2 x cdiv(max_model_len, page_size) x Hkv x D per sparse layer. 0 = --max-num-seqs.
        Absent or "auto" (None): the requests of max_model_len tokens the GPU KV budget (less the
        rows and dense pool) admits, at most --max-num-seqs and an auto host pool's (auto_size).
    prefill_slots: indexer "dsa" only: full-length latent regions on the GPU, i.e. prompts in
        prefill at once (a prompt's chunks select top-k anywhere in it; docs/dsa.md section 2);
        requests beyond it wait. Each is max_model_len x 1152 B per layer.
    mla_num_splits: indexer "dsa" only: FA3's num_splits for the sparse-MLA attention call. 0
        (default) = FA3's own heuristic, what stock FLASH_ATTN_MLA_SPARSE passes: bit-equal to stock
        (and hisparse to resident) when the runs schedule the same batches; 1 = no split, each row
        independent of its batch (hisparse == resident also when admission schedules differently),
        no longer stock's bits (docs/dsa.md, "Exactness").
    prefetch: overlap miss IO with the previous layer when layers share a selection.
    resident_first (default on): a sparse request keeps every GPU block after its prompt (RESOLVE through the
        block table, no misses) until the KV pool needs blocks; then it gives back just the
        missing ones, oldest pages first, down to its hot buffer, one way (docs/vllm-
        integration.md, "Residency states"); admission still counts the hot-buffer floor; the
        KV manager (vllm/spec.py) spills when the free blocks fall below its reserve or below
        what an arriving request needs. Indexer "dsa": a complete prompt keeps its prefill
        region, decoding from it (no RESOLVE, no misses), until an arriving prompt finds no free
        region and takes the one lent longest ago (core/latent_ledger.py); same outputs.
    host_tier: False = every token resident on the GPU with the same selection and kernels (the
        exactness reference).
    hostless: a request the host (or dense) pool cannot take: "sparse" (default) runs host-less
        while vLLM's GPU blocks hold its whole life and a Quest row is free (resident mode's
        outputs, never spilled, moved into the host tier when room frees), else waits; "wait":
        waits; "dense" (changes outputs): host-less without a row, stock vLLM's dense outputs.
    full_decode_graphs: let vLLM replay whole decode steps as FULL CUDA graphs, as stock vLLM does
        (the backend declares UNIFORM_SINGLE_TOKEN_DECODE): every step whose rows each have one
        query token is one decode batch (core/decode_batch.py), planned before the replay (from the
        KV connector's start_load_kv), and every layer's recorded body (core/decode_body.py) serves
        any mix of sparse, dense and padding rows. Mixed prefill/decode steps run PIECEWISE (the
        same body eagerly for their one-token rows). None (default) = on where
        it can run: a CUDA device, split_dense_decode on, no trace_dir, and dense_layers [] or
        dense_pool_gib > 0 with the host tier (``full_graphs_blocker``); True = on, refused at
        startup where it cannot run; False = off (every layer eagerly between vLLM's graph pieces).
    split_dense_decode: attend dense rows with one query token (short requests' decode steps,
        dense layers of long ones) with the split-KV decode kernel whose splits sit at fixed key
        positions (ops/triton_dense_decode.py: batch-invariant, so exactness holds), instead of
        FlashAttention without split-KV (8 CTAs for one Llama-3-8B row, slow for few rows). Rows
        with several query tokens (prefill) keep FlashAttention. None (default) = on when the KV lives on a CUDA device and the head
        size is one the kernel has (64, 128, 256), else off; True = on (refused at startup on a
        GPU for other head sizes; on the CPU the plain-torch twin runs); False = off.
    trace_dir: when set, selections are appended per request to trace files there.
    """

    top_k: int = 2048
    device_buffer_size: int = 4096
    page_size: int = 16
    indexer: str = "quest"
    host_pool_gib: Optional[float] = None     # None (as dense_pool_gib, quest_rows) = auto
    io_chunk_bytes: int = 64
    policy: str = "lru"
    dense_layers: tuple = (0, 1)
    dense_pool_gib: Optional[float] = None
    min_context: Optional[int] = None
    quest_rows: Optional[int] = None
    prefill_slots: int = 1
    mla_num_splits: int = 0
    prefetch: bool = False
    resident_first: bool = True
    host_tier: bool = True
    hostless: str = "sparse"
    full_decode_graphs: Optional[bool] = None
    split_dense_decode: Optional[bool] = None
    trace_dir: Optional[str] = None

    def __post_init__(self):
        for name in AUTO_FIELDS:                  # "auto" is spelled None from here on
            if getattr(self, name) == "auto":
                object.__setattr__(self, name, None)
        _check_types(self)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            _fail("page_size", self.page_size, "use a power of two such as 16 or 64")
        if self.hostless not in HOSTLESS:
            _fail("hostless", self.hostless, f"choose one of {', '.join(HOSTLESS)}")
        if self.indexer not in INDEXERS:
            _fail("indexer", self.indexer, f"choose one of {', '.join(INDEXERS)}")
        if self.top_k < 1:
            _fail("top_k", self.top_k, "use a positive token count such as 2048")
        if self.device_buffer_size < self.top_k:
            _fail("device_buffer_size", self.device_buffer_size,
                  f"must be >= top_k={self.top_k}; 2*top_k={2 * self.top_k} is a good start")
        unit = self.unit_tokens
        if self.device_buffer_size % unit:
            up = -(-self.device_buffer_size // unit) * unit
            _fail("device_buffer_size", self.device_buffer_size,
                  f"must be a multiple of the selection unit ({unit} tokens, page_size); try {up}")
        if self.host_pool_gib is not None and self.host_pool_gib <= 0:
            _fail("host_pool_gib", self.host_pool_gib,
                  "use a positive size in GiB such as 16, or \"auto\" (sized from the host's RAM)")
        if self.dense_pool_gib is not None and self.dense_pool_gib < 0:
            _fail("dense_pool_gib", self.dense_pool_gib,
                  "use 0 (no pool), a size in GiB such as 4, or \"auto\"")
        c = self.io_chunk_bytes
        if c < 16 or c > 256 or c & (c - 1):     # the CUDA RESOLVE kernel's range
            _fail("io_chunk_bytes", c, "use a power of two from 16 to 256 (64 is a good start)")
        if any(x < 0 for x in self.dense_layers) or len(set(self.dense_layers)) != len(self.dense_layers):
            _fail("dense_layers", list(self.dense_layers), "list distinct layer indices >= 0, e.g. [0, 1]")
        if self.prefill_slots < 1:
            _fail("prefill_slots", self.prefill_slots, "use 1 (the default) or more prompts in "
                  "prefill at once")
        if self.mla_num_splits < 0:
            _fail("mla_num_splits", self.mla_num_splits, "use 0 (FA3's heuristic, as stock) or 1 "
                  "(no split: batch-invariant)")
        if self.quest_rows is not None and self.quest_rows < 0:
            _fail("quest_rows", self.quest_rows,
                  "use a positive row count, 0 (= --max-num-seqs) or \"auto\"")
        if self.min_context is not None and self.min_context < 0:
            _fail("min_context", self.min_context,
                  "use 0 (all requests sparse), a token count, or null (2 x device_buffer_size)")
        if self.full_decode_graphs and self.full_graphs_blocker():
            _fail("full_decode_graphs", True, self.full_graphs_blocker())
        from vllm_hisparse.slots import available, served  # the lowest layer (torch only)

        if self.policy not in available():
            others = ", ".join(p for p in available() if p not in served())
            also = ", ".join(p for p in served() if p != "lru")
            _fail("policy", self.policy, f"use \"lru\" (what vLLM serves; also served: {also}); "
                  f"{others} run only in the core and the simulator (hisparse sim)")

    # ---- derived -------------------------------------------------------------------------------
    def full_graphs_blocker(self) -> str | None:
        """Why this config cannot run FULL decode graphs (None: it can, given a CUDA device and a
        head size the split-KV decode kernel has): the fix, as an error message would give it."""
        if self.trace_dir is not None:
            return ("tracing copies selections to the host every layer; set full_decode_graphs "
                    "false or drop trace_dir")
        if self.host_tier and self.dense_layers and self.dense_pool_gib == 0:
            return (f"dense_layers {list(self.dense_layers)} would read given-back pages from the "
                    f"host pool, which a CUDA graph cannot capture: set dense_pool_gib > 0 (e.g. "
                    f"4), dense_layers [], or full_decode_graphs false")
        if self.split_dense_decode is False:
            return ("the graphs attend dense rows with the split-KV decode kernel: leave "
                    "split_dense_decode unset (or true), or set full_decode_graphs false")
        return None

    @property
    def unit_tokens(self) -> int:
        """Tokens per selection unit: a page for Quest, one token for DSA."""
        return self.page_size if INDEXERS[self.indexer] == "page" else 1

    @property
    def top_k_units(self) -> int:
        return -(-self.top_k // self.unit_tokens)

    @property
    def min_context_tokens(self) -> int:
        """The effective min_context: the context at which a request turns sparse."""
        return 2 * self.device_buffer_size if self.min_context is None else self.min_context

    @property
    def num_slots(self) -> int:
        """Hot-buffer slots per request per layer (one slot holds one selection unit)."""
        return self.device_buffer_size // self.unit_tokens

    @property
    def auto_fields(self) -> tuple:
        """The sizes left to ``core.auto_size`` (absent or "auto"); none in a resolved config."""
        return tuple(f for f in AUTO_FIELDS if getattr(self, f) is None)

    def with_sizes(self, **sizes) -> "HiSparseConfig":
        """A copy with auto sizes filled in (computed values: not validated, not a parse)."""
        new = copy.copy(self)
        for name, value in sizes.items():
            assert name in AUTO_FIELDS, name
            object.__setattr__(new, name, value)
        return new

    @property
    def host_pool_bytes(self) -> int:            # 0 while auto (unresolved), as dense_pool_bytes
        return int((self.host_pool_gib or 0) * GIB)

    @property
    def dense_pool_bytes(self) -> int:
        return int((self.dense_pool_gib or 0) * GIB)

    @property
    def uses_dense_pool(self) -> bool:
        """The dense layers of sparse requests live in the GPU dense pool (false while the size
        is auto, i.e. unresolved)."""
        return self.host_tier and bool(self.dense_layers) and (self.dense_pool_gib or 0) > 0

    def host_pool_layers(self, num_layers: int) -> list[int]:
        """Layers the host pool holds: all of them, or only the sparse ones when the dense layers
        live in the GPU dense pool (nothing reads their host copy then)."""
        if self.uses_dense_pool:
            return [i for i in range(num_layers) if i not in self.dense_layers]
        return list(range(num_layers))

    def host_pool_pages(self, num_layers: int, page_bytes: int) -> int:
        """Pages the host pool holds; page_bytes: one page of one layer (K and V)."""
        return self.host_pool_bytes // (page_bytes * len(self.host_pool_layers(num_layers)))

    def dense_pool_pages(self, page_bytes: int) -> int | None:
        """Pages of the GPU dense pool (None without one); a sparse request takes as many there as
        in the host pool."""
        if not self.uses_dense_pool:
            return None
        return self.dense_pool_bytes // (page_bytes * len(self.dense_layers))

    def check_dense_pool(self, max_model_len: int, bytes_per_token_per_layer: int) -> None:
        """Fail at load if one request of max_model_len tokens cannot fit in the dense pool."""
        if not self.uses_dense_pool:
            return
        pages = -(-max_model_len // self.page_size)
        need = pages * self.page_size * bytes_per_token_per_layer * len(self.dense_layers)
        if need > self.dense_pool_bytes:
            _fail("dense_pool_gib", self.dense_pool_gib,
                  f"one request of max_model_len={max_model_len} needs {_size(need)} for its "
                  f"{len(self.dense_layers)} dense layers; set dense_pool_gib to at least "
                  f"{gib_at_least(need)}, lower max_model_len, or set dense_pool_gib to 0 (dense "
                  f"layers read the host pool)")

    def check_host_pool(self, max_model_len: int, bytes_per_token_per_layer: int,
                        num_sparse_layers: int) -> None:
        """Fail at load if one request of max_model_len tokens cannot fit in the host pool."""
        pages = -(-max_model_len // self.page_size)
        need = pages * self.page_size * bytes_per_token_per_layer * num_sparse_layers
        if need > self.host_pool_bytes:
            _fail("host_pool_gib", self.host_pool_gib,
                  f"one request of max_model_len={max_model_len} needs {_size(need)}; set "
                  f"host_pool_gib to at least {gib_at_least(need)} or lower max_model_len")

    def check_layers(self, num_layers: int) -> None:
        bad = [x for x in self.dense_layers if x >= num_layers]
        if bad:
            _fail("dense_layers", list(self.dense_layers),
                  f"the model has {num_layers} layers; drop {bad}")

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HiSparseConfig":
        if not isinstance(d, Mapping):
            raise HiSparseConfigError(f"hisparse config must be a JSON object such as "
                                      f"{{\"top_k\": 2048}}, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise HiSparseConfigError(
                f"hisparse config: unknown key(s) {unknown}; known keys: {', '.join(sorted(names))}")
        kw = dict(d)
        if isinstance(kw.get("dense_layers"), list):
            kw["dense_layers"] = tuple(kw["dense_layers"])
        return cls(**kw)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "HiSparseConfig":
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise HiSparseConfigError(f"hisparse config file {path} is not valid JSON: {e}") from None
        except OSError as e:
            raise HiSparseConfigError(
                f"hisparse config file {os.fspath(path)!r} cannot be read ({e.strerror}): give the "
                f"path of a JSON file of hisparse settings, e.g. {{\"top_k\": 2048}}") from None
        return cls.from_dict(d)

    @classmethod
    def load(cls, src: "HiSparseConfig | Mapping[str, Any] | str | os.PathLike | None") -> "HiSparseConfig":
        """Accept a config, a dict, a JSON file path or a JSON string; None gives the defaults."""
        if src is None:
            return cls()
        if isinstance(src, HiSparseConfig):
            return src
        if isinstance(src, Mapping):
            return cls.from_dict(src)
        if not isinstance(src, (str, os.PathLike)):
            _fail("hisparse", src, "give an object of settings such as {\"top_k\": 2048}, a JSON "
                  "string of one, or the path of a JSON file")
        s = os.fspath(src)
        if s.lstrip().startswith("{"):
            try:
                d = json.loads(s)
            except json.JSONDecodeError as e:
                raise HiSparseConfigError(f"hisparse config: the JSON string {s!r} is not valid "
                                          f"JSON ({e}); fix it or put the settings in a file "
                                          f"(--hisparse-config FILE.json)") from None
            return cls.from_dict(d)
        return cls.from_json(s)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["dense_layers"] = list(self.dense_layers)
        return d


_TYPES = {
    "top_k": int, "device_buffer_size": int, "page_size": int, "indexer": str,
    "host_pool_gib": (int, float, type(None)), "io_chunk_bytes": int, "policy": str,
    "dense_layers": tuple, "dense_pool_gib": (int, float, type(None)),
    "min_context": (int, type(None)), "quest_rows": (int, type(None)), "prefill_slots": int,
    "mla_num_splits": int, "prefetch": bool, "resident_first": bool, "host_tier": bool,
    "hostless": str, "full_decode_graphs": (bool, type(None)),
    "split_dense_decode": (bool, type(None)), "trace_dir": (str, type(None)),
}


def _check_types(cfg: HiSparseConfig) -> None:
    for name, typ in _TYPES.items():
        v = getattr(cfg, name)
        if any(isinstance(x, float) and not math.isfinite(x)
               for x in (v if isinstance(v, tuple) else (v,))):
            # Python's JSON reads NaN and Infinity, which pass the range checks below
            _fail(name, list(v) if isinstance(v, tuple) else v, _finite_fix(name))
        bad = not isinstance(v, typ) or (typ is not bool and isinstance(v, bool) and bool not in
                                         (typ if isinstance(typ, tuple) else (typ,)))
        if name == "dense_layers" and not bad:
            bad = not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if bad:
            want = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
            if name == "dense_layers":
                want = "list of int"
            _fail(name, list(v) if isinstance(v, tuple) else v, f"expected {want}")


def _finite_fix(name: str) -> str:
    default = HiSparseConfig.__dataclass_fields__[name].default
    example = (" or \"auto\" (the default)" if name in AUTO_FIELDS else
               " or null (the default)" if default is None
               else f", e.g. the default {json.dumps(default)}")
    return f"NaN and Infinity are not numbers here; give a finite number{example}"


def _size(nbytes: int) -> str:
    """A size that stays readable below 0.01 GiB (tiny pools used to read "needs 0.00 GiB")."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 100 else f"{nbytes / (1 << 20):.1f} MiB"


def gib_at_least(nbytes: int) -> float:
    """The smallest GiB value of three significant digits whose pool (``int(gib * GIB)`` bytes)
    holds ``nbytes``."""
    gib = max(nbytes, 1) / GIB
    step = 10.0 ** (math.floor(math.log10(gib)) - 2)
    n = math.ceil(round(gib / step, 6))
    while int(float(f"{n * step:.10g}") * GIB) < nbytes:
        n += 1
    return float(f"{n * step:.10g}")


def _fail(name: str, value: Any, fix: str):
    raise HiSparseConfigError(f"hisparse config: {name}={value!r} is invalid: {fix}")
