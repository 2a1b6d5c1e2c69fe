"""DeepSeek-V3 (and Kimi-K2, the same architecture with more experts) on the paged MLA latent cache.

Multi-head latent attention: each token caches one row [c_kv (kv_lora_rank L) | k_pe
(qk_rope_head_dim R)] whichever form computes the step. `kv_b_proj` [H*(N+V), L] is read as
W_UK [H, N, L] and W_UV [H, V, L].
- Absorbed form (`forward_mla`): queries are pushed through W_UK into latent space, the latent-space
  output is pulled back through W_UV; per-head K/V are never materialised. A query-key pair costs
  2*H*(2L + R) FLOPs (1088 per head for DeepSeek-V3).
- MHA form (`mla_extend_rows` + `forward_mla_mha`): the sequence's latent rows (prefix + new) are
  expanded through kv_b_proj into k_nope [S, H, N] and v [S, H, V]; keys are [k_nope | k_pe], the
  queries [q_nope | q_pe], ordinary causal attention: 2*H*(N + R + V) per pair (320 per head), plus
  2*S*L*H*(N+V) for the expansion, paid once per cached row.
Invariant: DECODE steps always run absorbed (CUDA graphs capture only that path). EXTEND steps
(prefill chunks, possibly mixed with decodes) run as a whole in one form, chosen per step by
`mla_extend_form` from the batch's lengths alone, so every layer of a step takes the same path:
MHA when its estimated cost is lower (long new chunks) and the expanded K/V stays under
`MHA_MAX_ROWS` rows; absorbed for short chunks over long prefixes and for decode-heavy mixes.
Both forms compute the same function (tests/test_mla_prefill.py).

MoE layers (from `first_k_dense_replace` on): `noaux_tc` grouped top-k routing over sigmoid scores,
routed experts in a FusedMoE, plus always-on shared experts. Multi-token-prediction layers
(`model.layers.{i}` with i >= num_hidden_layers) are skipped on load.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode, get_forward_batch
from ftransformers.cache.kv_pool import MLAKVPool, MLAKVSpec
from ftransformers.kernels import triton_mla_bmm
from ftransformers.layers.linear import ReplicatedLinear, RowParallelLinear
from ftransformers.layers.moe.experts import FusedMoE
from ftransformers.layers.moe.grouped_topk import DeepseekTopkRouter
from ftransformers.layers.norm import RMSNorm
from ftransformers.layers.rotary_yarn import get_deepseek_rope
from ftransformers.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from ftransformers.models.moe_weights import load_moe_model_weights
from ftransformers.models.registry import register_model

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
MHA_MAX_ROWS = 32768  # expanded rows (prefix + new) per step: 2.7 GB of bf16 K/V at DeepSeek-V3 width
ABSORBED_SLOWDOWN = 2.0  # absorbed extend kernel's FLOP rate is about half the MHA one's (H100 profile)
# Decode: the MLA rope kernel also stores the new latent rows into the layer's pool (rope_latent's `pool`), and the
# attention skips its own store (MLAKVPool.set_latent, a torch index op between the rope kernel and the attention,
# 2.8 us a layer of DeepSeek-V3's B=1 critical path on the H200, benchmarks/results/ab_mlabmm_dsv3_b1_*_s56_h200.log).
# H200, session 57, 3 layers, graph replay (benchmarks/results/ab_{ropestore,early}_*_s57_h200.log): DeepSeek-V3 B=1
# ctx 4096 1.483 -> 1.470 ms, B=4 1.647 -> 1.639; with 16 heads (its tensor-parallel-8 share) B=1 ctx 32768 1.253 ->
# 1.236, stage 1's critical path 46.2 -> 42.2 us.
# False: set_latent after the absorbing product (an A/B: `set=models.deepseek_v3.ROPE_STORES_LATENT=0`)
ROPE_STORES_LATENT = True


def mla_extend_form(batch: ForwardBatch, L: int, R: int, N: int, V: int) -> str:
    """'mha' or 'absorbed' for an EXTEND step, from host-side lengths only (same answer in every layer)."""
    rows = sum(batch.seq_lens_cpu)
    if rows > MHA_MAX_ROWS:
        return "absorbed"
    pairs = sum(e * s for e, s in zip(batch.extend_lens_cpu, batch.seq_lens_cpu))  # per head, upper bound
    absorbed = ABSORBED_SLOWDOWN * pairs * (2 * L + R)
    mha = pairs * (N + R + V) + rows * L * (N + V)
    return "mha" if mha < absorbed else "absorbed"


class DeepseekV3Attention(nn.Module):
    prefill_form = "auto"  # "auto" (mla_extend_form), "mha" or "absorbed": forced, for tests and benchmarks

    def __init__(self, config: PretrainedConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = int(config.num_attention_heads)
        self.qk_nope_head_dim = int(config.qk_nope_head_dim)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim = int(config.v_head_dim)
        self.kv_lora_rank = int(config.kv_lora_rank)
        self.q_lora_rank: int | None = config.q_lora_rank
        hidden, H = int(config.hidden_size), self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = ReplicatedLinear(hidden, H * self.qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # eps 1e-6, as the reference (not rms_norm_eps)
            self.q_b_proj = ReplicatedLinear(self.q_lora_rank, H * self.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = ReplicatedLinear(self.kv_lora_rank, H * (self.qk_nope_head_dim + self.v_head_dim))
        self.kv_b_proj.skip_quant = True  # its weight is absorbed into the attention (post_load_weights)
        self.kv_b_proj.accept_quantized = True  # DeepSeek's own FP8 checkpoints store it quantized: dequantized
        self.o_proj = RowParallelLinear(H * self.v_head_dim, hidden, bias=bias)
        self.rotary_emb, scale_multiplier = get_deepseek_rope(config)
        self.scaling = self.qk_head_dim**-0.5 * scale_multiplier

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        # kv_b_proj.weight: [H*(N+V), L] -> W_UK [H, N, L], W_UV [H, V, L] (views, no copy)
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _form(self, batch: ForwardBatch) -> str:
        if self.prefill_form != "auto":
            return self.prefill_form
        return mla_extend_form(batch, self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, D] -> [T, D]
        T = hidden.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(T, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)  # [T, H, N], [T, H, R]
        c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)  # [T, L]
        batch = get_forward_batch()
        stored = ROPE_STORES_LATENT and batch.mode == ForwardMode.DECODE and isinstance(batch.kv_pool, MLAKVPool)
        pool = batch.kv_pool.get_latent(self.layer_id) if stored else None  # type: ignore[union-attr]
        q_pe, latent = self.rotary_emb.rope_latent(
            positions, q_pe, c_kv, k_pe, pool, batch.out_cache_loc if stored else None
        )  # [T, H, R], [T, L+R]
        if batch.mode == ForwardMode.EXTEND and self._form(batch) == "mha":
            rows = batch.attn_backend.mla_extend_rows(latent, self.layer_id, batch).to(hidden.dtype)  # [P+T, L+R]
            kv = self.kv_b_proj(rows[:, : self.kv_lora_rank])  # [P+T, H*(N+V)]
            out = batch.attn_backend.forward_mla_mha(
                q_nope, q_pe, kv.view(-1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim),
                rows[:, self.kv_lora_rank :], self.scaling, batch,
            )  # [T, H, V]  # fmt: skip
            return self.o_proj(out.reshape(T, self.num_heads * self.v_head_dim))
        w_uk, w_uv = self.absorbed_weights()
        q_latent = per_head_product(q_nope, w_uk)  # [T, H, N] x [H, N, L] -> [T, H, L]
        out_latent = batch.attn_backend.forward_mla(
            q_latent, q_pe, latent, self.layer_id, self.scaling, batch, latent_stored=stored
        )  # [T, H, L]
        out = per_head_product(out_latent, w_uv.transpose(1, 2))  # [T, H, L] x [H, L, V] -> [T, H, V]
        return self.o_proj(out.reshape(T, self.num_heads * self.v_head_dim))


def per_head_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, H, K] (any strides) times each head's w [H, K, N] -> [T, H, N]: at decode sizes on CUDA through
    kernels/triton_mla_bmm.py (written contiguous, in the PDL chain), else torch.bmm (a transposed view)."""
    a = x.transpose(0, 1)  # [H, T, K]
    if not triton_mla_bmm.takes(a, w):
        return torch.bmm(a, w).transpose(0, 1)
    out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=x.dtype, device=x.device)
    triton_mla_bmm.mla_bmm(a, w, out=out.transpose(0, 1))
    return out


class DeepseekV3MoE(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        num_experts = int(config.n_routed_experts)
        self.gate = DeepseekTopkRouter(
            hidden_size=config.hidden_size,
            num_experts=num_experts,
            top_k=int(config.num_experts_per_tok),
            num_expert_group=getattr(config, "n_group", None),
            topk_group=getattr(config, "topk_group", None),
            renormalize=bool(getattr(config, "norm_topk_prob", True)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
            topk_method=getattr(config, "topk_method", None) or "noaux_tc",
            scoring_func=getattr(config, "scoring_func", None) or "sigmoid",
        )
        self.experts = FusedMoE(num_experts, config.hidden_size, config.moe_intermediate_size)
        n_shared = int(getattr(config, "n_shared_experts", 0) or 0)
        self.shared_experts = (
            LlamaMLP(config.hidden_size, config.moe_intermediate_size * n_shared) if n_shared > 0 else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, D] -> [T, D]
        topk_weights, topk_ids = self.gate(hidden)  # [T, k] float32, [T, k]
        out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden)
        return out


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV3Attention  # type: ignore[assignment]

    def make_mlp(self, config: PretrainedConfig, layer_id: int) -> nn.Module:
        moe = getattr(config, "n_routed_experts", None) and layer_id >= int(config.first_k_dense_replace or 0)
        if moe and layer_id % int(getattr(config, "moe_layer_freq", 1) or 1) == 0:
            return DeepseekV3MoE(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class DeepseekV3Model(LlamaModel):
    decoder_layer_cls = DeepseekV3DecoderLayer  # type: ignore[assignment]


@register_model("DeepseekV3ForCausalLM")
class DeepseekV3ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV3Model  # type: ignore[assignment]
    # Only the MLPs fuse; MLA projections keep their checkpoint names (q_proj must not become qkv_proj).
    stacked_params_mapping: list[tuple[str, str, Any]] = [
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    @classmethod
    def kv_spec(cls, config: PretrainedConfig) -> MLAKVSpec:  # type: ignore[override]
        return MLAKVSpec(int(config.num_hidden_layers), int(config.kv_lora_rank), int(config.qk_rope_head_dim))

    def skip_weight(self, name: str) -> bool:
        m = _LAYER_RE.match(name)
        if m is not None and int(m.group(1)) >= self.config.num_hidden_layers:
            return True  # multi-token-prediction layer(s)
        return super().skip_weight(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_moe_model_weights(self, weights, self.stacked_params_mapping)
