"""Planning time of ``bench_planning.py``'s fixed-mesh run at several commits, paired: the issue's benchmark
transformer (32 layers, h 4096, batch 64, sequence 2048) planned on ``dgx-h100:32`` with the mesh fixed to
(32, 8), each run its own Python process (imports included), the trees taken in turn A B C A B C ….

    git worktree add /tmp/x4f 4f92d9a && git worktree add /tmp/xa0 a0f2f93
    python benchmarks/bench_capture_speed.py /tmp/x4f /tmp/xa0 . --runs 3

or, leaving the repository's worktree list alone, plain copies of the commits' trees:

    for c in 4f92d9a a0f2f93; do mkdir -p /tmp/x$c && git archive $c | tar -x -C /tmp/x$c; done

Each tree is a checkout of meshpilot run with ``PYTHONPATH`` at it. Per run: the process's CPU seconds
(user + system, ``getrusage(RUSAGE_CHILDREN)``: what the whole ``python -c 'plan(...)'`` cost, imports
included), the CPU seconds of the ``plan()`` call alone (``time.process_time`` around it), its capture's wall
seconds, the plan's predicted step and a digest of its per-operator strategies (each op's target and placements
in order, ``Plan.strategy_lines`` without the node names, which captures number differently: the same
digest, the same plan). Prints a table of every run and one of the medians, each tree's ratio to the
first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.table import Table

CHILD = """
import hashlib, json, time, torch
from meshpilot.models.zoo import PlanBenchTransformer
from meshpilot.planner.auto import plan
with torch.device("meta"):
    model = PlanBenchTransformer({layers}, 4096, 32)
x = torch.empty(64, 2048, 4096, device="meta")
c0 = time.process_time()
p = plan(model, (x,), "dgx-h100:32", mesh_shape=(32, 8), mappings=("row",))
cpu = time.process_time() - c0
lines = [getattr(n, "target", "") + n.short().partition(":")[2] for n in p.nodes if n.kind == "op"]
digest = hashlib.sha256("\\n".join(lines).encode()).hexdigest()[:12]
print(json.dumps(dict(plan_cpu=cpu, capture_wall=p.solver.capture_s, step_ms=p.time.total_s * 1e3, digest=digest)))
"""


def run_once(tree: str, layers: int) -> dict:
    """One planning process at `tree`: its CPU seconds and what it printed."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(layers=layers)],
        env=env,
        cwd=os.path.abspath(tree),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: planning failed:\n{err[-2000:]}")
    row = json.loads(out.strip().splitlines()[-1])
    row.update(load=load, wall=wall, proc_cpu=_children_cpu_delta())
    return row


_LAST = [0.0]


def _children_cpu_delta() -> float:
    """CPU seconds (user + system) of the child that just ended: the growth of this process's children's."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = ru.ru_utime + ru.ru_stime
    delta, _LAST[0] = total - _LAST[0], total
    return delta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+", help="meshpilot checkouts, the first the baseline")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    console = Console(width=160)
    _children_cpu_delta()
    rows: dict[str, list[dict]] = {t: [] for t in args.trees}
    each = Table(title="every run, in the order made")
    for col in ("run", "tree", "load", "process CPU s", "plan() CPU s", "capture wall s", "step ms", "strategies"):
        each.add_column(col, justify="left" if col in ("tree", "strategies") else "right")
    for k in range(args.runs):
        for tree in args.trees:
            r = run_once(tree, args.layers)
            rows[tree].append(r)
            each.add_row(
                str(k + 1),
                tree,
                f"{r['load']:.1f}",
                f"{r['proc_cpu']:.2f}",
                f"{r['plan_cpu']:.2f}",
                f"{r['capture_wall']:.2f}",
                f"{r['step_ms']:.1f}",
                r["digest"],
            )
    console.print(each)
    med = Table(title=f"medians of {args.runs} paired runs ({args.layers} layers, mesh (32, 8), dgx-h100:32)")
    for col in ("tree", "process CPU s", "ratio", "plan() CPU s", "ratio", "step ms", "strategies"):
        med.add_column(col, justify="left" if col in ("tree", "strategies") else "right")
    base = rows[args.trees[0]]
    b_proc = statistics.median(r["proc_cpu"] for r in base)
    b_plan = statistics.median(r["plan_cpu"] for r in base)
    for tree, rs in rows.items():
        proc = statistics.median(r["proc_cpu"] for r in rs)
        cpu = statistics.median(r["plan_cpu"] for r in rs)
        med.add_row(
            tree,
            f"{proc:.2f}",
            f"{proc / b_proc:.2f}",
            f"{cpu:.2f}",
            f"{cpu / b_plan:.2f}",
            f"{rs[0]['step_ms']:.1f}",
            " ".join(sorted({r["digest"] for r in rs})),
        )
    console.print(med)


if __name__ == "__main__":
    main()
