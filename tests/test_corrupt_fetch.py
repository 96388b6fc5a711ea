"""The exactness harnesses' negative control (core/page_table.py, HISPARSE_TEST_CORRUPT_FETCH=1):
every page fetched from the host pool is read from its neighbour, writes are untouched. The GQA
runtime and the DSA episode, exact without it (test_sparse_runtime_exact.py, test_dsa_core.py),
must differ from resident mode with it; `vllm serve` refuses it with one line and exit 2."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.core.page_table import CORRUPT_FETCH_ENV, DevicePageTable, flush_tables

ENV = CORRUPT_FETCH_ENV


def _neighbours(table: torch.Tensor) -> torch.Tensor:
    """The plain loop: entry u reads u ^ 1's page where both have one."""
    want = table.clone()
    for r in range(table.shape[0]):
        for u in range(table.shape[1]):
            v = u ^ 1
            if v < table.shape[1] and table[r, u] >= 0 and table[r, v] >= 0:
                want[r, u] = table[r, v]
    return want


@pytest.mark.parametrize("width", [7, 8])
def test_fetch_reads_the_neighbour_page_writes_keep_their_own(monkeypatch, width):
    monkeypatch.setenv(ENV, "1")
    g = torch.Generator().manual_seed(width)
    t = DevicePageTable(3, width, "cpu")
    assert t.fetch is not t.table
    pages = torch.randperm(100, generator=g).tolist()
    t.grow(0, pages[:5])                              # odd count: the last page has no neighbour
    t.grow(2, pages[10:10 + width])
    flush_tables([t])                                 # the one-copy path (more than FEW pages)
    assert t.table[0, :5].tolist() == pages[:5] and t.table[2].tolist() == pages[10:10 + width]
    assert torch.equal(t.fetch, _neighbours(t.table)) and not torch.equal(t.fetch, t.table)
    t.grow(0, pages[:6])                              # one new page: the scalar path
    flush_tables([t])
    assert t.table[0, 5] == pages[5] and t.fetch[0, 5] == pages[4] and t.fetch[0, 4] == pages[5]
    assert torch.equal(t.fetch, _neighbours(t.table))
    t.clear(2)
    assert torch.equal(t.fetch, _neighbours(t.table)) and (t.fetch[2] == -1).all()
    for n in (0, 1, 5, 6):                            # the host side's read: the same swap
        want = _neighbours(torch.tensor([pages[:n]]))[0].tolist() if n else []
        assert t.host_reads(pages[:n]) == want


def test_off_by_default_fetch_is_the_table(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    t = DevicePageTable(2, 4, "cpu")
    assert t.fetch is t.table
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=f"{ENV}='yes': use 1 .* or 0"):
        DevicePageTable(2, 4, "cpu")


def test_gqa_runtime_under_the_control_differs_from_resident(monkeypatch):
    from test_sparse_runtime_exact import run

    res, _ = run(False)
    monkeypatch.setenv(ENV, "1")
    hs, stats = run(True)
    assert stats["misses"] > 0
    assert len(hs) == len(res)
    bad = [i for i, (a, b) in enumerate(zip(hs, res)) if not torch.equal(a, b)]
    assert bad, "the negative control matched resident mode: its fetches were not corrupted"


def test_the_control_covers_the_dense_layers_host_read_back(monkeypatch):
    """The one host read outside the fetch table (core/prefill.attend_from_host: a dense layer
    without a dense pool reads a request's freed pages back) takes the neighbour pages too: under
    the control, dense layer 0's outputs differ from resident mode's once pages left the GPU, and
    equal them before."""
    from test_sparse_runtime_exact import L, run

    from vllm_hisparse.core import prefill

    res, _ = run(False)
    monkeypatch.setenv(ENV, "1")
    reads = []
    attend = prefill.attend_from_host

    def counted(*a, **k):
        reads.append(1)
        return attend(*a, **k)
    monkeypatch.setattr(prefill, "attend_from_host", counted)
    hs, _ = run(True)
    assert reads, "no dense layer read the host pool"
    dense = range(0, len(res), L)                          # layer 0 of every step
    bad = [i for i in dense if not torch.equal(hs[i], res[i])]
    assert bad, "the dense layers' host read-back escaped the negative control"
    assert bad[0] > 0                                      # equal while every page was on the GPU


def test_dsa_episode_under_the_control_reads_wrong_rows(monkeypatch):
    from test_dsa_core import episode

    monkeypatch.setenv(ENV, "1")
    # a fresh episode (episode is cached: a result made without the control must not come back),
    # failing at the row check: the decode rows hold other tokens' latent rows
    with pytest.raises(AssertionError) as e:
        episode.__wrapped__("lru")
    assert "lat[who[t]]" in str(e.traceback[-1].statement), e.traceback[-1]


def test_vllm_serve_refuses_the_control(monkeypatch, capsys):
    from vllm_hisparse.vllm import cli_check

    ns = SimpleNamespace(attention_backend="hisparse", additional_config={})
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(SystemExit) as e:
        cli_check.check_namespace(ns)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert f"{ENV}=1 is the exactness harnesses' negative control" in err and "unset it" in err
    monkeypatch.setenv(ENV, "2")
    with pytest.raises(SystemExit):
        cli_check.check_namespace(ns)
    assert f"{ENV}='2': use 1" in capsys.readouterr().err
    monkeypatch.delenv(ENV)                 # not hisparse: the knob is not ours to refuse
    assert cli_check.check_namespace(SimpleNamespace(attention_backend=None)) is not None


def test_offline_engines_may_set_it():
    """The offline harness (scripts/hisparse_generate.py) runs it: building a table in a fresh
    interpreter with the knob on works and reports the corruption."""
    code = ("from vllm_hisparse.core.page_table import DevicePageTable as T; "
            "t = T(1, 2, 'cpu'); print(t.fetch is not t.table)")
    out = subprocess.run([sys.executable, "-c", code], env={"PATH": "", ENV: "1"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"
