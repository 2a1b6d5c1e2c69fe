"""ModelRunner driven directly with hand-built StepBatches, against Hugging Face transformers (float32)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ftransformers.attention.forward_batch import ForwardMode, get_forward_batch
from ftransformers.cache.kv_pool import MHAKVSpec
from ftransformers.config.model_config import ModelConfig
from ftransformers.config.sampling_params import SamplingParams
from ftransformers.config.server_args import ServerArgs
from ftransformers.runtime.memory import KVCacheSizeError, kv_pool_tokens
from ftransformers.runtime.model_runner import ModelRunner
from ftransformers.runtime.step_io import SeqStep, StepBatch
from tests.model_harness import make_tiny_checkpoint

LOGIT_TOL = 1e-3
GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "deepseek_v3"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MHA dense model, an MoE one and an MLA one (MLAKVPool)."""
    return Path(make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))


def make_runner(path: Path, **overrides: object) -> ModelRunner:
    kwargs: dict[str, object] = dict(
        model_path=str(path), dtype="float32", device="cpu", max_total_tokens=512, max_running_requests=4
    )
    kwargs.update(overrides)
    args = ServerArgs(**kwargs)  # type: ignore[arg-type]
    return ModelRunner(args, ModelConfig.from_server_args(args))


class Recorder:
    """Wraps the runner's model to record each step's mode and the logits it computed."""

    def __init__(self, runner: ModelRunner) -> None:
        self.modes: list[ForwardMode] = []
        self.logits: list[torch.Tensor] = []
        model = runner.model
        forward, compute_logits = model.forward, model.compute_logits

        def fwd(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            self.modes.append(get_forward_batch().mode)
            return forward(input_ids, positions)

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            out = compute_logits(hidden)
            self.logits.append(out.clone())
            return out

        model.forward, model.compute_logits = fwd, logits  # type: ignore[method-assign]


class Seq:
    """A hand-driven sequence: prompt, generated tokens, and its KV slots from a shared counter."""

    def __init__(self, rid: str, slot_row: int, prompt: list[int], counter: itertools.count[int]) -> None:
        self.rid, self.row, self.prompt, self.counter = rid, slot_row, prompt, counter
        self.output: list[int] = []
        self.slots: list[int] = []  # KV slot of every computed position
        self.logits: list[torch.Tensor] = []

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def step(self, n: int | None = None, shared_prefix: list[int] | None = None) -> SeqStep:
        """The next n uncomputed tokens (all when None); a shared prefix is sent as already cached."""
        if shared_prefix is not None:
            self.slots = list(shared_prefix)
        pre = len(self.slots)
        pending = self.tokens[pre:]
        new = pending if n is None else pending[:n]
        new_slots = [next(self.counter) for _ in new]
        first = pre == 0 or shared_prefix is not None
        self.slots += new_slots
        return SeqStep(
            rid=self.rid,
            req_pool_idx=self.row,
            input_ids=new,
            prefix_len=pre,
            slots_start=0 if first else pre,
            slots=list(self.slots) if first else new_slots,
            sample=pre + len(new) == len(self.tokens),
            sampling=GREEDY,
            prompt_ids=self.prompt,
            output_ids=list(self.output),
        )


def run(runner: ModelRunner, rec: Recorder, seqs: list[Seq], steps: list[SeqStep]) -> None:
    before = len(rec.logits)
    result = runner.forward_step(StepBatch(steps))
    assert len(result.results) == len(steps)
    sampled = [(s, st) for s, st in zip(seqs, steps) if st.sample]
    if sampled:
        rows = rec.logits[before]  # one compute_logits call per step, rows in batch order
        assert rows.shape[0] == len(sampled) and rows.dtype == torch.float32
    for j, (s, st) in enumerate(sampled):
        s.logits.append(rows[j])
    for s, st, r in zip(seqs, steps, result.results):
        assert (r is None) == (not st.sample)
        if r is not None:
            s.output.append(r.token_id)


def hf_reference(path: Path, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()  # [new_tokens, V]
    return ids[len(prompt) :], logits


def test_chunked_prefill_and_decode_match_hf(model_path: Path) -> None:
    runner = make_runner(model_path)
    rec = Recorder(runner)
    V = runner.model_config.vocab_size
    gen = torch.Generator().manual_seed(7)
    counter = itertools.count(1)
    a = Seq("a", 2, torch.randint(0, V, (13,), generator=gen).tolist(), counter)
    b = Seq("b", 0, torch.randint(0, V, (6,), generator=gen).tolist(), counter)
    run(runner, rec, [a, b], [a.step(5), b.step()])  # a: chunk 1 (no sample); b: whole prompt
    run(runner, rec, [a, b], [a.step(5), b.step()])  # a: chunk 2 (no sample); b: decode
    run(runner, rec, [b, a], [b.step(), a.step()])  # a: last chunk, samples; order swapped
    for _ in range(6):
        run(runner, rec, [a, b], [a.step(), b.step()])  # decodes
    assert rec.modes[:3] == [ForwardMode.EXTEND] * 3 and set(rec.modes[3:]) == {ForwardMode.DECODE}

    # c shares a's first 9 prompt tokens through a's KV slots (a prefix-cache hit).
    c = Seq("c", 1, a.prompt[:9] + torch.randint(0, V, (4,), generator=gen).tolist(), counter)
    run(runner, rec, [c, a], [c.step(shared_prefix=a.slots[:9]), a.step()])
    for _ in range(4):
        run(runner, rec, [c], [c.step()])

    for s in (a, b, c):
        ref_tokens, ref_logits = hf_reference(model_path, s.prompt, len(s.output))
        assert s.output == ref_tokens, s.rid
        torch.testing.assert_close(torch.stack(s.logits), ref_logits, rtol=0, atol=LOGIT_TOL)
    # The req_to_token rows hold exactly each sequence's slots.
    for s in (a, b):
        n = len(s.slots)
        assert runner.req_to_token[s.row, :n].tolist() == s.slots


def test_empty_batch_and_bad_step(llama_path: Path) -> None:
    runner = make_runner(llama_path)
    assert runner.forward_step(StepBatch([])).results == []
    assert runner.kv_capacity == 512 and runner.max_req_slots == 4
    assert runner.max_context_len == runner.model_config.context_len
    bad = Seq("x", 0, [1, 2, 3], itertools.count(1)).step()
    bad.slots = bad.slots[:-1]  # one slot short of prefix_len + new tokens
    with pytest.raises(ValueError, match="bad SeqStep"):
        runner.forward_step(StepBatch([bad]))


def test_dummy_load_format_runs(llama_path: Path) -> None:
    runner = make_runner(llama_path, load_format="dummy")
    rec = Recorder(runner)
    counter = itertools.count(1)
    seqs = [Seq("p", 0, [1, 2, 3, 4], counter), Seq("q", 1, [5, 6], counter)]
    for _ in range(3):
        run(runner, rec, seqs, [s.step() for s in seqs])
    assert all(len(s.output) == 3 for s in seqs)
    assert all(0 <= t < runner.model_config.vocab_size for s in seqs for t in s.output)
    assert all(torch.isfinite(x).all() for x in rec.logits)


def test_kv_pool_sizing_rules() -> None:
    spec = MHAKVSpec(num_layers=2, num_kv_heads=2, head_dim=8, v_head_dim=8)  # 256 B/token in fp32
    cpu = torch.device("cpu")
    args = ServerArgs(device="cpu")
    assert kv_pool_tokens(args.replace(max_total_tokens=1000), spec, torch.float32, cpu, 8, 128) == 1000
    # Plenty of RAM for a tiny spec: every request slot can hold a whole context, no more.
    assert kv_pool_tokens(args, spec, torch.float32, cpu, 8, 128) == 8 * 128
    huge = MHAKVSpec(num_layers=1 << 20, num_kv_heads=1 << 10, head_dim=1 << 10, v_head_dim=0)  # 4 TiB/token
    with pytest.raises(KVCacheSizeError, match="does not fit"):
        kv_pool_tokens(args, huge, torch.float32, cpu, 8, 128)


def test_packed_segments_are_exact_views_each_16_byte_aligned() -> None:
    """The step's int64 metadata travels in one copy; each segment, odd lengths and empty ones included, comes back
    as itself at a 16-byte boundary (Triton specializes kernels on pointer alignment)."""
    from ftransformers.runtime.model_runner import packed_on_device

    segments = [[3, 1, 4], [1], [], [5, 9], [2, 6, 5], [-3], [5, 8, 9, 7]]
    views = packed_on_device(segments, torch.device("cpu"))
    assert [v.tolist() for v in views] == segments
    base = views[0].data_ptr()
    assert all((v.data_ptr() - base) % 16 == 0 for v in views)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one tensor: one host->device copy
