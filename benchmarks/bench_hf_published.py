"""Hugging Face families at their published sizes (7B class included), planned on one 8-GPU ``dgx-h100`` node.

    PYTHONPATH=. python benchmarks/bench_hf_published.py [--only falcon-7b,qwen2-7b] [--batch 8]
        [--out /tmp/hf_published.jsonl]

Each model of ``meshpilot.models.hf_families.PUBLISHED`` (its published configuration written as overrides of
the library default: nothing is downloaded) is built on the meta device with its default attention, dropout
and ``use_cache=False``, captured and planned by ``meshpilot.plan`` over every 2D mesh of 8 devices (fp32
parameters, AdamW). One row per model — the mesh chosen, the planning time (capture included), the predicted
step time and peak memory per device (wall time and this process' CPU time: on a shared machine the wall
time counts other processes' turns), and the fallbacks (nodes no strategy shards) — appended to ``--out``
as JSON and printed as the markdown table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def plan_one(name: str, batch: int, precision: str = "fp32") -> dict:
    import torch

    from meshpilot.models.hf_families import build, one_line, published
    from meshpilot.models.sources import count
    from meshpilot.planner.auto import plan

    fam, over, seq = published(name)
    t0, c0 = time.perf_counter(), time.process_time()
    row: dict = {"model": name, "family": fam.name, "batch": batch, "seq": seq, "precision": precision}
    try:
        model, inputs = build(fam, over, attn="sdpa", batch=batch, seq=seq, device="meta")
        if precision == "bf16":
            model = model.to(torch.bfloat16)
        row["params"] = count(sum(p.numel() for p in model.parameters()))
        p = plan(model, inputs, "dgx-h100", num_devices=8, precision=None if precision == "fp32" else precision)
    except Exception as e:  # noqa: BLE001 - a refusal is the row
        row.update(status="refused", reason=one_line(e), seconds=round(time.perf_counter() - t0, 1))
        return row
    row.update(
        status="planned" if not p.fallbacks else "fallback",
        seconds=round(time.perf_counter() - t0, 1),
        cpu_s=round(time.process_time() - c0, 1),
        mesh=list(p.mesh_shape),
        step_s=p.time.total_s,
        memory_gb=p.memory.total / 1e9,
        fallbacks=[f.line() for f in p.fallbacks][:2],
    )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| model | family | parameters | b × s | mesh | planning (wall / CPU) | predicted step | peak memory / GPU "
        "| fallbacks |",
        "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if r.get("precision", "fp32") != "fp32":
            r = dict(r, model=f"{r['model']} ({r['precision']})")
        if r["status"] == "refused":
            lines.append(f"| {r['model']} | {r['family']} | {r.get('params', '')} | {r['batch']} × {r['seq']} | "
                         f"— | {r['seconds']} s | refused: {r['reason']} | | |")  # fmt: skip
            continue
        fb = "; ".join(r["fallbacks"]) or "none"
        lines.append(
            f"| {r['model']} | {r['family']} | {r['params']} | {r['batch']} × {r['seq']} | {tuple(r['mesh'])} | "
            f"{r['seconds']} / {r['cpu_s']} s | {r['step_s'] * 1e3:.0f} ms | {r['memory_gb']:.1f} GB | {fb} |"
        )
    return "\n".join(lines)


def main() -> None:
    from meshpilot.models.hf_families import PUBLISHED

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="names of PUBLISHED (comma-separated), planned in this order")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default="/tmp/hf_published.jsonl")
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    ap.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16"),
        help="fp32 parameters (the default), or bf16 parameters, gradients and AdamW states (the model cast)",
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    out = Path(args.out)
    if not args.table:
        for name in args.only.split(",") if args.only else list(PUBLISHED):  # in the order given
            row = plan_one(name, args.batch, args.precision)
            with out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    rows = {}
    for line in out.read_text().splitlines():
        r = json.loads(line)
        rows[r["model"], r.get("precision", "fp32")] = r  # the latest row of each model and precision
    import transformers

    print(f"transformers {transformers.__version__}")
    print(table(list(rows.values())))


if __name__ == "__main__":
    main()
