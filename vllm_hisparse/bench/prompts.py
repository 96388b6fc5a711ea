"""Prompts of real text for the serving benchmarks (bench.serving, bench.chat): token ids of the
model's tokenizer read from a file, cut into windows at distinct offsets, and (``repeated``) a
window repeated to a prompt's length (bench.serving --repeat-block: a model that continues the
repetition gets ngram drafts accepted)."""
from __future__ import annotations

import json
import random


def load_text_ids(path: str) -> list[int]:
    """Real text as token ids: a JSON list of ids, a list of lists, or {name: [ids]} (what
    ``bench.quality forced --save-ids`` writes), concatenated in order."""
    with open(path) as f:
        d = json.load(f)
    parts = list(d.values()) if isinstance(d, dict) else d
    if parts and isinstance(parts[0], int):
        parts = [parts]
    return [int(t) for part in parts for t in part]


def text_prompts(tokens: list[int], n: int, count: int, rng: random.Random) -> list[list[int]]:
    """``count`` prompts of ``n`` tokens of real text, each read at its own offset (distinct while
    the text has room: no two requests share a prefix, so stock's prefix cache gives no one a
    head start)."""
    room = len(tokens) - n + 1
    if room < 1:
        raise SystemExit(f"--text-ids: {len(tokens)} tokens cannot fill --input-len {n}")
    offsets = rng.sample(range(room), count) if count <= room else \
        [rng.randrange(room) for _ in range(count)]
    return [tokens[o:o + n] for o in offsets]


def repeated(block: list[int], n: int) -> list[int]:
    """``block`` repeated to ``n`` tokens (its last copy cut short); ``n`` <= len(block): its first
    ``n`` tokens."""
    if not block:
        raise ValueError("repeated: an empty block")
    return (block * (n // len(block) + 1))[:n]
