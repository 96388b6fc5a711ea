"""Teacher-forced Quest attention for the quality benchmark (transformers, no vLLM).

One attention function, registered with transformers as ``hisparse_quality``. Without an active
``Probe`` it is plain SDPA (the dense prefill). With one, the call's queries are the scored decode
rows: query row s sits at position ``start + s`` (seq_len ``start + s + 1``, its own key included,
as a decode step sees it) and attends over the keys the probe's mask allows:

  dense layers / dense mode  every key up to its position (causal);
  sparse layers              the runtime's Quest rule (core/sparse_runtime.py): the newest page
                             (the one holding the query token) always, plus the best
                             ``top_k_units - 1`` complete pages, picked as
                             ``core.sparse_layer.quest_topk`` does on the CPU (ops/reference
                             quest_update bounds, quest_scores, topk_index, topk_pages).

Both modes go through the same masked softmax, so a selection holding every page gives the dense
result bit for bit. The sparse decode kernel sums in another order (fp32) but attends the same
keys; ``tests/test_bench_quality.py`` checks the two agree.

Per sparse layer the probe also measures (on every MEASURE_EVERY-th decode row), against the
dense softmax of the same queries and keys (averaged over the layer's query heads):
  recall   share of the dense attention mass carried by the Quest-selected tokens;
  overlap  share of the exact top-k tokens (k = top_k, by head-averaged dense attention) that Quest
           selected;
  oracle   the mass those exact top-k tokens carry (what a perfect token-level top-k would keep).
"""
from __future__ import annotations

import torch

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.ops.reference import quest_scores, quest_update, topk_index, topk_pages

ATTN = "hisparse_quality"
ROW_CHUNK = 128      # query rows per block: bounds the (Hq, rows, T) fp32 temporaries
SCORE_CHUNK = 32     # query rows per Quest scoring block: bounds (rows, U, Hkv, G, D) fp32
MEASURE_EVERY = 4    # recall/overlap on every 4th decode row: a quarter of the cost, same means

_ACTIVE: "Probe | None" = None


def register() -> str:
    """Register the attention function with transformers (idempotent); returns its name for
    ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kw):
        if _ACTIVE is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
        return _ACTIVE.attend(module.layer_idx, query, key, value, kw.get("scaling")), None

    AttentionInterface.register(ATTN, attention)
    # the masks of sdpa too: transformers builds none for an unknown attention name, and sdpa's
    # is_causal is wrong for a prefill pass that continues a cache (bench/quality.py's _prefill)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register(ATTN, sdpa_mask)
    return ATTN


def quest_token_mask(q: torch.Tensor, keys: torch.Tensor, start: int, cfg: HiSparseConfig) -> torch.Tensor:
    """(S, T) bool: the tokens the runtime's Quest selection attends for each decode row.

    q: (S, Hq, D) post-RoPE queries at positions start .. start + S - 1; keys: (T, Hkv, D)
    post-RoPE keys of positions 0 .. T - 1 (T >= start + S; keys past a row's position are never
    selected: Quest scores complete pages only, the newest page is cut at the row's position).
    """
    S, T = q.shape[0], keys.shape[0]
    P = cfg.page_size
    U = -(-T // P)
    Hkv, D = keys.shape[1:]
    dev = keys.device
    kmin = torch.empty(1, U, Hkv, D, dtype=torch.float32, device=dev)
    kmax = torch.empty_like(kmin)
    quest_update(kmin, kmax, torch.zeros(T, dtype=torch.long, device=dev),
                 torch.arange(T, device=dev), keys.float(), P)
    pos = start + torch.arange(S, device=dev)
    newest = pos // P                     # the newest page; pages [0, newest) are complete
    k_sel = max(cfg.top_k_units - 1, 0)  # as SparseRuntime.k_sel: the newest page takes one unit
    pages = torch.zeros(S, U, dtype=torch.bool, device=dev)
    pages[torch.arange(S, device=dev), newest] = True
    kk = min(k_sel, U)
    for s0 in range(0, S, SCORE_CHUNK):
        s1 = min(S, s0 + SCORE_CHUNK)
        if kk == 0:
            break
        # quest_topk's CPU path, minus its per-row copy of the bounds (one request: they broadcast)
        scores = quest_scores(q[s0:s1].float(), kmin, kmax, newest[s0:s1])
        sel = topk_pages(topk_index(scores, kk), newest[s0:s1], k_sel).long()   # (c, k_sel), -1 pad
        r = torch.arange(s0, s1, device=dev)[:, None].expand_as(sel)
        ok = sel >= 0
        pages[r[ok], sel[ok]] = True
    causal = torch.arange(T, device=dev)[None] <= pos[:, None]
    return pages[:, :, None].expand(S, U, P).reshape(S, U * P)[:, :T] & causal


class Probe:
    """What one teacher-forced continuation pass does in every layer (see the module docstring).

    cfg: None = dense attention everywhere; else Quest with cfg.top_k, cfg.page_size in the layers
    not in cfg.dense_layers. After the pass: ``recall``, ``overlap``, ``oracle`` map each sparse
    layer to a (ceil(S / MEASURE_EVERY),) fp64 tensor (rows 0, 4, 8, ..., mean over the layer's
    query heads).
    """

    def __init__(self, cfg: HiSparseConfig | None):
        self.cfg = cfg
        self.recall: dict[int, torch.Tensor] = {}
        self.overlap: dict[int, torch.Tensor] = {}
        self.oracle: dict[int, torch.Tensor] = {}
        self.layers_seen = 0

    def __enter__(self):
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a quality Probe is already active (one forward pass at a time)")
        _ACTIVE = self
        return self

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = None

    def sparse(self, layer: int) -> bool:
        return self.cfg is not None and layer not in self.cfg.dense_layers

    @torch.no_grad()
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """query (1, Hq, S, D), key/value (1, Hkv, T, D) -> attention output (1, S, Hq, D)."""
        _, Hq, S, D = query.shape
        Hkv, T = key.shape[1], key.shape[2]
        start = T - S
        self.layers_seen += 1
        q = query[0].transpose(0, 1)                                    # (S, Hq, D)
        if self.sparse(layer):
            mask = quest_token_mask(q, key[0].transpose(0, 1), start, self.cfg)
        else:
            ar = torch.arange(T, device=query.device)
            mask = ar[None] <= (start + ar[:S])[:, None]
        out = torch.empty(S, Hkv, Hq // Hkv, D, dtype=query.dtype, device=query.device)
        stats = []
        for s0 in range(0, S, ROW_CHUNK):
            s1 = min(S, s0 + ROW_CHUNK)
            qs = query[0, :, s0:s1].reshape(Hkv, Hq // Hkv, s1 - s0, D).float()
            logits = torch.matmul(qs, key[0, :, None].float().transpose(-1, -2)) * scaling
            m = mask[s0:s1]                                             # (c, T)
            p = torch.softmax(logits.masked_fill(~m, float("-inf")), dim=-1)
            o = torch.matmul(p, value[0, :, None].float())              # (Hkv, G, c, D)
            out[s0:s1] = o.permute(2, 0, 1, 3).to(out.dtype)
            if self.sparse(layer):
                r = torch.arange(s0, s1, device=query.device)
                r = r[r % MEASURE_EVERY == 0] - s0
                causal = torch.arange(T, device=query.device)[None] <= (start + s0 + r)[:, None]
                stats.append(self._measure(logits[:, :, r], causal, m[r]))
        if stats:
            for name, i in (("recall", 0), ("overlap", 1), ("oracle", 2)):
                getattr(self, name)[layer] = torch.cat([s[i] for s in stats])
        return out.reshape(1, S, Hq, D)

    def _measure(self, logits: torch.Tensor, causal: torch.Tensor, sel: torch.Tensor):
        """logits (Hkv, G, c, T) fp32, causal/sel (c, T) bool -> (recall, overlap, oracle), (c,) each."""
        pd = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
        avg = pd.mean(dim=(0, 1)).double()                              # (c, T), rows sum to 1
        recall = (avg * sel).sum(-1)
        k = min(self.cfg.top_k, logits.shape[-1])
        # a full sort: torch.topk with k in the thousands is several times slower on the CPU
        val, idx = torch.sort(avg, dim=-1, descending=True, stable=True)
        val, idx = val[:, :k], idx[:, :k]
        n_valid = causal.sum(-1).clamp(max=k)                           # exact top-k within causal keys
        hit = torch.gather(sel, 1, idx) & torch.gather(causal, 1, idx)
        overlap = hit.sum(-1).double() / n_valid.double()
        oracle = val.sum(-1)
        return recall, overlap, oracle
