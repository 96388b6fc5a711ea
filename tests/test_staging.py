"""core/staging.py: per-step metadata reaches the device with its exact values, whatever the input
kind, and on the GPU without waiting for queued kernels while never refilling a pinned buffer whose
copy is still queued (the copies are checked after a long kernel held them all back)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hisparse.core.staging import HostToDevice


def _inputs(g):
    a = torch.randint(-2**40, 2**40, (5, 7), generator=g)
    return [a, a.numpy().T, a[:, 2].tolist(), [[1, 2], [3, 4]], torch.rand(9, generator=g) > 0.5,
            torch.randint(0, 9, (0,), generator=g)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_values_and_dtypes(device):
    h2d = HostToDevice(device, slots=3)
    g = torch.Generator().manual_seed(0)
    for x in _inputs(g) * 3:                      # more copies than buffers: the ring wraps
        want = torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x
        got = h2d(x)
        assert got.device.type == device
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    assert h2d([1, 2], torch.int32).dtype == torch.int32


def test_result_is_a_copy_on_cpu():
    x = torch.arange(4)
    y = HostToDevice("cpu")(x)
    x[0] = 9
    assert y[0] == 0


@pytest.mark.cuda
def test_copies_queued_behind_a_busy_gpu_keep_their_values():
    """A long kernel first, then 4x more copies than pinned buffers: every copy is still queued when
    the host wants its buffer back, so a missing wait would overwrite values before they are copied."""
    h2d = HostToDevice("cuda", slots=4)
    g = torch.Generator().manual_seed(1)
    want = [torch.randint(0, 2**62, (1000 + i,), generator=g) for i in range(16)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                # ~0.1 s of GPU time queued before the copies
    got = [h2d(w) for w in want]
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a.cpu(), b), f"copy {i} changed"
