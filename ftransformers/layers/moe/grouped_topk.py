"""DeepSeek-V3 `noaux_tc` routing: sigmoid scores, grouped top-k selection with a correction bias.

The bias (`e_score_correction_bias`, the aux-loss-free load balancer) shifts which experts are
*chosen*; the weights given to the chosen experts are the unbiased sigmoid scores. Groups are ranked
by the sum of their two best biased scores; experts outside the `topk_group` best groups are masked.
Numerics follow Hugging Face's DeepseekV3TopkRouter (float32, `+ 1e-20` in the renormaliser).
"""

from __future__ import annotations

import torch
from torch import nn


def grouped_topk(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    num_expert_group: int | None,
    topk_group: int | None,
    correction_bias: torch.Tensor | None = None,  # [E]
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns topk_weights [T, top_k] float32 and topk_ids [T, top_k] int64."""
    if router_logits.is_cuda and router_logits.shape[-1] <= 1024:
        # one launch instead of ~12 (kernels.triton_router); imported here so CPU needs no triton
        from ftransformers.kernels.triton_router import grouped_topk_sigmoid

        return grouped_topk_sigmoid(
            router_logits, top_k, num_expert_group, topk_group, correction_bias, renormalize, routed_scaling_factor
        )
    return grouped_topk_torch(
        router_logits, top_k, num_expert_group, topk_group, correction_bias, renormalize, routed_scaling_factor
    )


def grouped_topk_torch(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    num_expert_group: int | None,
    topk_group: int | None,
    correction_bias: torch.Tensor | None = None,  # [E]
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (and CPU) path of grouped_topk."""
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()  # [T, E]
    scores_for_choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        group_size = num_experts // num_expert_group
        # group_scores: [T, G], sum of the two best biased scores in each group
        group_scores = scores_for_choice.view(num_tokens, num_expert_group, group_size).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group or num_expert_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)  # [T, G]
        score_mask = group_mask.unsqueeze(-1).expand(-1, -1, group_size).reshape(num_tokens, num_experts)
        scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_ids = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]  # [T, k]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


class DeepseekTopkRouter(nn.Module):
    """The `mlp.gate` of a DeepSeek-V3 MoE layer: `weight` [E, D] and `e_score_correction_bias` [E]."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_expert_group: int | None,
        topk_group: int | None,
        renormalize: bool,
        routed_scaling_factor: float,
        topk_method: str = "noaux_tc",
        scoring_func: str = "sigmoid",
    ) -> None:
        super().__init__()
        if topk_method != "noaux_tc":
            raise ValueError(f"unsupported topk_method {topk_method!r}; valid: noaux_tc")
        if scoring_func != "sigmoid":
            raise ValueError(f"unsupported scoring_func {scoring_func!r} for noaux_tc; valid: sigmoid")
        if num_expert_group is not None and num_expert_group > 1 and num_experts % num_expert_group:
            raise ValueError(f"n_routed_experts={num_experts} is not divisible by n_group={num_expert_group}")
        self.top_k, self.num_expert_group, self.topk_group = top_k, num_expert_group, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        # The bias stays float32 whatever the model dtype (HF keeps it in fp32 too).
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden: [T, D] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)
        if hidden.is_cuda:  # decode sizes: float32 GEMV + selection in one kernel, no casts of the weight
            from ftransformers.kernels.triton_router import can_fuse_router, fused_router_topk

            if can_fuse_router(hidden, self.weight):
                return fused_router_topk(
                    hidden, self.weight, self.top_k, softmax=False, renormalize=self.renormalize,
                    num_expert_group=self.num_expert_group, topk_group=self.topk_group,
                    correction_bias=self.e_score_correction_bias, routed_scaling_factor=self.routed_scaling_factor,
                )  # fmt: skip
        router_logits = torch.nn.functional.linear(hidden.float(), self.weight.float())  # [T, E]
        return grouped_topk(
            router_logits,
            self.top_k,
            self.num_expert_group,
            self.topk_group,
            self.e_score_correction_bias,
            self.renormalize,
            self.routed_scaling_factor,
        )
