"""The one pair of dataclasses where the scheduler (L5) and the model worker (L4) meet.

The scheduler owns every index (request slots, KV slots, prefix cache) and never touches a model
tensor; the worker owns the tensors (weights, KV pool, the `req_to_token` table) and never decides
what runs. A step goes: scheduler builds a `StepBatch` -> `Worker.launch_step` -> `PendingStep`,
whose `result()` waits for the `StepResult`.

Overlap scheduling: the scheduler may build and launch step N+1 before it has read step N's tokens.
A token that is sampled but not yet read is a *future*: each sampling sequence of a step names a
`future_slot`, the worker stores the sampled token in its device-side future table at that slot,
and a later step may carry the placeholder `future_placeholder(slot)` (a negative id) anywhere a
token id goes (`input_ids`, `output_ids`); the worker resolves placeholders on the device. A slot is
reused only after its step's result was read, so `num_future_slots` covers two steps of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ftransformers.config.sampling_params import SamplingParams


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a step: a prefill chunk (>= 1 new tokens) or one decode token."""

    rid: str
    req_pool_idx: int  # row of the worker's req_to_token table this sequence owns
    input_ids: list[int]  # tokens computed this step; positions prefix_len .. prefix_len+len-1
    prefix_len: int  # tokens of this sequence whose KV is already in the pool
    # The worker writes req_to_token[req_pool_idx, slots_start : slots_start + len(slots)] = slots.
    # Invariant after the write: the row is valid on [0, prefix_len + len(input_ids)).
    # A sequence's first step (or first after a retraction) sends slots_start=0 with the slots of
    # its cached prefix too; later steps send only the slots of the new tokens.
    slots_start: int
    slots: list[int]
    sample: bool  # sample a token after the last new position (false for non-final prefill chunks)
    sampling: SamplingParams
    prompt_ids: list[int]  # whole prompt (repetition penalty covers it)
    output_ids: list[int]  # tokens generated so far (penalties, seeded sampling)
    banned_token_ids: list[int] = field(default_factory=list)  # e.g. EOS while below min_tokens
    future_slot: int = -1  # where the worker stores the sampled token (>= 0 when sample is true)


@dataclass(slots=True)
class StepBatch:
    seqs: list[SeqStep]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.seqs)


@dataclass(slots=True)
class SeqResult:
    token_id: int
    logprob: float | None = None  # log-probability of token_id when logprobs were asked for
    top_logprobs: list[tuple[int, float]] | None = None  # the k most likely (token, logprob)


@dataclass(slots=True)
class StepResult:
    results: list[SeqResult | None]  # one per StepBatch.seqs entry; None where sample was False


def num_future_slots(max_req_slots: int) -> int:
    """Future-table size: two steps' worth of sampling sequences (plus slack)."""
    return 2 * max_req_slots + 2


def future_placeholder(slot: int) -> int:
    return -(slot + 1)


def future_slot_of(token_id: int) -> int:
    """The future slot a placeholder names (token_id < 0)."""
    return -token_id - 1


class PendingStep(Protocol):
    def result(self) -> StepResult:
        """Wait for the step and return its tokens (call once)."""
        ...


class DoneStep:
    """A step that already finished: what a synchronous worker's `launch_step` returns."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        return self._result


class Worker(Protocol):
    """What the scheduler needs from a model worker (a real one, or a fake in tests)."""

    @property
    def kv_capacity(self) -> int:
        """Usable KV slots in the pool; valid slot indices are 1..kv_capacity (0 is a pad slot)."""
        ...

    @property
    def max_req_slots(self) -> int:
        """Rows in the req_to_token table: the most sequences that can be in flight."""
        ...

    @property
    def max_context_len(self) -> int:
        """Most tokens (prompt + output) one sequence may hold."""
        ...

    @property
    def supports_overlap(self) -> bool:
        """True when `launch_step` returns before the device finishes (overlap scheduling pays)."""
        ...

    def launch_step(self, batch: StepBatch) -> PendingStep:
        """Queue the step; it must resolve future placeholders and fill the batch's future slots."""
        ...
