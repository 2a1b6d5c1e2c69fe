"""The int4 wgmma prototype (kernels/gluon_w4a16_wgmma.py) compiles for Hopper on any machine, offline to sm_90
PTX and cubin, in a child process (the test session runs Triton's interpreter). Its GPU results are checked in
tests/test_gluon_w4a16_wgmma.py on a Hopper GPU.

What each compiled kernel must show: m64nNk16 wgmmas (N = 8 at 1-8 rows of x, 16 at 9-16) with float32
accumulators whose A operand is four registers (the weights decoded by the inline LOP3, lut 0xEA, never staged
in shared memory) and whose B is a shared-memory descriptor; shared memory exactly x's K share and its column
sums (`shared_bytes`); ptxas spilling nothing and not serializing the wgmmas (its C751x advisories: a register
of an in-flight wgmma written or read by other instructions); the first chunk's words loaded ahead of the PDL
wait, nothing stored there. The layout of the words is checked at trace time: it must decode into wgmma's A
fragment with no data movement (`_a_fragment`'s convert_layout asserts it), or the kernel does not compile.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")

from test_gluon_mma_compile import compile_for_hopper, compiled_in_child

# (rows of x, N, K, group, tiles, chunk, split, scales ahead, zeros and bias): 16 and 8 columns; chunks of 128, 64
# and 32 (one word a thread); 1, 2 and 4 tiles a program; scales after their chunk's wgmmas and a chunk ahead; with
# and without zero points and bias
JOBS = [(16, 4096, 4096, 128, 2, 128, 2, False, True), (4, 5120, 2048, 128, 1, 128, 1, False, True),
        (11, 4096, 12288, 64, 2, 128, 8, False, True), (1, 2048, 2048, 32, 1, 128, 4, False, False),
        (8, 4096, 4096, 128, 4, 64, 4, False, True), (16, 4096, 4096, 128, 2, 128, 2, True, False)]  # fmt: skip


def _compile() -> list[dict]:  # in this process, per job: its name, shared bytes and their bound, PTX, ptxas log
    from ftransformers.kernels import gluon_w4a16_wgmma as wg

    out = []
    for m, n, k, group, tiles, kc, split, ahead, zeros in JOBS:
        cfg = wg.WgmmaLinearConfig(tiles, kc, split, ahead)
        assert wg.fits(m, n, k, group, cfg), (m, n, k, group, cfg)
        consts = wg.constexprs(m, k, group, zeros, zeros, cfg)
        res = compile_for_hopper(wg._w4a16_wgmma_kernel, consts, 4)
        out.append({"name": f"M={m} {n}x{k} g{group} {cfg} zeros {zeros}", "np": consts["NP"], **res,
                    "shared_bytes": wg.shared_bytes(consts["NP"], k // split, consts["KC"])})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_in_child("test_gluon_wgmma_compile")


def test_wgmma_prototype_compiles_for_hopper(kernels: list[dict]) -> None:
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
        assert "ld.global" in ahead and "st.global" not in ahead and "st.shared" not in ahead, k["name"]


def test_the_engine_takes_it_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """w4a16_linear's opt-in: no rows while ENGINE_MIN_ROWS is 0 (the default: the kernel is unmeasured), then
    ENGINE_MIN_ROWS to 16 rows on a config that fits, and no shape it cannot take."""
    from ftransformers.kernels import gluon_w4a16_wgmma as wg

    assert wg.ENGINE_MIN_ROWS == 0
    assert all(wg.engine_config(m, 4096, 4096, 128) is None for m in range(1, 17))
    monkeypatch.setattr(wg, "ENGINE_MIN_ROWS", 9)
    taken = {m: wg.engine_config(m, 4096, 12288, 128) for m in range(1, 18)}  # Qwen3-8B down
    assert [m for m, cfg in taken.items() if cfg is not None] == list(range(9, 17))
    assert all(wg.fits(m, 4096, 12288, 128, cfg) for m, cfg in taken.items() if cfg is not None)
    assert wg.engine_config(16, 4096 + 32, 4096, 128) is None  # N not a multiple of 64 rows
