"""The fp8_ds_mla backend's plumbing (vllm/mla_fp8_backend.py) on the CPU, with the FlashMLA
kernels and vLLM's upconvert op replaced by recorders over the plain-torch reader
(ops/fp8_ds_mla.unpack): for a batch of two sparse decode tokens (RESOLVE into their row sets, rows
fetched from the host pool) and one prefill chunk (its region upconverted into the bf16 workspace,
workspace indices), every token's kernel reads exactly the latent values of its selected
positions, in its selection's order, -1 kept; the same through stock's mixed-batch path; the index
helpers against loops; the stub spec of an fp8_ds_mla layer sized at 16 B a token."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.core.latent_ledger import LatentLedger
from vllm_hisparse.core.latent_runtime import LatentRuntime
from vllm_hisparse.ops import fp8_ds_mla as F

pytestmark = pytest.mark.vllm

MML, B, K, H = 128, 64, 8, 2
PROMPTS = {"a": 100, "b": 90, "c": 70}


def test_workspace_indices_match_a_loop():
    from vllm_hisparse.vllm.mla_fp8_backend import region_blocks, workspace_indices

    g = torch.Generator().manual_seed(0)
    T = 12
    idx = torch.randint(-1, 300, (T, 5), generator=g, dtype=torch.int32)
    base = torch.tensor([-1, -1, 128, 128, 128, 0, 0, 0, 256, 256, -1, 128])
    req = torch.tensor([-1, -1, 0, 0, 0, 1, 1, 1, 2, 2, -1, 0], dtype=torch.int32)
    starts = torch.tensor([0, 40, 75], dtype=torch.int32)
    got = workspace_indices(idx, base, req, starts)
    for t in range(T):
        for j in range(5):
            u = int(idx[t, j])
            want = u if u < 0 or req[t] < 0 else u - int(base[t]) + int(starts[req[t]])
            assert int(got[t, j]) == want, (t, j)
    assert got.dtype == torch.int32
    assert region_blocks(torch.tensor([128, 0]), 3).tolist() == [[2, 3, 4], [0, 1, 2]]


def test_stub_spec_of_an_fp8_ds_mla_layer_is_16_bytes_a_token():
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    from vllm_hisparse.vllm.mla_spec import stub_spec

    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                            cache_dtype_str="fp8_ds_mla")
    assert spec.page_size_bytes == 64 * 656                  # what vLLM would reserve
    assert stub_spec(spec).page_size_bytes == 64 * 16


def _runtime():
    """Requests a and b decoding (row sets), c's 70-token prompt in region 1 this step (z holds
    region 0, so c's rows start at pool row 128, its workspace at 0)."""
    rt = LatentRuntime(1, MML, B, 4, 2, 600, 128, 4, K, F.ROW_BYTES, torch.uint8, "cpu",
                       pin=False)
    led = LatentLedger(4, 2, 600, MML, False)
    g = torch.Generator().manual_seed(1)
    truth = {k: (torch.randn(MML, 576, generator=g) * 2).bfloat16() for k in PROMPTS}
    for key in ("a", "b"):
        P = PROMPTS[key]
        assert led.admit(key, P, 8)
        rt.apply(led.take_events())
        rt.plan([key], [0, P], [P])
        rt.write(0, truth[key][:P, :512], truth[key][:P, 512:])
        led.prompt_done(key)
    assert led.admit("z", 50, 8) and led.admit("c", PROMPTS["c"], 8)
    rt.apply(led.take_events())
    assert rt.adm.grant("c").region == 1
    return rt, truth


def _recorder(reads, cache_values):
    """Stand-in kernels: record, per query token, the value rows its indices read."""
    def fp8(q, kv_c_and_k_pe_cache, topk_indices, kernel_metadata):
        vals = F.unpack(kv_c_and_k_pe_cache.reshape(-1, F.ROW_BYTES))
        for i in topk_indices.reshape(-1, topk_indices.shape[-1]):
            reads.append(torch.stack([vals[u] for u in i.tolist() if u >= 0]))
        return q.new_zeros(*q.shape[:-1], 512), None

    def bf16(q, workspace, idx, length):
        for i, n in zip(idx, length):
            ok = [u for u in i.tolist() if u >= 0]
            assert len(ok) == int(n)
            inside = all(u < workspace.shape[0] for u in ok)       # else: read off the workspace
            reads.append(workspace[ok] if inside else None)       # bf16, as vLLM upconverts
        return q.new_zeros(q.shape[0], H, 512)
    return fp8, bf16


@pytest.mark.parametrize("mixed, control", [(False, None), (True, None),
                                            (False, "no_workspace_shift"), (False, "region_0")])
def test_every_token_reads_its_selected_positions(monkeypatch, mixed, control):
    """Controls (each must make the prefill tokens read wrong rows): workspace indices left as
    pool rows; the region's blocks taken from pool row 0."""
    from vllm import _custom_ops as ops

    from vllm_hisparse.vllm import mla_fp8_backend as fb
    from vllm_hisparse.vllm.mla_fp8_backend import HiSparseFlashMLASparseImpl

    if control == "no_workspace_shift":
        monkeypatch.setattr(fb, "workspace_indices", lambda idx, base, req, starts: idx)
    elif control == "region_0":
        orig = fb.region_blocks
        monkeypatch.setattr(fb, "region_blocks", lambda bases, w: orig(bases * 0, w))

    rt, truth = _runtime()
    keys, P = ["a", "b", "c"], PROMPTS
    qsl, seq = [0, 1, 2, 2 + P["c"]], [P["a"] + 1, P["b"] + 1, P["c"]]
    rt.plan(keys, qsl, seq)                                      # decode a, b; prefill c
    tok_pos = [("a", P["a"]), ("b", P["b"])] + [("c", p) for p in range(P["c"])]
    new = torch.stack([truth[k][p] for k, p in tok_pos])
    rt.write(0, new[:, :512], new[:, 512:])
    T = len(tok_pos)
    g = torch.Generator().manual_seed(2)
    topk = torch.full((T, K), -1, dtype=torch.int32)
    for t, (k, p) in enumerate(tok_pos):
        m = min(K - 1, p + 1)
        topk[t, :m] = torch.randperm(p + 1, generator=g)[:m].int()   # causal, one -1 left

    reads: list = []
    impl = object.__new__(HiSparseFlashMLASparseImpl)
    fp8, bf16 = _recorder(reads, None)
    impl.__dict__.update(
        hisparse_worker=SimpleNamespace(runtime=rt, select=lambda li, buf, n: buf[:n]), _layer=0,
        topk_indices_buffer=topk, prefill_bf16_workspace=torch.zeros(5 * MML, 576).bfloat16(),
        num_heads=H, kv_lora_rank=512, _fp8_flash_mla_kernel=fp8, _bf16_flash_mla_kernel=bf16)

    def upconvert(src, dst, blocks, starts, n):
        rows = F.unpack(src.reshape(-1, F.ROW_BYTES)).to(dst.dtype)
        ends = starts.tolist()[1:] + [dst.shape[0]]
        for i in range(n):
            for p in range(ends[i] - int(starts[i])):
                dst[int(starts[i]) + p] = rows[int(blocks[i, p // 64]) * 64 + p % 64]
    monkeypatch.setattr(ops, "cp_gather_and_upconvert_fp8_kv_cache", upconvert)
    Meta = SimpleNamespace
    if mixed:
        md = Meta(fp8_use_mixed_batch=True, fp8_extra_metadata=None)
    else:
        chunk = Meta(tokens_slice=slice(2, T), block_table=torch.zeros(1, 2, dtype=torch.int32),
                     req_start_idx=0, workspace_starts=torch.tensor([0], dtype=torch.int32),
                     chunk_tot_seqlen=P["c"], hisparse_first=torch.tensor([2]))
        pre = Meta(request_ids=torch.tensor([-1, -1] + [0] * P["c"], dtype=torch.int32),
                   workspace_starts=torch.tensor([0], dtype=torch.int32), chunks=[chunk])
        md = Meta(fp8_use_mixed_batch=False, fp8_extra_metadata=Meta(
            num_decodes=2, num_decode_tokens=2, decode=Meta(kernel_metadata=None), prefill=pre))
    q = torch.randn(T, H, 576).bfloat16()
    out, _ = impl.forward_mqa(q, None, md, None)
    assert out.shape == (T, H, 512) and len(reads) == T
    wrong = []
    for t, (k, p) in enumerate(tok_pos):
        sel = [u for u in topk[t].tolist() if u >= 0]
        want = F.unpack(F.pack(truth[k][sel, :512], truth[k][sel, 512:]))
        if reads[t] is None or reads[t].shape != want.shape or not torch.equal(
                reads[t], want.to(reads[t].dtype)):
            wrong.append(t)
    assert rt.stats()["misses"] > 0                              # the decode tokens fetched
    if control is None:
        assert wrong == []
    else:                                    # every prefill token that selects anything
        assert wrong == list(range(2, T)) and 0 not in wrong and 1 not in wrong


def test_builder_notes_each_prefill_chunks_first_tokens():
    """The fp8 builder's addition to stock's metadata: per prefill chunk, the first token of each
    of its requests (decode requests first in vLLM's batch), which forward_mqa maps to regions."""
    from vllm_hisparse.vllm.mla_fp8_backend import HiSparseFlashMLASparseMetadataBuilder

    b = object.__new__(HiSparseFlashMLASparseMetadataBuilder)
    b.device, b.use_fp8_kv_cache = torch.device("cpu"), True
    b.worker = SimpleNamespace(runtime=SimpleNamespace(verify_tokens=None))
    chunks = [SimpleNamespace(req_start_idx=0, block_table=torch.zeros(2, 3)),
              SimpleNamespace(req_start_idx=2, block_table=torch.zeros(1, 3))]
    md = SimpleNamespace(num_decodes=3, fp8_use_mixed_batch=False, fp8_extra_metadata=SimpleNamespace(
        prefill=SimpleNamespace(chunks=chunks)))
    qsl = [0, 1, 2, 3, 40, 90, 95]              # 3 decodes, then prefills of 37, 50, 5 tokens
    b.noted(md, None, qsl)
    assert chunks[0].hisparse_first.tolist() == [3, 40] and chunks[1].hisparse_first.tolist() == [90]
    b.noted(SimpleNamespace(num_decodes=2, fp8_use_mixed_batch=False,
                            fp8_extra_metadata=SimpleNamespace(prefill=None)), None, qsl)


def test_builder_takes_the_mixed_batch_under_speculation():
    """ngram's decodes of unequal lengths would be called prefills by vLLM's uniform split: with
    verify rows every token goes through the fp8 kernel (stock's mixed-batch metadata)."""
    from vllm_hisparse.vllm.mla_fp8_backend import HiSparseFlashMLASparseMetadataBuilder

    b = object.__new__(HiSparseFlashMLASparseMetadataBuilder)
    b.use_fp8_kv_cache = True
    b.worker = SimpleNamespace(runtime=SimpleNamespace(verify_tokens=3))
    b._build_fp8_mixed_decode_prefill = lambda cm: ("mixed", cm)
    md = SimpleNamespace(num_decodes=1, fp8_use_mixed_batch=False, fp8_extra_metadata="separate")
    b.noted(md, "cm", [0, 4, 5, 9])
    assert md.fp8_use_mixed_batch and md.fp8_extra_metadata == ("mixed", "cm")
