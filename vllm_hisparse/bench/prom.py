"""Reading a `vllm serve` /metrics page (the soak test, the metrics test, the lead's checks).

``scrape(url)`` returns ``{series: value}``, one entry per Prometheus sample, keyed by the sample
name plus its labels other than vLLM's ``model_name`` and ``engine`` (summed over those), e.g.
``vllm:hisparse_hot_buffer_hits_total`` or ``vllm:hisparse_decode_rows_total{kind="sparse"}``.
"""
from __future__ import annotations

import urllib.request

SKIP_LABELS = ("model_name", "engine")


def parse(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())
                              if k not in SKIP_LABELS)
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


def scrape(base_url: str, timeout: float = 10) -> dict[str, float]:
    """base_url: the server, e.g. http://127.0.0.1:8000 (its /metrics is read)."""
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as r:
        return parse(r.read().decode())


def hisparse(series: dict[str, float]) -> dict[str, float]:
    """The hisparse series only, without the ``vllm:hisparse_`` prefix."""
    p = "vllm:hisparse_"
    return {k[len(p):]: v for k, v in series.items()
            if k.startswith(p) and not k.split("{")[0].endswith("_created")}
