"""The scheduler process's loop survives bad requests and a crashing model step (fake scheduler)."""

from __future__ import annotations

from typing import Any

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.entrypoints.scheduler_process import INTERNAL_ERROR_PREFIX, FlushCacheOutput, SchedulerLoop
from ftransformers.scheduler.io_struct import AbortReq, FlushCacheReq, GenerateReq, ReqOutput, StatsReq


class _FakeScheduler:
    def __init__(self, crash_on_step: int | None = None) -> None:
        self.reqs: dict[str, int] = {}
        self.steps = 0
        self.crash_on_step = crash_on_step

    def add_request(self, req: GenerateReq) -> None:
        if not req.input_ids:
            raise ValueError("boom: empty")
        self.reqs[req.rid] = 0

    def abort(self, rid: str) -> None:
        self.reqs.pop(rid)

    def has_work(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list[ReqOutput]:
        self.steps += 1
        if self.steps == self.crash_on_step:
            raise RuntimeError("CUDA exploded\nsecond line")
        outs = []
        for rid in list(self.reqs):
            self.reqs[rid] += 1
            done = self.reqs[rid] >= 3
            outs.append(ReqOutput(rid, [7], None, done, "length" if done else None, None, 1, self.reqs[rid], 0))
            if done:
                del self.reqs[rid]
        return outs

    def flush_cache(self) -> bool:
        return not self.reqs

    def stats(self) -> Any:
        return ("stats", len(self.reqs))


def _gen(rid: str, ids: list[int]) -> GenerateReq:
    return GenerateReq(rid=rid, input_ids=ids, sampling_params=SamplingParams())


def _run(loop: SchedulerLoop, inbox: list[list[Any]], turns: int) -> list[Any]:
    sent: list[Any] = []
    for _ in range(turns):
        batch = inbox.pop(0) if inbox else []
        loop.run_once(lambda _timeout: batch, sent.append, block_ms=0)
    return sent


def test_bad_request_becomes_error_output_and_loop_goes_on() -> None:
    loop = SchedulerLoop(_FakeScheduler)
    sent = _run(loop, [[_gen("bad", []), _gen("ok", [1, 2]), StatsReq()], [FlushCacheReq()]], 5)
    errors = [o for msg in sent if isinstance(msg, list) for o in msg if o.rid == "bad"]
    assert len(errors) == 1 and errors[0].finish_reason == "error" and "boom" in errors[0].error
    ok = [o for msg in sent if isinstance(msg, list) for o in msg if o.rid == "ok"]
    assert [o.completion_tokens for o in ok] == [1, 2, 3] and ok[-1].finished
    assert ("stats", 1) in sent and FlushCacheOutput(False) in sent  # flush refused while "ok" ran


def test_step_crash_fails_in_flight_requests_then_recovers() -> None:
    made: list[_FakeScheduler] = []

    def factory() -> _FakeScheduler:
        made.append(_FakeScheduler(crash_on_step=2 if not made else None))
        return made[-1]

    loop = SchedulerLoop(factory)
    sent = _run(loop, [[_gen("a", [1]), _gen("b", [2])]], 2)
    errs = [o for o in sent[-1] if o.finish_reason == "error"]
    assert {o.rid for o in errs} == {"a", "b"} and all(o.finished for o in errs)
    assert errs[0].error.startswith(INTERNAL_ERROR_PREFIX) and "\n" not in errs[0].error
    assert len(made) == 2 and loop.scheduler is made[1]
    sent = _run(loop, [[_gen("c", [3]), AbortReq("unknown")]], 3)
    assert [o.completion_tokens for msg in sent for o in msg] == [1, 2, 3]
