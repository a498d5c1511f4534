"""`meshpilot train`: a few real training steps of a built-in GPT under torchrun, with ATP on a given mesh or
with a saved `meshpilot plan` (run by `meshpilot.parallelize`).

Launch with torchrun, e.g.:
  torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train --model gpt-tiny --mesh 2x2 --steps 5
  meshpilot plan --model gpt-tiny --cluster atp-ic3 --devices 4 --out plan.json
  torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train --model gpt-tiny --plan plan.json

With --plan the batch size and sequence length come from the plan (the shapes it was made for); --model and
its --layers/--hidden/--heads must describe the model the plan was made for (its graph fingerprint is checked).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from meshpilot.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a built-in GPT for a few steps under torchrun (ATP on --mesh, or a saved --plan)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", "-m", default="gpt-tiny", help="built-in GPT (default gpt-tiny; see `meshpilot presets`)")
    p.add_argument("--layers", type=int, help="override the GPT's layer count")
    p.add_argument("--hidden", type=int, help="override the GPT's hidden size")
    p.add_argument("--heads", type=int, help="override the GPT's attention heads")
    p.add_argument("--mesh", default=None, help="ATP DeviceMesh d1xd2 (default: WORLDx1, Megatron-LM 1D)")
    p.add_argument("--chunks", type=int, default=1, choices=(1, 2, 4), help="ATP chunk-overlap chunks k")
    p.add_argument(
        "--plan",
        type=Path,
        metavar="FILE",
        help="run this saved plan (`meshpilot plan --out FILE`) with meshpilot.parallelize instead of ATP",
    )
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the per-step losses and times here as JSON")
    p.set_defaults(func=run)


def parse_mesh(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--mesh {text!r}: write two positive sizes as d1xd2, e.g. 2x2")
    return int(parts[0]), int(parts[1])


def load_plan(path: Path):
    """A saved Plan, or a one-line UserError saying what is wrong with the file."""
    from meshpilot.planner.plan import Plan

    if not path.is_file():
        raise UserError(f"--plan {path}: no such file; write one with `meshpilot plan ... --out {path}`")
    try:
        return Plan.load(path)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--plan {path}: not a meshpilot plan ({type(e).__name__}: {e})") from None


def run(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "train runs under torchrun; e.g. torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train"
        )
    if args.steps < 1:
        raise UserError(f"--steps {args.steps}: give at least 1 step")
    from meshpilot.models import gpt_config

    cfg = gpt_config(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads)
    world = int(os.environ["WORLD_SIZE"])
    if args.plan is not None:
        if args.mesh or args.chunks != 1:
            raise UserError("--plan fixes the mesh and every layout; leave out --mesh and --chunks")
        plan = load_plan(args.plan)
        n = 1
        for d in plan.mesh_shape:
            n *= d
        if n != world:
            raise UserError(
                f"--plan {args.plan}: planned for {n} devices (mesh {plan.mesh_shape}) but torchrun started "
                f"{world} processes; launch with --nproc-per-node {n}"
            )
        (b, t), _ = plan.input_shapes[0]
        cfg = replace(cfg, batch=int(b), seq=int(t))
        return _train(args, world, plan=plan, cfg=cfg)
    shape = parse_mesh(args.mesh) if args.mesh else (world, 1)
    if world % (shape[0] * shape[1]):
        raise UserError(f"--mesh {args.mesh}: {shape[0] * shape[1]} devices do not divide the world size {world}")
    if cfg.batch % (world // (shape[0] * shape[1]) * args.chunks):
        raise UserError(f"batch {cfg.batch} does not split into data-parallel replicas x {args.chunks} chunks")
    return _train(args, world, shape=shape, cfg=cfg)


def _train(args: argparse.Namespace, world: int, *, cfg, shape=None, plan=None) -> int:
    import torch.distributed as dist

    from meshpilot.runtime.train import train_atp, train_plan

    dist.init_process_group("gloo")
    try:
        if plan is not None:
            logs = train_plan(cfg, plan, args.steps, args.seed, args.lr)
            info = {"mesh": list(plan.mesh_shape), "plan": str(args.plan)}
        else:
            logs = train_atp(cfg, shape, args.steps, args.seed, args.lr, args.chunks)
            info = {"mesh": list(shape)}
        if dist.get_rank() == 0:
            for s in logs:
                print(f"step {s.step}: loss {s.loss:.6f} ({s.seconds * 1e3:.1f} ms)", flush=True)
            if args.json_out:
                tmp = args.json_out.with_name(args.json_out.name + ".tmp")
                tmp.write_text(json.dumps({**info, "steps": [s.__dict__ for s in logs]}))
                tmp.replace(args.json_out)
    finally:
        dist.destroy_process_group()
    return 0
