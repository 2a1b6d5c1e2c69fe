"""Server arguments: one frozen dataclass, from which the CLI and `LLM(**kwargs)` are both built.

Flag names follow SGLang (`--model-path`, `--chunked-prefill-size`, ...): a field `foo_bar` is the
flag `--foo-bar`. Each field's `metadata` carries its help text and, where the value set is closed,
its `choices`; `validate()` names the valid choices for a bad value.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = ("auto", "cuda", "cpu")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMAT_CHOICES = ("auto", "safetensors", "dummy")
ATTENTION_BACKEND_CHOICES = ("auto", "torch_native", "triton")  # auto: triton on CUDA, torch_native on CPU
MOE_BACKEND_CHOICES = ("auto", "torch_native", "triton")
SAMPLING_BACKEND_CHOICES = ("auto", "torch_native", "triton")  # auto: triton on CUDA
REASONING_PARSER_CHOICES = ("none", "deepseek-r1", "qwen3")
# auto: the checkpoint's quantization_config; a checkpoint method must match it; fp8 / w8a8_int8 / int4 /
# mxfp4 / nvfp4 on a float checkpoint quantize it at load time (quant/online.py)
QUANTIZATION_CHOICES = ("auto", "none", "awq", "gptq", "compressed-tensors", "fp8", "w8a8_int8", "int4", "mxfp4", "nvfp4")


def resolve_backend(name: str, device: torch.device) -> str:
    """An attention / MoE / sampling backend name with "auto" resolved: triton on CUDA, else torch_native."""
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch_native"
    return name


def _opt(help: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {"help": help, "choices": choices}


class ServerArgsError(ValueError):
    """A bad server argument; the message is one line fit to show a user."""


@dataclass(frozen=True)
class ServerArgs:
    # Model and tokenizer
    model_path: str | None = field(
        default=None, metadata=_opt("Hugging Face model folder; omitted: the built-in demo model")
    )
    tokenizer_path: str | None = field(default=None, metadata=_opt("Tokenizer folder (default: the model folder)"))
    served_model_name: str | None = field(default=None, metadata=_opt("Model name the API reports"))
    skip_tokenizer_init: bool = field(
        default=False, metadata=_opt("Load no tokenizer: token ids in, token ids out (offline engine)")
    )
    trust_remote_code: bool = field(default=False, metadata=_opt("Allow custom code in the model folder"))
    dtype: str = field(default="auto", metadata=_opt("Weight and activation dtype", DTYPE_CHOICES))
    device: str = field(default="auto", metadata=_opt("Device to run the model on", DEVICE_CHOICES))
    context_length: int | None = field(default=None, metadata=_opt("Override the model's context length"))
    load_format: str = field(
        default="auto", metadata=_opt("Weight format; 'dummy' makes random weights", LOAD_FORMAT_CHOICES)
    )
    quantization: str = field(
        default="auto",
        metadata=_opt("Weight quantization; 'auto' reads the checkpoint's quantization_config; on a float checkpoint "
                      "fp8, w8a8_int8, int4, mxfp4 or nvfp4 quantize at load time", QUANTIZATION_CHOICES),
    )
    quantization_ignore: tuple[str, ...] = field(
        default=(),
        metadata=_opt("Modules kept in the model dtype under load-time quantization (names or re: regexes, "
                      "e.g. lm_head 're:.*self_attn.*')"),
    )
    attention_backend: str = field(
        default="auto", metadata=_opt("Attention kernels (auto: triton on CUDA)", ATTENTION_BACKEND_CHOICES)
    )
    moe_backend: str = field(
        default="auto", metadata=_opt("MoE expert kernels (auto: triton on CUDA)", MOE_BACKEND_CHOICES)
    )
    sampling_backend: str = field(
        default="auto",
        metadata=_opt("Token sampling (auto: triton on CUDA, a sort-free kernel; torch_native sorts the vocabulary)",
                      SAMPLING_BACKEND_CHOICES),
    )
    cuda_graph_max_bs: int = field(default=64, metadata=_opt("Largest decode batch captured in a CUDA graph"))
    disable_cuda_graph: bool = field(default=False, metadata=_opt("Run decode eagerly, without CUDA graphs"))
    disable_pdl: bool = field(
        default=False,
        metadata=_opt("Launch the Triton kernels without programmatic dependent launch (Hopper and newer: on by "
                      "default, each kernel's launch overlaps the previous kernel's tail)"),
    )
    disable_overlap_schedule: bool = field(
        default=False,
        metadata=_opt("Wait for each step's tokens before scheduling the next (CUDA overlaps the two by default)"),
    )
    skip_warmup: bool = field(
        default=False,
        metadata=_opt("Skip the start-up warmup requests (CUDA), whose kernels then compile under the first requests"),
    )
    reasoning_parser: str = field(
        default="none", metadata=_opt("Split <think>...</think> into reasoning_content", REASONING_PARSER_CHOICES)
    )
    # Memory and scheduling
    mem_fraction_static: float | None = field(
        default=None, metadata=_opt("Fraction of device memory for weights and KV cache")
    )
    max_total_tokens: int | None = field(default=None, metadata=_opt("KV cache size in tokens"))
    max_running_requests: int | None = field(default=None, metadata=_opt("Most requests decoding at once"))
    chunked_prefill_size: int = field(
        default=8192, metadata=_opt("Most prompt tokens computed per step; -1 disables chunking")
    )
    max_prefill_tokens: int = field(default=16384, metadata=_opt("Most new prompt tokens admitted per step"))
    disable_radix_cache: bool = field(default=False, metadata=_opt("Turn off the prefix cache"))
    random_seed: int = field(default=0, metadata=_opt("Seed for dummy weights and unseeded sampling"))
    # HTTP server
    host: str = field(default="127.0.0.1", metadata=_opt("Address to listen on"))
    port: int = field(default=8001, metadata=_opt("Port to listen on"))
    api_key: str | None = field(default=None, metadata=_opt("Require this bearer token on every endpoint but /health"))
    enable_metrics: bool = field(default=False, metadata=_opt("Serve Prometheus metrics on /metrics"))
    log_level: str = field(default="info", metadata=_opt("Log level", ("debug", "info", "warning", "error")))
    log_interval_s: float = field(
        default=10.0, metadata=_opt("Log step throughput, batch, KV usage and cache hits this often, in seconds; 0: off")
    )
    # Profiling
    profile_dir: str | None = field(
        default=None,
        metadata=_opt("Folder for /start_profile traces (default: $FTRANSFORMERS_PROFILE_DIR or ./ftransformers-profiles)"),
    )

    def __post_init__(self) -> None:
        if isinstance(self.quantization_ignore, (list, str)):  # from LLM(**kwargs) or a single name
            names = [self.quantization_ignore] if isinstance(self.quantization_ignore, str) else self.quantization_ignore
            object.__setattr__(self, "quantization_ignore", tuple(names))
        self.validate()

    def validate(self) -> None:
        for f in fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ServerArgsError(
                    f"--{_flag(f.name)}: invalid value {value!r}; valid choices: {', '.join(choices)}"
                )
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ServerArgsError("--chunked-prefill-size must be a positive number of tokens or -1 (off)")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ServerArgsError("--max-total-tokens must be at least 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ServerArgsError("--max-running-requests must be at least 1")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ServerArgsError("--mem-fraction-static must lie in (0, 1)")
        if self.cuda_graph_max_bs < 1:
            raise ServerArgsError("--cuda-graph-max-bs must be at least 1")
        if self.context_length is not None and self.context_length < 1:
            raise ServerArgsError("--context-length must be at least 1")
        if self.log_interval_s < 0:
            raise ServerArgsError("--log-interval-s must be 0 (off) or a positive number of seconds")

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ServerArgsError(f"unknown option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    # CLI --------------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            flag = "--" + _flag(f.name)
            help_text = f.metadata.get("help", "")
            if f.type in (bool, "bool"):
                parser.add_argument(flag, dest=f.name, action="store_true", help=help_text)
                continue
            if "tuple[" in str(f.type):
                parser.add_argument(flag, dest=f.name, nargs="*", default=f.default, metavar="NAME", help=help_text)
                continue
            kind = _scalar_type(f.type)
            # Choices are checked in validate() so that the message names every valid value.
            parser.add_argument(flag, dest=f.name, type=kind, default=f.default, help=_with_choices(f))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _with_choices(f: dataclasses.Field[Any]) -> str:
    help_text = f.metadata.get("help", "")
    choices = f.metadata.get("choices")
    default = "" if f.default is None else f" (default: {f.default})"
    return f"{help_text}{default}" + (f"; one of {{{', '.join(choices)}}}" if choices else "")


def _scalar_type(annotation: Any) -> type:
    text = str(annotation)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str
