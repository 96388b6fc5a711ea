"""bench.scaled_trace: a random model at a trained model's scale records traces in the simulator's
format, and its proof that attention matters can fail (the control: weights too small for
attention to be anything but a uniform average, which a shuffle of the context cannot change)."""
import numpy as np
import torch

from vllm_hisparse.bench import scaled_trace
from vllm_hisparse.sim import trace


def test_records_loadable_traces(tmp_path, capsys):
    assert scaled_trace.main(["--layers", "1", "--context", "256", "--steps", "8", "--k", "32",
                              "--quest-pages", "4", "--out", str(tmp_path)]) == 0
    q = trace.load(str(tmp_path / "llama3-8b-scaled-L1-256.quest.npz"))
    t = trace.load(str(tmp_path / "llama3-8b-scaled-L1-256.topk.npz"))
    assert q.positions.shape == (8, 1, 4) and t.positions.shape == (8, 1, 32)
    assert (q.positions >= 0).all() and (q.positions < (256 + 8 + 15) // 16).all()
    assert list(q.context_len) == list(range(257, 265))
    assert 0.0 <= q.meta["shuffled_context_changes"] <= 1.0
    assert "attention matters" in capsys.readouterr().out


def test_shuffle_check_sees_attention_and_its_control_does_not():
    torch.manual_seed(0)
    ids = torch.randint(1000, (1, 192))
    big = scaled_trace.build(1, 1000)
    assert {float(p.detach().min()) for n, p in big.named_parameters() if "norm" in n} == {1.0}
    assert scaled_trace.shuffle_changes(big, ids, 32, 0) > 0.5
    tiny = scaled_trace.build(1, 1000, std=1e-4)      # logits ~0: attention averages V uniformly
    assert scaled_trace.shuffle_changes(tiny, ids, 32, 0) == 0.0


def test_errors_name_the_flag(tmp_path):
    import pytest
    for argv, flag in ((["--layers", "0"], "--layers"), (["--quest-pages", "999"], "--quest-pages")):
        with pytest.raises(SystemExit, match=flag):
            scaled_trace.main([*argv, "--context", "256", "--out", str(tmp_path)])
