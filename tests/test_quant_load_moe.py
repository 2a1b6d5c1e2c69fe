"""Quantized MoE experts in every format (tiny Qwen3-MoE: 8 experts, intermediate 32) and DeepSeek-V3
(FP8 as DeepSeek ships it, with the absorbed kv_b_proj stored FP8 and dequantized on load; AWQ),
CPU. The same checks and tolerances as test_quant_load_dense.py: (a) every dequantized layer and
expert bit-exact (NVFP4 to 1 float32 ulp), (b) greedy decoding against transformers with the
dequantized weights, activations fake-quantized for W8A8 / FP8, expert inputs included. Routers stay
in the model dtype.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model_harness import make_tiny_checkpoint
from tests.test_quant_load_dense import check_format

MOE_FORMATS = ["awq", "gptq", "ct_int4", "ct_int4_asym", "ct_w8a8", "ct_fp8", "ct_nvfp4", "ct_mxfp4", "ct_mixed",
               "fp8", "w8a8_int8"]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe") / "src")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("dsv3") / "src")


@pytest.mark.parametrize("fmt", MOE_FORMATS)
def test_moe_checkpoint_loads_and_matches_transformers(fmt: str, qwen3_moe: Path, tmp_path: Path) -> None:
    check_format(qwen3_moe, tmp_path, fmt)


@pytest.mark.parametrize("fmt", ["fp8", "awq", "ct_nvfp4"])
def test_deepseek_v3_checkpoint_loads_and_matches_transformers(fmt: str, deepseek: Path, tmp_path: Path) -> None:
    check_format(deepseek, tmp_path, fmt)


def test_expert_and_router_layout(qwen3_moe: Path, deepseek: Path, tmp_path: Path) -> None:
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.layers.moe.experts import FusedMoE
    from ftransformers.models.loader import load_model
    from tests.test_quant_load_common import write_quantized

    write_quantized(qwen3_moe, tmp_path / "q", "ct_int4")
    model = load_model(ModelConfig.from_pretrained(tmp_path / "q", dtype="float32"), "cpu", torch.float32)
    moe = next(m for m in model.modules() if isinstance(m, FusedMoE))
    assert moe.w13_qw.qweight.shape == (8, 64, 64 // 8) and moe.w2_qw.qweight.shape == (8, 64, 32 // 8)
    assert moe.w13_qw.scales.shape == (8, 64, 2) and moe.w13_qw.zeros is None
    assert not [n for n, _ in moe.named_parameters()]  # checkpoint layouts freed
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32  # the router
    write_quantized(deepseek, tmp_path / "d", "fp8")
    model = load_model(ModelConfig.from_pretrained(tmp_path / "d", dtype="float32"), "cpu", torch.float32)
    layer = model.model.layers[1]
    # gate and up of 32 rows each share no 128-row block: the scales are refined to 32-row blocks
    assert layer.mlp.experts.w13_qw.block_n == 32 and layer.mlp.shared_experts.gate_up_proj.qw.block_n == 32
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32 and layer.self_attn.kv_b_proj.quant_method is None
    assert layer.self_attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
