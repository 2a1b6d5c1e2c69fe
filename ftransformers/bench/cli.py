"""`ftransformers bench` (and `python -m ftransformers.bench`): measure a running OpenAI-compatible server.

`ftransformers bench report DIR [DIR...]` re-renders runs (ftransformers.bench.report).
Every failure a user can cause ends with one `error:` line on stderr and a non-zero status, after the
output folder has been written with whatever completed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ftransformers.bench.client import API_KINDS, BenchClient
from ftransformers.bench.environment import ServerError, environment, probe_server, resolve_model, tool_version
from ftransformers.bench.matrix import PlanItem, seed_matrix, split_by_context
from ftransformers.bench.prefix_check import describe, prefix_cache_check
from ftransformers.bench.prompts import PromptError, PromptFactory, load_jsonl, load_tokenizer
from ftransformers.bench.records import MaxConcurrencyResult
from ftransformers.bench.runner import BenchAbort, RecordSink, Runner
from ftransformers.bench.search import CRITERIA, find_max_concurrency
from ftransformers.bench.soak import soak


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ftransformers bench", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--base-url", default="http://127.0.0.1:8001", help="server root (default %(default)s)")
    a("--model", help="served model name (default: the first one /v1/models lists)")
    a("--api", choices=API_KINDS, default="openai-chat", help="endpoint to load (default %(default)s)")
    a("--api-key", help="sent as a Bearer token")
    a("--tokenizer-path", help="tokenizer for exact-length prompts (default: the server's /get_model_info)")
    a("--input-length", type=int, nargs="+", default=[128], help="prompt tokens, a list (default 128)")
    a("--output-length", type=int, nargs="+", default=[128], help="output tokens, a list (default 128)")
    a("--parallel", type=int, nargs="+", help="concurrencies, closed loop (default 1)")
    a("--number", type=int, nargs="+", help="requests per concurrency, one per --parallel (default 4x, at least 4)")
    a("--warmup", type=int, default=1, help="unrecorded requests before each input/output pair (default 1)")
    a("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    a("--dataset", choices=("random", "jsonl"), default="random")
    a("--dataset-path", help="JSONL file of prompts for --dataset jsonl")
    a("--prefix-length", type=int, default=0, help="tokens of a random prefix shared by every prompt")
    a("--random-range-ratio", type=float, default=1.0,
      help="random prompts: each request's input and output lengths uniform in [ratio x the length, the length] "
           "(SGLang's flag; default 1: every request exactly the lengths)")
    a("--no-fixed-output", dest="fixed_output", action="store_false",
      help="let requests stop at EOS (default: ignore_eos + min_tokens fix the output length)")
    a("--find-max-concurrency", action="store_true", help="search the largest concurrency holding --min-tps")
    a("--min-tps", type=float, default=15.0, help="per-request tok/s bar of the search (default 15)")
    a("--tps-criterion", choices=CRITERIA, default="mean",
      help="per-request TPS statistic that must reach --min-tps, with no failed request (default mean)")
    a("--max-concurrency-limit", type=int, default=512, help="stop the search's doubling here (default 512)")
    a("--matrix", choices=("seed",), help="SPEC §4 test matrix (lengths beyond the context are skipped)")
    a("--prefix-cache-check", action="store_true", help="the same long prompt twice: cold vs warm TTFT")
    a("--prefix-check-length", type=int, help="prompt tokens of the check (default max(--input-length, 1024))")
    a("--duration", type=float, help="soak: run this many seconds at the first --parallel value")
    a("--soak-interval", type=float, help="seconds per soak interval (default duration/20, at least 1)")
    a("--baseline", help="summary.json of another run, or a CSV/JSON table of a competitor, to compare against")
    a("--output", help="output folder (default ./bench-results/<timestamp>)")
    a("--request-timeout", type=float, default=600.0, help="seconds per request (default %(default)s)")
    a("--extra-request-body", type=_json_object, default={}, metavar="JSON",
      help='a JSON object merged into every request body, over the defaults (for --api generate into its '
           'sampling_params), e.g. \'{"temperature": 1.0}\' (default: greedy)')
    a("--progress", action=argparse.BooleanOptionalAction, default=None,
      help="live progress bar (default: when stderr is a terminal)")
    return p


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {type(value).__name__}")
    return value


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("input_length", "output_length", "parallel", "number"):
        if any(v < 1 for v in getattr(args, name) or []):
            p.error(f"--{name.replace('_', '-')} values must be >= 1")
    if args.number and len(args.number) != len(args.parallel or [1]):
        p.error(f"--number has {len(args.number)} values for {len(args.parallel or [1])} --parallel values")
    if args.dataset == "jsonl" and not args.dataset_path:
        p.error("--dataset jsonl needs --dataset-path")
    if args.duration is not None and args.duration <= 0:
        p.error("--duration must be > 0")
    if args.warmup < 0 or args.prefix_length < 0 or args.request_timeout <= 0 or args.min_tps <= 0:
        p.error("--warmup and --prefix-length must be >= 0, --request-timeout and --min-tps > 0")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        p.error("--random-range-ratio must be in [0, 1]")
    if args.random_range_ratio < 1.0 and args.dataset != "random":
        p.error("--random-range-ratio applies to --dataset random only")
    if args.prefix_length and any(args.prefix_length >= n for n in args.input_length):
        p.error("--prefix-length must be shorter than every --input-length")


def default_number(concurrency: int) -> int:
    return max(4, 4 * concurrency)


def plan(args: argparse.Namespace) -> list[PlanItem]:
    if args.matrix == "seed":
        return seed_matrix()
    inputs = [0] if args.dataset == "jsonl" else args.input_length
    items: list[PlanItem] = []
    if args.parallel or not args.find_max_concurrency:
        par = tuple(args.parallel or [1])
        numbers = tuple(args.number or [default_number(c) for c in par])
        items += [PlanItem(i, o, par, numbers) for i in inputs for o in args.output_length]
    if args.find_max_concurrency:
        items += [PlanItem(i, o) for i in inputs for o in args.output_length]
    return items


class Session:
    """One `ftransformers bench` run: what it measured so far, written out whatever happens."""

    def __init__(self, args: argparse.Namespace, argv: list[str], out: Path) -> None:
        self.args, self.out = args, out
        config = {k: v for k, v in vars(args).items()}
        if config.get("api_key"):
            config["api_key"] = "***"
        self.summary: dict[str, Any] = {
            "tool": {"name": "ftransformers bench", "version": tool_version()},
            "command": ["ftransformers", "bench", *argv], "created": dt.datetime.now().astimezone().isoformat(),
            "environment": None, "config": config, "points": [], "max_concurrency": [], "prefix_cache_check": None,
            "soak": None, "notes": [], "baseline": str(Path(args.baseline).resolve()) if args.baseline else None,
        }
        self.runner: Runner | None = None
        self.skipped_all = False
        self.context: int | None = None

    async def run(self) -> None:
        args = self.args
        facts = probe_server(args.base_url, args.api_key, timeout=min(args.request_timeout, 30.0))
        model = resolve_model(args.model, facts, args.base_url)
        self.summary["config"]["model"] = model
        tok_path = args.tokenizer_path or facts.tokenizer_path
        self.summary["environment"] = environment(facts, tok_path)
        if tok_path is None:
            raise PromptError(f"the server at {args.base_url} does not name its tokenizer (no /get_model_info); "
                              "pass --tokenizer-path")
        if args.tokenizer_path is None and not Path(tok_path).exists():
            raise PromptError(f"the server's tokenizer path {tok_path!r} is not on this machine; pass --tokenizer-path")
        factory = PromptFactory(load_tokenizer(tok_path), args.api, args.seed)
        dataset = load_jsonl(args.dataset_path) if args.dataset == "jsonl" else None
        client = BenchClient(args.base_url, model, args.api, args.api_key, args.request_timeout, args.fixed_output,
                             factory.count_output, extra_body=args.extra_request_body)
        progress = sys.stderr.isatty() if args.progress is None else args.progress
        sink = RecordSink(self.out / "requests.jsonl")
        self.runner = runner = Runner(client, factory, sink, dataset, prefix_len=args.prefix_length, warmup=args.warmup,
                                      range_ratio=args.random_range_ratio, progress=progress,
                                      notes=self.summary["notes"])  # fmt: skip
        runner.points = self.summary["points"]  # shared: a failure midway still leaves the finished points
        try:
            await self._measure(runner, facts.context_length)
        finally:
            sink.close()
            await client.aclose()

    async def _measure(self, runner: Runner, context: int | None) -> None:
        args, notes = self.args, self.summary["notes"]
        if args.prefix_cache_check:
            n = args.prefix_check_length or max(max(args.input_length), 1024)
            if context is not None and n + 8 > context:
                notes.append(f"prefix-cache check shortened from {n} to {context - 8} tokens (context {context})")
                n = context - 8
            result = await prefix_cache_check(runner.client, runner.factory, n, runner.sink)
            self.summary["prefix_cache_check"] = result
            print(describe(result), flush=True)
        if args.duration is not None:
            c, i, o = (args.parallel or [1])[0], args.input_length[0], args.output_length[0]
            if not self._fits([PlanItem(i, o)], context):
                return
            interval = args.soak_interval or max(1.0, args.duration / 20)
            self.summary["soak"] = await soak(runner, i, o, c, args.duration, interval)
        # --duration uses --parallel for the soak; --prefix-cache-check alone runs only the check
        sweep = args.matrix or args.find_max_concurrency or (args.duration is None and (
            args.parallel or not args.prefix_cache_check))
        if not sweep:
            return
        items = plan(args)
        if args.dataset != "jsonl":
            items = self._fits(items, context)
        for it in items:
            if it.search:
                res = await find_max_concurrency(runner, it.input_len, it.output_len, args.min_tps, args.tps_criterion,
                                                 default_number, args.max_concurrency_limit)
                self.summary["max_concurrency"].append(res)
                print(_describe_search(res), flush=True)
            else:
                for c, n in zip(it.parallel, it.numbers or [default_number(c) for c in it.parallel]):
                    await runner.run_point(it.input_len, it.output_len, c, n)

    def _fits(self, items: list[PlanItem], context: int | None) -> list[PlanItem]:
        self.context = context
        kept, skipped = split_by_context(items, context)
        self.summary["notes"].extend(skipped)
        for line in skipped:
            print(f"note: {line}", file=sys.stderr)
        if items and not kept:
            self.skipped_all = True
        return kept

    def write(self) -> None:
        s = dict(self.summary)
        s["points"] = [asdict(p) for p in s["points"]]
        s["max_concurrency"] = [asdict(m) if isinstance(m, MaxConcurrencyResult) else m for m in s["max_concurrency"]]
        (self.out / "summary.json").write_text(json.dumps(s, indent=2, default=str) + "\n")
        (self.out / "requests.jsonl").touch()

    def failure(self) -> str | None:
        """Why nothing was measured, or None when something was."""
        points, s = self.summary["points"], self.summary
        if any(p.successes for p in points):
            return None
        if s["soak"] and s["soak"]["successes"] or s["prefix_cache_check"] and s["prefix_cache_check"]["warm"]["success"]:
            return None
        if self.skipped_all:
            return f"nothing was measured: every input/output pair exceeds the server's context length {self.context}"
        errors: dict[str, int] = {}
        for p in points:
            for msg, n in p.errors.items():
                errors[msg] = errors.get(msg, 0) + n
        if errors:
            top = max(errors, key=lambda k: errors[k])
            return f"nothing was measured: all {sum(errors.values())} requests failed (most common: {top})"
        check = s["prefix_cache_check"]
        if check:
            return f"nothing was measured: the prefix-cache check failed ({check['cold']['error']})"
        return "nothing was measured"


def _describe_search(res: MaxConcurrencyResult) -> str:
    found = "none" if res.max_concurrency is None else str(res.max_concurrency)
    return (f"max concurrency in={res.input_len} out={res.output_len} at >= {res.min_tps:g} tok/s "
            f"({res.criterion}): {found}" + (f" ({res.note})" if res.note else ""))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "report":
        from ftransformers.bench.report import report_main

        return report_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    out = Path(args.output or Path("bench-results") / dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"error: cannot create the output folder {out}: {exc}", file=sys.stderr)
        return 1
    session = Session(args, argv, out)
    fatal: str | None = None
    try:
        if args.baseline:
            from ftransformers.bench.baseline import BaselineError, load_baseline

            try:
                load_baseline(args.baseline)
            except BaselineError as exc:
                raise PromptError(str(exc)) from exc
        asyncio.run(session.run())
    except (ServerError, PromptError, BenchAbort) as exc:
        fatal = str(exc)
    except KeyboardInterrupt:
        fatal = "interrupted; the folder holds what completed"
    fatal = fatal or session.failure()
    if fatal:  # the report's notes say why the run stopped or measured nothing, as the error line does
        session.summary["notes"].append(f"error: {fatal}")
    session.write()
    from ftransformers.bench.report import ReportError, render_report

    try:
        render_report(out)
    except (ReportError, OSError, ValueError) as exc:
        print(f"warning: the report could not be rendered: {exc}", file=sys.stderr)
    print(f"results: {out.resolve()}", flush=True)
    if fatal:
        print(f"error: {fatal}", file=sys.stderr)
        return 1
    return 0
