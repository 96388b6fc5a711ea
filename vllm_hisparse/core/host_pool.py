"""HostKVPool: the authoritative KV of every request, in paged host memory (pinned when CUDA is up).

Layout ``data: (layers, pages, 2, page_size, Hkv, D)``: one host page holds ``page_size`` tokens of
one layer, K block then V block (FlashInfer's NHD paged layout, the same as a hot-buffer slot), so
one page-level selection unit of one layer is one contiguous run of bytes — what fast GPU-side
gathers need (rows >= 4 KB reach ~90% of the pinned H2D ceiling).
A request owns a list of page ids shared by all of its layers. Core tests hand pages out from the
pool's free list (``ensure``, never twice; all come back on ``free``); in an engine the scheduler
owns the ids (core/host_pages.py ``HostPageTable``: pages shared by block hash) and ``assign``
gives a request its whole list, which ``free`` only forgets.
"""
from __future__ import annotations

import os
import weakref

import torch

from vllm_hisparse.core.pinned import pinned_empty

GIB = 1 << 30
SUGGEST_SHARE = 0.6      # guess: leave 40% of the available RAM to vLLM's own processes and the OS


class HostPoolFull(RuntimeError):
    """Not enough free host pages; the caller decides whether the request waits or is rejected."""


class HostPoolPinError(RuntimeError):
    """The pool's host memory could not be pinned (or allocated); the message says how much the
    machine has and what host_pool_gib to use instead."""

    def __init__(self, nbytes: int, cause: str, host_pool_gib: float | None = None,
                 pinned: bool = True, ranks: int = 1):
        self.nbytes, self.cause, self.pinned = nbytes, cause, pinned
        super().__init__(pin_failure_message(nbytes, cause, host_pool_gib, pinned, host_memory(),
                                             ranks))


def host_memory() -> dict[str, int]:
    """Host RAM in bytes: ``total`` and ``available`` (/proc/meminfo MemTotal, MemAvailable; else
    sysconf, whose free pages stand in for available), and ``limit`` when a cgroup (container)
    memory limit is below the total, with ``used``: what the cgroup holds already (its
    memory.current). Keys whose value is unknown are left out."""
    mem: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    mem["total" if name == "MemTotal" else "available"] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for key, name in (("total", "SC_PHYS_PAGES"), ("available", "SC_AVPHYS_PAGES")):
        if key not in mem:
            try:
                mem[key] = os.sysconf(name) * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                pass
    for path, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                        "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(path) as f:
                limit = int(f.read().strip())       # "max" (no limit) raises ValueError
        except (OSError, ValueError):
            continue
        if limit < mem.get("total", limit + 1):
            mem["limit"] = limit
            try:
                with open(used) as f:
                    mem["used"] = int(f.read().strip())
            except (OSError, ValueError):
                pass
        break
    return mem


def host_room(mem: dict[str, int]) -> int | None:
    """Bytes a new allocation can still get: the available RAM, and under a container limit at
    most the limit less what the container already uses; None when neither is known."""
    rooms = [mem["available"]] if "available" in mem else []
    if "limit" in mem:
        rooms.append(mem["limit"] - mem.get("used", 0))
    return max(min(rooms), 0) if rooms else None


def _have(mem: dict[str, int]) -> str:
    have = []
    if "total" in mem:
        have.append(f"{mem['total'] / GIB:.1f} GiB of RAM")
    if "available" in mem:
        have.append(f"{mem['available'] / GIB:.1f} GiB available now")
    if "limit" in mem:
        used = f", {mem['used'] / GIB:.1f} GiB of it in use" if "used" in mem else ""
        have.append(f"a container memory limit of {mem['limit'] / GIB:.1f} GiB{used}")
    return ", ".join(have) or "an unknown amount of RAM"


def _gib_str(gib: float) -> str:
    return str(int(gib)) if gib >= 1 else str(round(gib, 2))


def _suggest(room: int | None, ranks_total: int = 1, ranks_here: int = 1) -> str:
    """The fix: a host_pool_gib (the engine's total over ranks_total ranks, ranks_here of which
    pin on this host) whose share here is SUGGEST_SHARE of the room."""
    if room is None:
        return "lower host_pool_gib"
    gib = SUGGEST_SHARE * room / GIB * ranks_total / ranks_here
    if gib < 0.01:
        return "free host memory (other processes hold it) or lower host_pool_gib"
    return (f"lower host_pool_gib to about {_gib_str(gib)} ({SUGGEST_SHARE:.0%} of the available "
            f"memory{'' if ranks_here == ranks_total else ' on this host'})")


def pin_failure_message(nbytes: int, cause: str, host_pool_gib: float | None, pinned: bool,
                        mem: dict[str, int], ranks: int = 1) -> str:
    """One line: what could not be pinned, what the machine has, which host_pool_gib to use.
    ranks: tensor-parallel ranks sharing host_pool_gib (nbytes is then one rank's share)."""
    setting = f"host_pool_gib={host_pool_gib}" if host_pool_gib is not None else "set by host_pool_gib"
    if ranks > 1:
        setting += f", this rank's share of {ranks}"
    return (f"hisparse: could not {'pin' if pinned else 'allocate'} {nbytes / GIB:.2f} GiB of host "
            f"memory for the host KV pool ({setting}): this machine has {_have(mem)}; "
            f"{_suggest(host_room(mem), ranks, ranks)} (torch: {cause})")


PIN_SHARE = 0.9   # guess: refuse a pool above 90% of the room, leaving the rest to vLLM's processes


class HostPoolTooLarge(ValueError):
    """The host pools of the ranks on this host would not fit its memory (checked at startup,
    before any rank allocates)."""


def check_host_room(host_pool_gib: float, rank_bytes: int, ranks_total: int, ranks_here: int,
                    pinned: bool, mem: dict[str, int] | None = None) -> None:
    """Refuse, in one line naming host_pool_gib and a value that fits, when the pools that the
    ranks_here ranks on this host allocate (rank_bytes each; host_pool_gib is the engine's total
    over ranks_total ranks) exceed PIN_SHARE of this host's room (``host_room``: the available RAM
    and the container limit). Nothing is checked when the room is unknown."""
    mem = host_memory() if mem is None else mem
    room = host_room(mem)
    need = rank_bytes * ranks_here
    if room is None or need <= PIN_SHARE * room:
        return
    split = f" ({ranks_here} ranks x {rank_bytes / GIB:.2f} GiB)" if ranks_here > 1 else ""
    raise HostPoolTooLarge(
        f"hisparse: host_pool_gib={host_pool_gib} needs {need / GIB:.2f} GiB of "
        f"{'pinned ' if pinned else ''}host memory on this host{split}, more than "
        f"{PIN_SHARE:.0%} of the {room / GIB:.2f} GiB it can still give (this machine has "
        f"{_have(mem)}); {_suggest(room, ranks_total, ranks_here)}")


class HostKVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.bfloat16, pin: bool | None = None,
                 device=None):
        """device: None = host memory (pinned when CUDA is up, exactly its size: core/pinned.py);
        a device = the same paged pool in that device's memory (the runtime's pool for the dense
        layers of long requests). ``data`` and its views must not outlive the pool (it unpins the
        memory when collected)."""
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
        if device is not None and torch.device(device).type != "cpu":
            self.data = torch.empty(shape, dtype=dtype, device=device)
        else:
            if pin is None:
                pin = torch.cuda.is_available()
            try:
                if pin:                  # exactly its size (torch's pinned allocator rounds up to 2^n)
                    self.data, unpin = pinned_empty(shape, dtype)
                    self._unpin = weakref.finalize(self, unpin)
                else:
                    self.data = torch.empty(shape, dtype=dtype, device="cpu")
            except RuntimeError as e:   # torch.AcceleratorError / OutOfMemoryError: CUDA couldn't pin
                nbytes = num_layers * num_pages * self.page_bytes(page_size, num_kv_heads, head_dim,
                                                                  dtype)
                raise HostPoolPinError(nbytes, str(e).strip().splitlines()[0], pinned=pin) from e
        self._free: list[int] = list(range(num_pages - 1, -1, -1))   # pop() hands out 0, 1, ...
        self._owned: dict[object, list[int]] = {}
        self.assigned = False             # page ids come from the scheduler (``assign``)
        self._held: dict[int, int] = {}   # assigned pages -> how many keys hold them

    @staticmethod
    def page_bytes(page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one page of one layer (K and V)."""
        return 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    # ---- accounting --------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        if self.assigned:                 # distinct pages the live requests hold (kept as they
            return len(self._held)        # change: read every step by the metrics)
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_hold(self, key, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) - len(self._owned.get(key, ())) <= len(self._free)

    def page_table(self, key) -> list[int]:
        return self._owned.get(key, [])

    def owners(self) -> list:
        return list(self._owned)

    # ---- lifecycle ---------------------------------------------------------------------------
    def assign(self, key, pages: list[int]) -> None:
        """``key``'s whole page list, from the scheduler (its pages may be shared with other keys:
        read-only below the request's ``shared_upto``); replaces any list it had."""
        self.assigned = True
        self._hold(self._owned.get(key, ()), -1)
        self._owned[key] = list(pages)
        self._hold(pages, 1)

    def ensure(self, key, num_tokens: int) -> list[int]:
        """Grow ``key``'s page list to hold ``num_tokens`` tokens; all or nothing. With assigned
        pages it only checks that the list holds them."""
        pages = self._owned.setdefault(key, [])
        need = self.pages_for(num_tokens) - len(pages)
        if self.assigned and need > 0:
            if not pages:
                del self._owned[key]
            raise HostPoolFull(f"host KV pool: request {key!r} holds {len(pages)} pages from the "
                               f"scheduler, needs {self.pages_for(num_tokens)}; the connector "
                               f"assigns a request's whole life at admission")
        if need > len(self._free):
            if not pages:
                del self._owned[key]
            raise HostPoolFull(f"host KV pool full: request {key!r} needs {need} more pages of "
                               f"{self.page_size} tokens, {len(self._free)} free of {self.num_pages}")
        if need > 0:                     # what `need` pops from the free list's end would give
            pages.extend(reversed(self._free[-need:]))
            del self._free[-need:]
        return pages

    def free(self, key) -> int:
        """Return every page of ``key``; returns how many (0 if it held none)."""
        pages = self._owned.pop(key, [])
        if not self.assigned:             # assigned pages go back through the scheduler
            self._free.extend(reversed(pages))
        else:
            self._hold(pages, -1)
        return len(pages)

    def _hold(self, pages, d: int) -> None:
        held = self._held
        for p in pages:
            c = held.get(p, 0) + d
            if c:
                held[p] = c
            else:
                del held[p]

    # ---- data --------------------------------------------------------------------------------
    def _addr(self, key, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pt = torch.tensor(self._owned.get(key, []), dtype=torch.int64, device="cpu")
        pos = positions.to("cpu", torch.int64)
        if len(pos) and int(pos.max()) >= len(pt) * self.page_size:
            raise IndexError(f"position {int(pos.max())} beyond the {len(pt)} pages of {key!r}")
        return pt[pos // self.page_size], pos % self.page_size

    def write(self, key, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens' K and V, each (n, Hkv, D), at positions (n,); pages must exist (``ensure``)."""
        page, off = self._addr(key, positions)
        self.data[layer, page, 0, off] = k.to("cpu", self.data.dtype)
        self.data[layer, page, 1, off] = v.to("cpu", self.data.dtype)

    def read(self, key, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, each (n, Hkv, D), of tokens at positions (n,)."""
        page, off = self._addr(key, positions)
        return self.data[layer, page, 0, off], self.data[layer, page, 1, off]

    def page_table_tensor(self, keys: list, width: int) -> torch.Tensor:
        """(len(keys), width) int32 host page ids, -1 beyond each key's pages (None = padding row)."""
        out = torch.full((len(keys), width), -1, dtype=torch.int32, device="cpu")
        for i, key in enumerate(keys):
            pages = self._owned.get(key, []) if key is not None else []
            if pages:
                out[i, :len(pages)] = torch.tensor(pages[:width], dtype=torch.int32, device="cpu")
        return out
