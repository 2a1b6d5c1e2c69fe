"""W8A8 INT8 (per-channel weights, dynamic per-token activations): the reference linear against
plain dequantized math, config resolution, and the whole path `ftransformers quantize` -> load ->
generate against transformers running the same fake-quantized model (float32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ftransformers import LLM, SamplingParams
from ftransformers.entrypoints.quantize import main as quantize_main
from ftransformers.quant import QuantError, quant_config_for
from ftransformers.kernels.quant_formats import quant_linear_ref, quantize_act_int8
from ftransformers.quant.quantizers import quantize_int8
from tests.model_harness import make_tiny_checkpoint

NEW_TOKENS = 12


def test_reference_linear_is_dequantized_math() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=gen) * torch.linspace(0.1, 4, 96)  # uneven channels, like real activations
    w = torch.randn(40, 96, generator=gen)
    b = torch.randn(40, generator=gen)
    qw = quantize_int8(w)
    wq, sw = qw.qweight, qw.scales[:, None]
    xq, sx = quantize_act_int8(x)
    assert wq.dtype == xq.dtype == torch.int8 and wq.abs().max() <= 127 and xq.abs().max() <= 127
    assert ((wq.float() * sw - w).abs() <= sw / 2 + 1e-6).all()  # round to nearest
    assert ((xq.float() * sx - x).abs() <= sx / 2 + 1e-6).all()
    want = (xq.float() * sx) @ (wq.float() * sw).t() + b
    torch.testing.assert_close(quant_linear_ref(x, qw, b), want, rtol=1e-5, atol=1e-5)


def test_config_resolution() -> None:
    class Cfg:
        quantization_config = {"quant_method": "w8a8_int8", "ignore": ["lm_head"]}

    class Plain:
        pass

    qc = quant_config_for(Cfg())
    assert qc is not None and qc.method == "w8a8_int8" and qc.ignore == ("lm_head",)
    assert quant_config_for(Plain()) is None
    assert quant_config_for(Cfg(), "w8a8_int8") is not None
    online = quant_config_for(Plain(), "w8a8_int8")  # a float checkpoint: quantized at load time
    assert online is not None and online.online
    with pytest.raises(QuantError, match="no quantization_config"):
        quant_config_for(Plain(), "awq")  # AWQ cannot be made at load time
    with pytest.raises(QuantError, match="checkpoint is quantized"):
        quant_config_for(Cfg(), "none")
    Cfg.quantization_config = {"quant_method": "awq-ish"}
    with pytest.raises(QuantError, match="not supported; supported: .*w8a8_int8"):
        quant_config_for(Cfg())
    assert qc.is_ignored(["model.lm_head"]) and not qc.is_ignored(["model.layers.0.mlp.down_proj"])


def _fake_quant_logprobs(path: Path, qpath: Path, sequences: list[list[int]], starts: list[int]) -> list[torch.Tensor]:
    """transformers, float32, with every quantized Linear replaced by the dequantized weight and a
    per-token int8 round trip of its input (the function the engine must compute): log-softmax
    [len - start, V] of each teacher-forced sequence at the positions that chose tokens start.."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tensors = {}
    for f in qpath.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and f"{name}.weight_scale" in tensors:
            wq, sw = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
            module.weight.data = wq.float() * sw.float()

            def pre(mod: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
                x = args[0]
                xq, sx = quantize_act_int8(x.reshape(-1, x.shape[-1]))
                return ((xq.float() * sx).view_as(x),)

            module.register_forward_pre_hook(pre)
            n += 1
    assert n > 0
    with torch.no_grad():
        return [
            model(torch.tensor([seq])).logits[0, start - 1 : -1].log_softmax(-1)
            for seq, start in zip(sequences, starts)
        ]


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_quantize_then_generate_matches_fake_quant_transformers(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MoE experts are quantized too; this reference fakes nn.Linear layers only, so the MoE model
    keeps its experts in float here (--ignore); test_quantize_e2e.py covers quantized experts."""
    src = make_tiny_checkpoint(kind, tmp_path / "src")
    dst = tmp_path / "w8a8"
    ignore = ["re:.*experts.*"] if kind == "qwen3_moe" else []
    assert (
        quantize_main(["--model-path", str(src), "--output", str(dst), "--method", "w8a8-int8", "--ignore", *ignore])
        == 0
    )
    assert "weights quantized" in capsys.readouterr().out
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "w8a8_int8" and "lm_head" in cfg["ignore"]  # what stays float, by name
    if kind == "llama":
        assert cfg["ignore"] == ["lm_head"]
    else:
        assert {"model.layers.0.mlp.gate", "model.layers.2.mlp.experts.7.down_proj"} <= set(cfg["ignore"])

    llm = LLM(str(dst), dtype="float32", device="cpu", skip_tokenizer_init=True)
    layers = [m for m in llm.runner.model.modules() if getattr(m, "quant_method", None) is not None]
    assert layers and all(m.weight.dtype == torch.int8 for m in layers)
    if kind == "qwen3_moe":  # the router stays full precision (read as a plain weight)
        assert all(blk.gate.weight.dtype == torch.float32 for blk in llm.runner.model.modules()
                   if type(blk).__name__ == "Qwen3MoeSparseMoeBlock")  # fmt: skip
    prompts = [[5, 9, 17, 33, 2], [7] * 9]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    refs = _fake_quant_logprobs(src, dst, [p + o.token_ids for p, o in zip(prompts, outs)], [len(p) for p in prompts])
    diffs = []
    for out, ref in zip(outs, refs):
        for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry.token_id == tok
            # Greedy picks transformers' choice, or the other side of a near-tie (gap <= 0.05).
            assert ref[step].max() - ref[step][tok] <= 0.05, (step, tok)
            diffs.append(abs(entry.logprob - ref[step][tok].item()))
    # Per-token int8 rounding turns 1e-7 differences in a layer's input (op order) into whole int8 steps
    # now and then, so the engine is not bit-equal to the fake-quant model (an unquantized float32
    # engine matches transformers to 1e-3): at this width one flipped step moves a log-prob by up to
    # ~0.03. Bounds: mean 5e-3, max 0.05.
    assert sum(diffs) / len(diffs) <= 5e-3 and max(diffs) <= 0.05, (sum(diffs) / len(diffs), max(diffs))


def test_ignore_keeps_modules_in_full_precision(tmp_path: Path) -> None:
    src = make_tiny_checkpoint("llama", tmp_path / "src")
    dst = tmp_path / "w8a8"
    assert quantize_main(["--model-path", str(src), "--output", str(dst), "--method", "w8a8-int8",
                          "--ignore", "re:.*down_proj", "model.layers.0.self_attn.k_proj"]) == 0  # fmt: skip
    llm = LLM(str(dst), dtype="float32", device="cpu", skip_tokenizer_init=True)
    kinds = {n: m.weight.dtype for n, m in llm.runner.model.named_modules() if n.endswith(("down_proj", "qkv_proj"))}
    assert all(dt == torch.float32 for n, dt in kinds.items() if n.endswith("down_proj"))
    # k_proj is part of the fused qkv_proj of layer 0: the whole fused module stays unquantized
    assert kinds["model.layers.0.self_attn.qkv_proj"] == torch.float32
    assert kinds["model.layers.1.self_attn.qkv_proj"] == torch.int8


def test_quantize_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_tiny_checkpoint("llama", tmp_path / "src")
    dst = tmp_path / "w8a8"
    assert quantize_main(["--model-path", str(src), "--output", str(dst), "--method", "w8a8-int8"]) == 0
    capsys.readouterr()
    for args, needle in [
        (["--model-path", str(dst), "--output", str(tmp_path / "again")], "already quantized"),
        (["--model-path", str(src), "--output", str(dst)], "not empty"),
        (["--model-path", str(tmp_path / "nope"), "--output", str(tmp_path / "x")], "no config.json"),
    ]:
        assert quantize_main([*args, "--method", "w8a8-int8"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        quantize_main(["--model-path", str(src), "--output", str(tmp_path / "y"), "--method", "nf4"])
    assert exc.value.code == 2


def test_none_refuses_a_quantized_checkpoint(tmp_path: Path) -> None:
    src = make_tiny_checkpoint("llama", tmp_path / "src")
    dst = tmp_path / "w8a8"
    assert quantize_main(["--model-path", str(src), "--output", str(dst), "--method", "w8a8-int8"]) == 0
    with pytest.raises(QuantError, match="--quantization none"):
        LLM(str(dst), dtype="float32", device="cpu", skip_tokenizer_init=True, quantization="none")


def test_smoothquant_keeps_the_float_model_and_shrinks_activation_outliers(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from ftransformers.entrypoints.quantize import smooth, smoothquant_scales

    src = make_tiny_checkpoint("qwen3", tmp_path / "src")
    calib = torch.randint(3, 300, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    divide_out, multiply_in = smoothquant_scales(src, calib, alpha=0.5)
    assert any(k.endswith("input_layernorm.weight") for k in divide_out)
    assert any(k.endswith("mlp.up_proj.weight") for k in divide_out)  # producer of down_proj's input
    assert any(k.endswith("mlp.up_proj.weight") for k in multiply_in)  # and a consumer of the MLP norm
    tensors = load_file(str(src / "model.safetensors"))
    smoothed = {k: smooth(k, v, divide_out, multiply_in) for k, v in tensors.items()}
    out = tmp_path / "smoothed"
    out.mkdir()
    save_file(smoothed, str(out / "model.safetensors"))
    (out / "config.json").write_text((src / "config.json").read_text())
    ids = torch.tensor([calib[:40]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the float function is unchanged


def test_quantize_with_calibration_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    from ftransformers.entrypoints.quantize import quantize_checkpoint

    src = make_tiny_checkpoint("llama", tmp_path / "src")
    calib = torch.randint(3, 300, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    summary = quantize_checkpoint(src, tmp_path / "q", "w8a8-int8", calib_ids=calib)
    assert summary["smoothed_groups"] == 3 * 3  # per layer: qkv, gate_up, down
    llm = LLM(str(tmp_path / "q"), dtype="float32", device="cpu", skip_tokenizer_init=True)
    out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].token_ids) == 4
