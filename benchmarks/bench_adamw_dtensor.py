"""Where the CPU step tax of a planned model goes: AdamW's per-parameter loop over DTensor parameters.

In one process (a one-rank gloo group), a GPT planned for one device (``meshpilot.parallelize``) and the same
eager model train side by side, each with AdamW's CPU default (the per-parameter loop) and with
``foreach=True`` (CUDA's default; ``meshpilot train``'s everywhere): four variants, their steps interleaved
round by round so they share the machine's noise. Reported: the median full step (forward, backward,
``opt.step()``, ``zero_grad``) and the median ``opt.step()`` alone, and the planned/eager ratios per
optimizer. With the loop, every AdamW op of every DTensor parameter goes through DTensor's dispatch.

    python benchmarks/bench_adamw_dtensor.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

SHAPES = {"L12 h256": (12, 256, 4, 2, 64), "L4 h512": (4, 512, 8, 2, 128)}


def measure(shape: tuple, rounds: int, steps: int) -> dict:
    import meshpilot
    from meshpilot.models.gpt import GPT, GPTConfig

    layers, hidden, heads, batch, seq = shape
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=4096, seq=seq, layers=layers, hidden=hidden, heads=heads, batch=batch)
    planned, eager = GPT(cfg), GPT(cfg)
    eager.load_state_dict(planned.state_dict())
    idx = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = meshpilot.plan(planned, inputs, "dgx-h100", num_devices=1)
    models = {"eager": eager, "planned": meshpilot.parallelize(planned, plan)}
    variants = {
        (m, f): torch.optim.AdamW(models[m].parameters(), lr=1e-4, foreach=f) for m in models for f in (None, True)
    }
    step_t = {k: [] for k in variants}
    opt_t = {k: [] for k in variants}
    for r in range(rounds + 1):
        for (m, f), opt in variants.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                models[m](*inputs).backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                if r:  # round 0 warms up
                    step_t[(m, f)].append(time.perf_counter() - t0)
                    opt_t[(m, f)].append(t2 - t1)
    return {k: (statistics.median(step_t[k]) * 1e3, statistics.median(opt_t[k]) * 1e3) for k in variants}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="meshpilot-bench-")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
    torch.set_num_threads(1)
    table = Table(title="1-device plan vs eager, AdamW loop vs foreach (median ms; one process, interleaved)")
    for col in ("GPT", "AdamW", "eager step", "planned step", "planned / eager", "eager opt.step", "planned opt.step"):
        table.add_column(col, justify="right")
    load = os.getloadavg()[0]
    for name, shape in SHAPES.items():
        res = measure(shape, args.rounds, args.steps)
        for f, label in ((None, "loop (CPU default)"), (True, "foreach")):
            (es, eo), (ps, po) = res[("eager", f)], res[("planned", f)]
            table.add_row(name, label, f"{es:.1f}", f"{ps:.1f}", f"{ps / es:.3f}", f"{eo:.1f}", f"{po:.1f}")
    Console().print(table)
    print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; torch threads 1")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
