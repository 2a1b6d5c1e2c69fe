"""Fidelity of every `ftransformers quantize` method against the unquantized model on real weights (CPU).

For each method: quantize the demo model (SmolLM2-135M-Instruct) with `quantize_checkpoint`, run the
engine (`LLM`) teacher-forced over held-out text (GSM8K test questions and answers from
../shared/data, cut into 512-token windows, read from the first row on), and compare next-token
distributions with the same engine on the unquantized checkpoint in float32: top-1 agreement, mean
KL(ref || quant), and perplexity of the text under each. The unquantized model in bfloat16 is the
yardstick. Calibration text (AWQ, GPTQ, SmoothQuant) is GSM8K rows read from the end of the file,
disjoint from the evaluation rows (checked). All engines run window by window side by side, so no
method's log-probs over the whole text are ever held (50k tokens x 49k vocab would be 10 GB each).

SmolLM2-135M's hidden size is 576 = 4.5 x 128: a group size of 128 does not divide q/k/v/gate/up's
in_features, so the int4 methods use --group-size 64 (the largest power of two that divides 576 and 1536).

    PYTHONPATH=. python benchmarks/quant_fidelity.py --tokens 50000 --out benchmarks/results/quant_fidelity_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"
WINDOW = 512
VARIANTS = ("w8a8-int8", "w8a8-int8+sq", "fp8", "rtn-int4", "awq", "gptq", "mxfp4", "nvfp4")


def gsm8k_rows() -> list[dict[str, str]]:
    return [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]


def _row_ids(tokenizer: Any, row: dict[str, str]) -> list[int]:
    return tokenizer(row["question"] + "\n" + row["answer"] + "\n\n")["input_ids"]


def text_windows(tokenizer: Any, tokens: int) -> tuple[list[list[int]], int]:
    """(windows of WINDOW + 1 ids from the first rows on, number of rows read)."""
    ids: list[int] = []
    rows = gsm8k_rows()
    used = 0
    for used, row in enumerate(rows, 1):
        ids += _row_ids(tokenizer, row)
        if len(ids) >= tokens + 1:
            break
    ids = ids[: tokens + 1]
    return [ids[i : i + WINDOW + 1] for i in range(0, len(ids) - 1, WINDOW)], used


def calibration_ids(tokenizer: Any, tokens: int) -> tuple[list[int], int]:
    """(calibration ids from the last rows backwards, index of the first row used)."""
    ids: list[int] = []
    rows = gsm8k_rows()
    for i in range(len(rows) - 1, -1, -1):
        ids += _row_ids(tokenizer, rows[i])
        if len(ids) >= tokens:
            return ids[:tokens], i
    return ids, 0


class Engine:
    """An `LLM` whose last hidden states are captured so logits can be read at every position."""

    def __init__(self, path: Path, dtype: str) -> None:
        from ftransformers import LLM

        self.llm = LLM(str(path), device="cpu", dtype=dtype, skip_tokenizer_init=True, max_total_tokens=4 * WINDOW)
        self.model = self.llm.runner.model
        self.captured: dict[str, torch.Tensor] = {}
        forward = self.model.forward

        def capture(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            self.captured["hidden"] = forward(input_ids, positions)
            return self.captured["hidden"]

        self.model.forward = capture  # type: ignore[method-assign]

    def logprobs(self, window: list[int]) -> torch.Tensor:
        """log-softmax [len - 1, V] float32 at every position of `window` that predicts a next token."""
        from ftransformers.config.sampling_params import SamplingParams
        from ftransformers.runtime.step_io import SeqStep, StepBatch

        ids = window[:-1]
        step = SeqStep(rid="w", req_pool_idx=0, input_ids=ids, prefix_len=0, slots_start=0,
                       slots=list(range(1, len(ids) + 1)), sample=True, sampling=SamplingParams(temperature=0.0),
                       prompt_ids=ids, output_ids=[])  # fmt: skip
        self.llm.runner.forward_step(StepBatch([step]))
        with torch.inference_mode():
            return self.model.compute_logits(self.captured["hidden"]).float().log_softmax(-1)


class Tally:
    def __init__(self) -> None:
        self.agree = self.kl = self.nll = 0.0
        self.n = 0

    def add(self, ref: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> None:
        self.agree += float((got.argmax(-1) == ref.argmax(-1)).sum())
        self.kl += float((ref.exp() * (ref - got)).sum())
        self.nll -= float(got.gather(1, targets[:, None]).sum())
        self.n += targets.numel()

    def row(self, method: str, **extra: Any) -> dict[str, Any]:
        return {"method": method, "top1_agreement": self.agree / self.n, "mean_kl": self.kl / self.n,
                "perplexity": float(torch.exp(torch.tensor(self.nll / self.n))), **extra}  # fmt: skip


def quantize_variant(base: Path, out: Path, variant: str, calib: list[int], group: int) -> dict[str, Any]:
    from ftransformers.entrypoints.quantize import quantize_checkpoint

    method = variant.removesuffix("+sq")
    kw: dict[str, Any] = {}
    if method in ("rtn-int4", "awq", "gptq"):
        kw["group_size"] = group
    if method in ("awq", "gptq") or variant.endswith("+sq"):
        kw["calib_ids"] = calib
    t0 = time.time()
    summary = quantize_checkpoint(base, out, method, **kw)
    return {"quantize_seconds": round(time.time() - t0, 1), "quantize_summary": summary}


def label(variant: str, group: int) -> str:
    method = variant.removesuffix("+sq")
    name = method + (" + SmoothQuant (α 0.5)" if variant.endswith("+sq") else "")
    if method == "rtn-int4":
        name += f" g{group} asym (compressed-tensors)"
    elif method == "awq":
        name += f" g{group}"
    elif method == "gptq":
        name += f" g{group} sym"
    return name


def main() -> None:
    from transformers import AutoTokenizer

    from ftransformers.entrypoints.demo_model import ensure_demo_model

    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=50000)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calib-tokens", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    base = ensure_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    windows, eval_rows = text_windows(tokenizer, args.tokens)
    calib, first_calib_row = calibration_ids(tokenizer, args.calib_tokens)
    assert eval_rows <= first_calib_row, f"evaluation rows 0..{eval_rows} overlap calibration rows {first_calib_row}.."
    targets = [torch.tensor(w[1:]) for w in windows]
    t0 = time.time()
    variants = [v for v in args.variants.split(",") if v]
    with tempfile.TemporaryDirectory() as tmp:
        extras: dict[str, dict[str, Any]] = {}
        for v in variants:
            print(f"quantizing {v} ...", file=sys.stderr, flush=True)
            extras[v] = quantize_variant(base, Path(tmp) / v, v, calib, args.group_size)
        ref = Engine(base, "float32")
        engines = {"none (bfloat16)": Engine(base, "bfloat16")}
        engines |= {label(v, args.group_size): Engine(Path(tmp) / v, "float32") for v in variants}
        tallies = {name: Tally() for name in engines}
        ref_nll = 0.0
        for i, (w, tgt) in enumerate(zip(windows, targets)):
            r = ref.logprobs(w)
            ref_nll -= float(r.gather(1, tgt[:, None]).sum())
            for name, engine in engines.items():
                tallies[name].add(r, engine.logprobs(w), tgt)
            print(f"window {i + 1}/{len(windows)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    n = sum(t.numel() for t in targets)
    rows = [tallies["none (bfloat16)"].row("none (bfloat16)")]
    rows += [tallies[label(v, args.group_size)].row(label(v, args.group_size), **extras[v]) for v in variants]
    ref_ppl = float(torch.exp(torch.tensor(ref_nll / n)))
    result = {"model": "SmolLM2-135M-Instruct (from its Q4_1 GGUF, bf16 HF folder)", "device": "cpu",
              "text": f"GSM8K test questions + answers, rows 0..{eval_rows - 1}",
              "calibration": f"{len(calib)} tokens of GSM8K test rows {first_calib_row}..end (disjoint)",
              "tokens": n, "group_size_int4": args.group_size, "reference": "unquantized, float32, same engine",
              "reference_perplexity": ref_ppl, "rows": rows, "command": " ".join(sys.argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "seconds": round(time.time() - t0)}  # fmt: skip
    print(f"{result['model']}, {n} tokens of {result['text']}; reference perplexity {ref_ppl:.3f}")
    print("| method | top-1 agreement | mean KL | perplexity |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {100 * r['top1_agreement']:.2f}% | {r['mean_kl']:.4f} | {r['perplexity']:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
