"""Line up every rank's trace of one traced step: when each collective could start and when it ended.

Input: the JSON ``fidelity_step_worker.py --trace`` writes when its ranks ran with ``MESHPILOT_TRACE_EVENTS=1``
(each rank's split then carries ``events``, the raw ``duplex.TRACE`` stamps; ``perf_counter`` is one clock for
every process of the machine). Per plan and per traced program (forward, backward, or their two-microbatch
pairs), in order of start, every collective that lasted over --min seconds: its issue on the first and on the
last rank (it can start only once the last rank issued it), its end (the first rank whose wait blocked saw it
end; with no blocked wait, the first wait's start bounds it), its duration and the gap since the previous
collective's end (the link idle, when positive). Times are seconds from the step's first stamp.

    MESHPILOT_TRACE_EVENTS=1 meshpilot emulate -c examples/clusters/emulated-2x4-100mbit.toml -- \\
        python benchmarks/fidelity_step_worker.py --manifest M.json --out steps.json --steps 1 --warmup 1 --trace
    python benchmarks/trace_across_ranks.py steps.json

(docs/benchmarks.md, *One collective at a time per group*.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BLOCKED_S = 5e-4
"""A wait longer than this blocked: the collective ended when it returned."""


def programs(events: list) -> list[dict]:
    """One rank's stamps as programs: ``{"begin", "end", "c": {collective: {"issue", "wait", "waited"}}}``."""
    out: list[dict] = []
    cur: dict = {}
    for what, key, t in events:
        if what == "begin":
            cur = {"begin": t, "c": {}}
        elif what == "end":
            cur["end"] = t
            out.append(cur)
        else:
            cur["c"].setdefault(key, {})[what] = t
    return out


def report(result: dict, min_s: float) -> list[str]:
    """The lines for one plan's traced step (``result``: one entry of the worker's ``results``)."""
    ranks = [programs(t["events"]) for t in result["trace"]]
    t0 = min(p[0]["begin"] for p in ranks)
    lines = [f"{result['name']}: median step {result['median_s']:.2f} s"]
    for k in range(len(ranks[0])):
        progs = [p[k] for p in ranks]
        begin, end = min(p["begin"] for p in progs) - t0, max(p["end"] for p in progs) - t0
        lines.append(f"  program {k}: {begin:.2f} .. {end:.2f} s ({end - begin:.2f} s)")
        spans = []
        for c in progs[0]["c"]:
            issue = [p["c"][c]["issue"] - t0 for p in progs]
            waits = [(p["c"][c].get("wait", 0.0) - t0, p["c"][c].get("waited", 0.0) - t0) for p in progs]
            blocked = [done for w, done in waits if done - w > BLOCKED_S]
            finish = min(blocked) if blocked else min(w for w, _ in waits)
            spans.append((max(issue), finish, c, min(issue), len(blocked)))
        last = None
        for start, finish, c, first, nblocked in sorted(spans):
            gap = start - last if last is not None else 0.0
            if finish - start > min_s:
                lines.append(
                    f"    c{c:<3d} issued {first:7.2f} .. {start:7.2f}  ended {finish:7.2f}  "
                    f"lasted {finish - start:5.2f}  gap {gap:5.2f}  blocked waits {nblocked}"
                )
            last = finish if last is None else max(last, finish)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path, help="the worker's --out JSON (ranks run with MESHPILOT_TRACE_EVENTS=1)")
    ap.add_argument("--min", type=float, default=0.05, help="show collectives lasting over this (s; default 0.05)")
    args = ap.parse_args()
    doc = json.loads(args.result.read_text())
    for result in doc["results"]:
        if not result.get("trace") or "events" not in result["trace"][0]:
            raise SystemExit(f"{args.result}: no raw events; run the worker with --trace and MESHPILOT_TRACE_EVENTS=1")
        print("\n".join(report(result, args.min)))


if __name__ == "__main__":
    main()
