"""Every pipeline schedule kind planned and simulated for one GPT (issue 10's schedule search).

    python benchmarks/bench_pipeline_schedules.py          # GPT L=8 h=512 s=256 vocab 8192, 4 devices, B=8
    python benchmarks/bench_pipeline_schedules.py --layers 8 --devices 8 --microbatches 8 --markdown

Per ``PipelineKind`` (and ``auto``): ``plan_pipeline(schedule=kind)`` on ``alpa-p3x8`` with the whole model
captured (every layer range searched: the interleaved search needs the exact path), then
``Plan.simulate`` on the same cluster (each boundary's transfer sent, ``Plan.transfers``, as
``auto`` weighs them; and with sends of 0 bytes, their latency only, as ``auto`` weighed them before the
transfers were kept). Printed: the stages (layers @ logical mesh, ranks), the DP's objective (Eq. 2, or the
interleaved closed form), the simulated steps, the in-flight microbatches per stage, and the CPU seconds of the
call (one ``StagePlanner`` shared by all rows, so the first row pays the stage searches the later ones reuse).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

from meshpilot.graph.capture import capture
from meshpilot.models import _gpt_builder, gpt_config
from meshpilot.planner.pipeline import AUTO, plan_pipeline
from meshpilot.planner.schedule import PipelineKind
from meshpilot.planner.stage import StagePlanner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2, help="rows of one microbatch")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--cluster", default="alpa-p3x8")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    cfg = gpt_config(
        "gpt", layers=args.layers, hidden=args.hidden, heads=8, seq=args.seq, batch=args.batch, vocab=args.vocab
    )
    model, inputs = _gpt_builder(cfg)("meta", args.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, inputs)
    sp = StagePlanner(graph, args.cluster)
    kw = dict(microbatches=args.microbatches, num_devices=args.devices, planner=sp, fast=False)
    rows = []
    for kind in [*PipelineKind, AUTO]:
        t0 = time.process_time()
        p = plan_pipeline(graph, args.cluster, schedule=kind, **kw)
        cpu = time.process_time() - t0
        sim = p.simulate(args.cluster).step_s
        sim0 = p.simulate(args.cluster, p2p_bytes=0.0).step_s
        stages = " ".join(f"[{s.layers[0]},{s.layers[1]})@{'x'.join(map(str, s.mesh_shape))}" for s in p.stages)
        groups = ", ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in p.groups)
        held = ",".join(str(s.in_flight) for s in p.stages)
        name = kind if kind == AUTO else kind.value
        rows.append((f"{name} → {p.schedule.value}", stages, groups, p.dp_step_s, sim, held, cpu, sim0))
    print(f"gpt L={cfg.layers} h={cfg.hidden} s={cfg.seq} b={args.batch}, {args.devices} devices of {args.cluster}, "
          f"B={args.microbatches}")  # fmt: skip
    if args.markdown:
        print("| schedule | stages (layers @ mesh) | rank groups | DP objective | simulated step | sends of 0 bytes "
              "| in flight | CPU s |")  # fmt: skip
        print("| --- | --- | --- | ---: | ---: | ---: | --- | ---: |")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3] * 1e3:.3f} ms | {r[4] * 1e3:.3f} ms | {r[7] * 1e3:.3f} ms "
                  f"| {r[5]} | {r[6]:.1f} |")  # fmt: skip
    else:
        for r in rows:
            print(f"{r[0]:<34} {r[1]:<60} {r[2]:<16} {r[3] * 1e3:9.3f} ms {r[4] * 1e3:9.3f} ms "
                  f"{r[7] * 1e3:9.3f} ms  {r[5]:<16} {r[6]:.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
