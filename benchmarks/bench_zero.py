"""ZeRO stage 2 / 3 and recomputation as the memory cap tightens: which the plan chooses, its predicted step and
peak at each cap, and (under torchrun) the peak the runtime holds at three of them.

    python benchmarks/bench_zero.py plan --out /tmp/zero_caps.json          # the table (pure planning)
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_zero.py measure /tmp/zero_caps.json

``plan``: a 4-block GPT (gpt-tiny, hidden 128, 4 heads, batch 8 x 128 tokens, fp32) on a (4, 1) mesh of
``alpa-p3x8`` with 2 microbatches (``--microbatches``), planned without a cap with the ZeRO pass off, then
with ``zero="auto"`` and ``recompute="auto"`` under caps from the uncapped plan's peak down (each 0.9 of the
last plan's peak) until no plan fits; for reference, uncapped plans with every ZeRO candidate forced to
stage 2 and to stage 3. One row per plan: the ZeRO switches by stage (``planner.zero``), the blocks
recomputed (``planner.recompute``), the ILP's memory row, the predicted step and peak per device (or why no
plan fits). The first plan, the first with a stage-2 switch and the last are saved for ``measure``.

``measure``: each saved plan run by ``meshpilot.parallelize`` with foreach AdamW on the gloo ranks: one warm-up
step, then every rank's peak storage bytes over two full steps (``cluster.memtrack.StorageTracker``; parameter
shards, ZeRO-2 full copies, AdamW states and inputs included), as ``benchmarks/bench_recompute.py`` measures;
rank 0 prints the predicted peak beside the largest rank's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_recompute import measure_saved  # noqa: E402 - the same measurement of a plan's step

from meshpilot.graph.capture import capture  # noqa: E402
from meshpilot.io import fmt_size  # noqa: E402
from meshpilot.models.sources import build_model  # noqa: E402
from meshpilot.planner.auto import plan  # noqa: E402
from meshpilot.planner.ilp import PlanError  # noqa: E402
from meshpilot.planner.plan import StagePlan  # noqa: E402

CLUSTER, MESH = "alpa-p3x8", (4, 1)
MODEL = dict(layers=4, hidden=128, heads=4, batch=8, seq=128)


def _model(device: str):
    torch.manual_seed(0)
    b = build_model("gpt-tiny", device=device, **MODEL)
    return b.model, tuple(b.inputs)


def _choices(p: StagePlan) -> str:
    """``ZeRO-2 ×6, ZeRO-3 ×2, recompute 1 block``: what the plan switched."""
    stages = Counter(int(z.stage) for z in p.zero)
    parts = [f"ZeRO-{s} ×{n}" for s, n in sorted(stages.items())]
    if p.recompute is not None:
        parts.append(f"recompute {len(p.recompute.regions)} block(s)")
    return ", ".join(parts) or "none"


def _row(cap: float | None, p: StagePlan | None, error: str = "") -> str:
    cap_s = fmt_size(cap) if cap is not None else "none"
    if p is None:
        return f"| {cap_s} | — | — | — | — | {error} |"
    return (
        f"| {cap_s} | {_choices(p)} | {p.solver.memory_row} | {p.time.total_s * 1e3:.3f} ms | "
        f"{fmt_size(p.memory.total)} | |"
    )


def run_plan(out: Path, microbatches: int) -> None:
    model, inputs = _model("meta")
    graph = capture(model, tuple(x[: x.shape[0] // microbatches] for x in inputs))  # one microbatch
    kw = dict(mesh_shape=MESH, graph=graph, microbatches=microbatches)
    t0 = time.process_time()
    off = plan(None, (), CLUSTER, zero="off", recompute="none", **kw)
    print("| cap per device | switches | memory row | predicted step | predicted peak | why none |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(_row(None, off).replace("| none |", "| none (zero off) |", 1))
    for z in ("2", "3"):  # every candidate forced to one stage, for reference
        print(
            _row(None, plan(None, (), CLUSTER, zero=z, recompute="none", **kw)).replace(
                "| none |", f"| none (zero {z}) |", 1
            )
        )
    kept: dict[str, StagePlan] = {}
    cap, n = off.memory.total, 1
    while True:
        try:
            p = plan(None, (), CLUSTER, zero="auto", memory_bytes=cap, **kw)
        except PlanError as e:
            print(_row(cap, None, str(e).split(";")[0]))
            break
        print(_row(cap, p), flush=True)
        kept.setdefault(_choices(p), p)
        cap, n = p.memory.total * 0.9, n + 1
    print(f"\n{n} plans in {time.process_time() - t0:.0f} s of CPU")
    names = list(kept)
    mixed = next((k for k in names if "ZeRO-2" in k), names[len(names) // 2])  # a plan with stage-2 switches
    chosen = {k: kept[k] for k in dict.fromkeys((names[0], mixed, names[-1]))}
    out.write_text(json.dumps({k: p.to_json() for k, p in chosen.items()}))
    print(f"saved the plans with {'; '.join(chosen)} to {out}")


def run_measure(path: Path) -> None:
    measure_saved(path, lambda _: _model("cpu"), lambda k, _: k, gloo=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    planning = sub.add_parser("plan")
    planning.add_argument("--out", type=Path, default=Path("/tmp/zero_caps.json"))
    planning.add_argument("--microbatches", type=int, default=2)
    sub.add_parser("measure").add_argument("plans", type=Path)
    args = ap.parse_args()
    run_plan(args.out, args.microbatches) if args.cmd == "plan" else run_measure(args.plans)


if __name__ == "__main__":
    main()
