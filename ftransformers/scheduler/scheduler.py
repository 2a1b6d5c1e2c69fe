"""The scheduler loop: FCFS admission, continuous batching, chunked prefill mixed with decodes,
KV budget with prefix-cache eviction and retraction. It never touches a model tensor: each step
builds a `StepBatch` for `Worker.launch_step` and turns the `StepResult` into `ReqOutput`s.

Step plan (`_plan_step`), in order:
  1. decodes: every running request with one uncomputed token gets one slot; when the pool (free +
     evictable) is short, retract running requests, newest arrival first;
  2. unfinished chunked prefills of running requests, oldest first, within the prefill budget;
  3. admission from the waiting queue (FCFS) while the budget, --max-running-requests, a free
     req_to_token row and the KV pool (keeping one slot per running request for its next decode)
     allow.
A retracted request releases its KV to the prefix cache and goes back to the front of the queue;
on re-admission it re-prefills prompt + output so far (mostly cache hits) and continues.

Overlap (`--disable-overlap-schedule` turns it off; on by default where the worker launches
asynchronously, i.e. CUDA): `step()` plans and launches step N+1 before reading step N's tokens, so
the host's work for N+1 (and the caller's for N's outputs) runs while the device computes. Each
sampled token enters `output_ids` at launch as a future placeholder (step_io) and is replaced when
its step is read; only then are stop rules checked. A request that stops on a token of step N has
already had one more decode launched in N+1: that token is dropped (its KV slot was taken in N+1
and is released with the rest). A request whose launched tokens reach max_tokens or the context
limit gets no further decode while they are in flight. Without overlap, `step()` reads the step it
launched at once; both modes run the same code.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass

from ftransformers.config.server_args import ServerArgs
from ftransformers.runtime.step_io import (
    PendingStep,
    SeqStep,
    StepBatch,
    Worker,
    future_placeholder,
    num_future_slots,
)
from ftransformers.scheduler.io_struct import GenerateReq, ReqOutput, SchedulerStats
from ftransformers.scheduler.kv_manager import KVManager
from ftransformers.scheduler.req import Req, banned_token_ids, check_finish

logger = logging.getLogger(__name__)

_Plan = list[tuple[Req, int, list[int]]]  # (request, new tokens this step, their new slots)


@dataclass(slots=True)
class _Launched:
    """A launched step the scheduler has not read yet."""

    handle: PendingStep
    reqs: list[Req]  # one per sequence of the batch
    out_index: list[int]  # index in req.output_ids of the placeholder it sampled into; -1: no sample


class Scheduler:
    def __init__(self, worker: Worker, server_args: ServerArgs, eos_token_ids: list[int],
                 overlap: bool | None = None) -> None:
        self.worker = worker
        # overlap=None: from --disable-overlap-schedule and whether the worker launches asynchronously.
        if overlap is None:
            overlap = not server_args.disable_overlap_schedule and worker.supports_overlap
        self.overlap = overlap
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_capacity = worker.kv_capacity
        # A sequence of L tokens holds at most L - 1 KV slots, so capping at the pool size keeps
        # any single request runnable once everything else is retracted.
        self.max_context_len = min(worker.max_context_len, worker.kv_capacity)
        self.max_running_requests = min(server_args.max_running_requests or worker.max_req_slots,
                                        worker.max_req_slots)
        self.chunking = server_args.chunked_prefill_size != -1
        chunk = server_args.chunked_prefill_size if self.chunking else server_args.max_prefill_tokens
        self.prefill_budget = max(1, min(chunk, server_args.max_prefill_tokens))
        self.kv = KVManager(worker.kv_capacity, worker.max_req_slots, server_args.disable_radix_cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order
        self.reqs: dict[str, Req] = {}  # every waiting or running request
        self._pending: list[ReqOutput] = []  # outputs produced outside a forward (errors, aborts)
        self._arrival = itertools.count()
        self.cache_hit_tokens = 0
        self.prompt_tokens_total = 0
        self.num_retractions = 0
        self._in_flight: _Launched | None = None
        self._num_future = num_future_slots(worker.max_req_slots)
        self._next_future = 0

    # Public API -------------------------------------------------------------------------------
    def add_request(self, greq: GenerateReq) -> None:
        sp = greq.sampling_params
        req = Req(greq.rid, list(greq.input_ids), sp, next(self._arrival),
                  return_logprob=greq.return_logprob or sp.logprobs is not None)
        error = self._validate(req)
        if error is None and greq.rid in self.reqs:
            error = f"request id {greq.rid!r} is already in flight"
        if error is not None:
            req.finish_reason, req.error = "error", error
            self._pending.append(self._make_output(req))
            return
        self.reqs[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None:
            return
        req.finish_reason = "abort"
        self._remove(req)
        self._pending.append(self._make_output(req))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending or self._in_flight)

    def step(self) -> list[ReqOutput]:
        """Launch the next step; return the outputs of the step read now (this one without overlap,
        the previous one with it) and any produced outside a forward."""
        plan = self._schedule()
        launched = self._launch(plan) if plan else None
        if self.overlap:
            previous, self._in_flight = self._in_flight, launched
        else:
            previous = launched
        if previous is not None:
            self._read(previous)
        outputs, self._pending = self._pending, []
        return outputs

    def flush_cache(self) -> bool:
        if self.running or self.waiting:
            return False
        self._drain()
        self.kv.flush()
        return True

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_used_tokens=self.kv.used_by_requests(),
            kv_capacity=self.kv_capacity,
            cache_hit_tokens=self.cache_hit_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            num_retractions=self.num_retractions,
            kv_cached_tokens=self.kv.cached_only(),
        )

    # Scheduling -------------------------------------------------------------------------------
    def _validate(self, req: Req) -> str | None:
        n, ctx = len(req.prompt_ids), self.max_context_len
        what = "context length" if ctx == self.worker.max_context_len else "KV cache size"
        if n == 0:
            return "the prompt is empty"
        if n >= ctx:
            return f"the prompt has {n} tokens, which leaves no room for output within the {what} of {ctx} tokens"
        max_tokens = req.sampling.max_tokens
        if max_tokens is not None and n + max_tokens > ctx:
            return f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the {what} of {ctx} tokens"
        return None

    def _awaiting_finish(self, req: Req) -> bool:
        """Its launched tokens reach a length limit: it stops once they are read (overlap only)."""
        max_tokens = req.sampling.max_tokens
        return (max_tokens is not None and len(req.output_ids) >= max_tokens) or req.seq_len >= self.max_context_len

    def _schedule(self) -> _Plan:
        while True:
            plan = self._plan_step()
            if plan or all(self._awaiting_finish(r) for r in self.running):
                return plan
            # Running requests exist but none got a slot (prefills starved by each other).
            if len(self.running) == 1:
                raise RuntimeError("scheduler: a lone request cannot get KV slots (bookkeeping bug)")
            self._retract(self._newest_running())

    def _plan_step(self) -> _Plan:
        plan: _Plan = []
        budget = self.prefill_budget
        # 1. decodes
        decoding = [r for r in self.running if r.is_decoding and not self._awaiting_finish(r)]
        while decoding and self.kv.available() < len(decoding):
            victim = self._newest_running()
            self._retract(victim)
            if victim in decoding:
                decoding.remove(victim)
        if decoding:
            slots = self.kv.alloc(len(decoding))
            assert slots is not None
            plan.extend((r, 1, [s]) for r, s in zip(decoding, slots))
        # 2. unfinished chunked prefills, oldest first
        for req in sorted((r for r in self.running if not r.is_decoding), key=lambda r: r.arrival):
            n = min(req.num_uncomputed, budget, self.kv.available())
            if n <= 0:
                break
            if not self.chunking and n < req.num_uncomputed:
                continue
            slots = self.kv.alloc(n)
            assert slots is not None
            plan.append((req, n, slots))
            budget -= n
        # 3. admission
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            if req.num_unresolved or not self.kv.admit(req):  # retracted with a token in flight: next step
                break
            reserve = len(self.running)  # one slot for each running request's next decode
            n = req.num_uncomputed
            if self.chunking:
                n = min(n, budget, self.kv.available() - reserve)
            elif n > budget and budget < self.prefill_budget:
                n = 0  # without chunking a prompt over the budget goes first in a later step
            elif n > self.kv.available() - reserve:
                n = 0
            if n <= 0:
                self.kv.release(req)
                break
            slots = self.kv.alloc(n)
            assert slots is not None
            self.waiting.popleft()
            self.running.append(req)
            if not req.admitted_once:
                req.admitted_once = True
                req.cached_tokens = min(len(req.kv_slots), len(req.prompt_ids))
                self.cache_hit_tokens += req.cached_tokens
                self.prompt_tokens_total += len(req.prompt_ids)
            plan.append((req, n, slots))
            budget -= n
        return plan

    def _newest_running(self) -> Req:
        return max(self.running, key=lambda r: r.arrival)

    def _retract(self, req: Req) -> None:
        """Free `req`'s KV (kept in the prefix cache) and requeue it at the front of the queue."""
        self.running.remove(req)
        self.kv.release(req)
        self.waiting.appendleft(req)
        self.num_retractions += 1
        logger.debug("retracted %s (%d tokens)", req.rid, req.seq_len)

    def _build_seq(self, req: Req, n: int, slots: list[int]) -> SeqStep:
        assert req.req_pool_idx is not None
        start = len(req.kv_slots)
        req.kv_slots.extend(slots)
        if req.send_full_slots:
            slots_start, row_slots = 0, list(req.kv_slots)
            req.send_full_slots = False
        else:
            slots_start, row_slots = start, slots
        sample = start + n == req.seq_len
        future_slot = -1
        if sample:
            future_slot, self._next_future = self._next_future, (self._next_future + 1) % self._num_future
        return SeqStep(
            rid=req.rid,
            req_pool_idx=req.req_pool_idx,
            input_ids=req.token_slice(start, start + n),
            prefix_len=start,
            slots_start=slots_start,
            slots=row_slots,
            sample=sample,
            sampling=req.sampling,
            prompt_ids=req.prompt_ids,
            output_ids=req.output_ids,
            banned_token_ids=banned_token_ids(req, self.eos_token_ids),
            future_slot=future_slot,
        )

    # Launch and read ----------------------------------------------------------------------------
    def _launch(self, plan: _Plan) -> _Launched:
        seqs = [self._build_seq(req, n, slots) for req, n, slots in plan]
        handle = self.worker.launch_step(StepBatch(seqs))
        # The sequences' lists are the requests' own: the worker has read them by now.
        out_index: list[int] = []
        for (req, _, _), seq in zip(plan, seqs):
            if not seq.sample or len(seq.input_ids) > 1:
                self.kv.cache_unfinished(req)  # prefill KV (real ids only) is in the cache from here on
            if not seq.sample:
                out_index.append(-1)
                continue
            out_index.append(len(req.output_ids))
            req.output_ids.append(future_placeholder(seq.future_slot))
            req.num_unresolved += 1
        return _Launched(handle, [req for req, _, _ in plan], out_index)

    def _read(self, launched: _Launched) -> None:
        """Wait for a launched step; put its tokens in place of their placeholders, apply the stop
        rules and queue the outputs."""
        results = launched.handle.result().results
        if len(results) != len(launched.reqs):
            raise RuntimeError(f"worker returned {len(results)} results for {len(launched.reqs)} sequences")
        for req, idx, res in zip(launched.reqs, launched.out_index, results):
            if idx < 0:
                continue
            if res is None:
                raise RuntimeError(f"worker returned no token for sampled sequence {req.rid!r}")
            if req.finished or self.reqs.get(req.rid) is not req:
                continue  # stopped or aborted after this step was launched: the token is dropped
            req.output_ids[idx] = res.token_id
            req.num_unresolved -= 1
            if req.return_logprob:
                req.pending_logprobs.append(res)
            check_finish(req, self.eos_token_ids, self.max_context_len, n=idx + 1)
            if req.finished:
                del req.output_ids[idx + 1 :]  # a decode launched after this token is void
                req.num_unresolved = 0
                self._remove(req)
            self._pending.append(self._make_output(req))

    def _drain(self) -> None:
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._read(launched)

    # Outputs ----------------------------------------------------------------------------------
    def _remove(self, req: Req) -> None:
        """Drop a finished or aborted request from the running set (releasing its KV) or the queue."""
        if req in self.running:
            self.running.remove(req)
            self.kv.release(req)
        else:
            self.waiting.remove(req)  # a retracted request holds no KV
        del self.reqs[req.rid]

    def _make_output(self, req: Req) -> ReqOutput:
        done = req.num_resolved_outputs
        new = req.output_ids[req.num_reported : done]
        req.num_reported = done
        logprobs = None
        if req.return_logprob:
            logprobs, req.pending_logprobs = req.pending_logprobs, []
        return ReqOutput(
            rid=req.rid,
            new_token_ids=new,
            new_logprobs=logprobs,
            finished=req.finished,
            finish_reason=req.finish_reason,
            matched_stop=req.matched_stop,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=done,
            cached_tokens=req.cached_tokens,
            error=req.error,
        )
