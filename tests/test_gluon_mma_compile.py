"""The int4 mma.sync kernels in Gluon (kernels/gluon_moe_w4_mma.py, kernels/gluon_w4a16_mma.py) compile for
Hopper on any machine: Triton lowers them to sm_90 PTX and cubin offline, so CI catches a Triton that no
longer takes them. Their GPU results are checked against the references in tests/test_gluon_moe_w4_mma.py
and tests/test_gluon_w4a16_mma.py on an H100. The compile runs in a child process (the test session runs
Triton's interpreter, see tests/test_gluon_mla_compile.py).

What each compiled kernel must show: m16n8k16 bf16 mma.sync with float32 accumulation; the weights decoded
by the inline LOP3 (lut 0xEA: (q & mask) | magic) into operand registers, never staged in shared memory
(the only shared memory is the cross-warp sum or, in the grouped down, the partials' layout change: at most 6
bytes an output element a warp: float32, rows of 16 columns padded to 24); ptxas (the one Triton runs for sm_90, -v) spilling nothing, except one register (4
bytes) under a register cap (gluon_w4a16_mma.register_cap: the 16-warp form capped at 128 spills that here, 2
bytes on the H200's ptxas, and measured 8% faster); the dense kernel's first chunk of words loaded ahead of
the PDL wait (PRELOAD_WORDS), nothing stored there; and at 1-4 rows its x loaded on its spans only
(SPAN_MASKED_X: predicated vector loads), as the MoE kernels' x always (one token a pair; their SPAN_MASKED_X).
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

PTR = {"x_ptr": "*bf16", "act_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "bias_ptr": "*bf16",
       "y_ptr": "*bf16", "out_ptr": "*bf16", "ids_ptr": "*i32", "tw_ptr": "*fp32", "part_ptr": "*fp32",
       "cnt_ptr": "*i32", "groups_ptr": "*i32", "leaders_ptr": "*i32"}  # fmt: skip


def _sig(fn, consts: dict, types: dict | None = None) -> tuple[dict, dict]:  # every parameter: its type or constexpr
    import inspect

    params = list(inspect.signature(fn.fn).parameters)
    known = {**PTR, **(types or {})}
    sig = {n: "constexpr" if n in consts or n == "USE_PDL" else known.get(n, "fp32" if n == "offset" else "i32")
           for n in params}  # fmt: skip
    aligned = [n for n in params if n.endswith("_ptr") or n.startswith("stride")]
    return sig, {(params.index(n),): [["tt.divisibility", 16]] for n in aligned}


def _constexpr_defaults(fn) -> dict:  # the kernel's constexpr parameters with defaults, at them (else _sig's i32)
    import inspect

    params = inspect.signature(fn.fn).parameters.values()
    return {p.name: p.default for p in params if "constexpr" in str(p.annotation) and p.default is not p.empty}


def _compile() -> list[dict]:  # in this process: per kernel, its name, shared bytes, PTX, ptxas -v log
    from ftransformers.kernels import gluon_moe_w4_mma as moe
    from ftransformers.kernels import gluon_w4a16_mma as lin

    jobs = []
    # default configs, among them: 64 rows a warp (deep and wide weights past 8 rows); at 1-4 rows the H200's
    # forms (16 warps on narrow weights, 64 rows on wide shallow ones); group 32 at 8 rows, its 16 columns
    # (SMALL_GROUP_COLUMNS, the last here); after them the split form with its register cap of 255
    dense = [(1, 7168, 16384, 128), (2, 24576, 4096, 128), (4, 5120, 2048, 128), (8, 4096, 12288, 128),
             (16, 1024, 2048, 32), (16, 7168, 16384, 128), (16, 24576, 1536, 128), (1, 4096, 12288, 128),
             (4, 4096, 12288, 128), (1, 24576, 1536, 128), (4, 4096, 7168, 128),
             (8, 7168, 16384, 32)]  # fmt: skip
    # and the form whose warps split N (split 1, and split K with the last-one-out sum)
    split = [(16, 7168, 16384, 128, lin.MmaLinearConfig(32, 8, 128, 8)),
             (2, 4096, 12288, 128, lin.MmaLinearConfig(16, 4, 128, 1))]  # fmt: skip
    for m, n, k, group, cfg in [(*d, None) for d in dense] + split:
        cfg = cfg or lin.default_config(m, n, k)
        jobs.append((f"dense M={m} {n}x{k} g{group}", lin._w4a16_mma_kernel,
                     lin.constexprs(m, k, group, True, True, cfg), cfg.warps, cfg.rows * 16, cfg.maxnreg))  # fmt: skip
    # the weights decoded with their scales before the mma (DEQUANT_MAX_SPANS): group 32 at 12-16 rows
    for m, n, k, zero in [(16, 1536, 7168, False), (12, 4096, 7168, True)]:
        cfg = lin.default_config(m, n, k)
        consts = lin.constexprs(m, k, 32, zero, True, cfg)
        assert consts["DEQUANT"], (m, n, k)
        jobs.append((f"dense dequant M={m} {n}x{k} g32", lin._w4a16_mma_kernel, consts, cfg.warps, cfg.rows * 16,
                     cfg.maxnreg))  # fmt: skip
    for t, d, inter in [(1, 7168, 2048), (8, 2048, 768)]:  # DeepSeek-V3, Qwen3-30B-A3B
        cfg = moe.default_config(t, d)
        kc = moe.chunk_k(d // cfg.up_warps, 128, cfg.up_kc)
        up = dict(HAS_ZERO=True, GROUP=128, TOP_K=8, KC=kc, CHUNKS=d // cfg.up_warps // kc, AHEAD=cfg.up_ahead,
                  ROWS=cfg.up_rows, W=cfg.up_warps, **moe.layouts(cfg.up_warps, cfg.up_rows, kc),
                  MASK_X=moe.SPAN_MASKED_X)  # fmt: skip
        jobs.append((f"moe gate-up T={t} D={d}", moe._gate_up_kernel, up, cfg.up_warps, cfg.up_rows * 8, 0))
        for spans in (2, 4):  # the gate-up over groups of 8 / spans pairs of one expert
            kc = moe.chunk_k(d // cfg.up_warps, 128, cfg.up_kc, spans)
            grouped = dict(up, S=spans, KC=kc, CHUNKS=d // cfg.up_warps // kc, **moe.layouts(cfg.up_warps, cfg.up_rows, kc))
            jobs.append((f"moe grouped gate-up S={spans} T={t} D={d}", moe._grouped_gate_up_kernel, grouped, cfg.up_warps,
                         cfg.up_rows * 8, 0))  # fmt: skip
        for spans, zero in ((2, True), (4, False)):  # the down over the same groups (ticket counters, 32 rows a warp)
            kc = moe.chunk_k(inter, 128, cfg.down_kc, spans)
            gd = dict(HAS_ZERO=zero, GROUP=128, TOP_K=8, KC=kc, CHUNKS=inter // kc, AHEAD=cfg.gdown_ahead, S=spans,
                      ROWS=cfg.gdown_rows, W=cfg.gdown_warps, **moe.layouts(cfg.gdown_warps, cfg.gdown_rows, kc),
                      MASK_X=moe.SPAN_MASKED_X)  # fmt: skip
            jobs.append((f"moe grouped down S={spans} T={t} D={d}", moe._grouped_down_kernel, gd, cfg.gdown_warps,
                         cfg.gdown_rows * cfg.gdown_warps * 8, 0))  # fmt: skip
            jobs.append((f"moe grouped down compact S={spans} T={t} D={d}", moe._grouped_down_kernel,
                         {**gd, "COMPACT": True}, cfg.gdown_warps, cfg.gdown_rows * cfg.gdown_warps * 8, 0))
        jobs.append((f"moe grouped gate-up compact T={t} D={d}", moe._grouped_gate_up_kernel, {**grouped, "COMPACT": True},
                     cfg.up_warps, cfg.up_rows * 8, 0))  # fmt: skip
        kc = moe.chunk_k(inter, 128, cfg.down_kc)
        down = dict(HAS_ZERO=True, GROUP=128, KC=kc, CHUNKS=inter // kc, AHEAD=cfg.down_ahead, ROWS=cfg.down_rows, W=8,
                    **moe.layouts(8, cfg.down_rows, kc), MASK_X=moe.SPAN_MASKED_X)  # fmt: skip
        jobs.append((f"moe down T={t} D={d}", moe._down_kernel, down, 8, cfg.down_rows * 8, 0))
        # symmetric weights under the down kernel's cap (two programs an SM)
        sym = dict(down, HAS_ZERO=False)
        jobs.append((f"moe down sym T={t} D={d}", moe._down_kernel, sym, 8, cfg.down_rows * 8, moe.DOWN_MAXNREG_SYM))
    out = []
    for name, fn, consts, warps, outputs, maxnreg in jobs:  # maxnreg: the launch's register cap (0: none)
        out.append({"name": name, **compile_for_hopper(fn, consts, warps, maxnreg),
                    "max_shared": 6 * warps * outputs, "maxnreg": maxnreg})  # fmt: skip
    return out


def compile_for_hopper(fn, consts: dict, warps: int, maxnreg: int = 0, types: dict | None = None,
                       stages: int = 0) -> dict:  # fmt: skip
    """A Gluon (or, with `stages`, Triton) kernel compiled for sm_90 with PDL on, in this process: its shared bytes,
    PTX and the ptxas -v log of the ptxas Triton itself runs. `types` names parameter types past PTR's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    consts = {**_constexpr_defaults(fn), **consts}
    sig, attrs = _sig(fn, consts, types)
    source = ASTSource if stages else GluonASTSource
    src = source(fn, sig, constexprs={**consts, "USE_PDL": True}, attrs=attrs)
    options = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    if stages:
        options["num_stages"] = stages
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip
    return {"shared": kernel.metadata.shared, "ptx": kernel.asm["ptx"], "ptxas": log}


def compiled_in_child(module: str) -> list[dict]:
    """`module._compile()` (a test module beside this one) run in a child process without Triton's interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, sys; sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[1])]!r}; "
    code += f"from {module} import _compile; print(json.dumps(_compile()))"
    cmd = [sys.executable, "-c", code]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def kernels() -> list[dict]:
    return compiled_in_child("test_gluon_mma_compile")


def test_mma_kernels_compile_for_hopper(kernels: list[dict]) -> None:
    assert len(kernels) == 36
    for k in kernels:
        assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in k["ptx"], k["name"]
        assert re.search(r"lop3\.b32\s+%r\d+, %r\d+, 0x000F000F, %r\d+, 0xEA;", k["ptx"]), k["name"]
        assert k["shared"] <= k["max_shared"], (k["name"], k["shared"])  # only the cross-warp sum
        spilled = re.search(r"\b(\d+) bytes spill stores, (\d+) bytes spill loads", k["ptxas"])
        # the capped symmetric down kernel spills 24 bytes here (Triton 3.9's ptxas): measured faster than its 136
        # registers uncapped (gluon_moe_w4_mma.DOWN_MAXNREG_SYM)
        most = 32 if k["name"].startswith("moe down sym") else 4 if k["maxnreg"] else 0
        assert spilled and max(map(int, spilled.groups())) <= most, (k["name"], k["ptxas"])
        if k["maxnreg"]:
            used = re.search(r"Used (\d+) registers", k["ptxas"])
            assert used and int(used.group(1)) <= k["maxnreg"], (k["name"], k["ptxas"])
        if k["name"].startswith("dense"):  # its first chunk's words loaded ahead of the PDL wait, nothing stored
            ahead = k["ptx"][: k["ptx"].index("griddepcontrol.wait")]
            assert "ld.global" in ahead and "st.global" not in ahead and "st.shared" not in ahead, k["name"]
        if re.match(r"dense M=[1-4] |moe ", k["name"]):  # x on its spans only: predicated 16-byte loads
            assert re.search(r"@%p\d+ ld\.global\.v4\.b32", k["ptx"]), k["name"]
        if k["name"].startswith("moe grouped down"):  # the release tickets, and the last one's L2 reads of partials
            assert re.search(r"atom\.global\.gpu\.acq_rel\.add", k["ptx"]), k["name"]
            assert "ld.global.cg" in k["ptx"], k["name"]
