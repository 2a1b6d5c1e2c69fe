"""The register-operand int4 kernel (kernels/gluon_w4a16_rs.py) compiles for Hopper on any machine, offline to sm_90
PTX and cubin, in a child process (the test session runs Triton's interpreter). Its GPU results are checked in
tests/test_gluon_w4a16_rs.py on a Hopper GPU.

What each compiled kernel must show: m64nNPk16 wgmmas whose A is a list of registers and B a shared-memory
descriptor; x and the words by two TMA copies a stage with their bytes expected on its barrier; the decode's PRMT and
LOP3 a pair and its packed 16-bit FMAs (one with the scale after each tile, two without); the producer warp's
registers set by setmaxnreg; no spills and no serialised wgmma (ptxas's C751x advisories).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")

from test_gluon_mma_compile import compile_for_hopper, compiled_in_child

# (rows, config, x dtype): the engine's three forms (engine_config: 32, 64 and 128 rows), 8 columns with fp16 x and
# its scale per pair, two warpgroups, and the in-flight form with K tiles of 64
JOBS = [(32, {"regs": 3, "scale_after": True, "stages": 8}, "bf16"), (64, {"regs": 3, "scale_after": True}, "bf16"),
        (128, {"regs": 2, "scale_after": True, "stages": 2}, "bf16"), (1, {"split": 4, "stages": 8}, "fp16"),
        (16, {"warps": 8, "regs": 1, "split": 2}, "bf16"),
        (32, {"bk": 64, "in_flight": 1, "stages": 6}, "bf16")]  # fmt: skip


def _compile() -> list[dict]:  # in this process, per job: its name, config, PTX and ptxas log
    from triton.experimental.gluon import language as gl

    from ftransformers.kernels import gluon_w4a16_rs as rs

    out = []
    for m, fields, dt in JOBS:
        cfg = rs.RsConfig(**fields)
        np_, gdt = rs.columns(m), gl.bfloat16 if dt == "bf16" else gl.float16
        x_l = gl.NVMMASharedLayout.get_default_for([np_, cfg.bk], gdt)
        q_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        types = {"x_desc": f"tensordesc<{dt}[{np_}, {cfg.bk}],{x_l!r}>", "y_ptr": f"*{dt}", "bias_ptr": f"*{dt}",
                 "q_desc": f"tensordesc<i32[{cfg.rows()}, {cfg.bk // 8}],{q_l!r}>", "part_ptr": "*fp32",
                 "cnt_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8"}  # fmt: skip
        res = compile_for_hopper(rs._w4a16_rs_kernel, rs.constexprs(m, 128, True, True, cfg), cfg.warps,
                                 rs.maxnreg(cfg), types)  # fmt: skip
        out.append({"name": f"M={m} {cfg} {dt}", "np": np_, "dt": dt, "after": cfg.scale_after,
                    "split": cfg.split, **res})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_in_child("test_gluon_rs_compile")


def test_rs_kernel_compiles_for_hopper(kernels: list[dict]) -> None:
    assert len(kernels) == len(JOBS)
    for k in kernels:
        ptx, log, name = k["ptx"], k["ptxas"], k["name"]
        t = "bf16" if k["dt"] == "bf16" else "f16"
        a_in_registers = (
            rf"wgmma\.mma_async\.sync\.aligned\.m64n{k['np']}k16\.f32\.{t}\.{t} \{{[^}}]*\}}, \{{[^}}]*\}}, %rd"
        )
        assert re.search(a_in_registers, ptx), name
        assert ptx.count("cp.async.bulk.tensor.2d") >= 2 and "mbarrier.arrive.expect_tx" in ptx, name
        assert re.search(r"prmt\.b32 p, \S+, s, \S+; lop3\.b32 p, p, 0x000F000F, \S+, 0xEA;", ptx), name
        fma = "fma.rn.bf16x2" if k["dt"] == "bf16" else "fma.rn.f16x2"
        pair = re.search(r"lop3\.b32 p, p, 0x000F000F, \S+, 0xEA;\s*(.*?)\}", ptx, re.DOTALL)
        assert pair and pair.group(1).count(fma) == (1 if k["after"] else 2), name
        assert re.search(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+40;", ptx), name  # the producer warp's
        spilled = re.search(r"\b(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert spilled and max(map(int, spilled.groups())) == 0, (name, log)
        assert not re.search(r"C751\d", log), (name, log)
        assert ("atom.global.gpu.acq_rel.add.u32" in ptx) == (k["split"] > 1), name
