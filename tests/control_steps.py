"""The engine tests' negative controls, counted as the GPU verdict counts them
(scripts/exact_verdict.py check 4): how many requests' greedy tokens and how many steps' logprobs a
control moved, and the CONTROL_STEPS a control whose tokens all match must reach."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import exact_verdict  # noqa: E402

CONTROL_STEPS = exact_verdict.CONTROL_STEPS


def requests(res: dict) -> list[dict]:
    """A run's {"tokens": [...], "logprobs": [...]} (one entry a request) as a request list."""
    return [{"tokens": t, "logprobs": lp}
            for t, lp in zip(res["tokens"], res["logprobs"], strict=True)]


def differing(ref: list[dict], got: list[dict]) -> tuple[int, int]:
    """(requests whose tokens differ, steps whose logprobs differ) of two runs of the same
    requests, each {"tokens", "logprobs": one entry a step} of equal lengths."""
    assert len(ref) == len(got), (len(ref), len(got))
    assert all(len(r["logprobs"]) == len(g["logprobs"]) for r, g in zip(ref, got))
    return exact_verdict.differing_steps(ref, got)
