"""GPU time of the batch-invariant dense decode kernel (ops/triton_dense_decode.py) per call, Llama-3-8B
attention shape (32 / 8 heads, D 128, bf16, pages of 16), CUDA events over 50 calls after warm-up.
Compare: vLLM's FlashAttention with num_splits=1 on the same shapes took 44.6 us (4K, 1 row), 51.9
(4K, 8 rows), 296 (32K, 1 row), 327 (32K, 8 rows) — docs/gpu-results.md, bench/full_step.

    python scripts/probes/dense_decode_time.py
"""
import torch

from vllm_hisparse.ops.triton_dense_decode import dense_decode_attention

for ctx in (4096, 32768):
    for R in (1, 8, 32):
        W = -(-(ctx + 64) // 16)
        kv = torch.randn(R * W + 1, 2, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        bt = (1 + torch.randperm(R * W, device="cuda")).view(R, W).int()
        q = torch.randn(R, 32, 128, device="cuda", dtype=torch.bfloat16)
        seq = torch.full((R,), ctx, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        for _ in range(3):
            dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.088, out)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50):
            dense_decode_attention(q, kv[:, 0], kv[:, 1], bt, seq, 0.088, out)
        e1.record()
        torch.cuda.synchronize()
        print(f"context {ctx} rows {R}: {e0.elapsed_time(e1) / 50 * 1e3:.1f} us per call", flush=True)
