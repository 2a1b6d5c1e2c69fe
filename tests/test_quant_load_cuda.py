"""The CUDA dispatch of quantized layers (GPU only; skipped without CUDA).

Tiny Qwen3-MoE and DeepSeek-V3 models with `load_format=dummy` in every format (valid random tensors,
quant/kernel_method.py), bfloat16 on CUDA: every quantized linear through `LinearBase.forward` (the
Triton kernels) against `quant_linear_ref`, every expert stack through the "triton" quantized MoE
backend against `quant_moe_ref`, on fresh random inputs; then whole-engine greedy generation with
CUDA graphs. Tolerance: relative L2 error 2e-2 (bf16 outputs round to 2^-8 ~ 4e-3 relative; the W8A8 /
FP8 kernels quantize activations in their own op order, so an element may land one step away).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.model_harness import make_tiny_checkpoint
from tests.test_quant_load_common import CONFIGS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ONLINE = ["fp8", "w8a8_int8", "int4", "mxfp4", "nvfp4"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {kind: make_tiny_checkpoint(kind, root / kind) for kind in ("qwen3", "qwen3_moe", "deepseek_v3")}


def _dir(src: Path, dst: Path, qcfg: dict | None) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    if qcfg is not None:
        cfg["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.glob("*.safetensors"):
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _check_layers(model: torch.nn.Module, what: str) -> int:
    from ftransformers.kernels.quant_formats import quant_linear_ref, quant_moe_ref
    from ftransformers.layers.moe.experts import FusedMoE, get_quant_moe_backend

    checked = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, m in model.named_modules():
        qw = getattr(m, "qw", None)
        if qw is not None:
            if qw.fmt == "int4" and qw.scales.dtype in (torch.float16, torch.bfloat16):
                assert qw.scale_zero is not None, (what, name)  # the GEMV's copy (tiny weights; rows = 1 below)
            for rows in (1, 5, 70):
                x = torch.randn(rows, qw.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)
                err = _rel(m(x), quant_linear_ref(x, qw, m.bias))
                assert err < 2e-2, (what, name, qw.fmt, rows, err)
            checked += 1
        if isinstance(m, FusedMoE) and m.w13_qw is not None and m.w2_qw is not None:
            for tokens in (1, 3, 40):
                h = torch.randn(tokens, m.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
                ids = torch.randint(0, m.num_experts, (tokens, 2), device="cuda", generator=gen)
                ids[:, 1] = (ids[:, 0] + 1) % m.num_experts
                w = torch.rand(tokens, 2, device="cuda", generator=gen)
                y = get_quant_moe_backend("triton")(h, m.w13_qw, m.w2_qw, w, ids)
                err = _rel(y, quant_moe_ref(h, m.w13_qw, m.w2_qw, w, ids))
                assert err < 2e-2, (what, name, m.w13_qw.fmt, tokens, err)
            checked += 1
    return checked


def _generate(path: Path, **kw: object) -> list[int]:
    from ftransformers import LLM, SamplingParams

    llm = LLM(str(path), dtype="bfloat16", device="cuda", skip_tokenizer_init=True, **kw)  # type: ignore[arg-type]
    out = llm.generate(prompt_token_ids=[[3, 17, 5, 9], [8] * 11], sampling_params=SamplingParams(temperature=0.0, max_tokens=6))
    return [t for o in out for t in o.token_ids]


@pytest.mark.parametrize("fmt", sorted(CONFIGS))
def test_cuda_kernels_match_references(fmt: str, ckpts: dict[str, Path], tmp_path: Path) -> None:
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.models.loader import load_model

    kinds = ["qwen3"] if fmt == "gptq_v2_act" else ["qwen3_moe", "deepseek_v3"]
    for kind in kinds:
        path = _dir(ckpts[kind], tmp_path / kind, CONFIGS[fmt])
        model = load_model(ModelConfig.from_pretrained(path, dtype="bfloat16"), "cuda", torch.bfloat16, load_format="dummy")
        assert _check_layers(model, f"{fmt}/{kind}") >= 3
        tokens = _generate(path, load_format="dummy")
        assert len(tokens) == 12 and all(0 <= t < 384 for t in tokens)


@pytest.mark.parametrize("method", ONLINE)
def test_cuda_load_time_quantization(method: str, ckpts: dict[str, Path], tmp_path: Path) -> None:
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.models.loader import load_model

    path = _dir(ckpts["qwen3_moe"], tmp_path / "m", None)
    model = load_model(ModelConfig.from_pretrained(path, dtype="bfloat16"), "cuda", torch.bfloat16, quantization=method)
    assert _check_layers(model, method) >= 3
    float_tokens = _generate(path)
    tokens = _generate(path, quantization=method)
    same = sum(a == b for a, b in zip(tokens, float_tokens))
    print(f"load-time {method}: {same}/12 greedy tokens as the bf16 model")
