"""What the engine needs to know about a checkpoint, read once from its folder.

`ModelConfig` wraps the Hugging Face `PretrainedConfig` and resolves the engine-level choices:
the dtype ('auto' -> the checkpoint's own), the context length, the EOS ids. Failures raise
`ModelConfigError` with a one-line message fit to show a user.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ftransformers.config.server_args import ServerArgs

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
_DEEPSEEK_V3_ARCHS = ("DeepseekV3ForCausalLM",)


class ModelConfigError(ValueError):
    """A model folder that cannot be used; the message is one line fit to show a user."""


@dataclass
class ModelConfig:
    model_path: str
    hf_config: PretrainedConfig
    architecture: str
    dtype: torch.dtype
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> ModelConfig:
        if args.model_path is None:
            raise ModelConfigError("no --model-path given (the demo model is resolved by the entrypoint)")
        return cls.from_pretrained(
            args.model_path,
            dtype=args.dtype,
            context_length=args.context_length,
            trust_remote_code=args.trust_remote_code,
        )

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | Path,
        dtype: str = "auto",
        context_length: int | None = None,
        trust_remote_code: bool = False,
    ) -> ModelConfig:
        path = Path(model_path)
        if not path.is_dir():
            raise ModelConfigError(f"model path {str(path)!r} is not a folder")
        if not (path / "config.json").is_file():
            raise ModelConfigError(f"model folder {str(path)!r} has no config.json")
        raw = _read_json(path / "config.json")
        hf_config = _load_hf_config(path, raw, trust_remote_code)
        architectures = list(getattr(hf_config, "architectures", None) or raw.get("architectures") or [])
        if not architectures:
            raise ModelConfigError(f"{path / 'config.json'}: no 'architectures' entry")
        max_pos = _context_from_config(hf_config)
        if context_length is not None and context_length > max_pos:
            # Rope tables and position embeddings end at the model's own maximum.
            raise ModelConfigError(
                f"--context-length {context_length} exceeds the model's maximum of {max_pos} positions"
            )
        return cls(
            model_path=str(path),
            hf_config=hf_config,
            architecture=architectures[0],
            dtype=resolve_dtype(dtype, hf_config),
            context_len=int(context_length or max_pos),
            vocab_size=int(hf_config.vocab_size),
            eos_token_ids=_eos_token_ids(path, hf_config),
        )


def resolve_dtype(dtype: str, hf_config: Any) -> torch.dtype:
    """'auto' -> the checkpoint's dtype (bfloat16 when it names none); else the named dtype."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ModelConfigError(f"unknown dtype {dtype!r}; valid: auto, bfloat16, float16, float32")
        return _DTYPES[dtype]
    # vars(): reading `.torch_dtype` through getattr on transformers 5 prints a deprecation warning.
    found = getattr(hf_config, "dtype", None) or vars(hf_config).get("torch_dtype")
    if isinstance(found, torch.dtype):
        return found
    if isinstance(found, str):
        return _DTYPES.get(found.removeprefix("torch."), torch.bfloat16)
    return torch.bfloat16


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"cannot read {path}: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"cannot read {path}: expected a JSON object")
    return data


def _load_hf_config(path: Path, raw: dict[str, Any], trust_remote_code: bool) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError for unknown model types
        if any(a in _DEEPSEEK_V3_ARCHS for a in raw.get("architectures") or []):
            # Kimi-K2 and friends: DeepSeek-V3 architecture under a custom model_type + auto_map.
            return _deepseek_v3_config(path, raw)
        raise ModelConfigError(f"cannot read {path / 'config.json'}: {_one_line(e)}") from None


def _deepseek_v3_config(path: Path, raw: dict[str, Any]) -> PretrainedConfig:
    from transformers import DeepseekV3Config

    fields = {k: v for k, v in raw.items() if k not in ("auto_map", "model_type", "transformers_version")}
    try:
        return DeepseekV3Config(**fields)
    except Exception as e:
        raise ModelConfigError(f"cannot read {path / 'config.json'} as DeepSeek-V3: {_one_line(e)}") from None


def _context_from_config(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_token_ids(path: Path, hf_config: Any) -> list[int]:
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            ids = _as_id_list(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError, TypeError, AttributeError):
            ids = []
        if ids:
            return ids
    return _as_id_list(getattr(hf_config, "eos_token_id", None))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."
