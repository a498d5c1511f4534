"""Shared pieces of the subcommands: the --cluster option and rich output."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from rich.console import Console

from meshpilot.cluster import Cluster, load_cluster

console = Console()


def add_cluster_arg(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--cluster",
        "-c",
        required=required,
        metavar="C",
        help="a preset name (see `meshpilot presets`; sized ones as atp-ic5:64) or a cluster TOML file",
    )


def get_cluster(args: argparse.Namespace) -> Cluster:
    return load_cluster(args.cluster)


def gbps(x: float) -> float | None:
    """Bytes/s to GB/s for tables and JSON; None for an axis without communication."""
    return None if math.isinf(x) else round(x / 1e9, 6)


def fmt_gbps(x: float) -> str:
    return "—" if math.isinf(x) else f"{x / 1e9:.4g}"


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
