"""vLLM's DSA top-k kernels -> ops/stable_topk.py, in a worker process whose indexer asks for it
(``Indexer.stable_topk``: ``dsa_stable``, core/indexers/dsa/stable.py).

vLLM 0.26's ``sparse_attn_indexer`` (model_executor/layers/sparse_attn_indexer.py) looks each
kernel up when it runs, never binding it at import: ``ops.top_k_per_row_prefill(...)`` (:488) and
``ops.top_k_per_row_decode(...)`` (:635) on the module object ``vllm._custom_ops`` (imported as
``ops``), ``torch.ops._C.cooperative_topk(...)`` (:613) and ``torch.ops._C.persistent_topk(...)``
(:626) on torch's ``_C`` op namespace. The function body runs eagerly (a vLLM custom op: opaque to
torch.compile; replayed from CUDA graphs as captured), so setting those four attributes in the
process reaches every layer's prefill and decode, and the decode graphs capture the stand-ins.

Installed once per worker process by ``LatentWorker.start`` (vllm/mla_worker.py: the first MLA
layer's impl, hisparse and resident mode alike, before vLLM's profile and graph capture). Stock
FLASH_ATTN_MLA_SPARSE runs without our backend, so a served stock engine keeps vLLM's kernels;
scripts/gpu_dsa.py calls ``install_for`` for its in-process stock engine (the exactness harness).
Listed in patches/README.md.
"""
from __future__ import annotations

from vllm_hisparse.ops import stable_topk

from .compat import init_logger

logger = init_logger(__name__)

# (where, attribute): where is "custom_ops" (vllm._custom_ops) or "C" (torch.ops._C)
SWAPS = (("custom_ops", "top_k_per_row_prefill"), ("custom_ops", "top_k_per_row_decode"),
         ("C", "cooperative_topk"), ("C", "persistent_topk"))
ORIG = "_hisparse_orig_"       # where a replaced kernel is kept: on its own module / namespace


def _targets() -> dict:
    import torch
    from vllm import _custom_ops

    return {"custom_ops": _custom_ops, "C": torch.ops._C}


def install_for(indexer, targets: dict | None = None) -> bool:
    """Swap the kernels when ``indexer`` (a registered class) has ``stable_topk``; idempotent.
    ``targets`` (tests): {"custom_ops": module, "C": namespace} in place of vLLM's. True when the
    stand-ins are in place after the call. Each original is kept on its own object (``ORIG`` +
    name), not in this module (no module state: tests/test_worker_object.py)."""
    if not getattr(indexer, "stable_topk", False):
        return False
    t = targets if targets is not None else _targets()
    done = []
    for where, name in SWAPS:
        obj, new = t[where], getattr(stable_topk, name)
        if getattr(obj, name, None) is new:
            continue
        # an op namespace builds its attribute on first access: getattr makes the original
        # (absent on a build without the kernel: None, restored by deleting)
        setattr(obj, ORIG + name, getattr(obj, name, None))
        setattr(obj, name, new)
        done.append(name)
    if done:
        logger.info("hisparse %s: vLLM's top-k kernels replaced by the stable top-k "
                    "(ops/stable_topk.py): %s", indexer.name, ", ".join(done))
    return True


def uninstall(targets: dict | None = None) -> None:
    """Put back what ``install_for`` replaced on ``targets`` (tests; default vLLM's objects)."""
    t = targets if targets is not None else _targets()
    for where, name in SWAPS:
        obj = t[where]
        if not hasattr(obj, ORIG + name):
            continue
        old = getattr(obj, ORIG + name)
        delattr(obj, ORIG + name)
        if old is None:
            delattr(obj, name)
        else:
            setattr(obj, name, old)
