"""Scheduler against a fake worker that keeps its own req_to_token table and a record of which
sequence prefix's KV lives in every slot, and asserts step_io's invariants on every step. Every
test runs with overlap scheduling off and on (the fake resolves future placeholders from its own
future table, as the real worker does on the device).

The fake's next token is a hash of the whole sequence so far, so the expected output of every
request is known independently of batching, chunking, pool size or retraction (`reference`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.config.server_args import ServerArgs
from ftransformers.runtime.step_io import DoneStep, SeqResult, StepBatch, StepResult, future_slot_of
from ftransformers.scheduler.io_struct import GenerateReq, ReqOutput
from ftransformers.scheduler.scheduler import Scheduler

MOD = (1 << 61) - 1
EOS = 0


def _hashes(tokens: list[int]) -> list[int]:
    """hashes[p] identifies the prefix tokens[: p + 1] (what the KV at position p depends on)."""
    out, h = [], 7
    for t in tokens:
        h = (h * 1000003 + t + 1) % MOD
        out.append(h)
    return out


def next_token(seq_hash: int, banned: set[int], vocab: int) -> int:
    t = (seq_hash >> 11) % vocab
    while t in banned:
        t = (t + 1) % vocab
    return t


class FakeWorker:
    def __init__(self, kv_capacity: int, max_req_slots: int, max_context_len: int, vocab: int = 64) -> None:
        self.kv_capacity, self.max_req_slots, self.max_context_len = kv_capacity, max_req_slots, max_context_len
        self.vocab = vocab
        self.req_to_token = [[0] * max_context_len for _ in range(max_req_slots)]
        self.slot_kv: dict[int, int] = {}  # slot -> hash of the sequence prefix whose KV it holds
        self.valid: dict[str, tuple[int, int]] = {}  # rid -> (row, valid length) after its last step
        self.live_rids: Callable[[], set[str]] = lambda: set()
        self.steps: list[list[tuple[str, int, int, bool, bool]]] = []  # (rid, prefix, n, sample, decode)
        self.computed: dict[str, int] = {}  # rid -> tokens computed, over its life
        self.banned_seen: dict[str, list[list[int]]] = {}
        self.future: dict[int, int] = {}  # future slot -> the token sampled into it
        self.placeholder_inputs = 0  # sequences whose input_ids carried a future placeholder

    supports_overlap = False  # its steps finish inside launch_step; tests force overlap on

    def resolve(self, ids: list[int]) -> list[int]:
        return [t if t >= 0 else self.future[future_slot_of(t)] for t in ids]

    def launch_step(self, batch: StepBatch) -> DoneStep:
        return DoneStep(self.forward_step(batch))

    def forward_step(self, batch: StepBatch) -> StepResult:
        live = self.live_rids()
        assert batch.seqs, "empty batch"
        assert len({s.rid for s in batch.seqs}) == len(batch.seqs)
        assert len({s.req_pool_idx for s in batch.seqs}) == len(batch.seqs)
        for s in batch.seqs:
            if s.slots_start == 0:  # (re)admitted: its old row contents are gone
                self.valid.pop(s.rid, None)
        record, results = [], []
        for s in batch.seqs:
            assert s.rid in live
            n, fill = len(s.input_ids), self.resolve(s.prompt_ids + s.output_ids)
            end = s.prefix_len + n
            assert n >= 1 and end <= len(fill) and end <= self.max_context_len
            assert self.resolve(s.input_ids) == fill[s.prefix_len : end]
            self.placeholder_inputs += any(t < 0 for t in s.input_ids)
            assert s.sample == (end == len(fill))
            assert 0 <= s.req_pool_idx < self.max_req_slots
            if s.slots_start == 0:
                assert len(s.slots) == end
            else:
                assert s.slots_start == s.prefix_len and len(s.slots) == n
                assert self.valid.get(s.rid) == (s.req_pool_idx, s.prefix_len), "row not continued"
            assert all(1 <= x <= self.kv_capacity for x in s.slots)
            row = self.req_to_token[s.req_pool_idx]
            row[s.slots_start : s.slots_start + len(s.slots)] = s.slots
            hashes = _hashes(fill[:end])
            for p in range(s.prefix_len):
                assert self.slot_kv.get(row[p]) == hashes[p], f"{s.rid}: wrong KV at position {p}"
            new = row[s.prefix_len : end]
            assert len(set(new)) == n and not set(new) & set(row[: s.prefix_len])
            for other in live - {s.rid}:
                if other in self.valid:
                    r, length = self.valid[other]
                    assert not set(new) & set(self.req_to_token[r][:length]), f"{s.rid} overwrites {other}"
            for p in range(s.prefix_len, end):
                self.slot_kv[row[p]] = hashes[p]
            self.valid[s.rid] = (s.req_pool_idx, end)
            self.computed[s.rid] = self.computed.get(s.rid, 0) + n
            decode = n == 1 and s.sample and bool(s.output_ids) and s.slots_start != 0
            record.append((s.rid, s.prefix_len, n, s.sample, decode))
            if not s.sample:
                results.append(None)
                continue
            self.banned_seen.setdefault(s.rid, []).append(list(s.banned_token_ids))
            tok = next_token(self.slot_kv[row[end - 1]], set(s.banned_token_ids), self.vocab)
            assert s.future_slot >= 0
            self.future[s.future_slot] = tok
            lp = None if s.sampling.logprobs is None else -float(tok % 7) / 10
            results.append(SeqResult(tok, lp, None if lp is None else [(tok, lp)]))
        self.steps.append(record)
        return StepResult(results)


def reference(prompt: list[int], sp: SamplingParams, ctx: int, vocab: int,
              eos: tuple[int, ...] = (EOS,)) -> tuple[list[int], str, int | None]:
    out: list[int] = []
    stops = set(sp.stop_token_ids or [])
    while True:
        banned = set() if len(out) >= sp.min_tokens else (set() if sp.ignore_eos else set(eos)) | stops
        t = next_token(_hashes(prompt + out)[-1], banned, vocab)
        out.append(t)
        if len(out) >= sp.min_tokens and ((not sp.ignore_eos and t in eos) or t in stops):
            return out, "stop", t
        if (sp.max_tokens is not None and len(out) >= sp.max_tokens) or len(prompt) + len(out) >= ctx:
            return out, "length", None


@dataclass
class Run:
    sched: Scheduler
    worker: FakeWorker
    tokens: dict[str, list[int]] = field(default_factory=dict)
    final: dict[str, ReqOutput] = field(default_factory=dict)
    outputs: list[ReqOutput] = field(default_factory=list)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request: pytest.FixtureRequest) -> bool:
    global OVERLAP
    OVERLAP = request.param
    return OVERLAP


OVERLAP = False


def make(kv: int = 4096, slots: int = 16, ctx: int = 512, vocab: int = 64, **args: object) -> Run:
    worker = FakeWorker(kv, slots, ctx, vocab)
    sched = Scheduler(worker, ServerArgs(**args), [EOS], overlap=OVERLAP)  # type: ignore[arg-type]
    worker.live_rids = lambda: {r.rid for r in sched.running}
    return Run(sched, worker)


def check_books(s: Scheduler) -> None:
    """Every KV slot is free, cached, or owned by exactly one running request; rows likewise."""
    kv = s.kv
    own = [x for r in s.running for x in r.kv_slots[r.cache_owned_len :]]
    cached, stack = [], list(kv.tree_cache.root.children.values())
    while stack:
        node = stack.pop()
        cached.extend(node.value)
        stack.extend(node.children.values())
    free = kv.token_allocator._free
    assert len(set(own) | set(cached) | set(free)) == len(own) + len(cached) + len(free)
    assert kv.token_allocator.available_size + kv.tree_cache.total_size() + len(own) == s.kv_capacity
    assert kv.req_allocator.available_size + len(s.running) == kv.req_allocator.num_slots
    assert len(s.running) <= s.max_running_requests
    assert all(r.req_pool_idx is None and not r.kv_slots for r in s.waiting)
    # FCFS, retracted requests included: the queue is in arrival order, behind every running one.
    waiting = [r.arrival for r in s.waiting]
    assert waiting == sorted(waiting)
    assert not waiting or all(r.arrival < waiting[0] for r in s.running)


def step(run: Run) -> list[ReqOutput]:
    outs = run.sched.step()
    for o in outs:
        assert o.rid not in run.final, f"output for {o.rid} after it finished"
        toks = run.tokens.setdefault(o.rid, [])
        toks.extend(o.new_token_ids)
        assert o.completion_tokens == len(toks)
        if o.new_logprobs is not None:
            assert len(o.new_logprobs) == len(o.new_token_ids)
            assert [r.token_id for r in o.new_logprobs] == o.new_token_ids
        if o.finished:
            run.final[o.rid] = o
    run.outputs.extend(outs)
    check_books(run.sched)
    return outs


def drain(run: Run, max_steps: int = 20000) -> None:
    for _ in range(max_steps):
        if not run.sched.has_work():
            return
        step(run)
    raise AssertionError("scheduler did not finish")


def submit(run: Run, rid: str, prompt: list[int], **sp: object) -> SamplingParams:
    params = SamplingParams(**sp)  # type: ignore[arg-type]
    run.sched.add_request(GenerateReq(rid, prompt, params))
    return params


def workload(seed: int, n: int, vocab: int = 64, max_prompt: int = 60, max_out: int = 20
             ) -> list[tuple[str, list[int], dict[str, object]]]:
    rng = random.Random(seed)
    base = [rng.randrange(1, vocab) for _ in range(max_prompt)]
    reqs = []
    for i in range(n):
        plen = rng.randint(1, max_prompt)
        prompt = base[: rng.randint(0, plen)]  # shared prefixes make radix hits likely
        prompt += [rng.randrange(1, vocab) for _ in range(plen - len(prompt))]
        reqs.append((f"r{i}", prompt, {"max_tokens": rng.randint(1, max_out), "temperature": 0.0}))
    return reqs


def run_workload(run: Run, reqs: list[tuple[str, list[int], dict[str, object]]], stagger: int = 2) -> None:
    pending = list(reqs)
    params: dict[str, SamplingParams] = {}
    while pending or run.sched.has_work():
        for _ in range(stagger if pending else 0):
            if pending:
                rid, prompt, sp = pending.pop(0)
                params[rid] = submit(run, rid, prompt, **sp)
        step(run)
    ctx = run.sched.max_context_len
    for rid, prompt, _ in reqs:
        toks, reason, stop = reference(prompt, params[rid], ctx, run.worker.vocab)
        assert run.tokens[rid] == toks, rid
        assert (run.final[rid].finish_reason, run.final[rid].matched_stop) == (reason, stop), rid
        assert run.final[rid].prompt_tokens == len(prompt)


# ---------------------------------------------------------------------------------------------
def test_chunked_prefill_mixes_decodes_and_respects_budget() -> None:
    run = make(chunked_prefill_size=16)
    run_workload(run, workload(1, 14), stagger=1)
    steps = run.worker.steps
    for rec in steps:
        assert sum(n for _, _, n, _, decode in rec if not decode) <= 16
    assert any(any(d for *_, d in rec) and any(not d for *_, d in rec) for rec in steps), "never mixed"
    assert any(not sample for _, _, n, sample, _ in (x for rec in steps for x in rec)), "never chunked"
    assert run.sched.stats().num_running == 0 and run.sched.stats().num_retractions == 0


def test_max_prefill_tokens_bounds_chunks() -> None:
    run = make(chunked_prefill_size=64, max_prefill_tokens=10)
    run_workload(run, workload(2, 8), stagger=3)
    for rec in run.worker.steps:
        assert sum(n for _, _, n, _, decode in rec if not decode) <= 10


def test_chunking_off_prefills_whole_prompts() -> None:
    run = make(chunked_prefill_size=-1, max_prefill_tokens=50)
    run_workload(run, workload(3, 10, max_prompt=80), stagger=4)
    for rec in run.worker.steps:
        prefills = [(n, sample) for _, _, n, sample, decode in rec if not decode]
        assert all(sample for _, sample in prefills), "a prompt was split"
        if len(prefills) > 1:
            assert sum(n for n, _ in prefills) <= 50


def test_radix_hit_computes_only_suffix() -> None:
    run = make(chunked_prefill_size=8)
    rng = random.Random(5)
    prompt = [rng.randrange(1, 64) for _ in range(40)]
    submit(run, "a", prompt, max_tokens=5, ignore_eos=True)
    drain(run)
    assert run.final["a"].cached_tokens == 0
    submit(run, "b", prompt, max_tokens=5, ignore_eos=True)
    drain(run)
    assert run.final["b"].cached_tokens == 39
    assert run.tokens["b"] == run.tokens["a"]
    assert run.worker.computed["b"] == 1 + 4  # the last prompt token, then 4 decodes
    other = prompt[:20] + [rng.randrange(1, 64) for _ in range(10)]
    submit(run, "c", other, max_tokens=3, ignore_eos=True)
    drain(run)
    assert run.final["c"].cached_tokens == 20
    assert run.worker.computed["c"] == 10 + 2
    st = run.sched.stats()
    assert st.cache_hit_tokens == 59 and st.prompt_tokens_total == 110
    assert st.kv_used_tokens == 0 and st.kv_cached_tokens > 0


def test_concurrent_identical_prompts_share_prefix() -> None:
    run = make(chunked_prefill_size=-1)
    prompt = list(range(1, 31))
    submit(run, "a", prompt, max_tokens=4, ignore_eos=True)
    step(run)
    submit(run, "b", prompt, max_tokens=4, ignore_eos=True)  # "a" is still running
    drain(run)
    assert run.final["b"].cached_tokens == 29 and run.tokens["a"] == run.tokens["b"]


@pytest.mark.parametrize("disable_radix_cache", [False, True])
@pytest.mark.parametrize("chunk", [8, -1])
def test_retraction_under_tiny_pool_gives_same_tokens(disable_radix_cache: bool, chunk: int) -> None:
    reqs = workload(7, 16, max_prompt=30, max_out=30)
    big = make(ctx=64, chunked_prefill_size=chunk, disable_radix_cache=disable_radix_cache)
    run_workload(big, reqs, stagger=16)
    tiny = make(kv=64, ctx=64, chunked_prefill_size=chunk, disable_radix_cache=disable_radix_cache)
    run_workload(tiny, reqs, stagger=16)
    assert tiny.sched.stats().num_retractions > 0
    assert tiny.tokens == big.tokens
    # Each rid reported its tokens exactly once and finished exactly once.
    for rid, *_ in reqs:
        assert sum(1 for o in tiny.outputs if o.rid == rid and o.finished) == 1


def test_max_running_requests() -> None:
    run = make(max_running_requests=2, chunked_prefill_size=16)
    reqs = workload(11, 8)
    pending = list(reqs)
    for rid, prompt, sp in pending:
        submit(run, rid, prompt, **sp)
    while run.sched.has_work():
        step(run)
        assert len(run.sched.running) <= 2
        assert len(run.worker.steps[-1]) <= 2 if run.worker.steps else True
    assert set(run.final) == {r[0] for r in reqs}
    # FCFS: requests are first admitted in arrival order.
    first_seen: list[str] = []
    for rec in run.worker.steps:
        for rid, *_ in rec:
            if rid not in first_seen:
                first_seen.append(rid)
    assert first_seen == [r[0] for r in reqs]


def test_abort_in_every_state() -> None:
    run = make(max_running_requests=2, chunked_prefill_size=4)
    submit(run, "decoding", [1, 2, 3], max_tokens=50, ignore_eos=True)
    submit(run, "prefilling", list(range(1, 41)), max_tokens=5)
    submit(run, "waiting", [5, 6, 7], max_tokens=5)
    for _ in range(3):
        step(run)
    assert run.tokens["decoding"] and "prefilling" not in run.tokens
    assert [r.rid for r in run.sched.waiting] == ["waiting"]
    before = list(run.tokens["decoding"])
    for rid in ("decoding", "prefilling", "waiting", "nonexistent"):
        run.sched.abort(rid)
    assert run.sched.has_work()
    outs = step(run)
    assert {o.rid: o.finish_reason for o in outs} == {"decoding": "abort", "prefilling": "abort", "waiting": "abort"}
    assert run.tokens["decoding"] == before  # nothing re-sent, nothing lost
    assert not run.sched.has_work() and step(run) == []
    st = run.sched.stats()
    assert st.num_running == st.num_waiting == st.kv_used_tokens == 0
    run.sched.abort("decoding")  # twice: ignored
    assert not run.sched.has_work()


def test_abort_after_retraction() -> None:
    run = make(kv=40, ctx=40, chunked_prefill_size=8)
    for i in range(4):
        submit(run, f"q{i}", [i + 1] * 10, max_tokens=25, ignore_eos=True)
    while run.sched.stats().num_retractions == 0:
        step(run)
    victim = run.sched.waiting[0].rid
    run.sched.abort(victim)
    drain(run)
    assert run.final[victim].finish_reason == "abort"
    assert all(run.final[r].finish_reason == "length" for r in run.final if r != victim)


def test_stop_conditions() -> None:
    vocab = 5  # EOS (0) comes up often
    run = make(vocab=vocab, ctx=64)
    rng = random.Random(3)
    cases: dict[str, tuple[list[int], dict[str, object]]] = {}
    for i in range(6):
        p = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 12))]
        cases[f"plain{i}"] = (p, {"max_tokens": 30})
        cases[f"min{i}"] = (p, {"max_tokens": 30, "min_tokens": 12, "stop_token_ids": [3]})
        cases[f"ignore{i}"] = (p, {"max_tokens": 15, "ignore_eos": True})
        cases[f"stopid{i}"] = (p, {"max_tokens": 30, "ignore_eos": True, "stop_token_ids": [2, 4]})
        cases[f"ctx{i}"] = (p, {"max_tokens": None, "ignore_eos": True})
    params = {rid: submit(run, rid, p, **sp) for rid, (p, sp) in cases.items()}
    drain(run)
    reasons = set()
    for rid, (p, _) in cases.items():
        toks, reason, stop = reference(p, params[rid], 64, vocab)
        out = run.final[rid]
        assert run.tokens[rid] == toks and (out.finish_reason, out.matched_stop) == (reason, stop), rid
        reasons.add((rid.rstrip("0123456789"), reason))
    assert ("plain", "stop") in reasons and ("stopid", "stop") in reasons
    for i in range(6):
        assert len(run.tokens[f"min{i}"]) >= 12 and EOS not in run.tokens[f"min{i}"][:12]
        assert 3 not in run.tokens[f"min{i}"][:12]
        assert len(run.tokens[f"ignore{i}"]) == 15 and run.final[f"ignore{i}"].finish_reason == "length"
        assert len(cases[f"ctx{i}"][0]) + len(run.tokens[f"ctx{i}"]) == 64
        banned = run.worker.banned_seen[f"min{i}"]
        assert banned[0] == [EOS, 3] and banned[-1] == [] or len(run.tokens[f"min{i}"]) == 12
        assert all(b == [] for b in run.worker.banned_seen[f"ignore{i}"])
    assert any(EOS in run.tokens[f"ignore{i}"] for i in range(6))  # EOS sampled but not a stop


def test_logprobs_carried() -> None:
    run = make()
    submit(run, "lp", [1, 2, 3], max_tokens=6, ignore_eos=True, logprobs=1)
    submit(run, "nolp", [1, 2, 3], max_tokens=6, ignore_eos=True)
    drain(run)
    lp = [o for o in run.outputs if o.rid == "lp"]
    assert sum(len(o.new_logprobs or []) for o in lp) == 6
    assert all(o.new_logprobs is None for o in run.outputs if o.rid == "nolp")


def test_invalid_requests_error_and_others_continue() -> None:
    run = make(ctx=32)
    submit(run, "long", list(range(1, 33)), max_tokens=1)
    submit(run, "toolong_out", list(range(1, 21)), max_tokens=13)
    submit(run, "empty", [], max_tokens=1)
    submit(run, "ok", list(range(1, 21)), max_tokens=12, ignore_eos=True)
    outs = step(run)
    errs = {o.rid: o for o in outs if o.finish_reason == "error"}
    assert set(errs) == {"long", "toolong_out", "empty"}
    assert all(o.finished and o.error and "\n" not in o.error and not o.new_token_ids for o in errs.values())
    assert "32" in errs["long"].error  # type: ignore[operator]
    drain(run)
    assert len(run.tokens["ok"]) == 12 and run.final["ok"].finish_reason == "length"
    submit(run, "dup", [1], max_tokens=1)
    run.sched.add_request(GenerateReq("dup", [1], SamplingParams(max_tokens=1)))  # rid in flight
    outs = run.sched.step()
    if OVERLAP:  # the token is read one step later
        outs += run.sched.step()
    assert [(o.rid, o.finish_reason) for o in outs] == [("dup", "error"), ("dup", "length")]


def test_kv_pool_smaller_than_context_bounds_requests() -> None:
    run = make(kv=20, ctx=512)
    assert run.sched.max_context_len == 20
    submit(run, "big", list(range(1, 16)), max_tokens=10)
    submit(run, "fits", list(range(1, 16)), max_tokens=5, ignore_eos=True)
    drain(run)
    assert run.final["big"].finish_reason == "error" and "KV cache" in (run.final["big"].error or "")
    assert len(run.tokens["fits"]) == 5


def test_flush_cache() -> None:
    run = make()
    prompt = list(range(1, 21))
    submit(run, "a", prompt, max_tokens=3, ignore_eos=True)
    assert run.sched.flush_cache() is False  # a request is waiting
    step(run)
    assert run.sched.flush_cache() is False  # running
    drain(run)
    kv = run.sched.kv
    assert kv.tree_cache.total_size() > 0
    assert run.sched.flush_cache() is True
    assert kv.tree_cache.total_size() == 0 and kv.token_allocator.available_size == kv.kv_capacity
    submit(run, "b", prompt, max_tokens=3, ignore_eos=True)
    drain(run)
    assert run.final["b"].cached_tokens == 0 and run.tokens["b"] == run.tokens["a"]


def test_disabled_radix_cache_caches_nothing() -> None:
    run = make(disable_radix_cache=True, chunked_prefill_size=8)
    prompt = list(range(1, 31))
    for rid in ("a", "b"):
        submit(run, rid, prompt, max_tokens=4, ignore_eos=True)
        drain(run)
    assert run.final["b"].cached_tokens == 0 and run.tokens["a"] == run.tokens["b"]
    assert run.worker.computed["b"] == 30 + 3
    kv = run.sched.kv
    assert kv.tree_cache.total_size() == 0 and kv.token_allocator.available_size == kv.kv_capacity
    assert run.sched.flush_cache() is True


def test_randomized_stress() -> None:
    rng = random.Random(99)
    for trial in range(16):
        ctx = rng.choice([48, 64, 96])
        kv = rng.choice([ctx, ctx, ctx + 17, 4 * ctx])
        run = make(kv=kv, slots=rng.choice([2, 5, 12]), ctx=ctx, vocab=rng.choice([7, 64]),
                   chunked_prefill_size=rng.choice([-1, 3, 16]), max_prefill_tokens=rng.choice([20, 200]),
                   max_running_requests=rng.choice([None, 3]), disable_radix_cache=rng.random() < 0.3)
        reqs = workload(1000 + trial, rng.randint(5, 20), vocab=run.worker.vocab,
                        max_prompt=ctx // 2, max_out=ctx // 2 - 1)
        params: dict[str, SamplingParams] = {}
        pending, aborted = list(reqs), set()
        while pending or run.sched.has_work():
            for _ in range(rng.randint(0, 6)):
                if pending:
                    rid, prompt, sp = pending.pop(0)
                    params[rid] = submit(run, rid, prompt, **sp, min_tokens=rng.randint(0, 1))
            if rng.random() < 0.05 and run.sched.reqs:
                rid = rng.choice(sorted(run.sched.reqs))
                run.sched.abort(rid)
                aborted.add(rid)
            step(run)
        for rid, prompt, _ in reqs:
            out = run.final[rid]
            if rid in aborted:
                assert out.finish_reason == "abort"
                continue
            toks, reason, stop = reference(prompt, params[rid], run.sched.max_context_len, run.worker.vocab)
            assert run.tokens[rid] == toks and (out.finish_reason, out.matched_stop) == (reason, stop), (trial, rid)
        kv_m = run.sched.kv
        assert kv_m.token_allocator.available_size + kv_m.tree_cache.total_size() == kv
        assert (run.worker.placeholder_inputs > 0) == OVERLAP
        assert run.sched.flush_cache() and kv_m.token_allocator.available_size == kv


def test_chunking_off_long_prompt_runs_beside_decodes() -> None:
    run = make(chunked_prefill_size=-1, max_prefill_tokens=8)
    submit(run, "short", [1, 2, 3], max_tokens=40, ignore_eos=True)
    step(run)
    submit(run, "long", list(range(10, 40)), max_tokens=2, ignore_eos=True)  # over the budget
    step(run)
    assert run.worker.steps[-1] == [("short", 3, 1, True, True), ("long", 0, 30, True, False)]
    drain(run)
    assert len(run.tokens["long"]) == 2 and len(run.tokens["short"]) == 40


def test_overlap_reads_each_step_one_call_later() -> None:
    run = make(vocab=5)
    submit(run, "len", [1, 2, 3], max_tokens=4, ignore_eos=True)
    outs = step(run)
    assert outs == [] if OVERLAP else [o.rid for o in outs] == ["len"]
    drain(run)
    assert len(run.tokens["len"]) == 4 and run.final["len"].finish_reason == "length"
    # A length stop is foreseen: no decode is launched past max_tokens, overlap or not.
    assert run.worker.computed["len"] == 3 + 3
    decodes = [rec for rec in run.worker.steps if rec[0][4]]
    assert len(decodes) == 3
    assert (run.worker.placeholder_inputs == 3) == OVERLAP  # every decode input was in flight


def test_overlap_drops_the_decode_launched_after_a_stop() -> None:
    vocab, prompt = 5, [1, 2]
    params = SamplingParams(max_tokens=50)
    expected, reason, _ = reference(prompt, params, 512, vocab)
    assert reason == "stop"  # EOS (0) comes up within 50 tokens in this vocabulary
    run = make(vocab=vocab)
    submit(run, "eos", prompt, max_tokens=50)
    drain(run)
    assert run.tokens["eos"] == expected and run.final["eos"].finish_reason == "stop"
    # With overlap, one decode after the stop token was already running when it was read.
    assert run.worker.computed["eos"] == len(prompt) + len(expected) - 1 + int(OVERLAP)
    st = run.sched.stats()
    assert st.num_running == st.kv_used_tokens == 0
