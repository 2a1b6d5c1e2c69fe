"""ftransformers: an inference engine for Mixture-of-Experts language models.

    from ftransformers import LLM, SamplingParams
    llm = LLM("path/to/hf-folder", chunked_prefill_size=512)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "ServerArgs", "__version__"]

if TYPE_CHECKING:
    from ftransformers.config.sampling_params import SamplingParams
    from ftransformers.config.server_args import ServerArgs
    from ftransformers.entrypoints.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy, so `import ftransformers` (e.g. by the CLI) does not pull in torch before it is needed.
    if name == "LLM":
        from ftransformers.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ftransformers.config.sampling_params import SamplingParams

        return SamplingParams
    if name == "ServerArgs":
        from ftransformers.config.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'ftransformers' has no attribute {name!r}")
