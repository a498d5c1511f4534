"""Simulation time of a GPT-3 175B step on 4,096 devices (dgx-h100:512): meshpilot.sim alone, planning excluded.

    python benchmarks/bench_simulate.py                          # Megatron TP 8 x DP 512, forced (default)
    python benchmarks/bench_simulate.py --save /tmp/gpt3.json    # keep the plan; --load it next time
    python benchmarks/bench_simulate.py --layers 8               # a quicker variant

The plan is made once (GPT on the meta device, mesh (512, 8): data parallel over the nodes, Megatron tensor
parallelism inside a node, pinned with ``meshpilot.planner.forced.megatron_tp``; the ILP picks the rest; memory
unchecked, as 175B needs pipeline stages to fit 80 GiB, which plans do not have yet), then
each schedule is simulated: the plan's trivial one, the overlapped one, gradient accumulation over 4
microbatches, and the trivial one with one straggler (+20%) — which splits the 4,096 ranks into the classes
colour refinement finds; with at most --all-ranks-max ranks also both with every rank simulated on its own
(the speed-up of rank symmetry; same step). The cost model's Eq. 3 on the mesh (seconds on 4,096 devices; the
planner pays it too) is timed once before the runs, which reuse it. Prints a table: wall seconds of the
simulation alone (lowering + event loop), events, simulated classes, step time and its split. Target
(issue 9): < 30 s per simulation.
"""

from __future__ import annotations

import argparse
import os
import time

from rich.console import Console
from rich.table import Table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=12288)
    ap.add_argument("--heads", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cluster", default="dgx-h100:512")
    ap.add_argument("--mesh", default="512x8")
    ap.add_argument(
        "--memory-gib",
        type=float,
        default=1e6,
        help="device capacity for planning (default: unlimited; TP 8 x DP 512 of 175B needs ~204 GiB per device "
        "without pipeline stages, which plans do not have yet; the simulator ignores memory)",
    )
    ap.add_argument(
        "--all-ranks-max",
        type=int,
        default=256,
        help="also simulate every rank on its own (symmetric=False) when the mesh has at most this many ranks",
    )
    ap.add_argument("--save", help="save the plan here")
    ap.add_argument("--load", help="simulate this saved plan instead of planning")
    args = ap.parse_args()
    console = Console() if Console().is_terminal else Console(width=200)

    from meshpilot.cluster import load_cluster
    from meshpilot.planner.plan import StagePlan
    from meshpilot.planner.schedule import accumulate, overlapped
    from meshpilot.sim import simulate

    cluster = load_cluster(args.cluster)
    t0 = time.perf_counter()
    if args.load:
        plan = StagePlan.load(args.load)
        how = f"loaded {args.load}"
    else:
        import meshpilot
        from meshpilot.cli.plan import build_model
        from meshpilot.graph.capture import capture
        from meshpilot.planner.forced import megatron_tp

        shape = tuple(int(d) for d in args.mesh.split("x"))
        built = build_model(
            "gpt", layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch, seq=args.seq,
            dtype="bfloat16",
        )  # fmt: skip
        graph = capture(built.model, built.inputs)
        force = megatron_tp(built.model, built.inputs, shape, graph=graph)
        plan = meshpilot.plan(
            built.model, built.inputs, cluster, mesh_shape=shape, mappings=("row",), force=force, graph=graph,
            memory_bytes=args.memory_gib * 2**30, zero="off",
        ).only  # fmt: skip
        how = f"{built.label}; Megatron TP forced on {shape}"
        if args.save:
            plan.save(args.save)
    plan_s = time.perf_counter() - t0
    world = 1
    for d in plan.mesh_shape:
        world *= d
    console.print(
        f"{how}; {world} devices on {args.cluster}; {len(plan.nodes)} nodes, {len(plan.collectives)} collectives; "
        f"closed-form step {plan.time.total_s * 1e3:.2f} ms; plan made in {plan_s:.1f} s; "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )

    from meshpilot.sim.engine import _cost_model

    t0 = time.perf_counter()
    cm = _cost_model(cluster, tuple(plan.mesh_shape), tuple(plan.mesh_ranks))
    for axis in sorted({c.axis for c in plan.collectives}):
        cm.all_reduce(1.0, axis)  # Eq. 3 of the axis, once per mesh; every simulation below reuses it
    eq3_s = time.perf_counter() - t0
    console.print(f"cost model of the mesh (Eq. 3 per axis, once; cached for the runs): {eq3_s:.2f} s")

    runs = [
        ("trivial (F0 B0 G)", {}),
        ("overlapped", {"schedule": overlapped(plan)}),
        ("accumulate ×4", {"schedule": accumulate(world, 4)}),
        ("trivial, rank 9 +20%", {"straggler": {9: 20.0}}),
    ]
    if world <= args.all_ranks_max:
        runs += [
            ("trivial, every rank alone", {"symmetric": False}),
            ("rank 9 +20%, every rank alone", {"straggler": {9: 20.0}, "symmetric": False}),
        ]
    table = Table(title=f"meshpilot.sim: one step of {world} ranks")
    for col in ("run", "wall s", "events", "classes", "step ms", "vs closed form", "compute", "exposed", "hidden"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name, kw in runs:
        r = simulate(plan, cluster=cluster, **kw)
        worst = max(r.classes, key=lambda c: (c.end_s, c.compute_s))
        table.add_row(
            name,
            f"{r.wall_s:.3f}",
            str(r.num_events),
            str(r.sim_ranks),
            f"{r.step_s * 1e3:.2f}",
            f"{r.step_s / plan.time.total_s:.3f}",
            f"{worst.compute_s * 1e3:.2f}",
            f"{worst.exposed_comm_s * 1e3:.2f}",
            f"{worst.hidden_comm_s * 1e3:.2f}",
        )
        console.print(f"  {name}: {r.wall_s:.2f} s")
    console.print(table)


if __name__ == "__main__":
    main()
