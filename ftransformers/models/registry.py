"""Architecture name (config.json `architectures`) -> model class.

Model modules are imported only when their architecture is asked for, so importing the registry
is cheap. A new model is a new file with `@register_model("XForCausalLM")` plus one line in
`_MODEL_MODULES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

_MODEL_MODULES: dict[str, str] = {
    "LlamaForCausalLM": "ftransformers.models.llama",
    "Qwen3ForCausalLM": "ftransformers.models.qwen3",
    "Qwen3MoeForCausalLM": "ftransformers.models.qwen3_moe",
    "DeepseekV3ForCausalLM": "ftransformers.models.deepseek_v3",
}
_MODELS: dict[str, type[nn.Module]] = {}


class UnsupportedArchitectureError(ValueError):
    pass


def register_model(*architectures: str) -> Callable[[type[nn.Module]], type[nn.Module]]:
    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        for arch in architectures:
            _MODELS[arch] = cls
        return cls

    return wrap


def supported_architectures() -> list[str]:
    return sorted(set(_MODEL_MODULES) | set(_MODELS))


def get_model_class(architectures: str | Iterable[str]) -> type[nn.Module]:
    archs = [architectures] if isinstance(architectures, str) else list(architectures)
    for arch in archs:
        if arch not in _MODELS and arch in _MODEL_MODULES:
            importlib.import_module(_MODEL_MODULES[arch])
        if arch in _MODELS:
            return _MODELS[arch]
    named = ", ".join(archs) or "(none)"
    raise UnsupportedArchitectureError(
        f"unsupported architecture {named}; supported: {', '.join(supported_architectures())}"
    )
