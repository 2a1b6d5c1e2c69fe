"""Layer-by-layer calibration on a transformers model (CPU, float32), shared by AWQ and GPTQ.

The model runs once up to its first decoder layer on the calibration windows; then each decoder
layer in turn is run with hooks that record the inputs of its linears (and of its MoE experts: the
routed hidden states and top-k ids, from which each expert's inputs are cut), handed to the method,
and run again to produce the next layer's inputs, so each layer sees the previous layers as the
method left them. Weights are edited in place through `LinearRef.weight`, a view into the model's
parameter (for MoE experts a slice of transformers' stacked `gate_up_proj` [E, 2I, D] / `down_proj`
[E, D, I]), under the checkpoint's per-expert module names.

`ScaleGroup` is what AWQ needs and is read off the decoder layer's structure (Llama, Qwen3,
Qwen3-MoE, DeepSeek-V3 naming): linears fed by one producer whose output channels can absorb 1/s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ftransformers.quant.base import QuantError

WINDOW = 512


@dataclass
class LinearRef:
    name: str  # checkpoint module name (model.layers.3.mlp.experts.5.down_proj)
    weight: torch.Tensor  # [N, K] view into the model's parameter, edited in place
    x: torch.Tensor  # [T, K] inputs seen in calibration (T may be 0 for an expert no token chose)
    quantized: bool
    input_key: tuple[int, ...]  # equal for linears fed the same tensor (q/k/v, gate/up)
    bias: torch.Tensor | None = None


@dataclass
class ScaleGroup:
    """Consumers of one producer: W[:, j] *= s_j for every member and passenger, producer rows / s_j."""

    producers: list[tuple[str, torch.Tensor]]  # (checkpoint tensor name, tensor with channels on dim 0)
    members: list[LinearRef]
    passengers: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # float consumers [*, K] (routers)


@dataclass
class LayerCalib:
    prefix: str  # model.layers.3
    layer: nn.Module
    refs: dict[str, LinearRef]
    groups: list[ScaleGroup]


class _Stop(Exception):
    pass


def load_float_model(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module) > 0:
            return name, module
    raise QuantError("calibration: no decoder layers found in this model")


def _experts_modules(layer: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in layer.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and m.gate_up_proj.dim() == 3}  # fmt: skip


def _split_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, tuple[Any, ...], dict[str, Any]]:
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states"), (), kwargs


def _record_layer(layer: nn.Module, hidden: list[torch.Tensor], calls: list[tuple[tuple[Any, ...], dict[str, Any]]],
                  ) -> tuple[dict[str, list[torch.Tensor]], dict[str, list[tuple[torch.Tensor, ...]]]]:  # fmt: skip
    """Run the layer on every window, recording inputs of its nn.Linear modules and MoE experts."""
    lin: dict[str, list[torch.Tensor]] = {}
    moe: dict[str, list[tuple[torch.Tensor, ...]]] = {}

    def on_linear(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            lin.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]))

        return hook

    def on_experts(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            vals = list(args) + [kwargs[k] for k in ("hidden_states", "top_k_index", "top_k_weights") if k in kwargs]
            moe.setdefault(name, []).append((vals[0].detach(), vals[1].detach()))

        return hook

    handles = [m.register_forward_pre_hook(on_linear(n)) for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
    handles += [m.register_forward_pre_hook(on_experts(n), with_kwargs=True) for n, m in _experts_modules(layer).items()]
    try:
        _run_layer(layer, hidden, calls)
    finally:
        for h in handles:
            h.remove()
    return lin, moe


def _run_layer(layer: nn.Module, hidden: list[torch.Tensor], calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
               ) -> list[torch.Tensor]:  # fmt: skip
    outs = []
    with torch.no_grad():
        for h, (args, kwargs) in zip(hidden, calls):
            out = layer(h, *args, **kwargs)
            outs.append(out[0] if isinstance(out, tuple) else out)
    return outs


def _refs(layer: nn.Module, prefix: str, lin: dict[str, list[torch.Tensor]],
          moe: dict[str, list[tuple[torch.Tensor, ...]]], targets: set[str]) -> dict[str, LinearRef]:  # fmt: skip
    refs: dict[str, LinearRef] = {}
    modules = dict(layer.named_modules())
    for name, xs in lin.items():
        mod = modules[name]
        full = f"{prefix}.{name}"
        key = tuple(x.data_ptr() for x in xs)
        bias = mod.bias.data if getattr(mod, "bias", None) is not None else None
        refs[full] = LinearRef(full, mod.weight.data, torch.cat(xs), full in targets, key, bias)
    for name, calls in moe.items():
        experts = modules[name]
        hidden = torch.cat([c[0].reshape(-1, c[0].shape[-1]) for c in calls])  # [T, D]
        ids = torch.cat([c[1].reshape(-1, c[1].shape[-1]) for c in calls])  # [T, k]
        inter = experts.gate_up_proj.shape[1] // 2
        act = getattr(experts, "act_fn", torch.nn.functional.silu)
        for e in range(experts.gate_up_proj.shape[0]):
            x = hidden[(ids == e).any(dim=-1)]  # [n_e, D]
            gate, up = experts.gate_up_proj.data[e, :inter], experts.gate_up_proj.data[e, inter:]
            down = experts.down_proj.data[e]
            with torch.no_grad():
                xd = act(x @ gate.t()) * (x @ up.t())  # [n_e, I]
            base = f"{prefix}.{name}.{e}"
            for part, w, xin, key in (("gate_proj", gate, x, (id(experts), e, 0)), ("up_proj", up, x, (id(experts), e, 0)),
                                      ("down_proj", down, xd, (id(experts), e, 1))):  # fmt: skip
                refs[f"{base}.{part}"] = LinearRef(f"{base}.{part}", w, xin, f"{base}.{part}" in targets, key)
    return refs


def _groups(layer: nn.Module, prefix: str, refs: dict[str, LinearRef]) -> list[ScaleGroup]:
    def ref(rel: str) -> LinearRef | None:
        return refs.get(f"{prefix}.{rel}")

    def norm(rel: str) -> list[tuple[str, torch.Tensor]]:
        mod = layer.get_submodule(rel)
        return [(f"{prefix}.{rel}.weight", mod.weight.data)]

    def rows(r: LinearRef) -> list[tuple[str, torch.Tensor]]:
        out = [(f"{r.name}.weight", r.weight)]
        return out + ([(f"{r.name}.bias", r.bias)] if r.bias is not None else [])

    groups: list[ScaleGroup] = []

    def add(producers: list[tuple[str, torch.Tensor]], members: list[LinearRef | None],
            passengers: list[tuple[str, torch.Tensor]] | None = None) -> None:  # fmt: skip
        if members and all(m is not None for m in members):
            groups.append(ScaleGroup(producers, [m for m in members if m is not None], passengers or []))

    attn = getattr(layer, "self_attn", None)
    if attn is not None:
        if all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")):
            add(norm("input_layernorm"), [ref(f"self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj")])
            v, o = ref("self_attn.v_proj"), ref("self_attn.o_proj")
            if v is not None and o is not None and v.weight.shape[0] == o.weight.shape[1]:  # heads == kv heads
                add(rows(v), [o])
        elif hasattr(attn, "kv_a_proj_with_mqa"):  # MLA
            q_first = "q_a_proj" if getattr(attn, "q_a_proj", None) is not None else "q_proj"
            add(norm("input_layernorm"), [ref(f"self_attn.{q_first}"), ref("self_attn.kv_a_proj_with_mqa")])
            if q_first == "q_a_proj":
                add(norm("self_attn.q_a_layernorm"), [ref("self_attn.q_b_proj")])
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return groups
    if all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        add(norm("post_attention_layernorm"), [ref("mlp.gate_proj"), ref("mlp.up_proj")])
        up = ref("mlp.up_proj")
        if up is not None:
            add(rows(up), [ref("mlp.down_proj")])
        return groups
    experts = [n for n in _experts_modules(layer) if n.startswith("mlp.")]
    if not experts:
        return groups
    members: list[LinearRef | None] = []
    downs: list[tuple[LinearRef, LinearRef | None]] = []
    for name in experts:
        for e in range(layer.get_submodule(name).gate_up_proj.shape[0]):
            base = f"{name}.{e}"
            members += [ref(f"{base}.gate_proj"), ref(f"{base}.up_proj")]
            up = ref(f"{base}.up_proj")
            if up is not None:
                downs.append((up, ref(f"{base}.down_proj")))
    shared = getattr(mlp, "shared_experts", None)
    if shared is not None:
        members += [ref("mlp.shared_experts.gate_proj"), ref("mlp.shared_experts.up_proj")]
        up = ref("mlp.shared_experts.up_proj")
        if up is not None:
            downs.append((up, ref("mlp.shared_experts.down_proj")))
    router = getattr(mlp, "gate", None)
    passengers = [(f"{prefix}.mlp.gate.weight", router.weight.data)] if router is not None else []
    add(norm("post_attention_layernorm"), members, passengers)
    for up, down in downs:
        add(rows(up), [down])
    return groups


def calibrate_layers(model_path: Path, calib_ids: list[int], targets: set[str],
                     per_layer: Callable[[LayerCalib], None],
                     progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None) -> nn.Module:  # fmt: skip
    """Run `per_layer` on every decoder layer in order (see the module docstring); returns the model,
    whose parameters hold what the method left in them."""
    if len(calib_ids) < 16:
        raise QuantError("--calib-data has fewer than 16 tokens")
    model = load_float_model(model_path)
    prefix_root, layers = _decoder_layers(model)
    hidden: list[torch.Tensor] = []
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def catch(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        h, rest, kw = _split_call(args, kwargs)
        hidden.append(h.detach())
        calls.append((rest, kw))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            for i in range(0, len(calib_ids), WINDOW):
                try:
                    model(torch.tensor([calib_ids[i : i + WINDOW]]), use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    indices = range(len(layers))
    for i in progress(indices) if progress else indices:
        layer = layers[i]
        prefix = f"{prefix_root}.{i}"
        lin, moe = _record_layer(layer, hidden, calls)
        refs = _refs(layer, prefix, lin, moe, targets)
        per_layer(LayerCalib(prefix, layer, refs, _groups(layer, prefix, refs)))
        hidden = _run_layer(layer, hidden, calls)
    return model
