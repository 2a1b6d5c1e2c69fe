"""A real server in a child process for tests: start it, wait for /health, always stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    base: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]


@contextmanager
def running_server(
    args: list[str], module: str = "ftransformers.launch_server", timeout: float = 240.0
) -> Iterator[ServerProcess]:
    """`python -m MODULE --port P ARGS...`; fails the test with the server's log if it dies or stays unhealthy."""
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="ft-server-")) / "server.log"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), *args],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        server = ServerProcess(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"server exited with {proc.returncode}:\n{server.log()}")
                try:
                    if httpx.get(server.base + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"server not healthy after {timeout:.0f} s:\n{server.log()}")
                time.sleep(0.3)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
