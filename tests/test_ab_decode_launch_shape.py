"""benchmarks/ab_decode.py's launch census: a kernel event's launch (CUPTI's grid, block, registers a thread and
shared memory, as torch.profiler's trace gives them) read as programs an SM and what a full SM leaves to others."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("ab_decode", Path(__file__).parents[1] / "benchmarks" / "ab_decode.py")
ab_decode = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ab_decode)


def test_launch_shape_counts_programs_an_sm_and_what_they_leave() -> None:
    # the few-heads MLA stage 1 at 248 and at 152 registers: one program an SM either way (its shared memory), but
    # 248 x 256 threads take 62K of the 64K registers and 152 leave 26K
    big = {"grid": [1, 128, 1], "block": [256, 1, 1], "registers per thread": 248, "shared memory": 184868}
    s = ab_decode.launch_shape(big)
    assert s["programs"] == 128 and s["threads"] == 256
    assert s["per_sm"] == {"regs": 1, "threads": 8, "smem": 1}
    assert s["left"] == {"regs": 65536 - 8 * 31 * 256, "smem": 227 * 1024 - 184868}
    small = ab_decode.launch_shape({**big, "registers per thread": 152})
    assert small["per_sm"]["regs"] == 1 and small["left"]["regs"] == 65536 - 8 * 19 * 256
    # registers are handed out 256 to a warp: 70 a thread count as 72; no shared memory bounds nothing
    gemv = ab_decode.launch_shape({"grid": [512, 1, 1], "block": [128, 1, 1], "registers per thread": 70})
    assert gemv["per_sm"] == {"regs": 65536 // (4 * 9 * 256), "threads": 16, "smem": 32}
    assert gemv["left"]["regs"] == 65536 - 7 * 4 * 9 * 256
    assert ab_decode.launch_shape({"grid": [1, 1, 1]}) is None  # a trace without the launch fields


def test_launch_text_is_the_timeline_bracket() -> None:
    small = ab_decode.launch_shape({"grid": [1, 128, 1], "block": [256, 1, 1], "registers per thread": 152,
                                    "shared memory": 184868})  # fmt: skip
    want = " [128 x 256 thr, 152 regs, 181 KB; an SM holds 1, by regs 1, threads 8, smem 1; left 26K regs, 46 KB]"
    assert ab_decode.launch_text(small) == want
    assert ab_decode.launch_text(None) == ""
