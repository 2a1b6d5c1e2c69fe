"""AWQ's scale and clip searches, GPTQ, the CPU-expert INT4 files, and the quantize command's errors.

Bounds (float32 throughout):
- AWQ's folding keeps the float model: logits of the rescaled (unclipped) checkpoint match the original
  to 1e-4 (float32 op-order differences through 3 layers).
- AWQ's search on a layer whose inputs carry outlier channels: output MSE at most 0.7x round-to-nearest's
  (α = 0 is round-to-nearest, so it can never be worse; outliers make it clearly better).
- GPTQ's layer output error on its calibration inputs is at most round-to-nearest's (its objective); with
  correlated inputs at most 0.8x. With an identity Hessian GPTQ is round-to-nearest exactly.
- CPU experts: each dequantized weight within half a step (scale / 2 + 1e-6) of the float weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ftransformers.entrypoints.quantize import main as quantize_main
from ftransformers.entrypoints.quantize import quantize_checkpoint
from ftransformers.entrypoints.quantize.awq import awq_calibrate, fake_int4, search_clip, search_scale
from ftransformers.entrypoints.quantize.gptq import gptq_quantize, hessian, rtn_gptq
from ftransformers.kernels.quant_formats import dequantize
from ftransformers.quant import QuantError
from tests.model_harness import make_tiny_checkpoint
from tests.test_quantize_formats import calib_ids


def _outlier_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[:4]] *= 30.0  # a few channels with large activations
    return x


def test_awq_fake_quant_is_the_checkpoint_grid() -> None:
    from ftransformers.quant.quantizers import quantize_int4

    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(8)) * torch.linspace(0.01, 3, 256)
    want = dequantize(quantize_int4(w, 64, symmetric=False, scale_dtype=torch.float16))
    torch.testing.assert_close(fake_int4(w, 64), want, rtol=0, atol=0)


def test_awq_search_beats_round_to_nearest_with_outlier_channels() -> None:
    x = _outlier_inputs(512, 256, 0)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    s, best, rtn = search_scale(x.abs().mean(0), [(w, x)], 64)
    direct = ((x @ (fake_int4(w * s, 64) / s).t() - x @ w.t()) ** 2).mean().item()
    plain = ((x @ fake_int4(w, 64).t() - x @ w.t()) ** 2).mean().item()
    assert abs(direct - best) <= 1e-4 * best and abs(plain - rtn) <= 1e-4 * rtn
    assert best <= 0.7 * rtn, (best, rtn)


def test_awq_clip_never_raises_the_group_error() -> None:
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(2))
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    w[0, 5] = 12.0  # one weight outlier: clipping it pays off
    mx = search_clip(w, x, 32)
    clipped = torch.maximum(torch.minimum(w.view(32, 4, 32), mx), -mx).view(32, 128)
    err = ((x @ fake_int4(clipped, 32).t() - x @ w.t()) ** 2).mean()
    base = ((x @ fake_int4(w, 32).t() - x @ w.t()) ** 2).mean()
    assert err <= base and (mx < w.abs().view(32, 4, 32).amax(-1, keepdim=True)).any()


def _with_tensors(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import load_file, save_file

    state = load_file(str(src / "model.safetensors"))
    state.update({k: v.contiguous().clone() for k, v in tensors.items()})
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize("kind, overrides", [("llama", {"num_key_value_heads": 4}), ("qwen3_moe", {}), ("deepseek_v3", {})])
def test_awq_rescaling_keeps_the_float_model(kind: str, overrides: dict, tmp_path: Path) -> None:
    """Every scale group (q/k/v, o after v with heads == kv heads, gate/up + experts + router, down
    after up, MLA's q_b after q_a_layernorm) folds exactly; the groups were really rescaled."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_checkpoint(kind, tmp_path / "src", **overrides)
    targets = {n.removesuffix(".weight") for n in _names(src) if n.endswith("proj.weight") and "kv_b_proj" not in n}
    tensors, stats = awq_calibrate(src, calib_ids(), targets, 32, clip=False)
    assert stats["groups"] > 0 and stats["awq_loss"] <= stats["rtn_loss"]
    if kind == "llama":
        assert "model.layers.0.self_attn.v_proj.weight" in tensors  # o_proj's producer
    if kind == "qwen3_moe":
        assert "model.layers.0.mlp.gate.weight" in tensors  # the router follows the norm's rescaling
    if kind == "deepseek_v3":
        assert "model.layers.0.self_attn.q_a_layernorm.weight" in tensors
    out = _with_tensors(src, tmp_path / "awq", tensors)
    ids = torch.tensor([calib_ids(40, 7)])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _names(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _correlated_inputs(t: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, k // 4, generator=gen) @ torch.randn(k // 4, k, generator=gen) + 0.1 * torch.randn(t, k, generator=gen)


@pytest.mark.parametrize("symmetric, desc_act", [(True, False), (False, False), (True, True)])
def test_gptq_output_error_not_above_round_to_nearest(symmetric: bool, desc_act: bool) -> None:
    x = _correlated_inputs(1024, 256, 4)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    qw = gptq_quantize(w, hessian(x), 64, symmetric, desc_act)
    wq = dequantize(qw)
    if desc_act:
        assert torch.equal(qw.perm, torch.argsort(torch.diag(hessian(x)), descending=True, stable=True))
        wq = wq[:, torch.argsort(qw.perm)]
    err = ((x @ (wq - w).t()) ** 2).mean()
    base = ((x @ (dequantize(rtn_gptq(w, 64, symmetric)) - w).t()) ** 2).mean()
    assert err <= 0.8 * base, (err, base)


def test_gptq_with_identity_hessian_is_round_to_nearest() -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(6))
    for sym in (True, False):
        got, want = gptq_quantize(w, torch.eye(128), 32, sym), rtn_gptq(w, 32, sym)
        assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)


def test_cpu_expert_files(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from ftransformers.entrypoints.quantize.cpu_weights import load_cpu_experts

    src = make_tiny_checkpoint("qwen3_moe", tmp_path / "src")  # MoE layers 0 and 2 (layer 1 is dense)
    summary = quantize_checkpoint(src, tmp_path / "q", "rtn-int4", group_size=32, cpu_weight_path=tmp_path / "cpu")
    assert summary["cpu_expert_layers"] == 2
    manifest = json.loads((tmp_path / "cpu" / "manifest.json").read_text())
    assert sorted(manifest["layers"]) == ["0", "2"]
    raw = load_file(str(tmp_path / "cpu" / manifest["layers"]["0"]["file"]))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in raw.items()} == {
        "w13_qweight": (torch.uint8, (8, 64, 32)), "w13_scale": (torch.float32, (8, 64)),
        "w2_qweight": (torch.uint8, (8, 64, 16)), "w2_scale": (torch.float32, (8, 64))}  # fmt: skip
    state = load_file(str(src / "model.safetensors"))
    for layer in (0, 2):
        w13, w2 = load_cpu_experts(tmp_path / "cpu", layer)
        raw = load_file(str(tmp_path / "cpu" / manifest["layers"][str(layer)]["file"]))
        p = f"model.layers.{layer}.mlp.experts"
        want13 = torch.stack([torch.cat([state[f"{p}.{e}.gate_proj.weight"], state[f"{p}.{e}.up_proj.weight"]]) for e in range(8)])
        want2 = torch.stack([state[f"{p}.{e}.down_proj.weight"] for e in range(8)])
        for got, want, scale in ((w13, want13, raw["w13_scale"]), (w2, want2, raw["w2_scale"])):
            assert got.shape == want.shape
            assert ((got - want).abs() <= scale.unsqueeze(-1) / 2 + 1e-6).all()
    with pytest.raises(QuantError, match="no MoE layer 1"):
        load_cpu_experts(tmp_path / "cpu", 1)


def _save_word_tokenizer(path: Path, vocab: int = 384) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab - 1)} | {"[UNK]": vocab - 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))


def test_cli_awq_with_calibration_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_tiny_checkpoint("llama", tmp_path / "src")
    _save_word_tokenizer(src)
    (tmp_path / "calib.txt").write_text(" ".join(f"w{i}" for i in calib_ids(800, 3)))
    assert quantize_main(["--model-path", str(src), "--output", str(tmp_path / "q"), "--method", "awq",
                          "--group-size", "32", "--calib-data", str(tmp_path / "calib.txt"), "--calib-tokens", "512",
                          "--ignore", "re:.*down_proj"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "AWQ search: output MSE" in out and "weights quantized (awq" in out
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert {f"model.layers.{i}.mlp.down_proj" for i in range(3)} <= set(cfg["modules_to_not_convert"])  # names, no regex
    assert (tmp_path / "q" / "tokenizer.json").is_file()


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_tiny_checkpoint("llama", tmp_path / "src")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    cfg = json.loads((src / "config.json").read_text()) | {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    (gpt2 / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    cases = [
        (["--method", "rtn-int4", "--group-size", "48"], "--group-size 48 does not divide in_features"),
        (["--method", "awq", "--group-size", "32"], "needs calibration text: --calib-data FILE"),
        (["--method", "gptq", "--calib-data", str(tmp_path / "missing.txt")], "no such file"),
        (["--method", "fp8", "--group-size", "32"], "--group-size is not used by --method fp8"),
        (["--method", "rtn-int4", "--desc-act"], "--desc-act is for --method gptq"),
        (["--method", "mxfp4", "--model-path", str(gpt2)], "GPT2LMHeadModel"),
    ]
    capsys.readouterr()
    for extra, needle in cases:
        args = ["--model-path", str(src), "--output", str(tmp_path / "out"), *extra]
        args = args[2:] if "--model-path" in extra else args
        assert quantize_main(args) == 1, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exc:
        quantize_main(["--model-path", str(src), "--output", str(tmp_path / "y"), "--method", "int3"])
    assert exc.value.code == 2
