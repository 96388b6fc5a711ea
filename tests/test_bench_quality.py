"""The quality benchmark's teacher-forced harness on the tiny random Llama (no vLLM, a few seconds):
dense twice gives identical numbers, a Quest top_k covering the context gives the dense result bit
for bit, the recall figures are shares, and the masked attention is the runtime's sparse decode."""
from __future__ import annotations

import json
import math

import pytest
import torch

from vllm_hisparse.bench import quality, quality_report
from vllm_hisparse.bench import quality_attention as qa
from vllm_hisparse.ops import kernels

CONTEXTS = (200, 256)      # 200: the prompt ends inside a page
STEPS = 40
PAGE = 16
SMALL_K = (32, 64, 128)    # page multiples: Quest then attends at most top_k tokens
DENSE_LAYERS = (0,)        # the tiny model has 4 layers: 3 sparse


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from vllm_hisparse import tiny_model

    path = tiny_model.build(str(tmp_path_factory.mktemp("tiny")))
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                             attn_implementation=qa.register())
    return m.eval()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 512, (1, max(CONTEXTS) + STEPS + 1), generator=g)


@pytest.fixture(scope="module")
def run(model, ids):
    big = max(CONTEXTS) + STEPS                      # every page of every row
    cfgs = [None, None, quality.quest_config(big, PAGE, DENSE_LAYERS)]
    cfgs += [quality.quest_config(k, PAGE, DENSE_LAYERS) for k in SMALL_K]
    rows, layer_rows, lps = quality.score_text(model, ids, CONTEXTS, STEPS, cfgs, label="random")
    return cfgs, rows, layer_rows, lps


def _rows(rows, ctx):
    return [r for r in rows if r["context"] == ctx]


def test_dense_twice_is_identical(run):
    cfgs, rows, _, lps = run
    for ctx in CONTEXTS:
        a, b = _rows(rows, ctx)[:2]
        assert torch.equal(lps[(ctx, 0)], lps[(ctx, 1)])
        assert a["nll"] == b["nll"] and b["d_nll"] == 0.0 and b["kl"] == 0.0 and b["top1"] == 1.0
        assert 0.0 < a["nll"] < 20.0 and math.isfinite(a["ppl"])


def test_top_k_covering_the_context_equals_dense(run):
    cfgs, rows, _, lps = run
    for ctx in CONTEXTS:
        r = _rows(rows, ctx)[2]
        assert torch.equal(lps[(ctx, 2)], lps[(ctx, 0)]), "every page selected must be dense, bit for bit"
        assert r["d_nll"] == 0.0 and r["top1"] == 1.0
        assert r["recall"] == pytest.approx(1.0, abs=1e-6) and r["overlap"] == 1.0


def test_small_top_k_is_sparse_and_recall_is_a_share(run):
    cfgs, rows, layer_rows, lps = run
    for ctx in CONTEXTS:
        for i, k in enumerate(SMALL_K, start=3):
            r = _rows(rows, ctx)[i]
            assert r["top_k"] == k
            assert not torch.equal(lps[(ctx, i)], lps[(ctx, 0)]), f"top_k={k} changed nothing"
            assert math.isfinite(r["nll"]) and r["kl"] > 0.0 and 0.0 <= r["top1"] <= 1.0
    assert len(layer_rows) == len(CONTEXTS) * (1 + len(SMALL_K)) * 3
    for lr in layer_rows:
        assert lr["layer"] not in DENSE_LAYERS
        for name in ("recall", "overlap", "oracle"):
            assert -1e-9 <= lr[name] <= 1 + 1e-6, lr
        # Quest keeps at most top_k tokens, so never more mass than the exact top-k tokens.
        assert lr["recall"] <= lr["oracle"] + 1e-6, lr
        if lr["top_k"] < min(CONTEXTS):
            assert lr["recall"] < 1.0 and lr["overlap"] < 1.0, lr


def test_first_sparse_layer_recall_grows_with_top_k(run):
    """The first sparse layer sees the same queries/keys in every run (the layers before it are
    dense), and Quest's top pages for a larger k contain those for a smaller one."""
    _, _, layer_rows, _ = run
    first = min(lr["layer"] for lr in layer_rows)
    for ctx in CONTEXTS:
        rec = [lr["recall"] for lr in sorted(layer_rows, key=lambda x: x["top_k"])
               if lr["context"] == ctx and lr["layer"] == first]
        assert rec == sorted(rec) and rec[-1] == pytest.approx(1.0, abs=1e-6)


def test_dense_mode_is_the_model(model, ids):
    """The harness' dense decode rows equal one plain SDPA forward over the whole sequence."""
    ctx = CONTEXTS[0]
    _, _, lps = quality.score_text(model, ids, [ctx], STEPS, [None])
    with torch.no_grad():
        full = model(ids[:, :ctx + STEPS]).logits[0, ctx:].float().log_softmax(-1)
    torch.testing.assert_close(lps[(ctx, 0)], full, rtol=0, atol=1e-4)


@pytest.mark.parametrize("top_k,start", [(32, 100), (64, 160), (48, 47)])
def test_masked_attention_is_the_runtime_sparse_decode(top_k, start):
    """Probe.attend's Quest rows == the runtime's sparse decode attention (selected pages, then
    the newest page) over the same pages, for fresh random inputs."""
    g = torch.Generator().manual_seed(top_k + start)
    Hq, Hkv, D, S = 4, 2, 32, 9
    T = start + S
    q = torch.randn(1, Hq, S, D, generator=g)
    k = torch.randn(1, Hkv, T, D, generator=g)
    v = torch.randn(1, Hkv, T, D, generator=g)
    cfg = quality.quest_config(top_k, PAGE, ())
    out = qa.Probe(cfg).attend(5, q, k, v, D ** -0.5)[0]             # (S, Hq, D)

    U = -(-T // PAGE)
    pad = torch.full((U * PAGE - T, Hkv, D), float("nan"))           # past seq_len: never read
    kv = torch.stack([torch.cat([x[0].transpose(0, 1), pad]).view(U, PAGE, Hkv, D) for x in (k, v)],
                     dim=1)                                          # (U, 2, P, Hkv, D), block b = page b
    mask = qa.quest_token_mask(q[0].transpose(0, 1), k[0].transpose(0, 1), start, cfg)
    assert (mask.sum(-1) <= cfg.top_k_units * PAGE).all()
    for s in range(S):
        seq = start + s + 1
        newest = (seq - 1) // PAGE
        pages = mask[s].view(-1)[:newest * PAGE].reshape(-1, PAGE).any(-1).nonzero()[:, 0]
        sel = torch.full((1, cfg.top_k_units - 1), -1, dtype=torch.int32)
        sel[0, :len(pages)] = pages.to(torch.int32)
        ref = kernels.sparse_decode_attention_newest(
            q[0, :, s][None], kv, sel, sel, torch.tensor([seq], dtype=torch.int32),
            torch.tensor([newest]), D ** -0.5)
        torch.testing.assert_close(out[s], ref[0], rtol=1e-5, atol=1e-5)


def test_report_table_and_plot(run, tmp_path):
    _, rows, _, _ = run
    md = quality_report.markdown(rows, command="python -m vllm_hisparse.bench.quality forced --x")
    body = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(body) == len(CONTEXTS) * (1 + len(SMALL_K))
    rec = quality_report.recommend(quality_report.aggregate(rows))
    assert set(rec) == set(CONTEXTS)
    assert all(k is not None and k <= max(CONTEXTS) + STEPS for k in rec.values())
    assert quality_report.plot(rows, str(tmp_path / "q.png")) and (tmp_path / "q.png").stat().st_size > 0


def test_short_text_is_refused(model, ids):
    with pytest.raises(ValueError, match="context 256 \\+ steps 400"):
        quality.score_text(model, ids, [256], 400, [None])


def test_greedy_covering_top_k_is_dense(model, ids):
    from vllm_hisparse.bench.quality_greedy import greedy

    prompt = ids[0, :150].tolist()
    dense, full, small = greedy(model, prompt, [None, quality.quest_config(256, PAGE, DENSE_LAYERS),
                                                quality.quest_config(32, PAGE, DENSE_LAYERS)], 6)
    assert dense == full and len(dense) == 6 and small[0] == dense[0]   # token 1: dense prefill


def test_needle_prompts_plant_the_fact(model):
    from transformers import AutoTokenizer

    from vllm_hisparse.bench import quality_needle as qn

    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    text = "".join(f"line {i} of a plain text haystack.\n" for i in range(400))
    prompts = qn.build_prompts(tok, text, 300, [0.1, 0.5, 0.9], seed=0)
    q = tok(qn.QUESTION).input_ids
    for p in prompts:
        ids = p["prompt_token_ids"]
        assert len(ids) == 300 and ids[-len(q):] == q
        n = tok(qn.needle(p["number"])).input_ids
        assert ids[p["needle_at"]:p["needle_at"] + len(n)] == n
    at = [p["needle_at"] for p in prompts]
    assert at == sorted(at) and at[0] < 100 < at[1] < 200 < at[2]
    assert qn.passed(f" {prompts[0]['number']}. 12", prompts[0]["number"])
    assert not qn.passed(" 1000. " + str(prompts[0]["number"]), prompts[0]["number"])


def test_forced_cli_on_a_model_folder(model, tmp_path):
    """The command end to end (CSV, layer CSV, table, PNG) on the tiny model and a small text."""
    import csv

    text = tmp_path / "haystack.txt"
    text.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300)))
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        assert quality.main(["forced", "--model", model.name_or_path, "--texts", str(text),
                             "--contexts", "160,224", "--steps", "16", "--top-k", "32,64",
                             "--dense-layers", "0", "--threads", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = list(csv.DictReader(open(out / "quality.csv")))
    assert [(r["context"], r["top_k"]) for r in rows] == [
        (c, k) for c in ("224", "160") for k in ("0", "32", "64")]
    assert len(list(csv.DictReader(open(out / "quality_layers.csv")))) == 2 * 2 * 3
    md = (out / "quality.md").read_text()
    assert "--top-k 32,64" in md and "| 160 | 32 |" in md
    assert (out / "quality.png").stat().st_size > 0


def test_forced_on_carried_token_ids_equals_texts(model, tmp_path):
    """--save-ids where the texts are, --ids where they are not (the GPU box): the same rows."""
    import csv

    text = tmp_path / "haystack.txt"
    text.write_text("".join(f"Row {i}: a plain haystack line, number {i * 7}.\n" for i in range(300)))
    common = ["forced", "--model", model.name_or_path, "--contexts", "160", "--steps", "12",
              "--top-k", "32", "--dense-layers", "0", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert quality.main(common + ["--texts", str(text), "--out", str(tmp_path / "a")]) == 0
        assert quality.main(common + ["--texts", str(text), "--save-ids", str(tmp_path / "i.json")]) == 0
        saved = json.load(open(tmp_path / "i.json"))
        assert [len(v) for v in saved.values()] == [160 + 12 + 1]       # cut to what is scored
        assert quality.main(common + ["--ids", str(tmp_path / "i.json"), "--out", str(tmp_path / "b")]) == 0
    finally:
        torch.set_num_threads(threads)
    a, b = (list(csv.DictReader(open(tmp_path / d / "quality.csv"))) for d in "ab")
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert strip(a) == strip(b) and len(a) == 2
    # the table and plot again from the CSV alone (a box without matplotlib)
    (tmp_path / "b" / "quality.png").unlink()
    assert quality_report.main([str(tmp_path / "b"), "tiny"]) == 0
    assert (tmp_path / "b" / "quality.png").stat().st_size > 0
    md = quality_report.markdown(quality_report.load_csv(str(tmp_path / "b" / "quality.csv")))
    assert "| 160 | 32 |" in md and md == quality_report.markdown(
        quality_report.load_csv(str(tmp_path / "a" / "quality.csv")))


def test_needle_prompts_carried_and_simulated_per_context(model, tmp_path, monkeypatch):
    """--save-prompts (two contexts) then --prompts-file --no-engines: the simulation only, one
    table row per context, each prompt's planted number checked."""
    import csv

    from vllm_hisparse.bench import quality_needle as qn
    from vllm_hisparse.sim import texts

    hay = "".join(f"line {i} of a plain text haystack.\n" for i in range(400))
    monkeypatch.setattr(texts, "load_text", lambda name: hay)
    base = ["--model", model.name_or_path, "--texts", "hay", "--depths", "0.2,0.8",
            "--dense-layers", "0", "--max-tokens", "3"]
    path = tmp_path / "p.json"
    assert qn.main(base + ["--context", "200,300", "--save-prompts", str(path)]) == 0
    prompts = json.load(open(path))
    assert sorted((p["context"], len(p["prompt_token_ids"])) for p in prompts) == [
        (200, 200), (200, 200), (300, 300), (300, 300)]
    with pytest.raises(SystemExit, match="one value with vLLM engines"):
        qn.main(base + ["--prompts-file", str(path), "--out", str(tmp_path / "x")])
    assert qn.main(base + ["--prompts-file", str(path), "--no-engines", "--simulate-top-k", "32",
                           "--out", str(tmp_path / "o")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "o" / "needle.csv")))
    assert {(r["path"], r["context"], r["top_k"]) for r in rows} == {
        ("simulated", c, k) for c in ("200", "300") for k in ("0", "32")}
    assert len(rows) == 8
    for r in rows:
        assert r["pass"] == str(int(qn.passed(r["output"], int(r["number"]))))
    md = (tmp_path / "o" / "needle.md").read_text()
    assert "| 200 | simulated | dense |" in md and "| 300 | simulated | Quest top_k=32 |" in md


def test_chunked_prefill_matches_one_pass(model, ids):
    """Long prompts prefill in passes (sdpa's fp32 scores of a 32K prompt do not fit a GPU): the
    last logits and every cached key agree with one pass to fp32 rounding."""
    n = ids.shape[1] - 1
    one_logits, one = quality._prefill(model, ids[:, :n], chunk=10**6)
    got_logits, got = quality._prefill(model, ids[:, :n], chunk=64)
    assert got.get_seq_length() == one.get_seq_length() == n > 4 * 64
    torch.testing.assert_close(got_logits, one_logits, rtol=1e-4, atol=1e-4)
    k1, k2 = one.layers[-1].keys, got.layers[-1].keys
    torch.testing.assert_close(k2, k1, rtol=1e-4, atol=1e-4)
    assert not torch.equal(quality._prefill(model, ids[:, 1:], chunk=64)[0], got_logits)
