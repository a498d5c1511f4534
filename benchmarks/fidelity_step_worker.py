"""Per-rank training-step timer for saved plans of one GPT: run under torchrun or `meshpilot emulate`.

``bench_fidelity.py`` starts it under ``meshpilot emulate``. It reads a manifest (JSON: ``{"model": {GPTConfig
fields}, "plans": [{"name", "path"}, ...], "microbatches": M (optional, default 1: the plans' schedules cut the
global batch into M)}``), captures the GPT once on the meta device (on one microbatch), and for every plan
builds the same GPT (same seed) under ``meshpilot.parallelize(model, plan, graph=...)`` with an AdamW
optimizer. A step is forward + loss, backward, ``opt.step()``, ``zero_grad()`` on the full global batch
(every rank passes it; the runtime takes its slice).

Timing protocol (the same as ``atp_step_worker.py``, whose docstring explains why): every plan is built and
runs --warmup untimed steps; then --steps rounds, in round r every plan runs one step in the plan order
rotated by r; a barrier before each step; each rank times its own step; a step's time is the slowest rank's;
a plan's result is the median over its rounds (min and max too).

Rank 0 writes ``{"world", "nodes", "model", "steps", "warmup", "results": [{"name", "median_s", "min_s",
"max_s", "steps_s", "optimizer_median_s", "loss0", "build_s"}], ...}`` to --out; ``optimizer_median_s`` is
the step's ``opt.step()`` + ``zero_grad`` part (slowest rank per round, median over the rounds). ``loss0``
(the first warm-up loss) is the same for every plan up to float summation order: every plan trains the same
model on the same batch.

Instead of ``"model"`` a manifest may name any ``--model`` source (``meshpilot.models.sources.build_model``):
``{"source": {"name": "hf:mixtral", "hf_config": ["key=value", ...], "batch": B, "seq": S}, ...}``; every rank
builds it on the CPU with the same seed and steps on its example inputs (``bench_duplex.py --model mixtral``).

With ``--trace``, each rank's split also carries ``usage``: its CPU seconds (user, system), minor page
faults and context switches during the traced step, for the whole process (gloo's threads too) and for its
main thread alone (``getrusage``); with ``MESHPILOT_TRACE_EVENTS=1`` in the environment, ``events``: the raw
``duplex.TRACE`` time stamps (``perf_counter``, one clock for every process of the machine), to line the ranks
up against each other (``trace_across_ranks.py``; docs/benchmarks.md, *One collective at a time per group*).

``--fake-world N`` runs one process on torch's fake process group instead (as ``atp_step_worker.py``): a
rank's share of the computation, and what the runtime does around it, with no communication at all.

    meshpilot emulate -c examples/clusters/emulated-2x4-slow.toml -- \\
        python benchmarks/fidelity_step_worker.py --manifest out/bench-fidelity/manifest.json --out steps.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from atp_step_worker import step_stats, time_round_robin, write_result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", type=Path, required=True, help="JSON naming the model and the plan files")
    p.add_argument("--steps", type=int, default=5, help="timed rounds per plan (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per plan (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, help="rank 0 writes the JSON result here")
    p.add_argument(
        "--fake-world",
        type=int,
        metavar="N",
        help="no torchrun: one process on torch's fake process group of N ranks (collectives return at once), "
        "i.e. one rank's computation and the runtime's own work without communication (losses meaningless)",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="after timing, one more step per plan with its forward / backward programs time-stamping each "
        "collective (meshpilot.runtime.duplex.traced): every rank's compute, communication and overlap",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT, GPTConfig
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.spmd import mesh_for_plan, parallelize
    from meshpilot.runtime.train import adamw, batches, reference_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.fake_world)
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = json.loads(args.manifest.read_text())
    # plans with M microbatches are made for a microbatch of the global batch (all plans of a manifest alike)
    microbatches = int(manifest.get("microbatches", 1))
    source = manifest.get("source")
    if source is None:
        cfg = GPTConfig(**manifest["model"])
        inputs = batches(cfg, 1, args.seed)[0]
        with torch.device("meta"):
            meta = GPT(cfg)
        example = torch.empty(cfg.batch // microbatches, cfg.seq, dtype=torch.long, device="meta")
        graph = capture(meta, (example, example))

        def fresh():
            return reference_model(cfg, args.seed)
    else:
        from meshpilot.models.sources import build_model

        def built(batch: int, device: str):
            return build_model(
                source["name"],
                hf_config=source.get("hf_config"),
                batch=batch,
                seq=source.get("seq"),
                device=device,
                seed=args.seed,
            )

        inputs = built(source["batch"], "cpu").inputs
        small = built(source["batch"] // microbatches, "meta")
        graph = capture(small.model, small.inputs)

        def fresh():
            return built(source["batch"], "cpu").model

    configs = []
    for entry in manifest["plans"]:
        t0 = time.perf_counter()
        plan = StagePlan.load(entry["path"])
        mesh = mesh_for_plan(plan, "cpu") if args.fake_world else None  # parallelize refuses a fake group
        model = parallelize(fresh(), plan, mesh=mesh, graph=graph)
        opt = adamw(model.parameters(), lr=args.lr)  # the optimizer `meshpilot train` steps with
        configs.append({"name": entry["name"], "model": model, "opt": opt, "times": [], "loss0": None, "build_s": 0.0})
        configs[-1]["build_s"] = time.perf_counter() - t0

    def step(c: dict) -> float:
        loss = c["model"](*inputs)
        loss.backward()
        t0 = time.perf_counter()
        c["opt"].step()
        c["opt"].zero_grad(set_to_none=True)
        c["opt_times"].append(time.perf_counter() - t0)
        return float(loss.detach())

    for c in configs:
        c["opt_times"] = []
    per, t_warm, t_total = time_round_robin(configs, step, args.warmup, args.steps)
    # the optimizer's part of each timed step (the last --steps of each config's calls), slowest rank
    opt_local = torch.tensor([t for c in configs for t in c["opt_times"][-args.steps :]], dtype=torch.float64)
    dist.all_reduce(opt_local, op=dist.ReduceOp.MAX)
    opt_per = opt_local.view(len(configs), args.steps).tolist()
    traces = [trace_step(c, step) for c in configs] if args.trace else []
    every: list = [None] * world
    if traces:
        dist.all_gather_object(every, traces)
    if rank == 0:
        results = [
            {
                "name": c["name"],
                **step_stats(ts),
                "optimizer_median_s": statistics.median(os_),
                "loss0": c["loss0"],
                "build_s": c["build_s"],
            }
            for c, ts, os_ in zip(configs, per, opt_per)
        ]
        for k, r in enumerate(results):
            if traces:
                r["trace"] = [every[rk][k] for rk in range(world)]  # per rank
        doc = {"world": world, "model": manifest.get("model", source), "results": results}
        write_result("FIDELITY_STEP_RESULT", args.out, doc, args.steps, args.warmup, t_warm, t_total)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def trace_step(c: dict, step) -> dict:
    """One more step of config `c` with its forward / backward programs traced: this rank's split."""
    import torch.distributed as dist

    from meshpilot.runtime import duplex

    prog = c["model"].program
    kept = {}
    for fn, gm in (
        ("_forward_fn", "forward_gm"),
        ("_backward_fn", "backward_gm"),
        ("_forward_pair_fn", "forward_pair_gm"),
        ("_backward_pair_fn", "backward_pair_gm"),
    ):
        if getattr(prog, fn) is not None and getattr(prog, gm) is not None:
            kept[fn] = getattr(prog, fn)
            setattr(prog, fn, duplex.traced(getattr(prog, gm)))
    dist.barrier()
    duplex.TRACE.clear()
    before = _usage()
    step(c)
    split = duplex.trace_overlap(list(duplex.TRACE))
    split["usage"] = {k: a - b for (k, a), b in zip(_usage().items(), before.values())}
    if os.environ.get("MESHPILOT_TRACE_EVENTS"):  # the raw time stamps, for a look across ranks
        split["events"] = list(duplex.TRACE)
    for fn, f in kept.items():
        setattr(prog, fn, f)
    return split


def _usage() -> dict:
    """This rank's CPU seconds and scheduler / memory counters: the whole process (every thread: gloo's too)
    and its main thread alone (``getrusage``)."""
    import resource

    out = {}
    for who, flag in (("process", resource.RUSAGE_SELF), ("main", resource.RUSAGE_THREAD)):
        r = resource.getrusage(flag)
        out |= {f"{who}_user_s": r.ru_utime, f"{who}_sys_s": r.ru_stime, f"{who}_minflt": r.ru_minflt}
        out |= {f"{who}_nvcsw": r.ru_nvcsw, f"{who}_nivcsw": r.ru_nivcsw}
    return out


if __name__ == "__main__":
    sys.exit(main())
