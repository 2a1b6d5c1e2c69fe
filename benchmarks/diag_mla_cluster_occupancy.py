"""How many clusters of the clustered few-heads MLA stage 1 the GPU holds at once (cuOccupancyMaxActiveClusters)."""
import ctypes
import subprocess
import sys
import torch
from ftransformers.kernels import gluon_mla_few_heads as few
from ftransformers.kernels.triton_decode_attention import decode_scratch


class Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("x", ctypes.c_uint), ("y", ctypes.c_uint),
                ("z", ctypes.c_uint), ("rest", ctypes.c_char * 52)]


class Config(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(Attr)), ("n", ctypes.c_uint)]


cuda = ctypes.CDLL("libcuda.so.1")
DEV = torch.device("cuda")
H, L, R, B = 16, 512, 64, 1
n = 4096
r2t = torch.arange(1, n + 1, device=DEV).view(1, n)
rows = torch.zeros(1, dtype=torch.int64, device=DEV)
seq = torch.tensor([n], device=DEV)
qn = torch.randn(B, H, L, device=DEV, dtype=torch.bfloat16)
qr = torch.randn(B, H, R, device=DEV, dtype=torch.bfloat16)
buf = torch.randn(n + 1, L + R, device=DEV, dtype=torch.bfloat16)
for size in (1, 2, 4, 8, 16):
    mid_o, mid_lse = decode_scratch(B, H, L, 128, DEV)
    out = torch.empty_like(qn)
    few.mla_decode_few_heads(qn, qr, buf, out, r2t, rows, seq, mid_o, mid_lse, 128, 0.05, 0, cluster=size)
    torch.cuda.synchronize()
    if size == 1:
        continue
    run = few.mla_decode_stage1_few_heads.run
    kernel, off, shared = [v for k, v in run.cluster_kernels.items() if k[3] == size][0]
    cuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), 14, ctypes.c_int(1))  # non-portable sizes
    attr = Attr(id=4, x=size, y=1, z=1)
    cfg = Config(gx=128, gy=1, gz=1, bx=kernel.metadata.num_warps * 32, by=1, bz=1, smem=shared, stream=None,
                 attrs=ctypes.pointer(attr), n=1)
    count = ctypes.c_int(-1)
    rc = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(count), ctypes.c_void_p(kernel.function), ctypes.byref(cfg))
    print(f"cluster {size}: shared {shared} B, threads {cfg.bx}: max active clusters {count.value} (rc {rc}) "
          f"= {count.value * size} CTAs")
