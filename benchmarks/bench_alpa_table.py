"""Alpa's Tables 6–8 on the ``alpa-p3x8`` preset (8 V100 16 GB per node, 25 Gbps between nodes): for each row
the pipeline plan's predicted throughput next to a hand-designed baseline's on the same cost model.

    python benchmarks/bench_alpa_table.py                                  # the GPT rows that finish
    python benchmarks/bench_alpa_table.py --rows gpt3-350m gpt3-1.3b --microbatches 16 32
    python benchmarks/bench_alpa_table.py --tables --microbatches 64 --workers 2   # variant vs exact table

``--tables`` (GPT rows; default: all of them): per row and B, the repeated-block stage table costed both ways
(``plan_pipeline(costing=)``, ``planner.stack`` module docstring, 4 and 5) on fresh stage planners — the variant
table (each logical mesh's block planned uncapped, ZeRO-3-sharded and recomputed: real plans only), the
estimated one (a catalogue of base plans replicated, a whole server's meshes searched) and the exact one of every cap
level (``--costings`` picks which) — with the plan's predicted step (Eq. 2), its stages (``rc``: recomputed),
the step's ratio and each planning's wall and CPU seconds (``plan_pipeline`` only: the capture is shared).
``--final`` also plans the chosen stages exactly (``Plan.with_intra`` on the whole model, what ``meshpilot plan
--out`` saves) and prints that plan's Eq. 2 (``final s``) and its CPU seconds (``+cpu``).

Per row (its GPU count n from the paper, global batch 1024 sequences of 1024 tokens), for every number of
microbatches B given (one capture of one microbatch's step per B, on meta tensors; for a GPT the capture of
4 of its blocks, ``planner.stack.capture_stack``, unless ``--exact``):

* meshpilot: ``plan_pipeline`` (stage DP over every layer, submeshes, 1F1B; a GPT's stages costed from one
  block's plan and the embeddings' and head's, ``planner.stack``; ``--exact``: every range's own
  intra-operator ILP) — Eq. 2's step;
* Megatron-LM 3D (GPT): a grid over (pp, tp, dp) with pp · tp · dp = n, tp ≤ 8 inside a node, the blocks split
  evenly over pp stages (embeddings with the first, head with the last), each stage on a (dp, tp) mesh of
  contiguous ranks with Megatron's layouts pinned (``planner.forced.megatron_tp``; no ZeRO: ``zero="off"``),
  B and the schedule (1F1B, GPipe: Eq. 5's memory check with each schedule's microbatches in flight) — the
  fastest that fits, on the same ``StagePlanner`` (the same cost model and accounting); with a stack, each
  stage composed from the same pieces as meshpilot's (``stack.compose_stage``, the layouts pinned in each).

Throughput is the paper's metric: the step's model FLOPs (the captured graph's, forward and backward, times
B) over the predicted step, in PFLOPS. Planning time is meshpilot's: the captures and ``plan_pipeline`` calls
of the row, wall and CPU seconds (this process' and its planning workers'). For MoE rows the baseline is DeepSpeed-style
(:func:`deepspeed_moe`), for Wide-ResNet PP-DP (:func:`pp_dp`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass

from bench_plan_speed import cpu_seconds

from meshpilot.graph.capture import capture
from meshpilot.models import builtin_models
from meshpilot.models.zoo import AlpaFamily, alpa_models
from meshpilot.planner.forced import megatron_tp
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.pipeline import plan_pipeline, stage_in_flight, stage_memory
from meshpilot.planner.recompute import Recompute
from meshpilot.planner.schedule import PipelineKind
from meshpilot.planner.stack import Stack, capture_stack, compose_stage
from meshpilot.planner.stage import StagePlanner

CLUSTER = "alpa-p3x8"


def _rc(mode: Recompute) -> str:
    """A stage's recomputation as the tables write it: `` rc`` (whole blocks), `` rc-sel`` (selective)."""
    return {Recompute.NONE: "", Recompute.FULL: " rc", Recompute.SELECTIVE: " rc-sel"}[Recompute(mode)]


@dataclass
class Best:
    step_s: float = math.inf
    flops: float = 0.0
    what: str = "none fits"

    def offer(self, step_s: float, flops: float, what: str) -> None:
        if step_s < self.step_s:
            self.step_s, self.flops, self.what = step_s, flops, what

    @property
    def pflops(self) -> float:
        return self.flops / self.step_s / 1e15 if math.isfinite(self.step_s) else 0.0


def megatron(sp: StagePlanner, stack: Stack | None, model, inputs, n: int, B: int, best: Best, flops: float) -> None:
    """Megatron-LM's 3D grid for one B (module docstring) into `best`. With `stack` (a repeated stack: the
    captured blocks of ``capture_stack``) every stage is costed as meshpilot's fast path costs its own
    (``stack.compose_stage``: the same pieces, the same cost model), else by a search of its whole slice."""
    model_layers = stack.layers if stack is not None else sp.layers
    names = [x.name for x in model_layers]
    blocks = [j for j, x in enumerate(names) if x.startswith("blocks.")]
    first, K = blocks[0], len(names)
    cap = sp.cluster.device.memory_bytes
    mb = inputs[0].shape[0]
    for pp in (p for p in range(1, n + 1) if n % p == 0 and len(blocks) % p == 0):
        for tp in (t for t in (1, 2, 4, 8) if (n // pp) % t == 0):
            dp = n // pp // tp
            if mb % dp:
                continue
            force = megatron_tp(model, inputs, (dp, tp), graph=sp.graph)
            per = len(blocks) // pp
            edges = [0, *(first + s * per for s in range(1, pp)), K]
            bounds = list(zip(edges, edges[1:]))
            try:
                costs = []
                for s, (a, b) in enumerate(bounds):
                    ranks = range(s * dp * tp, (s + 1) * dp * tp)
                    if stack is not None:
                        c = compose_stage(sp, stack, a, b, ranks, (dp, tp), microbatches=B, zero="off", force=force)
                    else:
                        c = sp.plan(a, b, ranks, (dp, tp), microbatches=B, zero="off", force=force)
                    costs.append(c)
            except PlanError:
                continue
            ts = [c.time.total_s / B for c in costs]
            step = sum(ts) + (B - 1) * max(ts)
            for kind in (PipelineKind.ONE_F_ONE_B, PipelineKind.GPIPE):
                if all(stage_memory(c, stage_in_flight(kind, pp - s, B)) <= cap for s, c in enumerate(costs)):
                    best.offer(step, flops, f"pp={pp} tp={tp} dp={dp} B={B} {kind.value}")
                    break


def deepspeed_moe(sp: StagePlanner, n: int, B: int, best: Best, flops: float) -> None:
    """DeepSpeed-style MoE (Alpa §8.1's baseline): no pipeline; one (1, n) mesh, the experts' weights sharded
    over it on their expert dim (expert parallelism), every other weight replicated with ZeRO sharding its
    update (``zero="all"``), the ILP choosing the rest (data-parallel activations)."""
    K = len(sp.layers)
    sharded = "RS(0)" if n > 1 else "RR"
    force = {p: sharded if p.endswith((".w_in", ".w_out")) else "RR" for p in sp.graph.param_names}
    try:
        c = sp.plan(0, K, range(n), (1, n), microbatches=B, zero="all", force=force)
    except PlanError:
        return
    if stage_memory(c, 1) <= sp.cluster.device.memory_bytes:
        best.offer(c.time.total_s, flops, f"EP={n} ZeRO, B={B}")


def pp_dp(sp: StagePlanner, n: int, B: int, best: Best, flops: float, clusters: int | None) -> None:
    """PP-DP (Alpa's Wide-ResNet baseline): the same stage DP with every weight pinned replicated and no ZeRO,
    so each stage is data parallel (the ILP may still shard activations)."""
    force = {p: "RR" for p in sp.graph.param_names}
    try:
        p = plan_pipeline(sp.graph, sp.cluster, microbatches=B, num_devices=n, num_clusters=clusters, planner=sp,
                          force=force, zero="off")  # fmt: skip
    except PlanError:
        return
    best.offer(p.step_s, flops, f"B={B} " + "+".join(f"{s.layers[1] - s.layers[0]}L@{len(s.ranks)}" for s in p.stages))


def main() -> None:
    ap = argparse.ArgumentParser()
    gpts = [n for n, m in alpa_models().items() if m.family == AlpaFamily.GPT]
    ap.add_argument("--rows", nargs="+", default=gpts[:3], help="model names (default: the first GPT rows)")
    ap.add_argument("--microbatches", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--clusters", type=int, default=0, help="Eq. 6's L for meshpilot (0: every layer)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--exact", action="store_true", help="capture every block and search every stage range (GPT)")
    ap.add_argument("--tables", action="store_true", help="GPT rows: the approximate table against the exact one")
    ap.add_argument("--workers", type=int, default=None, help="--tables: plan_pipeline's planning processes")
    ap.add_argument(
        "--costings", nargs="+", default=["approximate", "exact"], help="--tables: which tables (default both)"
    )
    ap.add_argument(
        "--final",
        action="store_true",
        help="--tables: also plan the chosen stages exactly (Plan.with_intra on the whole model) and print that step",
    )
    ap.add_argument(
        "--no-accumulated",
        action="store_true",
        help="--tables: the tables leave out the gradients summed over the microbatches (default: counted)",
    )
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; cluster {CLUSTER}")
    if args.tables:
        rows = args.rows if "--rows" in sys.argv else gpts
        compare_tables(rows, args.microbatches, args.workers, args.costings, not args.no_accumulated, args.final)
        return
    head = (
        f"{'model':<16} {'GPUs':>4} {'meshpilot PFLOPS':>16} {'plan':<48} {'baseline PFLOPS':>15} "
        f"{'baseline plan':<34} {'plan s':>7} {'cpu s':>6}"
    )
    print(head + "\n" + "-" * len(head), flush=True)
    rows = alpa_models()
    for name in args.rows:
        row = rows[name]
        entry = builtin_models()[name]
        n = entry.devices
        ours, base = Best(), Best()
        planning = planning_cpu = 0.0
        for B in args.microbatches:
            if row.global_batch % B:
                continue
            t0, c0 = time.perf_counter(), cpu_seconds()
            model, inputs = entry.build("meta", row.global_batch // B)
            stack = None
            if row.family == AlpaFamily.GPT and not args.exact:
                got = capture_stack(model, inputs)
                stack, graph = (got, got.graph) if isinstance(got, Stack) else (None, got)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    graph = capture(model, inputs)
            sp = StagePlanner(graph, CLUSTER)
            # the model's FLOPs: its layers' (a stack's repeated blocks counted L times)
            flops = sum(x.flops for x in (stack.layers if stack is not None else sp.layers)) * B
            try:
                fast = False if args.exact else None
                p = plan_pipeline(stack or graph, sp.cluster, microbatches=B, num_devices=n,
                                  num_clusters=args.clusters or None, planner=sp, fast=fast)  # fmt: skip
                stages = "+".join(f"{s.layers[1] - s.layers[0]}L@{'x'.join(map(str, s.mesh_shape))}" for s in p.stages)
                ours.offer(p.step_s, flops, f"B={B} {stages}")
            except PlanError:
                pass
            planning += time.perf_counter() - t0
            planning_cpu += cpu_seconds() - c0
            if args.no_baseline:
                continue
            if row.family == AlpaFamily.GPT:
                megatron(sp, stack, model, inputs, n, B, base, flops)
            elif row.family == AlpaFamily.MOE:
                deepspeed_moe(sp, n, B, base, flops)
            else:
                pp_dp(sp, n, B, base, flops, args.clusters or None)
        print(
            f"{name:<16} {n:>4} {ours.pflops:16.3f} {ours.what:<48} {base.pflops:15.3f} {base.what:<34.34} "
            f"{planning:7.1f} {planning_cpu:6.1f}",
            flush=True,
        )


def _stages(p) -> str:
    return " ".join(f"[{a},{b})@{'x'.join(map(str, s.mesh_shape))}{_rc(s.cost.recompute)}"
                    for s in p.stages for a, b in [s.layers])  # fmt: skip


def final_step(pp, model, inputs) -> tuple[float, float, str]:
    """(Eq. 2 of the stages' own plans, its CPU seconds, the final stages): the whole model captured and every
    chosen stage searched exactly (``Plan.with_intra``, what ``meshpilot plan --out`` saves; where a stage's own
    plan does not fit, the DP's next best is planned instead), each stage's t its own plan's step over the plan's
    microbatches — the final plan's predicted step, not the table's."""
    c0 = cpu_seconds()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = capture(model, inputs)
    try:
        final = pp.with_intra(whole, CLUSTER)
    except PlanError:
        return math.inf, cpu_seconds() - c0, "no stage plans fit"
    B = final.microbatches
    ts = [st.plan.time.total_s / B for st in final.stages]
    return sum(ts) + (B - 1) * max(ts), cpu_seconds() - c0, _stages(final)


def compare_tables(
    names: list[str],
    microbatches: list[int],
    workers: int | None,
    costings: list[str],
    accumulated: bool,
    final: bool = False,
) -> None:
    """``--tables`` (module docstring): per GPT row and B, the stage tables' plans; a stage marked ``rc`` recomputes
    its blocks. With `final`, each plan's stages are then planned exactly (:func:`final_step`): ``final s`` is
    that plan's Eq. 2 and ``+cpu`` its CPU seconds (the whole model's capture and the stages' searches)."""
    head = (
        f"{'model':<10} {'GPUs':>4} {'B':>3} {'table':<11} {'step s':>12} {'apx/ex':>7} {'wall s':>7} {'cpu s':>7} "
        f"{'searches':>8} {'final s':>12} {'+cpu':>6}  stages"
    )
    print(head + "\n" + "-" * len(head), flush=True)
    for name in names:
        row, entry = alpa_models()[name], builtin_models()[name]
        for B in microbatches:
            if row.global_batch % B:
                continue
            model, inputs = entry.build("meta", row.global_batch // B)
            stack = capture_stack(model, inputs)
            steps = {}
            for costing in costings:
                t0, c0 = time.perf_counter(), cpu_seconds()
                try:
                    p = plan_pipeline(stack, CLUSTER, microbatches=B, num_devices=entry.devices, costing=costing,
                                      workers=workers, accumulated=accumulated)  # fmt: skip
                except PlanError as e:
                    print(f"{name:<10} {entry.devices:>4} {B:>3} {costing:<11} no plan: {e}", flush=True)
                    continue
                wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
                steps[costing] = p.step_s
                stages = _stages(p)
                # approximate / exact on the exact row: the approximate table's step against the exact one's
                ratio = steps["approximate"] / p.step_s if costing == "exact" and "approximate" in steps else 1.0
                fin, fcpu, fstages = final_step(p, model, inputs) if final else (math.nan, 0.0, stages)
                stages += f"  (final: {fstages})" if fstages != stages else ""
                print(
                    f"{name:<10} {entry.devices:>4} {B:>3} {costing:<11} {p.step_s:12.6f} {ratio:7.4f} {wall:7.1f} "
                    f"{cpu:7.1f} {p.stage_plans:>8} {fin:12.6f} {fcpu:6.1f}  {stages}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
