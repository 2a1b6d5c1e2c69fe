"""The server's start-up warmup: requests of the shapes serving meets, run through a throwaway `Scheduler` before the
server says ready, so that Triton compiles their kernels' specializations then, not under a user's request.

Why: a fresh Qwen3-30B-A3B server on an H200 compiled 23 kernel specializations under its first requests (extend
attention, rope + KV store, MoE alignment and GEMMs at new token counts, the sampler), and those requests waited up to
2.6 s (docs/performance.md, session 73). A Triton kernel specializes on constexprs that follow the token count (a
MoE tile chosen by bucket, the alignment's block count rounded to a power of two) and on Triton's own integer rules
(equal to 1, divisible by 16), so the warmup prefills a ladder of prompt lengths (every length up to 64, then both
sides of each power of two, and a few lengths between where a rule picks by band), each alone and all together
(mixed prefill and decode steps), greedy and sampled, then again behind a cached prefix, and decodes sampled batches
of several sizes up to the most requests running at once; the sampling kernel is then launched directly at each
specialization its row counts meet. Whatever it misses is
logged when it compiles (kernels/compile_log.py).

The throwaway scheduler owns its KV slots and radix tree; discarding it frees them all, so serving starts with an
empty cache and zeroed counters. The KV pool's contents are overwritten by real requests before they are read.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.config.server_args import ServerArgs
from ftransformers.scheduler.io_struct import GenerateReq
from ftransformers.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# prompt lengths at every power-of-two bucket boundary of the prefill kernels' tiles (n - 1, n, n + 1: both sides
# of it, odd and even, divisible by 16 and not), capped by the prefill chunk and the context; and a multiple of 16 in
# each 128-row band of 257-511 rows, where the int4 products' rule (kernels/gluon_w4a16_ws.py, few-tile forms) picks
# by the band: the ladder holds only 257 and 511 there
LADDER = tuple(
    sorted({m for n in (1 << i for i in range(15)) for m in (n - 1, n, n + 1) if m > 0} | {100, 1000, 384, 448})
)
# every prompt length up to here as well, where the pool allows: the int4 MoE's grouped kernels choose variants at
# token counts that are no power of two (40 and 46 for Qwen3-30B-A3B's experts, kernels/gluon_moe_w4_mma.py) and
# pass two integers (pairs, a group bound) whose divisibility by 16 varies apart, all within 2-64 tokens
DENSE_UP_TO = 64
DECODE_BATCHES = (1, 2, 3, 5)  # then powers of two from 8, and the most requests running at once (decode_batches)
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


@dataclass
class WarmupReport:
    requests: int
    prompt_tokens: int
    seconds: float
    finished: int  # requests that ran to their max_tokens
    errors: list[str]  # what the others said (a warmup request the scheduler refused or failed)
    sampler_rows: list[int]  # row counts the sampling kernel was launched at directly, per logits dtype (CUDA)


def warmup_lengths(server_args: ServerArgs, max_context_len: int, kv_capacity: int) -> list[int]:
    """The ladder plus one prompt of a whole prefill chunk and one past it (a second chunk), within the context and
    with all of them together in at most half the KV pool (the longest dropped first); then every length up to
    DENSE_UP_TO as well, if that still fits."""
    chunk = max(0, server_args.chunked_prefill_size)
    longest = max_context_len - 8  # room for the decoded tokens
    lengths = sorted({n for n in (*LADDER, chunk, chunk + 17) if 0 < n <= longest and (not chunk or n <= chunk + 17)})
    while lengths and sum(lengths) > kv_capacity // 2:
        lengths.pop()
    dense = sorted(set(lengths) | {n for n in range(1, DENSE_UP_TO + 1) if n <= longest})
    return dense if sum(dense) <= kv_capacity // 2 else lengths


def decode_batches(max_running: int) -> list[int]:
    """Decode batch sizes to run: 1, 2, 3, 5, the powers of two from 8 below `max_running`, and `max_running`.
    Batches above the CUDA graphs' largest decode eagerly, where kernels choose variants by batch size (decode
    attention's smaller tiles from 3 x SMs / head blocks rows: about 100 on Qwen3-30B-A3B on an H200)."""
    powers = [1 << i for i in range(3, max(3, max_running.bit_length()))]
    return sorted({b for b in (*DECODE_BATCHES, *powers, max_running) if 1 <= b <= max_running})


def _run(sched: Scheduler, reqs: list[GenerateReq]) -> list[Any]:
    """The requests' final outputs."""
    for r in reqs:
        sched.add_request(r)
    done = []
    while sched.has_work():
        done += [o for o in sched.step() if o.finish_reason is not None]
    return done


def _warm_sampler(worker: Any, max_rows: int) -> list[int]:
    """The sampling kernel at every specialization 1..max_rows rows meet, for both logits dtypes a step hands it
    (the CUDA graphs' logits buffer in the head's dtype, eager steps' float32). The model steps above reach only
    the row counts their batches had: a fresh H200 server compiled one under a 32-request load (session 74)."""
    if worker.device.type != "cuda" or worker.sampler.backend != "triton":
        return []
    from ftransformers.kernels.triton_sampling import warm_sample_kernel

    head = worker.model.logits_buffer(1)  # [1, V] in the head's dtype
    dtypes = tuple(dict.fromkeys((head.dtype, torch.float32)))
    return warm_sample_kernel(head.shape[1], dtypes, worker.device, max_rows)


def run_warmup(worker: Any, server_args: ServerArgs, eos_token_ids: list[int], vocab_size: int,
               seed: int = 0) -> WarmupReport:  # fmt: skip
    """Run the warmup requests to completion on `worker` (a ModelRunner) through a scheduler of their own."""
    t0 = time.perf_counter()
    sched = Scheduler(worker, server_args, eos_token_ids)
    lengths = warmup_lengths(server_args, sched.max_context_len, sched.kv_capacity)
    rng = random.Random(seed)
    prompts = {n: [rng.randrange(vocab_size) for _ in range(n)] for n in lengths}
    count = itertools.count()  # request ids and sampling seeds

    def req(ids: list[int], sampled: bool, new_tokens: int) -> GenerateReq:
        params = {**SAMPLED, "seed": next(count)} if sampled else {"temperature": 0.0}
        sp = SamplingParams(**params, max_tokens=new_tokens, ignore_eos=True)
        return GenerateReq(rid=f"warmup-{next(count)}", input_ids=ids, sampling_params=sp)

    rounds: list[list[GenerateReq]] = [[req(prompts[n], False, 2)] for n in lengths]  # each alone
    rounds.append([req(prompts[n], i % 2 == 1, 4) for i, n in enumerate(lengths)])  # together: mixed steps
    # behind a cached prefix (the radix tree holds each prompt now): extend attention over a prefix
    rounds.append([req(prompts[n] + [rng.randrange(vocab_size) for _ in range(5)], True, 2) for n in lengths])
    short = min(16, sched.max_context_len - 8)
    for b in decode_batches(sched.max_running_requests):  # sampled decode batches
        rounds.append([req([rng.randrange(vocab_size) for _ in range(short)], True, 3) for _ in range(b)])
    n_reqs = sum(len(r) for r in rounds)
    tokens = sum(len(g.input_ids) for r in rounds for g in r)
    done = [o for r in rounds for o in _run(sched, r)]
    errors = [f"{o.rid}: {o.finish_reason} {o.error or ''}".strip()
              for o in done if o.finish_reason != "length"]  # fmt: skip
    t1 = time.perf_counter()
    sampler_rows = _warm_sampler(worker, sched.max_running_requests)
    report = WarmupReport(n_reqs, tokens, time.perf_counter() - t0, len(done) - len(errors), errors, sampler_rows)
    logger.info("warmup: %d requests, %d prompt tokens, then the sampler at %d row counts (%.1f s), in %.1f s",
                report.requests, report.prompt_tokens, len(sampler_rows), time.perf_counter() - t1,
                report.seconds)  # fmt: skip
    if errors or report.finished != n_reqs:
        logger.warning("warmup: %d of %d requests finished; %s", report.finished, n_reqs, "; ".join(errors[:3]))
    return report
