"""What one small gloo collective costs as the ranks outnumber the cores: N ranks on this machine, each doing
`--steps` all-reduces of 4 KiB in a row (optionally a 256 x 256 matmul between them), for N in `--ranks`.

    python benchmarks/bench_gloo_ranks.py                  # 2, 4 and 8 ranks, 300 all-reduces each
    python benchmarks/bench_gloo_ranks.py --matmul         # with compute between the collectives

Prints a table: rank 0's wall per all-reduce and its user and system CPU seconds. On a 2-core machine the suite's
8-rank tests pay the 8-rank row per collective (docs/benchmarks.md, "The suite on the AMD EPYC box").
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table


def _rank(rank: int, world: int, tmp: str, steps: int, matmul: bool, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(tmp, "store"), world), rank=rank, world_size=world
    )
    x, a = torch.randn(1024), torch.randn(256, 256)  # 4 KiB all-reduced
    dist.barrier()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(steps):
        if matmul:
            a = torch.tanh(a @ a * 0.01)
        dist.all_reduce(x)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    if rank == 0:
        with open(out, "w") as fh:
            fh.write(f"{wall} {r1.ru_utime - r0.ru_utime} {r1.ru_stime - r0.ru_stime}")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--matmul", action="store_true", help="a 256 x 256 matmul between the all-reduces")
    args = ap.parse_args()
    table = Table(title=f"{args.steps} gloo all-reduces of 4 KiB in a row, {os.cpu_count()} CPUs")
    for col in ("ranks", "wall / all-reduce (ms)", "rank 0 user (s)", "rank 0 sys (s)"):
        table.add_column(col, justify="right")
    for world in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank0.txt")
            mp.start_processes(_rank, (world, tmp, args.steps, args.matmul, out), nprocs=world, start_method="spawn")
            with open(out) as fh:
                wall, user, sys_ = (float(v) for v in fh.read().split())
        table.add_row(str(world), f"{1000 * wall / args.steps:.1f}", f"{user:.2f}", f"{sys_:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
