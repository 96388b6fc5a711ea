"""StepWrite: the decode batch's write-through for every sparse layer in one launch, at the step's
last sparse layer (``HISPARSE_WRITE_THROUGH=step``, an A/B against each layer's write kernel
storing its own token; ops/triton_write_through_step.py says why).

It copies each row's new token from every sparse layer's cache, where the layers' write kernels
put it, into the host pool: so it needs the caches (``bind``, from the runtime's
bind_kv_caches), and it runs after the last sparse layer's write. The pages it completes are
read from the host pool only from the next step on (a decode row never selects its newest page),
so outputs and the pool's bytes are those of the per-layer write-through.
"""
from __future__ import annotations

import torch

from vllm_hisparse.ops import write_through


class StepWrite:
    def __init__(self, layers: list[int], host_layer: dict, device: torch.device,
                 dtype: torch.dtype):
        """layers: the sparse layers with a host copy, in order; host_layer: model layer -> its
        layer in the host pool; dtype: the host pool's."""
        self.layers, self.dtype = list(layers), dtype
        self.last = self.layers[-1] if self.layers else -1
        self.host_idx = torch.tensor([host_layer[i] for i in self.layers], dtype=torch.int64,
                                     device=device)
        self.kvs: list[torch.Tensor] | None = None
        self.ptrs: torch.Tensor | None = None

    def bind(self, caches: list) -> None:
        """Every layer's cache (caches[layer]). With HISPARSE_WRITE_THROUGH=step, the table of the
        sparse ones' addresses is written here, before any CUDA graph records the launch that
        reads it (a later bind rewrites the same table in place); otherwise nothing is kept."""
        kvs = [caches[layer] for layer in self.layers]
        if not write_through.STEP or not kvs or any(c is None for c in kvs):
            self.kvs = None
            return
        want = (kvs[0].shape, kvs[0].stride(), self.dtype)
        for layer, c in zip(self.layers, kvs):
            if (c.shape, c.stride(), c.dtype) != want or c.stride(-1) != 1:
                raise ValueError(
                    f"HISPARSE_WRITE_THROUGH=step: layer {layer}'s KV cache {tuple(c.shape)} "
                    f"{c.stride()} {c.dtype} differs from layer {self.layers[0]}'s "
                    f"{tuple(kvs[0].shape)} {kvs[0].stride()} or the host pool's {self.dtype} (or "
                    f"its last dimension is strided); one launch reads them all with one layout: "
                    f"use HISPARSE_WRITE_THROUGH=layer")
        ptrs = torch.tensor([c.data_ptr() for c in kvs], dtype=torch.int64)
        if self.ptrs is not None and self.ptrs.shape == ptrs.shape:
            self.ptrs.copy_(ptrs)
        else:
            self.ptrs = ptrs.to(kvs[0].device)
        self.kvs = kvs

    def run(self, host: torch.Tensor, db) -> None:
        """The decode batch db's new tokens of every layer into host (the pool's data)."""
        if self.kvs is None:
            raise RuntimeError("HISPARSE_WRITE_THROUGH=step reads the new tokens from every sparse "
                               "layer's KV cache: bind them with the knob set "
                               "(SparseRuntime.bind_kv_caches; the KV connector does it in "
                               "register_kv_caches)")
        f = db.field
        write_through.write_through_step(host, self.kvs, self.ptrs, self.host_idx, db.newest,
                                         f("seq"), f("host_page"))
