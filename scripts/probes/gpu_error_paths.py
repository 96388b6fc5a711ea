"""GPU box probe: do the CUDA ops raise (not crash) on bad arguments?

    python scripts/probes/gpu_error_paths.py unpinned|int32|resolve_unpinned
"""
import sys, torch
from vllm_hisparse.ops import kernels
case = sys.argv[1]
k = torch.randn(6, 2, 64, device="cuda").to(torch.bfloat16)
idx = torch.zeros(1, dtype=torch.int64, device="cuda")
host = torch.zeros(4, 2, 4, 2, 64, dtype=torch.bfloat16)
try:
    if case == "unpinned": torch.ops.hisparse.write_through(host, k, k, idx, idx, idx)
    if case == "int32": torch.ops.hisparse.write_through(host.pin_memory(), k, k, idx.int(), idx, idx)
    if case == "resolve_unpinned":
        R,kk,S,U=1,2,4,8
        sel=torch.zeros(R,kk,dtype=torch.int32,device="cuda")
        su=torch.full((R,S),-1,dtype=torch.int32,device="cuda")
        us=torch.full((R,U),-1,dtype=torch.int32,device="cuda")
        lru=torch.arange(S,dtype=torch.int32,device="cuda")[None]
        buf=torch.zeros(S,8,device="cuda")
        kernels.resolve_lru(sel,su,us,lru,lru.clone(),buf,torch.zeros(U,8),us.clone(),sel.clone())
    print(case, "no error?")
except RuntimeError as e:
    print(case, "raised:", str(e).splitlines()[0][:100])
