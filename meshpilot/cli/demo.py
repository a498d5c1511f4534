"""`meshpilot demo`: the tour. A preset cluster's hierarchy and mesh bandwidths, ATP's mesh choice for a GPT
on it, then real training of a tiny GPT on that choice on 4 local gloo processes (launched with torchrun),
its loss next to the single-device loss."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.panel import Panel
from rich.table import Table

from meshpilot.cli.common import console
from meshpilot.cluster import load_cluster
from meshpilot.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="the tour: topology, ATP's mesh choice, real 4-process training", description=__doc__
    )
    p.add_argument("--cluster", "-c", default="atp-ic1-calibrated", help="preset or file (default atp-ic1-calibrated)")
    p.add_argument("--model", "-m", default="atp-m2", help="GPT whose mesh is searched (default atp-m2)")
    p.add_argument("--steps", type=int, default=5, help="training steps of the tiny GPT (default 5)")
    p.add_argument("--procs", type=int, default=4, help="local gloo processes (default 4)")
    p.add_argument("--no-train", action="store_true", help="stop after the analysis (no processes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshpilot.cli import atp as atp_cli
    from meshpilot.cli import topology as topo_cli

    cluster = load_cluster(args.cluster)
    console.print(Panel.fit(f"1. The cluster: {cluster.name}, ATP's hierarchical communication matrix"))
    topo_cli.run(argparse.Namespace(cluster=args.cluster, devices=None, json=False))
    console.print(Panel.fit(f"2. ATP's mesh search for {args.model} on all {cluster.num_devices} devices (Eq. 2-4)"))
    atp_cli.run(
        argparse.Namespace(
            sweep=False,
            cluster=args.cluster,
            devices=None,
            model=args.model,
            layers=None,
            hidden=None,
            heads=None,
            batch=None,
            seq=None,
            dtype="float16",
            json=False,
        )
    )
    if args.no_train:
        return 0
    return train_tiny(cluster, args)


def train_tiny(cluster, args: argparse.Namespace) -> int:
    from meshpilot.models import gpt_config
    from meshpilot.planner.atp import search
    from meshpilot.runtime.train import train_single

    n = args.procs
    if n > cluster.num_devices:
        raise UserError(f"--procs {n}: cluster {cluster.name!r} has only {cluster.num_devices} devices")
    cfg = gpt_config("gpt-tiny")
    mesh = search(cluster, n, gpt_config(args.model)).chosen.mesh
    console.print(
        Panel.fit(
            f"3. Real training: gpt-tiny (L={cfg.layers}, h={cfg.hidden}, {cfg.heads} heads) with ATP on "
            f"DeviceMesh{mesh} — ATP's choice for {n} devices of {cluster.name} — on {n} local gloo processes"
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "losses.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            "-m",
            "meshpilot.cli.main",
            "train",
            "--model",
            "gpt-tiny",
            "--mesh",
            f"{mesh[0]}x{mesh[1]}",
            "--steps",
            str(args.steps),
            "--json-out",
            str(out),
        ]
        console.print("[dim]$ " + " ".join(cmd[2:]).replace("torch.distributed.run", "torchrun") + "[/dim]")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        with console.status(f"training on {n} processes …"):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise UserError(f"the {n}-process training run failed (exit {proc.returncode}); its output is above")
        parallel = json.loads(out.read_text())["steps"]
    with console.status("single-device reference …"):
        single = train_single(cfg, args.steps)
    t = Table(title=f"gpt-tiny, AdamW: ATP DeviceMesh{mesh} on {n} processes vs one device")
    for col in ("step", f"loss, {n} processes", "loss, 1 device", "|difference|"):
        t.add_column(col, justify="right")
    worst = 0.0
    for p, s in zip(parallel, single):
        diff = abs(p["loss"] - s.loss)
        worst = max(worst, diff)
        t.add_row(str(p["step"]), f"{p['loss']:.6f}", f"{s.loss:.6f}", f"{diff:.2e}")
    console.print(t)
    verdict = "[green]the same[/green]" if worst <= 1e-5 else "[red]different[/red]"
    console.print(f"largest difference {worst:.2e}: {verdict} loss as the single-device model (tolerance 1e-5)")
    return 0 if worst <= 1e-5 else 1
