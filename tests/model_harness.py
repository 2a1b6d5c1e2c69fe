"""Shared test helpers: tiny real Hugging Face checkpoints, an engine-less paged-KV greedy driver,
and the transformers reference it is compared against.

API (kept stable; other test files import it):
  make_tiny_checkpoint(kind, path, **overrides) -> Path
  run_engineless_greedy(model_path, prompts, max_new_tokens, chunk_size, dtype, ..., on_model) -> (tokens, logits)
  hf_greedy_reference(model_path, prompts, max_new_tokens, dtype) -> (tokens, logits)
  random_prompts(n, vocab_size, lengths, seed) -> list[list[int]]
  single_thread() -> context manager running torch on one CPU thread (tiny models on a busy
                     2-core machine run several times faster without OpenMP spin-waits)
tokens: one list of generated ids per prompt; logits: one float32 [max_new_tokens, V] per prompt
(row i: the logits that chose token i).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

TINY_KINDS = ("llama", "qwen3", "qwen3_moe", "deepseek_v3")

_COMMON: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Wider than the default 0.02 so that logits are peaked: greedy choices never hinge on 1e-6 ties.
    initializer_range=0.15,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


@contextmanager
def single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _tiny_config(kind: str, overrides: dict[str, Any]) -> Any:
    import transformers as tf

    if kind == "llama":
        fields = dict(_COMMON, rope_theta=10000.0)
        cls = tf.LlamaConfig
    elif kind == "qwen3":
        fields = dict(_COMMON, head_dim=16, rope_theta=1000000.0)
        cls = tf.Qwen3Config
    elif kind == "qwen3_moe":
        fields = dict(
            _COMMON,
            head_dim=16,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rope_theta=1000000.0,
        )
        cls = tf.Qwen3MoeConfig
    elif kind == "deepseek_v3":
        fields = dict(
            _COMMON,
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_theta=10000.0,
            rope_scaling={
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        )
        cls = tf.DeepseekV3Config
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; valid: {', '.join(TINY_KINDS)}")
    fields.update(overrides)
    return cls(**fields)


def make_tiny_checkpoint(kind: str, path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Build a tiny random float32 model of `kind` with transformers and save_pretrained it."""
    from transformers import AutoModelForCausalLM

    config = _tiny_config(kind, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "deepseek_v3":
        # HF initialises the routing bias to zeros; a random one exercises noaux_tc selection.
        for name, buf in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                buf.data.uniform_(-0.5, 0.5)
    path = Path(path)
    model.save_pretrained(path)
    return path


def random_prompts(n: int, vocab_size: int, lengths: list[int] | None = None, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = lengths or [rng.randint(3, 24) for _ in range(n)]
    return [[rng.randrange(vocab_size) for _ in range(length)] for length in lengths[:n]]


def hf_greedy_reference(
    model_path: str | Path, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype = torch.float32
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding with transformers, re-running the whole sequence each step (no KV cache)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, attn_implementation="eager").eval()
    all_tokens: list[list[int]] = []
    all_logits: list[torch.Tensor] = []
    with torch.no_grad():
        for prompt in prompts:
            ids, steps = list(prompt), []
            for _ in range(max_new_tokens):
                out = model(torch.tensor([ids]), use_cache=False)
                logits = out.logits[0, -1].float()
                steps.append(logits)
                ids.append(int(logits.argmax()))
            all_tokens.append(ids[len(prompt) :])
            all_logits.append(torch.stack(steps))
    return all_tokens, all_logits


class _Seq:
    def __init__(self, idx: int, prompt: list[int]) -> None:
        self.idx, self.prompt = idx, prompt
        self.tokens = list(prompt)  # prompt + generated
        self.computed = 0  # tokens whose KV is in the pool
        self.generated: list[int] = []
        self.logits: list[torch.Tensor] = []


def run_engineless_greedy(
    model_path: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    chunk_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    attention_backend: str = "torch_native",
    on_model: Callable[[torch.nn.Module], None] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy decoding through the loader, a paged KV pool and ForwardBatch, without the scheduler.
    `on_model` sees the loaded model before the first forward (to hook it).

    Each step runs every decoding sequence (one token) plus prefill chunks of up to `chunk_size`
    prompt tokens in total, so chunks and decodes of several sequences share one forward. KV slots
    are handed out from a shuffled free list, so no sequence's cache is contiguous.
    """
    from ftransformers.attention.backend import create_attention_backend
    from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode, forward_context
    from ftransformers.cache.kv_pool import make_kv_pool
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.models.loader import load_model
    from ftransformers.models.registry import get_model_class

    mc = ModelConfig.from_pretrained(model_path, dtype=str(dtype).removeprefix("torch."))
    model = load_model(mc, device, dtype)
    if on_model is not None:
        on_model(model)
    spec = get_model_class(mc.architecture).kv_spec(mc.hf_config)
    max_len = max(len(p) for p in prompts) + max_new_tokens
    capacity = sum(len(p) for p in prompts) + len(prompts) * max_new_tokens
    pool = make_kv_pool(spec, capacity, dtype, device)
    free_slots = list(range(1, capacity + 1))
    random.Random(1234).shuffle(free_slots)
    req_to_token = torch.zeros(len(prompts), max_len, dtype=torch.int64, device=device)
    backend = create_attention_backend(attention_backend)
    seqs = [_Seq(i, list(p)) for i, p in enumerate(prompts)]

    while any(len(s.generated) < max_new_tokens for s in seqs):
        budget = chunk_size
        batch: list[tuple[_Seq, int, bool]] = []  # (seq, new tokens, sample after them)
        for s in seqs:
            if s.computed >= len(s.prompt) and len(s.generated) < max_new_tokens:
                batch.append((s, 1, True))
        for s in seqs:
            remaining = len(s.prompt) - s.computed
            if remaining > 0 and budget > 0:
                n = min(remaining, budget)
                budget -= n
                batch.append((s, n, n == remaining))
        ids, pos, locs, logit_rows = [], [], [], []
        for s, n, sample in batch:
            new_slots = [free_slots.pop() for _ in range(n)]
            req_to_token[s.idx, s.computed : s.computed + n] = torch.tensor(new_slots, device=device)
            ids += s.tokens[s.computed : s.computed + n]
            pos += list(range(s.computed, s.computed + n))
            locs += new_slots
            if sample:
                logit_rows.append(len(ids) - 1)
        ext = [n for _, n, _ in batch]
        pre = [s.computed for s, _, _ in batch]
        lens = [p + n for p, n in zip(pre, ext)]

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        fb = ForwardBatch(
            mode=ForwardMode.DECODE if all(n == 1 for n in ext) else ForwardMode.EXTEND,
            input_ids=t(ids),
            positions=t(pos),
            out_cache_loc=t(locs),
            req_pool_indices=t([s.idx for s, _, _ in batch]),
            seq_lens=t(lens),
            prefix_lens=t(pre),
            extend_lens=t(ext),
            seq_lens_cpu=lens,
            prefix_lens_cpu=pre,
            extend_lens_cpu=ext,
            logits_indices=t(logit_rows),
            req_to_token=req_to_token,
            kv_pool=pool,
            attn_backend=backend,
        )
        with torch.no_grad(), forward_context(fb):
            hidden = model(fb.input_ids, fb.positions)
            logits = model.compute_logits(hidden[fb.logits_indices])  # [S, V] float32
        row = 0
        for s, n, sample in batch:
            s.computed += n
            if sample:
                token = int(logits[row].argmax())
                s.logits.append(logits[row].cpu())
                s.generated.append(token)
                s.tokens.append(token)
                row += 1
    return [s.generated for s in seqs], [torch.stack(s.logits) for s in seqs]
