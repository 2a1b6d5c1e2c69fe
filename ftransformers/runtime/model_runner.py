"""The model worker: weights, KV pool and the req_to_token table on one device; runs a StepBatch.

`ModelRunner` implements `step_io.Worker`. Per step it writes the scheduler's slot lists into
`req_to_token`, builds a `ForwardBatch` (all index tensors from one host->device copy), runs the
model inside `forward_context`, computes logits only for the rows that sample and hands them to
the `Sampler`. On CUDA, decode steps of up to `--cuda-graph-max-bs` sequences replay a captured
CUDA graph instead (`cuda_graph_runner.py`): one host->device copy of the step's rows, the replay
(which resolves placeholders, writes the new slots and picks greedy tokens on the device), and the
`Sampler` only when a row needs more than the first argmax (temperature, penalties, bans, logprobs);
`req_to_token` has one extra all-zero row, the dummy request the graphs' padding rows read.

`launch_step` never waits for the device on CUDA: input future placeholders are resolved from the
device-side `future_tokens` table, the sampled tokens are written into it and copied to pinned host
memory, and the returned `PendingStep` waits only when its result is asked for (overlap scheduling).
"""

from __future__ import annotations

import logging

import torch

from ftransformers.attention.backend import create_attention_backend
from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode, forward_context
from ftransformers.cache.kv_pool import KVPool, make_kv_pool
from ftransformers.config.model_config import ModelConfig
from ftransformers.config.server_args import ServerArgs, resolve_backend
from ftransformers.models.loader import load_model
from ftransformers.runtime.cuda_graph_runner import FIELDS, CudaGraphRunner, make_cuda_graph_runner
from ftransformers.runtime.memory import kv_pool_tokens
from ftransformers.runtime.sampler import SampleOutput, Sampler, argmax_suffices, resolve_future, to_device
from ftransformers.runtime.step_io import (
    DoneStep,
    PendingStep,
    SeqResult,
    SeqStep,
    StepBatch,
    StepResult,
    num_future_slots,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQ_SLOTS = {"cuda": 256, "cpu": 64}


class DeviceError(RuntimeError):
    """The requested device cannot be used; one line fit to show a user."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda: no CUDA device is available (use --device cpu)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def packed_on_device(segments: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """The int64 segments in one host->device copy, each a view starting 16 bytes aligned: Triton specializes a
    kernel on its pointers' 16-byte alignment, so views at offsets that follow the batch's token and sequence counts
    made the extend attention compile again under new batch shapes, in the middle of serving (session 73)."""
    flat: list[int] = []
    for seg in segments:
        flat += seg
        flat += [0] * (len(seg) % 2)  # int64: an even count keeps the next segment at a 16-byte boundary
    packed = to_device(flat, torch.int64, device)
    views, start = [], 0
    for seg in segments:
        views.append(packed[start : start + len(seg)])
        start += len(seg) + len(seg) % 2
    return views


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig) -> None:
        self.server_args = server_args
        self.model_config = model_config
        self.device = resolve_device(server_args.device)
        self.dtype = model_config.dtype  # --dtype, or the checkpoint's for 'auto' (see ModelConfig)
        torch.manual_seed(server_args.random_seed)
        if self.device.type == "cuda":  # before any kernel is launched or captured
            from ftransformers.kernels.pdl import set_pdl_enabled

            set_pdl_enabled(not server_args.disable_pdl)

        self.model = load_model(
            model_config, self.device, self.dtype, server_args.load_format, seed=server_args.random_seed,
            quantization=server_args.quantization, quantization_ignore=tuple(server_args.quantization_ignore),
        )
        self.attn_backend_name = resolve_backend(server_args.attention_backend, self.device)
        self.attn_backend = create_attention_backend(self.attn_backend_name)
        self.moe_backend = resolve_backend(server_args.moe_backend, self.device)
        self._max_context_len = int(model_config.context_len)
        self._max_req_slots = server_args.max_running_requests or DEFAULT_MAX_REQ_SLOTS.get(self.device.type, 64)
        # req_to_token[r, p]: KV slot of position p of the sequence in request slot r (0 = unset/pad);
        # row _max_req_slots stays all zero: the dummy request of CUDA-graph padding rows.
        self.req_to_token = torch.zeros(
            self._max_req_slots + 1, self._max_context_len, dtype=torch.int64, device=self.device
        )
        kv_spec = type(self.model).kv_spec(model_config.hf_config)
        size = kv_pool_tokens(
            server_args, kv_spec, self.dtype, self.device, self._max_req_slots, self._max_context_len
        )
        self.kv_pool: KVPool = make_kv_pool(kv_spec, size, self.dtype, self.device)
        # future_tokens[k]: the token last sampled into future slot k (step_io)
        self.future_tokens = torch.zeros(num_future_slots(self._max_req_slots), dtype=torch.int64, device=self.device)
        self.sampler = Sampler(
            self.device, seed=server_args.random_seed, future=self.future_tokens, backend=server_args.sampling_backend
        )
        logger.info(
            "model %s on %s (%s): KV pool %d tokens (%.2f GiB), %d request slots, context %d",
            model_config.architecture, self.device, self.dtype, size,
            size * kv_spec.bytes_per_token(self.dtype) / (1 << 30), self._max_req_slots, self._max_context_len,
        )  # fmt: skip
        self.graph_runner: CudaGraphRunner | None = make_cuda_graph_runner(self, dummy_req_row=self._max_req_slots)

    # step_io.Worker --------------------------------------------------------------------------
    @property
    def kv_capacity(self) -> int:
        return self.kv_pool.size

    @property
    def max_req_slots(self) -> int:
        return self._max_req_slots

    @property
    def max_context_len(self) -> int:
        return self._max_context_len

    @property
    def supports_overlap(self) -> bool:
        return self.device.type == "cuda"

    def forward_step(self, batch: StepBatch) -> StepResult:
        return self.launch_step(batch).result()

    def launch_step(self, batch: StepBatch) -> PendingStep:
        if not batch.seqs:
            return DoneStep(StepResult(results=[]))
        for s in batch.seqs:
            self._check(s)
        graphs = self.graph_runner
        if graphs is not None and all(len(s.input_ids) == 1 for s in batch.seqs):
            pbs = graphs.padded_size(len(batch.seqs))
            if pbs is not None:
                return self._launch_graph_step(graphs, batch, pbs)
        fb, sample_rows, future_slots = self._prepare(batch)
        with torch.inference_mode():
            self.attn_backend.init_forward_metadata(fb)
            with forward_context(fb):
                hidden = self.model(fb.input_ids, fb.positions)  # [T, D]
            if not sample_rows:
                return DoneStep(StepResult(results=[None] * len(batch.seqs)))
            logits = self.model.compute_logits(hidden[fb.logits_indices])  # [S, V] float32
            sampled = self.sampler.sample(logits, [batch.seqs[i] for i in sample_rows])
            self._store_futures(sampled.tokens, future_slots)
        return _PendingRunnerStep(sampled, sample_rows, len(batch.seqs))

    def reset_kv(self) -> None:
        """Forget every cached token (e.g. after the scheduler flushes its prefix cache)."""
        self.kv_pool.clear()
        self.req_to_token.zero_()

    # internals -------------------------------------------------------------------------------
    def _check(self, s: SeqStep) -> None:
        n, pre, start = len(s.input_ids), s.prefix_len, s.slots_start
        end = start + len(s.slots)
        # step_io invariant: the row ends up valid on [0, prefix_len + n).
        if n < 1 or start > pre or end != pre + n or end > self._max_context_len:
            raise ValueError(
                f"bad SeqStep {s.rid!r}: {n} new tokens, prefix_len={pre}, slots [{start}, {end}) "
                f"(context {self._max_context_len})"
            )
        if not 0 <= s.req_pool_idx < self._max_req_slots:
            raise ValueError(f"bad SeqStep {s.rid!r}: req_pool_idx {s.req_pool_idx} of {self._max_req_slots}")

    def _store_futures(self, tokens: torch.Tensor, future: tuple[torch.Tensor | None, torch.Tensor] | None) -> None:
        """future_tokens[slots] = tokens[rows] for future = (rows among the sampled ones, or None for all
        of them; their slots), as `_prepare` returns it; nothing for None."""
        if future is not None:
            rows, slots = future
            self.future_tokens[slots] = tokens if rows is None else tokens[rows]

    def _launch_graph_step(self, graphs: CudaGraphRunner, batch: StepBatch, pbs: int) -> PendingStep:
        """A decode batch (one new token per sequence) through the graph of `pbs` >= len(batch.seqs) rows."""
        seqs = batch.seqs
        B = len(seqs)
        cols: list[list[int]] = [[] for _ in FIELDS]
        ids, pos, loc, pool, seq_len, pre_len, fut = cols
        w_rows: list[int] = []  # slots of earlier positions a sequence (re)sends; the graph writes only the new one
        w_cols: list[int] = []
        w_vals: list[int] = []
        sample_rows: list[int] = []
        for i, s in enumerate(seqs):
            pre = s.prefix_len
            ids.append(s.input_ids[0])
            pos.append(pre)
            loc.append(s.slots[-1])
            pool.append(s.req_pool_idx)
            seq_len.append(pre + 1)
            pre_len.append(pre)
            fut.append(s.future_slot if s.sample else -1)
            if s.slots_start < pre:
                w_rows += [s.req_pool_idx] * (pre - s.slots_start)
                w_cols += range(s.slots_start, pre)
                w_vals += s.slots[:-1]
            if s.sample:
                sample_rows.append(i)
        flat = [v for col, padv in zip(cols, graphs.pad_values) for v in col + [padv] * (pbs - B)]
        on_cuda = self.device.type == "cuda"  # (a CPU stand-in for the graphs runs in tests)
        rows = torch.tensor(flat, dtype=torch.int64, pin_memory=on_cuda).view(len(FIELDS), pbs)
        with torch.inference_mode():
            if w_vals:
                w = to_device(w_rows + w_cols + w_vals, torch.int64, self.device).view(3, -1)
                self.req_to_token[w[0], w[1]] = w[2]
            graphs.replay(rows, B, context=max(seq_len))
            if not sample_rows:
                return DoneStep(StepResult(results=[None] * B))
            sample_seqs = [seqs[i] for i in sample_rows]
            picked = None if len(sample_rows) == B else to_device(sample_rows, torch.int64, self.device)
            if argmax_suffices(sample_seqs):  # the graph's tokens, already in the future table
                tokens = graphs.tokens[:B] if picked is None else graphs.tokens[picked]
                sampled = SampleOutput(tokens, None, [None] * len(sample_rows))
            else:
                assert graphs.logits is not None
                logits = graphs.logits[:B] if picked is None else graphs.logits[picked]
                sampled = self.sampler.sample(logits, sample_seqs)
                named = [(j, s.future_slot) for j, s in enumerate(sample_seqs) if s.future_slot >= 0]
                if named:  # over the graph's argmax in those slots
                    idx = to_device([j for j, _ in named] + [k for _, k in named], torch.int64, self.device).view(2, -1)
                    self._store_futures(sampled.tokens, (None if len(named) == len(sample_seqs) else idx[0], idx[1]))
        return _PendingRunnerStep(sampled, sample_rows, B)

    def _prepare(
        self, batch: StepBatch
    ) -> tuple[ForwardBatch, list[int], tuple[torch.Tensor | None, torch.Tensor] | None]:
        """Write the slot lists of checked SeqSteps into req_to_token and build the ForwardBatch (one H2D copy).

        Also returns the rows of the batch that sample and, when any of them names a future slot,
        (their indices among the sampled rows, or None for all of them; the slots) as device tensors.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        out_cache_loc: list[int] = []
        w_rows: list[int] = []
        w_cols: list[int] = []
        w_vals: list[int] = []
        pool_idx: list[int] = []
        seq_lens: list[int] = []
        prefix_lens: list[int] = []
        extend_lens: list[int] = []
        logits_idx: list[int] = []
        sample_rows: list[int] = []
        fut_rows: list[int] = []
        fut_slots: list[int] = []
        has_placeholder = False
        num_tokens = 0
        for i, s in enumerate(batch.seqs):
            n, pre, start = len(s.input_ids), s.prefix_len, s.slots_start
            end = start + len(s.slots)
            input_ids += s.input_ids
            has_placeholder = has_placeholder or min(s.input_ids) < 0
            positions += range(pre, pre + n)
            out_cache_loc += s.slots[pre - start :]
            w_rows += [s.req_pool_idx] * len(s.slots)
            w_cols += range(start, end)
            w_vals += s.slots
            pool_idx.append(s.req_pool_idx)
            seq_lens.append(pre + n)
            prefix_lens.append(pre)
            extend_lens.append(n)
            num_tokens += n
            if s.sample:
                if s.future_slot >= 0:
                    fut_rows.append(len(sample_rows))
                    fut_slots.append(s.future_slot)
                logits_idx.append(num_tokens - 1)
                sample_rows.append(i)
        B, T, F = len(batch.seqs), num_tokens, len(fut_slots)
        (ids_t, pos_t, loc_t, rows_t, cols_t, vals_t, pool_t, seq_t, pre_t, ext_t, logit_t, frows_t, fslots_t) = (
            packed_on_device([input_ids, positions, out_cache_loc, w_rows, w_cols, w_vals, pool_idx, seq_lens,
                              prefix_lens, extend_lens, logits_idx, fut_rows, fut_slots], self.device)
        )  # fmt: skip
        if has_placeholder:
            ids_t = resolve_future(ids_t, self.future_tokens)
        self.req_to_token[rows_t, cols_t] = vals_t
        mode = ForwardMode.DECODE if T == B else ForwardMode.EXTEND
        fb = ForwardBatch(
            mode=mode,
            input_ids=ids_t,
            positions=pos_t,
            out_cache_loc=loc_t,
            req_pool_indices=pool_t,
            seq_lens=seq_t,
            prefix_lens=pre_t,
            extend_lens=ext_t,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            logits_indices=logit_t,
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            moe_backend=self.moe_backend,
        )
        future = None if not F else (None if F == len(sample_rows) else frows_t, fslots_t)
        return fb, sample_rows, future


class _PendingRunnerStep:
    def __init__(self, sampled: SampleOutput, sample_rows: list[int], num_seqs: int) -> None:
        self._sampled, self._rows, self._n = sampled, sample_rows, num_seqs

    def result(self) -> StepResult:
        results: list[SeqResult | None] = [None] * self._n
        for i, r in zip(self._rows, self._sampled.results()):
            results[i] = r
        return StepResult(results=results)
