"""Quantized loading beyond the happy path, CPU: one-line errors naming the format, the tensor or the
config field; load-time quantization of a float checkpoint (`--quantization fp8 | w8a8_int8 | int4 |
mxfp4 | nvfp4`, `--quantization-ignore`); `load_format=dummy` giving valid tensors in every format.

Load-time quantization is checked exactly: each layer's kernel tensors equal quant/quantizers.py
applied to the float weight the checkpoint holds (per expert for stacked experts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftransformers.config.model_config import ModelConfig
from ftransformers.config.server_args import ServerArgs
from ftransformers.kernels.quant_formats import QuantizedWeight, dequantize
from ftransformers.layers.moe.experts import FusedMoE
from ftransformers.layers.weight_utils import MissingWeightsError, WeightLoadError
from ftransformers.models.loader import load_model
from ftransformers.quant import QuantError, quant_config_for
from ftransformers.quant.quantizers import quantize_weight
from tests.model_harness import make_tiny_checkpoint
from tests.test_quant_load_common import CONFIGS, write_quantized


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    return {kind: make_tiny_checkpoint(kind, root / kind) for kind in ("qwen3", "qwen3_moe", "deepseek_v3")}


def _load(path: Path, **kw: object) -> torch.nn.Module:
    return load_model(ModelConfig.from_pretrained(path, dtype="float32"), "cpu", torch.float32, **kw)  # type: ignore[arg-type]


def _edit(path: Path, config: dict | None = None, drop: str | None = None, replace: dict | None = None) -> Path:
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"].update(config)
        (path / "config.json").write_text(json.dumps(cfg))
    if drop or replace:
        tensors = load_file(str(path / "model.safetensors"))
        tensors.pop(drop or "", None)
        tensors.update(replace or {})
        save_file(tensors, str(path / "model.safetensors"))
    return path


def _one_line_error(path: Path, exc: type[Exception], *needles: str) -> None:
    with pytest.raises(exc) as info:
        _load(path)
    msg = str(info.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


def test_checkpoint_errors_name_format_tensor_and_field(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src = ckpts["qwen3"]
    write_quantized(src, tmp_path / "a", "awq")
    qweight = "model.layers.0.mlp.down_proj.qweight"
    _one_line_error(_edit(tmp_path / "a", {"group_size": 16}), WeightLoadError, "awq group_size 16",
                    "model.layers.0.mlp.down_proj.qzeros", "expected (8, 8)", "got (4, 8)")  # fmt: skip
    _edit(tmp_path / "a", {"group_size": 32})
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    _one_line_error(_edit(tmp_path / "a", replace={qweight: tensors[qweight].float()}), WeightLoadError,
                    qweight, "expected int32, got float32")  # fmt: skip
    _one_line_error(_edit(tmp_path / "a", {"bits": 8}), QuantError, "awq: quantization_config bits 8")
    _one_line_error(_edit(tmp_path / "a", {"bits": 4, "version": "gemv"}), QuantError, "version 'gemv'")
    write_quantized(src, tmp_path / "g", "gptq")
    _one_line_error(_edit(tmp_path / "g", drop="model.layers.1.self_attn.k_proj.scales"), MissingWeightsError,
                    "model.layers.1.self_attn.qkv_proj.scales")  # fmt: skip
    _one_line_error(_edit(tmp_path / "g", {"checkpoint_format": "marlin"}), QuantError, "checkpoint_format 'marlin'")
    write_quantized(src, tmp_path / "c", "ct_int4")
    _one_line_error(_edit(tmp_path / "c", {"config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 3, "type": "int", "strategy": "group", "group_size": 32}}}}), QuantError,
        "config_groups.g", "num_bits 3")  # fmt: skip
    mixed = {"config_groups": {"a": {"targets": ["re:.*k_proj"], "weights": CONFIGS["ct_w8a8"]["config_groups"]["group_0"]["weights"],
                                     "input_activations": CONFIGS["ct_w8a8"]["config_groups"]["group_0"]["input_activations"]},
                               "b": CONFIGS["ct_int4"]["config_groups"]["group_0"]}, "format": "mixed-precision"}  # fmt: skip
    _one_line_error(_edit(tmp_path / "c", mixed), QuantError, "parts of one fused module use different schemes", "k_proj")
    write_quantized(src, tmp_path / "f", "fp8")
    _one_line_error(_edit(tmp_path / "f", {"weight_block_size": None}), QuantError, "fp8", "weight_block_size")
    _one_line_error(_edit(tmp_path / "f", {"quant_method": "bitsandbytes"}), QuantError,
                    "'bitsandbytes' is not supported; supported: awq, compressed-tensors, fp8, gptq, w8a8_int8")  # fmt: skip


def test_act_order_errors(ckpts: dict[str, Path], tmp_path: Path) -> None:
    write_quantized(ckpts["qwen3_moe"], tmp_path / "m", "gptq_v2_act")
    _one_line_error(tmp_path / "m", QuantError, "act-order", "experts", "model.layers.0.mlp.experts")
    write_quantized(ckpts["qwen3"], tmp_path / "d", "gptq_v2_act")
    g_idx = "model.layers.2.self_attn.k_proj.g_idx"
    shuffled = load_file(str(tmp_path / "d" / "model.safetensors"))[g_idx].flip(0).contiguous()
    _one_line_error(_edit(tmp_path / "d", replace={g_idx: shuffled}), QuantError, "model.layers.2.self_attn.qkv_proj",
                    "different g_idx")  # fmt: skip


def test_quantization_flag_resolution(ckpts: dict[str, Path], tmp_path: Path) -> None:
    write_quantized(ckpts["qwen3"], tmp_path / "a", "awq")
    cfg = ModelConfig.from_pretrained(tmp_path / "a", dtype="float32").hf_config
    plain = ModelConfig.from_pretrained(ckpts["qwen3"], dtype="float32").hf_config
    assert quant_config_for(cfg, "awq") is not None and quant_config_for(plain, "auto") is None
    for args, needle in [((cfg, "gptq"), "does not match the checkpoint's quant_method 'awq'"),
                         ((cfg, "fp8"), "does not match"),
                         ((cfg, "none"), "--quantization none"),
                         ((cfg, "auto", ("lm_head",)), "--quantization-ignore applies to load-time quantization"),
                         ((plain, "awq"), "awq cannot quantize at load time"),
                         ((plain, "auto", ("lm_head",)), "--quantization-ignore needs a load-time")]:  # fmt: skip
        with pytest.raises(QuantError, match=needle.replace("(", r"\(")):
            quant_config_for(*args)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)  # the CLI is built from the dataclass
    parsed = ServerArgs.from_cli_args(parser.parse_args(["--quantization", "nvfp4", "--quantization-ignore", "lm_head", "re:.*attn.*"]))
    assert parsed.quantization == "nvfp4" and parsed.quantization_ignore == ("lm_head", "re:.*attn.*")
    assert ServerArgs(quantization_ignore=["x"]).quantization_ignore == ("x",)  # type: ignore[arg-type]


def _float_weights(path: Path) -> dict[str, torch.Tensor]:
    return {k.removesuffix(".weight"): v for k, v in load_file(str(path / "model.safetensors")).items()}


def _same(a: QuantizedWeight, b: QuantizedWeight) -> None:
    assert (a.fmt, a.group_size, a.block_n) == (b.fmt, b.group_size, b.block_n)
    for f in ("qweight", "scales", "zeros", "global_scale"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert torch.equal(x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x,
                               y.view(torch.uint8) if y.dtype == torch.float8_e4m3fn else y), f  # fmt: skip


@pytest.mark.parametrize("method", ["fp8", "w8a8_int8", "int4", "mxfp4", "nvfp4"])
def test_load_time_quantization(method: str, ckpts: dict[str, Path]) -> None:
    src = ckpts["qwen3_moe"]
    model = _load(src, quantization=method, quantization_ignore=("re:.*self_attn.*",))
    w = _float_weights(src)
    fmt = {"fp8": "fp8_block", "w8a8_int8": "int8"}.get(method, method)

    def kw(k: int) -> dict[str, object]:  # load-time int4: group 128, or the largest of 64 / 32 / 16 dividing K
        return {"group_size": next(g for g in (128, 64, 32, 16) if k % g == 0), "symmetric": True} if method == "int4" else {}

    layer0 = model.model.layers[0]
    assert layer0.self_attn.qkv_proj.quant_method is None and layer0.self_attn.qkv_proj.weight.dtype == torch.float32
    down = model.model.layers[1].mlp.down_proj  # dense MLP layer (mlp_only_layers)
    _same(down.qw, quantize_weight(w["model.layers.1.mlp.down_proj"], fmt, **kw(128)))
    gate_up = torch.cat([w["model.layers.1.mlp.gate_proj"], w["model.layers.1.mlp.up_proj"]])
    _same(model.model.layers[1].mlp.gate_up_proj.qw, quantize_weight(gate_up, fmt, **kw(64)))
    moe = layer0.mlp.experts
    assert isinstance(moe, FusedMoE) and moe.w13_qw is not None and moe.w2_qw is not None
    for e in (0, 5):
        w2 = w[f"model.layers.0.mlp.experts.{e}.down_proj"]
        _same(moe.w2_qw.expert(e), quantize_weight(w2, fmt, **kw(32)))
    assert layer0.mlp.gate.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    back = dequantize(moe.w13_qw)[3, :32]
    err = (back - w["model.layers.0.mlp.experts.3.gate_proj"]).norm() / back.norm()
    assert err < {"fp8": 0.05, "w8a8_int8": 0.01}.get(method, 0.25), err


@pytest.mark.parametrize("fmt", sorted(CONFIGS))
def test_dummy_weights_are_valid_in_every_format(fmt: str, ckpts: dict[str, Path], tmp_path: Path) -> None:
    kind = "qwen3" if fmt == "gptq_v2_act" else "deepseek_v3"  # act order: dense layers only
    (tmp_path / fmt).mkdir()
    cfg = json.loads((ckpts[kind] / "config.json").read_text())
    cfg["quantization_config"] = CONFIGS[fmt]
    (tmp_path / fmt / "config.json").write_text(json.dumps(cfg))
    model = _load(tmp_path / fmt, load_format="dummy")
    qws = [m.qw for m in model.modules() if getattr(m, "qw", None) is not None]
    qws += [q for m in model.modules() if isinstance(m, FusedMoE) for q in (m.w13_qw, m.w2_qw) if q is not None]
    assert len(qws) >= 6
    for qw in qws:
        w = dequantize(qw)
        assert bool(torch.isfinite(w).all()) and 1e-5 < float(w.abs().max()) < 4e-3, (fmt, qw.fmt, float(w.abs().max()))
        if qw.perm is not None:
            assert sorted(qw.perm.tolist()) == list(range(qw.in_features))
    perms = [qw.perm for qw in qws if qw.perm is not None]
    assert bool(perms) == (fmt == "gptq_v2_act")
    ids = torch.tensor([3, 17, 5])
    from ftransformers.attention.backend import create_attention_backend
    from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode, forward_context
    from ftransformers.cache.kv_pool import make_kv_pool

    spec = type(model).kv_spec(model.config)
    t = lambda x: torch.tensor(x, dtype=torch.int64)
    fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=t([0, 1, 2]), out_cache_loc=t([1, 2, 3]),
                      req_pool_indices=t([0]), seq_lens=t([3]), prefix_lens=t([0]), extend_lens=t([3]),
                      seq_lens_cpu=[3], prefix_lens_cpu=[0], extend_lens_cpu=[3], logits_indices=t([2]),
                      req_to_token=t([[1, 2, 3]]), kv_pool=make_kv_pool(spec, 8, torch.float32, "cpu"),
                      attn_backend=create_attention_backend("torch_native"), moe_backend="torch_native")  # fmt: skip
    with torch.no_grad(), forward_context(fb):
        logits = model.compute_logits(model(fb.input_ids, fb.positions)[fb.logits_indices])
    assert bool(torch.isfinite(logits).all())
