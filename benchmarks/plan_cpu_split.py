"""Where `meshpilot plan`'s CPU seconds go: the command run as given, with its phases and every HiGHS solve timed.

    PYTHONPATH=. python benchmarks/plan_cpu_split.py [--accumulated] -- \
        plan --model gpt3-39b --cluster alpa-p3x8 --out p.json

Phases (this process' CPU, ``time.process_time``; the stage table's forked workers are counted through
``RUSAGE_CHILDREN``): the stack captures (``stack.capture_stack``), the stage table and DP
(``pipeline.plan_pipeline``, workers included), the whole-model capture and ``Plan.with_intra`` (each stage's own
plan). Every solve of ``ilp._milp`` (in the workers too: they are forked after the wrapper is installed) is
written as one line to ``--solves`` (pid, mesh shape, row kind, capacity, wall s, CPU s, objective); the summary
splits them into solves without memory rows ("free") and capped ones, per submesh size, and counts those that
ran into the HiGHS time limit (wall ≥ 99 % of it: under load, a wall-clock limit cuts a solve short, so the plan
can depend on the machine's load). `--accumulated` runs the exact table with the summed-gradient term
(``plan_pipeline(accumulated=True)``: the default since issue 29's gpt40, so a no-op there). Measures only: the
plan is the command's own.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _timed(phases: dict[str, float], name: str, fn, children: bool = False):
    """`fn` with its CPU seconds (this process', and with `children` its waited-for children's) added to
    ``phases[name]``."""

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        c0, k0 = time.process_time(), _children_cpu()
        try:
            return fn(*a, **kw)
        finally:
            phases[name] += time.process_time() - c0 + ((_children_cpu() - k0) if children else 0.0)

    return wrapper


def _install(solves: Path, phases: dict[str, float], accumulated: bool) -> None:
    from meshpilot.graph import capture as capture_mod
    from meshpilot.planner import ilp, pipeline, plan, stack

    milp = ilp._milp

    def logged(prob, memory, cap, time_limit, mip_rel_gap):
        t0, c0 = time.perf_counter(), time.process_time()
        ans = milp(prob, memory, cap, time_limit, mip_rel_gap)
        row = [os.getpid(), list(prob.mesh_shape), memory, cap, time.perf_counter() - t0, time.process_time() - c0]
        row += [getattr(ans, "objective", None), time_limit]
        with solves.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return ans

    ilp._milp = logged
    stack.capture_stack = _timed(phases, "stack captures", stack.capture_stack)
    capture_mod.capture = _timed(phases, "whole-model capture", capture_mod.capture)
    run = functools.partial(pipeline.plan_pipeline, accumulated=True) if accumulated else pipeline.plan_pipeline
    pipeline.plan_pipeline = _timed(phases, "stage table + DP (workers included)", run, children=True)
    plan.Plan.with_intra = _timed(phases, "with_intra (the stages' own plans)", plan.Plan.with_intra)


def summary(solves: Path, phases: dict[str, float], total: float) -> list[str]:
    """The report's lines: the phases, then the solves split by kind and by submesh size."""
    rows = [json.loads(line) for line in solves.read_text().splitlines()] if solves.exists() else []
    out = [f"total CPU (this process and its children): {total:.1f} s"]
    out += [f"  {name}: {s:.1f} s" for name, s in phases.items()]
    main = os.getpid()
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    sizes: dict[int, list[float]] = defaultdict(lambda: [0, 0.0])
    hit = [0, 0.0]
    for pid, shape, _, cap, wall, cpu, _, limit in rows:
        where = "main process" if pid == main else "workers"
        kind = f"{where}, {'free' if cap is None or cap == float('inf') else 'capped'}"
        kinds[kind][0] += 1
        kinds[kind][1] += cpu
        if pid != main:
            d = shape[0] * (shape[1] if len(shape) > 1 else 1)
            sizes[d][0] += 1
            sizes[d][1] += cpu
        if wall >= 0.99 * limit:
            hit[0] += 1
            hit[1] += cpu
    out.append(f"HiGHS solves: {len(rows)}, {sum(r[5] for r in rows):.1f} s CPU")
    out += [f"  {k}: {n} solves, {s:.1f} s" for k, (n, s) in sorted(kinds.items())]
    per_size = ", ".join(f"{d}: {n}/{s:.1f} s" for d, (n, s) in sorted(sizes.items()))
    out.append(f"  per submesh size (workers; solves/CPU): {per_size}")
    out.append(f"  stopped by the time limit (wall): {hit[0]} solves, {hit[1]:.1f} s CPU")
    top = sorted(rows, key=lambda r: -r[5])[:10]
    out.append("  largest: " + ", ".join(f"{tuple(r[1])} {r[2]} {r[5]:.2f} s" for r in top))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--solves", type=Path, default=Path("plan_solves.jsonl"), help="the per-solve log (replaced)")
    ap.add_argument("--accumulated", action="store_true", help="exact table with the summed-gradient term")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then meshpilot's arguments")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("give meshpilot's arguments after --, e.g. -- plan --model gpt3-39b --cluster alpa-p3x8")
    args.solves.unlink(missing_ok=True)
    phases: dict[str, float] = defaultdict(float)
    _install(args.solves, phases, args.accumulated)
    from meshpilot.cli.main import main as cli

    c0, k0, t0 = time.process_time(), _children_cpu(), time.perf_counter()
    try:
        rc = cli(command)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    total = time.process_time() - c0 + _children_cpu() - k0
    lines = summary(args.solves, dict(phases), total)
    print(f"exit {rc}, wall {time.perf_counter() - t0:.1f} s", *lines, sep="\n", file=sys.stderr)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
