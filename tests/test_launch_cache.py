"""kernels/launch.py: host launch arithmetic, which kernels take the launch cache, and (on a GPU) that a
cached launch runs the kernel Triton would have for every specialization."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from ftransformers.kernels import compile_log, launch
from ftransformers.kernels.launch import cached_launch, cdiv, next_pow2

PACKAGE = Path(launch.__file__).resolve().parents[1]


def test_cdiv_and_next_pow2_match_triton() -> None:
    for a in range(300):
        assert next_pow2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 7, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
    for a in (1 << 20, (1 << 20) + 1, (1 << 40) - 3):
        assert next_pow2(a) == triton.next_power_of_2(a)


def _is_jit(node: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in node.decorator_list)


def test_every_kernel_launched_from_host_code_takes_the_cache() -> None:
    """A @triton.jit / @gluon.jit kernel named in host code (outside jit functions) is one the host launches:
    it must carry @cached_launch, or its launches pay Triton's full per-call Python."""
    jit_defs: dict[str, tuple[Path, ast.FunctionDef]] = {}
    trees = {p: ast.parse(p.read_text()) for p in PACKAGE.rglob("*.py")}
    for p, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and _is_jit(node):
                jit_defs[node.name] = (p, node)
    named_by_host: set[tuple[Path, str]] = set()

    def visit(node: ast.AST, p: Path, in_jit: bool) -> None:
        if isinstance(node, ast.FunctionDef):
            in_jit = _is_jit(node)
        if not in_jit and isinstance(node, ast.Name) and node.id in jit_defs and jit_defs[node.id][0] == p:
            named_by_host.add((p, node.id))
        for child in ast.iter_child_nodes(node):
            visit(child, p, in_jit)

    for p, tree in trees.items():
        visit(tree, p, False)
    assert len(named_by_host) >= 40  # the scan finds the launched kernels (46 when written)
    missing = sorted(
        f"{p.relative_to(PACKAGE)}:{name}"
        for p, name in named_by_host
        if not any(ast.unparse(d) == "cached_launch" for d in jit_defs[name][1].decorator_list)
    )
    assert not missing, missing


def test_interpreter_keeps_the_function_as_is() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU interpreter's case")
    assert not launch.launch_cache_enabled()

    @triton.jit
    def k(x_ptr):
        pass

    assert cached_launch(k) is k and "run" not in vars(k)


@cached_launch
@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, a, stride, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (a * x + y).to(out_ptr.dtype.element_ty), mask=mask)


def _axpy(x: torch.Tensor, y: torch.Tensor, a: float, stride: int) -> torch.Tensor:
    out = torch.empty_like(y)
    n = y.numel()
    _axpy_kernel[(cdiv(n, 64),)](x, y, out, n, a, stride, BLOCK=64)
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a GPU")
@pytest.mark.skipif(not launch.launch_cache_enabled(), reason="launch cache disabled")
def test_cached_launches_match_triton_for_every_specialization() -> None:
    """Fresh random inputs through every specialization Triton makes here (16-byte aligned or not, n equal to
    1, divisible by 16 or neither, stride 1 or not, two dtypes), each launched twice (a miss then a hit) and
    interleaved so that a hit follows a launch of another key: each result equals the float32 reference
    rounded as the kernel rounds, and every cached kernel is one Triton compiled for this function."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    run = _axpy_kernel.run
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 16, 17, 1000, 1024):
            for offset in (0, 1):  # 1: data pointers 4 or 2 bytes past a 16-byte boundary
                for stride in (1, 2):
                    cases.append((dtype, n, offset, stride))
    for _ in range(2):
        for dtype, n, offset, stride in cases:
            base_x = torch.randn(offset + n * stride, device="cuda", generator=gen).to(dtype)
            base_y = torch.randn(offset + n, device="cuda", generator=gen).to(dtype)
            x, y = base_x[offset:], base_y[offset:]
            a = float(torch.rand((), device="cuda", generator=gen)) + 0.5
            got = _axpy(x, y, a, stride)
            ref = (a * x[::stride][:n].float() + y.float()).to(dtype)
            # the kernel may fuse a * x + y into one FMA: a float32 ulp, and so at most a bf16 ulp, apart
            tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}
            case = f"{dtype} n={n} offset={offset} stride={stride}"
            torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{case}: {m}")  # noqa: B023
    assert len(run.kernels) >= 8, list(run.kernels)  # distinct specializations were told apart
    # each miss, and only a miss, was timed as a first launch (compile_log: a compile while serving is logged)
    assert sum(r.kernel == "_axpy_kernel" for r in compile_log.records()) == len(run.kernels)
    dev = torch.cuda.current_device()
    compiled = list(_axpy_kernel.device_caches[dev][0].values())
    assert all(any(k is c for c in compiled) for k in run.kernels.values())


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a GPU")
@pytest.mark.skipif(not launch.launch_cache_enabled(), reason="launch cache disabled")
def test_launch_hooks_take_tritons_own_path() -> None:
    """With a launch hook set (a Triton profiler), launches go through JITFunction.run and the hook sees each."""
    from triton import knobs

    hook = knobs.runtime.launch_enter_hook
    if not hasattr(hook, "add"):
        pytest.skip("this Triton has no launch hook chain")
    seen: list[object] = []

    def record(metadata: object) -> None:
        seen.append(metadata)

    x = torch.randn(100, device="cuda")
    y = torch.randn(100, device="cuda")
    _axpy(x, y, 2.0, 1)  # cached first
    hook.add(record)
    try:
        out = _axpy(x, y, 2.0, 1)
    finally:
        hook.remove(record)
    assert len(seen) == 1
    torch.testing.assert_close(out, 2.0 * x + y)
