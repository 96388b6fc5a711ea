"""Registers and spills of the decode batch's attention split launch (ops/triton_decode_attention.py),
compiled on the CPU for the H200 (sm_90a) by Triton's NVIDIA backend and ptxas -v: without the
misses' reads (resident rows) and with them (``miss``: a locs entry -2 - block copied from the host
page), Llama-3-8B's attention shape, bf16: registers, spills, cp.async and SASS instructions (the
whole kernel, a miss-copy prologue included). A loop that holds more registers than the SM gives
it spills to local memory; docs/archive/gpu-diary.md (seventh session) records what a branch per tile
cost.

    .venv/bin/python scripts/probes/split_registers.py
"""
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from test_decode_attention import mixed_batch, with_misses  # noqa: E402
from triton_sm90 import compile_only  # noqa: E402
from triton.backends.nvidia import compiler  # noqa: E402
from triton.runtime import jit  # noqa: E402

from vllm_hisparse.ops import triton_decode_attention as tda  # noqa: E402

gen = torch.Generator().manual_seed(6)
t = mixed_batch(4, 32, 8, 128, 16, 128, 4096, torch.bfloat16, gen)
m, miss = with_misses(t, gen)
work = tuple(torch.empty(n, dtype=torch.float32) for n in tda.partials_numel(4, 32, 8, 128, 16, 128))
ptx = []
with tempfile.TemporaryDirectory() as cache, compile_only():
    os.environ["TRITON_CACHE_DIR"] = cache
    run = jit.JITFunction.run

    def keep(self, *a, **k):
        kernel = run(self, *a, **k)
        if self.__name__ == "_mixed_split_kernel":
            ptx.append(kernel.asm["ptx"])
        return kernel

    jit.JITFunction.run = keep
    try:
        tda.decode_attention(*t[:-1], 0.1, t[-1], work)
        tda.decode_attention(*m[:-1], 0.1, m[-1], work, miss)
    finally:
        jit.JITFunction.run = run
ptxas = compiler.get_ptxas(90).path
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4}\*/", re.M)     # one per instruction in cuobjdump -sass
for name, text in zip(("resident rows", "misses read from the host"), ptx):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(text)
        f.flush()
        cubin = f.name + ".cubin"
        info = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", cubin],
                              capture_output=True, text=True).stderr
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True).stdout
        os.remove(cubin)
    regs = re.search(r"Used (\d+) registers", info).group(1)
    spill = re.search(r"(\d+) bytes spill stores", info).group(1)
    print(f"{name}: {regs} registers, {spill} bytes of spill stores, "
          f"{text.count('cp.async.cg') + text.count('cp.async.ca')} cp.async, "
          f"{len(SASS_LINE.findall(sass))} SASS instructions")
