"""`meshpilot demo`: the tour. A preset cluster's hierarchy, ATP's mesh choice for a GPT on it, then automatic
sharding: `meshpilot.plan` plans a tiny GPT for 4 of the cluster's devices (per-operator ILP over every mesh
shape), prints the plan and saves it, and `meshpilot train --plan` trains the GPT with that plan for real on
4 local gloo processes (launched with torchrun), its loss next to the single-device loss. Exits with 1 if the
losses differ by more than 1e-5."""

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

from meshpilot.cli.common import console, positive_int
from meshpilot.cluster import GB, load_cluster
from meshpilot.errors import UserError
from meshpilot.io import check_writable

TOLERANCE = 1e-5
TRAIN_MODEL = "gpt-tiny"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the tour: topology, ATP's mesh choice, a plan for a GPT, real 4-process training with it",
        description=__doc__,
    )
    p.add_argument("--cluster", "-c", default="atp-ic1-calibrated", help="preset or file (default atp-ic1-calibrated)")
    p.add_argument("--model", "-m", default="atp-m2", help="GPT whose ATP mesh is searched (default atp-m2)")
    p.add_argument("--steps", type=positive_int, default=5, help="training steps of the tiny GPT (default 5)")
    p.add_argument(
        "--procs", type=positive_int, default=4, help="devices planned for = local gloo processes (default 4)"
    )
    p.add_argument("--plan-out", type=Path, help="keep the plan here (default: a temporary file)")
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
        if args.no_train:
            return 0
        code = train_with_plan(plan, path, Path(tmp), args.steps, n)
    console.print(f"[dim]demo took {time.perf_counter() - t_start:.0f} s[/dim]")
    return code


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


def train_with_plan(plan, path: Path, tmp: Path, steps: int, n: int) -> int:
    from meshpilot.models import gpt_config
    from meshpilot.runtime.train import train_single

    cfg = gpt_config(TRAIN_MODEL)
    mesh = ", ".join(str(d) for d in plan.mesh_shape)
    console.print(
        Panel.fit(
            f"4. Real training: {TRAIN_MODEL} (L={cfg.layers}, h={cfg.hidden}, {cfg.heads} heads, b={cfg.batch}, "
            f"s={cfg.seq}) with this plan on DeviceMesh({mesh}) — meshpilot.parallelize on {n} local gloo "
            f"processes, AdamW, {steps} steps"
        )
    )
    out = tmp / "losses.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "-m",
        "meshpilot.cli.main",
        "train",
        "--plan",
        str(path),
        "--model",
        TRAIN_MODEL,
        "--steps",
        str(steps),
        "--json-out",
        str(out),
    ]
    console.print("[dim]$ " + " ".join(cmd[2:]).replace("torch.distributed.run", "torchrun") + "[/dim]")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    with console.status(f"training on {n} processes …"):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise UserError(f"the {n}-process training run failed (exit {proc.returncode}); its output is above")
    parallel = json.loads(out.read_text())["steps"]
    train_s = time.perf_counter() - t0
    with console.status("single-device reference …"):
        single = train_single(cfg, steps)
    t = Table(title=f"{TRAIN_MODEL}, AdamW: the plan on {n} processes vs one device ({train_s:.0f} s for the launch)")
    for col in ("step", f"loss, {n} processes", "loss, 1 device", "|difference|"):
        t.add_column(col, justify="right")
    worst = 0.0
    for p, s in zip(parallel, single):
        diff = abs(p["loss"] - s.loss)
        worst = max(worst, diff)
        t.add_row(str(p["step"]), f"{p['loss']:.6f}", f"{s.loss:.6f}", f"{diff:.2e}")
    console.print(t)
    if len(parallel) != len(single):
        console.print(f"[red]the {n}-process run logged {len(parallel)} steps, expected {len(single)}[/red]")
        return 1
    ok = worst <= TOLERANCE
    verdict = "[green]the same[/green]" if ok else "[red]different[/red]"
    console.print(
        f"largest difference {worst:.2e}: {verdict} loss as the single-device model (tolerance {TOLERANCE:g})"
    )
    return 0 if ok else 1
