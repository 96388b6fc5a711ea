"""The latent pool of the DSA path (docs/dsa.md section 2): per layer, one GPU tensor of latent
rows (``[kv_c, k_pe]``, 576 bf16/fp16 values a token, or with ``--kv-cache-dtype fp8_ds_mla``
656 packed bytes: ops/fp8_ds_mla.py; rows are opaque to everything below the attention) laid out
as

    [ regions: regions x max_model_len rows ][ row sets: row_sets x B rows ]

- a **region** holds a request's whole latent: while its prompt is prefilled in hisparse mode
  (``regions`` = prefill_slots), for its whole life in resident mode (``regions`` = requests at
  once, ``row_sets`` = 0; docs/dsa.md section 7);
- a **row set** holds the ``B = device_buffer_size`` hot slots of one sparse request (slot s of
  row set r is row ``row_set_base(r) + s``), with its RESOLVE state per layer (the slot engine's
  ``HotBufferState`` under the configured policy, ``lru`` or ``crf``: token -> slot
  ``max_model_len``, slot -> token and the policy's state (LRU order / crf value) ``B`` int32
  each) and one token -> host-row table shared by the layers (``DevicePageTable``: one token
  per host page, so the host pool's page table is the token -> host-row table).

``newest = 0`` (docs/dsa.md): a new token's row reaches the hot slots through RESOLVE, as a miss.
Which process: the worker (allocated by the adapter before vLLM profiles memory); ``nbytes`` is
what ``core/capacity_mla.py`` counts for the same layout (tests/test_dsa_core.py checks the two
agree), so capacity and admission size it without allocating.
"""
from __future__ import annotations

import torch

from vllm_hisparse.core.page_table import DevicePageTable
from vllm_hisparse.ops import fp8_ds_mla
from vllm_hisparse.slots import HotBufferState, make, served


def _check(name: str, value: int, low: int, fix: str) -> None:
    if not isinstance(value, int) or value < low:
        raise ValueError(f"LatentPool {name}={value!r} must be an int >= {low}; {fix}")


class LatentPool:
    def __init__(self, num_layers: int, max_model_len: int, buffer: int, row_sets: int,
                 regions: int, row: int = 576, dtype: torch.dtype = torch.bfloat16,
                 device="cpu", policy: str = "lru"):
        """num_layers: sparse MLA layers; max_model_len: rows of a region and tokens of a row
        set's tables; buffer: B hot slots per row set; row_sets: N sparse requests at once (0 in
        resident mode); regions: full-length regions (prefill_slots, or resident requests at
        once); row: values per latent row (kv_lora_rank + qk_rope_head_dim; fp8_ds_mla: its
        656 bytes); dtype: the latent's (bf16/fp16; uint8 = fp8_ds_mla rows); policy: the row
        sets' replacement policy (one RESOLVE kernel branch: slots.served()). Rows start zeroed
        (the attention reference reads row 0 under a -1 index, masked: it must be finite)."""
        _check("num_layers", num_layers, 1, "give the model's sparse MLA layer count")
        _check("max_model_len", max_model_len, 1, "give vLLM's max_model_len")
        _check("buffer", buffer, 1, "give device_buffer_size (>= top_k)")
        _check("row_sets", row_sets, 0, "give quest_rows or max_num_seqs (0: resident mode)")
        _check("regions", regions, 0, "give prefill_slots (default 1)")
        _check("row", row, 1, "give kv_lora_rank + qk_rope_head_dim (576)")
        if row_sets + regions == 0:
            raise ValueError("LatentPool needs row_sets > 0 or regions > 0; give prefill_slots >= 1")
        if dtype not in (torch.bfloat16, torch.float16, torch.uint8):
            raise ValueError(f"LatentPool dtype={dtype} must be bf16 or fp16 (FLASH_ATTN_MLA_SPARSE's"
                             f" latent) or uint8 (fp8_ds_mla rows); use torch.bfloat16")
        if dtype == torch.uint8 and row != fp8_ds_mla.ROW_BYTES:
            raise ValueError(f"LatentPool row={row} must be {fp8_ds_mla.ROW_BYTES} bytes for "
                             f"fp8_ds_mla rows (dtype uint8)")
        if policy not in served():
            raise ValueError(f"LatentPool policy={policy!r} has no RESOLVE kernel branch; choose "
                             f"one of {', '.join(served())}")
        most = make(policy).kernel_max_slots
        if most is not None and buffer > most:
            raise ValueError(f"LatentPool buffer={buffer} is more slots than policy {policy!r}'s "
                             f"kernel holds ({most}); lower device_buffer_size or use policy lru")
        self.num_layers, self.max_model_len, self.B = num_layers, max_model_len, buffer
        self.row_sets, self.regions, self.row, self.dtype = row_sets, regions, row, dtype
        self.device = torch.device(device)
        # fp8_ds_mla: what packs a step's [kv_c, k_pe] into rows (the reference; on a GPU the
        # adapter plugs in vLLM's own kernel, so stock and hisparse hold the same bytes)
        self.packer = fp8_ds_mla.pack if dtype == torch.uint8 else None
        self.num_rows = regions * max_model_len + row_sets * buffer
        self.rows = [torch.zeros(self.num_rows, row, dtype=dtype, device=self.device)
                     for _ in range(num_layers)]
        self.policy = policy
        self.states = [HotBufferState.create(row_sets, buffer, max_model_len, policy, self.device)
                       for _ in range(num_layers)] if row_sets else []
        self.host_rows = DevicePageTable(row_sets, max_model_len, self.device) if row_sets else None
        self.counts = torch.zeros(2, dtype=torch.int64, device=self.device)   # [hits, misses]

    # ---- layout ---------------------------------------------------------------------------------
    def row_parts(self, kv_c: torch.Tensor, k_pe: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's new latent rows in the pool's format, as parts (``write_latent_rows``
        joins them as it stores): ``(kv_c, k_pe)`` (kv_c (T, L), k_pe (T, Rd), the pool's dtype),
        or ``(packed fp8_ds_mla bytes, None)`` (``packer``)."""
        if self.packer is not None:
            return self.packer(kv_c, k_pe), None
        if kv_c.dtype != self.dtype or k_pe.dtype != self.dtype:
            raise ValueError(f"kv_c/k_pe dtype {kv_c.dtype}/{k_pe.dtype} must be the pool's "
                             f"{self.dtype}; cast them first")
        return kv_c, k_pe

    def region_base(self, region: int) -> int:
        """First pool row of region ``region`` (its position p is row region_base + p)."""
        if not 0 <= region < self.regions:
            raise ValueError(f"region={region} out of range; the pool has {self.regions} regions")
        return region * self.max_model_len

    def row_set_base(self, row_set: int) -> int:
        """First pool row of row set ``row_set``'s hot slots (slot s is row row_set_base + s)."""
        if not 0 <= row_set < self.row_sets:
            raise ValueError(f"row_set={row_set} out of range; the pool has {self.row_sets} row sets")
        return self.regions * self.max_model_len + row_set * self.B

    def slot_rows(self, row_sets: torch.Tensor) -> torch.Tensor:
        """(n, B) int32 pool rows of the hot slots of row_sets (n,) int (>= 0): RESOLVE's block
        table. Computed, not stored (a stored table would be memory calc does not count)."""
        base = self.regions * self.max_model_len + row_sets.long().to(self.device) * self.B
        return (base[:, None] + torch.arange(self.B, device=self.device)).to(torch.int32)

    def reset_row_set(self, row_set: int) -> None:
        """Empty a row set's slots in every layer and clear its host rows (a request takes it)."""
        self.row_set_base(row_set)
        for st in self.states:
            st.reset(row_set)
        self.host_rows.clear(row_set)

    # ---- size -----------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the layout sizes (rows, RESOLVE states, host-row table; not the 16 B of
        hit/miss counts)."""
        out = list(self.rows)
        for st in self.states:
            out += [st.slot_unit, st.unit_slot, *st.pstate.values()]
        if self.host_rows is not None:
            out.append(self.host_rows.table)
        return out

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool: what it allocated, not a formula (capacity_mla has that)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())
