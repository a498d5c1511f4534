"""ATP on an emulated multi-node cluster: predicted T_comm next to measured GPT training steps.

For each topology (a cluster TOML that `meshpilot emulate` can build; needs root):

1. probe: ``meshpilot probe`` runs under ``emulate`` on that cluster and writes a measured cluster TOML
   (hierarchy from P2P/fan-out, plus a calibration entry with the all-reduce bandwidths of every 2D mesh);
   ``--probed NAME=FILE`` reuses an earlier probe instead;
2. predict: ATP's search (Eq. 2, float32 activations) on the example file (matrix only, Eq. 3/4) and on the
   probed file (calibrated) gives T_comm per mesh and each one's chosen mesh;
3. measure: ``benchmarks/atp_step_worker.py`` runs under ``emulate`` and times the GPT training step
   (forward + backward + AdamW) on every 2D mesh and chunk count k (median over interleaved rounds,
   slowest rank per step).

It then prints, per topology, mesh | T_comm (file) | T_comm (probed) | measured step k=1,2,4 | chosen |
fastest, and checks ATP's criterion: the chosen mesh's k=1 step is the measured fastest k=1 step or within
5% of it. Everything (logs, probed TOMLs, the worker's JSON, a JSON summary, a markdown copy of the tables)
goes to --out-dir.

Decomposition (optional): ``--control NAME=FILE`` also times k=1 steps of every mesh on a control cluster
FILE (the same shape with a fast inter-node link), and ``--fake`` times one rank's computation on torch's
fake process group (no communication). A second table then shows, per mesh, compute per rank, the step on
the control, the step on the topology, their difference (what the slow link costs, measured) and the
inter-node part of the predicted T_comm (the Eq. 2 terms of the mesh axes whose groups span nodes).

    sudo python benchmarks/bench_atp_emulated.py                       # both default topologies
    sudo python benchmarks/bench_atp_emulated.py --topology 2x4-slow --steps 5
    sudo python benchmarks/bench_atp_emulated.py --topology my.toml --probed my=out/my-probed.toml
    sudo python benchmarks/bench_atp_emulated.py -t 2x4-slow --fake \
        --control 2x4-slow=examples/clusters/emulated-2x4-fast.toml

See docs/benchmarks.md, section "ATP on emulated clusters".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import atp_step_worker  # beside this script (on sys.path when it runs): the worker each emulated run starts

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "atp_step_worker.py"
TOPOLOGIES = {
    "2x4-slow": REPO / "examples" / "clusters" / "emulated-2x4-slow.toml",
    "4x2-racks": REPO / "examples" / "clusters" / "emulated-4x2-racks.toml",
}
CRITERION = 0.05  # the chosen mesh must be within 5% of the measured fastest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Needs root (network namespaces). Defaults: GPT L=2 h=256 heads=8 b=16 s=128 vocab=512 float32.",
    )
    p.add_argument(
        "--topology",
        "-t",
        action="append",
        metavar="NAME|FILE",
        help=f"a cluster TOML or one of {', '.join(TOPOLOGIES)} (repeatable; default: all of those)",
    )
    p.add_argument(
        "--probed",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="use this probed cluster TOML for topology NAME (its name or file stem) instead of probing",
    )
    p.add_argument("--out-dir", type=Path, default=REPO / "out" / "bench-atp-emulated", help="where results go")
    atp_step_worker.add_shared_options(p)  # the GPT's size and the step counts, forwarded to the worker
    p.add_argument("--chunks", default="1,2,4", help="chunk counts k (default 1,2,4)")
    p.add_argument(
        "--chunks-on",
        choices=["all", "chosen"],
        default="all",
        help="run k > 1 on every mesh (all) or only on the probed choice and DeviceMesh(N,1) (chosen)",
    )
    p.add_argument("--probe-bytes", default=None, help="message size for the probe (default: probe's, 4MiB)")
    p.add_argument("--probe-budget", type=float, default=60.0, help="probe's --p2p-budget seconds (default 60)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per emulated run (default 600)")
    p.add_argument("--port", type=int, default=29400, help="rendezvous port (default 29400)")
    p.add_argument(
        "--control",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="also time k=1 steps on control cluster FILE for topology NAME (decomposition table)",
    )
    p.add_argument("--fake", action="store_true", help="also time one rank's compute on a fake process group")
    p.add_argument("--markdown", action="store_true", help="also print the tables as markdown")
    return p.parse_args(argv)


@dataclass
class Topology:
    name: str
    file: Path


def _topologies(specs: list[str] | None) -> list[Topology]:
    out = []
    for spec in specs or list(TOPOLOGIES):
        if spec in TOPOLOGIES:
            out.append(Topology(spec, TOPOLOGIES[spec]))
        else:
            path = Path(spec)
            if not path.is_file():
                raise SystemExit(f"--topology {spec}: not one of {', '.join(TOPOLOGIES)} nor a file")
            out.append(Topology(path.stem, path.resolve()))
    return out


def _emulate(cluster_file: Path, cmd: list[str], log: Path, args: argparse.Namespace) -> tuple[int, float]:
    from meshpilot.emulate import run_emulated

    t0 = time.perf_counter()
    with log.open("w") as fh:
        rc = run_emulated(str(cluster_file), cmd, timeout=args.timeout, port=args.port, stdout=fh, stderr=fh)
    return rc, time.perf_counter() - t0


def _fail(what: str, rc: int, log: Path) -> None:
    tail = log.read_text().splitlines()[-25:] if log.exists() else []
    print("\n".join(tail), file=sys.stderr)
    raise SystemExit(f"{what} failed with exit code {rc}; full log in {log}")


def probe(topo: Topology, out_dir: Path, args: argparse.Namespace) -> tuple[Path, float]:
    probed = out_dir / f"{topo.name}.probed.toml"
    cmd = ["python", "-m", "meshpilot.cli.main", "probe", "--out", str(probed), "--name", f"{topo.name}-probed"]
    cmd += ["--p2p-budget", str(args.probe_budget)]
    if args.probe_bytes:
        cmd += ["--bytes", args.probe_bytes]
    log = out_dir / f"{topo.name}.probe.log"
    rc, secs = _emulate(topo.file, cmd, log, args)
    if rc != 0 or not probed.is_file():
        _fail(f"probe on {topo.name}", rc, log)
    return probed, secs


def crossing_axes(cluster_file: Path) -> dict[tuple[int, int], tuple[bool, bool]]:
    """Per 2D mesh of the topology, whether the groups of mesh axis 0 / axis 1 span nodes (layer 0 units)."""
    from meshpilot.cluster import LogicalMesh, load_cluster, mesh_shapes_2d

    cluster = load_cluster(str(cluster_file))
    per_node = cluster.num_devices // cluster.layers[0].ranks
    out = {}
    for shape in mesh_shapes_2d(cluster.num_devices):
        m = LogicalMesh(cluster, shape)
        out[shape] = tuple(bool((m.groups(a) // per_node != m.groups(a)[:, :1] // per_node).any()) for a in (0, 1))
    return out


def predict(cluster_file: Path, cfg: dict, crossing: dict) -> dict:
    """ATP's search on a cluster file: T_comm per mesh (and its inter-node part), the chosen mesh."""
    from meshpilot.cluster import load_cluster
    from meshpilot.models.gpt import GPTConfig
    from meshpilot.planner.atp import search

    cluster = load_cluster(str(cluster_file))
    res = search(cluster, cluster.num_devices, GPTConfig(**cfg), dtype_bytes=4)
    scale = 2 * cfg["layers"] * cfg["batch"] * cfg["seq"] * 4  # 2 L b s e, Eq. 2
    h = cfg["hidden"]
    inter = {}
    for c in res.candidates:
        (d1, d2), x0, x1 = c.mesh, *crossing[tuple(c.mesh)]
        t0 = 0.0 if d1 == 1 else scale * 2 * h / (d2 * c.B1)  # attention out + MLP down over axis 0
        t1 = 0.0 if d2 == 1 else scale * 7 * h / (d1 * c.B2)  # QKV + MLP up over axis 1
        inter[tuple(c.mesh)] = (t0 if x0 else 0.0) + (t1 if x1 else 0.0)
    return {
        "cluster": cluster.name,
        "t_comm_s": {tuple(c.mesh): c.t_comm_s for c in res.candidates},
        "t_comm_inter_node_s": inter,
        "B1_Bps": {tuple(c.mesh): c.B1 for c in res.candidates},
        "B2_Bps": {tuple(c.mesh): c.B2 for c in res.candidates},
        "calibrated": all(c.calibrated for c in res.candidates),
        "chosen": tuple(res.chosen.mesh),
        "devices": cluster.num_devices,
    }


def _worker_args(args: argparse.Namespace) -> list[str]:
    cmd = []
    for key in atp_step_worker.SHARED_OPTIONS:
        cmd += [f"--{key}", str(getattr(args, key))]
    return cmd


def measure(
    name: str, cluster_file: Path, out_dir: Path, args: argparse.Namespace, chunks: str, chunk_meshes: str
) -> tuple[dict, float]:
    result = out_dir / f"{name}.steps.json"
    result.unlink(missing_ok=True)
    cmd = ["python", str(WORKER), "--out", str(result), "--chunks", chunks, "--chunks-meshes", chunk_meshes]
    cmd += _worker_args(args)
    log = out_dir / f"{name}.steps.log"
    rc, secs = _emulate(cluster_file, cmd, log, args)
    if rc != 0 or not result.is_file():
        _fail(f"step benchmark on {name}", rc, log)
    return json.loads(result.read_text()), secs


def measure_fake(world: int, out_dir: Path, args: argparse.Namespace) -> dict:
    """One rank's step on a fake process group of `world` ranks, k=1, every mesh (no communication)."""
    result = out_dir / f"fake{world}.steps.json"
    cmd = [sys.executable, str(WORKER), "--fake-world", str(world), "--chunks", "1", "--out", str(result)]
    subprocess.run(
        cmd + _worker_args(args), check=True, stdout=subprocess.DEVNULL, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    return json.loads(result.read_text())


def analyse(pred_file: dict, pred_probed: dict, steps: dict, chunk_counts: list[int]) -> dict:
    """Rows per mesh plus the verdicts: chosen vs measured fastest, speedup over (N,1), k ratios."""
    n = steps["world"]
    t = {(tuple(r["mesh"]), r["chunks"]): r["median_s"] for r in steps["results"]}
    spread = {tuple(r["mesh"]): (r["min_s"], r["max_s"]) for r in steps["results"] if r["chunks"] == 1}
    meshes = [m for m in pred_file["t_comm_s"] if (m, 1) in t]
    meshes.sort(key=lambda m: -m[0])
    k1 = {m: t[(m, 1)] for m in meshes}
    best_k = {m: min((t[(m, k)], k) for k in chunk_counts if (m, k) in t) for m in meshes}
    fastest = min(meshes, key=lambda m: k1[m])
    fastest_any = min(meshes, key=lambda m: best_k[m][0])
    base = (n, 1)

    def verdict(chosen: tuple[int, int], pred: dict) -> dict:
        gap = k1[chosen] / k1[fastest] - 1
        gap_any = best_k[chosen][0] / best_k[fastest_any][0] - 1
        return {
            "mesh": list(chosen),
            "k1_s": k1[chosen],
            "gap_vs_fastest_k1": gap,
            "within_5pct_k1": gap <= CRITERION,
            "gap_vs_fastest_best_k": gap_any,
            "within_5pct_best_k": gap_any <= CRITERION,
            "speedup_vs_N1_k1": k1[base] / k1[chosen],
            "speedup_vs_N1_best_k": k1[base] / best_k[chosen][0],
            "predicted_speedup": (
                pred["t_comm_s"][base] / pred["t_comm_s"][chosen] if pred["t_comm_s"][chosen] > 0 else math.inf
            ),
        }

    rows = []
    for m in meshes:
        rows.append(
            {
                "mesh": list(m),
                "t_comm_file_s": pred_file["t_comm_s"][m],
                "t_comm_probed_s": pred_probed["t_comm_s"][m],
                "B1_probed_Bps": pred_probed["B1_Bps"][m],
                "B2_probed_Bps": pred_probed["B2_Bps"][m],
                "step_s": {str(k): t.get((m, k)) for k in chunk_counts},
                "k1_min_s": spread[m][0],
                "k1_max_s": spread[m][1],
                "k_ratio": {str(k): (t[(m, k)] / t[(m, 1)] if (m, k) in t else None) for k in chunk_counts},
                "chosen_file": m == pred_file["chosen"],
                "chosen_probed": m == pred_probed["chosen"],
                "fastest_k1": m == fastest,
                "fastest_best_k": m == fastest_any,
                "best_k": best_k[m][1],
            }
        )
    return {
        "rows": rows,
        "fastest_k1": list(fastest),
        "fastest_best_k": [*fastest_any, best_k[fastest_any][1]],
        "chosen_file": verdict(pred_file["chosen"], pred_file),
        "chosen_probed": verdict(pred_probed["chosen"], pred_probed),
    }


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def table_rows(an: dict, chunk_counts: list[int]) -> tuple[list[str], list[list[str]]]:
    head = ["mesh", "T_comm file ms", "T_comm probed ms"]
    head += [f"step k={k} ms" + (" (min-max)" if k == 1 else "") for k in chunk_counts]
    head += ["ATP's choice", "measured fastest"]
    body = []
    for r in an["rows"]:
        d1, d2 = r["mesh"]
        chosen = [x for x, on in (("file", r["chosen_file"]), ("probed", r["chosen_probed"])) if on]
        fastest = [x for x, on in (("k=1", r["fastest_k1"]), (f"any k (k={r['best_k']})", r["fastest_best_k"])) if on]
        k1 = f"{_ms(r['step_s']['1'])} ({_ms(r['k1_min_s'])}-{_ms(r['k1_max_s'])})"
        body.append(
            [f"({d1},{d2})", _ms(r["t_comm_file_s"]), _ms(r["t_comm_probed_s"]), k1]
            + [_ms(r["step_s"][str(k)]) for k in chunk_counts if k != 1]
            + [" + ".join(chosen) or "", ", ".join(fastest) or ""]
        )
    return head, body


def decomposition_rows(
    an: dict, pred_file: dict, pred_probed: dict, control: dict | None, fake: dict | None
) -> tuple[list[str], list[list[str]]]:
    ctrl = {tuple(r["mesh"]): r["median_s"] for r in control["results"] if r["chunks"] == 1} if control else {}
    comp = {tuple(r["mesh"]): r["median_s"] for r in fake["results"] if r["chunks"] == 1} if fake else {}
    head = ["mesh", "compute/rank ms (fake PG)", "step k=1, control ms", "step k=1 ms", "link cost ms (measured)"]
    head += ["inter-node T_comm probed ms", "inter-node T_comm file ms"]
    body = []
    for r in an["rows"]:
        m = tuple(r["mesh"])
        k1, c = r["step_s"]["1"], ctrl.get(m)
        body.append(
            [
                f"({m[0]},{m[1]})",
                _ms(comp.get(m)),
                _ms(c),
                _ms(k1),
                _ms(None if c is None else k1 - c),
                _ms(pred_probed["t_comm_inter_node_s"][m]),
                _ms(pred_file["t_comm_inter_node_s"][m]),
            ]
        )
    return head, body


def summary_lines(name: str, an: dict, chunk_counts: list[int], n: int) -> list[str]:
    lines = []
    for which in ("chosen_probed", "chosen_file"):
        v = an[which]
        label = "probed (calibrated)" if which == "chosen_probed" else "example file (matrix)"
        mesh = tuple(v["mesh"])
        ok = "YES" if v["within_5pct_k1"] else "NO"
        lines.append(
            f"{name}: ATP on the {label} chooses DeviceMesh{mesh}: k=1 step {_ms(v['k1_s'])} ms, "
            f"{v['gap_vs_fastest_k1'] * 100:+.1f}% vs the measured fastest k=1 DeviceMesh{tuple(an['fastest_k1'])} "
            f"-> within 5%: {ok}; measured speedup over DeviceMesh({n},1) {v['speedup_vs_N1_k1']:.2f}x at k=1, "
            f"{v['speedup_vs_N1_best_k']:.2f}x with its best k (predicted T_comm ratio {v['predicted_speedup']:.2f}x)"
        )
    for r in an["rows"]:
        parts = [f"k={k}/k=1 {r['k_ratio'][str(k)]:.2f}" for k in chunk_counts if k != 1 and r["k_ratio"][str(k)]]
        if parts:
            lines.append(f"{name}: DeviceMesh{tuple(r['mesh'])} step time ratio " + ", ".join(parts))
    return lines


def markdown(head: list[str], body: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(out)


def machine() -> dict:
    import torch

    return {
        "nproc": os.cpu_count(),
        "sched_affinity": len(os.sched_getaffinity(0)),
        "cpu": _cpu_model(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if os.geteuid() != 0:
        raise SystemExit("needs root: meshpilot emulate builds network namespaces (run with sudo)")
    if not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit("needs the `ip` and `tc` commands (iproute2)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    chunk_counts = [int(k) for k in args.chunks.split(",")]
    if 1 not in chunk_counts:
        raise SystemExit("--chunks must include 1 (the criterion and the ratios are taken at k=1)")
    cfg = {k: getattr(args, k) for k in ("vocab", "seq", "layers", "hidden", "heads", "batch")}
    probed_given = dict(p.split("=", 1) for p in args.probed)
    controls = {k: Path(v) for k, v in (c.split("=", 1) for c in args.control)}
    summary: dict = {"machine": machine(), "model": cfg, "args": vars(args) | {"out_dir": str(args.out_dir)}}
    summary["topologies"] = {}
    md: list[str] = []
    console.print(f"machine: {summary['machine']}")
    fakes: dict[int, dict] = {}
    for topo in _topologies(args.topology):
        console.rule(f"{topo.name}: {topo.file.relative_to(REPO) if topo.file.is_relative_to(REPO) else topo.file}")
        t_topo = time.perf_counter()
        load0 = os.getloadavg()
        if topo.name in probed_given:
            probed, probe_s = Path(probed_given[topo.name]), 0.0
            console.print(f"probed cluster: {probed} (given)")
        else:
            probed, probe_s = probe(topo, args.out_dir, args)
            console.print(f"probed cluster: {probed} ({probe_s:.0f} s)")
        crossing = crossing_axes(topo.file)
        pred_file, pred_probed = predict(topo.file, cfg, crossing), predict(probed, cfg, crossing)
        n = pred_file["devices"]
        if args.chunks_on == "chosen":
            chunk_meshes = ",".join(f"{a}x{b}" for a, b in {(n, 1), pred_probed["chosen"]})
        else:
            chunk_meshes = "all"
        load1 = os.getloadavg()
        steps, steps_s = measure(topo.name, topo.file, args.out_dir, args, args.chunks, chunk_meshes)
        load2 = os.getloadavg()
        control = None
        if topo.name in controls:
            name = f"{topo.name}.control-{controls[topo.name].stem}"
            control, _ = measure(name, controls[topo.name], args.out_dir, args, "1", "all")
        if args.fake and n not in fakes:
            fakes[n] = measure_fake(n, args.out_dir, args)
        fake = fakes.get(n)
        an = analyse(pred_file, pred_probed, steps, chunk_counts)
        losses = {tuple(r["mesh"]) + (r["chunks"],): r["loss0"] for r in steps["results"]}
        head, body = table_rows(an, chunk_counts)
        title = (
            f"{topo.name}: {steps['nodes']} nodes, {n} ranks; GPT L={cfg['layers']} h={cfg['hidden']} "
            f"b={cfg['batch']} s={cfg['seq']} V={cfg['vocab']} fp32; median of {steps['steps']} steps"
        )
        t = Table(title=title)
        for h in head:
            t.add_column(h, justify="right")
        for row in body:
            t.add_row(*row)
        console.print(t)
        lines = summary_lines(topo.name, an, chunk_counts, n)
        for line in lines:
            console.print(line)
        dmd: list[str] = []
        if control or fake:
            dhead, dbody = decomposition_rows(an, pred_file, pred_probed, control, fake)
            ctl = f"control {controls[topo.name].name}" if control else "no control"
            dt = Table(title=f"{topo.name}: where the k=1 step goes ({ctl}; medians)")
            for h in dhead:
                dt.add_column(h, justify="right")
            for row in dbody:
                dt.add_row(*row)
            console.print(dt)
            dmd = [f"Decomposition ({ctl}):", "", markdown(dhead, dbody), ""]
        spread = max(losses.values()) - min(losses.values())
        console.print(f"first-step loss over all configurations: {min(losses.values()):.6f} (spread {spread:.2e})")
        wall = time.perf_counter() - t_topo
        console.print(
            f"wall: probe {probe_s:.0f} s, steps {steps_s:.0f} s, total {wall:.0f} s; "
            f"load average (1 min) {load0[0]:.1f} before, {load1[0]:.1f} / {load2[0]:.1f} around the steps"
        )
        summary["topologies"][topo.name] = {
            "file": str(topo.file),
            "probed": str(probed),
            "predicted_file": _jsonable(pred_file),
            "predicted_probed": _jsonable(pred_probed),
            "measured": steps,
            "control": control,
            "fake": fake,
            "analysis": an,
            "loss0_spread": spread,
            "wall_s": {"probe": probe_s, "steps": steps_s, "total": wall},
            "loadavg": {"start": load0, "before_steps": load1, "after_steps": load2},
        }
        md += [f"### {title}", "", markdown(head, body), "", *[f"- {x}" for x in lines], "", *dmd]
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out_dir / "tables.md").write_text("\n".join(md))
    if args.markdown:
        print("\n".join(md))
    console.print(f"results in {args.out_dir}")
    return 0


def _jsonable(pred: dict) -> dict:
    out = {}
    for k, v in pred.items():
        out[k] = {f"{m[0]}x{m[1]}": x for m, x in v.items()} if isinstance(v, dict) else v
    return out


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"command failed: {e}") from None
