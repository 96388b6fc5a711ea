"""Prefix caching step 1 (docs/design/prefix-caching.md, issue 47) through the real vLLM 0.26
engine (CPU): hisparse resident mode (host_tier false) keeps vLLM's prefix caching on, exact.

tests/prefix_chat.py drives a fake multi-turn chat (3 conversations x 3 turns sharing an 80-token
system prompt, every request sparse, the conversations' turns in flight together: live requests hit
one cached block 0) on five engines side by side (tests/prefix_engines.py: "on" and "stock" are
test_prefix_host.py's too, run once for both): hisparse resident with prefix caching on == off
(fp32, no prompt chunked: where stock vLLM's own PC on == off holds, the design doc's Q1), with
hits, as many as stock vLLM's; the negative controls fail: without the first-step Quest rebuild
(section 3.2) outputs differ, without the floor copy-on-write (F = 0) RequestRows refuses the batch
or outputs differ; nothing is left after the run and an abort mid-turn. In every engine one request
with a hit is preempted by vLLM's own preemption after its prefill step and resumes with a hit on
its own blocks (prefix_chat.py, PREEMPT): its outputs are among those compared.
"""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PREFIX_MODES = ("on", "noswitch", "off", "stock", "floor0")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The engines' results, "on" and "stock" shared with test_prefix_host.py
    (tests/prefix_engines.py: each mode run once per pytest run)."""
    import prefix_engines

    return prefix_engines.runs(request, tmp_path_factory, PREFIX_MODES)


def test_resident_prefix_caching_on_equals_off_with_stocks_hits(runs):
    on, off, stock = runs["on"], runs["off"], runs["stock"]
    assert on["error"] is None and off["error"] is None and stock["error"] is None
    assert len(on["outputs"]) == len(off["outputs"]) == 9
    for i, (a, b) in enumerate(zip(on["outputs"], off["outputs"])):
        assert a["tokens"] == b["tokens"], f"request {i}: tokens differ"
        assert a["logprobs"] == b["logprobs"], f"request {i}: logprobs differ"
    assert off["hits"] == 0 and on["hits"] > 0
    assert [o["cached"] for o in on["outputs"]] == [o["cached"] for o in stock["outputs"]]
    assert on["hits"] == stock["hits"]
    assert on["stats"]["prefix_hits"] > 0          # the runtime rebuilt hit requests' Quest rows


def test_negative_controls_fail(runs):
    from control_steps import CONTROL_STEPS, differing

    ref = runs["off"]["outputs"]
    ns = runs["noswitch"]
    assert ns["error"] is None and ns["stats"]["prefix_hits"] == 0
    assert ns["hits"] == runs["on"]["hits"] > 0     # the hits came; only their switch was off
    steps = differing(ref, ns["outputs"])[1]
    print("noswitch: steps whose logprobs differ:", steps)
    assert steps >= CONTROL_STEPS, steps                                   # clearly
    f0 = runs["floor0"]
    # F = 0: two live requests on one block 0, which the worker's guard refuses (2026-12-07: this
    # is how it fails; a run that got through would be a guard that no longer sees it)
    assert f0["error"] is not None and "share first blocks" in f0["error"], f0["error"]


def test_a_preempted_hit_request_resumes_with_a_hit_and_stays_exact(runs):
    """PREEMPT's request (a hit at admission) resumes once, as a preempted request to vLLM, with
    a hit on its own prompt's blocks past the one it was admitted with, as long as stock vLLM's;
    the runtime rebuilt its Quest row again at the resumption; its outputs equal PC off's (first
    test: same preemption there)."""
    from prefix_chat import CONVS, PREEMPT

    on, off, stock = runs["on"], runs["off"], runs["stock"]
    rid = PREEMPT[0]
    for r in (on, off, stock):
        assert [x[:2] for x in r["resumed"]] == [[rid, 1]], r["resumed"]
    hit, admitted = on["resumed"][0][2], on["outputs"][CONVS + 1]["cached"]   # c1t1
    assert 0 < admitted < hit == stock["resumed"][0][2] and off["resumed"][0][2] == 0
    with_hits = sum(o["cached"] > 0 for o in on["outputs"])
    # one rebuild per admission with a hit, + the resumption's, + the abort phase's two requests
    assert on["stats"]["prefix_hits"] == with_hits + 1 + 2


@pytest.mark.parametrize("mode", ["on", "off"])
def test_no_leaks_after_the_turns_and_an_abort(runs, mode):
    r = runs[mode]
    assert r["leaks"] == {"runtime_reqs": 0, "rows": 0, "blocks_bound": 0, "indexer_rows_used": 0,
                          "host_pages_used": 0}
    assert r["free_blocks"] == r["num_blocks"] - 1              # block 0 is vLLM's null block
