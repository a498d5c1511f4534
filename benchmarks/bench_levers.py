"""Every memory lever at once, as the cap tightens: one model planned by ``meshpilot plan`` (one stage weighed
against a pipeline, recomputation, ZeRO stages and context parallelism all left to the planner) at a
descending list of caps.

    python benchmarks/bench_levers.py plan --out /tmp/levers.json     # the table (pure planning)
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_levers.py measure /tmp/levers.json

``plan``: bench_cp's tiny Llama (4 layers, hidden 32, 4 heads, 2 KV heads) at batch 1 x 2,048 tokens on 4
devices of ``alpa-p3x8``, first without a cap, then under caps as fractions of that plan's predicted peak.
Each row runs the CLI as a user does (``meshpilot plan --memory-gib … --out``, in this process) and reads the
saved plan back: whether it is one stage or a pipeline (and its stages), each stage's mesh, the blocks it
recomputes, its ZeRO switches by stage, the mesh axis its attention is sequence-parallel over, the predicted
step (one stage: the plan's overlapped step, as ``meshpilot plan`` weighs it; a pipeline: its simulated step)
and the predicted peak per device (the largest stage's). The one-stage plans at three caps are saved.

``measure``: each saved plan run by ``meshpilot.parallelize`` on 4 gloo ranks, every rank's peak storage over
two AdamW steps (``bench_recompute.step_peaks``) beside the predicted peak, for the plan's cluster and as
issued on gloo (``bench_recompute.gloo_peak``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cp import LLAMA, llama_batch  # noqa: E402
from bench_recompute import measure_saved  # noqa: E402

from meshpilot.io import fmt_size  # noqa: E402
from meshpilot.ops.attention import context_axes  # noqa: E402
from meshpilot.planner.plan import Plan, StagePlan  # noqa: E402
from meshpilot.planner.recompute import REGATHER, SELECTIVE  # noqa: E402

CLUSTER, DEVICES = "alpa-p3x8", 4
CAPS = (None, 0.8, 0.6, 0.45, 0.35, 0.28, 0.22, 0.17)
"""Caps as fractions of the uncapped plan's predicted peak (None: the device's own memory)."""


@dataclass(frozen=True)
class Shape:
    """The model and batch a table is planned for: bench_cp's Llama with `overrides`, `batch` x `seq` tokens."""

    batch: int = 1
    seq: int = 2048
    overrides: tuple[tuple[str, int], ...] = ()

    @property
    def config(self) -> dict:
        return {**LLAMA, **dict(self.overrides)}

    def build(self, device: str = "cpu") -> tuple[torch.nn.Module, tuple]:
        """The model (seeded) and a batch of token ids and labels, as the CLI's ``hf:llama`` builds them."""
        return llama_batch(self.config, self.batch, self.seq, device)


def _shape(text: str) -> Shape:
    """``--shape batch=8,seq=256,hidden_size=256,...``: the batch, the sequence and any Llama config key."""
    kv = dict(item.split("=", 1) for item in text.split(",") if item)
    batch, seq = int(kv.pop("batch", 1)), int(kv.pop("seq", 2048))
    return Shape(batch, seq, tuple((k, int(v)) for k, v in kv.items()))


def _cli(out: Path, cap: float | None, shape: Shape, extra: tuple[str, ...] = ()) -> tuple[Plan, str]:
    """``meshpilot plan`` of the model under `cap` bytes per device, saved to `out`: the plan and the line it
    printed about one stage against a pipeline."""
    from meshpilot.cli.main import main as cli

    hf = [f"{k}={v}" for k, v in shape.config.items()]
    argv = ["plan", "--model", "hf:llama", "--hf-config", *hf, "--batch", str(shape.batch), "--seq", str(shape.seq)]
    argv += ["--cluster", CLUSTER, "--devices", str(DEVICES), "--out", str(out)]
    # the stage table its rows in docs/benchmarks.md were planned with (the CLI's default until def29; now
    # --table estimated): the same plans when re-run
    argv += ["--table", "exact"]
    if cap is not None:
        argv += ["--memory-gib", f"{cap / 2**30:.9f}"]
    argv += list(extra)
    text, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(err):
        rc = cli(argv)
    said = " ".join(text.getvalue().split())
    if rc != 0 or not out.exists():
        raise RuntimeError(err.getvalue().strip().splitlines()[-1].removeprefix("meshpilot plan: error: "))
    return Plan.load(out), said[said.rfind("chose ") :] if "chose " in said else said[-300:]


def _stage_levers(p: StagePlan) -> str:
    """One stage's levers: mesh, recomputed blocks, ZeRO switches by stage, the sequence-parallel axis."""
    rc = p.recompute.regions if p.recompute is not None else ()
    sel = [x for x in rc if x.startswith(SELECTIVE)]
    whole = [x for x in rc if not x.startswith((SELECTIVE, REGATHER))]
    blocks = (
        ", ".join(
            f"{what}{len(xs)} blocks ({xs[0].rsplit('.', 1)[-1]}–{xs[-1].rsplit('.', 1)[-1]})"
            for what, xs in (("selective: ", sel), ("", whole))
            if xs
        )
        or "none"
    )
    zero = Counter(f"ZeRO-{int(z.stage)}" for z in p.zero)
    zs = ", ".join(f"{k} ×{v}" for k, v in sorted(zero.items())) or "none"
    cp = context_axes(p.nodes, p.mesh_axes, p.collectives)
    cps = ", ".join(f"{c.axis} ({p.mesh_shape[p.mesh_axes.index(c.axis)]}, {c.method})" for c in cp) or "no"
    return f"{p.mesh_shape} | {blocks} | {zs} | {cps}"


def _row(cap: float | None, plan: Plan | None, error: str = "") -> str:
    cap_s = fmt_size(cap) if cap is not None else "none"
    if plan is None:
        return f"| {cap_s} | no plan: {error} | | | | | | |"
    stages = [s.plan for s in plan.stages]
    if len(stages) == 1 and plan.microbatches == 1:
        step, kind = stages[0].time.overlapped_s, "one stage"
    elif len(stages) == 1:  # the stage DP's answer of one stage: gradient accumulation, timed by the simulator
        step, kind = plan.simulate().step_s, f"one stage × {plan.microbatches} microbatches"
    else:
        step = plan.simulate().step_s
        kind = f"pipeline, {len(stages)} stages × {plan.microbatches} microbatches"
    levers = " / ".join(_stage_levers(s) for s in stages if s is not None)
    peak = max(s.memory.total for s in stages if s is not None)
    return f"| {cap_s} | {kind} | {levers} | {step * 1e3:.3f} ms | {fmt_size(peak)} |"


def _save_three(saved: dict[str, str], out: Path) -> list[str]:
    """Write the first, middle and last of the one-stage plans `saved` so far to `out`; their caps."""
    keys = list(saved)
    chosen = list(dict.fromkeys((keys[0], keys[len(keys) // 2], keys[-1])))
    out.write_text(json.dumps({k: saved[k] for k in chosen}))
    return chosen


def run_plan(
    out: Path,
    shape: Shape,
    caps: tuple[float | None, ...] = CAPS,
    extra: tuple[str, ...] = (),
    top: float | None = None,
) -> None:
    if caps and caps[0] is not None and top is None:
        raise SystemExit("bench_levers: the caps start below 'none': give the uncapped peak with --top-mib")
    head = "cap per device | plan | mesh | recompute | ZeRO | attention sequence-parallel over"
    print(f"| {head} | predicted step | predicted peak |")
    print("| ---: | --- | --- | --- | --- | --- | ---: | ---: |")
    saved: dict[str, str] = {}
    chosen: list[str] = []
    t0 = time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, frac in enumerate(caps):
            cap = None if frac is None else frac * top
            path = Path(tmp) / f"plan{i}.json"
            try:
                plan, why = _cli(path, cap, shape, extra)
            except RuntimeError as e:  # the CLI's own one-line refusal is the row
                print(_row(cap, None, str(e)[:300]), flush=True)
                continue
            print(_row(cap, plan), flush=True)
            print(f"  ({why})", file=sys.stderr, flush=True)
            if top is None:
                top = max(s.plan.memory.total for s in plan.stages)
            if len(plan.stages) == 1:
                saved[fmt_size(cap) if cap else "none"] = plan.stages[0].plan.to_json()
                chosen = _save_three(saved, out)  # as it goes: the rows under the tightest caps plan slowest
    print(f"\n{len(caps)} plans in {time.process_time() - t0:.0f} s of CPU (this process; the stage DP's workers "
          f"not counted); saved the one-stage plans at caps {', '.join(chosen)} to {out}")  # fmt: skip


def run_measure(path: Path, shape: Shape) -> None:
    measure_saved(path, lambda _: shape.build("cpu"), lambda k, p: f"cap {k}: {_stage_levers(p)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    plan = sub.add_parser("plan")
    plan.add_argument("--out", type=Path, default=Path("/tmp/levers.json"))
    plan.add_argument(
        "--top-mib", type=float, help="the uncapped peak the caps are fractions of, when the caps start below 'none'"
    )
    plan.add_argument("--cli", default="", help="more `meshpilot plan` arguments, e.g. '--approximate-table'")
    plan.add_argument(
        "--caps",
        type=lambda t: tuple(None if c == "none" else float(c) for c in t.split(",")),
        default=CAPS,
        help="caps as fractions of the uncapped plan's peak, 'none' first (default: %(default)s)",
    )
    measure = sub.add_parser("measure")
    measure.add_argument("plans", type=Path)
    for p in (plan, measure):
        p.add_argument(
            "--shape",
            type=_shape,
            default=Shape(),
            help="batch=B,seq=S and Llama config keys over bench_cp's (default: batch=1,seq=2048)",
        )
    args = ap.parse_args()
    if args.cmd == "plan":
        top = args.top_mib * 2**20 if args.top_mib else None
        run_plan(args.out, args.shape, args.caps, tuple(args.cli.split()), top)
    else:
        run_measure(args.plans, args.shape)


if __name__ == "__main__":
    main()
