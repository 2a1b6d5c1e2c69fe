"""Whether a dummy-weight model's greedy tokens agree across sequences: prompts of random text under the chat
template (every prompt ends in the same tokens) against the same texts raw. Where they agree, a decode batch's MoE
layers read the experts of one sequence, not of B, and a serving run on dummy weights (bench_serve.py) is faster
than the engine's own step at that batch, whose prompts are random ids.

A CPU probe on bench_decode's Qwen3-30B-A3B config shrunk 16x (model_shapes.write_config's dry run) at a few layers,
with the full vocabulary and the Qwen3 tokenizer of make_qwen3_tokenizer.py:

    PYTHONPATH=$PWD python benchmarks/probe_dummy_greedy.py --tokenizer .tok/qwen3 --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_shapes import write_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a folder with tokenizer.json and a chat template")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()

    from ftransformers import LLM, SamplingParams

    root = Path(tempfile.mkdtemp(prefix="probe_greedy_"))
    cfg = write_config(args.model, args.layers, root, dry_run=True)
    for f in Path(args.tokenizer).iterdir():
        shutil.copy(f, root / f.name)
    from transformers import AutoTokenizer

    cfg["vocab_size"] = len(AutoTokenizer.from_pretrained(str(root)))  # the shrunk config's vocabulary: the tokenizer's
    (root / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(root), load_format="dummy", device="cpu", max_total_tokens=16384)
    rng = random.Random(0)
    vocab = len(llm.tokenizer)
    texts = [llm.tokenizer.decode([rng.randrange(1000, vocab - 1000) for _ in range(64)])
             for _ in range(args.sequences)]  # fmt: skip
    chat = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                              add_generation_prompt=True) for t in texts]  # fmt: skip
    res: dict[str, object] = {"date": datetime.date.today().isoformat(), "device": "cpu", "args": vars(args) | {
        "out": str(args.out)}, "config": cfg, "rows": []}  # fmt: skip
    for name, prompts in (("chat template", chat), ("raw text", texts)):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
        ids = [o.token_ids for o in outs]
        distinct = [len({seq[k] for seq in ids}) for k in range(args.tokens)]
        row = {"prompts": name, "distinct_tokens_per_step": distinct,
               "steps_all_agree": sum(d == 1 for d in distinct)}  # fmt: skip
        res["rows"].append(row)  # type: ignore[attr-defined]
        print(
            f"{name}: all {args.sequences} sequences' greedy tokens agree at {row['steps_all_agree']} of "
            f"{args.tokens} steps; distinct tokens a step {distinct}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
