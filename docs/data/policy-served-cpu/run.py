import json, os, subprocess, sys
from transformers import AutoTokenizer
ROOT = "/work/main"; PY = ROOT + "/.venv/bin/python"
model = ROOT + "/models/smollm2-135m"
tok = AutoTokenizer.from_pretrained(model)
docs = ("GPL-3", "MPL-1.1", "Apache-2.0")
prompts = []
for i, name in enumerate(docs):
    ids = tok(open(f"/usr/share/common-licenses/{name}", errors="ignore").read())["input_ids"]
    prompts.append(ids[:2000 - 150 * i])
json.dump(prompts, open("prompts.json", "w"))
base = {"top_k": 64, "device_buffer_size": 128, "page_size": 16, "dense_layers": [0, 1],
        "host_pool_gib": 0.5, "resident_first": False}
runs = {"resident": dict(base, host_tier=False), "lru": dict(base, policy="lru"),
        "crf": dict(base, policy="crf")}
env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
for tag in sys.argv[1:] or runs:
    r = subprocess.run([PY, ROOT + "/scripts/hisparse_generate.py", "--model", model, "--config",
                        json.dumps(runs[tag]), "--prompts", "prompts.json", "--max-tokens", "192",
                        "--max-model-len", "2304", "--max-num-batched-tokens", "512",
                        "--out", f"{tag}.json"], env=env, capture_output=True, text=True)
    print(tag, "rc", r.returncode, r.stderr[-800:] if r.returncode else "", flush=True)
