"""Shared pieces of the subcommands: the --cluster option, argparse types for numbers, rich output."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from meshpilot.cluster import Cluster, load_cluster
from meshpilot.io import fmt_size  # noqa: F401 - re-exported for the subcommands


def make_console(stderr: bool = False) -> Console:
    """A rich console for the subcommands' output. Emoji codes off: a model named ``hf:llama`` prints as
    itself, not with ``:llama:`` turned into a llama."""
    return Console(stderr=stderr, emoji=False)


console = make_console()


def _number(text: str, kind: type, what: str, *, allow_zero: bool = False) -> float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"{text!r}: give {what}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (``--devices 0`` is refused with the flag named)."""
    return int(_number(text, int, "a whole number of at least 1"))


def nonnegative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    return int(_number(text, int, "a whole number of at least 0", allow_zero=True))


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (NaN, inf, 0 and negatives are refused)."""
    return float(_number(text, float, "a finite number greater than 0"))


def path_arg(text: str) -> Path:
    """argparse type: a file or folder path. An empty one is refused with the flag named (``Path("")`` is ``.``,
    the current folder, which no message about ``--out`` should show)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; give a file or folder name")
    return Path(text)


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


def add_hf_config_arg(parser: argparse.ArgumentParser, help: str) -> None:
    """``--hf-config KEY=VALUE|FILE …`` (repeatable): the one definition `plan` and `train` share."""
    parser.add_argument("--hf-config", nargs="+", action="extend", default=[], metavar="KEY=VALUE|FILE", help=help)


def gbps(x: float) -> float | None:
    """Bytes/s to GB/s for tables and JSON; None for an axis without communication."""
    return None if math.isinf(x) else round(x / 1e9, 6)


def fmt_gbps(x: float) -> str:
    return "—" if math.isinf(x) else f"{x / 1e9:.4g}"


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")
