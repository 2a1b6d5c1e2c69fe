"""CUDA-graph decode (`runtime/cuda_graph_runner.py`).

CPU (CI): the captured batch sizes and the padding rule, and that a CPU runner captures nothing.
CUDA: a tiny Llama and a tiny Qwen3-MoE through `LLM(...)` with the triton attention and MoE
backends give the same greedy tokens with CUDA graphs on and off, in float32 and bfloat16, at
decode batch sizes that need padding (3 -> 4, 5 -> 8); a decode batch above --cuda-graph-max-bs
runs eagerly. Graph and eager steps of the same batch run the same kernels on the same rows (the
graph adds padding rows, which only change the row count of the dense matmuls), so the tokens must
be identical, not merely close.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ftransformers.attention.forward_batch import ForwardMode, get_forward_batch
from ftransformers.runtime.cuda_graph_runner import capture_batch_sizes, padded_batch_size
from tests.model_harness import make_tiny_checkpoint, random_prompts

NEW_TOKENS = 12
DEV = "cuda" if torch.cuda.is_available() else "cpu"
on_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_capture_batch_sizes() -> None:
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_padded_batch_size() -> None:
    sizes = capture_batch_sizes(32)
    assert [padded_batch_size(sizes, b) for b in (1, 3, 5, 9, 17, 32)] == [1, 4, 8, 16, 24, 32]
    assert padded_batch_size(sizes, 33) is None


def test_cpu_runner_captures_nothing(tmp_path: Path) -> None:
    from ftransformers.config.model_config import ModelConfig
    from ftransformers.config.server_args import ServerArgs
    from ftransformers.runtime.model_runner import ModelRunner

    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    args = ServerArgs(model_path=str(path), device="cpu", dtype="float32", max_total_tokens=64)
    runner = ModelRunner(args, ModelConfig.from_server_args(args))
    assert runner.graph_runner is None
    assert runner.req_to_token.shape[0] == runner.max_req_slots + 1  # + the dummy padding row


class EagerGraphs:
    """A CudaGraphRunner whose "graphs" run the captured step eagerly: the graph step's host side
    (input rows, padding, future slots, graph tokens or sampler) on any device, CPU included."""

    @staticmethod
    def install(llm: Any, max_bs: int) -> Any:
        from types import SimpleNamespace

        from ftransformers.runtime.cuda_graph_runner import CudaGraphRunner

        graphs = CudaGraphRunner(llm.runner, max_bs, dummy_req_row=llm.runner.max_req_slots)
        graphs.logits = llm.runner.model.logits_buffer(graphs.max_bs)
        for bs in graphs.batch_sizes:
            fb = graphs.static_batch(bs)
            graphs.graphs[bs] = SimpleNamespace(replay=lambda fb=fb: graphs._step(fb))
        llm.runner.graph_runner = graphs
        return graphs


@pytest.mark.parametrize("mixed", [False, True])
def test_graph_step_host_side(tmp_path: Path, mixed: bool) -> None:
    """The graph step's input rows, padding (3 -> 4), future placeholders (overlap on), graph tokens
    for plain greedy rows and the sampler for the others give the eager step's tokens, on the CPU
    (Triton interpreter) through a stand-in that runs the captured step eagerly."""
    from ftransformers import LLM, SamplingParams
    from ftransformers.scheduler.scheduler import Scheduler

    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    prompts = random_prompts(3, 384, seed=2)
    common = {"max_tokens": 5, "ignore_eos": True}
    params = [SamplingParams(temperature=0.0, **common)] * 3
    if mixed:
        params = [SamplingParams(temperature=0.0, logprobs=2, **common), SamplingParams(temperature=0.7, seed=3, **common),
                  SamplingParams(temperature=0.0, **common)]  # fmt: skip
    outs = []
    for graphs in (False, True):
        llm = LLM(str(path), skip_tokenizer_init=True, device=DEV, dtype="float32", attention_backend="triton",
                  max_total_tokens=512, max_running_requests=4)  # fmt: skip
        llm.scheduler = Scheduler(llm.runner, llm.server_args, llm.model_config.eos_token_ids, overlap=True)
        runner = EagerGraphs.install(llm, 4) if graphs else None
        outs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
        if runner is not None:
            assert runner.replays >= 4
    for eager, graphed in zip(*outs):
        assert graphed.token_ids == eager.token_ids
        for a, b in zip(eager.logprobs or [], graphed.logprobs or []):
            assert a.token_id == b.token_id and b.logprob == pytest.approx(a.logprob, abs=1e-5)


def test_graph_step_replays_the_context_range_of_its_longest_sequence(tmp_path: Path) -> None:
    """Where the backend's decode launch changes with context (`decode_context_bounds`), each size has a graph per
    range, captured with the range's lower end as `decode_context`; a step replays the range holding its longest
    sequence, and the tokens are the eager steps'. CPU, through the eager stand-in with a range from 20 tokens."""
    from types import SimpleNamespace

    from ftransformers import LLM, SamplingParams
    from ftransformers.runtime.cuda_graph_runner import FIELDS

    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    prompts = random_prompts(2, 384, lengths=[10, 15], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)

    def make_llm() -> Any:
        return LLM(str(path), skip_tokenizer_init=True, device=DEV, dtype="float32", attention_backend="triton",
                   max_total_tokens=512, max_running_requests=4)  # fmt: skip

    outs = [make_llm().generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = make_llm()
    runner = EagerGraphs.install(llm, 4)
    seq_row = FIELDS.index("seq_lens")
    used: list[tuple[int, int, int | None]] = []  # (the step's longest sequence, its range, decode_context)

    def replay(bs: int, lower: int) -> None:
        fb = runner.static_batch(bs, lower)
        used.append((int(runner.inputs[bs][seq_row].max()), lower, fb.decode_context))
        runner._step(fb)

    for bs in runner.batch_sizes:
        runner.graphs[bs] = SimpleNamespace(replay=lambda bs=bs: replay(bs, 0))
        runner.longer[bs] = [(20, SimpleNamespace(replay=lambda bs=bs: replay(bs, 20)))]
    outs.append(llm.generate(prompt_token_ids=prompts, sampling_params=params))
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    assert all((longest >= 20) == (lower == 20) and context == lower for longest, lower, context in used)
    assert {lower for _, lower, _ in used} == {0, 20}  # the run crossed the bound (15 + 9 tokens)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_graph_step_without_future_slots(tmp_path: Path, temperature: float) -> None:
    """A graph step whose rows name no future slot (a synchronous caller) writes no future slot, on the
    graph's argmax path or the sampler's, and writes the earlier slots a row re-sends into req_to_token."""
    from ftransformers import LLM, SamplingParams
    from ftransformers.runtime.step_io import SeqStep, StepBatch

    path = make_tiny_checkpoint("llama", tmp_path / "llama")
    llm = LLM(str(path), skip_tokenizer_init=True, device=DEV, dtype="float32", attention_backend="triton",
              max_total_tokens=512, max_running_requests=4)  # fmt: skip
    runner = llm.runner
    EagerGraphs.install(llm, 4)
    runner.future_tokens.fill_(-9)
    sp = SamplingParams(temperature=temperature, seed=1)
    steps = [SeqStep(rid=f"r{i}", req_pool_idx=i, input_ids=[5 + i], prefix_len=3, slots_start=0,
                     slots=[10 * i + j for j in range(1, 5)], sample=True, sampling=sp, prompt_ids=[1, 2, 3],
                     output_ids=[]) for i in range(3)]  # fmt: skip
    result = runner.forward_step(StepBatch(steps))
    assert runner.graph_runner.replays == 1 and all(r is not None for r in result.results)
    assert (runner.future_tokens == -9).all()
    for i in range(3):
        assert runner.req_to_token[i, :4].tolist() == [10 * i + j for j in range(1, 5)]


# CUDA ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def tiny_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))


class DecodeCounter:
    """Counts the eager (Python-level) model forwards in DECODE mode, by batch size."""

    def __init__(self, llm: Any) -> None:
        self.eager_decode_sizes: list[int] = []
        model = llm.runner.model
        forward = model.forward

        def counted(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            fb = get_forward_batch()
            if fb.mode is ForwardMode.DECODE:
                self.eager_decode_sizes.append(fb.batch_size)
            return forward(input_ids, positions)

        model.forward = counted  # type: ignore[method-assign]


def _llm(path: Path, dtype: str, graphs: bool, max_bs: int) -> Any:
    from ftransformers import LLM

    return LLM(
        str(path), skip_tokenizer_init=True, device="cuda", dtype=dtype, attention_backend="triton",
        moe_backend="triton", max_total_tokens=4096, max_running_requests=8, cuda_graph_max_bs=max_bs,
        disable_cuda_graph=not graphs,
    )  # fmt: skip


def _generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from ftransformers import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


class SamplerCounter:
    """Counts the runner's steps, graph replays and Sampler.sample calls."""

    def __init__(self, llm: Any) -> None:
        runner = llm.runner
        self.steps = 0
        self.sampler_calls = 0
        launch, sample = runner.launch_step, runner.sampler.sample

        def counted_launch(batch: Any) -> Any:
            self.steps += 1
            return launch(batch)

        def counted_sample(*args: Any, **kwargs: Any) -> Any:
            self.sampler_calls += 1
            return sample(*args, **kwargs)

        runner.launch_step = counted_launch
        runner.sampler.sample = counted_sample


@on_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_and_eager_tokens_match(tiny_path: Path, dtype: str) -> None:
    sets = {n: random_prompts(n, 384, seed=n) for n in (3, 5, 6)}

    eager = _llm(tiny_path, dtype, graphs=False, max_bs=8)
    assert eager.runner.graph_runner is None
    expected = {n: _generate(eager, prompts) for n, prompts in sets.items()}
    del eager

    graphed = _llm(tiny_path, dtype, graphs=True, max_bs=8)
    runner = graphed.runner.graph_runner
    assert runner is not None and runner.batch_sizes == [1, 2, 4, 8]
    counter = DecodeCounter(graphed)
    calls = SamplerCounter(graphed)
    for n in (3, 5):  # padded to 4 and 8
        before = runner.replays
        assert _generate(graphed, sets[n]) == expected[n], f"{n} prompts: graph tokens differ from eager"
        assert runner.replays - before >= NEW_TOKENS - 1
    assert counter.eager_decode_sizes == [], "decode batches within max_bs must replay a graph"
    assert calls.sampler_calls == calls.steps - runner.replays, "greedy graph steps take the graph's tokens"
    del graphed

    small = _llm(tiny_path, dtype, graphs=True, max_bs=4)
    runner = small.runner.graph_runner
    assert runner is not None and runner.max_bs == 4
    counter = DecodeCounter(small)
    assert _generate(small, sets[6]) == expected[6]
    assert 6 in counter.eager_decode_sizes, "a decode batch above --cuda-graph-max-bs must run eagerly"
    assert runner.replays == 0


@on_cuda
def test_graphs_per_context_range_keep_the_tokens(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose decode launch changes at 20 tokens (decode_context_bounds, patched in) gets two graphs a
    size up to 4, captured in one memory pool; steps on either side of the bound replay their range's graph and
    give the eager tokens."""
    from ftransformers.attention.triton_backend import TritonAttentionBackend
    from ftransformers.runtime.cuda_graph_runner import CudaGraphRunner

    prompts = random_prompts(3, 384, lengths=[9, 14, 4], seed=7)  # the longest crosses 20 while decoding
    expected = _generate(_llm(tiny_path, "bfloat16", graphs=False, max_bs=8), prompts)
    monkeypatch.setattr(TritonAttentionBackend, "decode_context_bounds", lambda self, bs: (20,) if bs <= 4 else ())
    picked: list[tuple[int, bool]] = []  # (the step's longest sequence, replayed the longer range's graph)
    graph_for = CudaGraphRunner.graph_for

    def recorded(self: CudaGraphRunner, pbs: int, context: int = 0) -> Any:
        graph = graph_for(self, pbs, context)
        picked.append((context, graph is not self.graphs[pbs]))
        return graph

    monkeypatch.setattr(CudaGraphRunner, "graph_for", recorded)
    llm = _llm(tiny_path, "bfloat16", graphs=True, max_bs=8)
    runner = llm.runner.graph_runner
    assert runner is not None and [len(runner.longer[bs]) for bs in runner.batch_sizes] == [1, 1, 1, 0]
    assert runner.longer[4][0][1] is not runner.graphs[4]
    assert _generate(llm, prompts) == expected
    assert {longer for _, longer in picked} == {False, True} and all((c >= 20) == longer for c, longer in picked)


@on_cuda
def test_graph_steps_that_need_the_sampler(tiny_path: Path) -> None:
    """Rows with logprobs, penalties, bans (min_tokens) or temperature make a graph step sample from
    the graph's logits: same tokens as eager, logprobs within float32 rounding."""
    from ftransformers import SamplingParams

    prompts = random_prompts(4, 200, seed=11)
    common = {"max_tokens": NEW_TOKENS, "ignore_eos": True}
    params = [
        SamplingParams(temperature=0.0, logprobs=3, **common),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, **common),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, **common),
        SamplingParams(temperature=0.0, min_tokens=4, max_tokens=NEW_TOKENS),  # EOS banned for 4 tokens
    ]
    outs = {}
    for graphs in (False, True):
        llm = _llm(tiny_path, "bfloat16", graphs=graphs, max_bs=8)
        calls = SamplerCounter(llm)
        outs[graphs] = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        if graphs:
            assert llm.runner.graph_runner is not None and llm.runner.graph_runner.replays >= NEW_TOKENS - 1
            assert calls.sampler_calls == calls.steps, "a step with such rows must call the sampler"
        del llm
    for eager, graphed in zip(outs[False], outs[True]):
        assert graphed.token_ids == eager.token_ids
    lp_eager, lp_graph = outs[False][0].logprobs, outs[True][0].logprobs  # SeqResults
    assert lp_eager is not None and lp_graph is not None and len(lp_graph) == len(lp_eager) == NEW_TOKENS
    for a, b in zip(lp_eager, lp_graph):
        assert a.token_id == b.token_id and [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert [v for _, v in b.top_logprobs] == pytest.approx([v for _, v in a.top_logprobs], abs=1e-5)


@on_cuda
def test_early_triggers_keep_the_tokens(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every RMSNorm and decode stage 2 triggering its successor ahead of its own PDL wait (kernels/pdl.py,
    "Early trigger"; EARLY_TRIGGER = 2 forces it beyond the 4-bit projections it is meant for) gives the same
    greedy tokens, eager and graphed, as no early trigger: only the kernels' start times change."""
    from ftransformers.kernels import triton_decode_attention, triton_norm

    prompts = random_prompts(3, 300, seed=4)
    expected = {}
    for mode in (0, 2):
        monkeypatch.setattr(triton_norm, "EARLY_TRIGGER", mode)
        monkeypatch.setattr(triton_decode_attention, "EARLY_TRIGGER", mode)
        for graphs in (False, True):
            llm = _llm(tiny_path, "bfloat16", graphs=graphs, max_bs=4)
            expected.setdefault(graphs, _generate(llm, prompts))
            assert _generate(llm, prompts) == expected[graphs], f"early trigger {mode}, graphs {graphs}"
            del llm
    assert expected[True] == expected[False]
