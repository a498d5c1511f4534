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

from gpu_check import GPT_SHAPES, Trainer, _rel, _tokens, adamw, tiny_shape  # noqa: E402

import meshpilot  # noqa: E402
from meshpilot.graph.capture import capture  # noqa: E402


def profile_steps(t: Trainer, steps: int, cuda: bool) -> tuple[dict[str, tuple[int, float, float]], float, float]:
    """{op: (calls, device ms, host self ms) per step}, device ms per step, host ms per step."""
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
    ops: dict[str, tuple[int, float, float]] = {}
    total = 0.0
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
        ops[e.key] = (round(e.count / steps), dev_us / 1e3 / steps, e.self_cpu_time_total / 1e3 / steps)
        total += dev_us / 1e3 / steps
    return ops, total, host


def time_modes(model, graph, plan, inputs, modes: list[str], n: int, cuda: bool, label: str) -> None:
    """Median step and forward + backward (ms) of eager and of the planned model under each compile mode."""
    import statistics

    from rich.console import Console
    from rich.table import Table

    def clock(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    eager = Trainer(model, adamw(model.parameters(), 1e-5), inputs)
    table = Table(title=f"{label}: step time by compile mode (ms, median of {n})")
    for c in ("mode", "grad rel", "eager step", "planned step", "ratio", "eager f+b", "planned f+b", "ratio", "error"):
        table.add_column(c, justify="left" if c in ("mode", "error") else "right")
    for mode in modes:
        try:
            par = copy.deepcopy(model)
            compile_arg = {"none": False, "inductor": True}.get(mode, mode)
            pm = meshpilot.parallelize(par, plan, graph=graph, compile=compile_arg)
            p = Trainer(pm, adamw(pm.parameters(), 1e-5), inputs)
            # one lockstep step from the same weights: the planned gradients against eager's
            le, lp = eager.loss(), p.loss()
            le.backward()
            lp.backward()
            names = [n for n, q in model.named_parameters() if q.requires_grad]
            rel = max(_rel(par.get_parameter(k).grad, model.get_parameter(k).grad) for k in names)
            for t in (eager, p):
                t.opt.step()
                t.opt.zero_grad(set_to_none=True)
            for _ in range(3):
                p.step()
                eager.step()
            se, sp, fe, fp = [], [], [], []
            for _ in range(n):
                se.append(clock(eager.step))
                sp.append(clock(p.step))
            for _ in range(n):
                fe.append(clock(eager.forward_backward))
                eager.opt.zero_grad(set_to_none=True)
                fp.append(clock(p.forward_backward))
                p.opt.zero_grad(set_to_none=True)
            m = [statistics.median(x) for x in (se, sp, fe, fp)]
            cells = [f"{rel:.1e}", f"{m[0]:.2f}", f"{m[1]:.2f}", f"{m[1] / m[0]:.3f}", f"{m[2]:.2f}", f"{m[3]:.2f}"]
            table.add_row(mode, *cells, f"{m[3] / m[2]:.3f}", "")
            del p, pm, par
        except Exception as e:  # noqa: BLE001 - the row says what failed
            table.add_row(mode, "", "", "", "", "", "", "", f"{type(e).__name__}: {str(e)[:80]}")
    Console(width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, default=3, help="index into gpu_check.GPT_SHAPES (default 3: L12 h768)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the shape at gpu_check's tiny size (smoke run)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps of each (default 3)")
    ap.add_argument("--rows", type=int, default=25, help="table rows, largest device-time difference first")
    ap.add_argument(
        "--modes",
        nargs="*",
        help="instead of profiling, time the step (eager vs planned, alternately, --timed each) with parallelize's "
        "compile= set to each of these: none, inductor, cudagraphs",
    )
    ap.add_argument("--timed", type=int, default=20, help="timed steps per mode (default 20)")
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
    label = f"L{shape['layers']} h{shape['hidden']} {shape['batch']}x{shape['seq']} {shape['dtype']}"
    par = copy.deepcopy(model)
    graph = capture(par, inputs)
    plan = meshpilot.plan(par, inputs, "dgx-h100", num_devices=1, graph=graph)
    if args.modes:
        time_modes(model, graph, plan, inputs, args.modes, args.timed, cuda, label)
        dist.destroy_process_group()
        return 0
    pm = meshpilot.parallelize(par, plan, graph=graph)
    eager = Trainer(model, adamw(model.parameters(), 1e-5), inputs)
    parallel = Trainer(pm, adamw(pm.parameters(), 1e-5), inputs)
    (e_ops, e_dev, e_host), (p_ops, p_dev, p_host) = (profile_steps(t, args.steps, cuda) for t in (eager, parallel))

    from rich.console import Console
    from rich.table import Table

    con = Console(width=160)
    zero = (0, 0.0, 0.0)
    for col, what in ((1, "device ms" if cuda else "CPU self ms"), (2, "host self ms")):
        if col == 2 and not cuda:
            break
        table = Table(title=f"{label}: per step, eager vs planned ({what})")
        for c in ("op", "calls eager", "calls planned", "eager", "planned", "planned - eager"):
            table.add_column(c, justify="left" if c == "op" else "right")
        diff: dict[str, float] = defaultdict(float)
        for k in set(e_ops) | set(p_ops):
            a, b = e_ops.get(k, zero), p_ops.get(k, zero)
            if a[0] != b[0] or abs(b[col] - a[col]) > 0.01:
                diff[k] = b[col] - a[col]
        for k in sorted(diff, key=lambda k: -abs(diff[k]))[: args.rows]:
            a, b = e_ops.get(k, zero), p_ops.get(k, zero)
            table.add_row(k[:70], str(a[0]), str(b[0]), f"{a[col]:.3f}", f"{b[col]:.3f}", f"{b[col] - a[col]:+.3f}")
        con.print(table)
    con.print(
        f"per step: device {e_dev:.2f} → {p_dev:.2f} ms; host wall {e_host:.2f} → {p_host:.2f} ms; "
        f"calls {sum(v[0] for v in e_ops.values())} → {sum(v[0] for v in p_ops.values())}"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
