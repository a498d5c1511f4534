"""`meshpilot atp`: ATP's topology-aware mesh search (Eq. 2-4) for a GPT on a cluster, or the Fig. 12 sweep."""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

from rich.table import Table

from meshpilot.cli.common import (
    add_cluster_arg,
    console,
    fmt_gbps,
    gbps,
    get_cluster,
    path_arg,
    positive_int,
    print_json,
)
from meshpilot.cli.main import COMMANDS
from meshpilot.cluster import load_cluster
from meshpilot.cluster.presets import parse_preset
from meshpilot.errors import UserError
from meshpilot.io import atomic_path, atomic_write, check_writable
from meshpilot.models import gpt_config
from meshpilot.planner.atp import DTYPE_BYTES, closed_form, search, sweep

SWEEP_SIZES = {"atp-ic5": [2**k for k in range(2, 11)], "atp-ic6": [q * q for q in (2, 4, 8, 16, 32)]}
"""The device counts N of ATP's Fig. 12 sweep on each sized preset (IC6: q x q tori)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "atp",
        help=COMMANDS["atp"],
        description=__doc__
        + " T_comm = 2Lbs·e·(7h/(d1·B2) + 2h/(d2·B1)); B1, B2 from the cluster's matrix (Eq. 3-4) or its"
        " calibration entries. DeviceMesh(N,1) is Megatron-LM's 1D tensor parallelism.",
    )
    add_cluster_arg(p)
    p.add_argument("--devices", "-n", type=positive_int, help="tensor-parallel devices N (default: all of the cluster)")
    p.add_argument("--model", "-m", help="built-in GPT (atp-m1 … atp-m4) or 'gpt' (default atp-m2)")
    p.add_argument("--layers", type=positive_int, help="override the model's layer count L")
    p.add_argument("--hidden", type=positive_int, help="override the hidden size h")
    p.add_argument("--heads", type=positive_int, help="override the attention heads")
    p.add_argument("--batch", "-b", type=positive_int, help="override the micro-batch size b")
    p.add_argument("--seq", "-s", type=positive_int, help="override the sequence length s")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="activation dtype (default float16)")
    p.add_argument("--json", action="store_true", help='print {"chosen": [d1, d2], "candidates": [...]}')
    p.add_argument(
        "--sweep",
        action="store_true",
        help="Fig. 12: T_comm/Δ of ATP-1/2/4/8 and ATP-OPT for N = 4 … --max-devices on a sized preset",
    )
    p.add_argument("--max-devices", type=positive_int, help="largest N of the sweep (default 1024)")
    p.add_argument(
        "--out", type=path_arg, help="sweep output prefix: writes PREFIX.csv and PREFIX.png (default atp-sweep)"
    )
    p.set_defaults(func=run)


SEARCH_ONLY = ("devices", "model", "layers", "hidden", "heads", "batch", "seq", "dtype", "json")
"""Flags of the mesh search that the sweep (T_comm / Δ: no model, every N) has no use for."""
SWEEP_ONLY = ("max_devices", "out")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n) not in (None, False)]


def run(args: argparse.Namespace) -> int:
    if args.sweep:
        unused = _given(args, SEARCH_ONLY)
        if unused:
            raise UserError(
                f"{', '.join(unused)}: not used by --sweep (T_comm / Δ of every mesh for N = 4 … --max-devices, "
                "written to --out PREFIX.csv); drop them, or drop --sweep to search one model's mesh"
            )
        return run_sweep(args)
    unused = _given(args, SWEEP_ONLY)
    if unused:
        raise UserError(f"{', '.join(unused)}: only with --sweep; add --sweep or drop them")
    args.model, args.dtype = args.model or "atp-m2", args.dtype or "float16"
    cluster = get_cluster(args)
    model = gpt_config(
        args.model, layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch, seq=args.seq
    )
    n = args.devices or cluster.num_devices
    if n > cluster.num_devices:
        raise UserError(f"--devices {n}: cluster {cluster.name!r} has {cluster.num_devices} devices; pick 1..that")
    result = search(cluster, n, model, DTYPE_BYTES[args.dtype])
    if args.json:
        print_json(
            {
                "cluster": cluster.name,
                "devices": n,
                "chosen": list(result.chosen.mesh),
                "speedup_vs_megatron": result.speedup,
                "candidates": [
                    {
                        "mesh": list(c.mesh),
                        "t_comm_s": c.t_comm_s,
                        "B1_GBps": gbps(c.B1),
                        "B2_GBps": gbps(c.B2),
                        "calibrated": c.calibrated,
                    }
                    for c in result.candidates
                ],
            }
        )
        return 0
    t = Table(
        title=f"ATP on {cluster.name}, {n} devices, GPT L={model.layers} h={model.hidden} b={model.batch} "
        f"s={model.seq} {args.dtype}"
    )
    for col in ("", "DeviceMesh", "T_comm ms", "vs (N,1)", "B1 GB/s", "B2 GB/s", "note"):
        t.add_column(col, justify="right")
    base = result.baseline.t_comm_s
    for c in result.candidates:
        notes = [x for x, on in (("Megatron-LM 1D", c.mesh == (n, 1)), ("calibrated", c.calibrated)) if on]
        t.add_row(
            "★" if c is result.chosen else "",
            f"({c.mesh[0]}, {c.mesh[1]})",
            f"{c.t_comm_s * 1e3:.3f}",
            f"{c.t_comm_s / base:.3f}" if base else "—",
            fmt_gbps(c.B1),
            fmt_gbps(c.B2),
            ", ".join(notes),
        )
    console.print(t)
    ch = result.chosen
    console.print(
        f"chosen DeviceMesh{ch.mesh}: T_comm {ch.t_comm_s * 1e3:.3f} ms, "
        f"{(1 - ch.t_comm_s / base) * 100:.1f}% below Megatron-LM's DeviceMesh({n}, 1) "
        f"(predicted communication speedup {result.speedup:.2f}x)"
    )
    return 0


def run_sweep(args: argparse.Namespace) -> int:
    name = args.cluster.partition(":")[0]
    if name not in SWEEP_SIZES:
        raise UserError(f"--sweep needs a sized preset, atp-ic5 or atp-ic6; got {args.cluster!r}")
    parse_preset(args.cluster)  # the same checks as every other command's --cluster
    if ":" in args.cluster:
        raise UserError(
            f"--cluster {args.cluster}: --sweep sizes the preset itself (N = 4 … --max-devices); "
            f"write --cluster {name} and set --max-devices"
        )
    args.max_devices = args.max_devices or 1024
    args.out = args.out or Path("atp-sweep")
    ns = [n for n in SWEEP_SIZES[name] if n <= args.max_devices]
    if not ns:
        raise UserError(
            f"--max-devices {args.max_devices}: below the sweep's smallest N ({SWEEP_SIZES[name][0]} on {name}); "
            f"give at least {SWEEP_SIZES[name][0]}"
        )
    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"--out {out}: is a folder; give a file prefix inside it, e.g. {out / 'atp-sweep'}")
    for suffix in (".csv", ".png"):
        check_writable(out.with_suffix(suffix), "--out")
    if name == "atp-ic5":
        at = lambda n: load_cluster(f"atp-ic5:{n}")  # noqa: E731
    else:
        at = lambda n: load_cluster(f"atp-ic6:{round(n**0.5)}")  # noqa: E731
    ways = (1, 2, 4, 8)
    with console.status("sweeping meshes …"):
        rows = sweep(at, ns, ways)
    header = ["N"] + [f"ATP-{i}" for i in ways] + ["ATP-OPT", "opt_d1", "opt_d2"]
    header += [f"closed_form_ATP-{i}" for i in ways] + ["closed_form_OPT"]
    lines = []
    for r in rows:
        cf = {i: closed_form(r.devices // i, i) for i in ways if r.devices % i == 0}
        lines.append(
            [r.devices]
            + [r.atp.get(i, "") for i in ways]
            + [r.opt, r.opt_mesh[0], r.opt_mesh[1]]
            + [cf.get(i, "") for i in ways]
            + [min(closed_form(r.devices // d2, d2) for d2 in range(1, r.devices + 1) if r.devices % d2 == 0)]
        )
    buf = io.StringIO()
    csv.writer(buf).writerows([header, *lines])
    atomic_write(out.with_suffix(".csv"), buf.getvalue(), newline="")
    _plot(rows, ways, out.with_suffix(".png"), args.cluster)
    t = Table(title=f"T_comm / Δ on {name} (Δ = 2Lbsh/GroupBW)")
    for col in header[:-5]:
        t.add_column(col, justify="right")
    for line in lines:
        t.add_row(*[f"{x:.4f}" if isinstance(x, float) else str(x) for x in line[: len(header) - 5]])
    console.print(t)
    console.print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.png')}")
    return 0


def _plot(rows, ways, path: Path, cluster: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ns = [r.devices for r in rows]
    for i in ways:
        pts = [(r.devices, r.atp[i]) for r in rows if i in r.atp]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"ATP-{i}")
    ax.plot(ns, [r.opt for r in rows], "k--", marker="s", label="ATP-OPT")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices N")
    ax.set_ylabel("T_comm / Δ")
    ax.set_title(f"ATP Fig. 12 on {cluster.partition(':')[0]}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
