"""The int4 kernel whose words are streamed by TMA (kernels/gluon_w4a16_tma.py) compiles for Hopper on any machine,
offline to sm_90 PTX and cubin, in a child process (the test session runs Triton's interpreter). Its GPU results
are checked in tests/test_gluon_w4a16_tma.py on a Hopper GPU.

What each compiled kernel must show: the words arriving by TMA (cp.async.bulk.tensor into shared memory on an
mbarrier), the first boxes requested before the PDL wait and nothing stored to global memory there; each thread
reading its words of a slot as 16-byte shared loads where a chunk gives it four words (chunks of 128); m64nNk16
wgmmas (N = 8 at 1-8 rows of x, 16 at 9-16) whose A operand is four registers decoded by the inline LOP3 (lut
0xEA) and whose B is a shared-memory descriptor; shared memory exactly `shared_bytes`; ptxas spilling nothing and
not serializing the wgmmas (its C751x advisories).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")

from test_gluon_mma_compile import _sig, compiled_in_child

# (rows of x, N, K, group, tiles, chunk, split, stages, zeros and bias): 16, 11, 8 and 1 rows; one and two tiles;
# chunks of 128, 64 and 32 (one word a thread); 2-8 stages, fewer chunks than stages; unsplit and split; x one
# chunk ahead (even splits) and two (odd); halves of a chunk at 9-16 rows where chunks are 128
JOBS = [(16, 24576, 4096, 128, 2, 128, 2, 4, True), (11, 4096, 12288, 128, 1, 128, 8, 6, True),
        (8, 7168, 16384, 128, 2, 128, 8, 8, False), (1, 2048, 2048, 64, 1, 64, 4, 3, True),
        (16, 1024, 1024, 32, 2, 32, 1, 2, False), (16, 1024, 256, 128, 1, 128, 1, 4, True)]  # fmt: skip


def _compile() -> list[dict]:  # in this process, per job: its name, N, shared bytes and their count, PTX, ptxas log
    import tempfile
    from pathlib import Path
    from subprocess import run

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    from ftransformers.kernels import gluon_w4a16_tma as tm

    out = []
    for m, n, k, group, tiles, kc, split, stages, zeros in JOBS:
        cfg = tm.TmaLinearConfig(tiles, kc, split, stages, x_ahead=1 + split % 2, halves=kc == 128 and m > 8)
        assert tm.fits(m, n, k, group, cfg), (m, n, k, group, cfg)
        consts = tm.constexprs(m, k, group, zeros, zeros, cfg)
        sig, attrs = _sig(tm._w4a16_tma_kernel, consts)
        sig["desc"] = f"tensordesc<i32[{cfg.rows()}, {kc // 8}],{tm.ring_layout()!r}>"
        src = GluonASTSource(tm._w4a16_tma_kernel, sig, constexprs={**consts, "USE_PDL": True}, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
            cmd = [get_ptxas(90).path, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"]
            log = run(cmd, capture_output=True, text=True, check=True).stderr
        out.append({"name": f"M={m} {n}x{k} g{group} {cfg} zeros {zeros}", "np": consts["NP"], "kc": kc,
                    "shared": kernel.metadata.shared, "shared_bytes": tm.shared_bytes(m, k, group, cfg),
                    "ptx": kernel.asm["ptx"], "ptxas": log})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_in_child("test_gluon_tma_compile")


def test_tma_kernel_compiles_for_hopper(kernels: list[dict]) -> None:
    assert len(kernels) == len(JOBS)
    for k in kernels:
        ptx, name = k["ptx"], k["name"]
        a_in_registers = (rf"wgmma\.mma_async\.sync\.aligned\.m64n{k['np']}k16\.f32\.bf16\.bf16 "
                          r"\{[^}]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}, %rd\d+")  # fmt: skip
        assert re.search(a_in_registers, ptx), name
        assert re.search(r"lop3\.b32\s+%r\d+, %r\d+, 0x000F000F, %r\d+, 0xEA;", ptx), name
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::(cta|cluster)\.global\.mbarrier", ptx), name
        ahead = ptx[: ptx.index("griddepcontrol.wait")]
        assert "cp.async.bulk.tensor" in ahead and "st.global" not in ahead, name
        if k["kc"] == 128:  # a thread's four words of a row: one 16-byte shared load
            assert re.search(r"ld\.shared\.v4\.b32", ptx), name
        assert k["shared"] == k["shared_bytes"], (name, k["shared"], k["shared_bytes"])
        spilled = re.search(r"\b(\d+) bytes spill stores, (\d+) bytes spill loads", k["ptxas"])
        assert spilled and max(map(int, spilled.groups())) == 0, (name, k["ptxas"])
        assert not re.search(r"C751\d", k["ptxas"]), (name, k["ptxas"])


def test_the_engine_takes_the_measured_wins_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """w4a16_linear's rule for this kernel: 9-16 rows of the weights of N >= 16384 and K <= 4096 (the H200's wins in
    session 59: Qwen3-8B gate_up, DeepSeek-V3 q_b), group a multiple of 128, two tiles, three stages and halves, on
    a config that fits; no rows at all with ENGINE_MIN_ROWS 0."""
    from test_w4a16_mma_rule import LINEARS

    from ftransformers.kernels import gluon_w4a16_tma as tm

    wins = {"qwen3-8b gate_up", "dsv3 q_b"}
    for m in range(1, 18):
        taken = {name for name, (n, k) in LINEARS.items() if tm.engine_config(m, n, k, 128) is not None}
        assert taken == (wins if 9 <= m <= 16 else set()), (m, taken)
    for name in wins:
        n, k = LINEARS[name]
        for m in range(9, 17):
            cfg = tm.engine_config(m, n, k, 128)
            assert cfg is not None and (cfg.tiles, cfg.stages, cfg.halves) == (2, 3, True), (name, m, cfg)
            assert tm.fits(m, n, k, 128, cfg), (name, m, cfg)
        assert tm.engine_config(16, n, k, 64) is None and tm.engine_config(16, n, k, 256) is not None
    monkeypatch.setattr(tm, "ENGINE_MIN_ROWS", 0)
    assert all(tm.engine_config(m, n, k, 128) is None for n, k in LINEARS.values() for m in range(1, 17))
