"""CUDA graphs for decode steps at padded batch sizes up to `--cuda-graph-max-bs`.

At startup `make_cuda_graph_runner` captures, for each size in `capture_batch_sizes(max_bs)`
(largest first, all graphs sharing one memory pool), a whole decode step of a static `ForwardBatch`
whose index tensors are the rows of that size's input buffer `inputs[bs]` ([F, bs] int64, FIELDS):
  `decode_inputs` (future placeholders in input_ids resolved, each row's new KV slot written into
  req_to_token), the attention backend's `init_forward_metadata`, `model.forward`, the LM head into
  the shared `logits` buffer (the head's dtype), and `greedy_tokens` (each row's first argmax into
  `tokens`, and into the future table at the row's future slot, -1 for none).
Where the attention backend launches differently by context at a size (`decode_context_bounds`, e.g. the
MLA decode's head blocks), that size gets a graph per context range, captured with the range's lower end
as `ForwardBatch.decode_context`.
A decode step is then one host->device copy of its rows, padding included (padding rows name the
dummy request row with seq_len 1 and KV slot 0, the pool's padding sink), and one replay of the
smallest graph that holds the batch, for the range holding its longest sequence. A step whose rows all
sample greedily with no penalty, ban or logprobs reads `tokens`; any other step samples from `logits`
and overwrites those rows' future slots.
Kernels on the captured path must follow the CUDA-graph rule: read only the device tensors of the batch
(no `.item()`, no `*_cpu` lists, no data-dependent sizes).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from ftransformers.attention.forward_batch import ForwardBatch, ForwardMode, forward_context
from ftransformers.layers.moe.experts import FusedMoE

if TYPE_CHECKING:
    from ftransformers.runtime.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Rows of a graph's input buffer, in order, and the value a padding row holds in each.
FIELDS = (
    "input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "prefix_lens", "future_slots"
)  # fmt: skip
_PAD_VALUES = {
    "input_ids": 0, "positions": 0, "out_cache_loc": 0, "seq_lens": 1, "prefix_lens": 0, "future_slots": -1
}  # fmt: skip
_WARMUP_RUNS = 2


def capture_batch_sizes(max_bs: int) -> list[int]:
    """[1, 2, 4, 8, 16, 24, 32, ...] (steps of 8 from 16) up to and including max_bs."""
    sizes = {b for b in (1, 2, 4, 8) if b < max_bs} | set(range(16, max_bs, 8)) | {max_bs}
    return sorted(sizes)


def padded_batch_size(sizes: list[int], bs: int) -> int | None:
    """Smallest captured size >= bs, None when bs exceeds them all."""
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


def graph_unsafe_reason(runner: ModelRunner) -> str | None:
    """Why decode steps of this runner cannot be captured, or None when they can."""
    if runner.device.type != "cuda":
        return f"device is {runner.device.type}"
    if runner.server_args.disable_cuda_graph:
        return "--disable-cuda-graph"
    if runner.attn_backend_name == "torch_native":
        return "attention backend torch_native reads host-side lists (use --attention-backend triton)"
    for m in runner.model.modules():
        if isinstance(m, FusedMoE) and (m.backend or runner.moe_backend) == "torch_native":
            return "MoE backend torch_native syncs with the host (use --moe-backend triton)"
    return None


class CudaGraphRunner:
    def __init__(self, model_runner: ModelRunner, max_bs: int, dummy_req_row: int) -> None:
        self.runner = model_runner
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        dev, n = model_runner.device, self.max_bs
        self.pad_values = [dummy_req_row if name == "req_pool_indices" else _PAD_VALUES[name] for name in FIELDS]
        pad = torch.tensor(self.pad_values, dtype=torch.int64, device=dev)[:, None]
        # inputs[bs][f, i]: field FIELDS[f] of row i of graph bs (contiguous: one H2D copy fills it)
        self.inputs = {bs: pad.expand(len(FIELDS), bs).contiguous() for bs in self.batch_sizes}
        self.extend_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.logits: torch.Tensor | None = None  # [max_bs, V] in the LM head's dtype, written by every graph
        self.tokens = torch.zeros(n, dtype=torch.int64, device=dev)  # [max_bs] each row's greedy token
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # bs -> the graph for the shortest contexts
        # bs -> [(lower end of a longer context range, its graph)], ascending, where the backend has bounds there
        self.longer: dict[int, list[tuple[int, torch.cuda.CUDAGraph]]] = {}
        self.replays = 0
        self.capture_seconds = 0.0

    def static_batch(self, bs: int, context: int = 0) -> ForwardBatch:
        r = self.runner
        rows = {name: self.inputs[bs][f] for f, name in enumerate(FIELDS) if name != "future_slots"}
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            extend_lens=self.extend_lens[:bs],
            seq_lens_cpu=[1] * bs,  # placeholders: the decode path must not read them
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            logits_indices=self.logits_indices[:bs],
            req_to_token=r.req_to_token,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
            moe_backend=r.moe_backend,
            decode_context=context,
            **rows,
        )

    def _step(self, fb: ForwardBatch) -> None:
        """The captured step: inputs[bs] -> logits[:bs], tokens[:bs] and the rows' future slots."""
        from ftransformers.kernels.triton_greedy import decode_inputs, greedy_tokens  # here: CPU needs no triton

        r, bs, inputs = self.runner, fb.batch_size, self.inputs[fb.batch_size]
        assert self.logits is not None
        decode_inputs(inputs, FIELDS, r.future_tokens, r.req_to_token)
        r.attn_backend.init_forward_metadata(fb)
        with forward_context(fb):
            hidden = r.model(fb.input_ids, fb.positions)  # [bs, D]
        logits = r.model.compute_logits(hidden, out=self.logits[:bs])
        greedy_tokens(logits, out=self.tokens[:bs], future=r.future_tokens, slots=inputs[FIELDS.index("future_slots")])

    @torch.inference_mode()
    def capture(self) -> None:
        init_state = getattr(self.runner.attn_backend, "init_cuda_graph_state", None)
        if callable(init_state):
            init_state(self.max_bs, self.runner.max_context_len)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        self.logits = self.runner.model.logits_buffer(self.max_bs)
        for bs in reversed(self.batch_sizes):  # largest first: smaller graphs reuse its pool blocks
            self.graphs[bs] = self._capture_one(self.static_batch(bs), pool, stream)
            bounds = self.runner.attn_backend.decode_context_bounds(bs)  # known after the warm-up decodes
            self.longer[bs] = [(c, self._capture_one(self.static_batch(bs, c), pool, stream)) for c in bounds]
        torch.cuda.synchronize(self.runner.device)

    def _capture_one(self, fb: ForwardBatch, pool: tuple, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(_WARMUP_RUNS):  # compiles / autotunes kernels outside the capture
                self._step(fb)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self._step(fb)
        return graph

    def graph_for(self, pbs: int, context: int = 0) -> torch.cuda.CUDAGraph:
        """The graph of captured size pbs for a batch whose longest sequence holds `context` tokens."""
        graph = self.graphs[pbs]
        for lower, g in self.longer.get(pbs, ()):
            if context >= lower:
                graph = g
        return graph

    def padded_size(self, bs: int) -> int | None:
        """The captured size a decode batch of bs rows replays at, None when graphs cannot run it."""
        return padded_batch_size(self.batch_sizes, bs) if self.graphs else None

    def replay(self, rows: torch.Tensor, bs: int, context: int = 0) -> None:
        """Run a decode step from its input rows [F, pbs] (pinned host memory, padding included; pbs a
        captured size) whose longest sequence holds `context` tokens. Afterwards logits[:bs] and tokens[:bs]
        hold its real rows' results, valid until the next replay."""
        pbs = rows.shape[1]
        assert pbs in self.graphs and bs <= pbs, "replay() at a size that was not captured"
        self.inputs[pbs].copy_(rows, non_blocking=True)
        self.graph_for(pbs, context).replay()
        self.replays += 1


def make_cuda_graph_runner(runner: ModelRunner, dummy_req_row: int) -> CudaGraphRunner | None:
    """Capture the decode graphs when this runner can use them; log why not or how long it took."""
    reason = graph_unsafe_reason(runner)
    if reason is not None:
        log = logger.debug if runner.device.type != "cuda" else logger.info
        log("CUDA graphs off: %s", reason)
        return None
    max_bs = min(runner.server_args.cuda_graph_max_bs, runner.max_req_slots)
    graphs = CudaGraphRunner(runner, max_bs, dummy_req_row)
    start = time.perf_counter()
    try:
        graphs.capture()
    except Exception as e:  # noqa: BLE001 - any kernel that breaks the capture rule: run eagerly
        logger.warning("CUDA graphs off: capture failed (%s: %s)", type(e).__name__, e)
        graphs.graphs.clear()
        graphs.longer.clear()
        torch.cuda.synchronize(runner.device)
        return None
    graphs.capture_seconds = time.perf_counter() - start
    mem = torch.cuda.memory_reserved(runner.device) / (1 << 30)
    longer = {bs: [c for c, _ in g] for bs, g in sorted(graphs.longer.items()) if g}
    logger.info(
        "CUDA graphs captured for decode batch sizes %s%s in %.2f s (%.2f GiB reserved)",
        graphs.batch_sizes, f" (and from contexts {longer})" if longer else "", graphs.capture_seconds, mem,
    )  # fmt: skip
    return graphs
