"""The host pool pins exactly its bytes (core/pinned.py), not torch's power-of-two rounded block."""
from __future__ import annotations

import gc

import pytest
import torch

from vllm_hisparse.core import host_pool, pinned
from vllm_hisparse.core.host_pool import HostKVPool


class FakeCudart:
    def __init__(self, rc=0):
        self.rc, self.registered, self.unregistered = rc, [], []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered.append((ptr, size, flags))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def test_pool_registers_exact_bytes_and_unregisters(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    pool = HostKVPool(3, 10, 4, 2, 8, torch.float16, pin=True)          # 3 x 10 x 2 x 4 x 2 x 8 x 2 B
    (ptr, size, flags), = fake.registered
    assert (ptr, size) == (pool.data.data_ptr(), 3 * 10 * 2 * 4 * 2 * 8 * 2)
    assert flags == pinned.HOST_REGISTER_PORTABLE | pinned.HOST_REGISTER_MAPPED
    del pool
    gc.collect()
    assert fake.unregistered == [ptr]


def test_register_failure_is_a_pin_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(rc=2))
    with pytest.raises(host_pool.HostPoolPinError, match=r"could not pin .*cudaError 2"):
        HostKVPool(2, 4, 4, 1, 8, torch.float32, pin=True)


@pytest.mark.cuda
def test_registered_pool_is_pinned_and_reachable_from_the_gpu():
    pool = HostKVPool(2, 64, 16, 2, 64, torch.bfloat16, pin=True)
    assert pool.data.is_pinned()
    src = torch.randn(64, 2, 16, 2, 64, device="cuda").to(torch.bfloat16)
    pool.data[1].copy_(src, non_blocking=True)                        # DMA into registered memory
    torch.cuda.synchronize()
    assert torch.equal(pool.data[1].cuda(), src)


def test_pool_is_on_the_cpu_under_a_default_device(monkeypatch):
    """vLLM builds the model (and the DSA runtime with it) under `with torch.device("cuda")`:
    on the H200 the host pool was made there and cudaHostRegister refused its device pointer. The
    meta device stands in for CUDA here (a pointer of 0 when the pool follows the default)."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with torch.device("meta"):
        pinned_pool = HostKVPool(2, 5, 1, 1, 288, torch.bfloat16, pin=True)   # a DSA latent row
        plain_pool = HostKVPool(2, 5, 1, 1, 288, torch.bfloat16, pin=False)
        pinned_pool.ensure("a", 3)
        pt = pinned_pool.page_table_tensor(["a"], 4)
    (ptr, size, _), = fake.registered
    assert pinned_pool.data.device.type == plain_pool.data.device.type == "cpu"
    assert ptr == pinned_pool.data.data_ptr() != 0 and size == 2 * 5 * 2 * 288 * 2
    assert pt.device.type == "cpu" and pt[0, :3].tolist() == pinned_pool.page_table("a")
