"""Speculative decoding's verify rows in the SparseRuntime without vLLM (core/spec_rows.py): the
driver of test_sparse_runtime_exact.py with rows of 1..4 tokens past their prompts (verified token +
drafts) and rejections (the next step starts again at the first rejected position, as vLLM's
num_computed_tokens does), blocks the scheduler frees poisoned with NaN. hisparse (4 hot slots:
misses) == resident bit for bit, every layer, every step; a corrupted host fetch differs; and the
verify rows are attended sparsely (not as the prefill chunks they were before)."""
from __future__ import annotations

import pytest
import torch

from test_sparse_runtime_exact import Driver
from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.page_table import CORRUPT_FETCH_ENV
from vllm_hisparse.core.residency import freed_pages

SPEC = 3
PROMPTS = {"a": 150, "b": 93, "c": 20}          # "c" turns sparse at 40 tokens (min_context)


class SpecDriver(Driver):
    def step(self, todo: dict[str, int], reject: dict[str, int] | None = None):
        """Driver.step, then the rejected drafts taken back before the scheduler frees blocks
        (it frees by the accepted tokens: processed = num_computed_tokens)."""
        self._plain_step(todo)
        for rid, n in (reject or {}).items():
            self.lens[rid] -= n
        for rid in todo:
            lo, hi = freed_pages(self.cfg, self.lens[rid], self.prompt[rid], 0)
            for kv in self.kv:
                kv[self.blocks[rid][lo:hi].long()] = float("nan")

    def _plain_step(self, todo):
        """Driver.step's plan and layers (CPU, no padding, no FULL steps), without its frees."""
        ids = list(todo)
        qsl, seq, slots = [0], [], []
        for rid in ids:
            start, n = self.lens[rid], self.lens[rid] + todo[rid]
            pos = torch.arange(start, n)
            slots.append(self.blocks[rid][pos // self.P].long() * self.P + pos % self.P)
            qsl.append(qsl[-1] + todo[rid])
            seq.append(n)
            self.lens[rid] = n
        bt = torch.stack([self.blocks[r] for r in ids])
        self._step(ids, qsl, seq, bt, torch.cat(slots))


def run(host_tier: bool, spec: int = SPEC):
    cfg = HiSparseConfig(top_k=24, device_buffer_size=32, page_size=8, dense_layers=(0,),
                         min_context=40, host_pool_gib=0.01, host_tier=host_tier,
                         resident_first=False)
    d = SpecDriver(cfg, rows=4)
    d.rt.spec_tokens = spec
    for rid, n in PROMPTS.items():
        d.add(rid, n)
    d.step({"a": 64, "b": 93, "c": 20})
    d.step({"a": 64, "b": 1, "c": 1})
    d.step({"a": 22, "b": 1, "c": 1})
    for i in range(24):          # 1..4 tokens a row, some drafts rejected
        todo = {rid: 1 + (i + j) % (SPEC + 1) for j, rid in enumerate(PROMPTS)}
        d.step(todo, {rid: (n - 1) // 2 for rid, n in todo.items() if i % 3 == 0})
    stats = d.rt.stats_dict()
    for rid in PROMPTS:
        assert d.rt.finish(rid)
    assert d.rt.host_pages_used == 0
    return d.outs, stats


@pytest.fixture(scope="module")
def resident():
    return run(False)


def _equal(a, b) -> list[int]:
    """Indices of the outputs (one per step and layer) that differ."""
    assert len(a) == len(b)
    return [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]


def test_verify_rows_hisparse_equals_resident(resident):
    res, rstats = resident
    hs, stats = run(True)
    assert stats["spec_rows"] > 30 and stats["spec_rows"] == rstats["spec_rows"]
    assert stats["misses"] > 0 and rstats["misses"] == 0
    assert not any(torch.isnan(o).any() for o in hs)          # no freed (poisoned) block read
    assert _equal(hs, res) == []


def test_verify_rows_are_sparse_not_dense(resident):
    """spec_tokens 0: the same rows go the prefill path (dense over every page: in resident mode
    the only mode that can): the verify rows' outputs must change."""
    dense, stats = run(False, spec=0)
    assert stats["spec_rows"] == 0
    assert _equal(dense, resident[0])


def test_corrupted_fetch_differs(resident, monkeypatch):
    monkeypatch.setenv(CORRUPT_FETCH_ENV, "1")
    bad, stats = run(True)
    assert stats["misses"] > 0
    assert _equal(bad, resident[0]), "the negative control matched resident mode"


@pytest.mark.vllm
def test_startup_check_of_speculation():
    """ngram with num_speculative_tokens below page_size serves; a draft model (its own attention
    layers would run hisparse) or verify rows over more than two pages are refused in one line
    naming the field and the fix."""
    from types import SimpleNamespace as NS

    from vllm_hisparse.vllm.setup_check import Refused, check_speculative

    cfg = HiSparseConfig(page_size=16)
    check_speculative(cfg, None)
    check_speculative(cfg, NS(method="ngram", num_speculative_tokens=15))
    for sc, words in ((NS(method="eagle", num_speculative_tokens=3), "method='eagle'"),
                      (NS(method="ngram", num_speculative_tokens=16),
                       "num_speculative_tokens=16 must be below page_size=16")):
        with pytest.raises(Refused) as e:
            check_speculative(cfg, sc)
        msg = str(e.value)
        assert words in msg and "\n" not in msg and ("ngram" in msg or "lower it" in msg)
