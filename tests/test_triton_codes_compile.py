"""The int4 codes kernel's decoded form (kernels/triton_w4a16_codes.py, DEQUANT with its PTX decode, DQ_ASM) compiles
for Hopper on any machine: Triton lowers it to sm_90 PTX and cubin offline (the test session runs Triton's
interpreter, which runs the float32 form instead; tests/test_triton_w4a16.py checks the PTX form against it bit for
bit on a GPU). On the tiles `decoded_config` picks (128 x 128, 8 warps, at 32 rows; 64 x 128, 4 warps, at 64), bf16
and fp16 x: the decode's LOP3 and packed 16-bit FMAs (two a pair), wgmma with float32 accumulation, no spills."""

from __future__ import annotations

import re

import pytest
from test_gluon_mma_compile import compile_for_hopper, compiled_in_child

pytest.importorskip("triton")


def _compile() -> list[dict]:  # in this process: per case, its name, words a thread, PTX and ptxas -v log
    import triton.language as tl

    from ftransformers.kernels import triton_w4a16_codes as codes

    out = []
    for m, n, k, dt in [(32, 24576, 4096, "bf16"), (64, 24576, 4096, "fp16")]:
        cfg = codes.decoded_config(m, n, k, 128)
        tiles = {name: cfg[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}
        consts = {"GROUP": 128, "HAS_ZEROS": True, "HAS_BIAS": False, "DT": tl.bfloat16 if dt == "bf16" else tl.float16,
                  **tiles, "IEEE": False, "EVEN_N": True, "DEQUANT": True, "DQ_ASM": True}
        types = {"x_ptr": f"*{dt}", "b_ptr": f"*{dt}", "y_ptr": f"*{dt}", "ticket_ptr": "*i32"}
        built = compile_for_hopper(codes._w4a16_codes_kernel, consts, cfg["num_warps"], types=types,
                                   stages=cfg["num_stages"])  # fmt: skip
        words = cfg["BLOCK_N"] * cfg["BLOCK_K"] // 8 // (32 * cfg["num_warps"])
        out.append({"name": f"M={m} {dt} {cfg}", "dt": dt, "words": words, **built})
    return out


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_in_child("test_triton_codes_compile")


def test_decoded_form_compiles_for_hopper(kernels: list[dict]) -> None:
    assert len(kernels) == 2
    for k in kernels:
        fma = "fma.rn.bf16x2" if k["dt"] == "bf16" else "fma.rn.f16x2"
        # one PTX block a word a K tile: 4 LOP3 and 8 packed FMAs (the subtraction and the scale, a pair each)
        assert k["ptx"].count(fma) == 8 * k["words"], (k["name"], k["ptx"].count(fma))
        assert len(re.findall(r"lop3\.b32\s+\S+, \S+, 0x000F000F, \S+, 0xEA;", k["ptx"])) == 4 * k["words"], k["name"]
        ptx_type = "bf16" if k["dt"] == "bf16" else "f16"
        assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\." + ptx_type, k["ptx"]), k["name"]
        spilled = re.search(r"\b(\d+) bytes spill stores, (\d+) bytes spill loads", k["ptxas"])
        assert spilled and max(map(int, spilled.groups())) == 0, (k["name"], k["ptxas"])
