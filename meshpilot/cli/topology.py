"""`meshpilot topology`: a cluster's hierarchy and, for every 2D mesh, B1', B2' (Eq. 3) and B1, B2 (Eq. 4)."""

from __future__ import annotations

import argparse

import numpy as np
from rich.table import Table

from meshpilot.cli.common import add_cluster_arg, console, gbps, get_cluster, positive_int, print_json
from meshpilot.cli.main import COMMANDS
from meshpilot.cluster import GB, Cluster, LogicalMesh, mesh_shapes_2d


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "topology",
        help=COMMANDS["topology"],
        description=__doc__
        + " Mesh axis 1 runs over contiguous ranks. A calibrated mesh shows the measured B instead of Eq. 4's.",
    )
    add_cluster_arg(p)
    p.add_argument("--devices", "-n", type=positive_int, help="mesh size (default: every device of the cluster)")
    p.add_argument("--json", action="store_true", help="print JSON: {meshes: [{mesh, B1_prime_GBps, ...}]}")
    p.set_defaults(func=run)


def mesh_rows(cluster: Cluster, n: int) -> list[dict]:
    rows = []
    for shape in mesh_shapes_2d(n):
        m = LogicalMesh(cluster, shape)
        rows.append(
            {
                "mesh": list(shape),
                "B1_prime_GBps": gbps(m.effective_bandwidth(0)),
                "B2_prime_GBps": gbps(m.effective_bandwidth(1)),
                "B1_GBps": gbps(m.algorithm_bandwidth(0)),
                "B2_GBps": gbps(m.algorithm_bandwidth(1)),
                "calibrated": cluster.calibrated(shape) is not None,
            }
        )
    return rows


def _cell(gb: float | None) -> str:
    """A row's GB/s value as the table shows it ('—' for an axis without communication)."""
    return "—" if gb is None else f"{gb:.4g}"


def run(args: argparse.Namespace) -> int:
    from meshpilot.errors import UserError

    cluster = get_cluster(args)
    n = args.devices or cluster.num_devices
    if not 1 <= n <= cluster.num_devices:
        raise UserError(f"--devices {n}: cluster {cluster.name!r} has {cluster.num_devices} devices; pick 1..that")
    rows = mesh_rows(cluster, n)
    if args.json:
        print_json({"cluster": cluster.name, "devices": n, "meshes": rows})
        return 0
    h = Table(title=f"{cluster.name}: {cluster.num_devices} x {cluster.device.kind} ({cluster.source})")
    for col in ("layer", "ranks R", "P2P GB/s", "group GB/s", "latency µs"):
        h.add_column(col)
    for layer in cluster.layers:
        off = layer.p2p[~np.eye(layer.ranks, dtype=bool)]
        if off.size == 0:
            p2p = "—"  # a layer of one rank has no peers
        elif layer.uniform:
            p2p = f"{off.min() / GB:g}"
        else:
            p2p = f"{off.min() / GB:g} … {off.max() / GB:g}"
        grp = f"{layer.group_bw.min() / GB:g}" + ("" if layer.uniform else f" … {layer.group_bw.max() / GB:g}")
        h.add_row(layer.name, str(layer.ranks), p2p, grp, f"{layer.latency * 1e6:g}")
    console.print(h)
    t = Table(title=f"2D meshes of {n} devices (Eq. 3: B' per axis; Eq. 4: all-reduce algorithm bandwidth B)")
    for col in ("DeviceMesh", "B1' GB/s", "B2' GB/s", "B1 GB/s", "B2 GB/s", ""):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            f"({r['mesh'][0]}, {r['mesh'][1]})",
            *(_cell(r[k]) for k in ("B1_prime_GBps", "B2_prime_GBps", "B1_GBps", "B2_GBps")),
            "calibrated" if r["calibrated"] else "",
        )
    console.print(t)
    return 0
