"""Planning a pipeline (Alpa §5: layer clustering + stage-mesh DP, ``meshpilot.planner.pipeline``) for
gpt-tiny and a mid-size GPT on the meta device, on the ``alpa-p3x8`` preset (8 V100 per node, 25 Gbps).

    python benchmarks/bench_pipeline_plan.py                       # both models, 8 and 16 devices
    python benchmarks/bench_pipeline_plan.py --devices 8 --clusters 4
    python benchmarks/bench_pipeline_plan.py --compare --mid-layers 8 16 --devices 16 --models mid

A GPT of 4 blocks or more takes ``plan_pipeline``'s repeated-stack path (``planner.stack``) unless ``--exact``
(every layer range searched, as before that path existed). With ``--compare`` each row is planned twice
back to back, first with every layer range searched on its own (``StagePlanner(share_identical=False)``,
the planner before identical ranges shared one search), then with the shared cache; the two plans must be
the same, and the row shows both times.

Each row is one ``plan_pipeline`` call end to end after capture (clustering, every stage search, the DP):
the stages chosen (layers, submesh, logical mesh), the predicted 1F1B step Σ t_i + (B−1)·max t_i, the
single-stage step on all the devices for comparison (the DP's one-stage candidate), and the planning time
(wall and this process's CPU seconds; the machine may be shared, its load average is printed first).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

from meshpilot.graph.capture import capture
from meshpilot.models import _gpt_builder, builtin_models, gpt_config
from meshpilot.planner.pipeline import plan_pipeline
from meshpilot.planner.stage import StagePlanner


def models(mid_layers: list[int], which: list[str]):
    out = []
    if "tiny" in which:
        out.append(("gpt-tiny", builtin_models()["gpt-tiny"].build, builtin_models()["gpt-tiny"].config.batch))
    for L in mid_layers if "mid" in which else ():
        mid = gpt_config("gpt", layers=L, hidden=1024, heads=16, seq=1024, batch=16)
        out.append((f"gpt L={mid.layers} h={mid.hidden} s={mid.seq}", _gpt_builder(mid), mid.batch))
    return out


def _row(p) -> tuple:
    return [(s.layers, s.ranks, s.mesh_shape, s.t_s) for s in p.stages], p.step_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument(
        "--clusters",
        type=int,
        default=6,
        help="Eq. 6's L (layer clusters); 0: every layer, as meshpilot plan --pipeline",
    )
    ap.add_argument("--mid-layers", type=int, nargs="+", default=[8])
    ap.add_argument("--models", nargs="+", default=["tiny", "mid"], choices=["tiny", "mid"])
    ap.add_argument("--compare", action="store_true", help="also plan without sharing identical ranges, first")
    ap.add_argument("--cluster", default="alpa-p3x8")
    ap.add_argument("--show", action="store_true", help="print each plan")
    ap.add_argument("--exact", action="store_true", help="search every layer range (no repeated-stack path)")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; cluster {args.cluster}")
    head = (
        f"{'model':<26} {'dev':>4} {'B':>3} {'stages (layers@mesh)':<44} {'step ms':>9} {'1-stage ms':>10} "
        f"{'searches':>8} {'wall s':>7} {'cpu s':>6}"
        + (f" {'unshared: searches':>18} {'wall s':>7} {'cpu s':>6}" if args.compare else "")
    )
    print(head)
    print("-" * len(head))
    B = args.microbatches
    clusters = args.clusters or None
    fast = False if args.exact else None
    for name, build, batch in models(args.mid_layers, args.models):
        model, inputs = build("meta", batch // B)  # one microbatch's step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = capture(model, inputs)
        for n in args.devices:
            extra = ""
            if args.compare:
                sp = StagePlanner(graph, args.cluster, share_identical=False)
                t0, c0 = time.perf_counter(), time.process_time()
                u = plan_pipeline(
                    graph, sp.cluster, microbatches=B, num_devices=n, num_clusters=clusters, planner=sp, fast=fast
                )
                uw, uc = time.perf_counter() - t0, time.process_time() - c0
                extra = f" {u.stage_plans:>18} {uw:7.1f} {uc:6.1f}"
            sp = StagePlanner(graph, args.cluster)  # a fresh cache per row: its time is a user's first call
            t0, c0 = time.perf_counter(), time.process_time()
            p = plan_pipeline(
                graph, sp.cluster, microbatches=B, num_devices=n, num_clusters=clusters, planner=sp, fast=fast
            )
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            one = plan_pipeline(graph, sp.cluster, microbatches=B, num_devices=n, num_stages=1, planner=sp, fast=fast)
            stages = " ".join(f"[{s.layers[0]},{s.layers[1]})@{'x'.join(map(str, s.mesh_shape))}" for s in p.stages)
            print(
                f"{name:<26} {n:>4} {B:>3} {stages:<44} {p.step_s * 1e3:9.3f} {one.step_s * 1e3:10.3f} "
                f"{p.stage_plans:>8} {wall:7.1f} {cpu:6.1f}" + extra,
                flush=True,
            )
            if args.compare and _row(u) != _row(p):
                print("  the unshared and shared plans differ:", _row(u), _row(p))
            if args.show:
                print(p)


if __name__ == "__main__":
    main()
