"""`ftransformers quantize`: write a quantized copy of a Hugging Face checkpoint.

    ftransformers quantize --model-path IN --output OUT --method w8a8-int8 [--ignore MODULE ...]
        [--calib-data FILE [--smooth-alpha 0.5]]

With `--calib-data` (a text file), w8a8-int8 first applies SmoothQuant: per input channel j of the
layers after each RMSNorm (q/k/v and gate/up) and of down_proj, s_j = max|X_j|^a / max|W_:,j|^(1-a)
from activations recorded on the calibration text; W[:, j] *= s_j and the producer of X_j (the
norm's weight, or up_proj's row j for down_proj) is divided by s_j, so the float model is unchanged
while activation outliers move into the weights, where per-channel INT8 absorbs them. It applies to
Llama-style decoder layers (Llama, Qwen3; the dense MLPs of MoE models are smoothed, experts are not
quantized); other layers are quantized unsmoothed.

Which tensors are quantized is decided by the same rule the loader applies (`apply_quant_config` on
the model built on the meta device), so what is written is exactly what ftransformers loads: every
linear layer of the model except the ignored ones and those its model keeps in full precision (MoE
routers, MLA's kv_b_proj; MoE experts are not quantized yet). Tensors stream one at a time; the
output is sharded at `shard_bytes`, with an index when there is more than one shard. Every file of
the input folder that is not a weight file (config, tokenizer, generation config) is copied, and
config.json gains the `quantization_config` vLLM and SGLang read.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ftransformers.quant.base import QuantError, checkpoint_module_names, apply_quant_config, quant_config_for
from ftransformers.quant.w8a8_int8 import quantize_per_channel

# --method name -> (quant_method written to config.json, tensor quantizer: weight -> {suffix: tensor})
METHODS: dict[str, tuple[str, Callable[[torch.Tensor], dict[str, torch.Tensor]]]] = {}


def _w8a8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale = quantize_per_channel(weight)
    return {"weight": q, "weight_scale": scale}


METHODS["w8a8-int8"] = ("w8a8_int8", _w8a8)


def quantized_module_names(hf_config: Any, quant_method: str, ignore: Sequence[str]) -> set[str]:
    """Checkpoint module names (e.g. model.layers.0.self_attn.q_proj) the loader expects quantized."""
    from types import SimpleNamespace

    from ftransformers.models.registry import get_model_class

    written = SimpleNamespace(quantization_config={"quant_method": quant_method, "ignore": list(ignore)})
    qconfig = quant_config_for(written, "auto")  # the config the loader will build from what we write
    assert qconfig is not None
    model_cls = get_model_class(getattr(hf_config, "architectures", None) or [])
    with torch.device("meta"):
        model = model_cls(hf_config)
    done = apply_quant_config(model, qconfig)
    stacked = getattr(model, "stacked_params_mapping", ())
    return {hf for name in done for hf in checkpoint_module_names(name, stacked)}


def smoothquant_scales(model_path: Path, calib_ids: list[int], alpha: float, max_tokens: int = 4096,
                       window: int = 512) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SmoothQuant factors by checkpoint tensor name: (divide_out, multiply_in). divide_out: a
    producer's output channels (a norm weight [C], or up_proj's rows [C, D]) are divided by s [C];
    multiply_in: a consumer's input columns ([N, C]) are multiplied by the same s."""
    from transformers import AutoModelForCausalLM

    ids = list(calib_ids)[:max_tokens]
    if len(ids) < 16:
        raise QuantError("--calib-data has fewer than 16 tokens")
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    act_max: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(_m: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            m = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
            act_max[name] = torch.maximum(act_max[name], m) if name in act_max else m

        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for i in range(0, len(ids), window):
            model(torch.tensor([ids[i : i + window]]))
    for h in handles:
        h.remove()
    params = dict(model.named_parameters())
    divide_out: dict[str, torch.Tensor] = {}
    multiply_in: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        attn, mlp = getattr(module, "self_attn", None), getattr(module, "mlp", None)
        groups = []
        if attn is not None and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")):
            groups.append((f"{name}.input_layernorm.weight", [f"{name}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]))
        if mlp is not None and all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
            groups.append((f"{name}.post_attention_layernorm.weight", [f"{name}.mlp.gate_proj", f"{name}.mlp.up_proj"]))
            groups.append((f"{name}.mlp.up_proj.weight", [f"{name}.mlp.down_proj"]))
        for producer, consumers in groups:
            if producer not in params or consumers[0] not in act_max:
                continue
            w_max = torch.stack([params[f"{c}.weight"].detach().abs().amax(0) for c in consumers]).amax(0)
            s = (act_max[consumers[0]].clamp_min(1e-5) ** alpha / w_max.clamp_min(1e-5) ** (1 - alpha)).clamp_min(1e-5)
            divide_out[producer] = s
            for c in consumers:
                multiply_in[f"{c}.weight"] = s
    return divide_out, multiply_in


def _smooth(name: str, tensor: torch.Tensor, divide_out: dict[str, torch.Tensor],
            multiply_in: dict[str, torch.Tensor]) -> torch.Tensor:
    if name not in divide_out and name not in multiply_in:
        return tensor
    t = tensor.float()
    if name in multiply_in:
        t = t * multiply_in[name][None, :]  # input column j grows by s_j
    if name in divide_out:  # output channel j shrinks by s_j (for up_proj: silu(g) * u is linear in u)
        s = divide_out[name]
        t = t / (s if t.dim() == 1 else s[:, None])
    return t.to(tensor.dtype)


def quantize_checkpoint(
    model_path: str | Path,
    output: str | Path,
    method: str,
    ignore: Sequence[str] = (),
    shard_bytes: int = 4 << 30,
    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
    calib_ids: list[int] | None = None,
    smooth_alpha: float = 0.5,
) -> dict[str, Any]:
    """Quantize `model_path` into `output`; returns a summary (tensors quantized, bytes in and out)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from ftransformers.models.loader import iterate_weights, weight_files

    if method not in METHODS:
        raise QuantError(f"unknown --method {method!r}; available: {', '.join(sorted(METHODS))}")
    src, dst = Path(model_path), Path(output)
    if not (src / "config.json").is_file():
        raise QuantError(f"{src} has no config.json")
    if dst.exists() and any(dst.iterdir()):
        raise QuantError(f"output folder {dst} is not empty")
    quant_method, quantize = METHODS[method]
    hf_config = AutoConfig.from_pretrained(str(src))
    if getattr(hf_config, "quantization_config", None):
        raise QuantError(f"{src} is already quantized")
    targets = quantized_module_names(hf_config, quant_method, ignore)
    divide_out: dict[str, torch.Tensor] = {}
    multiply_in: dict[str, torch.Tensor] = {}
    if calib_ids is not None:
        if method != "w8a8-int8":
            raise QuantError(f"--calib-data is not used by --method {method}")
        divide_out, multiply_in = smoothquant_scales(src, calib_ids, smooth_alpha)
    summary_smoothed = len(divide_out)
    files = weight_files(src)  # checks the weight files exist before anything is written
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    summary = {"method": method, "quantized_tensors": 0, "bytes_in": 0, "bytes_out": 0, "files_in": len(files),
               "smoothed_groups": summary_smoothed}
    weights = iterate_weights(src)
    for name, tensor in progress(weights) if progress else weights:
        summary["bytes_in"] += tensor.numel() * tensor.element_size()
        tensor = _smooth(name, tensor, divide_out, multiply_in)
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and module in targets:
            out = {f"{module}.{k}": v.contiguous() for k, v in quantize(tensor).items()}
            summary["quantized_tensors"] += 1
        else:
            out = {name: tensor}
        for key, value in out.items():
            nbytes = value.numel() * value.element_size()
            if size + nbytes > shard_bytes and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][key] = value
            size += nbytes
            summary["bytes_out"] += nbytes
    if summary["quantized_tensors"] == 0:
        raise QuantError(f"no weight of {src} matched a quantizable layer")
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": summary["bytes_out"]}, "weight_map": weight_map}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": quant_method, "ignore": list(ignore)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="ftransformers quantize", description="Write a quantized checkpoint.")
    parser.add_argument("--model-path", required=True, help="Hugging Face checkpoint folder (bf16/fp16/fp32)")
    parser.add_argument("--output", required=True, help="new folder for the quantized checkpoint")
    parser.add_argument("--method", required=True, choices=sorted(METHODS))
    parser.add_argument("--ignore", nargs="*", default=[], metavar="MODULE",
                        help="checkpoint module names (or re:regex) kept in full precision, e.g. lm_head")
    parser.add_argument("--calib-data", default=None, metavar="FILE",
                        help="calibration text (w8a8-int8: SmoothQuant before quantizing)")
    parser.add_argument("--smooth-alpha", type=float, default=0.5, help="SmoothQuant migration strength")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    try:
        calib = None
        if args.calib_data:
            from transformers import AutoTokenizer

            text = Path(args.calib_data).read_text()
            calib = AutoTokenizer.from_pretrained(args.model_path)(text)["input_ids"]
        summary = quantize_checkpoint(args.model_path, args.output, args.method, args.ignore,
                                      progress=lambda it: tqdm(it, desc="tensors", unit="tensor"),
                                      calib_ids=calib, smooth_alpha=args.smooth_alpha)
    except (QuantError, OSError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    smoothed = f", {summary['smoothed_groups']} groups smoothed" if summary["smoothed_groups"] else ""
    print(f"wrote {args.output}: {summary['quantized_tensors']} weights quantized ({args.method}{smoothed}), "
          f"{summary['bytes_in'] / 1e6:.1f} MB -> {summary['bytes_out'] / 1e6:.1f} MB")
    return 0
