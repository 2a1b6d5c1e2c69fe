"""Incremental detokenizer, stop strings, and the per-request output state (no server needed)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from test_server_fixtures import build_tiny_tokenizer

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.entrypoints.detokenizer import IncrementalDetokenizer, RequestState, StopStringMatcher

TEXTS = [
    "Caf\u00e9 \u4f60\u597d\u4e16\u754c \U0001f600\U0001f680 hello r\u00e9sum\u00e9 \u00fcber",
    "\U0001f600\U0001f600\U0001f600 \u4e16\u754c! \u2014 done",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def _stream(tokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces, i = [], 0
    for n in chunk_sizes:
        pieces.append(detok.add_tokens(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_chars_never_split(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    # Precondition: some character's bytes really are spread over several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    rng = random.Random(len(text))
    for trial in range(5):
        sizes = [1] * len(ids) if trial == 0 else [rng.randint(1, 3) for _ in range(len(ids))]
        pieces = _stream(tokenizer, ids, sizes)
        assert all("\ufffd" not in p for p in pieces), pieces
        assert "".join(pieces) == tokenizer.decode(ids) == text


def test_random_tokens_concatenate_to_full_decode(tokenizer) -> None:
    rng = random.Random(1234)
    vocab = len(tokenizer)
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        pieces = _stream(tokenizer, ids, [1] * len(ids))
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == full
        assert all(not p.endswith("\ufffd") for p in pieces[:-1])  # held back until complete (or the end)


def test_prompt_context_keeps_leading_space(tokenizer) -> None:
    prompt = tokenizer.encode("Hello")
    out = tokenizer.encode(" world today")
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    text = "".join(detok.add_tokens([t]) for t in out) + detok.flush()
    assert text == " world today"
    assert detok.output_ids == out


def test_special_tokens_skipped(tokenizer) -> None:
    ids = tokenizer.encode("hi") + [tokenizer.eos_token_id] + tokenizer.encode(" there")
    assert "".join(_stream(tokenizer, ids, [1] * len(ids))) == "hi there"
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert detok.add_tokens(ids) + detok.flush() == "hi<|im_end|> there"


def _feed_split(matcher: StopStringMatcher, text: str, cuts: list[int]) -> tuple[list[str], bool]:
    pieces, prev = [], 0
    for c in sorted(cuts) + [len(text)]:
        emit, stopped = matcher.process(text[prev:c], finished=c == len(text))
        pieces.append(emit)
        prev = c
        if stopped:
            return pieces, True
    return pieces, False


def test_stop_string_across_pieces_random_splits() -> None:
    rng = random.Random(7)
    text = "alpha beta STOP gamma STOP"
    for _ in range(50):
        cuts = rng.sample(range(1, len(text)), rng.randint(0, 10))
        m = StopStringMatcher(["STOP", "zeta"])
        pieces, stopped = _feed_split(m, text, cuts)
        assert stopped and m.matched == "STOP"
        assert "".join(pieces) == "alpha beta " == m.text
        emitted = ""
        for p in pieces:  # no prefix of a stop string leaks out before it is decided
            emitted += p
            assert "S" not in emitted


def test_stop_string_false_alarm_is_released() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.process("go ST") == ("go ", False)
    assert m.process("AR") == ("STAR", False)
    assert m.process("ST", finished=True) == ("ST", False)
    assert m.text == "go STARST"


def test_earliest_stop_wins_and_held_tail_bound() -> None:
    m = StopStringMatcher(["world", "lo w"])
    emit, stopped = m.process("hello world")
    assert stopped and m.matched == "lo w" and emit == "hel" and m.text == "hel"
    m = StopStringMatcher(["abcdef"])
    emit, _ = m.process("xxabcde")
    assert emit == "xx"  # held tail is at most len(stop) - 1
    emit, stopped = m.process("X")
    assert (emit, stopped) == ("abcdeX", False)


@dataclass
class _Out:  # the fields of scheduler.io_struct.ReqOutput that RequestState reads
    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | None = None
    prompt_tokens: int = 3
    completion_tokens: int = 0
    cached_tokens: int = 0
    new_logprobs: list | None = None
    error: str | None = None


def test_request_state_stop_string_across_tokens(tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. The capital")
    sp = SamplingParams(max_tokens=64, stop=["42."])
    st = RequestState("r", tokenizer, sp, prompt_ids=[1, 2, 3])
    streamed, n = "", 0
    for tok in ids:
        n += 1
        delta = st.apply(_Out("r", [tok], completion_tokens=n))
        streamed += delta.text
        if delta.finished:
            break
    assert st.stopped_by_string and st.finish_reason == "stop" and st.matched_stop == "42."
    assert streamed == st.text == "The answer is "


def test_request_state_drops_stop_token_text(tokenizer) -> None:
    eos = tokenizer.convert_tokens_to_ids("e")  # a normal token used as a stop token id
    ids = tokenizer.encode("hello")
    st = RequestState("r", tokenizer, SamplingParams(stop_token_ids=[eos]), prompt_ids=[5])
    st.apply(_Out("r", ids[:-1] + [eos], finished=True, finish_reason="stop", matched_stop=eos,
                  completion_tokens=len(ids)))
    assert st.finish_reason == "stop" and st.matched_stop == eos
    assert st.text == tokenizer.decode(ids[:-1]) and st.token_ids == ids[:-1] + [eos]
