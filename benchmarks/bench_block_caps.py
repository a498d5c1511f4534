"""What one block search of the stage table costs under each memory cap: GPT-39B's middle block on 32 GPUs of
``alpa-p3x8`` (B = 64 microbatches of 16 sequences), the caps the stack table's levels descend through
(``planner.stack``, module docstring, 2), each searched on a fresh ``StagePlanner`` in order (the first pays
for the ILP's structure). Printed per (logical mesh, cap): CPU seconds of the search, the block's step over
the B microbatches and its memory parts per device.

    nice -n 10 python benchmarks/bench_block_caps.py                   # HiGHS' relative gap 1e-3 (the planner's)
    nice -n 10 python benchmarks/bench_block_caps.py --mip-gap 5e-2    # a looser gap: is the capped solve cheaper?
"""

from __future__ import annotations

import argparse
import os
import time

import meshpilot.planner.ilp as ilp
from meshpilot.models import builtin_models
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.stack import capture_stack
from meshpilot.planner.stage import StagePlanner

GIB = 2**30
CAPS_GIB = (16.0, 4.0, 2.0, 1.0, 0.77)
SHAPES = ((2, 16), (8, 4))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mip-gap", type=float, default=None, help="HiGHS mip_rel_gap for every solve (default: 1e-3)")
    args = ap.parse_args()
    if args.mip_gap is not None:  # the stage planner does not pass a gap on: set it where HiGHS is called
        solve = ilp._milp

        def with_gap(prob, memory, cap, time_limit, mip_rel_gap):
            return solve(prob, memory, cap, time_limit, args.mip_gap)

        ilp._milp = with_gap
    print(f"load average {os.getloadavg()}, mip gap {args.mip_gap or 1e-3}")
    model, inputs = builtin_models()["gpt3-39b"].build("meta", 16)
    stack = capture_stack(model, inputs)
    sp = StagePlanner(stack.graph, "alpa-p3x8")
    mid = stack.middle
    print("| mesh | cap | search CPU | block step (64 microbatches) | static | live peak | saved |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in SHAPES:
        for cap in CAPS_GIB:
            t0 = time.process_time()
            try:
                c, m = sp.plan_with_memory(mid, mid + 1, range(32), shape, microbatches=64, capacity=cap * GIB)
                parts = (m.static, m.live_peak, m.saved)
                got = f"{c.time.total_s:.3f} s | " + " | ".join(f"{x / GIB:.3f} GiB" for x in parts)
            except PlanError as e:
                got = f"no plan: {str(e)[:60]} | | |"
            print(f"| {'x'.join(map(str, shape))} | {cap} GiB | {time.process_time() - t0:.2f} s | {got} |", flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
