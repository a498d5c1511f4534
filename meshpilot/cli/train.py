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

from meshpilot.cli.common import positive_float, positive_int
from meshpilot.errors import UserError
from meshpilot.io import atomic_write, check_writable


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a built-in GPT for a few steps under torchrun (ATP on --mesh, or a saved --plan)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", "-m", default="gpt-tiny", help="built-in GPT (default gpt-tiny; see `meshpilot presets`)")
    p.add_argument("--layers", type=positive_int, help="override the GPT's layer count")
    p.add_argument("--hidden", type=positive_int, help="override the GPT's hidden size")
    p.add_argument("--heads", type=positive_int, help="override the GPT's attention heads")
    p.add_argument("--mesh", default=None, help="ATP DeviceMesh d1xd2 (default: WORLDx1, Megatron-LM 1D)")
    p.add_argument("--chunks", type=int, default=1, choices=(1, 2, 4), help="ATP chunk-overlap chunks k")
    p.add_argument(
        "--plan",
        type=Path,
        metavar="FILE",
        help="run this saved plan (`meshpilot plan --out FILE`) with meshpilot.parallelize instead of ATP",
    )
    p.add_argument("--steps", type=positive_int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--json-out", type=Path, help="rank 0 writes the per-step losses and times here as JSON")
    p.add_argument(
        "--nproc-per-node",
        type=positive_int,
        metavar="N",
        help="launch N local ranks itself (torch.distributed.run) after checking every input: mistakes end in one line",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="a collective that waits longer than S seconds (a stalled rank) ends the run, naming the ranks",
    )
    p.set_defaults(func=run)


def parse_mesh(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--mesh {text!r}: not a mesh shape; write two positive sizes as d1xd2, e.g. 2x2")
    return int(parts[0]), int(parts[1])


def load_plan(path: Path):
    """A saved Plan, or a one-line UserError saying what is wrong with the file (and which key)."""
    from meshpilot.planner.plan import Plan

    if not path.is_file() and not path.is_dir():
        raise UserError(f"--plan {path}: no such file; write one with `meshpilot plan ... --out {path}`")
    try:
        return Plan.load(path)
    except UserError as e:
        raise UserError(f"--plan {e}") from None


def _world() -> tuple[int, int]:
    """WORLD_SIZE and RANK from torchrun's environment, checked."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "train runs on several ranks: add --nproc-per-node N (meshpilot starts them), or launch under torchrun, "
            "e.g. torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train"
        )
    values = []
    for key in ("WORLD_SIZE", "RANK"):
        text = os.environ[key]
        if not text.strip().isdigit():
            raise UserError(f"environment {key}={text!r}: must be a whole number; launch with torchrun")
        values.append(int(text))
    world, rank = values
    if world < 1 or rank >= world:
        raise UserError(
            f"environment WORLD_SIZE={world}, RANK={rank}: need 0 <= RANK < WORLD_SIZE; launch with torchrun"
        )
    return world, rank


def prepare(args: argparse.Namespace, world: int) -> dict:
    """Every check that needs no process group: the flags, the plan (version, mesh, ranks, placements, world
    size, and the model's graph fingerprint), the output path. Returns _train's keyword arguments."""
    from meshpilot.models import gpt_config

    if args.json_out:
        check_writable(args.json_out, "--json-out")
    cfg = gpt_config(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads)
    if args.plan is not None:
        if args.mesh or args.chunks != 1:
            raise UserError("--plan fixes the mesh and every layout; leave out --mesh and --chunks")
        plan = load_plan(args.plan)
        graph = check_plan(plan, cfg, world, f"--plan {args.plan}")
        (b, t), _ = plan.input_shapes[0]
        return {"plan": plan, "graph": graph, "cfg": replace(cfg, batch=int(b), seq=int(t))}
    shape = parse_mesh(args.mesh) if args.mesh else (world, 1)
    if world % (shape[0] * shape[1]):
        raise UserError(
            f"--mesh {args.mesh}: {shape[0] * shape[1]} devices do not divide the world size {world}; "
            "give a mesh whose size divides it"
        )
    if cfg.batch % (world // (shape[0] * shape[1]) * args.chunks):
        raise UserError(
            f"batch {cfg.batch} does not split into data-parallel replicas x {args.chunks} chunks; "
            "change --mesh or --chunks"
        )
    return {"shape": shape, "cfg": cfg}


def check_plan(plan, cfg, world: int, source: str):
    """validate_plan against the world size and the GPT `cfg` captured on meta tensors at the plan's input
    shapes (a plan for another model fails here, before any process group); returns the graph."""
    import torch

    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT
    from meshpilot.planner.validate import validate_plan

    validate_plan(plan, world_size=world, source=source)
    shapes = [tuple(s) for s, _ in plan.input_shapes]
    if len(shapes) != 2 or any(len(s) != 2 for s in shapes):
        raise UserError(
            f"{source}: input_shapes {shapes}: train runs GPTs, whose inputs are two [batch, seq] token tensors; "
            "give a plan made for a GPT (`meshpilot plan --model gpt-tiny ...`)"
        )
    b, t = shapes[0]
    cfg = replace(cfg, batch=int(b), seq=int(t))
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.empty(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
    graph = capture(model, (idx, idx), precision=plan.precision or None)
    validate_plan(plan, graph=graph, source=source)
    return graph


def run(args: argparse.Namespace) -> int:
    if args.nproc_per_node:
        if "RANK" in os.environ:
            raise UserError("--nproc-per-node starts the ranks itself; leave it out under torchrun")
        prepare(args, args.nproc_per_node)
        from meshpilot.cli.launcher import launch

        return launch(_without_nproc(getattr(args, "argv", None) or []), args.nproc_per_node)
    world, rank = _world()
    try:
        prep = prepare(args, world)
    except UserError:
        if rank != 0:  # every rank finds the same mistake: rank 0 alone says it (given time to, before
            import time  # torchrun stops the job at this rank's exit)

            time.sleep(5)
            raise SystemExit(2) from None
        raise
    return _train(args, world, **prep)


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def _train(args: argparse.Namespace, world: int, *, cfg, shape=None, plan=None, graph=None) -> int:
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    from meshpilot.runtime.train import train_atp, train_plan

    if args.timeout:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    else:
        dist.init_process_group("gloo")
    stall = os.environ.get("MESHPILOT_TEST_STALL_RANK")  # tests: this rank sleeps past --timeout
    if stall is not None and int(stall) == dist.get_rank():
        import time

        time.sleep(3 * (args.timeout or 1))
    try:
        if plan is not None:
            logs = train_plan(cfg, plan, args.steps, args.seed, args.lr, graph=graph)
            info = {"mesh": list(plan.mesh_shape), "plan": str(args.plan)}
        else:
            logs = train_atp(cfg, shape, args.steps, args.seed, args.lr, args.chunks)
            info = {"mesh": list(shape)}
        if dist.get_rank() == 0:
            for s in logs:
                print(f"step {s.step}: loss {s.loss:.6f} ({s.seconds * 1e3:.1f} ms)", flush=True)
            if args.json_out:
                atomic_write(args.json_out, json.dumps({**info, "steps": [s.__dict__ for s in logs]}))
    except RuntimeError as e:
        if args.timeout and _is_timeout(e):
            # one line naming this rank; the launcher merges the ranks' lines. The group may be broken:
            # leave without destroy_process_group, which could wait on the silent rank.
            print(
                f"meshpilot train: error: rank {dist.get_rank()}: a collective timed out after {args.timeout:g} s "
                "(another rank stopped answering); raise --timeout if the steps are just slow",
                file=sys.stderr,
                flush=True,
            )
            os._exit(124)
        raise
    dist.destroy_process_group()
    return 0


def _is_timeout(e: BaseException) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text
