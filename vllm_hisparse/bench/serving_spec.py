"""bench.serving ``--speculative JSON`` (issue 47 item 3: ngram speculation's speedup at 1 request,
hisparse's against stock's): each backend served twice, without and with vLLM's
``--speculative-config``; rows ``BACKEND`` and ``BACKEND+spec``, each with the acceptance of its
points read from the server's /metrics (vLLM's spec-decode counters, v1/spec_decode/metrics.py:
Prometheus counters, so their samples end in ``_total``); at the end, per backend, the TPOT
speedup of speculation and each hisparse backend's speedup over stock's (issue 47's bar: >= 0.9).
"""
from __future__ import annotations

from vllm_hisparse.bench import prom

SUFFIX = "+spec"
BAR = 0.9           # issue 47: hisparse's speedup >= 0.9 x stock's
# vLLM's spec-decode counters as LLM.get_metrics() names them (scripts/hisparse_generate.py reads
# those), and as /metrics' Prometheus samples (the same names + "_total")
SPEC_METRICS = {"drafts": "vllm:spec_decode_num_drafts",
                "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                "accepted": "vllm:spec_decode_num_accepted_tokens"}
COUNTERS = {k: v + "_total" for k, v in SPEC_METRICS.items()}


def runs(backends: list[str], spec: str | None) -> list[tuple[str, str, list[str]]]:
    """(backend, row name, extra `vllm serve` arguments) of each server, in order: every backend
    alone, then (with ``spec``, vLLM's speculative_config as JSON) again as BACKEND+spec."""
    out = []
    for b in backends:
        out.append((b, b, []))
        if spec:
            out.append((b, b + SUFFIX, ["--speculative-config", spec]))
    return out


def file_tag(name: str) -> str:
    """A row name as a file name part (hisparse+spec -> hisparse-spec)."""
    return name.replace("+", "-")


def scrape(port: int) -> dict[str, float]:
    """The server's spec-decode counters now ({} when /metrics cannot be read)."""
    try:
        series = prom.scrape(f"http://127.0.0.1:{port}")
    except OSError:
        return {}
    return {k: series[v] for k, v in COUNTERS.items() if v in series}


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict:
    """A point's row columns from the counters around it: drafts, draft tokens, accepted tokens and
    acceptance_rate = accepted / draft tokens (None where the server reports no drafts: a server
    without speculation)."""
    d = {k: int(after[k] - before.get(k, 0)) if k in after else None for k in COUNTERS}
    rate = d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None
    return {"spec_drafts": d["drafts"], "spec_draft_tokens": d["draft_tokens"],
            "spec_accepted": d["accepted"],
            "acceptance_rate": None if rate is None else round(rate, 4)}


def speedups(rows: list[dict]) -> dict[tuple[str, int], float]:
    """{(backend, concurrency): TPOT without speculation / TPOT with it} for every backend and
    concurrency measured both ways."""
    tpot = {(r["backend"], r["concurrency"]): r["tpot_mean_ms"] for r in rows}
    out = {}
    for (name, c), y in tpot.items():
        if name.endswith(SUFFIX) and (name[:-len(SUFFIX)], c) in tpot and y:
            out[(name[:-len(SUFFIX)], c)] = tpot[(name[:-len(SUFFIX)], c)] / y
    return out


def speedup_lines(rows: list[dict]) -> list[str]:
    """One line per backend (and concurrency other than 1): ``speedup B: TPOT x / y = s``; then per
    hisparse backend ``B speedup / stock speedup = r (issue 47: >= 0.9)``, where stock ran."""
    tpot = {(r["backend"], r["concurrency"]): r["tpot_mean_ms"] for r in rows}
    sp = speedups(rows)
    lines = []
    for (b, c), s in sp.items():
        at = "" if c == 1 else f" (concurrency {c})"
        lines.append(f"speedup {b}{at}: TPOT {tpot[(b, c)]:.2f} / {tpot[(b + SUFFIX, c)]:.2f} = "
                     f"{s:.3f}")
    for (b, c), s in sp.items():
        if b == "stock" or ("stock", c) not in sp:
            continue
        r = s / sp[("stock", c)]
        at = "" if c == 1 else f" (concurrency {c})"
        lines.append(f"{b} speedup / stock speedup{at} = {r:.3f} (issue 47: >= {BAR}): "
                     f"{'met' if r >= BAR else 'NOT met'}")
    return lines
