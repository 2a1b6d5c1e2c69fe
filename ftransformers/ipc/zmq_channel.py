"""ZeroMQ PUSH/PULL channels over `ipc://` paths, carrying pickled io_struct dataclasses.

Between the HTTP front end and the scheduler process run two one-way pipes:
front end --PUSH--> scheduler (requests), scheduler --PUSH--> front end (outputs).
A PUSH/PULL pipe keeps message order, which the front end relies on to pair replies
(stats, flush) with the requests that asked for them.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from typing import Any

import zmq
import zmq.asyncio


def make_ipc_dir() -> str:
    # ipc:// paths are limited to ~107 bytes, so the folder lives directly in the temp dir.
    return tempfile.mkdtemp(prefix="ftx-")


def ipc_addr(ipc_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, name)}"


def remove_ipc_dir(ipc_dir: str) -> None:
    shutil.rmtree(ipc_dir, ignore_errors=True)


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


class PushChannel:
    """Blocking sender (scheduler side, or any sync caller)."""

    def __init__(self, addr: str, bind: bool = False, ctx: zmq.Context | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)

    def send(self, obj: Any) -> None:
        self.sock.send(_dumps(obj), copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class PullChannel:
    """Blocking / polling receiver (scheduler side)."""

    def __init__(self, addr: str, bind: bool = True, ctx: zmq.Context | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """One message; None when `timeout_ms` passes first (0: poll without blocking)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return pickle.loads(self.sock.recv())

    def recv_all_nowait(self) -> list[Any]:
        msgs: list[Any] = []
        while True:
            try:
                msgs.append(pickle.loads(self.sock.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return msgs

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncPushChannel:
    """Front-end sender; sending never blocks the event loop (PUSH queues while the peer is busy)."""

    def __init__(self, addr: str, bind: bool = False, ctx: zmq.asyncio.Context | None = None) -> None:
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self._ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)

    def send_nowait(self, obj: Any) -> None:
        # A PUSH socket with a connected peer accepts NOBLOCK sends until its high-water mark.
        self.sock.send(_dumps(obj), flags=zmq.NOBLOCK, copy=False)

    async def send(self, obj: Any) -> None:
        await self.sock.send(_dumps(obj), copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncPullChannel:
    """Front-end receiver, awaited by one background task."""

    def __init__(self, addr: str, bind: bool = True, ctx: zmq.asyncio.Context | None = None) -> None:
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = self._ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)

    async def recv(self) -> Any:
        return pickle.loads(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
