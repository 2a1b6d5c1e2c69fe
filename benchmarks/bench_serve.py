"""The OpenAI server end to end on dummy weights of a real model shape, beside the engine's own decode step and its
floor: what a user of `ftransformers serve` sees, and what the HTTP front end, the tokenizer manager and the
scheduler process cost on top of the engine.

In one process, in order:
1. `ftransformers serve` on a checkpoint folder with bench_decode's config of `--model` (model_shapes.py) and the
   tokenizer files of `--tokenizer`, `--load-format dummy`, in its own process; its start (load, kernel compiles,
   graph capture) is timed to its first healthy /health.
2. `/start_profile` for a few steps around one request, and the trace it writes (issue 4's profiling).
3. `ftransformers bench` (its own process, the client a user runs) at `--parallel` concurrencies, `--input-length`
   prompt tokens, `--output-length` output tokens (ignore_eos), through `--api` (completions by default: see its
   help), `--passes` times, each pass with its own prompt seed (no pass hits another's prompts in the prefix cache).
4. The server stops; its periodic step lines (`--log-interval-s`) are kept.
5. The engine alone in this process on the same config: bench_decode's engine rows (the `Scheduler` loop with
   overlap, steady decode steps of B sequences at the points' middle context) and their floor (bytes / the copy
   rate measured here). The server's per-token time at concurrency B is set beside that step.

At concurrency 1 the server's TPOT and the engine's step time measure the same decode; their difference is what
serving costs per token. At higher concurrency the closed loop's new requests prefill between decodes, so TPOT is
above the step time by that prefill share; the inter-token latency's median is the step the decodes saw.

    python benchmarks/make_qwen3_tokenizer.py --out .tok/qwen3   # here; carry .tok
    # the device image lacks the server's packages: wheels fetched here, carried as .whl (both git-excluded)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl fastapi==0.165.0 uvicorn==0.54.0 \
        pydantic==2.14.4 pydantic_core==2.50.5 starlette==1.10.0 pyzmq==27.3.0 orjson==3.13.0 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing_extensions==4.16.0 opentelemetry-api==1.45.2
    # there, first: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    #               export PYTHONPATH=/tmp/site:$PWD
    PYTHONPATH=$PWD python benchmarks/bench_serve.py --out $OUT/serve_30b.json --model qwen3-30b-a3b:48 \
        --tokenizer .tok/qwen3 --parallel 1,8,32 [--format w4a16]

The tokenizer must have an id for every id the config's vocabulary holds: dummy weights sample any of them, and an
id a tokenizer lacks detokenizes to nothing, so a stream goes tokens without content and its TTFT and inter-token
latency stop meaning anything (make_qwen3_tokenizer.py says what that did). Output tokens are counted from the
server's usage either way.
`--dry-run`: a CPU smoke test (widths shrunk 16x, vocabulary set to the tokenizer's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decode
import bench_quant_decode
from model_shapes import model_spec

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"{}")


def checkpoint(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """bench_decode's config of --model at its depth, with --tokenizer's files beside it."""
    name, layers = model_spec(args.model)
    cfg = bench_quant_decode.write_config(name, layers, root, args.format, args.dry_run)
    found = [f for f in TOKENIZER_FILES if (Path(args.tokenizer) / f).exists()]
    if "tokenizer.json" not in found:
        raise SystemExit(f"bench_serve: no tokenizer.json in {args.tokenizer}")
    for f in found:
        shutil.copy(Path(args.tokenizer) / f, root / f)
    if args.dry_run:  # shrunk widths: the vocabulary must still cover the tokenizer's prompts
        from transformers import AutoTokenizer

        cfg["vocab_size"] = len(AutoTokenizer.from_pretrained(str(root)))
        (root / "config.json").write_text(json.dumps(cfg))
    return cfg


def start_server(args: argparse.Namespace, root: Path, port: int, log: Path, prof: Path) -> tuple[Any, float]:
    cmd = [sys.executable, "-m", "ftransformers", "serve", "--model-path", str(root), "--load-format", "dummy",
           "--port", str(port), "--log-interval-s", str(args.log_interval), "--profile-dir", str(prof),
           "--cuda-graph-max-bs", str(max(args.parallel)), *args.server_args.split()]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    while time.perf_counter() - t0 < args.start_timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was healthy (see {log})")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"the server was not healthy within {args.start_timeout} s (see {log})")


def stop_server(proc: Any) -> int | None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def profile_once(base: str, prof: Path, steps: int) -> dict[str, Any]:
    """/start_profile for `steps` model steps, one short request to fill them, and the trace that lands."""
    started = http(f"{base}/start_profile", {"num_steps": steps})
    http(f"{base}/v1/completions", {"prompt": "The capital of France is", "max_tokens": steps + 4, "ignore_eos": True})
    deadline = time.perf_counter() + 60
    traces: list[Path] = []
    while time.perf_counter() < deadline and not traces:
        traces = sorted(prof.glob("*.trace.json*"))
        time.sleep(0.5)
    return {"start_answer": started, "traces": [{"name": t.name, "bytes": t.stat().st_size} for t in traces]}


def run_bench(args: argparse.Namespace, base: str, out_dir: Path, seed: int) -> dict[str, Any]:
    """One `ftransformers bench` run; each pass its own prompt seed, so no pass finds another's prompts cached."""
    cmd = [sys.executable, "-m", "ftransformers.bench", "--base-url", base, "--api", args.api,
           "--input-length", str(args.input_length), "--output-length", str(args.output_length),
           "--parallel", *map(str, args.parallel), "--number", *map(str, args.number), "--warmup", "2",
           "--seed", str(seed), "--output", str(out_dir), "--no-progress"]  # fmt: skip
    if args.random_range_ratio < 1.0:
        cmd += ["--random-range-ratio", str(args.random_range_ratio)]
    if args.temperature:
        cmd += ["--extra-request-body", json.dumps({"temperature": args.temperature})]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout, check=False)
    print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", flush=True)
    summary = out_dir / "summary.json"
    if not summary.exists():
        raise RuntimeError(f"ftransformers bench wrote no summary (exit {done.returncode}): {done.stderr[-500:]}")
    return {"command": cmd, "exit": done.returncode, "summary": json.loads(summary.read_text())}


def engine_peer(args: argparse.Namespace, root: Path, cfg: dict[str, Any], ctx: int) -> dict[str, Any]:
    """bench_decode's engine rows (overlap on) at B = each concurrency, decoding from `ctx`, and their floors."""
    bench_decode.DEV = "cpu" if args.dry_run else "cuda"
    if args.temperature:  # the engine rows sample as the server's requests did
        bench_decode.ENGINE_SAMPLING["temperature"] = args.temperature
    ceil = bench_decode.ceilings()
    ns = argparse.Namespace(mem_fraction=0.9)
    runner = bench_decode.make_runner(root, max(args.parallel), ns, ctx + args.output_length + 1024)
    _, layers = model_spec(args.model)
    # bf16: bench_decode's floor (issue 4's tables); a quantized format: bench_quant_decode's, from the bytes held
    acct = bench_decode if args.format == "bf16" else bench_quant_decode
    acc = acct.accounting(runner.model, cfg, layers)
    mid = ctx + bench_decode.ENGINE_NEW_TOKENS // 2
    rows = []
    for b in args.parallel:
        steps = bench_decode.engine_steps_ms(runner, cfg["vocab_size"], b, ctx, overlap=True)
        floor = acct.decode_bytes(acc, b, mid) / (ceil["copy_GBps"] * 1e9) * 1e3
        ms = statistics.median(steps) if steps else None
        rows.append({"batch": b, "context": ctx, "engine_overlap_ms": ms, "floor_ms": floor,
                     "ratio": ms / floor if ms else None})  # fmt: skip
        print(f"engine B={b} ctx {ctx}: {ms} ms a step, floor {floor:.3f} ms", flush=True)
    return {"ceilings": ceil, "rows": rows}


def _f(x: float | None, spec: str = ".3f") -> str:
    return format(x, spec) if x is not None else "-"


def table(res: dict[str, Any]) -> list[str]:
    """One row a (pass, concurrency): the server's medians (TTFT also its worst) beside the engine's step and floor."""
    eng = {r["batch"]: r for r in res.get("engine", {}).get("rows", [])}
    lines = [
        ("| pass | concurrency | TPOT ms (median) | ITL ms (median) | TTFT s (median / max) | output tok/s | "
        "engine step ms | floor ms | TPOT / engine step | TPOT / floor |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for k, run in enumerate(res.get("bench_passes", []), 1):
        for p in run.get("summary", {}).get("points", []):
            e = eng.get(p["concurrency"], {})
            tpot, step, floor = p["tpot_ms"].get("p50"), e.get("engine_overlap_ms"), e.get("floor_ms")
            lines.append(f"| {k} | {p['concurrency']} ({p['successes']}/{p['number']} ok) | {_f(tpot)} | "
                         f"{_f(p['itl_ms'].get('p50'))} | {_f(p['ttft_s'].get('p50'))} / {_f(p['ttft_s'].get('max'))} | "
                         f"{_f(p['output_throughput'], '.1f')} | {_f(step)} | {_f(floor)} | "
                         f"{_f(tpot / step if tpot and step else None, '.2f')} | "
                         f"{_f(tpot / floor if tpot and floor else None, '.2f')} |")  # fmt: skip
    return lines


def compile_lines(lines: list[str]) -> tuple[list[str], int]:
    """compile_log's lines of a server log (the count before ready, and each compile a step waited for while
    serving) and how many of them are the latter."""
    kept = [ln for ln in lines if "before ready:" in ln or "while serving" in ln]
    return kept, sum("while serving" in ln for ln in kept)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="qwen3-30b-a3b:48", help="NAME[:LAYERS] of model_shapes.py")
    p.add_argument(
        "--format",
        default="bf16",
        choices=tuple(bench_quant_decode.FORMATS),
        help="weight format: bench_quant_decode's quantization_config of that name",
    )
    p.add_argument("--tokenizer", required=True, help="folder with tokenizer.json (and its config, chat template)")
    p.add_argument("--parallel", default="1,8,32")
    p.add_argument("--number", default="", help="requests per concurrency (default max(8, 2 x concurrency))")
    p.add_argument("--input-length", type=int, default=512)
    p.add_argument("--output-length", type=int, default=256)
    # completions by default: under a chat template every prompt ends in the same tokens, and a dummy model's greedy
    # tokens then agree across sequences at every step (a 4-layer shrunk Qwen3-MoE on the CPU: 8 of 8 sequences, 32
    # of 32 steps; raw text: 8 distinct), so a batch reads the experts of one sequence
    p.add_argument("--api", default="openai-completions", choices=("openai-chat", "openai-completions", "generate"))
    p.add_argument("--server-args", default="", help="more `ftransformers serve` options, one string")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample the requests (and the engine rows) at this temperature (default 0: greedy, the "
        "bench's default; greedy tokens of dummy weights can converge across sequences)",
    )
    p.add_argument("--passes", type=int, default=1, help="run the bench this many times on the same server")
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="the bench's: each request's lengths uniform in [ratio x the lengths, the lengths] (varied "
                   "step shapes, e.g. to look for kernels the warmup missed; the TPOT then no longer compares with "
                   "the engine rows)")  # fmt: skip
    p.add_argument("--log-interval", type=float, default=5.0)
    p.add_argument("--profile-steps", type=int, default=8, help="0: no /start_profile")
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--bench-timeout", type=float, default=420.0)
    p.add_argument("--no-engine", action="store_true", help="skip the engine rows (step 5)")
    p.add_argument("--dry-run", action="store_true", help="CPU smoke test: shapes shrunk 16x")
    args = p.parse_args()
    args.parallel = [int(x) for x in args.parallel.split(",")]
    args.number = [int(x) for x in args.number.split(",")] if args.number else [max(8, 2 * c) for c in args.parallel]
    if len(args.number) != len(args.parallel) or min(args.parallel + args.number) < 1:
        raise SystemExit("bench_serve: --number takes one positive count per --parallel value")
    if args.passes < 1:
        raise SystemExit("bench_serve: --passes must be at least 1")

    work = Path(tempfile.mkdtemp(prefix="bench_serve_"))
    root, prof, log = work / "model", work / "profiles", args.out.with_suffix(".server.log")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cfg = checkpoint(args, root)
    res: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "config": cfg}  # fmt: skip
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = None
    try:
        proc, res["server_start_s"] = start_server(args, root, port, log, prof)
        print(f"server healthy after {res['server_start_s']:.1f} s", flush=True)
        res["server_info"] = http(f"{base}/server_info")
        if args.profile_steps:
            res["profile"] = profile_once(base, prof, args.profile_steps)
            print("profile", res["profile"], flush=True)
        res["bench_passes"] = []
        for k in range(args.passes):  # the same points again on the same server: what a warm server gives
            res["bench_passes"].append(run_bench(args, base, work / f"bench{k + 1}", seed=k))
        res["health_after"] = http(f"{base}/health", timeout=10) if proc.poll() is None else None
    except Exception as e:  # noqa: BLE001 - keep what was measured, say what failed
        res["error"] = f"{type(e).__name__}: {e}"[:1000]
        print("error:", res["error"], flush=True)
    finally:
        if proc is not None:
            res["server_exit"] = stop_server(proc)
    if log.exists():
        lines = log.read_text().splitlines()
        res["step_lines"] = [ln for ln in lines if "Step stats" in ln]
        res["compile_lines"], res["compiles_while_serving"] = compile_lines(lines)
    args.out.write_text(json.dumps(res, indent=1))
    if not args.no_engine and res.get("bench_passes"):
        # the engine's steps are centred on the points' middle context, never below the prompt
        ctx = max(args.input_length, args.input_length + args.output_length // 2 - bench_decode.ENGINE_NEW_TOKENS // 2)
        res["engine"] = engine_peer(args, root, cfg, ctx)
    res["table"] = table(res)
    args.out.write_text(json.dumps(res, indent=1))
    print("\n".join(res["table"]), flush=True)
    print("\n".join(res.get("compile_lines", [])), flush=True)
    if "error" in res:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
