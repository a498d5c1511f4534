"""Context parallelism chosen by the planner: a tiny Llama at several sequence lengths and memory caps.

``plan``: for each sequence length, the plan with no cap and under tightening caps (mesh (4, 1) of
``alpa-p3x8``, recomputation ``auto``): which mesh, whether attention is sequence-parallel
(and over which axis), which blocks recompute, the predicted step and peak memory; the plans are saved.
``measure`` (under ``torchrun --nproc-per-node 4``): each saved plan's peak storage per rank over two AdamW
steps (``bench_recompute.step_peaks``) against its prediction.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from meshpilot.io import fmt_size
from meshpilot.models.sources import hf_model
from meshpilot.ops.attention import sequence_axes
from meshpilot.planner.auto import plan
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.plan import StagePlan

sys.path.insert(0, str(Path(__file__).parent))
from bench_recompute import measure_saved  # noqa: E402

CLUSTER = "alpa-p3x8"
MESH = (4, 1)
LLAMA = dict(
    num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, use_cache=False,
)  # fmt: skip
SEQS = (1024, 2048)
CAPS = (None, 0.6, 0.35)
"""Caps as fractions of the uncapped plan's predicted peak (None: the device's own memory)."""


def _model(seq: int, device: str = "meta") -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = hf_model("llama", dict(LLAMA))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, LLAMA["vocab_size"], (1, seq), generator=g)
    labels = torch.randint(0, LLAMA["vocab_size"], (1, seq), generator=g)
    return (model.to(device) if device != "meta" else model), (ids, labels)


def _row(seq: int, cap: float | None, p: StagePlan | None, error: str = "") -> str:
    cap_s = fmt_size(cap) if cap else "none"
    if p is None:
        return f"| {seq} | {cap_s} | no plan: {error} | | | | |"
    cp = sequence_axes(p.nodes, p.mesh_axes)
    cp_s = ", ".join(f"{a} ({p.mesh_shape[p.mesh_axes.index(a)]})" for a in cp) or "no"
    rc = ", ".join(p.recompute.regions) if p.recompute and p.recompute.regions else "none"
    return (
        f"| {seq} | {cap_s} | {p.mesh_shape} | {cp_s} | {rc} | {p.time.total_s * 1e3:.3f} ms "
        f"| {fmt_size(p.memory.total)} |"
    )


def run_plan(out: Path) -> None:
    saved: dict[str, str] = {}
    print(
        "| seq | cap per device | mesh | attention sequence-parallel over | recompute | predicted step "
        "| predicted peak |"
    )
    print("| ---: | ---: | --- | --- | --- | ---: | ---: |")
    for seq in SEQS:
        model, inputs = _model(seq)
        free = plan(model, inputs, CLUSTER, mesh_shape=MESH)
        print(_row(seq, None, free), flush=True)
        saved[f"{seq}/none"] = free.to_json()
        for frac in CAPS[1:]:
            cap = frac * free.memory.total
            try:
                p = plan(model, inputs, CLUSTER, mesh_shape=MESH, memory_bytes=cap)
            except PlanError as e:
                print(_row(seq, cap, None, str(e).split(";")[0]), flush=True)
                continue
            print(_row(seq, cap, p), flush=True)
            saved[f"{seq}/{frac}"] = p.to_json()
    out.write_text(json.dumps(saved))


def run_measure(path: Path, keys: list[str]) -> None:
    def label(k: str, p: StagePlan) -> str:
        return f"{k}: mesh {p.mesh_shape}, sequence-parallel {sequence_axes(p.nodes, p.mesh_axes) or 'no'}"

    measure_saved(path, lambda k: _model(int(k.split("/")[0]), "cpu"), label, keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan").add_argument("--out", type=Path, default=Path("/tmp/cp_caps.json"))
    m = sub.add_parser("measure")
    m.add_argument("plans", type=Path)
    m.add_argument("keys", nargs="*", help="which saved plans (seq/cap), default all")
    args = ap.parse_args()
    if args.cmd == "plan":
        run_plan(args.out)
    else:
        run_measure(args.plans, args.keys)


if __name__ == "__main__":
    main()
