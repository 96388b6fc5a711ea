"""FULL decode graphs only for batches without sparse requests (config full_decode_graphs).

A fixed graph cannot branch on the batch: a FULL body that serves sparse rows runs the whole sparse
pipeline (Quest, top-k, RESOLVE, sparse attention: ~55 us of kernels per layer on the H200) even for
a batch of short, dense requests, which made FULL graphs slower than PIECEWISE at 4K
(docs/gpu-results.md). So the choice is made per step, before vLLM picks the graph: a decode batch
holding a sparse request — or one new this step, not yet known to the runtime — runs PIECEWISE (its
sparse layers replay the per-layer decode graphs; eagerly under vLLM's FULL_DECODE_ONLY mode, which
has no PIECEWISE graphs), a batch of dense requests replays the FULL graph whose body is dense
attention alone (core/full_decode.py ``dense_only``).

vLLM 0.26 has no hook for that choice; it disables FULL graphs for a step when the step uses cascade
attention (``use_cascade_attn`` -> ``dispatch(..., invalid_modes={FULL})``). ``install`` wraps the V1
model runner's ``_determine_batch_execution_and_padding`` and sets that flag for batches with a
sparse request (only in the call ``execute_model`` makes: graph-capture and dummy runs are left
alone), and records the step's choice for the metadata builder (``sparse_batch``). Listed in
patches/README.md.
"""
from __future__ import annotations

from . import worker_state

_installed = False


def install() -> None:
    """Wrap the V1 runner's dispatch once per process (the worker, when its runtime is built with
    full_decode_graphs)."""
    global _installed
    if not _installed:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        wrap(GPUModelRunner)
        _installed = True


def wrap(runner_cls) -> None:
    """Replace runner_cls._determine_batch_execution_and_padding by the wrapper."""
    orig = runner_cls._determine_batch_execution_and_padding

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        worker_state.sparse_batch = False
        rt = worker_state.runtime
        if (rt is not None and rt.full is not None and "force_uniform_decode" not in kwargs
                and "num_reqs" in kwargs):
            # a request the runtime does not know yet is new this step: it may be sparse (a
            # prompt's first chunk can be one token when the token budget is nearly spent)
            if rt.may_hold_sparse(self.input_batch.req_ids[:kwargs["num_reqs"]]):
                kwargs["use_cascade_attn"] = True       # FULL graphs off for this step only
                worker_state.sparse_batch = True
        return orig(self, *args, **kwargs)

    _determine_batch_execution_and_padding.__wrapped__ = orig
    runner_cls._determine_batch_execution_and_padding = _determine_batch_execution_and_padding
