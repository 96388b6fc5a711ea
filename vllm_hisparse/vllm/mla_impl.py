"""What both hisparse MLA backends share (vllm/mla_backend.py on FLASH_ATTN_MLA_SPARSE, bf16 rows;
vllm/mla_fp8_backend.py on FLASHMLA_SPARSE, fp8_ds_mla rows), as mixins listed before the stock
classes:

- ``LatentBackend``: the backend class's name (CUSTOM) and its KV-cache shape (the stub's);
- ``LatentBuilder``: the stock build, then the batch's host-side shape noted for the connector's
  plan (``LatentWorker.note``);
- ``LatentImpl``: the process's worker object, found or started by the first layer
  (``LatentWorker.start``: the runtime's pool is allocated while vLLM builds the model, so its
  memory profiling counts it; kv_room.py then checks what it leaves vLLM's KV cache), the layer's
  index, and ``do_kv_cache_update``, which sends the step's new rows where the plan says (the stub
  cache and vLLM's slot_mapping are ignored)."""
from __future__ import annotations

from typing import ClassVar

import torch

from . import kv_room, worker
from .backend import _host_first_blocks, _host_seq_lens
from .compat import extract_layer_index, get_current_vllm_config
from .mla_worker import LatentWorker
from .profile_span import span


class LatentBackend:
    """A mixin listed before the stock backend class (each backend adds its impl and builder)."""
    is_hisparse: ClassVar[bool] = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"            # must be an AttentionBackendEnum member (attention.py:434)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return (num_blocks, block_size, head_size)     # head_size: the stub's (mla_spec.py)


class LatentBuilder:
    """A mixin listed before the stock metadata builder class."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.worker: LatentWorker = worker.of_layer(vllm_config, layer_names[0])

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        with span("hisparse.note"):
            cm = common_attn_metadata
            B = cm.num_reqs
            qsl = cm.query_start_loc_cpu[:B + 1].tolist()
            self.worker.note(qsl, _host_seq_lens(cm, B),
                             _host_first_blocks(cm.block_table_tensor[:B], qsl,
                                                self.worker.host_tables))
            self.noted(md, cm, qsl)
        return md

    def noted(self, md, cm, qsl: list[int]) -> None:
        """What a backend adds to the stock metadata of a noted batch (nothing by default)."""


class LatentImpl:
    def _start_hisparse(self, row: int, dtype: torch.dtype) -> LatentWorker:
        """The worker (made by the first layer, found by the next ones); row: values of one
        latent row in ``dtype`` (576 bf16, or fp8_ds_mla's 656 bytes as uint8)."""
        vc = get_current_vllm_config()
        self._static = vc.compilation_config.static_forward_context
        self._layer: int | None = None
        assert self.topk_indices_buffer is not None
        found = worker.find(vc)
        if found is None:
            found = LatentWorker.start(vc, row, self.topk_indices_buffer.shape[1], dtype)
            if torch.cuda.is_available():   # the pool is on the GPU: check what it leaves vLLM
                kv_room.install()
        self.hisparse_worker = found
        return found

    def _layer_index(self) -> int:
        """This impl's layer (vLLM passes do_kv_cache_update no layer): found once by name in the
        forward context, where the MLAAttention holding it registered itself."""
        if self._layer is None:
            for name, layer in self._static.items():
                if getattr(layer, "impl", None) is self:
                    self._layer = extract_layer_index(name)
                    break
            else:
                raise RuntimeError("hisparse: an MLA impl is not in vLLM's forward context")
        return self._layer

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale) -> None:
        self.hisparse_worker.runtime.write(self._layer_index(), kv_c_normed, k_pe)
