"""The import rule of DESIGN.md: imports point down the layer stack, packages form no cycles, and the
offline engine imports without the server's packages (the GPU image lacks them)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ftransformers"

LAYERS: dict[str, int] = {
    "config": 0, "utils": 0,
    "kernels": 1, "distributed": 1, "ipc": 1,
    "layers": 2, "attention": 2, "cache": 2, "quant": 2,
    "models": 3,
    "runtime": 4,
    "scheduler": 5,
    "entrypoints": 6, "bench": 6, "eval": 6,
}  # fmt: skip
TOP = 7  # ftransformers/__init__.py, __main__.py, launch_server.py


def _package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "ftransformers":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module top level) for every ftransformers import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(node) for node in tree.body}
    for node in tree.body:  # imports under a module-level `if TYPE_CHECKING:` count as top level
        if isinstance(node, ast.If):
            top_level.update(id(child) for child in node.body)
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno, id(node) in top_level))
        elif isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno, id(node) in top_level) for alias in node.names)
    return [item for item in found if item[0].split(".")[0] == "ftransformers"]


def _source_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _layer(path: Path) -> tuple[str, int]:
    rel = path.relative_to(ROOT).parts
    if len(rel) == 1:
        return "", TOP
    if rel[0] not in LAYERS:
        pytest.fail(f"package ftransformers/{rel[0]} has no layer: add it to LAYERS and DESIGN's picture")
    return rel[0], LAYERS[rel[0]]


def test_every_import_points_down() -> None:
    violations = []
    for path in _source_files():
        package, level = _layer(path)
        for module, line, _ in _imports(path):
            target = _package_of(module)
            if target is None:
                continue
            target_level = TOP if target == "" else LAYERS[target]
            if target_level > level:
                violations.append(f"{path.relative_to(ROOT.parent)}:{line} ({package or 'top'}, L{level}) imports {module} (L{target_level})")
    assert not violations, "upward imports:\n" + "\n".join(violations)


def test_packages_form_no_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for path in _source_files():
        package, _ = _layer(path)
        for module, _, _ in _imports(path):
            target = _package_of(module)
            if target and package and target != package:
                graph.setdefault(package, set()).add(target)
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> None:
        if node in done:
            return
        if node in visiting:
            pytest.fail("import cycle between packages: " + " -> ".join([*visiting[visiting.index(node):], node]))
        visiting.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        visiting.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


def test_offline_engine_imports_without_server_packages() -> None:
    blocked = ["fastapi", "uvicorn", "pydantic", "zmq", "prometheus_client", "orjson"]
    code = (
        "import sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        "from ftransformers import LLM, SamplingParams\n"
        "import ftransformers.runtime.model_runner, ftransformers.scheduler.scheduler\n"
        "import ftransformers.models.llama, ftransformers.models.deepseek_v3\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_cpu_engine_runs_without_triton(tmp_path: Path) -> None:
    """A CPU install has no triton (torch's CPU wheel does not bring it): the engine must import and
    generate without it, kernels being imported only where a CUDA path runs."""
    from tests.model_harness import make_tiny_checkpoint

    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "moe")
    code = (
        "import sys\n"
        "sys.modules['triton'] = None\n"
        "from ftransformers import LLM, SamplingParams\n"
        f"llm = LLM({str(path)!r}, skip_tokenizer_init=True, device='cpu', max_total_tokens=256)\n"
        "out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=3, top_p=0.9))\n"
        "assert len(out[0].token_ids) == 3, out\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300, env=env,
                            cwd=ROOT.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
