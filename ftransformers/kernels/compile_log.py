"""Triton's JIT compiles, timed and named, through its `jit_cache_hook` / `jit_post_compile_hook` knobs.

A kernel compiles the first time it meets a new specialization (its constexprs, and Triton's own: an integer
argument equal to 1 or divisible by 16, a pointer's alignment). Before the server says ready, compiles are the
start's cost and are only counted. After it, a compile holds up the step that needed it, and every request in that
step waits: on an H200, first requests of a fresh Qwen3-30B-A3B server waited up to 2.6 s. So `mark_ready` switches
to one WARNING line a compile, naming the kernel and its seconds, which says what the start's warmup missed.

The hooks chain to any set before `install` and never stop a compile (they return None to Triton's cache hook).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class CompileRecord:
    kernel: str
    seconds: float
    after_ready: bool


@dataclass
class _State:
    installed: bool = False
    ready: bool = False
    pending: dict[Any, float] = field(default_factory=dict)  # Triton's compile key -> perf_counter at its start
    records: list[CompileRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def _kernel_name(kwargs: dict[str, Any]) -> str:
    fn = kwargs.get("fn")
    return str(getattr(fn, "name", None) or getattr(fn, "__name__", None) or kwargs.get("repr", "?")).split("[")[0]


def install() -> bool:
    """Hook Triton's compiles (once a process); False where Triton or its knobs are missing."""
    if _STATE.installed:
        return True
    try:
        from triton import knobs

        runtime = knobs.runtime
        prev_pre, prev_post = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def pre(**kwargs: Any) -> Any:
        if prev_pre is not None and (answer := prev_pre(**kwargs)):
            return answer
        with _STATE.lock:
            _STATE.pending[kwargs.get("key")] = time.perf_counter()
        return None

    def post(**kwargs: Any) -> Any:
        with _STATE.lock:
            start = _STATE.pending.pop(kwargs.get("key"), None)
            rec = CompileRecord(_kernel_name(kwargs), time.perf_counter() - start if start else 0.0, _STATE.ready)
            _STATE.records.append(rec)
        if rec.after_ready:
            logger.warning("Triton compiled %s in %.2f s while serving: the step that needed it waited",
                           rec.kernel, rec.seconds)  # fmt: skip
        return prev_post(**kwargs) if prev_post is not None else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = pre, post
    _STATE.installed = True
    return True


def mark_ready() -> None:
    """From here on a compile is logged as a stall; logs how many the start made."""
    with _STATE.lock:
        _STATE.ready = True
        n, secs = len(_STATE.records), sum(r.seconds for r in _STATE.records)
    if _STATE.installed:
        logger.info("Triton kernels compiled before ready: %d (%.1f s)", n, secs)


def records() -> list[CompileRecord]:
    with _STATE.lock:
        return list(_STATE.records)


def reset() -> None:
    """Forget the records and the ready mark (tests); the hooks stay installed."""
    with _STATE.lock:
        _STATE.ready = False
        _STATE.pending.clear()
        _STATE.records.clear()
