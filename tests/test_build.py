"""Compile-only check of the CUDA extension on CPU machines: where nvcc exists (CI, dev machines)
`make setup` must have built vllm_hisparse._C and its ops must be registered."""
import os
import shutil

import pytest
import torch

from vllm_hisparse.ops import kernels

NEEDS_BUILD = shutil.which("nvcc") is not None and os.environ.get("HISPARSE_SKIP_CUDA_BUILD") != "1"


@pytest.mark.skipif(not NEEDS_BUILD, reason="no nvcc here (or HISPARSE_SKIP_CUDA_BUILD=1)")
def test_extension_built_and_ops_registered():
    assert kernels.available(), f"CUDA extension did not build/import: {kernels.import_error()}"
    schema = str(torch.ops.hisparse.add_one.default._schema)
    assert "Tensor(a!) out" in schema


def test_cpu_fallback_matches_torch():
    x = torch.randn(37)
    assert torch.equal(kernels.add_one(x), x + 1)
