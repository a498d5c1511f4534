"""A pipeline cut on a slow link against tensor parallelism across it, planned, simulated and measured.

On an emulated 2-node cluster (``meshpilot emulate``: each node a network namespace, the link between them
shaped to the cluster file) a GPT is planned three ways on all 8 ranks:

* ``pipeline``: ``plan_pipeline`` with 2 stages (the stage DP chooses the split, the submeshes and their
  logical meshes; the planner's submeshes are whole nodes, so the cut falls on the slow link), saved with each
  stage's own plan (``with_intra``);
* ``tp-across``: the best single-stage plan on the mesh (1, 8), whose one axis spans both nodes, with
  Megatron's tensor-parallel layouts pinned (``planner.forced.megatron_tp``): tensor parallelism across the link;
* ``single-best``: the single-stage planner's own choice over every mesh shape (for reference).

Each plan's step is simulated (``Plan.simulate`` with the boundary's bytes per send, ``sim.simulate``)
and, with ``--measure`` (root), trained under ``meshpilot emulate`` with ``meshpilot train --plan`` for
``--steps`` steps; the median step after ``--warmup`` is the measured one. Results go to
``OUT/results.json`` and a table on stdout.

    PYTHONPATH=. python benchmarks/bench_pipeline_slowlink.py                      # plan and simulate only
    sudo flock /tmp/meshpilot-emulate.lock env PYTHONPATH=. python benchmarks/bench_pipeline_slowlink.py --measure

See docs/benchmarks.md, section "Pipeline cut on a slow link".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default=str(REPO / "examples" / "clusters" / "emulated-2x4-slow.toml"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=4, help="global batch (default 4)")
    p.add_argument("--seq", type=int, default=16, help="sequence length (default 16)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--measure", action="store_true", help="train each plan under meshpilot emulate (root)")
    p.add_argument(
        "--control",
        help="a cluster file to measure the same plans on as well (e.g. the fast-link twin): what the link costs",
    )
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per emulated run")
    p.add_argument("--out-dir", type=Path, default=REPO / "out" / "bench-pipeline-slowlink")
    return p.parse_args()


def plans(args: argparse.Namespace) -> dict[str, dict]:
    """The three plans saved under OUT, with their simulated steps."""
    import torch

    from meshpilot.cluster import load_cluster
    from meshpilot.graph.capture import capture
    from meshpilot.models import gpt_config
    from meshpilot.models.gpt import GPT
    from meshpilot.planner import forced
    from meshpilot.planner.auto import plan as plan_single
    from meshpilot.planner.pipeline import plan_pipeline
    from meshpilot.sim import simulate

    cl = load_cluster(args.cluster)
    cfg = gpt_config(
        "gpt-tiny", layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch, seq=args.seq
    )
    B = args.microbatches
    with torch.device("meta"):
        model = GPT(cfg)
    whole = torch.zeros((cfg.batch, cfg.seq), dtype=torch.long, device="meta")
    micro = torch.zeros((cfg.batch // B, cfg.seq), dtype=torch.long, device="meta")
    out: dict[str, dict] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, (micro, micro))
        t0 = time.perf_counter()
        pp = plan_pipeline(graph, cl, microbatches=B, num_devices=8, num_stages=2)
        pp = pp.with_intra(graph, cl)
        plan_s = time.perf_counter() - t0
        boundary = cfg.batch // B * cfg.seq * cfg.hidden * 4  # one microbatch's activation, float32
        sim = pp.simulate(cl).step_s  # each boundary's transfer priced (Plan.transfers)
        sent = ", ".join(f"{x.src}->{x.dst} {x.nbytes / 2**10:.0f} KiB {x.seconds * 1e3:.2f} ms" for x in pp.transfers)
        print(f"pipeline: simulated {sim * 1e3:.2f} ms with its transfers ({sent}); {boundary} bytes a send: "
              f"{pp.simulate(cl, p2p_bytes=boundary).step_s * 1e3:.2f} ms; 0 bytes: "
              f"{pp.simulate(cl, p2p_bytes=0.0).step_s * 1e3:.2f} ms", flush=True)  # fmt: skip
        out["pipeline"] = {
            "plan": pp.to_json(), "simulated_s": sim, "planned_s": pp.step_s, "planning_s": plan_s,
            "what": " | ".join(f"ranks {s.ranks[0]}-{s.ranks[-1]} {'x'.join(map(str, s.mesh_shape))} "
                               f"[{s.layers[0]},{s.layers[1]})" for s in pp.stages),
        }  # fmt: skip
        pins = forced.megatron_tp(model, (whole, whole), (1, 8))
        tp = plan_single(model, (whole, whole), cl, mesh_shape=(1, 8), force=pins)
        out["tp-across"] = {"plan": tp.to_json(), "simulated_s": simulate(tp, cluster=cl).step_s,
                            "planned_s": tp.time.total_s, "what": "1x8 Megatron TP"}  # fmt: skip
        best = plan_single(model, (whole, whole), cl)
        shape = "x".join(map(str, best.mesh_shape))
        out["single-best"] = {"plan": best.to_json(), "simulated_s": simulate(best, cluster=cl).step_s,
                              "planned_s": best.time.total_s, "what": f"{shape} searched"}  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, r in out.items():
        (args.out_dir / f"{name}.json").write_text(r.pop("plan") + "\n")
    return out


def measure(args: argparse.Namespace, name: str, cluster: str, tag: str = "") -> list[float]:
    """Step seconds of ``meshpilot train --plan OUT/name.json`` under ``meshpilot emulate`` of `cluster`."""
    from meshpilot.emulate import run_emulated

    js = args.out_dir / f"{name}{tag}.steps.json"
    cmd = ["-m", "meshpilot.cli.main", "train", "--model", "gpt-tiny", "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--heads", str(args.heads), "--plan", str(args.out_dir / f"{name}.json"),
           "--steps", str(args.steps), "--json-out", str(js)]  # fmt: skip
    log = args.out_dir / f"{name}{tag}.log"
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with log.open("w") as fh:
        rc = run_emulated(cluster, cmd, timeout=args.timeout, env=env, stdout=fh, stderr=fh)
    if rc != 0:
        print("\n".join(log.read_text().splitlines()[-20:]), file=sys.stderr)
        raise SystemExit(f"{name}: emulated run failed ({rc}); log {log}")
    steps = json.loads(js.read_text())["steps"]
    return [float(s["seconds"]) for s in steps]


def main() -> int:
    args = _args()
    print(f"load average {os.getloadavg()[0]:.1f}, cluster {args.cluster}", flush=True)
    res = plans(args)
    if args.measure:
        runs = [("", args.cluster)] + ([("_control", args.control)] if args.control else [])
        for tag, cluster in runs:
            for name in res:
                secs = measure(args, name, cluster, tag)
                res[name][f"measured{tag}_steps_s"] = secs
                res[name][f"measured{tag}_s"] = statistics.median(secs[args.warmup :])
                print(f"{name}: measured{tag} {res[name][f'measured{tag}_s'] * 1e3:.1f} ms", flush=True)
    print(f"{'plan':<12} {'what':<44} {'simulated':>10} {'measured':>10} {'control':>10}")
    for name, r in res.items():
        m, c = (f"{r[k] * 1e3:.1f} ms" if k in r else "-" for k in ("measured_s", "measured_control_s"))
        print(f"{name:<12} {r['what']:<44} {r['simulated_s'] * 1e3:>7.2f} ms {m:>10} {c:>10}")
    print(f"load average {os.getloadavg()[0]:.1f}")
    (args.out_dir / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
