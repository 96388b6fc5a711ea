"""The recorder's selections equal top-k of the model's own (eager) attention weights, on a tiny
random Llama (the real SmolLM2 run is `python -m vllm_hisparse.sim.record`)."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from vllm_hisparse.sim import record  # noqa: E402

CTX, STEPS, K, PAGE, KP = 70, 6, 8, 16, 3


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, CTX + STEPS))
    return model, ids


def test_recorded_topk_matches_eager_attention(tiny):
    model, ids = tiny
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        att = model(ids, output_attentions=True).attentions          # per layer (1, H, T, T)
    model.config._attn_implementation = record.register_attention()
    rec, logits = record.record_ids(model, ids, STEPS, K, KP, PAGE)
    assert logits.shape == (STEPS, 64)
    for layer, a in enumerate(att):
        p = a[0, :, CTX:].float()                                     # (H, steps, T)
        avg = p.mean(0)
        per_kv = p.view(2, 2, STEPS, -1).mean(1)
        for s in range(STEPS):
            want = set(torch.topk(avg[s], K).indices.tolist())
            assert set(rec.topk[s, layer].tolist()) == want
            assert max(rec.topk[s, layer]) <= CTX + s                 # causal: nothing from the future
            for h in range(2):
                got = set(rec.kvhead[s, layer * 2 + h].tolist())
                assert got == set(torch.topk(per_kv[h, s], K).indices.tolist())
    newest = (CTX + np.arange(STEPS)) // PAGE
    assert (rec.quest[:, :, 0] == newest[:, None]).all()             # Quest: newest page first
    assert (rec.quest >= 0).all() and (rec.quest <= newest[:, None, None]).all()


def test_recorder_save_writes_each_kind_in_the_trace_format(tmp_path):
    """Recorder.save, shared by sim.record and bench.scaled_trace: each kind's rows, unit and k_max
    in its meta, the base meta in all, decode step s at context + s + 1 tokens."""
    from vllm_hisparse.sim import trace
    from vllm_hisparse.sim.record import Recorder

    rng = np.random.default_rng(3)
    rec = Recorder(layers=2, hkv=2, steps=3, k_tok=4, k_pages=2, page=16)
    rec.topk[:] = np.stack([rng.permutation(64)[:4] for _ in range(6)]).reshape(3, 2, 4)
    rec.kvhead[:] = np.stack([rng.permutation(64)[:4] for _ in range(12)]).reshape(3, 4, 4)
    rec.quest[:] = np.stack([rng.permutation(4)[:2] for _ in range(6)]).reshape(3, 2, 2)
    paths = rec.save(str(tmp_path), "x", 64, dict(model="m", text="t"))
    assert set(paths) == {"topk", "kvhead", "quest"}
    want = {"topk": (rec.topk, 1, "layer", 4), "kvhead": (rec.kvhead, 1, "layer*kv_heads+head", 4),
            "quest": (rec.quest, 16, "layer", 2)}
    for kind, (arr, unit, rows, k_max) in want.items():
        t = trace.load(paths[kind])
        assert np.array_equal(t.positions, arr) and list(t.context_len) == [65, 66, 67]
        assert (t.unit, t.meta["rows"], t.k_max, t.meta["model"]) == (unit, rows, k_max, "m")
    assert trace.load(paths["kvhead"]).meta["kv_heads"] == 2
    assert set(rec.save(str(tmp_path / "q"), "x", 64, dict(model="m", text="t"), ("quest",))) == {"quest"}
