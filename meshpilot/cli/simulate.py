"""`meshpilot simulate`: replay a saved plan's step schedule in a discrete-event simulation of its cluster.

Every rank runs its schedule (`meshpilot plan` saves one; default `F0 B0 G`): compute on one stream, each
collective on the link of the cluster layer it crosses, costed by the same cost model as the planner. Issued
collectives run beside the compute until waited on, concurrent transfers on one link share its bandwidth,
and a straggler holds back every collective it takes part in. The table shows, per class of identical ranks,
the step split into

  compute   the compute stream busy
  exposed   communication nothing overlaps (the compute stream waits for it)
  hidden    communication running beside compute
  idle      neither: waiting for a slower peer's issue, or for the step's end
  overlap   HiDup's overlap ratio (Table 4): hidden ÷ min(compute, exposed + hidden)

beside the plan's closed-form step (no overlap). Ranks are numbered as the schedule numbers them: the mesh
position in row-major order, 0 .. devices-1. Ranks that behave identically are simulated once (an SPMD plan
without stragglers: one class whatever the size). See docs/simulator.md.

Examples:
  meshpilot plan -m gpt-tiny -c atp-ic3 -n 4 --out plan.json
  meshpilot simulate plan.json
  meshpilot simulate plan.json --straggler 1:50 --trace step.json --png step.png
  meshpilot simulate plan.json --schedule overlapped --microbatches 2
  meshpilot simulate plan.json --schedule duplex --png duplex.png   (duplex and without: both timelines)

Open the --trace file in https://ui.perfetto.dev (or chrome://tracing): one process per class (named by its
ranks), thread 0 compute, one thread per cluster layer's link; grey `wait` spans are the compute stream blocked.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table

from meshpilot.cli.common import console, path_arg
from meshpilot.cli.main import COMMANDS
from meshpilot.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help=COMMANDS["simulate"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("plan", type=path_arg, help="a plan saved by `meshpilot plan --out plan.json`")
    p.add_argument(
        "--straggler",
        action="append",
        default=[],
        metavar="RANK:PCT",
        help="rank RANK computes PCT%% slower (e.g. 3:50; repeatable); its groups' collectives wait for it",
    )
    p.add_argument(
        "--schedule",
        choices=("plan", "trivial", "accumulate", "overlapped", "duplex"),
        default="plan",
        help="simulate the plan's own schedule (default), or rebuild one: trivial (F0 B0 G), accumulate "
        "(--microbatches, gradients reduced once), overlapped (collectives issued right after their producer), "
        "duplex (HiDup: 2 microbatches interleaved stage by stage; also simulates them without duplex)",
    )
    p.add_argument("--microbatches", type=int, default=None, help="microbatches for a rebuilt schedule (default 1)")
    p.add_argument(
        "--cluster",
        "-c",
        metavar="C",
        help="the cluster (preset or TOML file) when the plan's recorded name is not a preset",
    )
    p.add_argument("--trace", type=path_arg, metavar="T.json", help="write a Chrome trace (Perfetto) here, atomically")
    p.add_argument("--png", type=path_arg, metavar="T.png", help="write a timeline image here, atomically")
    p.set_defaults(func=run)


def _check_out(path: Path | None, flag: str) -> None:
    if path is None:
        return
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: folder {parent} does not exist; create it or write elsewhere")


def load_plan(path: Path):
    """A saved plan (``Plan.load``: the one format, or an older one-stage or pipeline file)."""
    from meshpilot.planner.plan import Plan

    if not path.is_file():
        raise UserError(f"{path}: does not exist; save a plan with `meshpilot plan ... --out {path}`")
    return Plan.load(path)


def run(args: argparse.Namespace) -> int:
    from meshpilot.cli.plan import fmt_s
    from meshpilot.planner import schedule as sched
    from meshpilot.sim import parse_straggler, simulate, write_timelines

    straggler = parse_straggler(args.straggler)
    if len(straggler) < len(args.straggler):
        ranks = [item.partition(":")[0].strip() for item in args.straggler]
        twice = sorted({r for r in ranks if ranks.count(r) > 1})
        raise UserError(f"--straggler: rank {', '.join(twice)} given more than once; give each rank one RANK:PCT")
    _check_out(args.trace, "--trace")
    _check_out(args.png, "--png")
    if args.microbatches is not None and args.microbatches < 1:
        raise UserError(f"--microbatches {args.microbatches}: not a number of microbatches; give at least 1")
    if args.microbatches is not None and args.schedule in ("plan", "trivial"):
        raise UserError(
            f"--microbatches {args.microbatches}: only for a rebuilt --schedule accumulate or overlapped, not "
            f"--schedule {args.schedule}; add one of those or drop --microbatches"
        )
    if args.schedule == "accumulate" and (args.microbatches or 1) < 2:
        raise UserError("--schedule accumulate: one microbatch is the trivial schedule; give --microbatches 2 or more")
    whole = load_plan(args.plan)
    if not whole.is_single:
        return run_pipeline(args, whole, straggler)
    plan = whole.only
    world = 1
    for d in plan.mesh_shape:
        world *= d
    mb = args.microbatches or 1
    schedule = {
        "plan": lambda: plan.step_schedule(),
        "trivial": lambda: sched.trivial(world),
        "accumulate": lambda: sched.accumulate(world, mb),
        "overlapped": lambda: sched.overlapped(plan, mb),
        "duplex": lambda: sched.duplex(plan),
    }[args.schedule]()
    if args.schedule == "duplex" and args.microbatches not in (None, 2):
        raise UserError(f"--schedule duplex interleaves 2 microbatches; drop --microbatches {args.microbatches}")
    result = simulate(plan, cluster=args.cluster, schedule=schedule, straggler=straggler)
    # duplex: the same two microbatches one after the other, for the comparison and the second timeline
    base = (
        simulate(plan, cluster=args.cluster, schedule=sched.accumulate(world, 2), straggler=straggler)
        if schedule.name == sched.DUPLEX
        else None
    )

    t = plan.time
    table = Table(title=f"Simulated step: {schedule.name} schedule, {schedule.microbatches} microbatch(es)")
    for col in ("ranks", "compute", "exposed comm", "hidden comm", "overlap ratio", "idle", "ends at"):
        table.add_column(col, justify="left" if col == "ranks" else "right")
    for c in result.classes:
        table.add_row(
            f"{c.label} ({len(c.ranks)})",
            fmt_s(c.compute_s),
            fmt_s(c.exposed_comm_s),
            fmt_s(c.hidden_comm_s),
            f"{c.overlap_ratio:.0%}",
            fmt_s(max(c.idle_s, 0.0)),
            fmt_s(c.end_s),
        )
    table.add_section()
    table.add_row("[bold]step[/bold]", "", "", "", "", "", f"[bold]{fmt_s(result.step_s)}[/bold]")
    console.print(table)
    ratio = result.step_s / t.overlapped_s if t.overlapped_s else float("nan")
    console.print(
        f"closed form (one microbatch as planned; gradient buckets overlapped, nothing else): "
        f"{fmt_s(t.overlapped_s)}; simulated / closed form "
        f"{ratio:.3f}. {result.world} ranks simulated as {result.sim_ranks} class(es) in {result.wall_s:.3f} s "
        f"({result.num_events} events)"
        + (f"; stragglers {', '.join(f'{r}: {p:+g}%' for r, p in sorted(straggler.items()))}" if straggler else "")
    )
    if base is not None:
        worst = min(result.classes, key=lambda c: c.overlap_ratio)
        console.print(
            f"without duplex (accumulate, 2 microbatches): step {fmt_s(base.step_s)}, overlap ratio "
            f"{max(c.overlap_ratio for c in base.classes):.0%}; duplex: {fmt_s(result.step_s)} "
            f"({(1 - result.step_s / base.step_s) if base.step_s else 0.0:.1%} less), overlap ratio "
            f"{worst.overlap_ratio:.0%} (lowest over rank classes; HiDup Table 4: overlapped ÷ min(compute, comm))"
        )
    if args.trace:
        result.write_trace(args.trace)
        console.print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
    if args.png:
        if base is not None:
            write_timelines([result, base], args.png)
            console.print(f"timelines (duplex above, without below): {args.png}")
        else:
            result.write_png(args.png)
            console.print(f"timeline: {args.png}")
    return 0


def run_pipeline(args: argparse.Namespace, pp, straggler: dict[int, float]) -> int:
    """A pipeline plan (``meshpilot plan --out pp.json`` with stages): its schedule simulated with one stand-in
    rank per stage (``Plan.simulate``), each boundary's transfer sent over the link between the stages,
    and a table of those transfers."""
    from meshpilot.cli.plan import fmt_s
    from meshpilot.io import fmt_size

    if args.schedule != "plan" or args.microbatches is not None or straggler:
        raise UserError("a pipeline plan simulates its own schedule: drop --schedule, --microbatches and --straggler")
    result = pp.simulate(args.cluster or None)
    table = Table(title=f"Simulated step: {pp.schedule.value}, {pp.microbatches} microbatches, {len(pp.stages)} stages")
    for col in ("stage (ranks)", "compute", "sends (exposed)", "idle", "ends at"):
        table.add_column(col, justify="left" if col.startswith("stage") else "right")
    for c in result.classes:
        g = pp.groups[c.ranks[0]]
        table.add_row(f"{c.ranks[0]} ({g[0]}-{g[-1]})", fmt_s(c.compute_s), fmt_s(c.exposed_comm_s),
                      fmt_s(max(c.idle_s, 0.0)), fmt_s(c.end_s))  # fmt: skip
    table.add_section()
    table.add_row("[bold]step[/bold]", "", "", "", f"[bold]{fmt_s(result.step_s)}[/bold]")
    console.print(table)
    tt = Table(title="Transfers per microbatch at each stage boundary (priced in the step above)")
    for col in ("from → to", "what", "values", "bytes", "over the link"):
        tt.add_column(col, justify="right" if col in ("values", "bytes", "over the link") else "left")
    for x in pp.transfers:
        tt.add_row(f"{x.src} → {x.dst}", "activations" if x.forward else "gradients", str(len(x.values)),
                   fmt_size(x.nbytes), fmt_s(x.seconds))  # fmt: skip
    if not pp.transfers:
        tt.add_row("—", "none recorded (a plan saved before transfers were kept: sends of 0 bytes)", "", "", "")
    console.print(tt)
    if pp.send_split > 1:
        console.print(f"each transfer sent as {pp.send_split} shares, one per rank's own link (the plan's send_split)")
    console.print(
        f"Eq. 2 (no sends, no schedule): {fmt_s(pp.step_s)}; simulated / Eq. 2 {result.step_s / pp.step_s:.3f}"
    )
    if args.trace:
        result.write_trace(args.trace)
        console.print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
    if args.png:
        result.write_png(args.png)
        console.print(f"timeline: {args.png}")
    return 0
