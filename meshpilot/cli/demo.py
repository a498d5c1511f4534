"""`meshpilot demo`: the tour. A preset cluster's hierarchy, ATP's mesh choice for a GPT on it, then automatic
sharding: `meshpilot.plan` plans a tiny GPT for 4 of the cluster's devices (per-operator ILP over every mesh
shape), prints the plan, saves it and draws its simulated step (a PNG timeline); `meshpilot train --plan` trains
the GPT with that plan for real on 4 local gloo processes (torchrun) and checkpoints it halfway, and a second run
resumes that checkpoint under a plan on another mesh; the whole loss curve next to the single-device loss.
Exits with 1 if the losses differ by more than 1e-5."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.panel import Panel
from rich.table import Table

from meshpilot.cli.common import console, path_arg, positive_int
from meshpilot.cli.main import COMMANDS
from meshpilot.cluster import GB, load_cluster
from meshpilot.errors import UserError
from meshpilot.io import check_writable

TOLERANCE = 1e-5
TRAIN_MODEL = "gpt-tiny"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help=COMMANDS["demo"],
        description=__doc__,
    )
    p.add_argument("--cluster", "-c", default="atp-ic1-calibrated", help="preset or file (default atp-ic1-calibrated)")
    p.add_argument("--model", "-m", default="atp-m2", help="GPT whose ATP mesh is searched (default atp-m2)")
    p.add_argument("--steps", type=positive_int, default=5, help="training steps of the tiny GPT (default 5)")
    p.add_argument(
        "--procs", type=positive_int, default=4, help="devices planned for = local gloo processes (default 4)"
    )
    p.add_argument(
        "--plan-out",
        type=path_arg,
        help="keep the plan here and its simulated timeline beside it (default: the plan in a temporary folder, "
        "the timeline in the system's temporary directory as meshpilot-demo-step.png)",
    )
    p.add_argument("--no-train", action="store_true", help="stop after the plan (no processes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    cluster = load_cluster(args.cluster)
    n = args.procs
    if not 1 <= n <= cluster.num_devices:
        raise UserError(f"--procs {n}: cluster {cluster.name!r} has {cluster.num_devices} devices; pick 1..that")
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: give at least 1 step")
    if args.plan_out:
        check_writable(args.plan_out, "--plan-out")
    show_cluster(cluster)
    show_atp(cluster, args.model)

    from meshpilot.cli.plan import build_model, make_plan, render, save_plan

    console.print(
        Panel.fit(
            f"3. Automatic sharding: meshpilot.plan({TRAIN_MODEL}, cluster={cluster.name}, num_devices={n}) — "
            "every operator's layout on every 2D mesh, by Alpa's ILP"
        )
    )
    built = build_model(TRAIN_MODEL)
    plan, graph = make_plan(built, cluster, n, None, progress=console)
    render(plan, graph, built.label, n, console, ops="none")
    console.print(
        f"[dim]every operator's strategy: meshpilot plan --model {TRAIN_MODEL} --cluster {args.cluster} "
        f"--devices {n}[/dim]"
    )
    with tempfile.TemporaryDirectory(prefix="meshpilot-demo-") as tmp:
        path = args.plan_out or Path(tmp) / "plan.json"
        save_plan(plan, path, "--plan-out")
        console.print(f"saved the plan to {path}")
        png = path.with_suffix(".png") if args.plan_out else Path(tempfile.gettempdir()) / "meshpilot-demo-step.png"
        show_timeline(plan, cluster, png)
        if args.no_train:
            return 0
        other = other_mesh(plan.mesh_shape, n)
        with console.status(f"planning again on DeviceMesh{other} for the resumed run …"):
            second, _ = make_plan(built, cluster, n, other, graph=graph)
        second_path = Path(tmp) / "plan-resume.json"
        save_plan(second, second_path, "plan")
        code = train_with_plan((plan, path), (second, second_path), Path(tmp), args.steps, n)
    console.print(f"[dim]demo took {time.perf_counter() - t_start:.0f} s[/dim]")
    return code


def other_mesh(shape: tuple[int, ...], n: int) -> tuple[int, int]:
    """A 2D mesh of `n` devices other than `shape`: where the resumed run goes."""
    from meshpilot.cluster import mesh_shapes_2d

    return next((tuple(s) for s in mesh_shapes_2d(n) if tuple(s) != tuple(shape)), (n, 1))


def show_timeline(plan, cluster, png: Path) -> None:
    """The plan's step as the simulator plays it (``meshpilot simulate``), drawn to `png`."""
    from meshpilot.sim import simulate

    result = simulate(plan, cluster=cluster)
    result.write_png(png)
    console.print(
        f"simulated step {result.step_s * 1e6:.1f} µs (closed form {plan.time.total_s * 1e6:.1f} µs); "
        f"its timeline: {png}"
    )


def show_cluster(cluster) -> None:
    console.print(Panel.fit(f"1. The cluster: {cluster.name}, {cluster.num_devices} x {cluster.device.kind}"))
    t = Table(title="its hierarchy, top-down (`meshpilot topology` derives every mesh's bandwidths from it)")
    for col in ("layer", "ranks", "P2P GB/s", "group GB/s", "latency µs"):
        t.add_column(col, justify="right" if col != "layer" else "left")
    for layer in cluster.layers:
        off = layer.p2p[~np.eye(layer.ranks, dtype=bool)]
        p2p = (
            "—"
            if off.size == 0
            else f"{off.min() / GB:g}" + ("" if off.min() == off.max() else f" … {off.max() / GB:g}")
        )
        grp = f"{layer.group_bw.min() / GB:g}" + (
            "" if layer.group_bw.min() == layer.group_bw.max() else f" … {layer.group_bw.max() / GB:g}"
        )
        t.add_row(layer.name, str(layer.ranks), p2p, grp, f"{layer.latency * 1e6:g}")
    console.print(t)


def show_atp(cluster, model: str) -> None:
    from meshpilot.models import gpt_config
    from meshpilot.planner.atp import search

    cfg = gpt_config(model)
    n = cluster.num_devices
    r = search(cluster, n, cfg)
    console.print(Panel.fit(f"2. ATP's mesh search for {model} on all {n} devices (Eq. 2-4; `meshpilot atp`)"))
    base = r.baseline.t_comm_s
    parts = [
        f"{'★' if c is r.chosen else ''}({c.mesh[0]}, {c.mesh[1]}) {c.t_comm_s * 1e3:.1f} ms"
        + (f" {c.t_comm_s / base:.2f}x" if base else "")
        for c in r.candidates
    ]
    console.print("T_comm per step, vs Megatron-LM's (N, 1): " + " · ".join(parts))
    console.print(
        f"ATP picks DeviceMesh{r.chosen.mesh}: predicted communication speedup {r.speedup:.2f}x over DeviceMesh({n}, 1)"
    )


def _launch(cmd: list[str], n: int, what: str) -> None:
    console.print("[dim]$ " + " ".join(cmd[2:]).replace("torch.distributed.run", "torchrun") + "[/dim]")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with console.status(f"{what} on {n} processes …"):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise UserError(f"the {n}-process run ({what}) failed (exit {proc.returncode}); its output is above")


def train_with_plan(first: tuple, second: tuple, tmp: Path, steps: int, n: int) -> int:
    """Train `steps` steps: the first half under `first` (plan, path) with a checkpoint, the rest resumed under
    `second` on another mesh; the curve next to one device's."""
    from meshpilot.models import gpt_config
    from meshpilot.runtime.train import train_single

    (plan, path), (plan2, path2) = first, second
    cfg = gpt_config(TRAIN_MODEL)
    mesh, mesh2 = (", ".join(str(d) for d in p.mesh_shape) for p in (plan, plan2))
    half = max(1, steps // 2)
    console.print(
        Panel.fit(
            f"4. Real training: {TRAIN_MODEL} (L={cfg.layers}, h={cfg.hidden}, {cfg.heads} heads, b={cfg.batch}, "
            f"s={cfg.seq}) — meshpilot.parallelize on {n} local gloo processes, AdamW: steps 0-{half - 1} on "
            f"DeviceMesh({mesh}) with a checkpoint, then resumed on DeviceMesh({mesh2})"
            + (f" for steps {half}-{steps - 1}" if steps > half else "")
        )
    )
    out, ckpt = tmp / "losses.json", tmp / "checkpoints"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]

    def train(plan_path: Path, upto: int, *extra: str) -> list[str]:
        cmd = [*torchrun, "-m", "meshpilot.cli.main", "train", "--plan", str(plan_path), "--model", TRAIN_MODEL]
        return cmd + ["--steps", str(upto), "--checkpoint-dir", str(ckpt), *extra, "--json-out", str(out)]

    t0 = time.perf_counter()
    _launch(train(path, half), n, "training")
    if steps > half:
        _launch(train(path2, steps, "--resume"), n, f"resuming on DeviceMesh({mesh2})")
    parallel = json.loads(out.read_text())["steps"]
    train_s = time.perf_counter() - t0
    with console.status("single-device reference …"):
        single = train_single(cfg, steps)
    title = f"{TRAIN_MODEL}, AdamW: the plans on {n} processes vs one device ({train_s:.0f} s for the launches)"
    t = Table(title=title)
    for col in ("step", "mesh", f"loss, {n} processes", "loss, 1 device", "|difference|"):
        t.add_column(col, justify="right")
    worst = 0.0
    for p, s in zip(parallel, single):
        diff = abs(p["loss"] - s.loss)
        worst = max(worst, diff)
        where = f"({mesh})" if p["step"] < half else f"({mesh2}) resumed"
        t.add_row(str(p["step"]), where, f"{p['loss']:.6f}", f"{s.loss:.6f}", f"{diff:.2e}")
    console.print(t)
    if len(parallel) != len(single):
        console.print(f"[red]the {n}-process runs logged {len(parallel)} steps, expected {len(single)}[/red]")
        return 1
    ok = worst <= TOLERANCE
    verdict = "[green]the same[/green]" if ok else "[red]different[/red]"
    console.print(
        f"largest difference {worst:.2e}: {verdict} loss as the single-device model (tolerance {TOLERANCE:g}), "
        "across the checkpoint and the change of mesh"
    )
    return 0 if ok else 1
