"""Every quantized checkpoint format on a dense model (tiny Qwen3: fused qkv and gate_up), CPU.

Each test writes the checkpoint with the independent writers of test_quant_load_common.py, loads it
with ftransformers (format detected from `quantization_config`) and checks
  (a) every layer's dequantized kernel-layout weight equals what the test quantized: bit-exact for the
      integer and FP8 formats (the same products of exactly representable values), to 1 ulp of
      float32 for NVFP4 (we multiply by 1/global_scale where compressed-tensors divides);
  (b) greedy decoding through the loader and paged KV equals transformers running the same model with
      the dequantized weights (and, for W8A8 / FP8, each quantized layer's input fake-quantized as the
      format does), teacher-forced on the engine's tokens: logits to 5e-5 (float32, different op
      order; 5e-6 seen), every greedy token transformers' best to 1e-4.
      Activation-quantized formats need two more things for that. A 1e-7 op-order difference next to a
      rounding boundary moves one element an int8 step (1/127 of the row's max) or an E4M3 step (1/16
      relative), and every layer after it (0.18 on the tiny DeepSeek-V3's logits). So these formats run
      one prompt per batch, the prompt in one chunk, against transformers run the same way (prompt,
      then one token per forward on its KV cache), and the reference rounds the engine's own input to
      each quantized layer wherever the two agree to float noise (1e-5 of the row's max;
      test_quant_load_common.snap_to_engine). A real difference is larger than that and is not
      snapped; the reference's own quantizer still rounds what it is given.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model_harness import make_tiny_checkpoint, run_engineless_greedy
from tests.test_quant_load_common import (
    SNAP_RTOL,
    EngineActInputs,
    engine_weights,
    hf_logits,
    snap_to_engine,
    write_dequantized,  # fmt: skip
    write_quantized,
)

PROMPTS = [[5, 9, 17, 33, 2, 71], [7, 7, 7, 120, 3]]
NEW_TOKENS = 5
DENSE_FORMATS = ["awq", "gptq", "gptq_v2_act", "ct_int4", "ct_int4_asym", "ct_w8a8", "ct_fp8", "ct_nvfp4",
                 "ct_mxfp4", "ct_mixed", "fp8", "w8a8_int8"]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3") / "src")


def check_format(src: Path, tmp: Path, fmt: str) -> None:
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.models.loader import load_model

    deq = write_quantized(src, tmp / fmt, fmt)
    model = load_model(ModelConfig.from_pretrained(tmp / fmt, dtype="float32"), "cpu", torch.float32)
    got = engine_weights(model)
    for module, (want, _) in deq.items():
        rtol = 2e-7 if fmt == "ct_nvfp4" else 0.0
        torch.testing.assert_close(got[module], want, rtol=rtol, atol=0.0, msg=lambda m, name=module: f"{name}: {m}")
    quantized = [m for m in model.modules() if getattr(m, "qw", None) is not None or getattr(m, "w13_qw", None) is not None]
    assert len(quantized) > 0 and all(getattr(m, "quant_method", None) is not None for m in quantized)
    for m in quantized:  # row-major strides, size-1 dims included: the Triton launchers assert them
        for qw in (getattr(m, "qw", None), getattr(m, "w13_qw", None), getattr(m, "w2_qw", None)):
            for t in (qw.qweight, qw.scales, qw.zeros, qw.global_scale) if qw is not None else ():
                if t is not None:
                    assert t.stride() == torch.empty(t.shape, device="meta").stride(), (fmt, t.shape, t.stride())

    act_quant = any(kind is not None for _, kind in deq.values())
    ref_dir = write_dequantized(src, tmp / f"{fmt}-deq", deq)
    if act_quant:  # one prompt per batch, each forward the reference's too, rounding the engine's inputs
        seen = EngineActInputs()
        with seen.recording():
            runs = [run_engineless_greedy(tmp / fmt, [p], NEW_TOKENS, chunk_size=len(p), on_model=seen.attach)
                    for p in PROMPTS]  # fmt: skip
        tokens, logits = [r[0][0] for r in runs], [r[1][0] for r in runs]
        assert seen.by_module, "no activation-quantized input was recorded"
        refs = hf_logits(ref_dir, deq, [p + t for p, t in zip(PROMPTS, tokens)], [len(p) for p in PROMPTS],
                         engine_inputs=seen.by_module)  # fmt: skip
    else:
        tokens, logits = run_engineless_greedy(tmp / fmt, PROMPTS, NEW_TOKENS, chunk_size=4)
        full = hf_logits(ref_dir, deq, [p + t for p, t in zip(PROMPTS, tokens)])
        refs = [r[len(p) - 1 : len(p) - 1 + len(t)] for p, t, r in zip(PROMPTS, tokens, full)]  # rows choosing each
    diffs = []
    for toks, ours, ref in zip(tokens, logits, refs):
        diffs.append((ours - ref).abs())
        best = ref.max(-1).values
        chosen = ref.gather(1, torch.tensor(toks).unsqueeze(1)).squeeze(1)
        assert bool(((best - chosen) <= 1e-4).all()), (fmt, toks, best - chosen)
    diff = torch.cat(diffs)
    assert diff.max() <= 5e-5, (fmt, diff.max().item())


@pytest.mark.parametrize("fmt", DENSE_FORMATS)
def test_dense_checkpoint_loads_and_matches_transformers(fmt: str, qwen3: Path, tmp_path: Path) -> None:
    check_format(qwen3, tmp_path, fmt)


def test_act_order_becomes_a_column_permutation(qwen3: Path, tmp_path: Path) -> None:
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.models.loader import load_model

    write_quantized(qwen3, tmp_path / "g", "gptq_v2_act")
    model = load_model(ModelConfig.from_pretrained(tmp_path / "g", dtype="float32"), "cpu", torch.float32)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.qw.perm is not None and sorted(qkv.qw.perm.tolist()) == list(range(64))
    assert qkv.qw.zeros is not None  # asymmetric: zeros kept
    sym = ModelConfig.from_pretrained(qwen3, dtype="float32")
    write_quantized(qwen3, tmp_path / "s", "gptq")
    model = load_model(ModelConfig.from_pretrained(tmp_path / "s", dtype="float32"), "cpu", torch.float32)
    qw = model.model.layers[0].mlp.down_proj.qw
    assert qw.perm is None and qw.zeros is None and sym is not None  # symmetric v1: every zero 8, dropped
    assert not any("qweight" in n or "g_idx" in n for n, _ in model.named_parameters())  # checkpoint layouts freed


def test_reference_snaps_only_rows_within_float_noise() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, 64, generator=gen)  # [..., K]: rows are the flattened leading dims
    flat = x.reshape(-1, 64)
    row_max = flat.abs().amax(-1, keepdim=True)
    engine = flat + (torch.rand(flat.shape, generator=gen) - 0.5) * SNAP_RTOL * row_max  # noise: within
    engine[5, 17] += 10 * SNAP_RTOL * row_max[5, 0]  # a real difference in one element of row 5
    got = snap_to_engine(x, engine).reshape(-1, 64)
    torch.testing.assert_close(got[5], flat[5], rtol=0, atol=0)  # kept: the logits will show it
    others = [r for r in range(flat.shape[0]) if r != 5]
    torch.testing.assert_close(got[others], engine[others], rtol=0, atol=0)
    assert not torch.equal(got[others], flat[others])
    assert snap_to_engine(x, engine[:-1]) is x  # no engine input of this shape: the reference's own
    assert snap_to_engine(x, None) is x
