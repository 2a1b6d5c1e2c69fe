"""L2 prefetch of a later kernel's weights (kernels/l2_ahead.py).

A prefetch is a hint: the kernels that issue it must give bitwise the results they give without it, and
every hinted address must be in bounds (an out-of-bounds `prefetch` / `cp.async.bulk.prefetch` is
undefined; compute-sanitizer-free, a fault shows as a CUDA error here). CUDA: decode attention stage 1
(family "o") and the MoE pair path's gate-up kernels, bf16 and int4 (family "down"), in both hint forms
and both places, against the same call with the hints off. Any machine: the helper compiles for sm_90
in both forms (ptxas checks the inline PTX), and the settings and layer plumbing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from ftransformers.kernels import l2_ahead

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9
FORMS = [(False, False), (False, True), (True, False), (True, True)]  # (bulk, at_end)


@pytest.fixture
def restore_ahead():
    was = l2_ahead.l2_ahead_settings()
    yield
    l2_ahead.set_l2_ahead(*was)


def test_settings_and_launch_args(restore_ahead) -> None:
    with pytest.raises(ValueError, match="unknown L2-ahead families"):
        l2_ahead.set_l2_ahead({"o", "lm_head"})
    l2_ahead.set_l2_ahead({"down"}, bulk=True)
    assert l2_ahead.l2_ahead_on("down") and not l2_ahead.l2_ahead_on("o")
    w = torch.randn(4, 6)
    off = l2_ahead.ahead_args([w], w, 4)  # the CPU: always off
    assert off["AHEAD"] == 0 and off["AN0"] == 0
    if HOPPER:
        stacked = torch.randn(3, 8, 16, device="cuda", dtype=torch.bfloat16)
        on = l2_ahead.ahead_args([stacked], stacked, 8)
        assert on["AHEAD"] == 2 and on["AN0"] == 8 * 16 * 2 and on["AN1"] == 0 and on["AHEAD_LANES"] == 256
        with pytest.raises(ValueError, match="contiguous"):
            l2_ahead.ahead_args([stacked.transpose(1, 2)], stacked, 8)


def test_linear_weight_tensors() -> None:
    from ftransformers.kernels.quant_formats import QuantizedWeight
    from ftransformers.layers.linear import ReplicatedLinear

    lin = ReplicatedLinear(64, 32)
    lin.weight.data = torch.randn(32, 64)
    assert [t.shape for t in lin.weight_tensors()] == [(32, 64)]
    q = torch.zeros(32, 8, dtype=torch.int32)
    s, z = torch.ones(32, 2, dtype=torch.bfloat16), torch.zeros(32, 2, dtype=torch.uint8)
    lin.qw = QuantizedWeight("int4", q, s, 32, 64, 32, zeros=z)  # type: ignore[assignment]
    assert [t.data_ptr() for t in lin.weight_tensors()] == [q.data_ptr(), s.data_ptr(), z.data_ptr()]


_COMPILE = r"""
import json, subprocess, sys, tempfile
from pathlib import Path
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from ftransformers.kernels.l2_ahead import l2_ahead

@triton.jit
def probe(AH0, AN0, AH1, AN1, AH2, AN2, ids, AHEAD: tl.constexpr, LANES: tl.constexpr):
    e = tl.load(ids + tl.program_id(0)).to(tl.int64)
    l2_ahead(AH0, AN0, AH1, AN1, AH2, AN2, e, tl.program_id(1), tl.num_programs(1), AHEAD, LANES)

out = {}
for mode in (1, 2):
    sig = {"AH0": "*bf16", "AN0": "i32", "AH1": "*i32", "AN1": "i32", "AH2": "*fp16", "AN2": "i32", "ids": "*i32",
           "AHEAD": "constexpr", "LANES": "constexpr"}
    k = triton.compile(ASTSource(probe, sig, constexprs={"AHEAD": mode, "LANES": 128}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                           capture_output=True, text=True)
    out[mode] = {"lines": ptx.count("prefetch.global.L2 "), "bulk": ptx.count("cp.async.bulk.prefetch.L2"),
                 "ptxas_rc": r.returncode, "ptxas_err": r.stderr[-400:]}
print(json.dumps(out))
"""


def test_helper_compiles_for_sm90(tmp_path: Path) -> None:
    """Offline (no GPU): both hint forms lower to the expected PTX and ptxas assembles them. In a child
    process (from a file: Triton reads a jit function's source): the test session runs Triton's
    interpreter (conftest)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    script = tmp_path / "compile_l2_ahead.py"
    script.write_text(_COMPILE)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["1"]["ptxas_rc"] == 0 and got["2"]["ptxas_rc"] == 0, got
    # three ranges each: per-line hints in a loop per range, one predicated bulk hint per range
    assert got["1"]["lines"] >= 3 and got["1"]["bulk"] == 0, got
    assert got["2"]["bulk"] == 3 and got["2"]["lines"] == 0, got


@pytest.mark.skipif(not HOPPER, reason="the hints are issued on Hopper only")
@pytest.mark.parametrize("bulk,at_end", FORMS)
def test_decode_attention_unchanged(bulk: bool, at_end: bool, restore_ahead) -> None:
    from ftransformers.kernels.triton_decode_attention import decode_attention_fwd, decode_scratch

    gen = torch.Generator("cuda").manual_seed(7)
    lens = [1, 300, 4097, 64]
    h_kv, group, d = 4, 8, 128
    B, H, N = len(lens), h_kv * group, sum(lens) + 10
    r2t = torch.zeros(B, max(lens), dtype=torch.int64, device="cuda")
    perm = torch.randperm(N, generator=gen, device="cuda") + 1
    start = 0
    for i, n in enumerate(lens):
        r2t[i, :n] = perm[start : start + n]
        start += n
    rows, seq_lens = torch.arange(B, device="cuda"), torch.tensor(lens, device="cuda")
    q = torch.randn(B, H, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    k_buf = torch.randn(N + 1, h_kv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    v_buf = torch.randn(N + 1, h_kv, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    # an o projection's tensors: bf16 weight, int32 codes, uint8 zeros of odd sizes (tails of a line)
    o_w = torch.randn(2048, 4096, generator=gen, device="cuda", dtype=torch.bfloat16)
    codes = torch.randint(0, 2**30, (1000, 129), generator=gen, device="cuda", dtype=torch.int32)
    zeros = torch.randint(0, 15, (77, 3), generator=gen, device="cuda", dtype=torch.uint8)
    outs = []
    for on in (False, True):
        l2_ahead.set_l2_ahead({"o"} if on else set(), bulk=bulk, at_end=at_end)
        for splits in (1, 16):
            mid_o, mid_lse = decode_scratch(B, H, d, splits, torch.device("cuda"))
            out = torch.full_like(q, float("nan"))
            ahead = [o_w, codes, zeros] if on else None
            outs.append(decode_attention_fwd(q, k_buf, v_buf, out, r2t, rows, seq_lens, mid_o, mid_lse, splits,
                                             d**-0.5, block_n=64, ahead=ahead))  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


@pytest.mark.skipif(not HOPPER, reason="the hints are issued on Hopper only")
@pytest.mark.parametrize("bulk,at_end", FORMS)
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_pair_paths_unchanged(bulk: bool, at_end: bool, tokens: int, restore_ahead) -> None:
    from ftransformers.kernels import triton_fused_moe as tfm
    from ftransformers.kernels import triton_fused_moe_w4 as w4
    from tests.test_triton_moe_w4 import make_routing, random_qw

    gen = torch.Generator("cuda").manual_seed(11 + tokens)
    e, d, inter, k = 128, 2048, 768, 8
    hidden = torch.randn(tokens, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    weights, ids = make_routing(tokens, e, k, gen)
    w13 = torch.randn(e, 2 * inter, d, generator=gen, device="cuda", dtype=torch.bfloat16) / d**0.5
    w2 = torch.randn(e, d, inter, generator=gen, device="cuda", dtype=torch.bfloat16) / inter**0.5
    q13 = random_qw("int4", e, 2 * inter, d, gen, zeros=True)
    q2 = random_qw("int4", e, d, inter, gen, zeros=True)
    outs = []
    for on in (False, True):
        l2_ahead.set_l2_ahead({"down"} if on else set(), bulk=bulk, at_end=at_end)
        outs.append(tfm.fused_moe(hidden, w13, w2, weights, ids))
        cfg = w4.default_w4_pair_config(tokens, d, "int4")  # the CUDA-core pair path, which hints
        outs.append(w4.fused_moe_w4(hidden, q13, q2, weights, ids, cfg))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
