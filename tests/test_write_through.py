"""WRITE-THROUGH: the reference against an explicit loop (CPU), the CUDA op against the reference
(bytes exact, host pre-filled with a sentinel, untouched rows checked), strided k/v views of a fused
qkv tensor, rows that are and are not multiples of 16 bytes, CUDA-graph capture + replay."""
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from vllm_hisparse.ops import reference
from vllm_hisparse.ops import write_through as wt

SENTINEL = 0x7F                                     # every host byte before the write
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (Hkv, D): 2 KB rows (bf16), 128 B, 12 B (fp16: 4-byte vectors), 30 B (fp16: 2-byte vectors), 1 element
ROWS = [(8, 128), (1, 64), (1, 6), (3, 5), (1, 1)]
# k/v sources: separate contiguous tensors; views of a fused qkv row (aligned); views starting one
# element into an odd-width fused row (pointer and token stride only element-aligned)
LAYOUTS = ["contiguous", "fused", "fused_odd"]
# entries: none, one, warp boundaries, enough to make the kernel's grid-stride loop go round
NS = [0, 1, 31, 32, 33, 257, 1500]
HOSTS = ["pinned", "cuda"]
REPO = Path(__file__).resolve().parents[1]
NEEDS_BUILD = shutil.which("nvcc") is not None and os.environ.get("HISPARSE_SKIP_CUDA_BUILD") != "1"


def _gen():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print("seed", seed)
    return torch.Generator().manual_seed(seed)


def _sources(gen, T, Hkv, D, dtype, layout):
    """k, v: (T, Hkv, D) in dtype on the CPU, laid out as `layout` says."""
    if layout == "contiguous":
        k, v = (torch.randn(T, Hkv, D, generator=gen).to(dtype) for _ in range(2))
        return k, v
    hq, lead, extra = (4 * Hkv, 0, 0) if layout == "fused" else (3 * Hkv, 1, 1)
    width = lead + (hq + 2 * Hkv) * D + extra
    qkv = torch.randn(T, width, generator=gen).to(dtype)
    c = lead + hq * D
    k = qkv[:, c:c + Hkv * D].view(T, Hkv, D)
    v = qkv[:, c + Hkv * D:c + 2 * Hkv * D].view(T, Hkv, D)
    return k, v


def _indices(gen, n, T, pages, P, p_pad=0.1):
    """tok, page, off: (n,) int64; distinct destinations, ~p_pad of the entries padding (page -1)."""
    flat = torch.randperm(pages * P, generator=gen)[:n]
    tok = torch.randint(0, T, (n,), generator=gen)
    page, off = flat // P, flat % P
    page[torch.rand(n, generator=gen) < p_pad] = -1
    return tok, page, off


def _host(pages, P, Hkv, D, dtype):
    es = torch.empty((), dtype=dtype).element_size()
    return torch.full((pages, 2, P, Hkv, D * es), SENTINEL, dtype=torch.uint8).view(dtype)


def _pool_for(n, P):
    return (3 * n) // (2 * P) + 3                     # a third of the rows (or more) stay untouched


def _loop(host, k, v, tok, page, off):
    exp = host.clone()
    for t, p, o in zip(tok.tolist(), page.tolist(), off.tolist()):
        if p >= 0:
            exp[p, 0, o] = k[t]
            exp[p, 1, o] = v[t]
    return exp


def _bytes(t):
    return t.cpu().view(torch.uint8)


def _untouched(host, page, off):
    """Every row not named by a non-padding entry still holds the sentinel bytes."""
    written = torch.zeros(host.shape[0], host.shape[2], dtype=torch.bool)
    keep = page >= 0
    written[page[keep].cpu(), off[keep].cpu()] = True
    b = _bytes(host).permute(0, 2, 1, 3, 4)[~written]
    return bool((b == SENTINEL).all())


# ---- CPU: the reference ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hkv,D", ROWS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [0, 1, 33, 257])
def test_reference_matches_loop(dtype, Hkv, D, layout, n):
    gen = _gen()
    T, P = n + 5, 4
    pages = _pool_for(n, P)
    k, v = _sources(gen, T, Hkv, D, dtype, layout)
    tok, page, off = _indices(gen, n, T, pages, P)
    host = _host(pages, P, Hkv, D, dtype)
    exp = _loop(host, k, v, tok, page, off)
    wt.write_through(host, k, v, tok, page, off)          # CPU tensors: dispatches to the reference
    assert torch.equal(_bytes(host), _bytes(exp))
    assert _untouched(host, page, off)


def test_cuda_tensor_without_op_raises(monkeypatch):
    monkeypatch.setattr(wt, "_has_op", lambda: False)
    k = types.SimpleNamespace(is_cuda=True, device="cuda:0")     # the dispatch only asks these
    with pytest.raises(RuntimeError, match="no slow fallback"):
        wt.write_through(None, k, None, None, None, None)


@pytest.mark.skipif(not NEEDS_BUILD, reason="no nvcc here (or HISPARSE_SKIP_CUDA_BUILD=1)")
def test_op_registered():
    assert wt._has_op(), "hisparse::write_through missing from the extension (rebuild: make build)"
    assert "Tensor(a!) host" in str(torch.ops.hisparse.write_through.default._schema)


# ---- CUDA: the op against the reference ---------------------------------------------------------
def _run_case(gen, n, Hkv, D, dtype, layout, where, P=4, max_blocks=0):
    T = n + 5
    pages = _pool_for(n, P)
    k, v = _sources(gen, T, Hkv, D, dtype, layout)
    tok, page, off = _indices(gen, n, T, pages, P)
    exp = _host(pages, P, Hkv, D, dtype)
    reference.write_through(exp, k, v, tok, page, off)
    host = _host(pages, P, Hkv, D, dtype)
    host = host.pin_memory() if where == "pinned" else host.cuda()
    kc, vc = _to_cuda_keep_strides(k), _to_cuda_keep_strides(v)
    wt.write_through(host, kc, vc, tok.cuda(), page.cuda(), off.cuda(), max_blocks=max_blocks)
    torch.cuda.synchronize()
    assert torch.equal(_bytes(host), _bytes(exp)), "host bytes differ from the reference"
    assert _untouched(host, page, off)


def _to_cuda_keep_strides(t):
    """The same view (strides, storage offset) over a CUDA copy of its whole storage."""
    base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).cuda()
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hkv,D", ROWS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_rows_dtypes_layouts(where, dtype, Hkv, D, layout):
    _run_case(_gen(), 33, Hkv, D, dtype, layout, where)


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("where", HOSTS)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("Hkv,D,dtype", [(8, 128, torch.bfloat16), (1, 6, torch.float16)])
def test_cuda_sizes(where, n, Hkv, D, dtype):
    _run_case(_gen(), n, Hkv, D, dtype, "fused", where, P=16)


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("max_blocks", [1, 3, 32, 10**6])
@pytest.mark.parametrize("n", [257, 1500])
def test_cuda_capped_grid_writes_the_same_bytes(max_blocks, n):
    """max_blocks (core/write_behind.py's side stream) caps the grid; the loop covers the rest."""
    _run_case(_gen(), n, 8, 128, torch.bfloat16, "fused", "pinned", P=16, max_blocks=max_blocks)


# Each bad call runs in a fresh interpreter: inside the pytest process these calls crashed it
# (segfault, twice on the H200) while a fresh process raised cleanly
# (scripts/probes/gpu_error_paths.py); a crash now fails only its case, with the output.
BAD_CALLS = {   # case: (the call, the message it must raise)
    "host_unpinned": ("wt.write_through(host, k, k, idx, idx, idx)", "host must be pinned"),
    "tok_int32": ("wt.write_through(pinned, k, k, idx.int(), idx, idx)", "tok must be int64"),
    "v_dtype": ("wt.write_through(pinned, k, k.float(), idx, idx, idx)", "v must have host's dtype"),
    "k_layout": ("wt.write_through(pinned, kt, k, idx, idx, idx)",
                 r"k's \(Hkv, D\) block must be contiguous"),
    "off_on_cpu": ("wt.write_through(pinned, k, k, idx, idx, idx.cpu())", "off must be"),
    "max_blocks": ("wt.write_through(pinned, k, k, idx, idx, idx, max_blocks=-1)",
                   "max_blocks must be >= 0"),
}
BAD_CALL_SCRIPT = """
import torch
from vllm_hisparse.ops import write_through as wt
Hkv, D, T = 2, 64, 6
host = torch.zeros(4, 2, 4, Hkv, D, dtype=torch.bfloat16)
pinned = host.pin_memory()
k = torch.randn(T, Hkv, D, device="cuda").to(torch.bfloat16)
kt = torch.randn(T, D, Hkv, device="cuda").to(torch.bfloat16).transpose(1, 2)
idx = torch.zeros(1, dtype=torch.int64, device="cuda")
try:
    CALL
except RuntimeError as e:
    print("raised:", e, flush=True)
else:
    print("no error", flush=True)
torch.cuda.synchronize()
"""


@pytest.mark.cuda
@pytest.mark.ext
@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_cuda_checks_name_the_argument(case):
    call, message = BAD_CALLS[case]
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c",
                        BAD_CALL_SCRIPT.replace("CALL", call)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    out = f"exit code {r.returncode}\n--- stdout\n{r.stdout}--- stderr\n{r.stderr[-4000:]}"
    assert r.returncode == 0, f"{case}: the bad call crashed the process\n{out}"
    assert r.stdout.startswith("raised:"), f"{case}: no RuntimeError\n{out}"
    assert re.search(message, r.stdout), f"{case}: the error does not say {message!r}\n{out}"


@pytest.mark.cuda
@pytest.mark.ext
def test_cuda_graph_capture_replay():
    """Captured once; tok/page/off and the fused qkv contents change in place between replays."""
    gen = _gen()
    n, T, P, Hkv, D, dt = 40, 48, 8, 2, 64, torch.bfloat16
    pages = _pool_for(n, P)
    k, v = _sources(gen, T, Hkv, D, dt, "fused")
    kc, vc = _to_cuda_keep_strides(k), _to_cuda_keep_strides(v)
    tok, page, off = (torch.zeros(n, dtype=torch.int64, device="cuda") for _ in range(3))
    page.fill_(-1)                                            # warm-up and capture write nothing
    host = _host(pages, P, Hkv, D, dt).pin_memory()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        wt.write_through(host, kc, vc, tok, page, off)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        wt.write_through(host, kc, vc, tok, page, off)
    torch.cuda.synchronize()
    assert _untouched(host, page, off)
    for step in range(4):
        k2, v2 = _sources(gen, T, Hkv, D, dt, "fused")
        kc.copy_(k2.cuda())
        vc.copy_(v2.cuda())
        t, p, o = _indices(gen, n, T, pages, P, p_pad=0.1 if step % 2 else 0.0)
        tok.copy_(t)
        page.copy_(p)
        off.copy_(o)
        host.copy_(_host(pages, P, Hkv, D, dt))
        exp = _host(pages, P, Hkv, D, dt)
        reference.write_through(exp, k2, v2, t, p, o)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(_bytes(host), _bytes(exp)), f"step {step}: host bytes differ"
        assert _untouched(host, p, o)
