"""The DSA path's in-engine exactness check (core/latent_shadow.py): a LatentRuntime with
HISPARSE_TEST_SHADOW=1 keeps a resident twin fed the same events, plans, rows and selections, and
counts decode tokens whose rows differ from the twin's. Driven with vLLM's batch shapes over an
episode (prompts longer than the hot slots: misses, evictions; bf16 and fp8_ds_mla rows; one-token
decodes and 2-token verify rows): it counts every decode token and finds none differing; under the
negative control (every host fetch reads the neighbouring page) it finds them; the knob is off by
default, refuses other values in one line, and ``vllm serve`` refuses it."""
from __future__ import annotations

import pytest
import torch

from vllm_hisparse.core.latent_ledger import LatentLedger
from vllm_hisparse.core.latent_runtime import LatentRuntime
from vllm_hisparse.core.latent_shadow import SHADOW_ENV, shadow_on
from vllm_hisparse.core.page_table import CORRUPT_FETCH_ENV
from vllm_hisparse.ops import fp8_ds_mla
from vllm_hisparse.ops.sparse_mla import KV_LORA_RANK, LATENT_ROW

MML, B, K, LAYERS = 128, 16, 8, 2
PROMPTS = {"a": 60, "b": 45, "c": 52}


def episode(fp8: bool, verify: int | None, steps: int = 6) -> dict:
    row, dt = (fp8_ds_mla.ROW_BYTES, torch.uint8) if fp8 else (LATENT_ROW, torch.bfloat16)
    n = verify or 1
    rt = LatentRuntime(LAYERS, MML, n * B, 3, 1, 600, 64, 4, K, row, dt, "cpu", pin=False,
                       verify_tokens=verify)
    led = LatentLedger(3, 1, 600, MML, False)
    g = torch.Generator().manual_seed(3 + n + fp8)

    def new_rows(t: int):
        x = torch.randn(t, LATENT_ROW, generator=g).bfloat16()
        return x[:, :KV_LORA_RANK], x[:, KV_LORA_RANK:]

    pos = {}
    for key, P in PROMPTS.items():                      # prefill one at a time (one region)
        assert led.admit(key, P, steps * n + 2)
        rt.apply(led.take_events())
        rt.plan([key], [0, P], [P])
        for layer in range(LAYERS):
            rt.write(layer, *new_rows(P))
        led.prompt_done(key)
        pos[key] = P
    rt.apply(led.take_events())
    keys = list(PROMPTS)
    for _ in range(steps):
        counts = [n if verify is None else int(torch.randint(1, n + 1, (1,), generator=g))
                  for _ in keys]
        qsl = [0]
        for c in counts:
            qsl.append(qsl[-1] + c)
        seq = [pos[k] + c for k, c in zip(keys, counts)]
        rt.plan(keys, qsl, seq)
        T = qsl[-1]
        for layer in range(LAYERS):
            rt.write(layer, *new_rows(T))
            topk = torch.full((T, K), -1, dtype=torch.int32)
            t = 0
            for k, c in zip(keys, counts):
                for j in range(c):
                    p = pos[k] + j
                    topk[t, :K - 1] = torch.randperm(p + 1, generator=g)[:K - 1].int()
                    t += 1
            rt.convert(layer, topk)
        for k, c in zip(keys, counts):
            pos[k] += 1 if verify is None else int(torch.randint(1, c + 1, (1,), generator=g))
    return rt.stats()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("verify", [None, 2])
def test_the_twin_sees_every_decode_token_and_no_difference(monkeypatch, fp8, verify):
    monkeypatch.setenv(SHADOW_ENV, "1")
    st = episode(fp8, verify)
    assert st["misses"] > 0 and st["hits"] > 0
    assert st["shadow_tokens"] >= 6 * 3 * LAYERS and st["shadow_mismatch"] == 0, st


@pytest.mark.parametrize("fp8", [False, True])
def test_the_twin_catches_the_negative_control(monkeypatch, fp8):
    monkeypatch.setenv(SHADOW_ENV, "1")
    monkeypatch.setenv(CORRUPT_FETCH_ENV, "1")
    st = episode(fp8, None)
    assert st["shadow_mismatch"] > 0 and st["shadow_mismatch"] <= st["shadow_tokens"], st


def test_off_by_default_and_one_line_refusals(monkeypatch, capsys):
    monkeypatch.delenv(SHADOW_ENV, raising=False)
    assert not shadow_on() and "shadow_tokens" not in episode(False, None, steps=1)
    monkeypatch.setenv(SHADOW_ENV, "yes")
    with pytest.raises(ValueError, match="HISPARSE_TEST_SHADOW='yes': use 1"):
        shadow_on()


def test_vllm_serve_refuses_the_twin(monkeypatch, capsys):
    from types import SimpleNamespace

    from vllm_hisparse.vllm import cli_check

    monkeypatch.setenv(SHADOW_ENV, "1")
    with pytest.raises(SystemExit) as e:
        cli_check.check_namespace(SimpleNamespace(attention_backend="hisparse",
                                                  additional_config={}))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"{SHADOW_ENV}=1 is the DSA" in err


def test_gpu_harness_verdict_of_the_in_engine_check():
    """scripts/gpu_dsa.py's verdict: EXACT only with tokens compared, misses, none differing and a
    control that ran and differs; any difference MISMATCH; else VOID."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import exact_verdict as ev
    import gpu_dsa

    ok = {"shadow_tokens": 96, "shadow_mismatch": 0, "misses": 7}
    assert gpu_dsa.shadow_verdict(None, None) is None
    assert gpu_dsa.shadow_verdict(ok, dict(ok, shadow_mismatch=12))[0] == ev.EXACT
    assert gpu_dsa.shadow_verdict(ok, None)[0] == ev.VOID                # no control ran
    assert gpu_dsa.shadow_verdict(ok, ok)[0] == ev.VOID                  # control not caught
    assert gpu_dsa.shadow_verdict(dict(ok, misses=0), None)[0] == ev.VOID
    assert gpu_dsa.shadow_verdict(dict(ok, shadow_tokens=0), None)[0] == ev.VOID
    assert gpu_dsa.shadow_verdict(dict(ok, shadow_mismatch=1), None)[0] == ev.MISMATCH


def test_gpu_harness_compare_reads_the_shadow_runs(tmp_path, capsys):
    """``gpu_dsa.py compare`` on a folder of only the shadow runs: their verdict is the exit code."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
    import exact_verdict as ev
    import gpu_dsa

    st = {"shadow_tokens": 480, "shadow_mismatch": 0, "misses": 9000, "hits": 100}
    for mode, bad in (("shadow", 0), ("shadowctl", 75)):
        (tmp_path / f"{mode}.json").write_text(json.dumps(
            {"mode": mode, "requests": [], "stats": dict(st, shadow_mismatch=bad)}))
    assert gpu_dsa.compare(str(tmp_path)) == ev.EXACT
    out = capsys.readouterr().out
    assert "480 decode tokens x layers" in out and "control: 75 of 480" in out
    (tmp_path / "shadow.json").write_text(json.dumps(
        {"mode": "shadow", "requests": [], "stats": dict(st, shadow_mismatch=2)}))
    assert gpu_dsa.compare(str(tmp_path)) == ev.MISMATCH
