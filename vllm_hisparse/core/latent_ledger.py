"""The latent pool's admission rules as counts (docs/dsa.md section 6), no tensors, and the log of
what was decided for the worker to replay.

The rules are written here once: a row set, a region and host pages for prompt + max_tokens, all or
nothing; the region back at ``prompt_done``; everything back at ``release``; resident mode: a region
for life, nothing else. With ``lend`` (the config's ``resident_first``) the region is not given back
at ``prompt_done`` but lent: the request decodes from it (region rows, no RESOLVE, no misses) until
an admission finds no free region, which then takes the region lent longest ago (``demote``: that
request reads its row set and the host from the next plan on; every row it wrote is on the host
already, written through). Two hold a ledger:

- the scheduler (the connector's scheduler role) must decide admission without the pool: it asks
  its ledger and sends ``events`` to the worker;
- the worker's ``core/latent_admission.LatentAdmission`` (the pool itself: which row set, region and
  host pages) keeps one for its counts (``log=False``) and asks its ``refusal``.

The worker applies the events in order to its ``LatentAdmission`` (``LatentRuntime.apply``): with
the same counts in the same order every admission the scheduler's ledger grants succeeds there too
(tests/test_dsa_runtime.py drives both against a count of what the worker holds).

Events: ``("admit", key, prompt_len, max_tokens)``, ``("prompt_done", key)``, ``("demote", key)``
(logged just before the admission that takes its region), ``("release", key)``.
Which process: the scheduler, and the worker inside its ``LatentAdmission``.
"""
from __future__ import annotations


class LatentLedger:
    def __init__(self, row_sets: int, regions: int, host_pages: int, max_model_len: int,
                 resident: bool, log: bool = True, lend: bool = False):
        """row_sets / regions / host_pages: what the worker's pool holds (resident: row_sets and
        host_pages unused); max_model_len: the most positions a request may take; log: append
        each decision to ``events`` (the scheduler's; the worker's admission keeps no log);
        lend: a complete prompt keeps its region until an admission needs it (not in resident
        mode, where the region is the request's latent anyway)."""
        if regions < 1 or (not resident and (row_sets < 1 or host_pages < 1)):
            raise ValueError(f"LatentLedger needs regions >= 1 (got {regions}) and, with a host "
                             f"pool, row_sets >= 1 and host_pages >= 1 (got {row_sets}, "
                             f"{host_pages}); raise prefill_slots / quest_rows / host_pool_gib")
        self.resident, self.max_model_len, self.log = resident, max_model_len, log
        self.free_sets = 0 if resident else row_sets
        self.free_regions, self.free_pages = regions, 0 if resident else host_pages
        self.row_sets, self.regions, self.host_pages = row_sets, regions, host_pages
        self.held: dict[object, list] = {}      # key -> [row set?, region?, pages]
        self.lend = lend and not resident
        self.lent: dict[object, None] = {}      # keys decoding in a region, oldest lent first
        self.demotions = 0
        self.events: list[tuple] = []

    def refusal(self, key, prompt_len: int, max_tokens: int) -> str | None:
        """Why ``key`` cannot be admitted now (one line), or None when it can. Positions past
        max_model_len are an error (the scheduler clips max_tokens first)."""
        total = prompt_len + max_tokens
        if prompt_len < 1 or max_tokens < 0 or total > self.max_model_len:
            raise ValueError(f"prompt_len={prompt_len} + max_tokens={max_tokens} must be in "
                             f"[1, max_model_len={self.max_model_len}]; clip max_tokens")
        if key in self.held:
            raise ValueError(f"request {key!r} is admitted already; release it first")
        if not self.resident and self.free_sets == 0:
            return f"no free latent row set (all {self.row_sets} in use)"
        if self.free_regions == 0 and not self.lent:
            what = "full-length" if self.resident else "prefill"
            return f"no free {what} region (all {self.regions} in use)"
        if not self.resident and total > self.free_pages:
            return (f"host pool: {total} pages needed, {self.free_pages} free of "
                    f"{self.host_pages}")
        return None

    def admit(self, key, prompt_len: int, max_tokens: int) -> bool:
        if self.refusal(key, prompt_len, max_tokens) is not None:
            return False
        pages = 0 if self.resident else prompt_len + max_tokens
        if self.free_regions == 0:                 # refusal let it through: a region is lent
            self.demote(next(iter(self.lent)))
        self.free_regions -= 1
        if not self.resident:
            self.free_sets -= 1
            self.free_pages -= pages
        self.held[key] = [not self.resident, True, pages]
        self._log(("admit", key, prompt_len, max_tokens))
        return True

    def in_prefill(self, key) -> bool:
        """``key`` holds a region for its prompt (not yet complete, or resident mode)."""
        return key in self.held and self.held[key][1] and key not in self.lent

    def prompt_done(self, key) -> None:
        """The prompt of ``key`` is complete: its prefill region goes back, or with ``lend`` is
        lent to its decoding (not in resident mode; a no-op once done)."""
        h = self.held.get(key)
        if h is None or self.resident or not h[1] or key in self.lent:
            return
        if self.lend:
            self.lent[key] = None
        else:
            h[1] = False
            self.free_regions += 1
        self._log(("prompt_done", key))

    def demote(self, key) -> None:
        """The region lent to ``key`` goes back; it decodes through its row set from now on."""
        if key not in self.lent:
            raise ValueError(f"request {key!r} has no lent region to give back")
        del self.lent[key]
        self.held[key][1] = False
        self.free_regions += 1
        self.demotions += 1
        self._log(("demote", key))

    def release(self, key) -> None:
        """Finished, aborted or preempted: all back (a no-op for a key holding nothing)."""
        h = self.held.pop(key, None)
        if h is None:
            return
        self.lent.pop(key, None)
        self.free_sets += h[0]
        self.free_regions += h[1]
        self.free_pages += h[2]
        self._log(("release", key))

    def _log(self, event: tuple) -> None:
        if self.log:
            self.events.append(event)

    def take_events(self) -> list[tuple]:
        out, self.events = self.events, []
        return out
