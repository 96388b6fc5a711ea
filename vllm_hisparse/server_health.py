"""Waiting for a `vllm serve` subprocess to answer /health (demo, serving benchmark, tests)."""
from __future__ import annotations

import subprocess
import time
import urllib.request


class ServerExited(RuntimeError):
    """The server process ended before it was healthy."""


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> float:
    """Block until http://127.0.0.1:PORT/health answers 200; returns the seconds waited.
    Raises ServerExited if ``proc`` ends first, TimeoutError after ``timeout`` seconds."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise ServerExited(f"vllm serve exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.time() - t0
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"vllm serve was not healthy after {timeout:.0f} s")


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Terminate the server, and kill it if it has not exited after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
