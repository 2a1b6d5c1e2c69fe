"""Fidelity of quantized checkpoints against the unquantized model on real weights (CPU is enough).

For each method: quantize the demo model (SmolLM2-135M-Instruct) with `ftransformers quantize`, run
the engine teacher-forced over held-out public-domain text (GSM8K test questions and answers from
../shared/data, cut into 512-token windows), and compare next-token distributions with the same
engine on the unquantized checkpoint in float32: top-1 agreement, mean KL(ref || quant), and
perplexity of the text under each. The unquantized model in bfloat16 is printed as a yardstick.

    PYTHONPATH=. python benchmarks/quant_fidelity.py --tokens 50000 --out benchmarks/results/quant_fidelity.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
WINDOW = 512


def gsm8k_rows() -> list[dict[str, str]]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def calibration_ids(tokenizer: Any, tokens: int = 4096) -> list[int]:
    """SmoothQuant calibration text: GSM8K rows from the end of the file, disjoint from the evaluation text
    (which is read from the start and needs far fewer rows)."""
    ids: list[int] = []
    for row in reversed(gsm8k_rows()):
        ids += tokenizer(row["question"] + "\n" + row["answer"] + "\n\n")["input_ids"]
        if len(ids) >= tokens:
            return ids[:tokens]
    return ids


def text_windows(tokenizer: Any, tokens: int) -> list[list[int]]:
    rows = gsm8k_rows()
    ids: list[int] = []
    for row in rows:
        ids += tokenizer(row["question"] + "\n" + row["answer"] + "\n\n")["input_ids"]
        if len(ids) >= tokens + 1:
            break
    ids = ids[: tokens + 1]
    return [ids[i : i + WINDOW + 1] for i in range(0, len(ids) - 1, WINDOW)]


def teacher_forced_logprobs(path: Path, dtype: str, windows: list[list[int]]) -> torch.Tensor:
    """log-softmax [N, V] float32 of the engine at every position that predicts a next token."""
    from ftransformers import LLM
    from ftransformers.config.sampling_params import SamplingParams
    from ftransformers.runtime.step_io import SeqStep, StepBatch

    llm = LLM(str(path), device="cpu", dtype=dtype, skip_tokenizer_init=True, max_total_tokens=4 * WINDOW)
    runner, model = llm.runner, llm.runner.model
    captured: dict[str, torch.Tensor] = {}
    forward = model.forward

    def capture(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        captured["hidden"] = forward(input_ids, positions)
        return captured["hidden"]

    model.forward = capture  # type: ignore[method-assign]
    out = []
    for w in windows:
        ids = w[:-1]
        step = SeqStep(rid="w", req_pool_idx=0, input_ids=ids, prefix_len=0, slots_start=0,
                       slots=list(range(1, len(ids) + 1)), sample=True, sampling=SamplingParams(temperature=0.0),
                       prompt_ids=ids, output_ids=[])  # fmt: skip
        runner.forward_step(StepBatch([step]))
        with torch.inference_mode():
            out.append(model.compute_logits(captured["hidden"]).float().log_softmax(-1))
    return torch.cat(out)


def compare(ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {
        "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "mean_kl": (ref.exp() * (ref - got)).sum(-1).mean().item(),
        "perplexity": torch.exp(-got.gather(1, targets[:, None]).mean()).item(),
    }


def main() -> None:
    from transformers import AutoTokenizer

    from ftransformers.entrypoints.demo_model import ensure_demo_model
    from ftransformers.entrypoints.quantize import METHODS, quantize_checkpoint

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=50000)
    p.add_argument("--methods", default=",".join(sorted(METHODS)))
    p.add_argument("--dtypes", default="float32", help="engine dtypes for the quantized checkpoints")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = ensure_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    windows = text_windows(tokenizer, args.tokens)
    calib = calibration_ids(tokenizer)
    assert len(windows) * WINDOW < len(gsm8k_rows()) * 50, "evaluation and calibration text may overlap"
    targets = torch.tensor([t for w in windows for t in w[1:]])
    t0 = time.time()
    ref = teacher_forced_logprobs(base, "float32", windows)
    rows = [{"method": "none (bfloat16)", **compare(ref, teacher_forced_logprobs(base, "bfloat16", windows), targets)}]
    ref_ppl = torch.exp(-ref.gather(1, targets[:, None]).mean()).item()
    with tempfile.TemporaryDirectory() as tmp:
        variants = [(m, None) for m in args.methods.split(",")]
        if "w8a8-int8" in args.methods.split(","):
            variants.append(("w8a8-int8", calib))  # SmoothQuant, alpha 0.5
        for method, calib_ids in variants:
            label = method + (" + SmoothQuant" if calib_ids else "")
            qpath = Path(tmp) / label.replace(" ", "")
            quantize_checkpoint(base, qpath, method, calib_ids=calib_ids)
            for dtype in args.dtypes.split(","):
                rows.append({"method": f"{label} ({dtype})",
                             **compare(ref, teacher_forced_logprobs(qpath, dtype, windows), targets)})  # fmt: skip
    result = {"model": "SmolLM2-135M-Instruct", "text": "GSM8K test questions + answers", "tokens": len(targets),
              "reference": "unquantized, float32, same engine", "reference_perplexity": ref_ppl, "rows": rows,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "seconds": time.time() - t0}  # fmt: skip
    print(f"{result['model']}, {result['tokens']} tokens of {result['text']}; reference perplexity {ref_ppl:.3f}")
    print("| method | top-1 agreement | mean KL | perplexity |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {100 * r['top1_agreement']:.2f}% | {r['mean_kl']:.4f} | {r['perplexity']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
