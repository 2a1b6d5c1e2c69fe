"""The one-launch int4 MoE token kernel (kernels/gluon_moe_w4_fused.py) compiles for Hopper on any machine
(Triton lowers it to sm_90 PTX and cubin offline), in a child process as tests/test_gluon_mma_compile.py does.
Its GPU results are checked in tests/test_gluon_moe_w4_fused.py on an H100.

What the compiled kernel must show: every expert word reaches shared memory through 16-byte cp.async.cg (L2
only, no registers in flight), in one commit group a gate-up unit (the last carrying the down tile), waited
for unit by unit; the grid barrier's acquire / release atomics; its shared memory within the H100's 227 KB;
and ptxas (the one Triton runs for sm_90, -v) spilling nothing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon._runtime")

PTR = {"x_ptr": "*bf16", "act_ptr": "*bf16", "out_ptr": "*bf16", "q13_ptr": "*i32", "q2_ptr": "*i32",
       "z13_ptr": "*u8", "z2_ptr": "*u8", "ids_ptr": "*i32", "tw_ptr": "*fp32", "cnt_ptr": "*i32"}  # fmt: skip
CASES = [(128, True, "fp16", 6), (128, False, "bf16", 6), (32, True, "bf16", 8)]  # group, zeros, scales, units


def _compile() -> list[dict]:
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    from ftransformers.kernels import gluon_moe_w4_fused as fused

    fn = fused._fused_moe_kernel
    params = list(inspect.signature(fn.fn).parameters)
    out = []
    for group, zeros, scales, units in CASES:
        consts = {"TOP_K": 8, "GROUP": group, "HAS_ZEROS": zeros, "DW": 256, "UNITS": units,
                  "RING": triton.next_power_of_2(2 * units), "USE_PDL": True}  # fmt: skip
        types = {**PTR, "s13_ptr": f"*{scales}", "s2_ptr": f"*{scales}"}
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in params}
        aligned = [n for n in params if n.endswith("_ptr") or n.startswith("stride") or n in ("D", "I", "IW")]
        attrs = {(params.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = GluonASTSource(fn, sig, constexprs=consts, attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": fused.WARPS})
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
            log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                                 capture_output=True, text=True, check=True).stderr  # fmt: skip
        expect = fused.smem_bytes(2048, group, units)
        out.append({"case": [group, zeros, scales, units], "shared": kernel.metadata.shared, "expect": expect,
                    "ptx": kernel.asm["ptx"], "ptxas": log})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, sys; sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[1])]!r}; "
    code += "from test_gluon_moe_fused_compile import _compile; print(json.dumps(_compile()))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                         check=False)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_fused_kernel_compiles_for_hopper(kernels: list[dict]) -> None:
    assert len(kernels) == len(CASES)
    for k in kernels:
        ptx, units = k["ptx"], k["case"][3]
        copies = re.findall(r"cp\.async\.(c[ag])\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+)", ptx)
        assert copies and all(c == ("cg", "0x10") for c in copies), (k["case"], set(copies))
        assert ptx.count("cp.async.commit_group") == units, k["case"]
        assert len(re.findall(r"cp\.async\.wait_group", ptx)) == units + 1, k["case"]
        assert "atom.global.gpu.acq_rel.add" in ptx and "acquire" in ptx and "release" in ptx, k["case"]
        assert k["expect"] == k["shared"] <= 227 * 1024, (k["case"], k["shared"], k["expect"])
        assert "spill" not in k["ptxas"] or re.search(r"0 bytes spill stores, 0 bytes spill loads", k["ptxas"]), k
