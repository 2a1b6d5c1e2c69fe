"""Per-request scheduler state and the stop rules (EOS, stop token ids, max_tokens, context)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ftransformers.cache.radix_cache import TreeNode
from ftransformers.config.sampling_params import SamplingParams
from ftransformers.runtime.step_io import SeqResult


@dataclass(slots=True, eq=False)
class Req:
    """One request. Its sequence is prompt_ids + output_ids ("fill ids").

    While admitted (in the running set) it holds a req_to_token row and `kv_slots`, where
    kv_slots[p] holds the KV of sequence token p; kv_slots[:cache_owned_len] belong to the prefix
    cache (matched at admission, kept alive by the lock on `last_node`), the rest are the request's
    own. While waiting it holds nothing. The last output token never has KV until the next step.

    Under overlap scheduling the last `num_unresolved` output ids may be future placeholders
    (negative, see step_io) for tokens a launched step has sampled but the scheduler not yet read;
    everything before them, and every token with KV, is a real id.
    """

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: int  # FCFS order; retraction picks the newest arrival first
    return_logprob: bool = False
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_slots: list[int] = field(default_factory=list)
    cache_owned_len: int = 0
    last_node: TreeNode | None = None
    send_full_slots: bool = True  # next SeqStep sends slots_start=0 with the whole row
    admitted_once: bool = False
    cached_tokens: int = 0  # prompt tokens matched in the cache on the first admission
    num_reported: int = 0  # output tokens already sent in a ReqOutput
    num_unresolved: int = 0  # trailing output ids that are future placeholders
    pending_logprobs: list[SeqResult] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | None = None
    error: str | None = None

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_uncomputed(self) -> int:
        """Sequence tokens without KV yet (>= 1 while running: at least the last token)."""
        return self.seq_len - len(self.kv_slots)

    @property
    def is_decoding(self) -> bool:
        """One uncomputed token that is an output token: a decode (outside the prefill budget)."""
        return self.num_uncomputed == 1 and len(self.kv_slots) > 0 and len(self.output_ids) > 0

    @property
    def num_resolved_outputs(self) -> int:
        return len(self.output_ids) - self.num_unresolved

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without building the whole list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]


def banned_token_ids(req: Req, eos_token_ids: frozenset[int]) -> list[int]:
    """Tokens that would stop the request while it is still below min_tokens."""
    sp = req.sampling
    if len(req.output_ids) >= sp.min_tokens:
        return []
    banned = [] if sp.ignore_eos else sorted(eos_token_ids)
    for t in sp.stop_token_ids or ():
        if t not in banned:
            banned.append(t)
    return banned


def check_finish(req: Req, eos_token_ids: frozenset[int], max_context_len: int, n: int | None = None) -> None:
    """Set the finish state as of output token n - 1 (default: the last one), vLLM's order: EOS,
    stop ids, lengths."""
    sp = req.sampling
    n = len(req.output_ids) if n is None else n
    tok = req.output_ids[n - 1]
    if n >= sp.min_tokens:
        if not sp.ignore_eos and tok in eos_token_ids:
            req.finish_reason, req.matched_stop = "stop", tok
            return
        if sp.stop_token_ids and tok in sp.stop_token_ids:
            req.finish_reason, req.matched_stop = "stop", tok
            return
    if sp.max_tokens is not None and n >= sp.max_tokens:
        req.finish_reason = "length"
    elif len(req.prompt_ids) + n >= max_context_len:
        req.finish_reason = "length"
