"""Issue 15 on a selection with locality: the elastic default (resident_first) against the fixed hot
buffer at one floor, and crf against lru, on SmolLM2-135M's real weights through vLLM 0.26's CPU
engine, "at capacity": a KV pool that 8 floors, one prompt's prefill and the reserve fill, as the
H200 paper run (docs/archive/gpu-diary.md, 2026-12-04 third session), where only the prefill headroom
is spare once every prompt is in. 8 license texts of 1,330-2,048 tokens as one batch, 256 greedy
outputs with logprobs; a resident engine (host_tier false, a pool that holds everything) is the
exactness reference.

    cd docs/data/elastic-real-cpu && ../../../.venv/bin/python run.py [TAG ...]   # ~2 min each on 2 cores
    ../../../.venv/bin/python run.py table        # the CSV, from the runs' JSON (not kept: ~190 KB each)
"""
import json, os, subprocess, sys
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
PY = ROOT + "/.venv/bin/python"
MODEL = ROOT + "/models/smollm2-135m"
DOCS = ("GPL-3", "MPL-1.1", "Apache-2.0", "GPL-2", "LGPL-2.1", "GFDL-1.3", "Artistic", "MPL-2.0")
BLOCKS = 440         # 8 floors of 33 + one 2K prompt (~128) + the reserve (cdiv(512, 16) + 4 = 36)
base = {"top_k": 256, "device_buffer_size": 512, "page_size": 16, "dense_layers": [0, 1],
        "host_pool_gib": 1.0, "min_context": 0}
RUNS = {"resident": (dict(base, host_tier=False), 2000),
        "fixed-lru": (dict(base, resident_first=False, policy="lru"), BLOCKS),
        "elastic-lru": (dict(base, resident_first=True, policy="lru"), BLOCKS),
        "fixed-crf": (dict(base, resident_first=False, policy="crf"), BLOCKS),
        "elastic-crf": (dict(base, resident_first=True, policy="crf"), BLOCKS)}


def prompts():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    out = []
    for i, name in enumerate(DOCS):
        ids = tok(open(f"/usr/share/common-licenses/{name}", errors="ignore").read())["input_ids"]
        out.append(ids[:2048 - 48 * i])
    json.dump(out, open("prompts.json", "w"))


def run(tag):
    cfg, blocks = RUNS[tag]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([PY, ROOT + "/scripts/hisparse_generate.py", "--model", MODEL, "--config",
                        json.dumps(cfg), "--prompts", "prompts.json", "--max-tokens", "256",
                        "--max-model-len", "2304", "--max-num-seqs", "8",
                        "--max-num-batched-tokens", "512", "--num-blocks", str(blocks),
                        "--out", f"{tag}.json"], env=env, capture_output=True, text=True)
    print(tag, "rc", r.returncode, r.stderr[-1500:] if r.returncode else "", flush=True)


def table():
    sys.path.insert(0, ROOT + "/scripts")
    from real_capacity import write_table   # the same comparison as the GPU run's
    write_table(".", [t for t in RUNS if t != "resident"], "elastic-real-cpu.csv")


if __name__ == "__main__":
    os.chdir(os.path.dirname(os.path.abspath(__file__)))
    tags = sys.argv[1:] or list(RUNS)
    if tags == ["table"]:
        table()
    else:
        if not os.path.exists("prompts.json"):
            prompts()
        for t in tags:
            run(t)
