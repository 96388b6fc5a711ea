"""The indexer registry and the Quest indexer through the interface (core/indexers): the
interface's token plan + update leave the same bounds as the plain-torch reference's quest_update,
and decode_unit addresses the page the decode write updates."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hisparse.config import INDEXERS, HiSparseConfig
from vllm_hisparse.core import indexers
from vllm_hisparse.ops import reference


def test_registry_lists_the_config_choices():
    assert set(indexers.NAMES) == set(INDEXERS)
    for name in INDEXERS:
        assert issubclass(indexers.get(name), indexers.Indexer)
        assert indexers.get(name).name == name
    with pytest.raises(ValueError, match="indexer='nsa' is not known; .*quest, dsa"):
        indexers.get("nsa")


def _quest(rows=3, max_model_len=200, P=16, dense=(0,)):
    cfg = HiSparseConfig(top_k=32, device_buffer_size=64, page_size=P, dense_layers=dense)
    return indexers.get("quest")(cfg, 3, rows, max_model_len, 2, 8, torch.float32, "cpu")


def test_quest_state_shapes_and_rows():
    ix = _quest()
    assert ix.kmin[0] is None and ix.kmin[1].shape == (4, 13, 2, 8)     # rows + scratch, 200/16
    assert ix.row_bytes(2, 2, 8, 4, 200, 16) == sum(t[:1].numel() * 4 for t in ix.kmin + ix.kmax
                                                    if t is not None)
    got = [ix.allocate() for _ in range(4)]
    assert got == [0, 1, 2, -1] and ix.scratch == 3
    ix.free(1)
    assert ix.allocate() == 1


@pytest.mark.parametrize("spans", [[(0, 0, 45)], [(0, 21, 45), (1, 30, 31), (2, 0, 17)],
                                   [(2, 15, 16), (0, 16, 33)]])
def test_quest_plan_update_equals_reference(spans):
    """spans: (row, start, seq) requests whose tokens [start, seq) are new, in order."""
    g = torch.Generator().manual_seed(len(spans))
    ix = _quest()
    for t in ix.kmin + ix.kmax:
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=g))
    ref_min, ref_max = ix.kmin[2].clone(), ix.kmax[2].clone()
    start, seq, row = (np.array(c, dtype=np.int64) for c in zip(*[(s, e, r) for r, s, e in spans]))
    ix_d = {k: torch.from_numpy(v) for k, v in ix.plan_tokens(start, seq, row).items()}
    rows = torch.cat([torch.full((e - s,), r) for r, s, e in spans])
    pos = torch.cat([torch.arange(s, e) for r, s, e in spans])
    k = torch.randn(len(pos), 2, 8, generator=g)
    reference.quest_update(ref_min, ref_max, rows, pos, k, 16)
    ix.update(2, ix.device_update(ix_d), k)
    assert torch.equal(ix.kmin[2], ref_min) and torch.equal(ix.kmax[2], ref_max)
    assert ix.decode_unit(2, 45) == 2 * ix.U + 2
