"""SmoothQuant (Xiao et al. 2022) for w8a8-int8: move activation outliers into the weights.

Per input channel j of q/k/v (after the input norm), gate/up (after the post-attention norm) and
down_proj (after silu(gate) * up): s_j = max|X_j|^α / max|W_:,j|^(1-α) from activations recorded with
transformers on the calibration text; the consumers' columns are multiplied by s_j and the producer
(the norm's weight, or up_proj's row j) divided by it, so the float model is unchanged. Llama-style
layers only (dense MLPs of MoE models included; experts and o_proj are not smoothed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ftransformers.quant.base import QuantError


def smoothquant_scales(model_path: Path, calib_ids: list[int], alpha: float, max_tokens: int = 4096,
                       window: int = 512) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:  # fmt: skip
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


def smooth(name: str, tensor: torch.Tensor, divide_out: dict[str, torch.Tensor],
           multiply_in: dict[str, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    if name not in divide_out and name not in multiply_in:
        return tensor
    t = tensor.float()
    if name in multiply_in:
        t = t * multiply_in[name][None, :]  # input column j grows by s_j
    if name in divide_out:  # output channel j shrinks by s_j (for up_proj: silu(g) * u is linear in u)
        s = divide_out[name]
        t = t / (s if t.dim() == 1 else s[:, None])
    return t.to(tensor.dtype)
