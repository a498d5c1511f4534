"""The searchers of ``meshpilot.planner.search`` on BERT-SGMoE (HiDup §6.1's model): search time (HiDup Fig. 14)
and robustness to wrong cost estimates (Table 5), ILP against the Pareto DP.

    python benchmarks/bench_search.py                        # everything, the default (reduced) sizes
    python benchmarks/bench_search.py --only time            # Fig. 14 only
    python benchmarks/bench_search.py --only noise --seeds 3 # Table 5 only, fewer seeds

**Fig. 14 (search time).** (a) layers 2, 4, 6, 8 on 4 devices; (b) 6 layers on 2 … 64 devices of
``hidup-v100x64`` (a 1D mesh of n, as HiDup's SPMD; experts = n, 1 per device). Per point: the strategies and
structure (``ilp.build_structure``, shared by both searchers) and then, on that structure, the ILP
(``ILPSearcher``: pricing, HiGHS, the ZeRO post-pass), the pure Pareto beam (``pareto_search``, no incumbent)
and the seeded DP alone (``pareto_search`` with the ILP plan as incumbent; the ``pareto`` searcher = ILP + this).
The tables give CPU seconds of this process (``time.process_time``: other jobs on a shared machine do not
count), after one warm-up point (torch's and DTensor's first-call caches).

**Table 5 (robustness).** The cost model is perturbed (:class:`Perturbed`): ±20% / ±50% on every collective, or
every distinct operator cost (a node's compute under a strategy, a collective of a given kind, size and axis)
multiplied by a factor drawn uniformly in [1 − x, 1 + x] (x = 20%, 50%; ``--seeds`` seeds). The plan is searched
on the perturbed costs, then priced on the true ones; the *relative time* is that price over the price of the
plan searched on the true costs — the ILP's by the accounting's serial step, the Pareto DP's by its duplex step
ψ (``pareto.duplex_time``), each by the cost it minimises.

The model is BERT-SGMoE with the paper's structure (post-LN BERT layers, an MoE feed-forward in every second,
top-2 gating, capacity, load-balancing loss) at a reduced size by default (``--hidden 256 --ffn 1024 --heads 4
--seq 64 --vocab 1024``, batch 8 per device) so that every point fits in minutes on 2 shared CPU cores;
``--paper`` uses BERT-Base sizes (h = 768, 12 heads, ffn 3072, seq 128, vocab 30522).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
import zlib
from typing import Any

import torch

from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mapped_ranks
from meshpilot.cluster.mesh import MeshMapping
from meshpilot.graph.capture import capture
from meshpilot.models import zoo
from meshpilot.planner import pareto
from meshpilot.planner.accounting import ComputeCost, account, step_edges
from meshpilot.planner.ilp import Pricer, build_structure
from meshpilot.planner.search import ILPSearcher, SearchTask
from meshpilot.planner.zero import ParamEdges
from meshpilot.sharding.reshard import Resharder
from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")


class Perturbed:
    """A ``CostModel`` whose estimates are wrong: collectives scaled by `comm`, and every distinct cost (by its
    arguments) by a factor in [1 − noise, 1 + noise] fixed by `seed` (the same operator is always misjudged
    the same way, as a wrong profile would)."""

    def __init__(self, cm: CostModel, comm: float = 1.0, noise: float = 0.0, seed: int = 0):
        self._cm, self._comm, self._noise, self._seed = cm, comm, noise, seed

    def _factor(self, key: Any) -> float:
        if not self._noise:
            return 1.0
        u = zlib.crc32(repr((self._seed, key)).encode()) / 2**32  # uniform in [0, 1), stable per key
        return 1.0 + self._noise * (2.0 * u - 1.0)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._cm, name)
        if name in COLLECTIVES:
            return lambda nbytes, axes: attr(nbytes, axes) * self._comm * self._factor((name, nbytes, axes))
        if name == "compute":
            return lambda *a, **k: attr(*a, **k) * self._factor(("compute", a, tuple(sorted(k.items()))))
        return attr


@dataclasses.dataclass
class Setup:
    graph: Any
    shape: tuple[int, ...]
    cluster: Any


def bert_sgmoe(args: argparse.Namespace, layers: int, devices: int) -> Setup:
    sizes = (
        dict(hidden=768, heads=12, ffn=3072, seq=128, vocab=30522)
        if args.paper
        else dict(hidden=args.hidden, heads=args.heads, ffn=args.ffn, seq=args.seq, vocab=args.vocab)
    )
    with torch.device("meta"):
        model = zoo.BertMoE(layers=layers, experts=devices, top_k=2, **sizes)
    inputs = zoo.example_inputs("bert-sgmoe", model, args.per_device * devices, "meta")
    return Setup(capture(model, inputs), (1, devices), None)


def task_of(graph: Any, shape: tuple[int, ...], cluster: str, cm_wrap=None) -> tuple[SearchTask, ComputeCost, float]:
    cl = load_cluster(cluster)
    dmesh = fake_device_mesh(shape)
    cm = CostModel(LogicalMesh(cl, shape, mapped_ranks(shape, MeshMapping.ROW)))
    if cm_wrap is not None:
        cm = cm_wrap(cm)
    rs = Resharder(dmesh, cm)
    t0 = time.process_time()
    struct = build_structure(graph, StrategyBuilder(graph, dmesh), rs, cm)
    build_s = time.process_time() - t0
    task = SearchTask(graph, struct, rs, ParamEdges.of(graph, step_edges(graph)), MeshMapping.ROW)
    return task, ComputeCost(cm, shape, graph), build_s


def timed_searches(task: SearchTask, compute: ComputeCost) -> dict[str, float]:
    t0 = time.process_time()
    ilp = ILPSearcher().search(task)
    t1 = time.process_time()
    pricer = Pricer(task.struct.table, task.resharder)
    pareto.pareto_search(task.graph, task.struct, pricer, compute)
    t2 = time.process_time()
    pareto.pareto_search(task.graph, task.struct, pricer, compute, incumbent=ilp.chosen)
    t3 = time.process_time()
    return {"ilp": t1 - t0, "beam": t2 - t1, "seeded": t3 - t2}


def fig14(args: argparse.Namespace) -> None:
    warm = bert_sgmoe(args, 2, 4)
    timed_searches(*task_of(warm.graph, (1, 4), "hidup-2x4-100g")[:2])
    print("### Fig. 14a: search time vs layers (4 devices, mesh (1, 4), hidup-2x4-100g)\n")
    print("| layers | nodes | structure | ILP | Pareto beam | seeded DP | pareto = ILP + seeded DP |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layers in args.layers:
        s = bert_sgmoe(args, layers, 4)
        task, compute, build_s = task_of(s.graph, (1, 4), "hidup-2x4-100g")
        t = timed_searches(task, compute)
        print(
            f"| {layers} | {len(s.graph.nodes)} | {build_s:.1f} | {t['ilp']:.2f} | {t['beam']:.2f} | "
            f"{t['seeded']:.2f} | {t['ilp'] + t['seeded']:.2f} |",
            flush=True,
        )
    print(f"\n### Fig. 14b: search time vs devices ({args.fixed_layers} layers, mesh (1, n), hidup-v100x64)\n")
    print("| devices | nodes | structure | ILP | Pareto beam | seeded DP | pareto = ILP + seeded DP |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in args.devices:
        s = bert_sgmoe(args, args.fixed_layers, n)
        task, compute, build_s = task_of(s.graph, (1, n), "hidup-v100x64")
        t = timed_searches(task, compute)
        print(
            f"| {n} | {len(s.graph.nodes)} | {build_s:.1f} | {t['ilp']:.2f} | {t['beam']:.2f} | "
            f"{t['seeded']:.2f} | {t['ilp'] + t['seeded']:.2f} |",
            flush=True,
        )


def table5(args: argparse.Namespace) -> None:
    s = bert_sgmoe(args, args.noise_layers, 8)
    shape = tuple(int(d) for d in args.noise_mesh.split("x"))
    print(
        f"\n### Table 5: relative step time of the plan searched on wrong costs ({args.noise_layers} layers, "
        f"8 devices, mesh {shape}, {args.noise_cluster})\n"
    )
    true_task, true_compute, _ = task_of(s.graph, shape, args.noise_cluster)

    def found(wrap) -> tuple[dict, dict]:
        task, compute, _ = task_of(s.graph, shape, args.noise_cluster, wrap)
        ilp = ILPSearcher().search(task)
        dp = pareto.ParetoSearcher().search(task, incumbent=ilp)
        return ilp.chosen, dp.chosen

    def serial(chosen: dict) -> float:
        return account(s.graph, chosen, true_task.resharder, true_compute, 1).time.total_s

    def duplex(chosen: dict) -> float:
        return pareto.duplex_time(s.graph, chosen, true_task.resharder, true_compute)

    ilp0, dp0 = found(None)
    base_ilp, base_dp = serial(ilp0), duplex(dp0)
    print(f"true costs: ILP plan {base_ilp * 1e3:.2f} ms serial; Pareto plan {base_dp * 1e3:.2f} ms duplex\n")
    print("| noise | ILP relative time (serial step) | Pareto relative time (duplex step) | runs |")
    print("| --- | ---: | ---: | ---: |")
    rows = [(f"{int(x * 100)}% random noise", dict(noise=x), args.seeds) for x in (0.2, 0.5)]
    rows += [(f"{y:+d}% communication", dict(comm=1 + y / 100), 1) for y in (20, 50, -20, -50)]
    for label, kw, runs in rows:
        r_ilp, r_dp = [], []
        for seed in range(runs):
            ilp, dp = found(lambda cm, kw=kw, seed=seed: Perturbed(cm, seed=seed, **kw))
            r_ilp.append(serial(ilp) / base_ilp)
            r_dp.append(duplex(dp) / base_dp)
        print(
            f"| {label} | {statistics.mean(r_ilp):.1%} (max {max(r_ilp):.1%}) | "
            f"{statistics.mean(r_dp):.1%} (max {max(r_dp):.1%}) | {runs} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("time", "noise"))
    ap.add_argument("--paper", action="store_true", help="BERT-Base sizes instead of the reduced ones")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--per-device", type=int, default=8, help="batch per device (weak scaling, as HiDup)")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 6, 8])
    ap.add_argument("--fixed-layers", type=int, default=6)
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--noise-layers", type=int, default=2)
    ap.add_argument("--noise-mesh", default="2x4")
    ap.add_argument("--noise-cluster", default="hidup-2x4-30g")
    args = ap.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()}")
    if args.only in (None, "time"):
        fig14(args)
    if args.only in (None, "noise"):
        table5(args)
    print(f"\nload at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
