"""Issue 10's planning-speed targets: the whole GPT-39B plan on ``alpa-p3x8`` (64 GPUs) and a GPT-3 175B plan on
``dgx-h100:512`` (4,096 GPUs): wall seconds, and CPU seconds of this process and its planning workers.

    nice -n 10 python benchmarks/bench_plan_speed.py --rows gpt3-39b
    nice -n 10 python benchmarks/bench_plan_speed.py --rows gpt3-175b --workers 1 2

Per row and worker count (``plan_pipeline(workers=)``, ``planner.parallel``): ``capture_stack`` (4 of the
blocks traced on meta tensors) and one ``plan_pipeline`` call (1F1B); printed: the CPU and wall seconds of
each, the stage searches, the t_max DPs, the plan and its predicted step.

* ``gpt3-39b``: Alpa's Table 6 row, B = 64 microbatches of 16 sequences (global batch 1024), every layer a
  cluster, every Theorem 1 submesh and logical shape: the same call as ``bench_alpa_table.py``'s.
* ``gpt3-175b``: GPT-3 175B (global batch 1536 of 2048 tokens), B = 96 microbatches of 16, on 512 nodes of 8
  H100 80 GB. The narrowed search of a large cluster (``plan_pipeline``'s ``submeshes`` / ``shapes``):
  stages of 2^j whole nodes (8, 16, …, 4096 GPUs), logical shapes with tensor parallelism inside a node
  (``LogicalShapes.IN_NODE``), the 100 layers clustered into 24 (Eq. 6).
"""

from __future__ import annotations

import argparse
import os
import time

from meshpilot.models import builtin_models
from meshpilot.planner.pipeline import LogicalShapes, plan_pipeline
from meshpilot.planner.stack import Stack, capture_stack
from meshpilot.planner.stage import StagePlanner

ROWS = {
    "gpt3-39b": dict(cluster="alpa-p3x8", devices=64, batch=1024, B=64, kw={}),
    "gpt3-175b": dict(
        cluster="dgx-h100:512",
        devices=4096,
        batch=1536,
        B=96,
        kw=dict(submeshes=[8 << j for j in range(10)], shapes=LogicalShapes.IN_NODE, num_clusters=24),
    ),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument(
        "--workers", type=int, nargs="+", default=[None],
        help="planning processes, one run per value (default: plan_pipeline's, the usable CPUs up to 8)",
    )  # fmt: skip
    args = ap.parse_args()
    for name in args.rows:
        for workers in args.workers:
            run(name, workers)


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (``plan_pipeline``'s planning workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run(name: str, workers: int | None) -> None:
    """One row: the capture and ``plan_pipeline`` with `workers` processes; CPU seconds of every process,
    wall seconds of each part."""
    row = ROWS[name]
    print(f"{name} on {row['cluster']}, workers={workers}: load average {os.getloadavg()}, {os.cpu_count()} CPUs")
    c0, w0 = cpu_seconds(), time.perf_counter()
    model, inputs = builtin_models()[name].build("meta", row["batch"] // row["B"])
    stack = capture_stack(model, inputs)
    assert isinstance(stack, Stack)
    c1, w1 = cpu_seconds(), time.perf_counter()
    sp = StagePlanner(stack.graph, row["cluster"])
    p = plan_pipeline(
        stack, sp.cluster, microbatches=row["B"], num_devices=row["devices"], planner=sp, workers=workers,
        **row["kw"],
    )  # fmt: skip
    c2, w2 = cpu_seconds(), time.perf_counter()
    print(p)
    print(
        f"{name}, workers={workers}: capture {c1 - c0:.1f} s CPU ({w1 - w0:.1f} s wall), plan_pipeline "
        f"{c2 - c1:.1f} s CPU ({w2 - w1:.1f} s wall), total {c2 - c0:.1f} s CPU ({w2 - w0:.1f} s wall); "
        f"{p.stage_plans} stage searches, {p.t_max_tried} DPs; step {p.dp_step_s!r} s; "
        f"load average after {os.getloadavg()}",
        flush=True,
    )


if __name__ == "__main__":
    main()
