"""Write a quantized copy of a Hugging Face checkpoint (the `--method` table is in writers.py).

Which modules are quantized is the loader's rule, run on the model built on the meta device:
`apply_quant_config` with the config about to be written (when the loader cannot read it, the same
rule is applied here: linears not ignored and not `skip_quant`, `FusedMoE` experts not ignored, each
expert as `...experts.{e}.{gate,up,down}_proj`). Everything left in float (MoE routers, MLA's
kv_b_proj, ignored modules) and `lm_head` are named in the written ignore list, so vLLM / SGLang
leave them in float too. Tensors stream one at a time (AWQ's
rescaled tensors and GPTQ's results replace theirs); the output is sharded at `shard_bytes`.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ftransformers.entrypoints.quantize.writers import METHOD_SPECS, MethodSpec, QuantOptions, check_shape
from ftransformers.kernels.quant_formats import QuantizedWeight
from ftransformers.quant.base import QuantError, apply_quant_config, checkpoint_module_names, quant_config_for

Progress = Callable[[Iterable[Any]], Iterable[Any]]


@dataclass(frozen=True)
class ModulePlan:
    targets: set[str]  # checkpoint module names to quantize
    fused_key: dict[str, str]  # target -> the fused module it loads into (q_proj -> qkv_proj)
    written_ignore: list[str]  # lm_head and every linear module left in float (--ignore's matches included)
    moe_layers: dict[str, int]  # experts prefix (model.layers.3.mlp.experts) -> number of experts
    note: str = "loader"  # whose rule chose the targets


def _is_ignored(patterns: Sequence[str], names: Iterable[str]) -> bool:
    """The ignore-list semantics of quant/base.py: a name, a dotted suffix of one, or `re:` + a regex."""
    for name in names:
        for p in patterns:
            if (re.fullmatch(p[3:], name) if p.startswith("re:") else name == p or name.endswith("." + p)):
                return True
    return False


def _loader_rule(model: torch.nn.Module, quant_config: dict[str, Any]) -> set[str]:
    """Names of the modules the loader quantizes when it reads `quant_config` (our fused / FusedMoE names)."""
    qconfig = quant_config_for(SimpleNamespace(quantization_config=quant_config), "auto")
    assert qconfig is not None
    return set(apply_quant_config(model, qconfig))


def plan_modules(hf_config: Any, make_config: Callable[[list[str]], dict[str, Any]], ignore: Sequence[str]) -> ModulePlan:
    """The loader's rule when it can read the config `make_config(ignore list)`; else the same rule applied
    here (every linear not ignored and not `skip_quant`, every FusedMoE not ignored); `note` says which."""
    from ftransformers.layers.linear import LinearBase
    from ftransformers.layers.moe import FusedMoE
    from ftransformers.models.registry import get_model_class

    model_cls = get_model_class(getattr(hf_config, "architectures", None) or [])
    with torch.device("meta"):
        model = model_cls(hf_config)
    stacked = getattr(model, "stacked_params_mapping", ())
    modules = dict(model.named_modules())
    experts = {n: m.num_experts for n, m in modules.items() if isinstance(m, FusedMoE)}

    def expert_names(name: str) -> list[str]:
        return [f"{name}.{e}.{p}" for e in range(experts[name]) for p in ("gate_proj", "up_proj", "down_proj")]

    float_linears = [hf for name, m in modules.items() if isinstance(m, LinearBase) and getattr(m, "skip_quant", False)
                     for hf in checkpoint_module_names(name, stacked)]  # fmt: skip
    candidates = [hf for name, m in modules.items() if isinstance(m, LinearBase) for hf in checkpoint_module_names(name, stacked)]
    candidates += [hf for name in experts for hf in expert_names(name)]
    # --ignore patterns become the module names they match: AWQ / GPTQ / FP8 readers know no regexes
    matched = [n for n in candidates if _is_ignored(ignore, [n])]
    rule_ignore = list(dict.fromkeys([*matched, "lm_head", *float_linears]))
    note = "loader"
    try:
        done = _loader_rule(model, make_config(rule_ignore))
    except QuantError as exc:
        note = f"the loader cannot read this config ({' '.join(str(exc).split())}); its rule was applied here"
        done = set()
        for name, module in modules.items():
            if isinstance(module, FusedMoE):
                parts = [name, *expert_names(name)]
            elif isinstance(module, LinearBase) and not getattr(module, "skip_quant", False):
                parts = checkpoint_module_names(name, stacked)
            else:
                continue
            if not _is_ignored(ignore, parts):
                done.add(name)
    targets: set[str] = set()
    kept: list[str] = []
    for name, module in modules.items():
        if name in experts:
            (targets.update if name in done else kept.extend)(expert_names(name))
        elif isinstance(module, LinearBase):
            (targets.update if name in done else kept.extend)(checkpoint_module_names(name, stacked))
    if not targets:
        raise QuantError("no linear layer of this model is left to quantize")
    fused_key = {}
    for t in targets:
        fused_key[t] = t
        for param_part, weight_part, _shard in stacked:
            if t.endswith(weight_part.rstrip(".")):
                fused_key[t] = t[: -len(weight_part.rstrip("."))] + param_part.rstrip(".")
    return ModulePlan(targets, fused_key, list(dict.fromkeys([*rule_ignore, *sorted(kept)])), experts, note)


def _weight_shapes(src: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from safetensors import safe_open

    from ftransformers.models.loader import weight_files

    out = {}
    for path in weight_files(src):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors file, not a dict
                t = f.get_slice(name)
                out[name] = (tuple(t.get_shape()), getattr(torch, {"BF16": "bfloat16", "F16": "float16"}.get(
                    t.get_dtype(), "float32")))  # fmt: skip
    return out


def resolve_options(spec: MethodSpec, group_size: int | None, symmetric: bool | None, desc_act: bool,
                    source_dtype: torch.dtype) -> QuantOptions:  # fmt: skip
    if not spec.grouped and group_size is not None:
        raise QuantError(f"--group-size is not used by --method {spec.name}")
    if desc_act and spec.name != "gptq":
        raise QuantError("--desc-act is for --method gptq")
    if spec.name == "awq" and symmetric:
        raise QuantError("awq writes zero points (zero_point: true); --symmetric is for rtn-int4 and gptq")
    g = 128 if group_size is None else group_size
    if spec.grouped and (g == 0 or g < -1 or (g == -1 and spec.name != "gptq")):
        raise QuantError(f"--group-size must be a positive number of input channels (-1: one group, gptq only), got {g}")
    sym = spec.default_symmetric if symmetric is None else symmetric
    scale_dtype = torch.bfloat16 if source_dtype == torch.bfloat16 else torch.float16
    return QuantOptions(group_size=g, symmetric=sym, desc_act=desc_act, scale_dtype=scale_dtype)


def quantize_checkpoint(
    model_path: str | Path,
    output: str | Path,
    method: str,
    ignore: Sequence[str] = (),
    shard_bytes: int = 4 << 30,
    progress: Progress | None = None,
    calib_ids: list[int] | None = None,
    smooth_alpha: float = 0.5,
    group_size: int | None = None,
    symmetric: bool | None = None,
    desc_act: bool = False,
    cpu_weight_path: str | Path | None = None,
    awq_clip: bool = True,
) -> dict[str, Any]:
    """Quantize `model_path` into `output`; returns a summary (tensors quantized, bytes in and out, ...)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from ftransformers.models.loader import iterate_weights

    spec = METHOD_SPECS.get(method)
    if spec is None:
        raise QuantError(f"unknown --method {method!r}; available: {', '.join(sorted(METHOD_SPECS))}")
    src, dst = Path(model_path), Path(output)
    if not (src / "config.json").is_file():
        raise QuantError(f"{src} has no config.json")
    if dst.exists() and any(dst.iterdir()):
        raise QuantError(f"output folder {dst} is not empty")
    hf_config = AutoConfig.from_pretrained(str(src))
    if getattr(hf_config, "quantization_config", None):
        raise QuantError(f"{src} is already quantized")
    if spec.needs_calibration and calib_ids is None:
        raise QuantError(f"--method {method} needs calibration text: --calib-data FILE")
    if calib_ids is not None and not spec.needs_calibration and method != "w8a8-int8":
        raise QuantError(f"--calib-data is not used by --method {method}")
    shapes = _weight_shapes(src)
    opts = resolve_options(spec, group_size, symmetric, desc_act, next(iter(shapes.values()))[1])
    plan = plan_modules(hf_config, lambda names: spec.config(opts, names), ignore)
    for name, (shape, _dtype) in shapes.items():
        module, _, suffix = name.rpartition(".")
        if ".experts." in name and len(shape) == 3:
            raise QuantError(f"{name}: fused 3-D expert tensors are not supported; save the model with per-expert weights")
        if suffix == "weight" and module in plan.targets:
            check_shape(spec, opts, name, shape)
    cpu_writer = None
    if cpu_weight_path is not None:
        from ftransformers.entrypoints.quantize.cpu_weights import CpuExpertWriter

        if not plan.moe_layers:
            raise QuantError("--cpu-weight-path: this model has no MoE layers")
        cpu_writer = CpuExpertWriter(Path(cpu_weight_path), plan.moe_layers)

    summary: dict[str, Any] = {"method": method, "quantized_tensors": 0, "bytes_in": 0, "bytes_out": 0,
                               "smoothed_groups": 0, "group_size": opts.group_size if spec.grouped else None,
                               "module_rule": plan.note}  # fmt: skip
    overrides: dict[str, torch.Tensor] = {}
    results: dict[str, QuantizedWeight] = {}
    divide_out: dict[str, torch.Tensor] = {}
    multiply_in: dict[str, torch.Tensor] = {}
    if calib_ids is not None and method == "w8a8-int8":
        from ftransformers.entrypoints.quantize.smoothquant import smoothquant_scales

        divide_out, multiply_in = smoothquant_scales(src, calib_ids, smooth_alpha)
        summary["smoothed_groups"] = len(divide_out)
    elif method == "awq":
        from ftransformers.entrypoints.quantize.awq import awq_calibrate

        overrides, stats = awq_calibrate(src, calib_ids or [], plan.targets, opts.group_size, awq_clip, progress)
        if not stats.get("groups"):
            raise QuantError(f"awq: no scale group found in the layers of {hf_config.architectures}")
        summary["awq"] = stats
    elif method == "gptq":
        from ftransformers.entrypoints.quantize.gptq import gptq_calibrate

        results = gptq_calibrate(src, calib_ids or [], plan.targets, opts.group_size, opts.symmetric, opts.desc_act,
                                 progress)  # fmt: skip
        summary["gptq_weights"] = len(results)
    global_amax = _fused_amax(src, plan) if spec.shares_global_scale else {}

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(".safetensors") \
                and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    weights = iterate_weights(src)
    for name, tensor in progress(weights) if progress else weights:
        summary["bytes_in"] += tensor.numel() * tensor.element_size()
        value = overrides.get(name)
        value = value if value is not None else _smooth(name, tensor, divide_out, multiply_in)
        module, _, suffix = name.rpartition(".")
        if cpu_writer is not None:
            cpu_writer.add(name, value)
        if suffix == "weight" and module in plan.targets:
            qw = results.get(module)
            if qw is None:
                qw = spec.quantize(value, opts, global_amax.get(plan.fused_key[module]))
            out = {f"{module}.{k}": v for k, v in spec.encode(qw, opts).items()}
            summary["quantized_tensors"] += 1
        else:
            out = {name: value.to(tensor.dtype).contiguous()}
        for key, v in out.items():
            nbytes = v.numel() * v.element_size()
            if size + nbytes > shard_bytes and shards[-1]:
                shards.append({})
                size = 0
            shards[-1][key] = v
            size += nbytes
            summary["bytes_out"] += nbytes
    if summary["quantized_tensors"] == 0:
        raise QuantError(f"no weight of {src} matched a quantizable layer")
    if cpu_writer is not None:
        summary["cpu_expert_layers"] = cpu_writer.finish()
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
    cfg["quantization_config"] = spec.config(opts, plan.written_ignore)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return summary


def _smooth(name: str, tensor: torch.Tensor, divide_out: dict[str, torch.Tensor],
            multiply_in: dict[str, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    if not divide_out and not multiply_in:
        return tensor
    from ftransformers.entrypoints.quantize.smoothquant import smooth

    return smooth(name, tensor, divide_out, multiply_in)


def _fused_amax(src: Path, plan: ModulePlan) -> dict[str, torch.Tensor]:
    """max|w| over the parts of each fused module (one pass over the checkpoint; nvfp4's global scale)."""
    from ftransformers.models.loader import iterate_weights

    amax: dict[str, torch.Tensor] = {}
    for name, tensor in iterate_weights(src):
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and module in plan.targets:
            key = plan.fused_key[module]
            a = tensor.float().abs().amax()
            amax[key] = torch.maximum(amax[key], a) if key in amax else a
    return amax
