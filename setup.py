"""Build vllm-hisparse. The CUDA extension (csrc/) compiles whenever nvcc is found, for sm_90 by
default. Env toggles: HISPARSE_SKIP_CUDA_BUILD=1 skips it; HISPARSE_CUDA_ARCHS="90;100" picks archs;
MAX_JOBS limits parallel compiles."""
import glob
import os
import shutil

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def cuda_extensions():
    if os.environ.get("HISPARSE_SKIP_CUDA_BUILD", "0") == "1":
        print("vllm-hisparse: HISPARSE_SKIP_CUDA_BUILD=1, not building the CUDA extension")
        return [], {}
    _find_cuda_home()
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

    if CUDA_HOME is None and shutil.which("nvcc") is None:
        print("vllm-hisparse: no nvcc found, not building the CUDA extension (CPU path only)")
        return [], {}
    archs = os.environ.get("HISPARSE_CUDA_ARCHS", "90").replace(",", ";").split(";")
    gencode = []
    for a in filter(None, (x.strip() for x in archs)):
        a = a.replace(".", "")
        suffix = "a" if a in ("90a", "100a") else ""
        a = a.rstrip("a")
        gencode += [f"-gencode=arch=compute_{a}{suffix},code=sm_{a}{suffix}"]
    srcs = sorted(glob.glob("csrc/*.cu")) + sorted(glob.glob("csrc/*.cpp"))
    ext = CUDAExtension(
        name="vllm_hisparse._C",
        sources=srcs,
        include_dirs=[os.path.join(ROOT, "csrc"), *pip_cuda_includes()],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17"],
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", *gencode],
        },
    )
    return [ext], {"build_ext": BuildExtension}


def _find_cuda_home():
    """torch guesses CUDA_HOME from nvcc's folder; an nvcc copied to /usr/local/bin makes that guess
    /usr/local, which has no libcudart. Prefer a toolkit folder that has both (CUDA_HOME wins)."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    cands = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    cands.append("/usr/local/cuda")   # the toolkit's standard install folder, torch's own fallback
    for c in cands:
        if glob.glob(os.path.join(c, "lib*", "libcudart.so")) and os.path.exists(os.path.join(c, "bin", "nvcc")):
            os.environ["CUDA_HOME"] = c
            return


def pip_cuda_includes():
    """Headers of the CUDA libraries torch's wheel depends on (cusparse.h, cublas_v2.h, ...): a minimal
    toolkit (nvcc only) lacks them, and torch's own headers include them."""
    try:
        import nvidia
    except ImportError:
        return []
    dirs = []
    for base in nvidia.__path__:
        dirs += sorted(d for d in glob.glob(os.path.join(base, "*", "include")) if os.path.isdir(d))
    return dirs


ext_modules, cmdclass = cuda_extensions()

setup(
    name="vllm-hisparse",
    version="0.1.0",
    description="HiSparse hierarchical KV cache for top-k sparse-attention decoding, as a vLLM plugin",
    packages=find_packages(include=["vllm_hisparse", "vllm_hisparse.*"]),
    package_data={"vllm_hisparse": ["sim/data/*.npz", "sim/data/*.json"]},
    python_requires=">=3.10",
    install_requires=["torch==2.11.*", "numpy", "vllm==0.26.*"],
    extras_require={"test": ["pytest", "matplotlib", "tqdm", "openai"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": ["hisparse = vllm_hisparse.cli:main"],
        "vllm.general_plugins": ["hisparse = vllm_hisparse.vllm.plugin:register"],
        # per-step records for the serving benchmark; inert unless HISPARSE_STEP_LOG is set
        "vllm.stat_logger_plugins": ["hisparse_steps = vllm_hisparse.vllm.step_log:StepLogger"],
    },
)
