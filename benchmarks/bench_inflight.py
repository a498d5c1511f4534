"""Is a gloo all-reduce slower while its ranks compute? (docs/benchmarks.md, duplex section)

Run under ``meshpilot emulate`` (8 ranks): for each message size, the all-reduce of every rank at once is
timed alone (``probe._Runner.timed``: barrier, blocking all-reduce) and while every rank runs matmuls until
it sees its all-reduce complete (``probe._Runner.inflight``); per repeat the slowest rank, median over
repeats; rank 0 prints both and their ratio.

The other way round, ``--matmuls K``: the time per matmul of ``--gemm`` n x n, K of them alone, and while
K / 10 all-reduces of the largest size run back to back on every rank (the next issued as soon as this rank
sees the last complete); median over ranks and rounds: how much the collectives slow the compute.

    flock /tmp/meshpilot-emulate.lock python -m meshpilot.cli.main emulate \\
        -c examples/clusters/emulated-2x4-100mbit.toml -- python benchmarks/bench_inflight.py --sizes 65536 2097152
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from meshpilot.cluster.probe import ProbeOptions, _Runner


def _slowest(per_rank: list, which: int) -> list[float]:
    """Per repeat (all rounds in order) the slowest rank's seconds of measurement `which` (0 alone, 1 busy)."""
    runs = [sum(r[which], []) for r in per_rank]
    return [max(col) for col in zip(*runs)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[2 << 20])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="alternations of alone / in flight per size")
    p.add_argument("--matmuls", type=int, default=0, metavar="K", help="also time K matmuls beside all-reduces")
    p.add_argument("--gemm", type=int, default=512, metavar="N", help="their size (default 512)")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    opts = ProbeOptions(nbytes=max(a.sizes), repeats=a.repeats, warmup=1)
    run = _Runner(opts, torch.device("cpu"))
    rows = []
    for size in a.sizes:
        buf = run.sink[: size // 4]
        alone, busy = [], []
        for _ in range(a.rounds):
            alone.append(run.timed(lambda b=buf: run._allreduce(None, b)))
            busy.append(run.inflight(None, buf))
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, (alone, busy))
        if dist.get_rank() == 0:
            t_alone, t_busy = _slowest(out, 0), _slowest(out, 1)
            row = {
                "bytes": size,
                "alone_s": statistics.median(t_alone),
                "inflight_s": statistics.median(t_busy),
                "alone_all": t_alone,
                "inflight_all": t_busy,
                "loadavg": os.getloadavg(),
            }
            row["ratio"] = row["inflight_s"] / row["alone_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.matmuls:
        row = _compute_beside(a.matmuls, a.gemm, run.sink[: max(a.sizes) // 4], a.rounds)
        if row is not None:
            print(json.dumps(row), flush=True)
    dist.destroy_process_group()


def _compute_beside(k: int, n: int, buf: torch.Tensor, rounds: int) -> dict | None:
    """Seconds per n x n matmul alone (`k` of them) and while every rank runs `k` // 10 all-reduces of `buf`
    back to back (the next issued when this rank sees the last complete; a fixed count, so every rank issues
    the same collectives), computing between polls (module docstring)."""
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    count = max(1, k // 10)
    alone, beside = [], []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            torch.mm(a, b, out=c)
        alone.append((time.perf_counter() - t0) / k)
        dist.barrier()
        t0, done = time.perf_counter(), 0
        for _ in range(count):
            work = dist.all_reduce(buf, async_op=True)
            while not work.is_completed():
                torch.mm(a, b, out=c)
                done += 1
            work.wait()
        if done:
            beside.append((time.perf_counter() - t0) / done)
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, (alone, beside))
    if dist.get_rank() != 0:
        return None
    t_alone = statistics.median(x for o in out for x in o[0])
    t_beside = statistics.median(x for o in out for x in o[1])
    return {
        "gemm": n,
        "allreduces": count,
        "allreduce_bytes": buf.numel() * 4,
        "alone_s_per_matmul": t_alone,
        "beside_s_per_matmul": t_beside,
        "slowdown": t_beside / t_alone,
        "loadavg": os.getloadavg(),
    }


if __name__ == "__main__":
    main()
