"""The warp-specialised int4 kernel (kernels/gluon_w4a16_ws.py) compiles for Hopper on any machine, offline to sm_90
PTX and cubin, in a child process (the test session runs Triton's interpreter). Its GPU results are checked in
tests/test_gluon_w4a16_ws.py on a Hopper GPU.

What each compiled kernel must show: m64nBNk16 wgmmas whose A and B are both shared-memory descriptors, one tile's
left in flight (`wgmma.wait_group 1`); x by 16-byte cp.async arriving on an mbarrier (noinc); the producer's
decode (the LOP3 of the codes kernel's decoded form and its packed 16-bit FMAs); the partitions' registers set by
setmaxnreg to the config's producer count; ptxas spilling nothing and not serialising the wgmmas (its C751x
advisories); shared memory within what the config says it takes plus barriers.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")

from test_gluon_mma_compile import compile_for_hopper, compiled_in_child

# (BM, BN, BK, stages, producer registers, zeros and bias, x dtype): the default, its 2-stage ring, 128 columns on
# 4 and 5 stages, fp16 x
JOBS = [(128, 256, 64, 3, 152, True, "bf16"), (128, 256, 64, 2, 152, False, "bf16"),
        (128, 128, 64, 4, 128, True, "bf16"), (128, 128, 64, 5, 128, False, "fp16")]  # fmt: skip


def _compile() -> list[dict]:  # in this process, per job: its name, config, PTX and ptxas log
    from ftransformers.kernels import gluon_w4a16_ws as ws

    out = []
    for bm, bn, bk, stages, regs, zb, dt in JOBS:
        cfg = ws.WsConfig(bm, bn, bk, stages, producer_regs=regs)
        types = {"x_ptr": f"*{dt}", "y_ptr": f"*{dt}", "b_ptr": f"*{dt}"}
        res = compile_for_hopper(ws._w4a16_ws_kernel, ws.constexprs(128, zb, zb, cfg), ws.CONSUMER_WARPS,
                                 ws.maxnreg(cfg), types)  # fmt: skip
        out.append({"name": f"{cfg} zeros/bias {zb} {dt}", "bn": bn, "regs": regs, "dt": dt,
                    "bytes": cfg.shared_bytes(), **res})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_in_child("test_gluon_ws_compile")


def test_ws_kernel_compiles_for_hopper(kernels: list[dict]) -> None:
    assert len(kernels) == len(JOBS)
    for k in kernels:
        ptx, log, name = k["ptx"], k["ptxas"], k["name"]
        t = "bf16" if k["dt"] == "bf16" else "f16"
        both_shared = rf"wgmma\.mma_async\.sync\.aligned\.m64n{k['bn']}k16\.f32\.{t}\.{t} \{{[^}}]*\}}, %rd\d+, %rd\d+"
        assert re.search(both_shared, ptx), name
        assert "wgmma.wait_group.sync.aligned 1;" in ptx, name
        assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx and "cp.async.cg.shared.global" in ptx, name
        fma = "fma.rn.bf16x2" if k["dt"] == "bf16" else "fma.rn.f16x2"
        assert re.search(r"lop3\.b32\s+\S+, \S+, 0x000F000F, \S+, 0xEA;", ptx) and fma in ptx, name
        assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{k['regs']};", ptx), name
        spilled = re.search(r"\b(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        assert spilled and spilled.groups() == ("0", "0"), (name, log)
        assert not re.search(r"C751\d", log), (name, log)
        assert k["bytes"] <= k["shared"] <= k["bytes"] + 1024, (name, k["shared"])
