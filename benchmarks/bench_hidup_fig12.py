"""HiDup Fig. 12 traced: GShard's MoE layout (what the ILP finds) against HiDup's 10 Gbps layout forced, node by
node, on BERT-SGMoE (mesh (1, 8): HiDup's SPMD, one axis over the 2 x 4 GPUs), 2 microbatches of 32.

    python benchmarks/bench_hidup_fig12.py                   # reduced model (tests/test_pareto.py's), 10 Gbps
    python benchmarks/bench_hidup_fig12.py --paper -c hidup-2x4-100g
    python benchmarks/bench_hidup_fig12.py --paper --fig11  # Fig. 11's bound instead (both clusters)

HiDup's layout (Fig. 12, right) is pinned with ``build_structure(force=pareto.hidup_moe_force(graph))``: each MoE
layer's gating matmul replicated, the experts sharded on the expert dim, the combine giving a Partial output;
the ILP places everything else. GShard's is the unforced ILP
plan. For every node whose cost differs between the two, the table gives one microbatch's compute, the
resharding of its operands (collective kind < source : bytes) and the collectives it issues itself, in µs, and
the layouts (``out < operands``). Above it: the serial step (``accounting.account``) and the duplex step ψ
(``pareto.duplex_time``) of both. docs/hidup.md, "Fig. 11 and Fig. 12", reads the result.

``--fig11``: the ILP's plan against the same plan with every replicated parameter switched to a sharded layout
(all-gathered for each read, gradient reduce-scattered), ψ split into the stages and the exposed tail
(``pareto.duplex_parts``), at 10 and 100 Gbps: how much an overlap of the gradient sync could change Fig. 11.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mapped_ranks
from meshpilot.cluster.mesh import MeshMapping
from meshpilot.graph.capture import capture
from meshpilot.models import builtin_models, zoo
from meshpilot.planner import pareto
from meshpilot.planner.accounting import ComputeCost, account, step_edges
from meshpilot.planner.ilp import build_structure
from meshpilot.planner.search import SEARCHERS, SearchTask
from meshpilot.planner.zero import ParamEdges
from meshpilot.sharding.placements import fmt
from meshpilot.sharding.reshard import Resharder
from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

MESH = (1, 8)


def fig11(graph, dmesh, cluster: str) -> None:
    """Print ψ = stages + tail of the ILP plan and of it with its replicated parameters sharded."""
    cm = CostModel(LogicalMesh(load_cluster(cluster), MESH, mapped_ranks(MESH, MeshMapping.ROW)))
    rs, compute = Resharder(dmesh, cm), ComputeCost(cm, MESH, graph)
    struct = build_structure(graph, StrategyBuilder(graph, dmesh), rs, cm, microbatches=2)
    task = SearchTask(graph, struct, rs, ParamEdges.of(graph, step_edges(graph)), MeshMapping.ROW, microbatches=2)
    replicated = dict(SEARCHERS["ilp"].search(task).chosen)
    sharded, switched = dict(replicated), 0
    for n in graph.nodes:
        if n.kind == "param" and all(p.is_replicate() for p in replicated[n.name].outs[0]):
            alt = [s for s in struct.strategies[n.name] if any(p.is_shard() for p in s.outs[0])]
            if alt:
                sharded[n.name], switched = alt[0], switched + 1
    for key, chosen in (("replicated", replicated), (f"sharded ({switched} switched)", sharded)):
        stages, tail = pareto.duplex_parts(graph, chosen, rs, compute)
        print(f"{cluster} {key}: ψ {(stages + tail) * 1e3:.1f} ms = stages {stages * 1e3:.1f} + tail {tail * 1e3:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-c", "--cluster", default="hidup-2x4-10g")
    ap.add_argument("--paper", action="store_true", help="BERT-Base sizes (builtin bert-sgmoe)")
    ap.add_argument("--fig11", action="store_true", help="replicated against sharded parameters, ψ in parts")
    args = ap.parse_args()
    with torch.device("meta"):
        if args.paper:
            model, _ = builtin_models()["bert-sgmoe"].build("meta", None)
        else:
            model = zoo.BertMoE(layers=2, hidden=256, heads=4, ffn=1024, seq=64, vocab=1024, experts=8)
    graph = capture(model, zoo.example_inputs("bert-sgmoe", model, 32, "meta"))
    dmesh = fake_device_mesh(MESH)
    if args.fig11:
        for cluster in ("hidup-2x4-10g", "hidup-2x4-100g"):
            fig11(graph, dmesh, cluster)
        return
    cm = CostModel(LogicalMesh(load_cluster(args.cluster), MESH, mapped_ranks(MESH, MeshMapping.ROW)))
    rs = Resharder(dmesh, cm)
    compute = ComputeCost(cm, MESH, graph)
    edges = ParamEdges.of(graph, step_edges(graph))

    def solve(force):
        t = time.process_time()
        struct = build_structure(graph, StrategyBuilder(graph, dmesh), rs, cm, force=force, microbatches=2)
        cand = SEARCHERS["ilp"].search(SearchTask(graph, struct, rs, edges, MeshMapping.ROW, microbatches=2))
        print(f"planned in {time.process_time() - t:.1f} CPU s, force={force}")
        return cand.chosen

    plans = {"gshard": solve(None), "hidup": solve(pareto.hidup_moe_force(graph))}
    rows: dict[str, dict] = {}
    for key, chosen in plans.items():
        acct = account(graph, chosen, rs, compute, 2)
        psi = pareto.duplex_time(graph, chosen, rs, compute)
        print(f"{key}: serial step {acct.time.total_s * 1e3:.3f} ms, duplex ψ {psi * 1e3:.3f} ms")
        per = defaultdict(lambda: [0.0, 0.0, 0.0, []])
        for name, sec in acct.node_seconds.items():
            per[name][0] = sec
        for c in acct.collectives:
            own = c.src == c.dst
            per[c.dst][2 if own else 1] += c.seconds
            per[c.dst][3].append(f"{c.kind}{'' if own else '<' + c.src}:{c.nbytes / 2**20:.2f}M")
        rows[key] = per
    nodes = {n.name: n for n in graph.nodes}
    print(f"{'node':24s} ph  | GShard: comp  reshard   own | HiDup: comp  reshard   own | Δ µs | layouts, collectives")
    total = 0.0
    for name in dict.fromkeys([*nodes, *rows["gshard"], *rows["hidup"]]):
        g, h = rows["gshard"][name], rows["hidup"][name]
        delta = (sum(h[:3]) - sum(g[:3])) * 1e6
        total += delta
        if abs(delta) < 0.5:
            continue
        node = nodes.get(name)

        def lay(key, node=node):
            if node is None:
                return "-"
            st = plans[key][node.name]
            return f"{fmt(st.outs[0])}<{','.join(fmt(i) for i in st.ins)}"

        nums = " ".join(f"{v * 1e6:7.1f}" for v in (*g[:3], *h[:3]))
        phase = node.phase if node else "grad"
        print(f"{name:24s} {phase:3s} | {nums} | {delta:7.1f} | {lay('gshard')} {g[3]} / {lay('hidup')} {h[3]}")
    print(f"Δ summed over the nodes (one microbatch; gradients once): {total:.1f} µs")


if __name__ == "__main__":
    main()
