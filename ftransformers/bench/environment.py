"""What the run needs to know about the server before it starts, and the environment block of summary.json
(server info, hardware, tool version, git commit) that lets someone repeat it."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ftransformers.bench.client import describe_http_error


class ServerError(RuntimeError):
    """The server cannot be used (unreachable, model not served); printed as one line."""


@dataclass
class ServerFacts:
    models: list[str] = field(default_factory=list)  # ids from /v1/models ([] when it has none)
    model_info: dict[str, Any] | None = None  # /get_model_info (SGLang, ours)
    server_info: dict[str, Any] | None = None  # /server_info or /get_server_info
    context_length: int | None = None

    @property
    def tokenizer_path(self) -> str | None:
        info = self.model_info or {}
        return info.get("tokenizer_path") or info.get("model_path")


def _get_json(http: httpx.Client, path: str) -> dict[str, Any] | None:
    try:
        resp = http.get(path)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        body = resp.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def probe_server(base_url: str, api_key: str | None, timeout: float = 30.0) -> ServerFacts:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout) as http:
        try:
            resp = http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise ServerError(f"cannot reach the server at {base_url}: {describe_http_error(exc, timeout)}") from exc
        facts = ServerFacts()
        if resp.status_code == 401:
            raise ServerError(f"the server at {base_url} refused the API key (HTTP 401); pass --api-key")
        if resp.status_code == 200:
            try:
                data = resp.json().get("data") or []
            except (ValueError, AttributeError):
                data = []
            facts.models = [str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id")]
            lens = [m.get("max_model_len") for m in data if isinstance(m, dict) and isinstance(m.get("max_model_len"), int)]
            facts.context_length = lens[0] if lens else None
        facts.model_info = _get_json(http, "/get_model_info")
        facts.server_info = _get_json(http, "/server_info") or _get_json(http, "/get_server_info")
        ctx = (facts.model_info or {}).get("context_length")
        if isinstance(ctx, int):
            facts.context_length = ctx
        return facts


def resolve_model(requested: str | None, facts: ServerFacts, base_url: str) -> str:
    if requested is None:
        if not facts.models:
            raise ServerError(f"the server at {base_url} lists no models at /v1/models; pass --model")
        return facts.models[0]
    roots = {str((facts.model_info or {}).get("model_path"))}
    if facts.models and requested not in facts.models and requested not in roots:
        raise ServerError(f"the server at {base_url} does not serve model {requested!r}; "
                          f"it serves: {', '.join(facts.models)}")
    return requested


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def git_commit() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    commit = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    return f"{commit}{'-dirty' if dirty else ''}" if commit else None


def tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ftransformers")
    except PackageNotFoundError:
        return "unknown"


def environment(facts: ServerFacts, tokenizer_path: str | None) -> dict[str, Any]:
    gpu = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    return {
        "server_info": facts.server_info,
        "model_info": facts.model_info,
        "served_models": facts.models,
        "context_length": facts.context_length,
        "tokenizer_path": tokenizer_path,
        "gpu": gpu.splitlines() if gpu else None,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "git_commit": git_commit(),
        "tool_version": tool_version(),
    }
