"""kernels/cluster.py's host side on any machine: cluster_launch over launch.py's _CachedRun with a stand-in
kernel (no GPU): one compile per specialization, the launch metadata asking for the cluster and the scratch past
Triton's shared memory, the >48 KiB opt-in, and the sizes Triton's launcher cannot take. The clustered kernels
themselves run in tests/test_triton_attention.py and tests/test_triton_rope_store.py on a Hopper GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ftransformers.kernels import cluster
from ftransformers.kernels.launch import _CachedRun


class _Kernel:  # a compiled kernel: what cluster_launch reads of it, and its launches
    def __init__(self, shared: int) -> None:
        self.metadata = SimpleNamespace(shared=shared, num_warps=4)
        self.function = 0xF00
        self.launches: list[tuple[Any, ...]] = []

    def _init_handles(self) -> None:
        pass

    def run(self, *args: Any) -> None:
        self.launches.append(args)


class _Fn:  # a JITFunction: Triton's run (compiles on warmup) and its per-device caches with the binder
    def __init__(self, shared: int, binder: Any = None) -> None:
        self.kernel = _Kernel(shared)
        self.compiles = 0
        self.used_global_vals: dict[Any, Any] = {}
        self.__name__ = "k"
        bind = binder or (lambda x, n, smem_off, BLOCK: ({"x": x, "n": n, "smem_off": smem_off, "BLOCK": BLOCK},
                                                          ["D", "i32"], {"num_warps": 4}))  # fmt: skip
        self.device_caches = {0: (None, None, None, None, bind)}

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> _Kernel:
        assert warmup, "cluster_launch must compile without launching"
        self.compiles += 1
        return self.kernel


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    opted: list[tuple[int, int]] = []
    monkeypatch.setattr(cluster, "_opt_in", lambda function, shared: opted.append((function, shared)))
    return opted


def _launch(fn: _Fn, size: int, scratch: int, n: int = 5) -> None:
    cluster.cluster_launch(fn, (3, 1, 2), size, scratch, "x", n, smem_off=0, BLOCK=64)


def test_cluster_launch_compiles_once_and_asks_for_the_cluster(fake_cuda: list[tuple[int, int]]) -> None:
    fn = _Fn(shared=38900)
    fn.run = _CachedRun(fn)  # as @cached_launch installs it
    _launch(fn, 16, 8320)
    _launch(fn, 16, 8320, n=6)
    assert fn.compiles == 1  # the second launch found the kernel by its specialization
    assert len(fn.kernel.launches) == 2 and not fake_cuda  # 38912 + 8320 bytes: no opt-in
    for launch, n in zip(fn.kernel.launches, (5, 6), strict=True):
        grid, stream, function, meta, params = launch[:3], launch[3], launch[4], launch[5], launch[9:]
        assert grid == (3, 1, 2) and stream == 77 and function == 0xF00
        assert meta == (4, 16, 38912 + 8320)  # (warps, cluster size, dynamic shared bytes)
        assert params == ("x", n, 38912, 64)  # smem_off: Triton's shared bytes rounded up to 16
    _launch(fn, 8, 8320)  # another cluster size is another entry
    assert fn.compiles == 2 and fn.kernel.launches[-1][5] == (4, 8, 38912 + 8320)


def test_cluster_launch_opts_in_past_48k_and_refuses_sizes_9_to_15(fake_cuda: list[tuple[int, int]]) -> None:
    fn = _Fn(shared=80000)
    fn.run = _CachedRun(fn)
    _launch(fn, 16, 8320)
    _launch(fn, 16, 8320)
    assert fake_cuda == [(0xF00, 80000 + 8320)]  # once, when the kernel was first found
    for size in (9, 12, 15, 17):
        with pytest.raises(AssertionError, match="1-8 or 16"):
            _launch(fn, size, 8320)
    other = _Fn(shared=0)
    other.run = _CachedRun(other)
    other.device_caches = {0: ("a Triton whose caches hold something else",)}
    with pytest.raises(RuntimeError, match="binder"):
        _launch(other, 4, 64)
