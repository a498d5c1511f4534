"""Planning time of the issue's benchmark transformer: 32 pre-LN layers, h = 4096, 32 heads, batch 64,
sequence 2048, on 256 devices (dgx-h100:32), built on the meta device (nothing allocated).

    python benchmarks/bench_planning.py                 # fixed (32, 8) mesh, then the 2D-shape search
    python benchmarks/bench_planning.py --layers 4      # a quicker variant
    python benchmarks/bench_planning.py --no-search     # the fixed mesh only

Prints one table row per run: end-to-end seconds (capture + strategies + ILP build + HiGHS), the split,
the ILP size and its final relative gap. Targets (issue): < 5 s with gap < 1% on (32, 8); < 15 s searching.
"""

from __future__ import annotations

import argparse
import time

import torch

from meshpilot.models.zoo import PlanBenchTransformer
from meshpilot.planner.auto import plan


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cluster", default="dgx-h100:32")
    ap.add_argument("--no-search", action="store_true")
    ap.add_argument("--show", action="store_true", help="print the chosen strategies of the first layer")
    args = ap.parse_args()

    with torch.device("meta"):
        model = PlanBenchTransformer(args.layers, args.hidden, args.heads)
    x = torch.empty(args.batch, args.seq, args.hidden, device="meta")

    runs = [("fixed (32, 8)", {"mesh_shape": (32, 8), "mappings": ("row",)})]
    if not args.no_search:
        runs.append(("all 2D shapes x 2 mappings", {}))
    print(f"model: {args.layers} layers, h={args.hidden}, batch {args.batch}, seq {args.seq}; cluster {args.cluster}")
    header = f"{'run':28} {'total s':>8} {'capture':>8} {'build':>8} {'solve':>8} {'vars':>7} {'gap':>7}  mesh"
    print(header)
    print("-" * len(header))
    for label, kw in runs:
        t0 = time.perf_counter()
        p = plan(model, (x,), args.cluster, **kw)
        total = time.perf_counter() - t0
        s = p.solver
        print(
            f"{label:28} {total:8.2f} {s.capture_s:8.2f} {s.build_s:8.2f} {s.solve_s:8.2f} {s.num_vars:7d} "
            f"{s.gap:7.2%}  {p.mesh_shape} {p.mapping}"
        )
        print("   " + p.summary().replace("\n", "\n   "))
        if args.show:
            for line in p.strategy_lines()[:40]:
                print("     " + line)


if __name__ == "__main__":
    main()
