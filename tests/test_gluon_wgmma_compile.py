"""The int4 wgmma kernel (kernels/gluon_w4a16_wgmma.py) compiles for Hopper on any machine, offline to sm_90
PTX and cubin, in a child process (the test session runs Triton's interpreter). Its GPU results are checked in
tests/test_gluon_w4a16_wgmma.py on a Hopper GPU.

What each compiled kernel must show: m64nNk16 wgmmas (N = 8 at 1-8 rows of x, 16 at 9-16) with float32
accumulators whose A operand is four registers (the weights decoded by the inline LOP3, lut 0xEA, never staged
in shared memory) and whose B is a shared-memory descriptor; shared memory exactly x's K share and its column
sums (`shared_bytes`); ptxas spilling nothing and not serializing the wgmmas (its C751x advisories: a register
of an in-flight wgmma written or read by other instructions); the words of the first `words_ahead` chunks
loaded before the PDL wait, nothing stored there. The layout of the words is checked at trace time: it must
decode into wgmma's A fragment with no data movement (`_a_fragment`'s convert_layout asserts it), or the kernel
does not compile.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")

from test_gluon_mma_compile import compile_for_hopper, compiled_in_child

# (rows of x, N, K, group, tiles, chunk, split, scales ahead, words ahead, zeros and bias): 16 and 8 columns; chunks
# of 128, 64 and 32 (one word a thread); 1, 2 and 4 tiles a program; scales after their chunk's wgmmas and a chunk
# ahead; words 1-3 chunks ahead; with and without zero points and bias
JOBS = [(16, 4096, 4096, 128, 2, 128, 2, False, 1, True), (4, 5120, 2048, 128, 1, 128, 1, False, 2, True),
        (11, 4096, 12288, 64, 2, 128, 8, False, 3, True), (1, 2048, 2048, 32, 1, 128, 4, False, 1, False),
        (8, 4096, 4096, 128, 4, 64, 4, False, 1, True), (16, 4096, 4096, 128, 2, 128, 2, True, 1, False),
        (16, 24576, 4096, 128, 2, 128, 8, False, 3, True)]  # fmt: skip


def _compile() -> list[dict]:  # in this process, per job: its name, shared bytes and their bound, PTX, ptxas log
    from ftransformers.kernels import gluon_w4a16_wgmma as wg

    out = []
    for m, n, k, group, tiles, kc, split, ahead, words, zeros in JOBS:
        cfg = wg.WgmmaLinearConfig(tiles, kc, split, ahead, words)
        assert wg.fits(m, n, k, group, cfg), (m, n, k, group, cfg)
        consts = wg.constexprs(m, k, group, zeros, zeros, cfg)
        res = compile_for_hopper(wg._w4a16_wgmma_kernel, consts, 4)
        out.append({"name": f"M={m} {n}x{k} g{group} {cfg} zeros {zeros}", "np": consts["NP"], **res,
                    "shared_bytes": wg.shared_bytes(consts["NP"], k // split, consts["KC"]),
                    "first_loads": 2 * tiles * words})  # a thread: a run of words in 2 rows a tile  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_in_child("test_gluon_wgmma_compile")


def test_wgmma_kernel_compiles_for_hopper(kernels: list[dict]) -> None:
    assert len(kernels) == len(JOBS)
    for k in kernels:
        a_in_registers = (rf"wgmma\.mma_async\.sync\.aligned\.m64n{k['np']}k16\.f32\.bf16\.bf16 "
                          r"\{[^}]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd\d+")  # fmt: skip
        assert re.search(a_in_registers, k["ptx"]), k["name"]
        assert re.search(r"lop3\.b32\s+%r\d+, %r\d+, 0x000F000F, %r\d+, 0xEA;", k["ptx"]), k["name"]
        assert k["shared"] == k["shared_bytes"], (k["name"], k["shared"], k["shared_bytes"])
        spilled = re.search(r"\b(\d+) bytes spill stores, (\d+) bytes spill loads", k["ptxas"])
        assert spilled and spilled.groups() == ("0", "0"), (k["name"], k["ptxas"])
        assert "instructions are serialized" not in k["ptxas"], (k["name"], k["ptxas"])  # ptxas's C7510-C7520
        ahead = k["ptx"][: k["ptx"].index("griddepcontrol.wait")]
        assert ahead.count("ld.global") == k["first_loads"], (k["name"], ahead.count("ld.global"))
        assert "st.global" not in ahead and "st.shared" not in ahead, k["name"]


def test_the_engine_takes_the_measured_wins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """w4a16_linear's rule: 9-16 rows of the weights of K <= 4096 and N x K <= 40 Mi (the H200's wins in session
    44), group 128, on a config that fits; no rows at all with ENGINE_MIN_ROWS 0."""
    from test_w4a16_mma_rule import LINEARS

    from ftransformers.kernels import gluon_w4a16_wgmma as wg

    wins = {"qwen3-30b qkv", "qwen3-30b o", "qwen3-8b qkv", "qwen3-8b o", "dsv3 q_b", "dsv3 shared down"}
    for m in range(1, 18):
        taken = {name for name, (n, k) in LINEARS.items() if wg.engine_config(m, n, k, 128) is not None}
        assert taken == (wins if 9 <= m <= 16 else set()), (m, taken)
    for name in wins:
        n, k = LINEARS[name]
        cfgs = [wg.engine_config(m, n, k, 128) for m in range(9, 17)]
        assert all(c is not None and c.tiles == 1 and wg.fits(m, n, k, 128, c) for m, c in zip(range(9, 17), cfgs))
        assert wg.engine_config(16, n, k, 64) is None and wg.engine_config(16, n, k, 256) is not None
    assert wg.engine_config(16, 4096 + 32, 4096, 128) is None  # N not a multiple of 64 rows
    monkeypatch.setattr(wg, "ENGINE_MIN_ROWS", 0)
    assert all(wg.engine_config(m, n, k, 128) is None for n, k in LINEARS.values() for m in range(1, 17))
