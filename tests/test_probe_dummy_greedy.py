"""benchmarks/probe_dummy_greedy.py runs as documented (the demo tokenizer, one layer, a few tokens) and writes, for
the chat-templated and the raw prompts, how many distinct greedy tokens each step has. Not a check of the finding:
whether they agree is the probe's measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ftransformers.entrypoints.demo_model import ensure_demo_model

ROOT = Path(__file__).resolve().parent.parent


def test_probe_writes_both_prompt_kinds(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tok / name).write_bytes((ensure_demo_model() / name).read_bytes())
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probe_dummy_greedy.py"), "--tokenizer", str(tok),
                           "--out", str(out), "--layers", "1", "--sequences", "3", "--tokens", "4"],
                          check=False, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompts"] for r in rows] == ["chat template", "raw text"]
    for r in rows:
        assert len(r["distinct_tokens_per_step"]) == 4 and all(1 <= d <= 3 for d in r["distinct_tokens_per_step"])
        assert r["steps_all_agree"] == sum(d == 1 for d in r["distinct_tokens_per_step"])
