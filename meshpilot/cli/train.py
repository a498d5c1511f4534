"""`meshpilot train`: a few real training steps of a built-in GPT under torchrun, with ATP on a given mesh.

Launch with torchrun, e.g.:
  torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train --model gpt-tiny --mesh 2x2 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from meshpilot.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a built-in GPT for a few steps under torchrun (ATP tensor parallelism on --mesh)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", "-m", default="gpt-tiny", help="built-in GPT (default gpt-tiny; see `meshpilot presets`)")
    p.add_argument("--mesh", default=None, help="ATP DeviceMesh d1xd2 (default: WORLDx1, Megatron-LM 1D)")
    p.add_argument("--chunks", type=int, default=1, choices=(1, 2, 4), help="ATP chunk-overlap chunks k")
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


def run(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(
            "train runs under torchrun; e.g. torchrun --standalone --nproc-per-node 4 -m meshpilot.cli.main train"
        )
    import torch.distributed as dist

    from meshpilot.models import gpt_config
    from meshpilot.runtime.train import train_atp

    cfg = gpt_config(args.model)
    world = int(os.environ["WORLD_SIZE"])
    shape = parse_mesh(args.mesh) if args.mesh else (world, 1)
    if world % (shape[0] * shape[1]):
        raise UserError(f"--mesh {args.mesh}: {shape[0] * shape[1]} devices do not divide the world size {world}")
    if cfg.batch % (world // (shape[0] * shape[1]) * args.chunks):
        raise UserError(f"batch {cfg.batch} does not split into data-parallel replicas x {args.chunks} chunks")
    dist.init_process_group("gloo")
    try:
        logs = train_atp(cfg, shape, args.steps, args.seed, args.lr, args.chunks)
        if dist.get_rank() == 0:
            for s in logs:
                print(f"step {s.step}: loss {s.loss:.6f} ({s.seconds * 1e3:.1f} ms)", flush=True)
            if args.json_out:
                tmp = args.json_out.with_name(args.json_out.name + ".tmp")
                tmp.write_text(json.dumps({"mesh": list(shape), "steps": [s.__dict__ for s in logs]}))
                tmp.replace(args.json_out)
    finally:
        dist.destroy_process_group()
    return 0
