"""Offline engine in the vLLM style: `LLM(model_path, **server_args).generate(prompts, SamplingParams(...))`.

It drives the very `Scheduler.step()` loop the server's scheduler process runs, in this process,
and post-processes outputs with the server's incremental detokenizer and stop-string matcher.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftransformers.config.sampling_params import SamplingParams
from ftransformers.config.server_args import ServerArgs
from ftransformers.entrypoints.cli import resolve_model_path
from ftransformers.entrypoints.detokenizer import RequestState
from ftransformers.runtime.profiler import StepProfiler
from ftransformers.scheduler.io_struct import GenerateReq, ReqOutput
from ftransformers.scheduler.scheduler import Scheduler


@dataclass
class RequestOutput:
    """One prompt's result. `.outputs[0]` is the same object, for code written against vLLM."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int = 0
    logprobs: list[Any] | None = None
    error: str | None = None
    outputs: list[RequestOutput] = field(default_factory=list, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    def __init__(self, model: str | None = None, **server_args: Any) -> None:
        from transformers import AutoTokenizer

        from ftransformers.config.model_config import ModelConfig
        from ftransformers.runtime.model_runner import ModelRunner

        self.server_args = resolve_model_path(ServerArgs.from_kwargs(model_path=model, **server_args))
        self.model_config = ModelConfig.from_server_args(self.server_args)
        tokenizer_path = self.server_args.tokenizer_path or self.server_args.model_path
        self.tokenizer: Any = (
            _NoTextTokenizer()
            if self.server_args.skip_tokenizer_init
            else AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=self.server_args.trust_remote_code)
        )
        self.runner = ModelRunner(self.server_args, self.model_config)
        self.scheduler = Scheduler(self.runner, self.server_args, self.model_config.eos_token_ids)
        self._ids = itertools.count()
        self.profiler = StepProfiler(self.server_args.profile_dir)

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        texts, id_lists = self._normalise_prompts(prompts, prompt_token_ids)
        params = self._normalise_params(sampling_params, len(id_lists))
        self._check_params(params)
        states: dict[str, RequestState] = {}
        order: list[str] = []
        for text, ids, sp in zip(texts, id_lists, params):
            rid = f"offline-{next(self._ids)}"
            states[rid] = RequestState(rid, self.tokenizer, sp, prompt_text=text, prompt_ids=ids)
            order.append(rid)
            self.scheduler.add_request(GenerateReq(rid=rid, input_ids=ids, sampling_params=sp))
        pending = set(order)
        while pending:
            outputs: list[ReqOutput] = self.scheduler.step()
            if self.profiler.active:
                self.profiler.on_step()
            for out in outputs:
                state = states.get(out.rid)
                if state is None or out.rid not in pending:
                    continue
                state.apply(out)
                if state.stopped_by_string and not out.finished:
                    self.scheduler.abort(out.rid)  # the stop string ended it; free its KV now
                if state.finished:
                    pending.discard(out.rid)
        return [self._to_output(states[rid]) for rid in order]

    def start_profile(self, output_dir: str | os.PathLike[str] | None = None, num_steps: int | None = None,
                      activities: Sequence[str] | None = None, record_shapes: bool = False,
                      with_stack: bool = False) -> Path:
        """Profile the model steps of the following `generate` calls (torch.profiler); returns the
        trace's path. The trace is written by `stop_profile()`, or after `num_steps` steps."""
        return self.profiler.start(output_dir, num_steps, activities, record_shapes, with_stack)

    def stop_profile(self) -> Path:
        """Stop profiling and write the Chrome/Perfetto trace (`*.trace.json.gz`); returns its path."""
        return self.profiler.stop()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        id_lists = [
            list(self.tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False))
            for conv in conversations
        ]
        return self.generate(prompt_token_ids=id_lists, sampling_params=sampling_params)

    def _normalise_prompts(
        self, prompts: str | Sequence[str] | None, prompt_token_ids: Sequence[Sequence[int]] | None
    ) -> tuple[list[str | None], list[list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of `prompts` and `prompt_token_ids`")
        if prompt_token_ids is not None:
            ids = [list(map(int, p)) for p in prompt_token_ids]
            return [None] * len(ids), ids
        if isinstance(self.tokenizer, _NoTextTokenizer):
            raise ValueError("skip_tokenizer_init=True: pass prompt_token_ids, not text prompts")
        texts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        return list(texts), [list(self.tokenizer(t).input_ids) for t in texts]

    @staticmethod
    def _normalise_params(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(count)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return params

    def _check_params(self, params: list[SamplingParams]) -> None:
        if isinstance(self.tokenizer, _NoTextTokenizer) and any(sp.stop_strings for sp in params):
            raise ValueError("skip_tokenizer_init=True: stop strings need a tokenizer; use stop_token_ids")
        vocab = self.model_config.vocab_size
        if any(t >= vocab for sp in params for t in sp.logit_bias or ()):
            raise ValueError(f"logit_bias token ids must lie in [0, {vocab})")

    @staticmethod
    def _to_output(state: RequestState) -> RequestOutput:
        out = RequestOutput(
            request_id=state.rid,
            prompt=state.prompt_text,
            prompt_token_ids=state.prompt_ids,
            text=state.text,
            token_ids=list(state.token_ids),
            finish_reason=state.finish_reason,
            cached_tokens=state.cached_tokens,
            logprobs=state.logprobs,
            error=state.error,
        )
        out.outputs = [out]
        return out


class _NoTextTokenizer:
    """Stands in for the tokenizer under skip_tokenizer_init: outputs carry token ids and empty text."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""
