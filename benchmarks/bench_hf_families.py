"""Every family of the installed transformers, tiny: planned on a (2, 2) mesh, then run on 4 gloo ranks.

    PYTHONPATH=. python benchmarks/bench_hf_families.py [--kinds causal,masked,seq2seq,image]
        [--settings nocache-sdpa,cache-sdpa,nocache-eager,cache-eager] [--run] [--limit 120]
        [--out /tmp/hf_families.jsonl] [--only gpt2,llama] [--table] [--compact docs/hf_families/x.jsonl]
        [--lock /tmp/meshpilot-ranks.lock]

Phase 1 plans each family (``meshpilot.models.hf_families``: its default configuration made tiny by key
names, dropout off) under each setting — ``use_cache`` on or off, sdpa or eager attention — on a (2, 2) mesh
of ``dgx-h100``, each capped at ``--limit`` seconds. Phase 2 (``--run``) trains every family whose first
setting planned without fallback on 4 gloo ranks beside the single device (3 AdamW steps: loss and every
gradient within 1e-5, the collectives issued equal to the plan's; ``tests/test_hf_families.py``'s worker).
Every result is one JSON line appended to ``--out`` as it comes, so a long sweep can be resumed (rows already
there are skipped) and watched; ``--table`` prints the summary and the table of what failed, as in
docs/benchmarks.md; ``--compact`` writes ``--out`` without its plans, small enough to keep (the kept sweeps are
``docs/hf_families/``). An ``assert`` or a branch on values of the inputs alone (XLM, FlauBERT, ProphetNet) is
guarded (``meshpilot.ops.guard``); one on values capture cannot compute (I-BERT's) still plans only under
``python -O`` (asserts off; the 4-rank spawns inherit the flag): a setting of its own, swept into an ``--out``
of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

SETTINGS = ("nocache-sdpa", "cache-sdpa", "nocache-eager", "cache-eager")
TEXT = ("causal", "masked", "seq2seq")
TOL = 1e-5
ROUNDING = 2.0
"""A run that differs from one device by more than TOL is float32 rounding when its gradients are at most this
many times as far from a float64 run's as the single device's float32 gradients are (``lockstep_adamw``'s
``ref64``); it is counted apart from ``exact``."""


@contextlib.contextmanager
def _held(lock: str | None, pause: float = 2.0):
    """Hold `lock` (a file, ``flock``; the one ``flock(1)`` takes, so a shell's ``flock FILE cmd`` waits for it
    too) while the body runs; nothing when `lock` is None. The run phase takes it around each 4-rank spawn, so a
    long sweep shares the ranks' cores with other users of the lock a spawn at a time, not for hours. flock is
    not first come, first served: a waiter woken by the release must still be scheduled before it takes the lock,
    and the sweep asking again at once would win it back, spawn after spawn; so the sweep waits `pause` seconds
    after each release, and a waiting user goes first."""
    if lock is None:
        yield
        return
    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    time.sleep(pause)


def _setting(name: str) -> tuple[bool, str]:
    cache, _, attn = name.partition("-")
    return cache == "cache", attn


def _done(out: Path) -> dict[tuple, dict]:
    """The latest row of each (phase, family, setting) in `out`, each with its line number as ``_line``."""
    rows = {}
    if out.exists():
        for i, line in enumerate(out.read_text().splitlines()):
            if line.strip():
                r = json.loads(line)
                rows[(r["phase"], r["family"], r["setting"])] = {**r, "_line": i}
    return rows


def _append(out: Path, row: dict) -> None:
    with out.open("a") as fh:
        fh.write(json.dumps(row) + "\n")


def plan_phase(fams, settings, out: Path, limit: float, redo: bool = False) -> None:
    """Plan every family of `fams` under each setting, appending one row each; rows already in `out` are
    skipped unless `redo` (a re-plan after a fix: the table reads each family's latest row)."""
    from meshpilot.models.hf_families import no_dropout, tiny_overrides, try_plan

    done = {} if redo else _done(out)
    for fam in fams:
        for setting in settings:
            if ("plan", fam.name, setting) in done:
                continue
            if ("start", fam.name, setting) in done:  # the last sweep died planning it: its row says so
                row = {
                    "phase": "plan", "family": fam.name, "kind": fam.kind, "setting": setting,
                    "status": "crashed", "reason": "the sweep's process was killed planning it (out of memory?)",
                }  # fmt: skip
                _append(out, row)
                print(f"crashed          {fam.name} [{setting}] {row['reason']}", flush=True)
                continue
            _append(out, {"phase": "start", "family": fam.name, "kind": fam.kind, "setting": setting})
            use_cache, attn = _setting(setting)
            try:
                over = {**tiny_overrides(fam.model_type), **no_dropout(fam.model_type)}
            except Exception as e:  # noqa: BLE001 - a family whose default config cannot even be made
                over = None
                o_status, o_reason, o_s = "unbuilt", f"{type(e).__name__}: {e}".splitlines()[0], 0.0
            if over is not None:
                o = try_plan(fam, use_cache=use_cache, attn=attn, overrides=over, limit_s=limit)
                o_status, o_reason, o_s = o.status, o.reason, o.seconds
            row = {
                "phase": "plan", "family": fam.name, "kind": fam.kind, "setting": setting,
                "status": o_status, "reason": o_reason[:400], "seconds": round(o_s, 2),
            }  # fmt: skip
            if over is not None and o.plan is not None and setting == settings[0]:
                row["plan"] = o.plan.to_json()
                row["overrides"] = over
            _append(out, row)
            print(f"{o_status:8s} {o_s:6.1f}s {fam.name} [{setting}] {o_reason[:200]}", flush=True)


def run_phase(
    out: Path,
    setting: str,
    chunk: int,
    most: int | None = None,
    names: set[str] | None = None,
    per: float = 600.0,
    lock: str | None = None,
) -> None:
    """Every family planned without fallback under `setting` (of `names` if given; the first `most` not run
    yet): 4 gloo ranks, `chunk` families per spawn, `per` seconds per family before the spawn is ended (ranks
    that wait for each other in mismatched collectives never return on their own); each spawn holds `lock`."""
    from dist_utils import DistributedTestError, run_distributed
    from test_hf_families import lockstep_families

    done = _done(out)

    def stale(fam: str, plan_row: dict) -> bool:  # never run, or run on a plan made before the latest
        run = done.get(("run", fam, setting))
        return run is None or run["_line"] < plan_row["_line"]

    todo = [
        r for (ph, fam, st), r in done.items()
        if ph == "plan" and st == setting and r["status"] == "planned" and stale(fam, r)
    ]  # fmt: skip
    todo = [r for r in todo if names is None or r["family"] in names][:most]
    use_cache, attn = _setting(setting)
    for i in range(0, len(todo), chunk):
        part = todo[i : i + chunk]
        jobs = [(r["family"], r["kind"], use_cache, attn, r["overrides"], r["plan"]) for r in part]
        t0 = time.perf_counter()
        try:
            with _held(lock):
                per_rank = run_distributed(lockstep_families, 4, jobs, referee=True, timeout=per * len(part))
        except DistributedTestError as e:
            if len(part) > 1:  # a crash takes the spawn down: retry one by one to find which
                for r in part:
                    _run_one(out, r, setting, use_cache, attn, per, lock)
                continue
            per_rank = None
            err = str(e).strip().splitlines()[-1][:300]
        for k, r in enumerate(part):
            row = {"phase": "run", "family": r["family"], "kind": r["kind"], "setting": setting}
            if per_rank is None:
                row.update(status="crashed", reason=err)
            else:
                row.update(_verdict([res[k] for res in per_rank]))
            row["seconds"] = round((time.perf_counter() - t0) / len(part), 1)
            _append(out, row)
            print(f"run {row['status']:8s} {r['family']} {row.get('reason', '')[:200]}", flush=True)


def _run_one(out: Path, r: dict, setting: str, use_cache: bool, attn: str, per: float, lock: str | None) -> None:
    from dist_utils import DistributedTestError, run_distributed
    from test_hf_families import lockstep_families

    row = {"phase": "run", "family": r["family"], "kind": r["kind"], "setting": setting}
    t0 = time.perf_counter()
    try:
        jobs = [(r["family"], r["kind"], use_cache, attn, r["overrides"], r["plan"])]
        with _held(lock):
            per_rank = run_distributed(lockstep_families, 4, jobs, referee=True, timeout=per)
        row.update(_verdict([res[0] for res in per_rank]))
    except DistributedTestError as e:
        row.update(status="crashed", reason=str(e).strip().splitlines()[-1][:300])
    row["seconds"] = round(time.perf_counter() - t0, 1)
    _append(out, row)
    print(f"run {row['status']:8s} {r['family']} {row.get('reason', '')[:200]}", flush=True)


def _verdict(results: list[dict]) -> dict:
    """One family's run over the ranks: exact, or what differed first."""
    if any("error" in r for r in results):
        return {"status": "error", "reason": next(r["error"] for r in results if "error" in r)}
    loss = max(max(r["loss"]) for r in results)
    grad = max(max(r["grad"]) for r in results)
    counts = all(r["counts_equal"] for r in results)
    out = {"status": "exact", "loss": loss, "grad": grad}
    if loss > TOL or grad > TOL:
        out.update(status="differs", reason=f"loss {loss:.2g}, gradient {grad:.2g} from one device")
        if all("grad64_par" in r for r in results):  # the float64 referee ran: is it float32 rounding?
            par = max(max(r["grad64_par"]) for r in results)
            one = max(max(r["grad64_ref"]) for r in results)
            out.update(grad64_par=par, grad64_ref=one)
            if par <= ROUNDING * one:
                out.update(status="rounding", reason=f"{out['reason']}, but as near float64's gradients as one "
                           f"device's float32 run ({par:.2g} against {one:.2g})")  # fmt: skip
    elif not counts:
        out.update(status="counts", reason="collectives issued differ from the plan's")
    return out


def _summary(kind: str, setting: str, plans: list[dict], runs: list[dict]) -> str:
    """One row of the summary table: counts by status, and the share planned with no fallback of all the
    families and of those transformers builds tiny."""
    c = Counter(r["status"] for r in plans)
    exact = sum(r["status"] == "exact" for r in runs)
    rounding = sum(r["status"] == "rounding" for r in runs)
    ran = f"{exact} / {len(runs)}" + (f" (+{rounding} float32 rounding)" if rounding else "") if runs else "—"
    built = len(plans) - c["unbuilt"]
    share = f"{100 * c['planned'] / len(plans):.0f} % / {100 * c['planned'] / built:.0f} %" if built else "—"
    return (
        f"| {kind} | {setting} | {len(plans)} | {c['planned']} | {c['fallback']} | "
        f"{c['refused'] + c['timeout'] + c['crashed']} | {c['unbuilt']} | {share} | {ran} |"
    )


def table(out: Path, settings: tuple[str, ...]) -> str:
    """The summary (per kind and setting, and the text kinds together: planned / run exactly / refused, of how
    many) and every failure."""
    rows = _done(out)
    lines = [
        "| kind | setting | families | planned | fallback | refused | not built | planned of all / of built "
        "| run exactly |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    fails = []
    groups = [(k, (k,)) for k in ("causal", "masked", "seq2seq", "image")] + [("text", TEXT)]
    for label, kinds in groups:
        for st in settings:
            plans = [r for (ph, _, s), r in rows.items() if ph == "plan" and s == st and r["kind"] in kinds]
            # a run of an older plan of the family does not count
            runs = [
                r for (ph, f, s), r in rows.items()
                if ph == "run" and s == st and r["kind"] in kinds and r["_line"] > rows[("plan", f, s)]["_line"]
            ]  # fmt: skip
            if not plans or (label == "text" and len({r["kind"] for r in plans}) < 2):
                continue
            lines.append(_summary(label, st, plans, runs))
            if label != "text":
                fails += [r for r in plans + runs if r["status"] not in ("planned", "exact")]
    lines += ["", "| family | setting | phase | status | reason |", "| --- | --- | --- | --- | --- |"]
    for r in sorted(fails, key=lambda r: (r["family"], r["setting"])):
        reason = r.get("reason", "").replace("|", "\\|")
        lines.append(f"| {r['family']} | {r['setting']} | {r['phase']} | {r['status']} | {reason} |")
    return "\n".join(lines)


def compact(out: Path, dest: Path) -> int:
    """Write `out`'s plan and run rows to `dest` without their plans and overrides (a sweep small enough to keep in
    the repository, ``--table`` reads it the same way): every row, in order, so the latest of each still wins.
    Returns the number of rows written."""
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    kept = [{k: v for k, v in r.items() if k not in ("plan", "overrides")} for r in rows if r["phase"] != "start"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return len(kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="causal,masked,seq2seq,image")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--only", default="", help="model types to keep (comma-separated)")
    ap.add_argument("--limit", type=float, default=120.0, help="seconds of planning per family and setting")
    ap.add_argument("--out", default="/tmp/hf_families.jsonl")
    ap.add_argument("--run", action="store_true", help="also run the planned families on 4 gloo ranks")
    ap.add_argument("--chunk", type=int, default=8, help="families per 4-rank spawn")
    ap.add_argument("--run-timeout", type=float, default=600.0, help="seconds per family of a 4-rank spawn")
    ap.add_argument("--run-most", type=int, default=None, help="run at most this many families (a sample)")
    ap.add_argument("--lock", default=None, help="a file to flock around each 4-rank spawn (shared cores)")
    ap.add_argument("--no-plan", action="store_true", help="skip the plan phase (with --run: run what --out planned)")
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    ap.add_argument("--shard", default="0/1", help="i/n: plan every n-th family from the i-th (parallel sweeps)")
    ap.add_argument("--redo", action="store_true", help="plan again families --out already has (after a fix)")
    ap.add_argument("--compact", default="", help="only write --out's rows without their plans to this file")
    args = ap.parse_args()
    if args.compact:
        print(f"{compact(Path(args.out), Path(args.compact))} rows written to {args.compact}")
        return
    warnings.filterwarnings("ignore")
    import transformers

    from meshpilot.models.hf_families import families

    settings = tuple(args.settings.split(","))
    out = Path(args.out)
    if not args.table:
        only = set(filter(None, args.only.split(",")))
        fams = [f for f in families(tuple(args.kinds.split(","))) if not only or f.model_type in only]
        i, n = map(int, args.shard.split("/"))
        fams = fams[i::n]
        print(f"transformers {transformers.__version__}: {len(fams)} families", flush=True)
        if not args.no_plan:
            plan_phase(fams, settings, out, args.limit, args.redo)
        if args.run:
            names = {f.name for f in fams} if only else None
            run_phase(out, settings[0], args.chunk, args.run_most, names, args.run_timeout, args.lock)
    print(f"transformers {transformers.__version__}")
    print(table(out, settings))


if __name__ == "__main__":
    main()
