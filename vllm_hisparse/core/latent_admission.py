"""Who holds what of the latent pool (docs/dsa.md section 6): each admitted request's row set,
prefill region and host pages, handed out at admission and all given back when it finishes or is
preempted.

hisparse mode (a host pool given): a request is admitted when it gets a free row set, a free
prefill region and host pages for prompt + max_tokens, all or nothing; ``prompt_done`` gives the
region back once its prompt is complete (the next step's writes to it belong to another request;
this one reads its hot slots and the host from then on). With ``lend`` the region is kept past
``prompt_done`` (its decode tokens stay region tokens: core/latent_step.py) until ``demote`` gives
it back, on the scheduler's ``demote`` event just before the admission that takes it. A request
recomputed after a preemption is released and admitted again (it takes a region again).

resident mode (no host pool, docs/dsa.md section 7): a request holds a full-length region for its
whole life; no row sets, no host pages.

The rules are ``core/latent_ledger.LatentLedger``'s: this object keeps a ledger for its counts
(``refusal`` is the ledger's) and hands out which row set, region and host pages.
Which process: the worker, replaying the scheduler's ledger (``LatentRuntime.apply``; the pool's
row-set reset and host-row table happen here).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.core.latent_ledger import LatentLedger
from vllm_hisparse.core.latent_pool import LatentPool


@dataclass
class Grant:
    """What one admitted request holds. row_set / region: -1 = none."""
    row_set: int
    region: int
    tokens: int              # prompt + max_tokens: host pages held, positions it may write

    @property
    def in_region(self) -> bool:
        return self.region >= 0


class LatentAdmission:
    def __init__(self, pool: LatentPool, host: HostKVPool | None, lend: bool = False):
        """host: the host pool (one token per page, rows of pool.row values) in hisparse mode;
        None = resident mode; lend: keep a complete prompt's region until ``demote``
        (LatentLedger's ``lend``)."""
        if host is not None:
            if host.page_size != 1:
                raise ValueError(f"host pool page_size={host.page_size} must be 1 (one latent row "
                                 f"a page: the token -> host-row table is its page table)")
            if host.data[0, 0].numel() != pool.row or host.data.shape[0] != pool.num_layers:
                raise ValueError(f"host pool pages {tuple(host.data.shape)} must be ({pool.num_layers}"
                                 f" layers, pages, {pool.row} values a page); build it as "
                                 f"HostKVPool(layers, pages, 1, 1, {pool.row // 2}, dtype)")
            if pool.row_sets == 0:
                raise ValueError("LatentAdmission with a host pool needs row_sets > 0 in the pool")
        self.pool, self.host = pool, host
        self.resident = host is None
        self._free_sets = list(range(pool.row_sets - 1, -1, -1))   # pop() hands out 0, 1, ...
        self._free_regions = list(range(pool.regions - 1, -1, -1))
        self.grants: dict[object, Grant] = {}
        pages = 0 if host is None else host.num_pages
        self.ledger = LatentLedger(pool.row_sets, pool.regions, pages, pool.max_model_len,
                                   self.resident, log=False, lend=lend)

    # ---- admission ------------------------------------------------------------------------------
    def refusal(self, key, prompt_len: int, max_tokens: int) -> str | None:
        """Why ``key`` cannot be admitted now (one line), or None when it can (the ledger's rules
        over this pool's counts)."""
        return self.ledger.refusal(key, prompt_len, max_tokens)

    def admit(self, key, prompt_len: int, max_tokens: int) -> Grant | None:
        """Hand ``key`` what it needs (all or nothing); None when ``refusal`` says why not."""
        if self.ledger.free_regions == 0 and self.ledger.refusal(key, prompt_len,
                                                                 max_tokens) is None:
            raise RuntimeError(f"hisparse: admitting {key!r} would take a lent region that no "
                               f"'demote' event gave back first (the scheduler logs it before "
                               f"the admission)")
        if not self.ledger.admit(key, prompt_len, max_tokens):
            return None
        total = prompt_len + max_tokens
        region = self._free_regions.pop()
        row_set = -1
        if not self.resident:
            row_set = self._free_sets.pop()
            pages = self.host.ensure(key, total)
            self.pool.reset_row_set(row_set)
            self.pool.host_rows.grow(row_set, pages)
            self.pool.host_rows.flush()
        self.grants[key] = g = Grant(row_set, region, total)
        return g

    def prompt_done(self, key) -> None:
        """The prompt of ``key`` is complete: its prefill region goes back (hisparse mode; a no-op
        in resident mode, where the region is the request's latent; kept with ``lend``)."""
        g = self.grant(key)
        self.ledger.prompt_done(key)
        if not self.resident and not self.ledger.lend and g.region >= 0:
            self._free_regions.append(g.region)
            g.region = -1

    def demote(self, key) -> None:
        """The region lent to ``key`` goes back (a no-op in resident mode: a resident twin
        replays a hisparse scheduler's events, core/latent_shadow.py)."""
        if self.resident:
            return
        g = self.grant(key)
        self.ledger.demote(key)
        self._free_regions.append(g.region)
        g.region = -1

    def release(self, key) -> None:
        """``key`` finished or was preempted: everything it holds goes back."""
        g = self.grants.pop(key, None)
        if g is None:
            raise ValueError(f"request {key!r} holds nothing (never admitted, or released already)")
        self.ledger.release(key)
        if g.region >= 0:
            self._free_regions.append(g.region)
        if g.row_set >= 0:
            self._free_sets.append(g.row_set)
            self.pool.host_rows.clear(g.row_set)
            self.host.free(key)

    # ---- queries --------------------------------------------------------------------------------
    def grant(self, key) -> Grant:
        if key not in self.grants:
            raise ValueError(f"request {key!r} is not admitted; admit it first")
        return self.grants[key]

    def leaks(self) -> list[str]:
        """What is still held (empty when every row set, region and host page is free)."""
        out = [f"request {k!r} holds {g}" for k, g in self.grants.items()]
        if len(self._free_sets) != self.pool.row_sets:
            out.append(f"{self.pool.row_sets - len(self._free_sets)} row sets held")
        if len(self._free_regions) != self.pool.regions:
            out.append(f"{self.pool.regions - len(self._free_regions)} regions held")
        if self.host is not None and self.host.used_pages:
            out.append(f"{self.host.used_pages} host pages held by {self.host.owners()}")
        if self.pool.host_rows is not None and bool((self.pool.host_rows.table >= 0).any()):
            out.append("the host-row table still maps rows")
        return out
