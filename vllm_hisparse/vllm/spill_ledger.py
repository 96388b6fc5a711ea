"""The spill ledger: the link between one block pool's HiSparseManager (vllm/spec.py) and the
scheduler-side connector (vllm/connector_scheduler.py), kept on vLLM's BlockPool itself."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field


@dataclass
class SpillLedger:
    """The link between the manager and the scheduler-side connector of one block pool: the
    requests running host-less (``hostless``: never freed from, never spilled; both modes) and,
    with resident_first, the spills: the connector sets ``reserve`` (bind_gpu_block_pool) and asks
    for room before it admits a request (``make_room``); the manager records each request's new
    ``keep`` in ``spilled``, which the connector takes into the step's metadata."""
    reserve: int | None = None        # free blocks to keep; None (no connector bound): spill at once
    spilled: dict[str, int] = field(default_factory=dict)     # req -> keep, this step's shrinks
    hostless: set[str] = field(default_factory=set)     # requests with no host copy
    # requests whose context never reaches min_context (the connector's rule, with spec decode's
    # lookahead): their hot slots are never written, so the floor copies block 0 only
    never_sparse: set[str] = field(default_factory=set)
    bound: bool = False               # a HiSparseManager uses it (one per pool: one sparse group;
                                      # a flag and a weak reference: the pool holds the ledger)
    guard: object = None              # the manager's PublishGuard (vllm/publish_guard.py)
    # prefix caching: the manager's hashed hot-slot blocks moved to fresh copies before the
    # worker overwrites them / dropped from the cache (no free block); the connector reports them
    donation: dict[str, int] = field(default_factory=lambda: {"donated": 0, "dropped": 0})
    _manager: "weakref.ref | None" = None

    def take(self) -> dict[str, int]:
        out, self.spilled = self.spilled, {}
        return out

    def make_room(self, blocks: int) -> None:
        """Spill until ``blocks`` blocks are free, or nothing is left to spill (no manager: a
        no-op)."""
        m = self._manager() if self._manager is not None else None
        if m is not None:
            m.spill_until(blocks)

    def floor_copies(self, request, hit_blocks: int) -> int:
        """Fresh blocks the floor copy-on-write will take for ``request`` with a prefix-cache hit
        of ``hit_blocks`` blocks (the connector's admission count); no manager: all of them (an
        upper bound)."""
        m = self._manager() if self._manager is not None else None
        return hit_blocks if m is None else m.floor_copies(request, hit_blocks)


LEDGER_ATTR = "_hisparse_spill_ledger"     # the attribute of vLLM's BlockPool that holds it


def ledger_of(block_pool) -> SpillLedger:
    """The spill ledger of a vLLM BlockPool (scheduler process; created on first use and kept
    on the pool itself, so it lives as long as the pool)."""
    led = getattr(block_pool, LEDGER_ATTR, None)
    if led is None:
        led = SpillLedger()
        setattr(block_pool, LEDGER_ATTR, led)
    return led
