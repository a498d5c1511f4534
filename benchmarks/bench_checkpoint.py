"""Checkpoints: planning a reshard offline for a 1.3B GPT, and saving / loading against plain ``torch.save``.

**Reshard plan.**
Alpa's GPT-1.3B shape (24 layers, h = 2048, 32 heads, vocabulary 51,200, sequence 1024) is captured on the
meta device and planned twice on ``dgx-h100``: once for 8 devices as (2, 4) and once for 4 devices as
(4, 1). ``meshpilot.planner.reshard_checkpoint.plan_reshard`` then lists which box of every parameter (and its
two AdamW states) each rank of the second plan reads from which rank of the first — what ``train --resume``
on the other plan loads. The table shows the reshard plan's size and the time to compute it (target: under
1 s), best of `--repeat`.

**Save and load** (``--io``): a GPT (L=8, h=512, vocab 8192: 33 M parameters, with AdamW 400 MB) planned
for 4 devices as (2, 2) and run on 4 local gloo processes after one AdamW step; ``meshpilot.runtime.checkpoint``
``save`` (DCP, every rank writing its shards, fsynced, then the manifest and the rename) and ``load`` (DCP
into a fresh model and optimizer, here on the same plan), against one process ``torch.save`` / ``torch.load``
of the same model's and optimizer's full state dicts, fsynced. Medians of `--repeat` runs, interleaved.

    python benchmarks/bench_checkpoint.py            # the reshard plan
    python benchmarks/bench_checkpoint.py --io       # and save / load times
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
from rich.console import Console
from rich.table import Table

from meshpilot.graph.capture import NodeKind, capture
from meshpilot.models.gpt import GPT, GPTConfig
from meshpilot.planner.auto import plan
from meshpilot.planner.reshard_checkpoint import plan_reshard

GPT_1_3B = GPTConfig(vocab=51200, seq=1024, layers=24, hidden=2048, heads=32, batch=8)
PAIRS = [((2, 4), (4, 1)), ((4, 1), (2, 4)), ((2, 4), (1, 4))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="dgx-h100")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--io", action="store_true", help="also time save and load against torch.save")
    args = ap.parse_args()
    console = Console()
    cfg = GPT_1_3B
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.empty(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, (idx, idx))
        meshes = {s for pair in PAIRS for s in pair}
        plans = {s: plan(model, (idx, idx), args.cluster, mesh_shape=s, graph=graph) for s in sorted(meshes)}
    setup_s = time.perf_counter() - t0
    shapes = {n.fqn: (n.out.shape, n.out.itemsize) for n in graph.nodes if n.kind == NodeKind.PARAM}
    n_params = sum(torch.Size(s).numel() for s, _ in shapes.values())
    load = os.getloadavg()[0]
    table = Table(title=f"Offline reshard of a GPT-1.3B checkpoint ({n_params / 1e9:.2f} B parameters + AdamW)")
    for col in ("saved on", "loaded on", "pieces", "GiB moved", "from own shard", "from others", "plan ms"):
        table.add_column(col, justify="right")
    for a, b in PAIRS:
        best = None
        for _ in range(args.repeat):
            rp = plan_reshard(plans[a], plans[b], shapes)
            best = rp if best is None or rp.seconds < best.seconds else best
        gib = 1024**3
        table.add_row(
            f"{a} ({len(plans[a].mesh_ranks)} ranks)",
            f"{b} ({len(plans[b].mesh_ranks)} ranks)",
            str(len(best.pieces)),
            f"{best.total_bytes / gib:.2f}",
            f"{best.local_bytes / gib:.2f}",
            f"{best.remote_bytes / gib:.2f}",
            f"{best.seconds * 1e3:.1f}",
        )
    console.print(table)
    console.print(f"[dim]capture + planning the {len(plans)} plans: {setup_s:.1f} s; load {load:.2f}[/dim]")
    if args.io:
        io_table(console, args.repeat)


IO_GPT = GPTConfig(vocab=8192, seq=128, layers=8, hidden=512, heads=8, batch=8)


def _model_and_batch():
    torch.manual_seed(0)
    model = GPT(IO_GPT)
    idx = torch.randint(0, IO_GPT.vocab, (IO_GPT.batch, IO_GPT.seq + 1), generator=torch.Generator().manual_seed(1))
    return model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _rank_io(rank: int, world: int, store_path: str, plan_json: str, folder: str, repeat: int, out: str) -> None:
    import json
    import statistics

    import torch.distributed as dist

    from meshpilot.planner.plan import Plan
    from meshpilot.runtime import checkpoint
    from meshpilot.runtime.spmd import parallelize
    from meshpilot.runtime.train import adamw

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    model, batch = _model_and_batch()
    pm = parallelize(model, Plan.from_json(plan_json))
    opt = adamw(pm.parameters(), 1e-3)
    pm(*batch).backward()
    opt.step()
    saves, loads = [], []
    for i in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        path = checkpoint.save(folder, pm, opt, step=i + 1, position=0)
        saves.append(time.perf_counter() - t0)
        fresh, _ = _model_and_batch()
        pm2 = parallelize(fresh, Plan.from_json(plan_json))
        opt2 = adamw(pm2.parameters(), 1e-3)
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.load(path, pm2, opt2)
        loads.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"save": statistics.median(saves), "load": statistics.median(loads)}, f)
    dist.destroy_process_group()


def io_table(console: Console, repeat: int) -> None:
    import json
    import statistics
    import tempfile

    import torch.multiprocessing as mp

    from meshpilot.runtime.train import adamw

    model, batch = _model_and_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(model, batch, "atp-ic3", mesh_shape=(2, 2))
    opt = adamw(model.parameters(), 1e-3)
    model(*batch).backward()
    opt.step()
    n_params = sum(t.numel() for t in model.parameters())
    with tempfile.TemporaryDirectory(prefix="meshpilot-bench-ckpt-") as tmp:
        out = os.path.join(tmp, "times.json")
        args = (4, os.path.join(tmp, "store"), p.to_json(), os.path.join(tmp, "dcp"), repeat, out)
        mp.spawn(_rank_io, args=args, nprocs=4, join=True)
        with open(out) as f:
            dcp = json.load(f)
        saves, loads = [], []
        for i in range(repeat):
            path = os.path.join(tmp, f"plain-{i}.pt")
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
            _fsync_tree(tmp)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state = torch.load(path, weights_only=True)
            fresh, _ = _model_and_batch()
            fresh.load_state_dict(state["model"])
            loads.append(time.perf_counter() - t0)
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(tmp, "dcp")) for f in fs)
    size /= repeat
    table = Table(
        title=f"Save and load: GPT {n_params / 1e6:.0f} M parameters + AdamW, {size / 1e6:.0f} MB per checkpoint"
    )
    for col in ("", "save s", "load s"):
        table.add_column(col, justify="right")
    table.add_row("meshpilot checkpoint, 4 ranks, plan (2, 2) (DCP)", f"{dcp['save']:.3f}", f"{dcp['load']:.3f}")
    table.add_row(
        "torch.save / torch.load, 1 process", f"{statistics.median(saves):.3f}", f"{statistics.median(loads):.3f}"
    )
    console.print(table)
    console.print(f"[dim]load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs[/dim]")


if __name__ == "__main__":
    main()
