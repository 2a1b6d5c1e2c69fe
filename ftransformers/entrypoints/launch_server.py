"""Process layout of the server: the scheduler/model in a spawned child, HTTP + tokenizer in this one.

    main process: uvicorn -> FastAPI app -> TokenizerManager --zmq--> scheduler process
                                                              <--zmq--
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence
from typing import Any

from ftransformers.config.server_args import ServerArgs, ServerArgsError

logger = logging.getLogger("ftransformers.server")


class LaunchError(RuntimeError):
    """Startup failed; the message is one line for the user."""


class SchedulerHandle:
    """The spawned scheduler process and its two ipc addresses."""

    def __init__(self, server_args: ServerArgs) -> None:
        from ftransformers.entrypoints.scheduler_process import run_scheduler_process
        from ftransformers.ipc.zmq_channel import ipc_addr, make_ipc_dir

        self.ipc_dir = make_ipc_dir()
        self.in_addr, self.out_addr = ipc_addr(self.ipc_dir, "sched_in"), ipc_addr(self.ipc_dir, "sched_out")
        ctx = mp.get_context("spawn")
        self._ready_recv, ready_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_scheduler_process, name="ftransformers-scheduler", daemon=True,
            args=(server_args, server_args.model_path, self.in_addr, self.out_addr, ready_send),
        )
        self.proc.start()
        ready_send.close()

    def wait_ready(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready_recv.poll(0.2):
            if not self.proc.is_alive():
                raise LaunchError(f"the model process exited during startup (exit code {self.proc.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"the model process was not ready after {timeout:.0f} s")
        try:
            msg = self._ready_recv.recv()
        except EOFError:
            raise LaunchError("the model process exited during startup") from None
        if msg.get("status") != "ok":
            raise LaunchError(msg.get("error") or "the model process failed to start")
        return msg

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def shutdown(self) -> None:
        from ftransformers.ipc.zmq_channel import remove_ipc_dir

        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
        remove_ipc_dir(self.ipc_dir)


def build_app(server_args: ServerArgs, timeout: float | None = None) -> tuple[Any, SchedulerHandle]:
    """Start the scheduler process and build the app; raises LaunchError with a one-line message."""
    from ftransformers.entrypoints.http_server import create_app
    from ftransformers.entrypoints.metrics import ServerMetrics
    from ftransformers.entrypoints.tokenizer_manager import TokenizerManager, load_tokenizer

    handle = SchedulerHandle(server_args)
    try:
        tokenizer, tok_error = None, None
        try:  # loads while the model process starts
            tokenizer = load_tokenizer(server_args)
        except Exception as exc:
            tok_error = " ".join(str(exc).split()) or type(exc).__name__
        info = handle.wait_ready(timeout)
        if tokenizer is None:
            raise LaunchError(f"cannot load the tokenizer from {server_args.tokenizer_path or server_args.model_path}: "
                              f"{tok_error}")
        served = server_args.served_model_name or server_args.model_path or "default"
        metrics = ServerMetrics(served) if server_args.enable_metrics else None
        tm = TokenizerManager(server_args, tokenizer, info, handle.in_addr, handle.out_addr, metrics, handle.is_alive)
        return create_app(server_args, tm, metrics), handle
    except BaseException:
        handle.shutdown()
        raise


def launch_server(server_args: ServerArgs) -> None:
    """Run the server until interrupted. Startup failures print one line `error: ...` and exit 1."""
    import uvicorn

    logging.basicConfig(level=server_args.log_level.upper(), format="[%(asctime)s] %(message)s")
    try:
        app, handle = build_app(server_args)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    try:
        logger.info("serving %s on http://%s:%d", server_args.model_path, server_args.host, server_args.port)
        uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        handle.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Bare entry (no demo-model resolution): `python -m ftransformers.entrypoints.launch_server --model-path DIR`."""
    parser = argparse.ArgumentParser(prog="ftransformers.entrypoints.launch_server")
    ServerArgs.add_cli_args(parser)
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
        if args.model_path is None:
            raise ServerArgsError("--model-path is required")
    except ServerArgsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    launch_server(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
