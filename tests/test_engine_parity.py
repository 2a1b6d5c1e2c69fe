"""Whole-engine parity with Hugging Face transformers (float32, CPU).

Four prompts of different lengths go in together through `LLM.generate`, with chunked prefill forced
small so prefill chunks and decodes share steps. Greedy tokens must equal transformers' for 32 tokens,
and the engine's top-5 log-probabilities must match transformers' within 1e-3 at every step. The same
holds on a second pass served from the radix cache, and under a KV pool so small that running
requests get retracted. The retraction test runs with overlap scheduling forced on (CUDA's default;
on the CPU it is otherwise off), so future placeholders, late stop checks and retraction of a
request with a token in flight meet the real model runner.

`FT_TEST_DEVICE=cuda FT_TEST_DTYPE=bfloat16` runs the same tests on a GPU in bfloat16, against the
float32 reference with the looser rule of `_check`; there the engine's defaults pick the fast path
(Triton attention and MoE, CUDA graphs, overlap scheduling), `FT_TEST_DISABLE_CUDA_GRAPH=1` runs
decode eagerly and `FT_TEST_DISABLE_OVERLAP=1` schedules without overlap.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import os

from ftransformers import LLM, SamplingParams
from tests.model_harness import make_tiny_checkpoint

KINDS = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]
NEW_TOKENS = 32
TOP = 5
DEVICE = os.environ.get("FT_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("FT_TEST_DTYPE", "float32")
# Log-softmax differences (the same scale as logits differences) allowed per engine dtype.
STRICT = DTYPE == "float32"
ENGINE_ARGS = {"dtype": DTYPE, "device": DEVICE, "skip_tokenizer_init": True,
               "disable_cuda_graph": os.environ.get("FT_TEST_DISABLE_CUDA_GRAPH") == "1",
               "disable_overlap_schedule": os.environ.get("FT_TEST_DISABLE_OVERLAP") == "1"}
LOGPROB_TOL = 1e-3  # float32: per log-prob (the same scale as a logits difference)
CHOICE_GAP = 0.5  # bfloat16/float16: largest float32 gap a rounding-flipped greedy choice may have


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    lengths = [3, 11, 26, 47]
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _teacher_forced(path: Path, prompts: list[list[int]], outputs: list, dtype: torch.dtype) -> list[torch.Tensor]:
    """transformers' log-softmax [NEW_TOKENS, V] at each step of the engine's own sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    rows = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            seq = torch.tensor([prompt + out.token_ids], device=DEVICE)
            logits = model(seq).logits[0, len(prompt) - 1 : -1].float()  # [NEW_TOKENS, V]
            rows.append(torch.log_softmax(logits, dim=-1).cpu())
    return rows


def _check(path: Path, prompts: list[list[int]], outputs: list, label: str) -> None:
    """float32: every greedy token is transformers' argmax given the same prefix (so the sequences are
    identical to transformers' greedy ones) and every top-5 log-prob is within 1e-3.
    bfloat16/float16: against the float32 reference the engine's mean top-5 error is at most twice
    transformers' own error in that dtype (plus 0.01), and a greedy token other than float32's argmax
    appears only where float32's gap to it is below CHOICE_GAP (a near-tie that rounding can flip) or
    where transformers in the same dtype, given the same prefix, picks that token as well (bfloat16
    rounding can flip an MoE routing decision and move a logit by more than the gap)."""
    reference = _teacher_forced(path, prompts, outputs, torch.float32)
    low = None if STRICT else _teacher_forced(path, prompts, outputs, getattr(torch, DTYPE))
    engine_err: list[float] = []
    hf_err: list[float] = []
    for i, out in enumerate(outputs):
        assert len(out.token_ids) == NEW_TOKENS and out.logprobs is not None and len(out.logprobs) == NEW_TOKENS
        for step, entry in enumerate(out.logprobs):
            ref_row, token = reference[i][step], out.token_ids[step]
            gap = (ref_row.max() - ref_row[token]).item()
            if STRICT:
                assert gap == 0.0, f"{label}: prompt {i} step {step}: greedy token differs from transformers'"
            else:
                assert low is not None
                same_as_hf = int(low[i][step].argmax()) == token  # transformers in DTYPE picks it too
                assert gap <= CHOICE_GAP or same_as_hf, (
                    f"{label}: prompt {i} step {step}: picked a token {gap:.3f} below float32's best, "
                    f"which transformers in {DTYPE} does not pick either"
                )
            for tok, logprob in [(token, entry.logprob), *entry.top_logprobs]:
                diff = abs(logprob - ref_row[tok].item())
                if STRICT:
                    assert diff <= LOGPROB_TOL, f"{label}: prompt {i} step {step} token {tok} off by {diff:.2e}"
                engine_err.append(diff)
                if low is not None:
                    hf_err.append(abs(low[i][step][tok].item() - ref_row[tok].item()))
    if not STRICT:
        mean_engine, mean_hf = sum(engine_err) / len(engine_err), sum(hf_err) / len(hf_err)
        print(f"{label}: mean |logprob error| engine {mean_engine:.4f}, transformers {DTYPE} {mean_hf:.4f}")
        assert mean_engine <= 2 * mean_hf + 0.01, f"{label}: engine error {mean_engine:.4f} vs transformers {mean_hf:.4f}"


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path


def _check_path(llm: LLM) -> None:
    """On CUDA the defaults must have chosen the fast path, so these tests cover it."""
    runner = llm.runner
    if DEVICE == "cuda":
        assert runner.attn_backend_name == "triton" and runner.moe_backend == "triton"
        assert (runner.graph_runner is None) == ENGINE_ARGS["disable_cuda_graph"]
        assert llm.scheduler.overlap != ENGINE_ARGS["disable_overlap_schedule"]
    else:
        assert runner.attn_backend_name == "torch_native" and runner.graph_runner is None
        assert not llm.scheduler.overlap


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)


def test_parity_chunked_then_radix_hit(checkpoint: tuple[str, Path]) -> None:
    kind, path = checkpoint
    llm = LLM(str(path), chunked_prefill_size=8, max_total_tokens=4096, **ENGINE_ARGS)
    _check_path(llm)
    prompts = _prompts(llm.model_config.vocab_size)

    first = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    _check(path, prompts, first, f"{kind} cold")
    assert all(o.finish_reason == "length" for o in first)

    second = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    if STRICT:
        assert [o.token_ids for o in second] == [o.token_ids for o in first]
    _check(path, prompts, second, f"{kind} radix hit")
    # Every prompt is cached now except the token that must be recomputed to sample from.
    assert [o.cached_tokens for o in second] == [len(p) - 1 for p in prompts]


def test_parity_single_sequence(checkpoint: tuple[str, Path]) -> None:
    """Batch 1 alone: on CUDA the decode-only kernels (one-row GEMV, the batch-1 graph) run."""
    kind, path = checkpoint
    llm = LLM(str(path), max_total_tokens=1024, **ENGINE_ARGS)
    prompts = _prompts(llm.model_config.vocab_size)[2:3]
    _check(path, prompts, llm.generate(prompt_token_ids=prompts, sampling_params=_params()), f"{kind} alone")


def test_parity_under_retraction(checkpoint: tuple[str, Path]) -> None:
    kind, path = checkpoint
    # 4 requests need 4 * (<= 47 + 32) tokens at the end; 120 slots force retractions on the way.
    llm = LLM(
        str(path), chunked_prefill_size=16, max_total_tokens=120, disable_radix_cache=True, **ENGINE_ARGS
    )
    if not ENGINE_ARGS["disable_overlap_schedule"]:
        llm.scheduler.overlap = True  # nothing launched yet, so switching now is safe
    prompts = _prompts(llm.model_config.vocab_size)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=_params())
    assert llm.scheduler.stats().num_retractions > 0, "the pool was meant to be too small for all four"
    _check(path, prompts, outputs, f"{kind} retracted")
