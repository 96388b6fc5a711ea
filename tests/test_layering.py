"""The core, ops and sim packages never import vLLM (checked in a fresh interpreter)."""
import subprocess
import sys


def test_core_ops_sim_do_not_import_vllm():
    code = ("import sys, importlib, pkgutil, vllm_hisparse\n"
            "import vllm_hisparse.config, vllm_hisparse.core, vllm_hisparse.ops, vllm_hisparse.sim\n"
            "for pkg in (vllm_hisparse.core, vllm_hisparse.ops, vllm_hisparse.sim):\n"
            "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
            "        importlib.import_module(m.name)\n"
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
