"""Run a test module's Triton kernels on the CPU through Triton's interpreter: in a subprocess,
because TRITON_INTERPRET must be set before triton is imported. The module defines
``run_interpreter_cases()``, which raises on a mismatch and prints "interpreter ok" at the end."""
from __future__ import annotations

import os
import subprocess
import sys


def run_cases(module: str) -> None:
    code = (f"import sys; sys.path.insert(0, sys.argv[1]); import {module} as t; "
            "t.run_interpreter_cases()")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__))],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "interpreter ok" in r.stdout, r.stdout + r.stderr
