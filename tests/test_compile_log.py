"""kernels/compile_log.py: a first launch of a kernel specialization before `mark_ready` is counted quietly; after it,
one that took `MIN_LOGGED_S` or more (a Triton compile) is a WARNING naming the kernel and its seconds, and a fast
one (Triton's in-memory cache) is not logged. The launch cache's misses feed it on a GPU
(tests/test_launch_cache.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from ftransformers.kernels import compile_log


@pytest.fixture
def fresh_state() -> Iterator[None]:
    saved = compile_log._STATE
    compile_log._STATE = compile_log._State()
    try:
        yield
    finally:
        compile_log._STATE = saved


def test_first_launches_before_ready_are_counted_and_after_it_logged(
    fresh_state: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=compile_log.__name__)
    compile_log.record("_rmsnorm_kernel", 0.8)
    compile_log.record("_rmsnorm_kernel", 0.0001)  # another specialization, found in Triton's memory
    compile_log.mark_ready()
    assert "before ready: 1 (0.8 s)" in caplog.text and "while serving" not in caplog.text
    compile_log.record("_extend_kernel", 1.29)
    compile_log.record("_sample_kernel", compile_log.MIN_LOGGED_S / 2)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "_extend_kernel specialization took 1.29 s while serving" in warnings[0]
    assert [(r.kernel, r.after_ready) for r in compile_log.records()] == [
        ("_rmsnorm_kernel", False), ("_rmsnorm_kernel", False), ("_extend_kernel", True), ("_sample_kernel", True)
    ]  # fmt: skip
    compile_log.reset()
    assert compile_log.records() == [] and not compile_log._STATE.ready
