"""Checkpoints across plans: how long planning a reshard takes, offline, for a 1.3B GPT.

Alpa's GPT-1.3B shape (24 layers, h = 2048, 32 heads, vocabulary 51,200, sequence 1024) is captured on the
meta device and planned twice on ``dgx-h100``: once for 8 devices as (2, 4) and once for 4 devices as
(4, 1). ``meshpilot.planner.reshard_checkpoint.plan_reshard`` then lists which box of every parameter (and its
two AdamW states) each rank of the second plan reads from which rank of the first — what ``train --resume``
on the other plan loads. The table shows the reshard plan's size and the time to compute it (target: under
1 s), best of `--repeat`.

    python benchmarks/bench_checkpoint.py
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


if __name__ == "__main__":
    main()
