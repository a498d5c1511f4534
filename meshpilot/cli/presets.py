"""`meshpilot presets`: the built-in clusters, device kinds and models."""

from __future__ import annotations

import argparse

from rich.table import Table

from meshpilot.cli.common import console, print_json
from meshpilot.cli.main import COMMANDS
from meshpilot.cluster import DEVICES, PRESETS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help=COMMANDS["presets"], description=__doc__)
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(func=run)


def _models() -> dict[str, str]:
    try:
        from meshpilot.models import builtin_models
    except ImportError:
        return {}
    return {name: entry.summary for name, entry in builtin_models().items()}


def run(args: argparse.Namespace) -> int:
    models = _models()
    if args.json:
        print_json(
            {
                "clusters": [
                    {"name": p.name, "summary": p.summary, "size": p.size, "default_size": p.default_size}
                    for p in PRESETS.values()
                ],
                "devices": list(DEVICES),
                "models": [{"name": k, "summary": v} for k, v in models.items()],
            }
        )
        return 0
    t = Table(title="Cluster presets (--cluster NAME, or NAME:SIZE where a size is taken)")
    t.add_column("name", style="bold")
    t.add_column("what it is")
    t.add_column("size after ':'")
    for p in PRESETS.values():
        t.add_row(p.name, p.summary, f"{p.size} (default {p.default_size})" if p.size else "—")
    console.print(t)
    d = Table(title="Device kinds (device = ... in a cluster file)")
    for col in ("kind", "fp32 TFLOP/s", "bf16 TFLOP/s", "memory GB/s", "memory GiB"):
        d.add_column(col)
    for dev in DEVICES.values():
        d.add_row(
            dev.kind,
            f"{dev.flops_for('float32') / 1e12:g}",
            f"{dev.flops_for('bfloat16') / 1e12:g}",
            f"{dev.memory_bandwidth / 1e9:g}",
            f"{dev.memory_bytes / 2**30:g}",
        )
    console.print(d)
    if models:
        m = Table(title="Built-in models (--model NAME)")
        m.add_column("name", style="bold")
        m.add_column("what it is")
        for k, v in models.items():
            m.add_row(k, v)
        console.print(m)
    return 0
