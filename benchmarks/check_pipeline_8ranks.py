"""A 4-stage pipeline on 8 gloo ranks (2 per stage), each stage its own intra-operator plan, against one device.

    PYTHONPATH=. python benchmarks/check_pipeline_8ranks.py

Not in the test suite (an 8-rank spawn takes a minute or more on a shared 2-core machine; the suite's 4-rank
spawn in ``tests/test_pipeline_runtime.py`` runs the same code on 2 and 3 stages). The tiny GPT with 4 blocks
(8 layers) is cut into [wte, wpe, blocks.0] | [blocks.1] | [blocks.2] | [blocks.3, ln_f, lm_head] on ranks
0-1, 2-3, 4-5, 6-7, the stages on logical meshes (1, 2) Megatron TP, (2, 1) data parallel, (1, 2) Megatron TP
and (1, 2) as searched; 4 microbatches under 1F1B, 3 AdamW steps, plain and with Alpa's local all-gather, and
the ZB-H1 zero-bubble schedule. Each rank prints its stage, the largest gradient and loss difference to one
device, and whether every collective, send and receive it recorded equals what the plans say.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from dist_utils import run_distributed  # noqa: E402
from test_pipeline_runtime import _run_intra, _tiny_gpt_graph  # noqa: E402

STAGES = [((0, 3), (0, 1), (1, 2)), ((3, 4), (2, 3), (2, 1)), ((4, 5), (4, 5), (1, 2)), ((5, 8), (6, 7), (1, 2))]
KINDS = ("megatron_tp", "data_parallel", "megatron_tp", None)


def main() -> int:
    from meshpilot.planner import forced
    from meshpilot.planner.pipeline import fixed_pipeline

    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    model, inputs, graph = _tiny_gpt_graph()
    pp = fixed_pipeline(graph, "atp-ic3", STAGES, microbatches=4, schedule="1f1b")
    force = [
        getattr(forced, k)(model, inputs, shape, **({"graph": graph} if k == "megatron_tp" else {})) if k else None
        for k, (_, _, shape) in zip(KINDS, STAGES)
    ]
    plans = {"4 stages": pp.with_intra(graph, "atp-ic3", force=force).to_json()}
    runs = [("1f1b", "4 stages", False, False), ("1f1b+gather", "4 stages", True, False)]
    runs += [("zb-h1", "4 stages", False, True)]
    t0 = time.perf_counter()
    outs = run_distributed(_run_intra, 8, plans, runs, timeout=900)
    print(f"8 ranks: {time.perf_counter() - t0:.1f} s", flush=True)
    ok = True
    for rank, out in enumerate(outs):
        for name, res in out.items():
            equal = all(c == res["planned"] for c in res["counts"])
            loss = max(res["loss"]) if res["loss"] else None
            good = max(res["grad"]) < 1e-5 and (loss is None or loss < 1e-5) and equal and res["mismatches"] == 0
            ok &= good
            print(
                f"rank {rank} stage {res['stage']} {name:<12} max |Δgrad| {max(res['grad']):.1e}"
                + (f" |Δloss| {loss:.1e}" if loss is not None else "")
                + f" counts == planned: {equal}"
            )
    print("all within 1e-5, counts equal" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
