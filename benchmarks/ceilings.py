"""The device ceilings every benchmark's floors divide by: copy bandwidth and dense matmul rate.

One measurement for every script; they used to carry eight variants (512 MiB or 1 GiB, Triton's
do_bench, a CUDA graph, or wall clock), and one of them was wrong by a fifth: a `copy_` captured into
a CUDA graph (`do_bench_cudagraph`, used by bench_w4a16.py and bench_gemv.py) becomes a graph memcpy
node and ran at 2433 GB/s on the H100, against 3001 GB/s for the same copy launched as a kernel
(`python benchmarks/ceilings.py` prints both). Kernels read memory through the SMs, so their floor is
the kernel copy's rate; dividing by the graph-node figure made every "% of copy bandwidth" 1.23x too
high. Here each ceiling is timed with CUDA events (`triton.testing.do_bench`, median, its own warm-up
and L2 flush between calls) and is the best of `TRIALS` such medians: the rate the hardware
demonstrably sustains, so that a floor is reachable rather than flattering. On the CPU (dry runs)
wall-clock medians stand in.

Also shared here: `Report` (a result file's header and log lines) and `graph_ms` (a kernel's time per call from one
CUDA graph of calls), so that scripts comparing each other's figures time them the same way; `module_settings`,
`set_module_values` and `module_values`, the benches' `NAME=V[+NAME=V]` settings of a kernel module's knobs, parsed
and applied (V an integer, or a decimal for a float value; ab_decode.py's `set=` goes through them too).

    PYTHONPATH=$PWD python benchmarks/ceilings.py   # every former method beside this one
"""

from __future__ import annotations

import contextlib
import datetime
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

TRIALS = 5
# On the CPU, a call slower than SLOW_CALL_MS is timed as the best of CPU_TRIALS medians of CPU_REPS calls: a bf16
# 1024^3 matmul takes 2.5 s on this project's 2-core machine, and TRIALS medians of 20 calls took 280 s of
# bench_cpu_decode's and bench_serve --dry-run's test time. Faster calls keep TRIALS medians of 20.
SLOW_CALL_MS, CPU_REPS, CPU_TRIALS = 500.0, 3, 2


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], device: str, reps: int = 20) -> float:
    """Median wall ms of fn over `reps` synchronised calls (2 unmeasured calls first)."""
    for _ in range(2):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def best_rate(amount: float, fn: Callable[[], Any], device: str) -> float:
    """amount / ms at the best of TRIALS medians: CUDA-event timed on a GPU, wall clock on the CPU (where a call
    slower than SLOW_CALL_MS takes CPU_TRIALS medians of CPU_REPS calls)."""
    if device.startswith("cuda"):
        from triton.testing import do_bench

        return max(amount / do_bench(fn, return_mode="median") for _ in range(TRIALS))
    slow = median_ms(fn, device, 1) > SLOW_CALL_MS
    reps, trials = (CPU_REPS, CPU_TRIALS) if slow else (20, TRIALS)
    return max(amount / median_ms(fn, device, reps) for _ in range(trials))


def copy_bandwidth(device: str = "cuda") -> float:
    """GB/s (bytes read + written) of a device-to-device copy of random bf16 data: 1 GiB on a GPU."""
    n = 1 << 29 if device.startswith("cuda") else 1 << 24
    src = torch.rand(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return best_rate(2 * 2 * n / 1e6, lambda: dst.copy_(src), device)


def matmul_rate(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, size: int = 8192) -> float:
    """TFLOP/s of a square `size` matmul in `dtype`; on the CPU (1024 square) the faster of `dtype` and float32.

    A CPU without native bf16 (AVX2 only, as this project's 2-core AMD machine) ran a bf16 1024^3 matmul at 0.8
    GFLOP/s against 83 in float32, while a bf16 model's own products there ran faster than 0.8: the bf16 figure alone
    put bench_cpu_decode's FLOP floor at 316.6 ms over a measured token of 57.3. On such a CPU a bf16 call slower
    than half the float32 rate is timed once (it cannot be the faster), not in CPU_TRIALS medians (35 s a test)."""
    if device.startswith("cuda"):
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        return best_rate(2 * size**3 / 1e9, lambda: a @ b, device)
    s, rates = 1024, []
    for dt in dict.fromkeys((torch.float32, dtype)):
        a, b = (torch.randn(s, s, device=device, dtype=dt) for _ in range(2))
        t0 = time.perf_counter()
        a @ b
        once = 2 * s**3 / 1e9 / ((time.perf_counter() - t0) * 1e3)  # the first call's rate: a lower bound
        rates.append(
            once if rates and once < rates[0] / 2 else best_rate(2 * s**3 / 1e9, lambda a=a, b=b: a @ b, device)
        )
    return max(rates)


def graph_ms(fn: Callable[[int], Any], reps: int, warm_calls: int | None = None, warmup_ms: int = 25,
             rep_ms: int = 100) -> float:  # fmt: skip
    """Median ms per call of fn(i), i < reps, all captured in one CUDA graph whose replay Triton's do_bench times
    (warmup_ms / rep_ms, its defaults here). warm_calls: eager calls before the capture (compiles, allocator
    warm-up); all `reps` when None. The benchmarks' shared graph timer (a GPU is needed)."""
    from triton.testing import do_bench

    for i in range(reps if warm_calls is None else min(reps, warm_calls)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    return do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median") / reps


def ceilings(device: str = "cuda") -> dict[str, float]:
    return {"copy_GBps": copy_bandwidth(device), "matmul_TFLOPs": matmul_rate(device)}


class Report:
    """A benchmark's results: `out` starts with the device, the date and the copy ceiling measured now (the floors'
    divisor), `log` prints a line and keeps it, `save` writes `out` as JSON and the lines beside it as .log."""

    def __init__(self, device: str = "cuda", **fields: Any) -> None:
        self.copy_gbs = copy_bandwidth(device)
        name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
        self.out: dict[str, Any] = {"device": name, "date": datetime.date.today().isoformat(),
                                    "copy_gbs": self.copy_gbs, **fields}  # fmt: skip
        self.lines: list[str] = []
        self.log(f"{name}  copy {self.copy_gbs:.0f} GB/s")

    def log(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.out, indent=1))
        Path(path).with_suffix(".log").write_text("\n".join(self.lines) + "\n")


def _setting_value(value: str, was: Any) -> int | float:
    """V of a NAME=V setting for a module value that holds `was`: an integer, or a decimal where it holds a float;
    ValueError otherwise."""
    return (float if isinstance(was, float) else int)(value)


def module_settings(text: str, module: Any) -> list[tuple[str, int | float]]:
    """'NAME=V[+NAME=V]' -> [(NAME, V)], each NAME a module-level value of module and V an integer (a decimal for a
    float value; a bench's --ab or --set); ValueError saying which item is wrong otherwise."""
    out = []
    for item in filter(None, text.split("+")):
        name, _, value = item.partition("=")
        try:
            if not hasattr(module, name):
                raise ValueError(f"no {name!r}")
            out.append((name, _setting_value(value, getattr(module, name))))
        except ValueError as e:
            raise ValueError(f"NAME=V with NAME a module-level name of {module.__name__} and V an integer (a decimal "
                             f"for a float), got {item!r}: {e}") from None  # fmt: skip
    return out


def set_module_values(module: Any, settings: list[tuple[str, int | float]]) -> dict[str, Any]:
    """module.NAME = V (in the type the module holds) for each setting; the values they replaced."""
    kept = {name: getattr(module, name) for name, _ in settings}
    for name, value in settings:
        setattr(module, name, type(kept[name])(value))
    return kept


@contextlib.contextmanager
def module_values(module: Any, settings: list[tuple[str, int | float]]) -> Iterator[None]:
    """`set_module_values` inside the block, the old values restored after it."""
    kept = set_module_values(module, settings)
    try:
        yield
    finally:
        for name, value in kept.items():
            setattr(module, name, value)


def main() -> None:
    """Each way the benchmarks used to measure copy bandwidth, beside this module's figure."""
    from triton.testing import do_bench, do_bench_cudagraph

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n = 1 << 29
    src = torch.rand(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    gb = 2 * 2 * n / 1e6
    copy = lambda: dst.copy_(src)
    first = gb / median_ms(copy, dev)
    rows = {
        "wall-clock median of synchronised copies (bench_decode's former method)": first,
        "copy_bandwidth(): CUDA events, best of medians": copy_bandwidth(dev),
        "triton do_bench, median": gb / do_bench(copy, return_mode="median"),
        "triton do_bench_cudagraph (copies inside a CUDA graph)": gb / do_bench_cudagraph(copy, rep=50),
    }
    print(torch.cuda.get_device_name() if dev == "cuda" else "cpu")
    for k, v in rows.items():
        print(f"  {v:6.0f} GB/s  {k}")
    print(f"  bf16 matmul {matmul_rate(dev):.0f} TFLOP/s (8192^3, CUDA events, best of medians)")


if __name__ == "__main__":
    main()
