"""Token sampler: penalties, bans, temperature, top-k / top-p / min-p, seeded draws and logprobs.

One call handles a batch whose rows carry different `SamplingParams`. Per-row parameters become
[S] tensors (one host->device copy each); every stage runs over the whole batch and is skipped when
no row uses it. `Sampler.sample` only queues device work and an asynchronous copy of the tokens
(and logprobs) into pinned host memory; `SampleOutput.results()` is the one wait, so a caller can
launch the next step before reading this one's tokens. Output ids may hold future placeholders
(step_io) for tokens still on the device: the penalties resolve them from the `future` table.

Semantics (vLLM / OpenAI):
- logprobs are the log-softmax of the raw model logits (before penalties, bans and temperature).
- repetition_penalty (HF): every token seen in prompt + output has its logit divided by the
  penalty when positive, multiplied when negative. Then frequency_penalty subtracts
  penalty * count(token in output) and presence_penalty subtracts penalty once if it occurs.
- logit_bias then adds each listed token's bias to its logit (OpenAI's; -100 all but bans a token, +100 all but
  forces it).
- banned_token_ids get -inf (the scheduler bans EOS below min_tokens).
- temperature 0 (or top_k 1) is greedy argmax over the penalised logits.
- otherwise probs = softmax(logits / T); top-k keeps the k largest; top-p keeps the smallest
  prefix (by descending probability, renormalised after top-k) whose mass reaches top_p, always
  the top token; min-p keeps tokens with p >= min_p * max(p). The draw is exact categorical
  sampling from the renormalised kept set via argmax(p / E), E ~ Exp(1).
- seed: the noise of a seeded row comes from a generator seeded with (seed, len(output_ids)), so
  the same seed and history give the same token and no per-request state is kept. Unseeded rows
  share one engine generator seeded with `--random-seed`.

Two backends draw from that distribution (`--sampling-backend`):
- "triton" (the default on CUDA): `kernels/triton_sampling.py`, one launch, no sort; ties at a top-k or
  top-p boundary go to the lower token id. Its uniforms come from Philox keyed by (seed, step) for a
  seeded row and by a host generator seeded with `--random-seed` otherwise.
- "torch_native" (the default elsewhere, and the reference): a full-vocabulary sort for top-k / top-p
  and exponential noise, argmax(p / E).
The two take different random streams, so one seed gives a reproducible token within a backend.

Probabilities are taken unnormalised where only their ratios matter (exp(x - max x), no softmax: on a
150K-token row torch's softmax runs one block a row, 38 us on an H100 against a few us for a reduction
and an elementwise exp; benchmarks/results/sampler_h100.json).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from ftransformers.config.server_args import resolve_backend
from ftransformers.runtime.step_io import SeqResult, SeqStep

_MASK64 = (1 << 64) - 1


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): decorrelates the generators of neighbouring steps and seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def to_device(values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One host->device copy of a Python list; pinned + non_blocking on CUDA so it never syncs."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def resolve_future(ids: torch.Tensor, future: torch.Tensor | None) -> torch.Tensor:
    """Replace future placeholders (negative ids) by the tokens stored in `future` [F]."""
    if future is None:
        return ids
    return torch.where(ids < 0, future[(-ids - 1).clamp_min(0)], ids)


def apply_penalties(logits: torch.Tensor, seqs: Sequence[SeqStep], future: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition, frequency and presence penalties on logits [S, V], out of place (logits itself is
    returned untouched when no row has a penalty)."""
    S, V = logits.shape
    dev = logits.device
    rows = [i for i, s in enumerate(seqs) if s.sampling.has_penalties]
    if not rows:
        return logits
    out_rows: list[int] = []
    out_toks: list[int] = []
    seen_rows: list[int] = []
    seen_toks: list[int] = []
    for i in rows:
        s = seqs[i]
        out_rows += [i] * len(s.output_ids)
        out_toks += s.output_ids
        if s.sampling.repetition_penalty != 1.0:
            seen_rows += [i] * (len(s.prompt_ids) + len(s.output_ids))
            seen_toks += s.prompt_ids
            seen_toks += s.output_ids
    if seen_rows:
        rep = to_device([s.sampling.repetition_penalty for s in seqs], torch.float32, dev)[:, None]  # [S, 1]
        seen = torch.zeros(S, V, dtype=torch.bool, device=dev)
        seen[to_device(seen_rows, torch.int64, dev), resolve_future(to_device(seen_toks, torch.int64, dev), future)] = True
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    if out_rows:
        counts = torch.zeros(S, V, dtype=torch.float32, device=dev)  # counts[i, t]: t in output of row i
        idx = (to_device(out_rows, torch.int64, dev), resolve_future(to_device(out_toks, torch.int64, dev), future))
        counts.index_put_(idx, torch.ones(len(out_rows), device=dev), accumulate=True)
        freq = to_device([s.sampling.frequency_penalty for s in seqs], torch.float32, dev)[:, None]
        pres = to_device([s.sampling.presence_penalty for s in seqs], torch.float32, dev)[:, None]
        logits = logits - freq * counts - pres * (counts > 0).float()
    return logits


def _put_at_tokens(logits: torch.Tensor, per_row: Sequence[dict[int, float]], accumulate: bool) -> torch.Tensor:
    """logits with each row's {token id: value} put (accumulate: added) at those ids, on a copy; logits itself where
    no row has any."""
    rows: list[int] = []
    toks: list[int] = []
    values: list[float] = []
    for i, entries in enumerate(per_row):
        for token, value in entries.items():
            rows.append(i)
            toks.append(token)
            values.append(value)
    if not rows:
        return logits
    dev = logits.device
    idx = (to_device(rows, torch.int64, dev), to_device(toks, torch.int64, dev))
    return logits.index_put(idx, to_device(values, torch.float32, dev).to(logits.dtype), accumulate=accumulate)


def apply_logit_bias(logits: torch.Tensor, seqs: Sequence[SeqStep]) -> torch.Tensor:
    """Each row's logit_bias added at its token ids, on a copy (logits itself is returned when no row has one)."""
    return _put_at_tokens(logits, [s.sampling.logit_bias or {} for s in seqs], accumulate=True)


def apply_bans(logits: torch.Tensor, seqs: Sequence[SeqStep]) -> torch.Tensor:
    """-inf at each row's banned ids, on a copy (logits itself is returned when no row bans any)."""
    return _put_at_tokens(logits, [dict.fromkeys(s.banned_token_ids or (), float("-inf")) for s in seqs],
                          accumulate=False)  # fmt: skip


def argmax_suffices(seqs: Sequence[SeqStep]) -> bool:
    """True when `Sampler.sample` would return each row's first argmax of the raw logits and nothing
    else (greedy, no penalty, no logit_bias, no ban, no logprobs), so a token picked on the device stands for it."""
    return all(
        s.sampling.greedy and not s.sampling.has_penalties and not s.sampling.logit_bias and not s.banned_token_ids
        and s.sampling.logprobs is None
        for s in seqs
    )


def top_k_top_p_min_p_mask(
    logits: torch.Tensor,  # [S, V], already divided by the temperature
    top_k: torch.Tensor | None,  # [S] int64 in 1..V, or None (off for every row)
    top_p: torch.Tensor | None,  # [S] float32 in (0, 1], or None
    min_p: torch.Tensor | None,  # [S] float32 in [0, 1], or None
) -> torch.Tensor:  # [S, V] bool, True where the token is kept
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k is not None or top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
        ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]  # [1, V]
        keep_sorted = torch.ones_like(sorted_logits, dtype=torch.bool)
        if top_k is not None:
            keep_sorted &= ranks < top_k[:, None]
            sorted_logits = sorted_logits.masked_fill(~keep_sorted, float("-inf"))
        if top_p is not None:
            weight = (sorted_logits - sorted_logits[:, :1]).exp()  # [S, V] unnormalised, the first is the max
            mass = weight.cumsum(dim=-1)
            # mass of the strictly better tokens, as a share of the kept total
            keep_sorted &= (mass - weight < top_p[:, None] * mass[:, -1:]) | (ranks == 0)
        keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    if min_p is not None:  # p >= min_p * max p, with p unnormalised (max 1)
        keep &= (logits - logits.amax(dim=-1, keepdim=True)).exp() >= min_p[:, None]
    return keep


class SampleOutput:
    """A batch's sampled tokens on their way to the host; `results()` waits for them."""

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor | None, logprobs_k: list[int | None]) -> None:
        self.tokens = tokens  # [S] int64 on the device: what the future table is filled from
        # On the host (pinned when the device is CUDA): tokens [S] int64, or, when any row asked for
        # logprobs, packed [S, 2 + 2K] float64 = token, its logprob, top-K ids, top-K logprobs.
        src = tokens if packed is None else packed
        self._event: torch.cuda.Event | None = None
        if src.device.type == "cuda":
            self._host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._host.copy_(src, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # a copy: src may be a buffer the next step rewrites (the graph runner's tokens)
            self._host = src.clone()
        self._packed = packed is not None
        self._logprobs_k = logprobs_k

    def results(self) -> list[SeqResult]:
        if self._event is not None:
            self._event.synchronize()
        rows = self._host.tolist()
        if not self._packed:
            return [SeqResult(token_id=t) for t in rows]
        max_k = max(k or 0 for k in self._logprobs_k)
        results: list[SeqResult] = []
        for row, k in zip(rows, self._logprobs_k):
            if k is None:
                results.append(SeqResult(token_id=int(row[0])))
                continue
            top = [(int(t), v) for t, v in zip(row[2 : 2 + k], row[2 + max_k : 2 + max_k + k])]
            results.append(SeqResult(token_id=int(row[0]), logprob=row[1], top_logprobs=top))
        return results


class Sampler:
    def __init__(
        self,
        device: torch.device | str,
        seed: int = 0,
        future: torch.Tensor | None = None,
        backend: str = "auto",  # "triton", "torch_native" or "auto" (triton on CUDA)
    ) -> None:
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        if self.backend not in ("triton", "torch_native"):
            raise ValueError(f"sampling backend must be auto, triton or torch_native, not {backend!r}")
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.host_rng = random.Random(seed)  # the triton backend's seeds of unseeded rows
        self.future = future  # [F] int64 future table (step_io) that output ids may point into

    def _noise(self, seqs: Sequence[SeqStep], S: int, V: int) -> torch.Tensor:
        """Exp(1) noise [S, V]: seeded rows from their own (seed, step) generator."""
        q = torch.empty(S, V, dtype=torch.float32, device=self.device)
        q.exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.sampling.seed is not None and not s.sampling.greedy:
                g = torch.Generator(device=self.device)
                g.manual_seed(_mix_seed(s.sampling.seed, len(s.output_ids)))
                q[i].exponential_(generator=g)
        return q.clamp_min_(torch.finfo(torch.float32).tiny)

    def _sample_triton(self, logits: torch.Tensor, seqs: Sequence[SeqStep]) -> torch.Tensor:
        from ftransformers.kernels.triton_sampling import sample_tokens

        V = logits.shape[1]
        params = [s.sampling for s in seqs]
        seeds = [
            _mix_seed(p.seed, len(s.output_ids)) if p.seed is not None else self.host_rng.getrandbits(63)
            for s, p in zip(seqs, params)
        ]
        return sample_tokens(
            logits,
            to_device([0.0 if p.greedy else p.temperature for p in params], torch.float32, self.device),
            to_device([p.top_k if 0 < p.top_k < V else 0 for p in params], torch.int32, self.device),
            to_device([p.top_p for p in params], torch.float32, self.device),
            to_device([p.min_p for p in params], torch.float32, self.device),
            to_device(seeds, torch.int64, self.device),
        )

    def __call__(self, logits: torch.Tensor, seqs: Sequence[SeqStep]) -> list[SeqResult]:
        return self.sample(logits, seqs).results()

    def sample(self, logits: torch.Tensor, seqs: Sequence[SeqStep]) -> SampleOutput:
        # logits: [S, V] raw model logits for the rows of seqs (one row per sequence that samples)
        S, V = logits.shape
        if S == 0:
            return SampleOutput(torch.empty(0, dtype=torch.int64, device=logits.device), None, [])
        dev = logits.device
        params = [s.sampling for s in seqs]
        want_logprobs = [p.logprobs is not None for p in params]
        logprobs = logits.float().log_softmax(dim=-1) if any(want_logprobs) else None  # [S, V]

        # both copy before changing anything: the CUDA graph's logits buffer stays as it is, and a plain
        # greedy step (or the triton backend, which reads bfloat16) reads it without a [S, V] copy
        edited = any(p.has_penalties or p.logit_bias for p in params) or any(s.banned_token_ids for s in seqs)
        if edited or self.backend == "torch_native":
            logits = apply_bans(apply_logit_bias(apply_penalties(logits.float(), seqs, self.future), seqs), seqs)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)  # [S]
        elif self.backend == "triton":
            tokens = self._sample_triton(logits, seqs)
        else:
            temps = to_device([1.0 if g else p.temperature for g, p in zip(greedy, params)], torch.float32, dev)
            scaled = logits / temps[:, None]
            top_k = top_p = min_p = None
            if any(0 < p.top_k < V for p in params):
                top_k = to_device([p.top_k if 0 < p.top_k < V else V for p in params], torch.int64, dev)
            if any(p.top_p < 1.0 for p in params):
                top_p = to_device([p.top_p if p.top_p < 1.0 else 2.0 for p in params], torch.float32, dev)
            if any(p.min_p > 0.0 for p in params):
                min_p = to_device([p.min_p for p in params], torch.float32, dev)
            probs = (scaled - scaled.amax(dim=-1, keepdim=True)).exp()  # [S, V], unnormalised
            if top_k is not None or top_p is not None or min_p is not None:
                probs = probs.masked_fill(~top_k_top_p_min_p_mask(scaled, top_k, top_p, min_p), 0.0)
            tokens = (probs / self._noise(seqs, S, V)).argmax(dim=-1)  # exact draw from probs/sum(probs)
            if any(greedy):
                tokens = torch.where(to_device(greedy, torch.bool, dev), logits.argmax(dim=-1), tokens)

        ks = [p.logprobs for p in params]
        if logprobs is None:
            return SampleOutput(tokens, None, ks)
        max_k = max(k or 0 for k in ks)
        chosen = logprobs.gather(-1, tokens[:, None])  # [S, 1]
        top_vals, top_ids = logprobs.topk(max_k, dim=-1)  # [S, K]
        packed = torch.cat([tokens[:, None].double(), chosen.double(), top_ids.double(), top_vals.double()], dim=1)
        return SampleOutput(tokens, packed, ks)
