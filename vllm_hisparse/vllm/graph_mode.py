"""Whether a run lets vLLM replay FULL CUDA graphs of decode steps (config full_decode_graphs,
resolved once per process from the VllmConfig): the metadata builder declares the graph support
from it, the startup check refuses an explicit ``true`` that cannot run."""
from __future__ import annotations

import torch

from vllm_hisparse.ops.kernels import DENSE_DECODE_HEAD_SIZES

from .deployment import config_of


def blocker(vllm_config) -> str | None:
    """Why FULL decode graphs cannot run with this config and model (None: they can; the CPU has
    no CUDA graphs, which is no reason to refuse: the body then runs eagerly, as CI tests it)."""
    cfg = config_of(vllm_config)
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    why = cfg.full_graphs_blocker()
    if why:
        return why
    if (mc is not None and torch.cuda.is_available()
            and mc.get_head_size() not in DENSE_DECODE_HEAD_SIZES):
        return (f"the graphs attend dense rows with the split-KV decode kernel, which has head "
                f"sizes {DENSE_DECODE_HEAD_SIZES}, not {mc.get_head_size()}; set "
                f"full_decode_graphs false")
    if getattr(pc, "data_parallel_size", 1) > 1 or getattr(pc, "use_ubatching", False):
        # an idle data-parallel rank replays a FULL graph on a dummy batch without the connector
        # (stale buffers); micro-batches would share one set of them
        return ("data parallelism and micro-batching (DBO) are not supported with FULL decode "
                "graphs yet; set full_decode_graphs false")
    return None


def full_graphs(vllm_config) -> bool:
    """FULL decode graphs on for this run: not switched off, nothing blocks them, a CUDA device."""
    if config_of(vllm_config).full_decode_graphs is False:
        return False
    return torch.cuda.is_available() and blocker(vllm_config) is None


def capture_full_batch(vllm_config, logger=None) -> None:
    """Make max_num_seqs a CUDA-graph capture size. vLLM captures FULL decode graphs only for
    capture sizes <= max_num_seqs and pads a decode batch up to the next capture size; with
    max_num_seqs = 22 and sizes [1, 2, 4, 8, 16, 24, ...] a batch of 17-22 rows found no FULL graph
    and ran every layer eagerly (the host then sets the pace; the 32K serving figures:
    docs/gpu-results.md). Called from the startup check, after vLLM has chosen its sizes."""
    cc, n = vllm_config.compilation_config, vllm_config.scheduler_config.max_num_seqs
    sizes = list(cc.cudagraph_capture_sizes or [])
    if not sizes or n in sizes or n > (cc.max_cudagraph_capture_size or 0):
        return
    cc.cudagraph_capture_sizes = sorted(sizes + [n])
    if logger is not None:
        logger.info("hisparse: added max_num_seqs=%d to cudagraph_capture_sizes, so a full decode "
                    "batch replays a FULL graph", n)
