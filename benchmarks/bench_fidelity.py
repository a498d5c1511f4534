"""Cost-model fidelity (issue 9): predicted step times of several plans of one GPT against measured ones.

On an emulated 2 nodes x 4 ranks cluster (``meshpilot emulate``, root needed):

1. plans: one GPT is planned several ways on the cluster file (--cluster): the solver's free choice, the
   solver on fixed meshes, forced data parallelism, ZeRO-3 and Megatron TP (``meshpilot.planner.forced``),
   some of them also with the ``overlap=True`` schedule. Each plan is saved to --out-dir/plans/, with its
   closed-form step (``plan.time.overlapped_s``; serial: ``total_s``) and its simulated step
   (``meshpilot.sim.simulate``) on the file;
2. measure: ``benchmarks/fidelity_step_worker.py`` runs under ``emulate`` (8 ranks) and times the training
   step (forward + backward + AdamW) of every plan, round-robin, median over rounds of the slowest rank;
3. calibrate: ``meshpilot probe`` runs under ``emulate`` on the same cluster (as ``bench_atp_emulated.py``
   does), with ``--matmul-shapes`` naming every GEMM a device runs under any of the plans (their local
   shards, ``accounting.plan_gemms``; written to --out-dir/gemms.json), so each matmul is priced at the rate
   measured for its own shape; it also measures the fixed cost of an operator and of a foreach operator per
   tensor. The SAME plans are re-priced on the probed file (:func:`reprice`: every node's seconds, the
   optimizer's update and every collective's cost-model seconds on the probed cluster; strategies, layouts
   and collectives unchanged), then simulated on it;
4. report: plan | mesh | kind | closed-form and simulated step on the file and on the probed cluster |
   measured step, then per predictor the Spearman rank correlation with the measured steps (target >= 0.9)
   and the median relative error |pred - meas| / meas (target <= 25 %).

A plan with a ``col`` mapping (axis 0 on contiguous ranks) sees the probe's entry measured on its own
rank groups (``LogicalMesh`` matches calibration entries by groups: a col (4, 2)'s axis 0 is the row
(2, 4)'s axis 1).

    sudo python benchmarks/bench_fidelity.py --fake --markdown --out-dir out/bench-fidelity/quiet
                                                                           # the documented run (5-6 min quiet)
    sudo python benchmarks/bench_fidelity.py                               # probe, plan, measure, report
    sudo python benchmarks/bench_fidelity.py --probed out/x.probed.toml     # reuse an earlier probe
    python benchmarks/bench_fidelity.py --plans-only                        # plans and predictions only
    python benchmarks/bench_fidelity.py --reprice-run out/bench-fidelity/x  # an earlier run priced by this code

See docs/benchmarks.md, section "Cost-model fidelity on an emulated cluster".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "fidelity_step_worker.py"
DEFAULT_CLUSTER = REPO / "examples" / "clusters" / "emulated-2x4-slow.toml"
TARGET_SPEARMAN = 0.9
TARGET_MEDIAN_ERROR = 0.25


@dataclasses.dataclass(frozen=True)
class PlanSpec:
    """One plan of the benchmark: a name, its kind, and how to ask the planner for it."""

    name: str
    kind: str
    """``solver`` (the ILP alone), ``data parallel``, ``ZeRO-3`` or ``Megatron TP`` (forced layouts)."""
    mesh: tuple[int, int] | None
    """Fixed mesh shape, or None: the solver searches every 2D shape (and both mappings)."""
    overlap: bool = False


PLANS = (
    PlanSpec("solver", "solver", None),
    PlanSpec("solver+overlap", "solver", None, overlap=True),
    PlanSpec("solver-2x4", "solver", (2, 4)),
    PlanSpec("solver-4x2", "solver", (4, 2)),  # the free choice before the mesh search priced the buckets
    PlanSpec("dp-8x1", "data parallel", (8, 1)),
    PlanSpec("zero3-8x1", "ZeRO-3", (8, 1)),
    PlanSpec("megatron-2x4", "Megatron TP", (2, 4)),
    PlanSpec("megatron-2x4+overlap", "Megatron TP", (2, 4), overlap=True),
    PlanSpec("megatron-1x8", "Megatron TP", (1, 8)),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Needs root (network namespaces) unless --plans-only. "
        "Defaults: GPT L=2 h=256 heads=8 b=16 s=128 vocab=512 float32.",
    )
    p.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER, help="cluster TOML to emulate and plan on")
    p.add_argument("--probed", type=Path, help="use this probed cluster TOML instead of probing")
    p.add_argument("--out-dir", type=Path, default=REPO / "out" / "bench-fidelity", help="where results go")
    from atp_step_worker import add_shared_options

    add_shared_options(p, steps=7, warmup=2, what="plan")  # the GPT's size and the step counts
    p.add_argument("--only", help="comma-separated plan names to keep (default: all of " + _names() + ")")
    p.add_argument("--probe-bytes", default=None, help="message size for the probe (default: probe's, 4MiB)")
    p.add_argument("--probe-budget", type=float, default=60.0, help="probe's --p2p-budget seconds (default 60)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per emulated run (default 900)")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port (default 29400)")
    p.add_argument(
        "--control",
        type=Path,
        metavar="FILE",
        help="also time every plan on this control cluster (the same shape with a fast link between nodes)",
    )
    p.add_argument(
        "--fake",
        action="store_true",
        help="also time one rank's compute on a fake process group, and predict it on a device probed alone "
        "(one process: the cost model's compute terms without neighbours or communication)",
    )
    p.add_argument("--plans-only", action="store_true", help="plan and predict on --cluster (and --probed) only")
    p.add_argument(
        "--reprice-run",
        type=Path,
        metavar="DIR",
        help="no new run: the plans, probed cluster and measured steps of an earlier --out-dir priced by this code",
    )
    p.add_argument("--markdown", action="store_true", help="also print the tables as markdown")
    return p.parse_args(argv)


def _names() -> str:
    return ", ".join(s.name for s in PLANS)


def gpt_config(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("vocab", "seq", "layers", "hidden", "heads", "batch")}


# ------------------------------------------------------------------------------------------- statistics


def spearman(pred: Sequence[float], meas: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their average rank; NaN when either side is constant)."""
    from scipy.stats import spearmanr

    if len(pred) != len(meas) or len(pred) < 2:
        raise ValueError("spearman: need two equally long sequences of at least 2 values")
    return float(spearmanr(pred, meas).statistic)


def relative_errors(pred: Sequence[float], meas: Sequence[float]) -> list[float]:
    """|pred - meas| / meas per pair."""
    return [abs(p - m) / m for p, m in zip(pred, meas, strict=True)]


def fidelity(pred: Sequence[float], meas: Sequence[float]) -> dict:
    """Spearman, median relative error and median ratio pred / meas of one predictor, with the verdicts."""
    rho = spearman(pred, meas)
    err = statistics.median(relative_errors(pred, meas))
    return {
        "spearman": rho,
        "median_rel_error": err,
        "median_ratio": statistics.median(p / m for p, m in zip(pred, meas)),
        "spearman_ok": bool(rho >= TARGET_SPEARMAN),
        "error_ok": bool(err <= TARGET_MEDIAN_ERROR),
    }


# ------------------------------------------------------------------------------------------------- plans


def _model_and_inputs(cfg: dict) -> tuple[Any, tuple]:
    import torch

    from meshpilot.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**cfg))
    idx = torch.empty(cfg["batch"], cfg["seq"], dtype=torch.long, device="meta")
    return model, (idx, idx)


def _force(spec: PlanSpec, model: Any, inputs: tuple, graph: Any) -> dict[str, str] | None:
    from meshpilot.planner import forced

    if spec.kind == "data parallel":
        return forced.data_parallel(model, inputs, spec.mesh)
    if spec.kind == "ZeRO-3":
        return forced.zero3(model, inputs, spec.mesh)
    if spec.kind == "Megatron TP":
        return forced.megatron_tp(model, inputs, spec.mesh, graph=graph)
    return None


def make_plans(specs: Sequence[PlanSpec], cfg: dict, cluster: Any, folder: Path, log: Callable = print) -> dict:
    """Plan every spec on `cluster` (one capture of the model), save each to `folder`/NAME.json."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import plan

    model, inputs = _model_and_inputs(cfg)
    graph = capture(model, inputs)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for spec in specs:
        t0 = time.perf_counter()
        kw: dict[str, Any] = {"graph": graph, "overlap": spec.overlap}
        if spec.mesh is not None:
            kw["mesh_shape"] = spec.mesh
        force = _force(spec, model, inputs, graph)
        if force is not None:
            kw["force"] = force
        p = plan(model, inputs, cluster, **kw)
        path = folder / f"{spec.name}.json"
        p.save(path)
        out[spec.name] = (p, path)
        log(
            f"plan {spec.name}: mesh {p.mesh_shape} {p.mapping}, {len(p.collectives)} collectives, "
            f"{len(p.zero)} ZeRO switches, {len(p.grad_buckets)} gradient buckets, closed form "
            f"{p.time.overlapped_s * 1e3:.1f} ms (serial {p.time.total_s * 1e3:.1f}) "
            f"({time.perf_counter() - t0:.1f} s)"
        )
    return {"graph": graph, "plans": out}


def reprice(plan: Any, graph: Any, cluster: Any) -> Any:
    """The same plan with every price recomputed on `cluster` (``accounting.reprice``: node roofline seconds on
    the cluster's device profile, each collective on the plan's mesh and rank map; layouts, collectives and
    schedule kept). On the cluster it was planned on, this reproduces ``plan.time``."""
    from meshpilot.planner.accounting import reprice as reprice_plan

    return reprice_plan(plan, graph, cluster)


def write_gemms(plans: dict, graph: Any, path: Path) -> list:
    """Every distinct GEMM ``(m, n, k, dtype)`` a device runs under any of `plans` (``accounting.plan_gemms``),
    as the JSON list ``meshpilot probe --matmul-shapes`` reads."""
    from meshpilot.planner.accounting import plan_gemms

    seen: dict[tuple, None] = {}
    for p, _ in plans.values():
        seen.update(dict.fromkeys(plan_gemms(p, graph)))
    shapes = [list(g) for g in seen]
    path.write_text(json.dumps(shapes) + "\n")
    return shapes


def probe_cluster(cluster_file: Path, gemms: Path, out_dir: Path, args: argparse.Namespace) -> tuple[Path, float]:
    """``meshpilot probe`` under ``emulate`` on `cluster_file`, timing the GEMMs listed in `gemms` too."""
    from bench_atp_emulated import _emulate, _fail

    name = cluster_file.stem
    probed = out_dir / f"{name}.probed.toml"
    cmd = ["python", "-m", "meshpilot.cli.main", "probe", "--out", str(probed), "--name", f"{name}-probed"]
    cmd += ["--p2p-budget", str(args.probe_budget), "--matmul-shapes", str(gemms)]
    if args.probe_bytes:
        cmd += ["--bytes", args.probe_bytes]
    log = out_dir / f"{name}.probe.log"
    rc, secs = _emulate(cluster_file, cmd, log, args)
    if rc != 0 or not probed.is_file():
        _fail(f"probe on {name}", rc, log)
    return probed, secs


def predict(plans: dict, graph: Any, cluster: Any) -> dict:
    """Closed-form and simulated step (and the closed form's split) of every plan, re-priced on `cluster`: as
    the planner and simulator price it now (gradient buckets overlapped where the runtime overlaps them:
    ``StepTime.overlapped_s``, ``meshpilot.sim``) and as they priced it before they priced the buckets
    (``serial``: ``StepTime.total_s``, every collective exposed; the plan simulated without its buckets, one
    collective per gradient at ``G``, which is what the simulator did with a bucketed plan then)."""
    from meshpilot.sim import simulate

    out = {}
    for name, (p, _) in plans.items():
        q = reprice(p, graph, cluster)
        sim = simulate(q, cluster=cluster)
        unbucketed = dataclasses.replace(q, grad_buckets=(), time=dataclasses.replace(q.time, hidden_s=0.0))
        c = sim.classes[0]
        out[name] = {
            "closed_s": q.time.overlapped_s,
            "closed_serial_s": q.time.total_s,
            "sim_serial_s": simulate(unbucketed, cluster=cluster).step_s,
            "buckets": len(q.grad_buckets),
            "compute_s": q.time.compute_s,
            "communication_s": q.time.communication_s,
            "resharding_s": q.time.resharding_s,
            "optimizer_s": q.time.optimizer_s,
            "sim_s": sim.step_s,
            "sim_exposed_s": c.exposed_comm_s,
            "sim_hidden_s": c.hidden_comm_s,
        }
    return out


# ------------------------------------------------------------------------------------------------ measure


def measure(
    manifest: Path, cluster_file: Path, out_dir: Path, args: argparse.Namespace, tag: str = "steps"
) -> tuple[dict, float]:
    """Every plan's step under ``emulate`` on `cluster_file` (the worker's JSON, seconds taken)."""
    from bench_atp_emulated import _emulate, _fail

    result = out_dir / f"{tag}.json"
    result.unlink(missing_ok=True)
    cmd = ["python", str(WORKER), "--manifest", str(manifest), "--out", str(result)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    log = out_dir / f"{tag}.log"
    rc, secs = _emulate(cluster_file, cmd, log, args)
    if rc != 0 or not result.is_file():
        _fail(f"step benchmark ({tag})", rc, log)
    return json.loads(result.read_text()), secs


def measure_fake(manifest: Path, world: int, out_dir: Path, args: argparse.Namespace) -> dict:
    """One rank's step of every plan on a fake process group of `world` ranks: no communication, no
    neighbours sharing the cores (one process, one thread)."""
    result = out_dir / "fake.json"
    cmd = [sys.executable, str(WORKER), "--fake-world", str(world), "--manifest", str(manifest)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(result)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with (out_dir / "fake.log").open("w") as fh:
        subprocess.run(cmd, check=True, stdout=fh, stderr=fh, env=env)
    return json.loads(result.read_text())


def probe_alone(gemms: Path, out_dir: Path) -> Path:
    """``meshpilot probe`` in ONE process (torchrun, 1 rank, one thread): the device as a rank sees it with
    no neighbours on its cores, with the plans' GEMMs. Only its device profile is used (:func:`predict_alone`)."""
    out = out_dir / "alone.probed.toml"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    cmd += ["-m", "meshpilot.cli.main", "probe", "--out", str(out), "--matmul-shapes", str(gemms)]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    with (out_dir / "alone.probe.log").open("w") as fh:
        subprocess.run(cmd, check=True, stdout=fh, stderr=fh, env=env)
    return out


def predict_alone(plans: dict, graph: Any, cluster: Any, alone: Path) -> dict:
    """Per plan, the closed form's compute + optimizer on `cluster` with the device profile probed alone:
    what the fake-process-group step measures (one rank's work, no communication, no neighbours)."""
    from meshpilot.cluster import load_cluster

    device = load_cluster(str(alone)).device
    solo = dataclasses.replace(load_cluster(cluster), device=device)
    out = {}
    for name, (p, _) in plans.items():
        t = reprice(p, graph, solo).time
        out[name] = {"compute_s": t.compute_s, "optimizer_s": t.optimizer_s}
    return out


# ------------------------------------------------------------------------------------------------- report

PREDICTORS = (
    ("closed_file", "closed-form (file)"),
    ("sim_file", "simulated (file)"),
    ("closed_probed", "closed-form (probed)"),
    ("sim_probed", "simulated (probed)"),
    ("closed_probed_serial", "closed-form (probed), buckets not priced"),
    ("sim_probed_serial", "simulated (probed), buckets not priced"),
)


def rows(
    specs: Sequence[PlanSpec],
    plans: dict,
    pred_file: dict,
    pred_probed: dict | None,
    steps: dict | None,
    control: dict | None = None,
    fake: dict | None = None,
    alone: dict | None = None,
) -> list[dict]:
    """One row per plan: its predictions, the measured step and the decomposition runs where given."""
    meas = {r["name"]: r for r in steps["results"]} if steps else {}
    ctrl = {r["name"]: r["median_s"] for r in control["results"]} if control else {}
    comp = {r["name"]: r for r in fake["results"]} if fake else {}
    out = []
    for s in specs:
        p, path = plans[s.name]
        r = {
            "name": s.name,
            "kind": s.kind + (" + overlap" if s.overlap else ""),
            "mesh": list(p.mesh_shape),
            "mapping": p.mapping,
            "plan": str(path),
            "collectives": len(p.collectives),
            "zero_switches": len(p.zero),
            "buckets": pred_file[s.name]["buckets"],
            "closed_file": pred_file[s.name]["closed_s"],
            "sim_file": pred_file[s.name]["sim_s"],
            "file": pred_file[s.name],
        }
        if pred_probed is not None:
            r |= {
                "closed_probed": pred_probed[s.name]["closed_s"],
                "sim_probed": pred_probed[s.name]["sim_s"],
                "closed_probed_serial": pred_probed[s.name]["closed_serial_s"],
                "sim_probed_serial": pred_probed[s.name]["sim_serial_s"],
                "probed": pred_probed[s.name],
            }
        if s.name in meas:
            m = meas[s.name]
            r |= {"measured": m["median_s"], "measured_min": m["min_s"], "measured_max": m["max_s"]}
            r["measured_optimizer"] = m.get("optimizer_median_s")
            r["loss0"] = m["loss0"]
        if s.name in ctrl:
            r["control"] = ctrl[s.name]
        if s.name in comp:
            r["compute_fake"] = comp[s.name]["median_s"]
            r["optimizer_fake"] = comp[s.name].get("optimizer_median_s")
        if alone is not None:
            r["alone"] = alone[s.name]
        out.append(r)
    return out


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def table(rs: list[dict]) -> tuple[list[str], list[list[str]]]:
    head = ["plan", "mesh", "kind"] + [label + " ms" for _, label in PREDICTORS] + ["measured ms (min-max)"]
    body = []
    for r in rs:
        d1, d2 = r["mesh"]
        meas = r.get("measured")
        cell = "—" if meas is None else f"{_ms(meas)} ({_ms(r['measured_min'])}-{_ms(r['measured_max'])})"
        body.append(
            [r["name"], f"({d1},{d2}) {r['mapping']}", r["kind"]] + [_ms(r.get(key)) for key, _ in PREDICTORS] + [cell]
        )
    return head, body


def split_table(rs: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Where the step goes: the closed form's compute, communication and optimizer update (file, probed)
    beside the measured update (``opt.step()`` + ``zero_grad``, slowest rank, median), one rank's measured
    compute (fake process group) and its prediction on a device probed alone, the step on the control cluster
    and the measured link cost."""
    head = ["plan", "compute file", "comm file", "optimizer file", "compute probed", "comm probed"]
    head += ["optimizer probed", "optimizer measured", "compute + optimizer, probed alone"]
    head += ["compute/rank (fake PG)", "optimizer (fake PG)"]
    head += ["step, control", "step", "link cost (step - control)"]
    body = []
    for r in rs:
        f, q = r["file"], r.get("probed") or {}
        meas, ctrl = r.get("measured"), r.get("control")
        body.append(
            [
                r["name"],
                _ms(f["compute_s"]),
                _ms(f["communication_s"] + f["resharding_s"]),
                _ms(f["optimizer_s"]),
                _ms(q.get("compute_s")),
                _ms(q["communication_s"] + q["resharding_s"] if q else None),
                _ms(q.get("optimizer_s")),
                _ms(r.get("measured_optimizer")),
                _ms(r["alone"]["compute_s"] + r["alone"]["optimizer_s"] if "alone" in r else None),
                _ms(r.get("compute_fake")),
                _ms(r.get("optimizer_fake")),
                _ms(ctrl),
                _ms(meas),
                _ms(None if meas is None or ctrl is None else meas - ctrl),
            ]
        )
    return [h + " ms" if i else h for i, h in enumerate(head)], body


def stats_lines(stats: dict) -> list[str]:
    lines = []
    for key, label in PREDICTORS:
        if key not in stats:
            continue
        s = stats[key]
        lines.append(
            f"{label}: Spearman {s['spearman']:.3f} ({'meets' if s['spearman_ok'] else 'misses'} >= "
            f"{TARGET_SPEARMAN}), median relative error {s['median_rel_error'] * 100:.1f}% "
            f"({'meets' if s['error_ok'] else 'misses'} <= {TARGET_MEDIAN_ERROR * 100:.0f}%), "
            f"median predicted / measured {s['median_ratio']:.3f}"
        )
    return lines


def reprice_run(folder: Path, cfg: dict) -> list[str]:
    """An earlier run's plans (``folder``/plans), its probed cluster and its measured steps (``steps.json``),
    priced again by this code: the markdown table and each predictor's statistics (before / after a pricing
    change, on the same measurements)."""
    from meshpilot.cluster import load_cluster
    from meshpilot.graph.capture import capture
    from meshpilot.planner.plan import Plan

    steps = json.loads((folder / "steps.json").read_text())
    meas = {r["name"]: r["median_s"] for r in steps["results"]}
    plans = {n: (Plan.load(folder / "plans" / f"{n}.json").only, None) for n in meas}
    (probed,) = folder.glob("*.probed.toml")
    model, inputs = _model_and_inputs(cfg)
    pred = predict(plans, capture(model, inputs), load_cluster(str(probed)))
    keys = [("closed_s", "closed-form"), ("sim_s", "simulated")]
    keys += [("closed_serial_s", "closed-form, buckets not priced"), ("sim_serial_s", "simulated, buckets not priced")]
    lines = ["| plan | " + " | ".join(f"{label} (probed) ms" for _, label in keys) + " | measured ms |"]
    lines.append("|---" * (len(keys) + 2) + "|")
    for n, m in meas.items():
        lines.append(f"| {n} | " + " | ".join(_ms(pred[n][k]) for k, _ in keys) + f" | {_ms(m)} |")
    for k, label in keys:
        f = fidelity([pred[n][k] for n in meas], list(meas.values()))
        lines.append(
            f"- {label} (probed): Spearman {f['spearman']:.3f}, median relative error "
            f"{f['median_rel_error'] * 100:.1f} %, median predicted / measured {f['median_ratio']:.3f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reprice_run:
        print("\n".join(reprice_run(args.reprice_run, gpt_config(args))))
        return 0
    from bench_atp_emulated import machine, markdown
    from rich.console import Console
    from rich.table import Table

    from meshpilot.cluster import load_cluster

    console = Console() if Console().is_terminal else Console(width=220)
    if not args.plans_only:
        if os.geteuid() != 0:
            raise SystemExit("needs root: meshpilot emulate builds network namespaces (run with sudo)")
        if not shutil.which("ip") or not shutil.which("tc"):
            raise SystemExit("needs the `ip` and `tc` commands (iproute2)")
    specs = list(PLANS)
    if args.only:
        keep = set(args.only.split(","))
        unknown = keep - {s.name for s in PLANS}
        if unknown:
            raise SystemExit(f"--only: unknown plan(s) {', '.join(sorted(unknown))}; choose from {_names()}")
        specs = [s for s in PLANS if s.name in keep]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cfg = gpt_config(args)
    cluster_file = args.cluster.resolve()
    t_start = time.perf_counter()
    load0 = os.getloadavg()
    summary: dict = {"machine": machine(), "model": cfg, "args": vars(args) | {"out_dir": str(args.out_dir)}}
    summary["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in summary["args"].items()}
    console.print(f"machine: {summary['machine']}; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")

    # 1. plans, priced on the file
    cluster = load_cluster(str(cluster_file))
    made = make_plans(specs, cfg, cluster, args.out_dir / "plans", log=console.print)
    graph, plans = made["graph"], made["plans"]
    for name, (p, _) in plans.items():
        again = reprice(p, graph, cluster).time.overlapped_s
        if not math.isclose(again, p.time.overlapped_s, rel_tol=1e-9):
            raise SystemExit(f"re-pricing {name} on its own cluster gives {again} s, not {p.time.overlapped_s} s")
    pred_file = predict(plans, graph, cluster)
    gemms = args.out_dir / "gemms.json"
    console.print(f"{len(write_gemms(plans, graph, gemms))} distinct local GEMMs over the plans: {gemms}")
    manifest = args.out_dir / "manifest.json"
    manifest.write_text(
        json.dumps({"model": cfg, "plans": [{"name": s.name, "path": str(plans[s.name][1])} for s in specs]}) + "\n"
    )
    t_plans = time.perf_counter() - t_start

    # 2. measure, 3. probe and re-price
    steps, steps_s, probe_s, load_steps, control, fake, alone = None, 0.0, 0.0, None, None, None, None
    probed = args.probed
    if not args.plans_only:
        l1 = os.getloadavg()
        steps, steps_s = measure(manifest, cluster_file, args.out_dir, args)
        load_steps = (l1, os.getloadavg())
        console.print(f"measured {len(steps['results'])} plans in {steps_s:.0f} s")
        if args.control:
            control, control_s = measure(manifest, args.control.resolve(), args.out_dir, args, tag="control")
            console.print(f"control {args.control.name}: {control_s:.0f} s")
        if args.fake:
            fake = measure_fake(manifest, steps["world"], args.out_dir, args)
            alone = predict_alone(plans, graph, cluster, probe_alone(gemms, args.out_dir))
        if probed is None:
            probed, probe_s = probe_cluster(cluster_file, gemms, args.out_dir, args)
            console.print(f"probed cluster: {probed} ({probe_s:.0f} s)")
    pred_probed = predict(plans, graph, load_cluster(str(probed))) if probed else None

    # 4. report
    rs = rows(specs, plans, pred_file, pred_probed, steps, control, fake, alone)
    stats = {}
    if steps:
        meas = [r["measured"] for r in rs]
        for key, _ in PREDICTORS:
            if key in rs[0]:
                stats[key] = fidelity([r[key] for r in rs], meas)
    head, body = table(rs)
    title = (
        f"{cluster.name}: GPT L={cfg['layers']} h={cfg['hidden']} heads={cfg['heads']} b={cfg['batch']} "
        f"s={cfg['seq']} V={cfg['vocab']} fp32, 8 ranks; "
        + (f"median of {steps['steps']} rounds" if steps else "predictions only")
    )
    t = Table(title=title)
    for h in head:
        t.add_column(h, justify="right")
    for row in body:
        t.add_row(*row)
    console.print(t)
    shead, sbody = split_table(rs)
    st = Table(title="where the step goes (ms): closed-form split, one rank's compute, control and link cost")
    for h in shead:
        st.add_column(h, justify="right")
    for row in sbody:
        st.add_row(*row)
    console.print(st)
    lines = stats_lines(stats)
    if steps:
        losses = [r["loss0"] for r in rs]
        lines.append(f"first-step loss over all plans: {min(losses):.6f} (spread {max(losses) - min(losses):.2e})")
    wall = time.perf_counter() - t_start
    lines.append(
        f"wall: plans {t_plans:.0f} s, steps {steps_s:.0f} s, probe {probe_s:.0f} s, total {wall:.0f} s; "
        f"load average (1 min) {load0[0]:.1f} at start"
        + (f", {load_steps[0][0]:.1f} / {load_steps[1][0]:.1f} around the steps" if load_steps else "")
    )
    for line in lines:
        console.print(line)
    summary |= {
        "cluster": str(cluster_file),
        "probed": str(probed) if probed else None,
        "rows": rs,
        "stats": stats,
        "measured": steps,
        "control": control,
        "fake": fake,
        "wall_s": {"plans": t_plans, "steps": steps_s, "probe": probe_s, "total": wall},
        "loadavg": {"start": load0, "around_steps": load_steps},
    }
    md = [f"### {title}", "", markdown(head, body), "", markdown(shead, sbody), "", *[f"- {x}" for x in lines]]
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (args.out_dir / "tables.md").write_text("\n".join(md) + "\n")
    if args.markdown:
        print("\n".join(md))
    console.print(f"results in {args.out_dir}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"command failed: {e}") from None
