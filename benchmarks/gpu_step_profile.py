"""Where a planned step spends its time against eager, op by op (not in CI; a diagnostic for issue 14's tax).

One GPT shape from ``gpu_check.GPT_SHAPES`` (``--shape`` is its index), eager and parallelized by a 1-device
plan, each profiled over ``--steps`` full AdamW steps with ``torch.profiler``. Prints one table: for every op
(aten op or kernel-launching function) whose count or device time differs between the two, the calls per
step and the device milliseconds per step of each; then the totals (device time, host time, calls) per step.
What the planned program adds (copies, casts, reductions eager does not run) shows as rows eager lacks::

    python benchmarks/gpu_step_profile.py --shape 3            # on a GPU
    python benchmarks/gpu_step_profile.py --device cpu --tiny  # smoke run
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_check import GPT_SHAPES, Trainer, _tokens, adamw, tiny_shape  # noqa: E402

import meshpilot  # noqa: E402
from meshpilot.graph.capture import capture  # noqa: E402


def profile_steps(t: Trainer, steps: int, cuda: bool) -> tuple[dict[str, tuple[int, float]], float, float]:
    """{op: (calls per step, device ms per step)}, device ms per step, host ms per step."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(2):
        t.step()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            t.step()
        if cuda:
            torch.cuda.synchronize()
    host = (time.perf_counter() - t0) * 1e3 / steps
    ops: dict[str, tuple[int, float]] = {}
    total = 0.0
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
        ops[e.key] = (round(e.count / steps), dev_us / 1e3 / steps)
        total += dev_us / 1e3 / steps
    return ops, total, host


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, default=3, help="index into gpu_check.GPT_SHAPES (default 3: L12 h768)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the shape at gpu_check's tiny size (smoke run)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps of each (default 3)")
    ap.add_argument("--rows", type=int, default=25, help="table rows, largest device-time difference first")
    args = ap.parse_args(argv)
    from meshpilot.models.gpt import GPT, GPTConfig

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: this torch has no CUDA; use --device cpu --tiny", file=sys.stderr)
        return 2
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    dev = "cuda:0" if cuda else "cpu"
    shape = GPT_SHAPES[args.shape]
    shape = tiny_shape(shape) if args.tiny else shape
    cfg = GPTConfig(**shape)
    torch.manual_seed(0)
    with torch.device(dev):
        model = GPT(cfg)
    inputs = _tokens(cfg.vocab, cfg.batch, cfg.seq, dev)
    par = copy.deepcopy(model)
    graph = capture(par, inputs)
    plan = meshpilot.plan(par, inputs, "dgx-h100", num_devices=1, graph=graph)
    pm = meshpilot.parallelize(par, plan, graph=graph)
    eager = Trainer(model, adamw(model.parameters(), 1e-5), inputs)
    parallel = Trainer(pm, adamw(pm.parameters(), 1e-5), inputs)
    (e_ops, e_dev, e_host), (p_ops, p_dev, p_host) = (profile_steps(t, args.steps, cuda) for t in (eager, parallel))

    from rich.console import Console
    from rich.table import Table

    label = f"L{shape['layers']} h{shape['hidden']} {shape['batch']}x{shape['seq']} {shape['dtype']}"
    table = Table(title=f"{label}: per step, eager vs planned ({'device' if cuda else 'CPU self'} ms)")
    for c in ("op", "calls eager", "calls planned", "ms eager", "ms planned", "ms planned - eager"):
        table.add_column(c, justify="left" if c == "op" else "right")
    keys = set(e_ops) | set(p_ops)
    diff: dict[str, float] = defaultdict(float)
    for k in keys:
        (ce, te), (cp, tp) = e_ops.get(k, (0, 0.0)), p_ops.get(k, (0, 0.0))
        if ce != cp or abs(tp - te) > 0.01:
            diff[k] = tp - te
    for k in sorted(diff, key=lambda k: -abs(diff[k]))[: args.rows]:
        (ce, te), (cp, tp) = e_ops.get(k, (0, 0.0)), p_ops.get(k, (0, 0.0))
        table.add_row(k[:70], str(ce), str(cp), f"{te:.3f}", f"{tp:.3f}", f"{tp - te:+.3f}")
    con = Console(width=160)
    con.print(table)
    con.print(
        f"per step: device {e_dev:.2f} → {p_dev:.2f} ms; host wall {e_host:.2f} → {p_host:.2f} ms; "
        f"calls {sum(c for c, _ in e_ops.values())} → {sum(c for c, _ in p_ops.values())}"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
