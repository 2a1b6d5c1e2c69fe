"""First launches of a kernel specialization, timed and named: where Triton compiles (or loads from its disk cache)
while a server is already answering requests.

A Triton kernel compiles the first time it meets a new specialization: its constexprs, and Triton's own (an integer
argument equal to 1 or divisible by 16, a pointer's alignment). `launch.cached_launch` sees each one as a miss of its
table and times it here (`record`). Before the server says ready these are the start's cost and are only counted.
After `mark_ready` a first launch holds up the step that needed it, and every request in that step waits: on an
H200, first requests of a fresh Qwen3-30B-A3B server waited up to 2.6 s, one compile after another. So each one
of `MIN_LOGGED_S` or more is then a WARNING line naming the kernel, which says what the start's warmup missed.

Not through Triton's `jit_cache_hook` / `jit_post_compile_hook`: with a hook set, Triton 3.6 serializes every
compile's constexprs to JSON, and a Gluon kernel's layout constexprs are not serializable (its compile raised).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

MIN_LOGGED_S = 0.01  # a first launch Triton answers from its in-memory cache takes microseconds; a compile, seconds


@dataclass
class CompileRecord:
    kernel: str
    seconds: float  # the first launch's host time: compile (or disk-cache load), module load, launch
    after_ready: bool


@dataclass
class _State:
    ready: bool = False
    records: list[CompileRecord] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_STATE = _State()


def record(kernel: str, seconds: float) -> None:
    """One first launch of a specialization of `kernel`, which took `seconds` on the host."""
    with _STATE.lock:
        rec = CompileRecord(kernel, seconds, _STATE.ready)
        _STATE.records.append(rec)
    if rec.after_ready and seconds >= MIN_LOGGED_S:
        logger.warning("first launch of a new %s specialization took %.2f s while serving (a Triton compile): "
                       "the step that needed it waited", kernel, seconds)  # fmt: skip


def mark_ready() -> None:
    """From here on a slow first launch is logged as a stall; logs what the start compiled."""
    with _STATE.lock:
        _STATE.ready = True
        slow = [r for r in _STATE.records if r.seconds >= MIN_LOGGED_S]
    if slow:
        logger.info("kernel specializations compiled or loaded before ready: %d (%.1f s)", len(slow),
                    sum(r.seconds for r in slow))  # fmt: skip


def records() -> list[CompileRecord]:
    with _STATE.lock:
        return list(_STATE.records)


def reset() -> None:
    """Forget the records and the ready mark (tests)."""
    with _STATE.lock:
        _STATE.ready = False
        _STATE.records.clear()
