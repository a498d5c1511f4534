"""Activation recomputation as the memory cap tightens: which blocks the plan recomputes, its predicted step and
peak at each cap, and (under torchrun) the peak the runtime holds at three of them.

    python benchmarks/bench_recompute.py plan --out /tmp/rc_caps.json          # the table (pure planning)
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_recompute.py measure /tmp/rc_caps.json

``plan``: a 4-block GPT (gpt-tiny, batch 8 x 512 tokens, fp32) on 4 devices of ``alpa-p3x8`` (every 2D mesh
searched), planned without recomputation and with every block recomputed; then under caps from just above the
first plan's peak down past the second's, ``recompute="auto"`` (``meshpilot.planner.recompute``). One row per
cap: the mesh, the blocks recomputed, the predicted step and peak per device (or why no plan fits). The plans
with none, some and all blocks recomputed are saved for ``measure``.

``measure``: each saved plan run by ``meshpilot.parallelize`` with foreach AdamW on the gloo ranks: one warm-up
step, then every rank's peak storage bytes over two full steps (``cluster.memtrack.StorageTracker``, parameter
shards, AdamW states and inputs included), as ``benchmarks/memory_sharded_cpu.py`` measures; rank 0 prints the
predicted peak beside the largest rank's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshpilot.graph.capture import capture  # noqa: E402
from meshpilot.io import fmt_size  # noqa: E402
from meshpilot.models.sources import build_model  # noqa: E402
from meshpilot.planner.auto import plan  # noqa: E402
from meshpilot.planner.ilp import PlanError  # noqa: E402
from meshpilot.planner.plan import StagePlan  # noqa: E402

CLUSTER, DEVICES = "alpa-p3x8", 4
MODEL = dict(layers=4, batch=8, seq=512)


def _model(device: str):
    torch.manual_seed(0)
    b = build_model("gpt-tiny", device=device, **MODEL)
    return b.model, tuple(b.inputs)


def _row(cap: float | None, p: StagePlan | None, error: str = "") -> str:
    cap_s = fmt_size(cap) if cap is not None else "none"
    if p is None:
        return f"| {cap_s} | — | — | — | — | {error} |"
    blocks = ", ".join(p.recompute.regions) if p.recompute is not None else "none"
    return (
        f"| {cap_s} | {p.mesh_shape} | {blocks} | {p.time.total_s * 1e3:.3f} ms | {fmt_size(p.memory.total)} | "
        f"{p.recompute.reason if p.recompute is not None else ''} |"
    )


def run_plan(out: Path) -> None:
    model, inputs = _model("meta")
    graph = capture(model, inputs)
    t0 = time.process_time()
    none = plan(model, inputs, CLUSTER, num_devices=DEVICES, graph=graph, recompute="none")
    full = plan(model, inputs, CLUSTER, num_devices=DEVICES, graph=graph, recompute="full")
    hi, lo = none.memory.total, full.memory.total
    caps = [hi * 1.01] + [hi - (hi - lo) * f for f in (0.15, 0.35, 0.55, 0.75, 0.95)] + [lo * 0.9]
    print("| cap per device | mesh | blocks recomputed | predicted step | predicted peak | why |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(_row(None, none))
    print(_row(None, full).replace("| none |", "| none (full asked) |", 1))
    kept: dict[int, StagePlan] = {}
    for cap in caps:
        try:
            p = plan(model, inputs, CLUSTER, num_devices=DEVICES, graph=graph, memory_bytes=cap)
            print(_row(cap, p))
            kept.setdefault(len(p.recompute.regions) if p.recompute else 0, p)
        except PlanError as e:
            print(_row(cap, None, str(e).split(";")[0]))
    print(f"\n{len(caps) + 2} plans in {time.process_time() - t0:.0f} s of CPU")
    counts = sorted(kept)
    chosen = {k: kept[k] for k in (counts[0], counts[len(counts) // 2], counts[-1])}
    out.write_text(json.dumps({str(k): p.to_json() for k, p in chosen.items()}))
    print(f"saved the plans recomputing {', '.join(map(str, chosen))} blocks to {out}")


def step_peaks(model: torch.nn.Module, inputs: tuple, p: StagePlan) -> list[int]:
    """Every rank's peak storage bytes over two full AdamW steps of `model` run by plan `p`, after one warm-up
    step; what the step holds across steps (parameters, AdamW states, ZeRO-2's gathered copies, the inputs) is
    the baseline. Shared with ``bench_zero.py``."""
    import torch.distributed as dist

    import meshpilot
    from meshpilot.cluster.memtrack import adamw_step_peak

    pm = meshpilot.parallelize(model, p)
    peak = adamw_step_peak(pm, inputs, lambda: [c for c in pm._copies.copies.values() if c is not None])
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return peaks


def gloo_peak(model: torch.nn.Module, inputs: tuple, p: StagePlan) -> float:
    """Plan `p`'s predicted peak with its redistributions issued as on the gloo ranks that measure it
    (``accounting.reshard_bytes`` with ``on_cpu``: DTensor has no all-to-all there and gathers the whole
    tensor instead); `p` itself was priced for its cluster's devices."""
    from meshpilot.planner.accounting import memory_use, plan_strategies
    from meshpilot.planner.recompute import for_plan

    m = p.step_schedule().microbatches
    one = tuple(x[: x.shape[0] // m] for x in inputs)  # the graph is one microbatch's
    graph = for_plan(capture(model, one, precision=p.precision or None), p)
    chosen = plan_strategies(p, graph)
    return memory_use(graph, chosen, p.mesh_shape, microbatches=m, on_cpu=True, buckets=p.grad_buckets).total


def measured_line(p: StagePlan, peaks: list[int], gloo: float | None = None) -> str:
    """Plan `p`'s predicted peak (and `gloo`, its peak as issued on gloo: :func:`gloo_peak`) against the
    largest of `peaks` (every rank's, from :func:`step_peaks`), as this benchmark, ``bench_zero.py`` and
    ``bench_cp.py`` print it."""
    top = max(peaks)
    ranks = ", ".join(fmt_size(x) for x in peaks)
    line = (
        f"predicted {fmt_size(p.memory.total)}, measured {fmt_size(top)} (ranks {ranks}), "
        f"predicted / measured {p.memory.total / top:.3f}"
    )
    if gloo is not None:
        line += f"; predicted as issued on gloo {fmt_size(gloo)}, / measured {gloo / top:.3f}"
    return line


def measure_saved(
    path: Path,
    build: Callable[[str], tuple[torch.nn.Module, tuple]],
    label: Callable[[str, StagePlan], str],
    keys: Collection[str] = (),
    gloo: bool = True,
) -> None:
    """Under ``torchrun``: every plan saved in `path` (a JSON object, key → plan), or those in `keys`, run on this
    gloo group with the model `build(key)` gives on the CPU; rank 0 prints `label(key, plan)` and the
    :func:`measured_line` (with the :func:`gloo_peak` prediction when `gloo`). The measure step of every
    memory benchmark here."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for k, text in json.loads(path.read_text()).items():
        if keys and k not in keys:
            continue
        p = StagePlan.from_json(text)
        model, inputs = build(k)
        peaks = step_peaks(model, inputs, p)
        if dist.get_rank() == 0:
            issued = gloo_peak(model, inputs, p) if gloo else None
            print(f"{label(k, p)}: {measured_line(p, peaks, issued)}", flush=True)
    dist.destroy_process_group()


def run_measure(path: Path) -> None:
    measure_saved(path, lambda _: _model("cpu"), lambda k, p: f"{k} blocks recomputed, mesh {p.mesh_shape}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan").add_argument("--out", type=Path, default=Path("/tmp/rc_caps.json"))
    sub.add_parser("measure").add_argument("plans", type=Path)
    args = ap.parse_args()
    run_plan(args.out) if args.cmd == "plan" else run_measure(args.plans)


if __name__ == "__main__":
    main()
