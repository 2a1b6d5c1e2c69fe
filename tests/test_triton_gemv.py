"""Triton skinny GEMM (decode linears, M <= 16) vs a float32-accumulating PyTorch reference on fresh
random inputs, and the linear layer's dispatch to it.

CPU: TRITON_INTERPRET=1, small shapes. Tolerances (||out - ref|| / ||ref||): float32 1e-5; bfloat16
1e-2 (the reference rounds the same float32 sum once, so in practice the kernel is within an ulp or
two of it; the summation order differs)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # conftest runs it through the interpreter without a GPU

from ftransformers.kernels.triton_gemv import GEMV_MAX_M, can_fold_norm, gemv, gemv_config, gemv_ref, gemv_rmsnorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K): K not a multiple of any BLOCK_K exercises the masked path; N not a multiple of BLOCK_N too.
SHAPES = [(5120, 2048), (2048, 4096), (2112, 7168), (129, 1000)] if DEV == "cuda" else [(37, 96), (20, 512)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype and not out.isnan().any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, GEMV_MAX_M])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype: torch.dtype, M: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(M * 7 + bias)
    for N, K in SHAPES:
        x = torch.randn(M, K, generator=gen).to(DEV, dtype)
        w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEV, dtype)
        b = torch.randn(N, generator=gen).to(DEV, dtype) if bias else None
        out = gemv(x, w, b)
        assert rel_err(out, gemv_ref(x, w, b)) < tol(dtype), (M, N, K)


def test_gemv_every_tile_path() -> None:
    """Both kernels with small tiles, so several programs and K iterations run even on CPU shapes."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 80, generator=gen)
    w = torch.randn(24, 80, generator=gen)
    for cfg in ({"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1},
                {"BLOCK_M": 2, "BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 1, "num_stages": 1},
                {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 1, "num_stages": 1}):  # fmt: skip
        m = min(6, cfg["BLOCK_M"])
        xs = x[:m].to(DEV)
        assert rel_err(gemv(xs, w.to(DEV), config=cfg), gemv_ref(xs, w.to(DEV))) < 1e-5, cfg
    assert gemv_config(1, 5120, 2048)["BLOCK_M"] == 1 and gemv_config(9, 5120, 2048)["BLOCK_M"] == 16
    # one row: K up to GEMV_WHOLE_ROW_K in one step, longer rows GEMV_BLOCK_K at a time; 2-4 rows 1024 / rows
    ks = [gemv_config(m, 2048, k)["BLOCK_K"] for m, k in ((1, 4096), (1, 3000), (1, 7168), (1, 16384), (2, 4096))]
    assert ks == [4096, 4096, 2048, 2048, 512]


def test_strided_rows() -> None:
    """x may be a row slice of a wider buffer (unit stride along K only)."""
    gen = torch.Generator().manual_seed(5)
    buf = torch.randn(3, 200, generator=gen).to(DEV)
    x = buf[:, 50:146]  # [3, 96], row stride 200
    w = torch.randn(37, 96, generator=gen).to(DEV)
    assert rel_err(gemv(x, w), gemv_ref(x, w)) < 1e-5


@pytest.mark.skipif(DEV != "cuda", reason="the linear layers dispatch to the kernel on CUDA only")
def test_linear_layer_dispatches_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    import ftransformers.kernels.triton_gemv as mod
    from ftransformers.layers.linear import ReplicatedLinear

    calls: list[tuple[int, ...]] = []
    real = mod.gemv
    monkeypatch.setattr(mod, "gemv", lambda x, w, b=None, config=None: calls.append(tuple(x.shape)) or real(x, w, b))
    layer = ReplicatedLinear(2048, 640, bias=True).to(DEV, torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=2048**-0.5)
    torch.nn.init.normal_(layer.bias)
    for shape in [(1, 2048), (1, 1, 2048), (3, 2048)]:
        x = torch.randn(*shape, device=DEV, dtype=torch.bfloat16)
        out = layer(x)
        ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float()).to(x.dtype)
        assert rel_err(out, ref) < tol(torch.bfloat16) and out.shape == (*shape[:-1], 640)
    assert calls == [(1, 2048), (1, 2048)]  # the 3-row input stays on cuBLAS


def test_out_buffer() -> None:
    """gemv writes into a given row slice of a wider buffer (the CUDA graph's logits) and returns it."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 96, generator=gen).to(DEV)
    w = torch.randn(300, 96, generator=gen).to(DEV)
    buf = torch.full((3, 300), 7.0, device=DEV)
    y = gemv(x, w, out=buf[1:2])
    assert y.data_ptr() == buf[1].data_ptr() and rel_err(buf[1:2], gemv_ref(x, w)) < 1e-5
    assert (buf[0] == 7.0).all() and (buf[2] == 7.0).all()


@pytest.mark.skipif(DEV != "cuda", reason="the LM head dispatches to the kernel on CUDA only")
def test_lm_head_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """One row of logits (batch-1 decode, or a prefill's last token) from the kernel, float32 or into the
    head's buffer; more rows from cuBLAS."""
    import ftransformers.kernels.triton_gemv as mod
    from ftransformers.layers.embedding import ParallelLMHead

    calls: list[tuple[int, ...]] = []
    real = mod.gemv
    monkeypatch.setattr(mod, "gemv", lambda x, w, b=None, config=None, out=None: calls.append(tuple(x.shape))
                        or real(x, w, b, out=out))  # fmt: skip
    head = ParallelLMHead(5000, 256).to(DEV, torch.bfloat16)
    torch.nn.init.normal_(head.weight, std=256**-0.5)
    buf = head.logits_buffer(4)
    for rows in (1, 3):
        x = torch.randn(rows, 256, device=DEV, dtype=torch.bfloat16)
        with torch.inference_mode():  # as the engine runs it (out= takes no autograd)
            ref = gemv_ref(x, head.weight).float()
            got = head.compute_logits(x)
            into = head.compute_logits(x, out=buf[:rows])
        assert got.dtype == torch.float32 and rel_err(got, ref) < tol(torch.bfloat16)
        assert into.data_ptr() == buf.data_ptr() and torch.equal(into.float(), got)
    assert calls == [(1, 256), (1, 256)]


def _norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # layers/norm.py's RMSNorm on the CPU path: the sum rounded to x's dtype, statistics in float32, the normed row
    # rounded before the weight multiplies
    s = (x.float() + residual.float()).to(x.dtype)
    s32 = s.float()
    y = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * y, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_rmsnorm_matches_norm_then_gemv(dtype: torch.dtype, bias: bool) -> None:
    """The input RMSNorm folded into the one-row GEMV: y against the norm's reference then gemv_ref (the tolerances
    above; the kernel's float32 sum of squares may differ from the reference's in its last bits, and so round a
    normed element the other way), and x + residual bit for bit (on the GPU; the interpreter truncates casts)."""
    gen = torch.Generator().manual_seed(21 + bias)
    shapes = [(5120, 2048), (6144, 4096), (129, 1000)] if DEV == "cuda" else [(37, 96), (20, 512)]
    for N, K in shapes:
        x = torch.randn(1, K, generator=gen).to(DEV, dtype)
        r = (3 * torch.randn(1, K, generator=gen)).to(DEV, dtype)
        nw = (1 + 0.3 * torch.randn(K, generator=gen)).to(DEV, dtype)
        w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEV, dtype)
        b = torch.randn(N, generator=gen).to(DEV, dtype) if bias else None
        assert can_fold_norm(x, r, nw, w)
        y, new_res = gemv_rmsnorm(x, r, nw, 1e-6, w, b)
        xn, s = _norm_ref(x, r, nw, 1e-6)
        if DEV == "cuda" or dtype == torch.float32:
            assert torch.equal(new_res, s), (N, K)
        else:  # the interpreter's casts to bfloat16 truncate: within one bf16 step
            assert torch.allclose(new_res.float(), s.float(), rtol=2**-7, atol=0), (N, K)
        assert rel_err(y, gemv_ref(xn, w, b)) < tol(dtype), (N, K, rel_err(y, gemv_ref(xn, w, b)))


def test_gemv_rmsnorm_takes_one_whole_row_only() -> None:
    """can_fold_norm: one contiguous row of at most GEMV_WHOLE_ROW_K, one dtype throughout."""
    from ftransformers.kernels.triton_gemv import GEMV_WHOLE_ROW_K

    k = 64
    x, w, nw = torch.randn(1, k), torch.randn(8, k), torch.randn(k)
    assert can_fold_norm(x, x.clone(), nw, w)
    assert not can_fold_norm(torch.randn(2, k), torch.randn(2, k), nw, w)  # two rows
    assert not can_fold_norm(x, x.clone(), nw.to(torch.bfloat16), w)  # the norm's weight in another dtype
    assert not can_fold_norm(x, x.clone(), torch.randn(k + 1), w)
    big = GEMV_WHOLE_ROW_K * 2
    assert not can_fold_norm(torch.randn(1, big), torch.randn(1, big), torch.randn(big), torch.randn(4, big))


def test_norm_then_linear_leaves_quantized_and_cpu_layers_alone() -> None:
    """norm_then_linear returns None (the norm's own launch) for a quantized layer, whose weight tensors are its
    method's, and for a CPU row; it never reaches for a `weight` a quantized layer lacks."""
    from ftransformers.layers.linear import ReplicatedLinear, norm_then_linear
    from ftransformers.layers.norm import RMSNorm

    norm, layer = RMSNorm(64), ReplicatedLinear(64, 32)
    x, r = torch.randn(1, 64), torch.randn(1, 64)
    assert norm_then_linear(norm, layer, x, r) is None  # a CPU row: one_row_gemv declines
    layer.quant_method = object()  # any method: the fold leaves the layer to it
    del layer.weight
    assert norm_then_linear(norm, layer, x, r) is None


@pytest.mark.skipif(DEV != "cuda", reason="the decoder layer folds its input norm into the GEMV on CUDA only")
def test_decoder_layer_folds_its_input_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3 decoder layer's input norm and qkv projection at one row through norm_then_linear, as the layer calls
    them: gemv_rmsnorm takes the call, its product matches the norm then the projection and its residual equals the
    norm's; two rows go back to the norm's own launch. (The whole layer runs folded in the engine parity tests.)"""
    from transformers import Qwen3Config

    import ftransformers.kernels.triton_gemv as mod
    from ftransformers.models import llama
    from ftransformers.models.qwen3 import Qwen3DecoderLayer

    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=128)  # fmt: skip
    layer = Qwen3DecoderLayer(cfg, 0).to(DEV, torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    qkv_w, norm_w = layer.self_attn.qkv_proj.weight, layer.input_layernorm.weight
    with torch.no_grad():  # fresh random weights (the layer's own are uninitialised)
        qkv_w.copy_(torch.randn(qkv_w.shape, generator=gen) / 16)
        norm_w.copy_(1 + 0.3 * torch.randn(norm_w.shape, generator=gen))
    calls: list[int] = []
    real = mod.gemv_rmsnorm
    monkeypatch.setattr(mod, "gemv_rmsnorm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(1, 256, generator=gen).to(DEV, torch.bfloat16)
    r = torch.randn(1, 256, generator=gen).to(DEV, torch.bfloat16)
    # the norm and qkv alone (the attention needs a KV pool): the folded call against norm then qkv
    folded = llama.norm_then_linear(layer.input_layernorm, layer.self_attn.qkv_proj, x, r)
    assert folded is not None and calls == [1]
    normed, res = layer.input_layernorm(x, r)
    assert torch.equal(folded[1], res)
    ref = layer.self_attn.qkv_proj(normed)
    assert rel_err(folded[0], ref) < tol(torch.bfloat16)
    two = llama.norm_then_linear(layer.input_layernorm, layer.self_attn.qkv_proj, x.expand(2, 256), r.expand(2, 256))
    assert two is None  # two rows: the norm's own launch
