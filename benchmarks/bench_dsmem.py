"""What an exchange inside a thread-block cluster costs on this GPU (kernels/cluster.py's primitives): the barriers
alone, and reads of the peers' shared memory through distributed shared memory (DSMEM), the two things a cluster
merge (session 47's GQA decode, session 48's MLA try) is made of.

Each program (4 warps, one an SM: shared memory padded to PAD_BYTES) publishes E floats in its shared memory, meets
its cluster at a barrier, reads, and leaves through a split barrier, as `_cluster_merge` does. Modes:
- `barriers`: the two barriers only (nothing published or read);
- `merge`: E / C floats from each of the C peers, E a program (the merges' pattern: a warp's lanes on consecutive
  floats of one peer);
- `neighbour`: all E floats of the next peer.
The reads repeat REPS times; the time of the extra repetitions, (t(REPS) - t(1)) / (REPS - 1), is one read's, and
E x 4 bytes over it a program's DSMEM read rate (times the programs: the GPU's). CLUSTER 1 with `barriers` is a
plain launch of the same kernel: the barriers' cost is the difference. PROGRAMS (112) fit in one wave at every
cluster size on an H200 (7 clusters of 16 a program an SM; benchmarks/results/attention_mla_cluster_s48_h200.log).

    PYTHONPATH=$PWD python benchmarks/bench_dsmem.py --out $OUT/dsmem_h200.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ceilings import Report, graph_ms

from ftransformers.kernels.cluster import (
    cluster_arrive,
    cluster_launch,
    cluster_supported,
    cluster_sync,
    cluster_wait,
    ld_cluster_f32,
    smem_addr,
    st_shared_f32,
)
from ftransformers.kernels.launch import cached_launch

PROGRAMS = 112
PAD_BYTES = 120 * 1024  # > half an SM's shared memory: one program an SM, as the MLA decode runs
MODES = {"barriers": 0, "merge": 1, "neighbour": 2}
CALLS = 20  # launches a CUDA graph


@cached_launch
@triton.jit
def _exchange_kernel(out, smem_off, E: tl.constexpr, CLUSTER: tl.constexpr, REPS: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    rank = pid % CLUSTER
    base = smem_addr(smem_off)
    W: tl.constexpr = E // CLUSTER
    if MODE != 0:
        offs = tl.arange(0, E)
        st_shared_f32(base + offs * 4, (offs + pid).to(tl.float32))
    cluster_sync()
    total = 0.0
    if MODE == 1:
        peer = tl.arange(0, CLUSTER)[:, None] + 0 * tl.arange(0, W)[None, :]
        addr = base + (rank * W + tl.arange(0, W)[None, :]) * 4 + 0 * peer
        for _ in tl.static_range(REPS):
            total += tl.sum(tl.sum(ld_cluster_f32(addr, peer), 1), 0)
    elif MODE == 2:
        offs = tl.arange(0, E)
        peer = (rank + 1) % CLUSTER + 0 * offs
        for _ in tl.static_range(REPS):
            total += tl.sum(ld_cluster_f32(base + offs * 4, peer), 0)
    cluster_arrive()
    tl.store(out + pid, total)
    cluster_wait()


def launch(mode: str, cluster: int, e: int, reps: int, out: torch.Tensor) -> None:
    """One launch of PROGRAMS programs in clusters of `cluster`; each stores its sum of what it read in out."""
    cluster_launch(_exchange_kernel, (PROGRAMS // cluster,), cluster, PAD_BYTES, out, 0, E=e, CLUSTER=cluster,
                   REPS=reps, MODE=MODES[mode], num_warps=4)  # fmt: skip


def time_case(mode: str, cluster: int, e: int, reps: int, out: torch.Tensor) -> float:
    """us a launch."""
    return graph_ms(lambda _: launch(mode, cluster, e, reps, out), CALLS, warm_calls=2) * 1e3


def check(out: torch.Tensor, cluster: int, e: int) -> None:
    """One `merge` launch against its sums: program p's floats are p + offs, so the peers of p's cluster give the
    sum of (q + rank * W + j) over its peers q and j < W."""
    w = e // cluster
    launch("merge", cluster, e, 1, out)
    pid = torch.arange(PROGRAMS, dtype=torch.float64)
    first = pid - pid % cluster
    peers_sum = cluster * first + cluster * (cluster - 1) / 2
    want = peers_sum * w + cluster * ((pid % cluster) * w * w + w * (w - 1) / 2)
    got = out.double().cpu()
    assert torch.allclose(got, want, rtol=1e-5), (cluster, e, (got - want).abs().max().item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="result .json (a .log beside it)")
    ap.add_argument("--clusters", default="2,8,16")
    ap.add_argument("--floats", default="1024,8192", help="E: floats a program publishes and reads")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    if not cluster_supported(dev):
        raise SystemExit("bench_dsmem: thread-block clusters need a Hopper (or newer) GPU and the launch cache")
    rep = Report("cuda", programs=PROGRAMS, pad_bytes=PAD_BYTES, calls_a_graph=CALLS)
    out = torch.empty(PROGRAMS, device=dev, dtype=torch.float32)
    plain = time_case("barriers", 1, 1024, 1, out)
    rep.log(f"plain launch (cluster 1, barriers on a cluster of one): {plain:.2f} us")
    rows = [{"mode": "barriers", "cluster": 1, "us": plain}]
    for c in [int(x) for x in args.clusters.split(",")]:
        bar = time_case("barriers", c, 1024, 1, out)
        rep.log(f"cluster {c:2d} barriers only: {bar:.2f} us (+{bar - plain:.2f} over the plain launch)")
        rows.append({"mode": "barriers", "cluster": c, "us": bar})
        for e in [int(x) for x in args.floats.split(",")]:
            check(out, c, e)
            for mode in ("merge", "neighbour"):
                one, many = time_case(mode, c, e, 1, out), time_case(mode, c, e, args.reps, out)
                read_us = (many - one) / (args.reps - 1)
                gbs = e * 4 / read_us / 1e3  # a program's
                rep.log(f"cluster {c:2d} {mode:9s} E {e:5d} ({e * 4 // 1024} KB a program): {one:.2f} us a launch, "
                        f"one read {read_us:.2f} us = {gbs:.0f} GB/s a program, {gbs * PROGRAMS:.0f} GB/s in all "
                        f"(copy {rep.copy_gbs:.0f})")  # fmt: skip
                rows.append({"mode": mode, "cluster": c, "floats": e, "us": one, "read_us": read_us,
                             "gbs_program": gbs, "gbs_all": gbs * PROGRAMS})  # fmt: skip
    rep.out["rows"] = rows
    rep.save(args.out)


if __name__ == "__main__":
    main()
