"""Per-rank ATP training-step benchmark: run under torchrun or `meshpilot emulate`.

For every 2D mesh shape (d1, d2) of the world (or those given by --meshes) and every chunk count k of
--chunks, builds the same GPT (same seed) as an ``ATPGPT`` on DeviceMesh(d1, d2) with ``chunks=k`` and an
AdamW optimizer, and times full training steps: forward + loss, backward, ``sync_gradients()`` (a no-op
here: the whole world is one tensor-parallel group), ``opt.step()``, ``zero_grad()``.

Timing protocol (the box is shared and noisy, so configurations are interleaved, not run back to back):

1. every configuration is built and runs --warmup untimed steps;
2. --steps rounds; in round r every configuration runs one step, in the configuration order rotated by r
   (so no configuration always runs first or last). Before each step all ranks meet at a barrier; each
   rank times its own step with ``perf_counter`` (barrier exit to ``zero_grad`` done);
3. a step's time is the slowest rank's; a configuration's result is the median over its rounds (min and
   max are reported too).

Rank 0 writes one JSON object to --out (and prints it with the prefix ``ATP_STEP_RESULT ``):
``{"world", "config", "results": [{"mesh": [d1, d2], "chunks": k, "median_s", "min_s", "max_s",
"steps_s": [...], "loss0": first warm-up loss}], ...}``. ``loss0`` is the same for every configuration
up to float summation order (a sanity check that every mesh trains the same model on the same batch).

``--fake-world N`` runs one process on torch's fake process group instead (every collective returns at
once): the computation of one rank of N with no communication at all, to split a step into compute and
communication.

Example (2 nodes x 4 ranks, slow link)::

    meshpilot emulate -c examples/clusters/emulated-2x4-slow.toml -- \\
        python benchmarks/atp_step_worker.py --out /tmp/steps.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

SHARED_OPTIONS = ("layers", "hidden", "heads", "batch", "seq", "vocab", "steps", "warmup")
"""The options `bench_atp_emulated.py` takes with the same meaning and forwards to this worker."""


def add_shared_options(
    p: argparse.ArgumentParser, steps: int = 5, warmup: int = 1, what: str = "configuration"
) -> None:
    """The GPT's size and the step counts (:data:`SHARED_OPTIONS`), for this worker and its drivers."""
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=steps, help=f"timed rounds per {what} (default {steps})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps per {what} (default {warmup})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_options(p)
    p.add_argument("--chunks", default="1,2,4", help="comma-separated chunk counts k (default 1,2,4)")
    p.add_argument(
        "--meshes",
        default="all",
        help="'all' (every 2D shape of the world) or e.g. '8x1,2x4' (default all)",
    )
    p.add_argument(
        "--chunks-meshes",
        default="all",
        help="meshes that run every k of --chunks; the others run k=1 only ('all' or e.g. '8x1,2x4')",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, help="rank 0 writes the JSON result here")
    p.add_argument(
        "--fake-world",
        type=int,
        metavar="N",
        help="no torchrun: one process on torch's fake process group of N ranks (collectives do nothing), "
        "i.e. one rank's computation without communication (losses are meaningless)",
    )
    return p.parse_args(argv)


def _parse_meshes(text: str, world: int) -> list[tuple[int, int]]:
    from meshpilot.cluster import mesh_shapes_2d

    if text == "all":
        return mesh_shapes_2d(world)
    out = []
    for part in text.split(","):
        d1, d2 = (int(x) for x in part.lower().split("x"))
        if d1 * d2 != world:
            raise SystemExit(f"--meshes {part}: d1*d2 = {d1 * d2} is not the world size {world}")
        out.append((d1, d2))
    return out


def time_round_robin(configs: list[dict], step, warmup: int, steps: int) -> tuple[list[list[float]], float, float]:
    """Time `step(c)` for every config `c` the way both emulated workers do: `warmup` untimed steps each (the
    first step's loss kept as ``c["loss0"]``), then `steps` rounds that run every config once, in an order
    rotated by one each round, each step behind a barrier; per config, the slowest rank's seconds of each
    timed step (all-reduce MAX). Returns (per-config step seconds, warm-up seconds, total seconds). Collective."""
    import torch
    import torch.distributed as dist

    t_start = time.perf_counter()
    for c in configs:
        for i in range(warmup):
            loss = step(c)
            if i == 0:
                c["loss0"] = loss
        dist.barrier()
    t_warm = time.perf_counter() - t_start
    n = len(configs)
    for r in range(steps):
        for j in range(n):
            c = configs[(j + r) % n]
            dist.barrier()
            t0 = time.perf_counter()
            step(c)
            c["times"].append(time.perf_counter() - t0)
    t_total = time.perf_counter() - t_start
    local = torch.tensor([t for c in configs for t in c["times"]], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.view(n, steps).tolist(), t_warm, t_total


def step_stats(ts: list[float]) -> dict:
    """One config's timed steps: median, min, max and all of them (seconds)."""
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "steps_s": ts}


def write_result(tag: str, out: Path | None, doc: dict, steps: int, warmup: int, t_warm: float, t_total: float) -> None:
    """Rank 0's result: `doc` (``world`` and what the worker measured) with the run's common fields, written to
    `out` (if given) and printed as one ``<tag> {json}`` line for the driver."""
    import torch
    import torch.distributed as dist

    doc = {
        "world": doc.pop("world"),
        "backend": dist.get_backend(),
        "nodes": int(os.environ.get("MESHPILOT_EMULATE_NODES", "1")),
        **doc,
        "steps": steps,
        "warmup": warmup,
        "omp_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "warmup_s": t_warm,
        "total_s": t_total,
    }
    text = json.dumps(doc)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(f"{tag} {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from meshpilot.models.gpt import GPTConfig
    from meshpilot.runtime.atp import ATPGPT, init_meshes
    from meshpilot.runtime.train import batches, reference_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(
        vocab=args.vocab,
        seq=args.seq,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        batch=args.batch,
    )
    chunk_counts = [int(k) for k in args.chunks.split(",")]
    meshes = _parse_meshes(args.meshes, world)
    chunk_meshes = set(meshes if args.chunks_meshes == "all" else _parse_meshes(args.chunks_meshes, world))
    for d1, d2 in meshes:
        if cfg.heads % (d1 * d2) or cfg.vocab % d1:
            raise SystemExit(f"DeviceMesh({d1}, {d2}): heads {cfg.heads} and vocab {cfg.vocab} must divide")
    for k in chunk_counts:
        if cfg.batch % k:
            raise SystemExit(f"--chunks {k} does not divide --batch {cfg.batch}")

    idx, tgt = batches(cfg, 1, args.seed)[0]

    # Build every configuration (the meshes' process groups are created once per mesh, collectively).
    configs = []
    for shape in meshes:
        m = init_meshes(shape)
        for k in chunk_counts if shape in chunk_meshes else [1]:
            model = ATPGPT.from_gpt(reference_model(cfg, args.seed), m.tp, chunks=k)
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
            configs.append({"mesh": shape, "chunks": k, "model": model, "opt": opt, "times": [], "loss0": None})

    def step(c: dict) -> float:
        loss = c["model"](idx, tgt)
        loss.backward()
        c["model"].sync_gradients()
        c["opt"].step()
        c["opt"].zero_grad(set_to_none=True)
        return float(loss.detach())

    per, t_warm, t_total = time_round_robin(configs, step, args.warmup, args.steps)
    if rank == 0:
        results = [
            {"mesh": list(c["mesh"]), "chunks": c["chunks"], **step_stats(ts), "loss0": c["loss0"]}
            for c, ts in zip(configs, per)
        ]
        config = {k: getattr(cfg, k) for k in ("vocab", "seq", "layers", "hidden", "heads", "batch", "dtype")}
        doc = {"world": world, "config": config, "results": results}
        write_result("ATP_STEP_RESULT", args.out, doc, args.steps, args.warmup, t_warm, t_total)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
