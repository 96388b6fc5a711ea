"""Compile a test's Triton launches for the H200 (sm_90) on a machine without a GPU: inside
``compile_only()`` every ``@triton.jit`` launch is compiled through Triton's real NVIDIA backend
(down to a cubin with the ptxas Triton ships) and not run. Triton's interpreter runs a kernel's
Python but accepts code the compiler refuses (a reassigned constexpr cost a GPU call on
2026-12-01), so the CPU suite compiles every kernel too. Triton internals used: the active
driver (swapped for a stub naming the target) and ``JITFunction.run``'s ``warmup`` flag."""
from __future__ import annotations

import contextlib
import shutil

import torch


def ptxas_available(arch: int = 90) -> bool:
    try:
        from triton.backends.nvidia import compiler
        return bool(compiler.get_ptxas(arch).path)
    except Exception:
        return shutil.which("ptxas") is not None


@contextlib.contextmanager
def compile_only(arch: int = 90):
    """Yields the set of kernel names compiled inside the block."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver, jit

    class Stub:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    seen: set[str] = set()
    run = jit.JITFunction.run

    def compile_run(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        assert kernel is not None and kernel.asm.get("cubin"), f"{self.__name__}: no cubin"
        seen.add(self.__name__)
        return kernel

    prev = driver._active
    driver.set_active(Stub())
    jit.JITFunction.run = compile_run
    try:
        yield seen
    finally:
        jit.JITFunction.run = run
        driver._active = prev
