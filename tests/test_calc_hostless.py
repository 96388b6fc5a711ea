"""`hisparse calc` and the server's startup line read H (host-backed) and L (host-less) requests
from one place, the resolved Deployment (core/deployment.py): for auto rows and explicit rows, with
hostless "sparse", "wait" and "dense", calc's figures equal the Deployment's and the line's text.
The Deployment is resolved here from the same inputs as calc's flags, not read back from calc."""
import re

import pytest
from calc_cli import GIB, calc_json, model_dir  # noqa: F401

from vllm_hisparse.config import HiSparseConfig
from vllm_hisparse.core.auto_size import Machine
from vllm_hisparse.core.deployment import EngineLimits, resolve

CONTEXT, GPU_GIB, RAM_GIB = 32768, 54, 120         # Llama-3-8B shape, max_model_len = context
EXPLICIT = {"quest_rows": 64, "host_pool_gib": 160.0, "dense_layers": 0, "dense_pool_gib": 0.0,
            "max_num_seqs": 64}                      # a 40-request host pool: 24 idle rows
CONFIGS = [(mode, rows) for rows in ("auto", "explicit") for mode in ("sparse", "wait", "dense")]
LINE = re.compile(r"room for (\d+) requests .*?\((\d+) host-backed \+ (\d+) host-less "
                  r"\(hostless=(\w+)\)")


def _flags(mode: str, rows: str) -> list:
    out = ["--context", CONTEXT, "--gpu-kv-gib", GPU_GIB, "--host-ram-gib", RAM_GIB,
           "--hostless", mode]
    if rows == "explicit":
        e = EXPLICIT
        out += ["--quest-rows", e["quest_rows"], "--host-gib", e["host_pool_gib"], "--dense-layers",
                e["dense_layers"], "--dense-pool-gib", e["dense_pool_gib"], "--max-num-seqs",
                e["max_num_seqs"]]
    return out


def _deployment(mode: str, rows: str, max_num_seqs: int):
    """The server's Deployment for calc's flags (its defaults: B 4096, top_k 2048, page 16, 2
    dense layers, 8192 batched tokens, no watermark, resident_first)."""
    sizes = {"dense_layers": (0, 1)}
    if rows == "explicit":
        sizes = {k: v for k, v in EXPLICIT.items() if k != "max_num_seqs"}
        sizes["dense_layers"] = ()
    cfg = HiSparseConfig(top_k=2048, device_buffer_size=4096, page_size=16, hostless=mode, **sizes)
    machine = Machine(RAM_GIB * GIB, 1, GPU_GIB * GIB, False, "--gpu-kv-gib")
    return resolve(cfg, EngineLimits(32, CONTEXT, max_num_seqs, 8, 128, 2,
                                     max_num_batched_tokens=8192, machine=machine))


@pytest.mark.parametrize("mode,rows", CONFIGS)
def test_calc_and_the_startup_line_read_h_and_l_from_the_deployment(model_dir, mode, rows):
    h = calc_json(model_dir, *_flags(mode, rows))["hisparse"]
    dep = _deployment(mode, rows, h["max_num_seqs"])   # max_num_seqs as calc says to pass it
    assert h["startup_line"] == dep.room_line()
    n, _ = dep.room()
    m = LINE.search(dep.room_line())
    if dep.hostless_requests is None:      # "wait" on rows it did not size: no L in the line
        assert mode == "wait" and rows == "explicit" and m is None
        assert (h["hostless_requests"], h["max_requests"]) == (0, n)
        return
    total, backed, hostless, said = int(m[1]), int(m[2]), int(m[3]), m[4]
    assert (total, said) == (n, mode) and backed + hostless == n
    assert (h["max_requests"], h["hostless_requests"]) == (backed, hostless)
    assert hostless == dep.hostless_requests
    assert (hostless == 0) == (mode == "wait")       # these configs have room for some
