"""Checkpoint loading for MoE models: per-expert (or fused 3-D) expert tensors onto FusedMoE's
stacked parameters, everything else through the model's usual stacked-parameter mapping."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ftransformers.layers.weight_utils import LoadTracker, load_with_mapping


def load_moe_model_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked_params_mapping: list[tuple[str, str, Any]]
) -> None:
    """Load a whole checkpoint into `model` (which provides `skip_weight(name)`); raises the
    WeightLoadError family for unknown, mis-shaped or missing tensors."""
    tracker = LoadTracker(model)

    def non_expert() -> Iterator[tuple[str, torch.Tensor]]:
        kept = ((n, t) for n, t in weights if not model.skip_weight(n))
        for name, param_name, w, expert_id, shard_id in route_expert_weights(kept):
            if expert_id is None:
                yield name, w
            else:
                tracker.load(param_name, name, w, expert_id, shard_id)

    load_with_mapping(tracker, non_expert(), stacked_params_mapping)
    tracker.check_complete()


def route_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, str, torch.Tensor, int | None, str | None]]:
    """Yield (checkpoint name, param name, tensor, expert id, shard id); expert id is None for
    non-expert tensors. `...experts.{e}.{gate,up,down}_proj.{suffix}` map onto the stacked
    parameters `w13_{suffix}` / `w2_{suffix}` (`weight`, or a quantized layout's `qweight`,
    `weight_scale`, ...); fused 3-D `experts.gate_up_proj` [E, 2I, D] / `experts.down_proj` [E, D, I] (the
    transformers>=5 in-memory layout) are split per expert."""
    shards = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for name, w in weights:
        if ".experts." not in name:
            yield name, name, w, None, None
            continue
        prefix, rest = name.split(".experts.", 1)
        parts = rest.split(".")
        w13, w2 = f"{prefix}.experts.w13_weight", f"{prefix}.experts.w2_weight"
        if len(parts) == 3 and parts[0].isdigit() and parts[1] in shards:
            stack = "w2" if parts[1] == "down_proj" else "w13"
            yield name, f"{prefix}.experts.{stack}_{parts[2]}", w, int(parts[0]), shards[parts[1]]
        elif rest == "gate_up_proj" and w.dim() == 3:
            half = w.shape[1] // 2
            for e in range(w.shape[0]):
                yield name, w13, w[e, :half], e, "w1"
                yield name, w13, w[e, half:], e, "w3"
        elif rest == "down_proj" and w.dim() == 3:
            for e in range(w.shape[0]):
                yield name, w2, w[e], e, "w2"
        else:
            yield name, name, w, None, None
