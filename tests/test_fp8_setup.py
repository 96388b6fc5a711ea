"""fp8 KV at startup: which ``--kv-cache-dtype`` values hisparse serves and the one line for the
others (vllm/setup_check.check_kv_cache_dtype, vllm/backend.kv_cache_dtype_error), and the spec
that has vLLM type the fp8 cache as e4m3 (vllm/spec.HiSparseSpec)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.config import HiSparseConfig, HiSparseConfigError

pytestmark = pytest.mark.vllm

SERVED = ["auto", "fp8", "fp8_e4m3"]
REFUSED = {"fp8_e5m2": "use --kv-cache-dtype fp8 (e4m3) or auto",
           "fp8_ds_mla": "indexer 'dsa' only",
           "fp8_per_token_head": "use --kv-cache-dtype fp8 (e4m3) or auto",
           "nvfp4": "use --kv-cache-dtype fp8 (e4m3) or auto"}


def _cc(dt, skip=None):
    return SimpleNamespace(cache_dtype=dt, kv_cache_dtype_skip_layers=skip)


@pytest.mark.parametrize("dt", SERVED)
def test_served_dtypes_pass(dt):
    from vllm_hisparse.vllm.backend import HiSparseBackend, kv_cache_dtype_error
    from vllm_hisparse.vllm.setup_check import check_kv_cache_dtype
    assert kv_cache_dtype_error(dt) is None
    assert dt in HiSparseBackend.supported_kv_cache_dtypes
    check_kv_cache_dtype(HiSparseConfig(), _cc(dt))


@pytest.mark.parametrize("dt", list(REFUSED))
def test_other_dtypes_get_one_line_naming_the_field_and_the_fix(dt):
    from vllm_hisparse.vllm.setup_check import check_kv_cache_dtype
    with pytest.raises(HiSparseConfigError) as e:
        check_kv_cache_dtype(HiSparseConfig(), _cc(dt))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"hisparse: kv_cache_dtype={dt!r}")
    assert REFUSED[dt] in line


def test_validate_configuration_gives_the_same_reason():
    from vllm_hisparse.vllm.backend import HiSparseBackend
    args = dict(head_size=64, dtype=torch.bfloat16, block_size=16, use_mla=False, has_sink=False,
                use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                device_capability=None, attn_type="decoder")
    assert HiSparseBackend.validate_configuration(kv_cache_dtype="fp8", **args) == []
    why = HiSparseBackend.validate_configuration(kv_cache_dtype="fp8_e5m2", **args)
    assert len(why) == 1 and "fp8_e5m2" in why[0]


def test_fp8_refuses_what_it_does_not_run_with_yet():
    from vllm_hisparse.vllm.setup_check import check_kv_cache_dtype
    with pytest.raises(HiSparseConfigError, match="split_dense_decode=false .* leave"):
        check_kv_cache_dtype(HiSparseConfig(split_dense_decode=False), _cc("fp8"))
    with pytest.raises(HiSparseConfigError, match="kv_cache_dtype_skip_layers=.* drop"):
        check_kv_cache_dtype(HiSparseConfig(), _cc("fp8", ["0"]))
    check_kv_cache_dtype(HiSparseConfig(split_dense_decode=False), _cc("auto"))


def test_spec_types_vllm_fp8_cache_as_e4m3():
    from vllm_hisparse.ops.fp8 import FP8
    from vllm_hisparse.vllm.spec import HiSparseSpec
    kw = dict(block_size=16, num_kv_heads=2, head_size=32)
    fp8 = HiSparseSpec(dtype=torch.uint8, **kw)        # what vLLM gives for --kv-cache-dtype fp8
    assert fp8.dtype == FP8
    assert fp8.page_size_bytes == HiSparseSpec(dtype=torch.bfloat16, **kw).page_size_bytes // 2
    assert HiSparseSpec(dtype=torch.bfloat16, **kw).dtype == torch.bfloat16
