"""ILP against HiDup's Pareto DP on paper-size BERT-SGMoE (docs/hidup.md, "When each wins").

For each cluster and mesh shape, both searchers plan the model with the duplex schedule (2 microbatches of
half the batch, ``plan(..., microbatches=2, duplex=True, searcher=...)``); the table gives each plan's serial
step (``Plan.time.total_s``: the accounting's step, no overlap), the simulator's step of its duplex schedule
(``meshpilot.sim.simulate``: one microbatch's collectives beside the other's compute) and the CPU seconds the
plan took.

    python benchmarks/bench_when_each_wins.py
    python benchmarks/bench_when_each_wins.py --clusters hidup-2x4-10g --meshes 1x8
"""

from __future__ import annotations

import argparse
import time
import warnings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clusters", nargs="+", default=["hidup-2x4-10g", "hidup-2x4-100g"])
    p.add_argument("--meshes", nargs="+", default=["2x4", "1x8"], help="mesh shapes, d1xd2")
    p.add_argument("--batch", type=int, default=64, help="global batch (2 microbatches of half)")
    a = p.parse_args()

    from meshpilot.cluster import load_cluster
    from meshpilot.models import builtin_models, zoo
    from meshpilot.planner.auto import plan
    from meshpilot.sim import simulate

    warnings.simplefilter("ignore")
    model, _ = builtin_models()["bert-sgmoe"].build("meta", None)
    inputs = zoo.example_inputs("bert-sgmoe", model, a.batch, "meta")
    print("| cluster, mesh | ILP: serial / duplex (sim) ms | pareto: serial / duplex (sim) ms | CPU s (ILP, pareto) |")
    print("| --- | ---: | ---: | ---: |")
    for name in a.clusters:
        cluster = load_cluster(name)
        for mesh in a.meshes:
            shape = tuple(int(x) for x in mesh.split("x"))
            cells, cpu = [], []
            for searcher in ("ilp", "pareto"):
                t0 = time.process_time()
                pl = plan(model, inputs, cluster, mesh_shape=shape, microbatches=2, duplex=True, searcher=searcher)
                cpu.append(time.process_time() - t0)
                cells.append(f"{pl.time.total_s * 1e3:.1f} / {simulate(pl, cluster=cluster).step_s * 1e3:.1f}")
            print(f"| {name}, {shape} | {cells[0]} | {cells[1]} | {cpu[0]:.1f}, {cpu[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
