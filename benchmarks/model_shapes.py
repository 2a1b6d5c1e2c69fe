"""The model shapes of the whole-model benchmarks (bench_decode.py, bench_quant_decode.py, ab_decode.py, ...):
Hugging Face configs of real models for dummy weights, their full depths, and `write_config`, which writes one at a
chosen depth (shrunk 16x for a CPU dry run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN_COMMON = {
    "vocab_size": 151936, "num_attention_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        **QWEN_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48,
        "hidden_size": 2048, "num_key_value_heads": 4, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3-8b": {
        **QWEN_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36,
        "hidden_size": 4096, "num_key_value_heads": 8, "intermediate_size": 12288,
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 3,
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
    },
}  # fmt: skip
# DeepSeek-V3's layers with 64 attention heads: its share a GPU at tensor parallel 2, and Kimi-K2's head count (the
# MLA decode launches of 33-64 heads, triton_backend.MLA_ONE_BLOCK_FROM)
SHAPES["deepseek-v3-h64"] = {**SHAPES["deepseek-v3"], "num_attention_heads": 64, "num_key_value_heads": 64}
# and with 16: its share a GPU at tensor parallel 8, where the MLA decode takes the few-heads kernel
# (kernels/gluon_mla_few_heads.py); the rest of the layer keeps its one-GPU width
SHAPES["deepseek-v3-h16"] = {**SHAPES["deepseek-v3"], "num_attention_heads": 16, "num_key_value_heads": 16}
FULL_DEPTH = {"qwen3-30b-a3b": 48, "qwen3-8b": 36, "deepseek-v3": 61, "deepseek-v3-h64": 61, "deepseek-v3-h16": 61}
# dense layers at full depth where the model mixes both kinds
FULL_DENSE = {"deepseek-v3": 3, "deepseek-v3-h64": 3, "deepseek-v3-h16": 3}


def model_spec(spec: str) -> tuple[str, int]:
    """'name' or 'name:layers' (the benches' --model) -> (name, layers); a bare name is its full depth."""
    name, _, layers = spec.partition(":")
    return name, int(layers or FULL_DEPTH[name])


# --dry-run (CPU smoke test of this script): every width divided by 16, torch_native kernels.
SHRINK = ("hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size", "q_lora_rank", "kv_lora_rank")
SMALL_HEADS = {
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


def write_config(name: str, layers: int, root: Path, dry_run: bool) -> dict[str, Any]:
    cfg = dict(SHAPES[name], num_hidden_layers=layers)
    if dry_run:
        cfg.update({k: cfg[k] // 16 for k in SHRINK if k in cfg}, **{k: v for k, v in SMALL_HEADS.items() if k in cfg})
        cfg["num_key_value_heads"] = min(cfg["num_key_value_heads"], 4)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return cfg
