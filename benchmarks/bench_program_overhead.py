"""The runtime's own cost: a planned step on one device against the same eager model, back to back.

On one process (a one-rank gloo group) a GPT is planned for one device and run three ways, steps interleaved so
they share the machine's noise:

  eager        the model itself: forward, backward, AdamW step
  program      ``meshpilot.parallelize`` as it runs: the step recorded once, then generated code per step
  interpreted  the same plan with ``MESHPILOT_INTERPRET=1``: the DTensor interpreter walks every node each step
               (how the runtime ran before it recorded programs)

The ratio to eager is the tax of running a plan instead of the model; the interpreted row shows what recording
the program saved. Small shapes make the tax visible (per-node Python costs the same whatever the op's size);
the GPU numbers of issue 14 come from ``benchmarks/gpu_check.py`` on a lent GPU.

On CPU, ``torch.optim.AdamW`` defaults to its per-parameter loop, and with DTensor parameters every one of
its ops (≈ 10 per parameter) goes through DTensor's dispatch: that, not the recorded program, is most of the
tax at small shapes. On CUDA AdamW defaults to ``foreach`` for DTensors as for tensors (DTensor registers
itself as foreach-capable), and ``meshpilot train`` uses ``foreach`` everywhere; ``--foreach`` measures that.

    python benchmarks/bench_program_overhead.py            # three GPT shapes, 30 steps after 5 warm-up
    python benchmarks/bench_program_overhead.py --foreach  # the same with AdamW(foreach=True) everywhere
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {  # name: (layers, hidden, heads, batch, seq)
    "L12 h256": (12, 256, 4, 2, 64),
    "L4 h512": (4, 512, 8, 2, 128),
    "L2 h1024": (2, 1024, 16, 4, 128),
}


def _step_times(
    mode: str, layers: int, hidden: int, heads: int, batch: int, seq: int, steps: int, warmup: int, foreach: bool
):
    import torch
    import torch.distributed as dist

    import meshpilot
    from meshpilot.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=4096, seq=seq, layers=layers, hidden=hidden, heads=heads, batch=batch)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g)
    inputs = (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    if mode != "eager":
        tmp = tempfile.mkdtemp(prefix="meshpilot-bench-")
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        plan = meshpilot.plan(model, inputs, "dgx-h100", num_devices=1)
        model = meshpilot.parallelize(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=foreach or None)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _child(mode: str, shape: str, steps: int, warmup: int, foreach: bool) -> list[float]:
    """One variant in a fresh interpreter (the interpreted one needs its environment variable at import)."""
    env = dict(os.environ, MESHPILOT_INTERPRET="1" if mode == "interpreted" else "0")
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys, json; sys.path.insert(0, {here!r}); from bench_program_overhead import _step_times, SHAPES; "
        f"print(json.dumps(_step_times({mode!r}, *SHAPES[{shape!r}], {steps}, {warmup}, {foreach})))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    import json

    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="alternate the three variants this many times")
    ap.add_argument(
        "--foreach",
        action="store_true",
        help="AdamW(foreach=True) in every variant (CUDA's default, meshpilot train's); default: torch's CPU default, "
        "the per-parameter loop, which sends each AdamW op of each DTensor parameter through DTensor's dispatch",
    )
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    adamw = "foreach AdamW" if args.foreach else "AdamW's CPU default (per-parameter loop)"
    table = Table(title=f"Step time of a 1-device plan vs the eager model (median ms; ratio to eager), {adamw}")
    for col in ("GPT", "eager", "program", "interpreted", "program / eager", "interpreted / eager"):
        table.add_column(col, justify="right")
    for shape in SHAPES:
        runs: dict[str, list[float]] = {"eager": [], "program": [], "interpreted": []}
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode] += _child(mode, shape, args.steps, args.warmup, args.foreach)
        med = {m: statistics.median(v) * 1e3 for m, v in runs.items()}
        table.add_row(
            shape,
            f"{med['eager']:.1f}",
            f"{med['program']:.1f}",
            f"{med['interpreted']:.1f}",
            f"{med['program'] / med['eager']:.3f}",
            f"{med['interpreted'] / med['eager']:.3f}",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
