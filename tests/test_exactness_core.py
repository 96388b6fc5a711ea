"""Exactness of the core: attention through host pool + hot buffer + resolve is bit-identical to the
same sparse attention reading a fully resident KV, on random multi-step episodes (random lengths,
k, B >= k, random and Quest selections, every policy)."""
import pytest
import torch

from vllm_hisparse.core.host_pool import HostKVPool
from vllm_hisparse.slots.engine import HotBufferState, fetch_misses, resolve, write_resident
from vllm_hisparse.ops import reference as ref

POLICIES = ["lru", "fifo", "random", "vanilla"]


class Episode:
    """R requests of one layer, both ways: resident (full cache, locs = units) and hisparse."""

    def __init__(self, g, policy, dtype):
        self.g = g
        self.R = int(torch.randint(1, 5, (), generator=g))
        self.unit = int(torch.tensor([1, 2, 4, 16])[torch.randint(0, 4, (), generator=g)])
        self.H = int(torch.randint(1, 3, (), generator=g))
        self.G = int(torch.randint(1, 4, (), generator=g))
        self.D = int(torch.tensor([8, 16, 64])[torch.randint(0, 3, (), generator=g)])
        self.k = int(torch.randint(1, 9, (), generator=g))                     # units per step
        self.S = self.k + int(torch.randint(0, 6, (), generator=g))             # B >= k
        self.U = 40
        self.dtype = dtype
        R, S, U, unit, H, D = self.R, self.S, self.U, self.unit, self.H, self.D
        self.full = torch.full((R * U, 2, unit, H, D), float("nan"), dtype=dtype)
        self.pool = HostKVPool(1, R * U + 3, unit, H, D, dtype=dtype, pin=False)
        self.state = HotBufferState.create(R, S, U, policy)
        self.buffer = torch.full((R * S, 2, unit, H, D), float("nan"), dtype=dtype)
        self.slot_map = torch.randperm(R * S).int().view(R, S)                 # physical != local
        self.kmin = torch.zeros(R, U, H, D)
        self.kmax = torch.zeros(R, U, H, D)
        self.lens = torch.randint(1, U * unit // 2, (R,), generator=g)
        for r in range(R):
            self.append(r, torch.arange(int(self.lens[r])))

    def append(self, r, pos):
        n = len(pos)
        k = torch.randn(n, self.H, self.D, generator=self.g).to(self.dtype)
        v = torch.randn(n, self.H, self.D, generator=self.g).to(self.dtype)
        self.pool.ensure(r, int(pos.max()) + 1)
        self.pool.write(r, 0, pos, k, v)
        self.full[r * self.U + pos // self.unit, 0, pos % self.unit] = k
        self.full[r * self.U + pos // self.unit, 1, pos % self.unit] = v
        write_resident(self.state, self.buffer, self.slot_map, torch.full((n,), r), pos, k, v)
        ref.quest_update(self.kmin, self.kmax, torch.full((n,), r), pos, k.float(), self.unit)

    def step(self, quest: bool):
        R, U, unit = self.R, self.U, self.unit
        for r in range(R):                                                    # decode one token
            self.append(r, self.lens[r:r + 1].clone())
        self.lens += 1
        q = torch.randn(R, self.H * self.G, self.D, generator=self.g).to(self.dtype)
        n_units = (self.lens + unit - 1) // unit
        if quest:
            sel = torch.empty(R, self.k, dtype=torch.int32)
            ref.quest_select(ref.quest_scores(q, self.kmin, self.kmax, n_units), self.lens, unit, sel)
        else:
            sel = torch.full((R, self.k), -1, dtype=torch.int32)
            for r in range(R):
                m = min(self.k, int(n_units[r]))
                sel[r, :m] = torch.randperm(int(n_units[r]), generator=self.g)[:m].int()
            sel[torch.rand(R, self.k, generator=self.g) < 0.15] = -1
        locs, miss = resolve(self.state, sel)
        fetch_misses(self.buffer, self.slot_map, locs, miss, sel,
                     lambda rr, uu: torch.stack([self.pool.data[0, self.pool.page_table(int(a))[int(b)]]
                                                 for a, b in zip(rr, uu)]))
        phys = torch.where(locs >= 0, torch.gather(self.slot_map.long(), 1, locs.clamp(min=0)), -1)
        res_locs = torch.where(sel >= 0, torch.arange(R)[:, None] * U + sel, -1)
        scale = self.D ** -0.5
        a = ref.sparse_decode_attention(q, self.buffer, phys.int(), sel, self.lens.int(), scale)
        b = ref.sparse_decode_attention(q, self.full, res_locs.int(), sel, self.lens.int(), scale)
        self.check_slots()
        return a, b, int(miss.sum())

    def check_slots(self):
        """Invariant: every resident slot holds its unit's bytes (valid token rows)."""
        for r in range(self.R):
            for s, u in enumerate(self.state.slot_unit[r].tolist()):
                if u < 0:
                    continue
                n = min(self.unit, int(self.lens[r]) - u * self.unit)
                got = self.buffer[self.slot_map[r, s], :, :n]
                want = self.full[r * self.U + u, :, :n]
                assert torch.equal(got, want), (r, s, u)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("quest", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hisparse_attention_bit_identical_to_resident(policy, quest, dtype):
    seed = int(torch.randint(0, 2**31, ()))
    g = torch.Generator().manual_seed(seed)
    misses = 0
    for _ in range(3):                                                    # three random episodes
        ep = Episode(g, policy, dtype)
        for _ in range(12):
            a, b, m = ep.step(quest)
            misses += m
            assert torch.equal(a, b), f"seed={seed}"
            assert not a.isnan().any()
    assert misses > 0


def test_attention_reference_matches_dense_softmax():
    """The reference itself: same result as plain softmax attention over the selected rows."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    unit, H, G, D = 4, 2, 3, 16
    kv = torch.randn(10, 2, unit, H, D, generator=g, dtype=torch.float64)
    q = torch.randn(1, H * G, D, generator=g, dtype=torch.float64)
    sel = torch.tensor([[3, 0, 7]], dtype=torch.int32)
    seq = torch.tensor([30])                                              # unit 7 holds 28..31: 2 valid
    out = ref.sparse_decode_attention(q, kv, sel, sel, seq.int(), 0.25)
    rows = [(u, j) for u in [3, 0, 7] for j in range(unit) if u * unit + j < 30]
    K = torch.stack([kv[u, 0, j] for u, j in rows])                       # (T, H, D)
    V = torch.stack([kv[u, 1, j] for u, j in rows])
    for h in range(H * G):
        p = torch.softmax(K[:, h // G] @ q[0, h] * 0.25, 0)
        torch.testing.assert_close(out[0, h], p @ V[:, h // G], rtol=1e-5, atol=1e-6)  # fp32 inside
