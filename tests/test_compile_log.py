"""kernels/compile_log.py: Triton's compile hooks, called here as Triton's JITFunction calls them (keyword arguments,
the cache hook before a compile and the post-compile hook after it; a CPU cannot compile a Triton kernel). Compiles
before `mark_ready` are counted quietly, each one after it is a WARNING naming the kernel, and hooks set before
`install` still run."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def fresh_hooks() -> Iterator[list[str]]:
    from ftransformers.kernels import compile_log

    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, compile_log._STATE
    calls: list[str] = []
    knobs.runtime.jit_cache_hook = lambda **kw: calls.append(f"pre {kw['key']}")
    knobs.runtime.jit_post_compile_hook = lambda **kw: calls.append(f"post {kw['key']}")
    compile_log._STATE = compile_log._State()
    try:
        yield calls
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook, compile_log._STATE = saved


def _compile(key: Any, name: str, seconds: float = 0.0) -> Any:
    fn = SimpleNamespace(name=name, module="ftransformers.kernels.x")
    answer = knobs.runtime.jit_cache_hook(key=key, repr=f"{name}[num_warps=4]()", fn=fn, compile={},
                                          is_manual_warmup=False, already_compiled=False)  # fmt: skip
    time.sleep(seconds)
    knobs.runtime.jit_post_compile_hook(key=key, repr=f"{name}[num_warps=4]()", fn=fn, compile={},
                                        is_manual_warmup=False, already_compiled=False)  # fmt: skip
    return answer


def test_compiles_before_ready_are_counted_and_after_it_logged(
    fresh_hooks: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    from ftransformers.kernels import compile_log

    assert compile_log.install() and compile_log.install()  # once a process: the second call changes nothing
    caplog.set_level(logging.INFO, logger=compile_log.__name__)
    assert _compile(("k", 1), "_rmsnorm_kernel") is None  # None: Triton goes on to compile
    compile_log.mark_ready()
    assert "compiled before ready: 1" in caplog.text and "while serving" not in caplog.text
    _compile(("k", 2), "_extend_attention_kernel", seconds=0.02)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "_extend_attention_kernel" in warnings[0].getMessage()
    recs = compile_log.records()
    assert [(r.kernel, r.after_ready) for r in recs] == [("_rmsnorm_kernel", False), ("_extend_attention_kernel", True)]
    assert recs[1].seconds >= 0.02 > recs[0].seconds
    # the hooks set before install ran too, in Triton's order
    assert fresh_hooks == ["pre ('k', 1)", "post ('k', 1)", "pre ('k', 2)", "post ('k', 2)"]


def test_a_chained_cache_hook_that_skips_the_compile_is_obeyed(fresh_hooks: list[str]) -> None:
    from ftransformers.kernels import compile_log

    knobs.runtime.jit_cache_hook = lambda **kw: True  # e.g. a tool that only collects signatures
    compile_log.install()
    assert _compile(("k", 3), "_any_kernel") is True
