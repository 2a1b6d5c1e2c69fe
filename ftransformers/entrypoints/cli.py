"""`ftransformers` command line: `ftransformers serve [flags]` (and `python -m ftransformers.launch_server`).

Every failure a user can cause (bad flag value, missing model folder, unreadable checkpoint) ends
the command with a non-zero status and one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ftransformers.config.server_args import ServerArgs, ServerArgsError


class CLIError(RuntimeError):
    """A user-facing failure; main() prints it as one line and exits 1."""


def resolve_model_path(args: ServerArgs) -> ServerArgs:
    """Fill in the demo model when no --model-path was given, and a served name from the folder."""
    from pathlib import Path

    if args.model_path is None:
        from ftransformers.entrypoints.demo_model import DemoModelError, ensure_demo_model

        try:
            path = ensure_demo_model()
        except DemoModelError as exc:
            raise CLIError(str(exc)) from exc
        args = args.replace(model_path=str(path))
    if args.served_model_name is None:
        args = args.replace(served_model_name=Path(args.model_path).resolve().name or args.model_path)
    return args


def build_serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    ServerArgs.add_cli_args(parser)
    return parser


def serve(argv: Sequence[str] | None, prog: str = "ftransformers serve") -> int:
    parser = build_serve_parser(argparse.ArgumentParser(prog=prog, description="Start the OpenAI-compatible server."))
    ns = parser.parse_args(argv)
    try:
        args = resolve_model_path(ServerArgs.from_cli_args(ns))
        if args.skip_tokenizer_init:
            raise CLIError("--skip-tokenizer-init is for the offline engine; the server needs a tokenizer")
        from ftransformers.config.model_config import ModelConfig, ModelConfigError

        try:
            ModelConfig.from_server_args(args)  # fail fast, before any process starts
        except ModelConfigError as exc:
            raise CLIError(str(exc)) from exc
    except (ServerArgsError, CLIError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        from ftransformers.entrypoints.launch_server import launch_server
    except ImportError as exc:
        print(f"error: the server needs extra packages ({exc.name}): pip install 'ftransformers[server]'", file=sys.stderr)
        return 1
    launch_server(args)
    return 0


def bench_main(argv: Sequence[str]) -> int:
    from ftransformers.bench.cli import main as bench

    return bench(argv)


def quantize_main(argv: Sequence[str]) -> int:
    from ftransformers.entrypoints.quantize import main as quantize

    return quantize(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"serve": serve, "bench": bench_main, "quantize": quantize_main}
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ftransformers {serve,bench,quantize} [flags]\n\n"
              "  serve     start the OpenAI-compatible server (demo model when no --model-path)\n"
              "  bench     measure a running OpenAI-compatible server (`bench report DIR...` re-renders runs)\n"
              "  quantize  write a quantized checkpoint (--method awq, gptq, rtn-int4, mxfp4, nvfp4, fp8, w8a8-int8)")
        return 0 if argv else 2
    command = commands.get(argv[0])
    if command is None:
        print(f"error: unknown command {argv[0]!r}; valid: {', '.join(commands)}", file=sys.stderr)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
