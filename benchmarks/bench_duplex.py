"""HiDup's duplex on an emulated 2 nodes x 4 ranks cluster: step time with and without, overlap ratio (issue 11).

Per cluster file (fast, medium and slow inter-node links; ``meshpilot emulate``, root needed):

1. plan: a GPT under Megatron tensor parallelism over all 8 ranks (mesh 1x8: every layer's activations are
   all-reduced across the node link, the collectives duplex can hide), for 2 microbatches of the global
   batch, with the ``duplex`` schedule; "without" is the same plan under ``accumulate`` (the two
   microbatches one after the other; same strategies, same collectives);
2. predict: ``meshpilot.sim.simulate`` of both: step, compute, communication, overlap ratio (HiDup Table 4:
   overlapped ÷ min(compute, communication)) — on the cluster file, and with ``--probe`` also on the cluster
   ``meshpilot probe`` measures under the same emulated topology with the plans' own GEMMs
   (``bench_fidelity.write_gemms`` / ``probe_cluster``; both plans re-priced on it, ``accounting.reprice``),
   so the simulated compute is the probed device's, not the file's nominal CPU profile;
3. measure: ``fidelity_step_worker.py`` times both plans' training steps under ``emulate`` (8 ranks,
   round-robin, median of the rounds; its docstring has the protocol), then runs one more step of each with
   its forward / backward programs traced (``--trace``: ``meshpilot.runtime.duplex.traced``): per rank the
   compute, the communication, their overlap and the overlap ratio (``duplex.trace_overlap``); and once on a
   fake process group (one process, no communication).

The table gives the traced ratio (median rank, range over ranks) and, for comparison, one derived from step
times alone: without duplex nothing overlaps, so ``overlapped ≈ T_without − T_duplex`` over
``min(T_compute (fake group), T_without − T_compute)`` — fragile under load (the lone fake-group process does
not share the cores as the 8 ranks do).

    sudo python benchmarks/bench_duplex.py --out-dir /tmp/bench-duplex --markdown
    sudo python benchmarks/bench_duplex.py --hidden 1024 --mlp-ratio 32 --probe --markdown   # issue 11's targets

``--model mixtral`` runs Hugging Face's Mixtral instead (dropless top-2 experts, ``meshpilot.ops.moe``; sized by
``--layers``, ``--hidden``, ``--heads``, ``--mlp-ratio`` (the experts' inner width), ``--experts``, ``--vocab``,
``--seq``), planned by the solver on mesh 1x8 (expert parallelism over the 8 ranks where it chooses it; the
run prints the experts' layout), whose expert all-to-alls duplex overlaps with the other microbatch's experts
and routing. No fake-group run there (the routing's split sizes need real all-to-alls), so the table's
step-derived ratio is left out; the traced one stands.

    sudo python benchmarks/bench_duplex.py --model mixtral --links slow medium --markdown

Megatron TP's traffic per layer grows with ``h · tokens`` and its compute with ``ffn · h · tokens``: a wide
hidden size and MLP (``--hidden``, ``--mlp-ratio``) make computation and communication comparable on the slow
link, where duplex's overlap can shorten the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "fidelity_step_worker.py"
CLUSTERS = {
    "fast": REPO / "examples" / "clusters" / "emulated-2x4-fast.toml",
    "medium": REPO / "examples" / "clusters" / "emulated-2x4-slow.toml",
    "slow": REPO / "examples" / "clusters" / "emulated-2x4-100mbit.toml",
}
MESH = (1, 8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/bench-duplex"))
    p.add_argument("--links", nargs="+", choices=sorted(CLUSTERS), default=["fast", "medium", "slow"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="global batch (2 microbatches of half)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--mlp-ratio", type=int, default=4, help="MLP inner width as a multiple of --hidden (default 4)")
    p.add_argument("--model", choices=("gpt", "mixtral"), default="gpt")
    p.add_argument("--experts", type=int, default=8, help="--model mixtral: experts per MoE layer (default 8)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed steps (>= 2: the first records, the second builds duplex)"
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--port", type=int, default=29400)
    p.add_argument("--png", type=Path, help="write the simulated timelines of the slowest link here")
    p.add_argument(
        "--probe",
        action="store_true",
        help="also probe each link under emulate (with the plans' GEMMs) and simulate both plans on the probed cluster",
    )
    p.add_argument(
        "--probed",
        action="append",
        default=[],
        metavar="LINK=FILE",
        help="reuse a probed cluster TOML for LINK instead of probing (repeatable; implies --probe for LINK)",
    )
    p.add_argument("--probe-bytes", default=None, help="message size for the probe (default: probe's)")
    p.add_argument("--probe-budget", type=float, default=60.0, help="probe's --p2p-budget seconds (default 60)")
    p.add_argument("--markdown", action="store_true")
    return p.parse_args(argv)


def mixtral_source(args: argparse.Namespace) -> dict:
    """The manifest's ``source`` of ``--model mixtral`` (``fidelity_step_worker.py`` builds it on every rank)."""
    hf = {
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * args.mlp_ratio,
        "num_local_experts": args.experts,
        "num_experts_per_tok": 2,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.seq,
    }
    return {
        "name": "hf:mixtral",
        "hf_config": [f"{k}={v}" for k, v in hf.items()],
        "batch": args.batch,
        "seq": args.seq,
    }


def make_plans(cfg: dict, cluster_file: Path, folder: Path, source: dict | None = None) -> dict:
    """The duplex plan and the same strategies without duplex, saved; and their simulations. A GPT under
    Megatron TP (`cfg`), or the model `source` names (``mixtral_source``) as the solver plans it."""
    import torch

    from meshpilot.cluster import load_cluster
    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT, GPTConfig
    from meshpilot.planner import forced
    from meshpilot.planner.auto import plan
    from meshpilot.planner.schedule import accumulate
    from meshpilot.sim import simulate

    cluster = load_cluster(str(cluster_file))
    if source is None:
        with torch.device("meta"):
            model = GPT(GPTConfig(**cfg))
        whole = torch.empty(cfg["batch"], cfg["seq"], dtype=torch.long, device="meta")
        half = torch.empty(cfg["batch"] // 2, cfg["seq"], dtype=torch.long, device="meta")
        graph = capture(model, (half, half))
        force = forced.megatron_tp(model, (half, half), MESH, graph=graph)
        inputs = (whole, whole)
    else:
        from meshpilot.models.sources import build_model

        def built(batch: int):
            return build_model(source["name"], hf_config=source["hf_config"], batch=batch, seq=source["seq"])

        full, small = built(source["batch"]), built(source["batch"] // 2)
        model, inputs, force = full.model, full.inputs, None
        graph = capture(small.model, small.inputs)
    dup = plan(model, inputs, cluster, mesh_shape=MESH, graph=graph, force=force, microbatches=2, duplex=True)
    if source is not None:
        experts = [n.ins[3] for n in dup.nodes if n.target == "meshpilot.moe_experts.default"]
        print(f"{cluster_file.name}: experts' layouts {experts}", flush=True)
    acc = dataclasses.replace(dup, schedule=accumulate(8, 2))
    folder.mkdir(parents=True, exist_ok=True)
    out: dict = {"_graph": graph}
    for name, p in (("duplex", dup), ("without", acc)):
        path = folder / f"{name}.json"
        p.save(path)
        out[name] = {"path": str(path), "plan": p} | predicted(simulate(p, cluster=cluster))
    return out


def predicted(sim) -> dict:
    """The simulated step of one plan and its first rank class's split (HiDup Table 4's terms)."""
    c = sim.classes[0]
    return {"sim": sim, "sim_s": sim.step_s, "compute_s": c.compute_s, "comm_s": c.comm_s, "overlap": c.overlap_ratio}


def predict_probed(plans: dict, probed: Path) -> dict:
    """Both plans re-priced on the probed cluster (``accounting.reprice``: the same strategies and collectives,
    every price from the probe) and simulated there; and (``*_alone``) simulated without the probe's busy
    curves, every collective at its time alone whether or not its rank computes (``meshpilot.sim``,
    *Contention*)."""
    from meshpilot.cluster import load_cluster
    from meshpilot.planner.accounting import reprice
    from meshpilot.sim import simulate

    cluster = load_cluster(str(probed))
    # the same cluster without the busy curves: every collective at its time alone (no contention)
    alone = dataclasses.replace(
        cluster, calibration=tuple(dataclasses.replace(c, busy_curve=()) for c in cluster.calibration)
    )
    out = {}
    for name in ("duplex", "without"):
        q = reprice(plans[name]["plan"], plans["_graph"], cluster)
        out[name] = predicted(simulate(q, cluster=cluster))
        out[f"{name}_alone"] = predicted(simulate(q, cluster=alone))
    return out


def probe_link(plans: dict, cluster_file: Path, folder: Path, args: argparse.Namespace) -> Path:
    """``meshpilot probe`` under ``emulate`` on `cluster_file`, timing every GEMM the two plans run
    (``bench_fidelity``'s steps, reused)."""
    from bench_fidelity import probe_cluster, write_gemms

    gemms = folder / "gemms.json"
    write_gemms({n: (plans[n]["plan"], None) for n in ("duplex", "without")}, plans["_graph"], gemms)
    probed, secs = probe_cluster(cluster_file, gemms, folder, args)
    print(f"probed {cluster_file.name} in {secs:.0f} s: {probed}", flush=True)
    return probed


def run_worker(manifest: Path, out_dir: Path, tag: str, args: argparse.Namespace, cluster_file: Path | None) -> dict:
    result = out_dir / f"{tag}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(WORKER), "--manifest", str(manifest), "--out", str(result)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if cluster_file is not None:
        cmd.append("--trace")
    log = out_dir / f"{tag}.log"
    t0 = time.perf_counter()
    if cluster_file is None:  # one process on a fake group of 8: the computation alone
        cmd = [*cmd, "--fake-world", "8"]
        with log.open("w") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=fh, env=os.environ | {"OMP_NUM_THREADS": "1"}).returncode
    else:
        from meshpilot.emulate import run_emulated

        with log.open("w") as fh:
            rc = run_emulated(str(cluster_file), cmd, timeout=args.timeout, port=args.port, stdout=fh, stderr=fh)
    if rc != 0 or not result.is_file():
        tail = log.read_text().splitlines()[-25:] if log.exists() else []
        raise SystemExit(f"{tag} failed ({rc}):\n" + "\n".join(tail))
    doc = json.loads(result.read_text())
    doc["seconds"] = time.perf_counter() - t0
    return {r["name"]: r for r in doc["results"]} | {"_seconds": doc["seconds"]}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def markdown(rows: list[dict]) -> str:
    """The results table: measured steps, the traced split (median rank), the simulated ones (file, probed)."""
    head = (
        "| link | without ms | duplex ms | gain | traced compute / comm ms (duplex, median rank) "
        "| overlap ratio (trace, median rank [min-max]; lower bound; without) "
        "| sim (file): without / duplex ms, ratio "
        "| sim (probed): without / duplex ms, compute / comm ms, ratio "
        "| sim (probed, no contention): without / duplex ms, compute / comm ms, ratio |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        dup = r["trace"]["duplex"]
        probed = alone = "—"
        if r.get("probed"):
            probed, alone = (
                f"{r[f'probed_{p}without_s'] * 1e3:.0f} / {r[f'probed_{p}sim_s'] * 1e3:.0f}, "
                f"{r[f'probed_{p}compute_s'] * 1e3:.0f} / {r[f'probed_{p}comm_s'] * 1e3:.0f}, "
                f"{r[f'probed_{p}overlap']:.0%}"
                for p in ("", "alone_")
            )
        lines.append(
            f"| {r['link']} | {r['measured_without_s'] * 1e3:.0f} | {r['measured_duplex_s'] * 1e3:.0f} "
            f"| {r['gain']:.1%} | {_median([t['compute_s'] for t in dup]) * 1e3:.0f} / "
            f"{_median([t['comm_s'] for t in dup]) * 1e3:.0f} "
            f"| {r['trace_overlap']:.0%} [{r['trace_overlap_range'][0]:.0%}-{r['trace_overlap_range'][1]:.0%}]; "
            f"{r.get('trace_overlap_low', float('nan')):.0%}; {r['trace_without']:.0%} "
            f"| {r['sim_without_s'] * 1e3:.0f} / {r['sim_duplex_s'] * 1e3:.0f}, {r['sim_overlap']:.0%} | {probed} "
            f"| {alone} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO / "benchmarks"))
    cfg = {k: getattr(args, k) for k in ("vocab", "seq", "layers", "hidden", "heads", "mlp_ratio", "batch")}
    reuse = {}
    for item in args.probed:
        link, sep, file = item.partition("=")
        if not sep or link not in CLUSTERS or not Path(file).is_file():
            links = ", ".join(CLUSTERS)
            raise SystemExit(f"--probed {item}: give LINK=FILE with LINK one of {links} and an existing file")
        reuse[link] = Path(file)
    rows = []
    fake = None
    source = mixtral_source(args) if args.model == "mixtral" else None
    for link in args.links:
        folder = args.out_dir / link
        plans = make_plans(cfg, CLUSTERS[link], folder, source)
        manifest = folder / "manifest.json"
        entries = [{"name": n, "path": plans[n]["path"]} for n in ("duplex", "without")]
        model = {"source": source} if source is not None else {"model": cfg}
        manifest.write_text(json.dumps(model | {"plans": entries, "microbatches": 2}))
        if fake is None and source is None:
            fake = run_worker(manifest, args.out_dir, "fake", args, None)
        meas = run_worker(manifest, folder, "steps", args, CLUSTERS[link])
        t_dup, t_acc = meas["duplex"]["median_s"], meas["without"]["median_s"]
        t_comp = fake["without"]["median_s"] if fake is not None else float("nan")
        t_comm = max(t_acc - t_comp, 0.0)
        low = min(t_comp, t_comm)
        probed = reuse.get(link) or (probe_link(plans, CLUSTERS[link], folder, args) if args.probe else None)
        on_probed = predict_probed(plans, probed) if probed else None
        trace = meas["duplex"]["trace"]  # per rank: compute, comm, overlap of the traced F / B programs
        ratios = sorted(t["ratio"] for t in trace)
        row = {
            "link": link,
            "trace_overlap": ratios[len(ratios) // 2],
            "trace_overlap_range": (ratios[0], ratios[-1]),
            "trace_overlap_low": _median([t.get("ratio_low", 0.0) for t in trace]),
            "trace_without": sorted(t["ratio"] for t in meas["without"]["trace"])[len(ratios) // 2],
            "trace_bounded": max(t["bounded"] for t in trace),
            "trace": {"duplex": trace, "without": meas["without"]["trace"]},
            "measured_without_s": t_acc,
            "measured_duplex_s": t_dup,
            "measured_compute_s": t_comp,
            "measured_comm_s": t_comm,
            "measured_overlap": (t_acc - t_dup) / low if low > 0 else 0.0,
            "gain": 1 - t_dup / t_acc,
            "sim_without_s": plans["without"]["sim_s"],
            "sim_duplex_s": plans["duplex"]["sim_s"],
            "sim_compute_s": plans["duplex"]["compute_s"],
            "sim_comm_s": plans["duplex"]["comm_s"],
            "sim_overlap": plans["duplex"]["overlap"],
            "probed": str(probed) if probed else None,
            "emulate_s": meas["_seconds"],
            "loadavg": os.getloadavg(),
        }
        if on_probed:
            for key in ("sim_s", "compute_s", "comm_s", "overlap"):
                row[f"probed_{key}"] = on_probed["duplex"][key]
                row[f"probed_alone_{key}"] = on_probed["duplex_alone"][key]
            row["probed_without_s"] = on_probed["without"]["sim_s"]
            row["probed_alone_without_s"] = on_probed["without_alone"]["sim_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.png and link == args.links[-1]:
            from meshpilot.sim import write_timelines

            shown = on_probed or plans
            write_timelines([shown["duplex"]["sim"], shown["without"]["sim"]], args.png)
    (args.out_dir / "results.json").write_text(json.dumps(rows, indent=1))
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
