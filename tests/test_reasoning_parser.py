"""<think> splitting for --reasoning-parser, whole and streamed in random pieces."""

from __future__ import annotations

import random

import pytest

from ftransformers.entrypoints.reasoning_parser import ReasoningParser

CASES = [
    # (kind, output, reasoning, content)
    ("deepseek-r1", "I should add.\n</think>\n\nThe sum is 4.", "I should add.\n", "The sum is 4."),
    ("deepseek-r1", "<think>Hmm.</think>Yes.", "Hmm.", "Yes."),
    ("deepseek-r1", "still thinking, cut off", "still thinking, cut off", ""),
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "Paris."),
    ("qwen3", "  Plain answer <b>x</b>.", None, "  Plain answer <b>x</b>."),
    ("qwen3", "<think>never closed", "never closed", ""),
    ("qwen3", "<think></think>Direct.", "", "Direct."),
]


@pytest.mark.parametrize("kind,text,reasoning,content", CASES)
def test_parse_whole(kind: str, text: str, reasoning: str | None, content: str) -> None:
    assert ReasoningParser(kind).parse(text) == (reasoning, content)


@pytest.mark.parametrize("kind,text,reasoning,content", CASES)
def test_streaming_matches_whole(kind: str, text: str, reasoning: str | None, content: str) -> None:
    rng = random.Random(hash(text) & 0xFFFF)
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
        if trial == 0:
            cuts = list(range(1, len(text)))  # one character at a time
        parser = ReasoningParser(kind)
        r_all, c_all, prev = "", "", 0
        for i, c in enumerate(cuts + [len(text)]):
            r, cont = parser.feed(text[prev:c], finished=c == len(text))
            assert "<think>" not in r + cont and "</think>" not in r + cont
            r_all, c_all, prev = r_all + r, c_all + cont, c
        assert r_all == (reasoning or "") and c_all == content


def test_partial_end_tag_held_back() -> None:
    p = ReasoningParser("deepseek-r1")
    assert p.feed("abc</th") == ("abc", "")
    assert p.feed("ink>ok") == ("", "ok")
    p = ReasoningParser("qwen3")
    assert p.feed("<thi") == ("", "")
    assert p.feed("nk>x</") == ("x", "")
    assert p.feed("b>", finished=True) == ("</b>", "")


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="valid choices"):
        ReasoningParser("nope")
