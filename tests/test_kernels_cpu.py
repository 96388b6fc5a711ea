"""CPU checks of the kernel layer: op schemas registered when the extension is built, and the
dispatch in ops/kernels.py falling back to the references on CPU tensors."""
import pytest
import torch

from vllm_hisparse.ops import kernels, reference


@pytest.mark.ext
def test_ops_registered_with_schemas():
    schema = str(torch.ops.hisparse.resolve_lru.default._schema)
    for part in ("Tensor selection", "Tensor(a!) slot_unit", "Tensor(b!) unit_slot", "Tensor(c!) lru_order",
                 "Tensor slot_map", "Tensor(d!) buffer", "Tensor host", "Tensor host_page_table",
                 "Tensor(e!) device_locs", "int io_chunk_bytes=64", "-> ()"):
        assert part in schema, schema
    assert "Tensor(a!) out" in str(torch.ops.hisparse.add_one.default._schema)


def _state(R=2, k=5, S=8, U=20, P=12, row=6):
    g = torch.Generator().manual_seed(1)
    sel = torch.stack([torch.randperm(U, generator=g)[:k] for _ in range(R)]).int()
    sel[0, 2] = -1
    return dict(selection=sel, slot_unit=torch.full((R, S), -1, dtype=torch.int32),
                unit_slot=torch.full((R, U), -1, dtype=torch.int32),
                lru_order=torch.arange(S, dtype=torch.int32).repeat(R, 1),
                slot_map=torch.randperm(R * S, generator=g).view(R, S).int(),
                buffer=torch.zeros(R * S, row), host=torch.randn(P, row, generator=g),
                host_page_table=torch.randint(0, P, (R, U), generator=g).int(),
                device_locs=torch.full((R, k), 7, dtype=torch.int32))


def test_resolve_cpu_fallback_matches_reference():
    a, b = _state(), _state()
    kernels.resolve_lru(**a, io_chunk_bytes=32)
    reference.resolve_lru(**b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (a["device_locs"][0, 2] == -1) and (a["device_locs"] >= -1).all()


def test_attention_cpu_fallback_matches_reference():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 64, generator=g)
    kv = torch.randn(10, 2, 2, 2, 64, generator=g)
    locs = torch.tensor([[3, -1, 5], [0, 9, 2]], dtype=torch.int32)
    units = torch.tensor([[0, 1, 2], [4, 1, 0]], dtype=torch.int32)
    seq = torch.tensor([5, 9], dtype=torch.int32)
    out = kernels.sparse_decode_attention(q, kv, locs, units, seq, 0.125)
    assert torch.equal(out, reference.sparse_decode_attention(q, kv, locs, units, seq, 0.125))
