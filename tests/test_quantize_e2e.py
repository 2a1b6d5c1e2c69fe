"""The whole path for every method: `ftransformers quantize` -> `LLM` load -> greedy generation, against
transformers running the fake-quantized model: every quantized linear (and MoE expert) holds the weight
decoded from the written checkpoint by the independent decoders of test_quantize_formats.py, every other
tensor (norms and routers AWQ rescaled, embeddings, lm_head) is read from the written checkpoint, and for
fp8 / w8a8-int8 each quantized linear's input is round-tripped through the format's dynamic activation
quantization (per token and 128-column group to E4M3 / per token to INT8). Float32 throughout.

Bounds: greedy picks transformers' choice or the other side of a near-tie (gap <= 0.05). Weight-only
formats compute the same float32 function in another op order: log-prob differences mean <= 1e-4,
max <= 1e-3. Activation-quantized formats turn 1e-7 input differences into whole rounding steps now
and then (see test_quant_w8a8.py): mean <= 5e-3, max <= 0.05.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ftransformers import LLM, SamplingParams
from ftransformers.entrypoints.quantize import quantize_checkpoint
from ftransformers.kernels.quant_formats import quantize_act_fp8, quantize_act_int8
from tests.model_harness import make_tiny_checkpoint
from tests.test_quantize_formats import METHODS, decode_module, method_kwargs, quantized_modules, read_checkpoint

NEW_TOKENS = 10
ACT_QUANT = {"fp8", "w8a8-int8"}


ActQuant = Callable[[torch.Tensor], torch.Tensor]


def _act_fn(method: str) -> ActQuant | None:
    """x [M, K] -> x as the format's dynamic activation quantization leaves it (float32)."""
    if method == "w8a8-int8":
        def int8(x: torch.Tensor) -> torch.Tensor:
            q, s = quantize_act_int8(x)
            return q.float() * s

        return int8
    if method == "fp8":
        def fp8(x: torch.Tensor) -> torch.Tensor:
            q, s = quantize_act_fp8(x, 128)
            return q.float() * s.repeat_interleave(128, dim=-1)[:, : x.shape[1]]

        return fp8
    return None


def _experts_forward(mod: torch.nn.Module, aq: ActQuant) -> Callable[..., torch.Tensor]:
    """transformers' expert loop with both expert GEMM inputs activation-quantized."""
    inter = mod.gate_up_proj.shape[1] // 2

    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(mod.gate_up_proj.shape[0]):
            tok, slot = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gu = aq(hidden[tok]) @ mod.gate_up_proj[e].t()
            y = aq(mod.act_fn(gu[:, :inter]) * gu[:, inter:]) @ mod.down_proj[e].t()
            out.index_add_(0, tok, y * top_k_weights[tok, slot, None])
        return out

    return forward


def fake_quant_model(src: Path, qpath: Path, method: str, work: Path) -> torch.nn.Module:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    tensors, cfg = read_checkpoint(qpath)
    modules = quantized_modules(tensors)
    state = {k: v.float() for k, v in tensors.items() if k.rsplit(".", 1)[0] not in modules}
    state |= {f"{m}.weight": decode_module(method, t, cfg).contiguous() for m, t in modules.items()}
    work.mkdir()
    save_file(state, str(work / "model.safetensors"))
    (work / "config.json").write_text((src / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).eval()
    aq = _act_fn(method)
    if aq is not None:
        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name in modules:
                mod.register_forward_pre_hook(lambda _m, args: (aq(args[0].reshape(-1, args[0].shape[-1])).view_as(args[0]),))
            if isinstance(getattr(mod, "gate_up_proj", None), torch.Tensor) and f"{name}.0.down_proj" in modules:
                mod.forward = _experts_forward(mod, aq)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("method", METHODS)
def test_quantize_load_generate_matches_fake_quant_transformers(method: str, kind: str, tmp_path: Path) -> None:
    _check(method, kind, tmp_path, **method_kwargs(method))


@pytest.mark.parametrize("kind, extra", [("llama", {"desc_act": True}), ("qwen3_moe", {"desc_act": True}),
                                         ("llama", {"group_size": -1}), ("qwen3_moe", {"symmetric": False})])
def test_gptq_variants(kind: str, extra: dict, tmp_path: Path) -> None:
    """Act order (dense layers permuted, experts not), one group per row, asymmetric."""
    _check("gptq", kind, tmp_path, **(method_kwargs("gptq") | extra))


def _check(method: str, kind: str, tmp_path: Path, **kwargs: object) -> None:
    src = make_tiny_checkpoint(kind, tmp_path / "src")
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, method, **kwargs)
    llm = LLM(str(dst), dtype="float32", device="cpu", skip_tokenizer_init=True)
    prompts = [[5, 9, 17, 33, 2], [7] * 9]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    model = fake_quant_model(src, dst, method, tmp_path / "fake")
    diffs = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            seq = prompt + out.token_ids
            ref = model(torch.tensor([seq])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            for step, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
                assert entry.token_id == tok
                assert ref[step].max() - ref[step][tok] <= 0.05, (step, tok)
                diffs.append(abs(entry.logprob - ref[step][tok].item()))
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    bound = (5e-3, 0.05) if method in ACT_QUANT else (1e-4, 1e-3)
    assert mean <= bound[0] and worst <= bound[1], (mean, worst)
