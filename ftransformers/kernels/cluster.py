"""Thread-block clusters for Triton kernels compiled one CTA a program (Hopper): a launch in clusters, and the
distributed shared memory (DSMEM) through which a cluster's CTAs exchange small results without a kernel boundary.

Triton's `num_ctas` option would spread each tensor over the cluster's CTAs (a CGA layout). Here the kernel is
compiled as usual, one independent program a CTA, and only its launch asks for clusters of `size` consecutive
programs along grid axis 0 (`cluster_launch`: the compiled kernel's launcher given `num_ctas = size` in the
launch metadata, which sets the cluster-dimension attribute and multiplies grid x by it, so the grid passed counts
clusters). `tl.program_id(0)` is then the CTA's index, and its rank in the cluster is `program_id(0) % size`.

A kernel's own scratch lies after the shared memory Triton allocates for it: the launch passes the dynamic
shared size Triton computed, rounded up to 16, as `smem_off`, and asks for `scratch_bytes` more. Nothing Triton
generates touches those bytes. `smem_addr(smem_off)` is their shared-window address (the PTX symbol
`global_smem`, Triton's dynamic shared array). Invariant for a kernel using this: every CTA of a cluster runs
`cluster_sync` the same number of times, all its threads, whatever its data (an empty split too), and the last
one after its final DSMEM read, so that no CTA exits while a peer still reads its shared memory.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import triton
import triton.language as tl

from ftransformers.kernels import compile_log
from ftransformers.kernels.launch import launch_cache_enabled

MAX_PORTABLE_CLUSTER = 8


@triton.jit
def cluster_sync():
    # every thread of every CTA of the cluster: shared-memory stores before it are visible to the peers' loads after
    tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; // $0",
        "=r", [], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def cluster_arrive():
    # the first half of a cluster barrier, for "I have finished reading my peers"; cluster_wait completes it. Work
    # placed between the two overlaps the slowest peer. Release semantics: the CTA's loads from peers before it
    # have their values first. A relaxed arrive would let a peer pass its wait and exit while those loads are in
    # flight (with one, a clustered MLA merge, since removed, failed once on the H200: unspecified launch failure)
    tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )  # fmt: skip


@triton.jit
def cluster_wait():
    tl.inline_asm_elementwise(
        "barrier.cluster.wait.aligned; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )  # fmt: skip


@triton.jit
def smem_addr(offset):
    # the shared-window address of byte `offset` of this CTA's dynamic shared memory (int32)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 base; mov.u32 base, global_smem; add.u32 $0, base, $1; }",
        "=r,r", [offset.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def st_shared_f32(addr, value):
    # this CTA's shared memory at `addr` (smem_addr) := value, elementwise
    return tl.inline_asm_elementwise(
        "st.shared.f32 [$1], $2; // $0", "=r,r,r", [addr, value.to(tl.float32)], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@triton.jit
def ld_cluster_f32(addr, rank):
    # the float at `addr` (smem_addr) of the shared memory of the cluster's CTA `rank`, elementwise
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a; mapa.shared::cluster.u32 a, $1, $2; ld.shared::cluster.f32 $0, [a]; }",
        "=r,r,r", [addr, rank.to(tl.int32)], dtype=tl.float32, is_pure=False, pack=1,
    )  # fmt: skip


def cluster_supported(device: torch.device) -> bool:
    """Clusters need Hopper or later, and the cached launch path (cluster_launch binds arguments through it)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9 and launch_cache_enabled()


def max_cluster_size(device: torch.device) -> int:
    """The largest cluster a launch here may ask for: 16 (non-portable, which Triton's launcher opts into) on
    Hopper and Blackwell data-center parts, else the portable 8; 1 where clusters are not supported."""
    if not cluster_supported(device):
        return 1
    return 16 if torch.cuda.get_device_capability(device)[0] in (9, 10) else MAX_PORTABLE_CLUSTER


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def cluster_launch(fn: Any, grid: tuple[int, ...], size: int, scratch_bytes: int, *args: Any, **kwargs: Any) -> None:
    """Launch `fn` (a @cached_launch @triton.jit kernel with a runtime argument `smem_off`, passed here as 0 and
    replaced) on grid[0] clusters of `size` programs along axis 0, with `scratch_bytes` of shared memory after
    Triton's own. As `cached_launch` does, it binds the arguments with Triton's binder and keeps the compiled
    kernel by their specialization, so only a call's first launch goes through `JITFunction.run` (to compile)."""
    # Triton's launcher opts a kernel into a non-portable cluster size at 16 only: 9-15 would fail to launch
    assert 1 <= size <= MAX_PORTABLE_CLUSTER or size == 16, f"cluster size {size}: 1-8 or 16"
    run = fn.run  # launch._CachedRun (cluster_supported requires the launch cache)
    device = torch._C._cuda_getDevice()
    binder = run.binder(device)
    if binder is False:
        raise RuntimeError("cluster_launch needs Triton 3.6-3.9's argument binder")
    bound, specialization, options = binder(*args, **kwargs)
    key = (device, tuple(specialization), tuple(options.items()), size, scratch_bytes)
    found = run.cluster_kernels.get(key)
    if found is None:
        t0 = time.perf_counter()
        kernel = run.triton_run(*args, grid=grid, warmup=True, **kwargs)  # compiles, or finds, without launching
        compile_log.record(getattr(fn, "__name__", "kernel"), time.perf_counter() - t0)
        kernel._init_handles()
        off = _align16(kernel.metadata.shared)
        shared = off + scratch_bytes
        if shared > 48 * 1024:  # above 48 KiB of dynamic shared memory a kernel must opt in
            _opt_in(kernel.function, shared)
        found = run.cluster_kernels[key] = (kernel, off, shared)
    else:
        run.check_globals()
    kernel, off, shared = found
    bound["smem_off"] = off
    stream = torch._C._cuda_getCurrentRawStream(device)
    n = len(grid)
    kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
               (kernel.metadata.num_warps, size, shared), None, None, None, *bound.values())  # fmt: skip


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def _opt_in(function: int, shared: int) -> None:
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")
    err = libcuda.cuFuncSetAttribute(
        ctypes.c_void_p(function), _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(shared)
    )
    if err != 0:
        raise RuntimeError(f"cuFuncSetAttribute(max dynamic shared memory = {shared} bytes) failed: CUresult {err}")
