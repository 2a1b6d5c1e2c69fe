"""The host side of kernel launches: Triton launches without most of Triton's per-call Python, and integer
helpers for launch arithmetic.

An eager step is bound by the host where its kernels are short: a 1K-token prefill of Qwen3-30B-A3B on an
H200 ran 56 ms against 28 ms of kernels (592 launches), an eager batch-1 decode 63 ms against 2.8
(benchmarks/profile_host.py, docs/performance.md). Per Triton launch, `JITFunction.run` spends most of its
time outside the specialization it must do: reading Triton's knobs (debug settings from the environment), a
string of the launch options for the cache key, building launch metadata for hooks nobody set, and more; and
in Triton 3.6 `triton.cdiv` / `triton.next_power_of_2` are constexpr functions whose host calls unwrap every
argument. With the table below, that prefill ran at its kernels' time (28.8 ms, in-process A/B).

`cached_launch` (a decorator over `@triton.jit` / `@gluon.jit` of a kernel launched from the host) keeps
Triton's binder, so the specialization of every argument (dtype, 16-byte alignment, integers equal to 1 or
divisible by 16, constexpr values) is computed exactly as Triton does, and keys its own table of compiled
kernels on that specialization, the launch options and the device. A hit launches the compiled kernel
through its launcher directly; a miss, a warmup, a kernel with pre-run hooks or launch hooks set (a Triton
profiler) takes `JITFunction.run` unchanged. Invariant: a key maps to the kernel `JITFunction.run` compiled
for the same specialization and options, so a hit launches what Triton would have.

Not used under TRITON_INTERPRET=1 (the CPU interpreter has its own `run`), nor with
FTRANSFORMERS_DISABLE_LAUNCH_CACHE=1 (`set_launch_cache(False)` turns it off in a running process). Triton's
debug setting is read when the kernel is first launched with a key, not on each hit.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, TypeVar

import torch

from ftransformers.kernels import compile_log

try:
    from triton import knobs as _knobs
    from triton.runtime.jit import JITFunction
except ImportError:  # pragma: no cover - a Triton without these internals: no cache, plain launches
    JITFunction = None  # type: ignore[assignment,misc]

F = TypeVar("F")
_ENABLED = (
    JITFunction is not None
    and os.environ.get("TRITON_INTERPRET") != "1"
    and os.environ.get("FTRANSFORMERS_DISABLE_LAUNCH_CACHE", "0") in ("", "0")
)
_on = True  # set_launch_cache: off sends every launch through JITFunction.run (in-process A/B)
_MISSING = object()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host launch arithmetic (a plain function: triton.cdiv is a constexpr function)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def maxnreg_option(cap: int) -> dict[str, int]:
    """The launch option capping the registers a thread ptxas may use (`**maxnreg_option(cap)`); none for 0."""
    return {"maxnreg": cap} if cap else {}


class _CachedRun:
    """Replaces `fn.run` (an instance attribute over JITFunction.run; `fn[grid](...)` calls it)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.triton_run = functools.partial(type(fn).run, fn)
        self.kernels: dict[tuple[Any, ...], Any] = {}
        self.binders: dict[int, Any] = {}  # device -> Triton's argument binder for fn, False: not one we know
        # kernels/cluster.py's launches: (key, cluster size, scratch bytes) -> (kernel, scratch offset, shared bytes)
        self.cluster_kernels: dict[tuple[Any, ...], tuple[Any, int, int]] = {}

    def binder(self, device: int) -> Any:
        """Triton's argument binder of fn on `device`: bound params, specialization and options of a call; False
        where Triton's caches have another layout (then only Triton's own path can launch fn)."""
        binder = self.binders.get(device)
        if binder is None:
            caches = self.fn.device_caches[device]
            # Triton 3.6-3.9: (kernel cache, key cache, target, backend, binder)
            binder = self.binders[device] = caches[4] if isinstance(caches, tuple) and len(caches) == 5 else False
        return binder

    def check_globals(self) -> None:
        """What JITFunction.run checks before a launch: no global the kernel read has changed since it compiled."""
        for (name, _), (val, globals_dict) in self.fn.used_global_vals.items():
            if globals_dict.get(name, _MISSING) != val:
                raise RuntimeError(f"Global variable {name} has changed since {self.fn.__name__} was compiled")

    def __call__(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        fn = self.fn
        # launch hooks: Triton 3.6 holds them as a HookChain (its `calls` list), older ones as None or a callable
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        hooks = (enter is not None and getattr(enter, "calls", True)) or (
            leave is not None and getattr(leave, "calls", True)
        )
        if not _on or warmup or fn.pre_run_hooks or hooks:
            return self.triton_run(*args, grid=grid, warmup=warmup, **kwargs)
        device = torch._C._cuda_getDevice()  # what Triton's CUDA driver reads (torch.cuda.current_device)
        binder = self.binder(device)
        if binder is False:
            return self.triton_run(*args, grid=grid, warmup=False, **kwargs)
        bound, specialization, options = binder(*args, **kwargs)  # (params dict, specialization list, options)
        key = (device, tuple(specialization), tuple(options.items()))
        kernel = self.kernels.get(key)
        if kernel is None:  # compile (or find) and launch through Triton, then remember what it ran
            t0 = time.perf_counter()
            kernel = self.triton_run(*args, grid=grid, warmup=False, **kwargs)
            compile_log.record(getattr(fn, "__name__", "kernel"), time.perf_counter() - t0)
            if kernel is not None:
                self.kernels[key] = kernel
            return kernel
        self.check_globals()
        if callable(grid):
            grid = grid(bound)
        n = len(grid)
        stream = torch._C._cuda_getCurrentRawStream(device)
        kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
                   kernel.packed_metadata, None, None, None, *bound.values())  # fmt: skip
        return kernel


def cached_launch(fn: F) -> F:
    """Decorator for a Triton / Gluon kernel launched from the host (above its @triton.jit / @gluon.jit);
    returns `fn` itself, with launches through the table above where it applies."""
    if _ENABLED and isinstance(fn, JITFunction):
        fn.run = _CachedRun(fn)  # type: ignore[attr-defined]
    return fn


def launch_cache_enabled() -> bool:
    return _ENABLED and _on


def set_launch_cache(enabled: bool) -> None:
    """Turn the cached launches off (every launch through JITFunction.run) or back on, from now on."""
    global _on
    _on = bool(enabled)
