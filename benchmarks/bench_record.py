"""Where a rank's first step goes: recording the plan's programs, split by phase, on 4 gloo CPU ranks.

The first step of ``parallelize``'s module runs each phase (forward, backward, gradient sync) once under the
recorder (``runtime.record``) and then hands the recording to the passes of ``runtime/`` (untranspose, issue
points, prefetch, buckets, fold, boxing, code generation). This script plans the tests' tiny GPT
(``tests/test_models_parallel.py``'s ``gpt``: 2 layers, h=32, batch 8, sequence 8) and Hugging Face GPT-2
(``tests/test_hf_models.py``'s sizes, ``use_cache=False``) in the parent, runs each plan for a few steps on 4
gloo ranks, and prints rank 0's CPU seconds (``time.thread_time``: this thread only, so gloo's threads are
not counted) per part:

  parallelize  capture, plan checks, parameter distribution (``meshpilot.parallelize``)
  record       the recorder's run of each phase (DTensor dispatch under the TorchDispatchMode)
  passes       the passes over the recordings, each by name, and the code generation (``direct_ops``)
  step1        the whole first step (record + passes + the rest of the step)
  later        the mean of the later steps (the optimizer's step not counted in either)

    flock /tmp/meshpilot-ranks.lock python benchmarks/bench_record.py            # every plan, one run each
    flock /tmp/meshpilot-ranks.lock python benchmarks/bench_record.py --profile gpt:solver   # + cProfile of rank 0

``--repeat N`` parallelizes each plan N times in the same ranks (the program cache cleared in between) and
reports the median of each part: the first run of a process pays DTensor's cold sharding caches, which the
tests' long-lived ranks pay once for many plans; ``--profile`` profiles the last run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

WORLD = 4
MESH = (2, 2)
CLUSTER = "atp-ic3"
STEPS = 3

# the runtime's functions this script times: (module, attribute) as program.py binds them
PASSES = (
    "record",
    "gather_untransposed",
    "issue_early",
    "prefetch",
    "issue_when_ready",
    "write_into_buckets",
    "fold_views",
    "_boxed",
    "_maybe_compile",
)


def build(name: str):
    import torch

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        from meshpilot.models.gpt import GPT, gpt_tiny

        model = GPT(gpt_tiny(batch=8, seq=8, layers=2))
        idx = torch.randint(0, 64, (8, 9), generator=g)
        return model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
    if name == "gpt2":
        from meshpilot.models.sources import hf_model

        cfg = dict(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=64, bos_token_id=0, eos_token_id=0)
        model = hf_model("gpt2", {**cfg, "use_cache": False})
        ids = torch.randint(0, 64, (4, 8), generator=g)
        labels = torch.randint(0, 64, (4, 8), generator=g)
        labels[0, :4] = -100
        return model, (ids, labels)
    raise KeyError(name)


def make_plans(names: list[str]) -> dict:
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import plan
    from meshpilot.planner.forced import forced

    plans = {}
    for spec in names:
        model_name, kind = spec.split(":")
        model, inputs = build(model_name)
        graph = capture(model, inputs)
        extra = {}
        if kind == "overlapped":
            extra = dict(overlap=True)
        force = None
        if kind in ("data_parallel", "megatron_tp", "zero3"):
            force = forced(kind, model, inputs, MESH, **({"graph": graph} if kind == "megatron_tp" else {}))
        plans[spec] = plan(
            model, inputs, CLUSTER, mesh_shape=MESH, force=force, graph=graph, mappings=("row",), **extra
        )
    return plans


def _instrument(times: dict) -> None:
    """Wrap program.py's bindings of the passes so each call's thread CPU adds to `times`."""
    from meshpilot.runtime import program

    for name in PASSES:
        fn = getattr(program, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.thread_time()
            try:
                return _fn(*a, **k)
            finally:
                times[_name] += time.thread_time() - t0

        setattr(program, name, timed)
    # DTensor's sharding propagation on a cache miss (its LRU cache rebuilt around the timed function)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import LocalLRUCache, ShardingPropagator

    miss = ShardingPropagator.propagate_op_sharding_non_cached

    def timed_miss(self, schema, _fn=miss):
        t0 = time.thread_time()
        try:
            return _fn(self, schema)
        finally:
            times["dtensor_miss"] += time.thread_time() - t0

    ShardingPropagator.propagate_op_sharding_non_cached = timed_miss
    sp = DTensor._op_dispatcher.sharding_propagator
    sp.propagate_op_sharding = LocalLRUCache(sp.propagate_op_sharding_non_cached)


def _rank(rank: int, store_dir: str, plans: dict, repeat: int, profile: str | None, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(store_dir, "store"), WORLD), rank=rank, world_size=WORLD
    )
    import meshpilot
    from meshpilot.runtime import spmd

    times: dict = defaultdict(float)
    _instrument(times)
    rows = {}
    for spec, p in plans.items():
        runs = []
        for r in range(repeat):
            spmd._PROGRAMS.clear()
            times.clear()
            model, inputs = build(spec.split(":")[0])
            t0 = time.thread_time()
            pm = meshpilot.parallelize(model, p)
            par = time.thread_time() - t0
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
            prof = None
            if profile == spec and rank == 0 and r == repeat - 1:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            steps = []
            for _ in range(STEPS):
                t0 = time.thread_time()
                pm.train_step(*inputs)
                steps.append(time.thread_time() - t0)  # the step alone: AdamW's DTensor dispatch is not the runtime's
                opt.step()
                opt.zero_grad()
                if prof is not None:
                    prof.disable()
                    prof.dump_stats(f"/tmp/bench_record.{spec.replace(':', '-')}.prof")
                    prof = None
            ops = {}
            prog = pm.program
            for ph in ("forward", "backward", "grad_sync"):
                gm = getattr(prog, f"{ph}_gm")
                if gm is not None:
                    ops[ph] = len(gm.graph.nodes)
            runs.append(dict(parallelize=par, step1=steps[0], later=statistics.mean(steps[1:]), ops=ops, **dict(times)))
            dist.barrier()
        rows[spec] = runs
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plans", nargs="*", default=["gpt:solver", "gpt:zero3", "gpt:megatron_tp", "gpt2:solver"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--profile", default=None, help="model:kind whose first step rank 0 profiles")
    args = ap.parse_args()
    import torch.multiprocessing as mp

    t0 = time.process_time()
    plans = make_plans(args.plans)
    print(f"planning (parent): {time.process_time() - t0:.2f} CPU s", file=sys.stderr)
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, (tmp, plans, args.repeat, args.profile, q), nprocs=WORLD, start_method="spawn")
        rows = q.get()
    cols = ["parallelize", "dtensor_miss", *PASSES, "step1", "later"]
    print("plan".ljust(18) + "".join(c[:10].rjust(11) for c in cols) + "   ops (fwd/bwd/sync)")
    for spec, runs in rows.items():
        med = {c: statistics.median(r.get(c, 0.0) for r in runs) for c in cols}
        ops = "/".join(str(v) for v in runs[0]["ops"].values())
        print(spec.ljust(18) + "".join(f"{med[c]:11.3f}" for c in cols) + f"   {ops}")
        if len(runs) > 1:
            print("  step1 runs: " + " ".join(f"{r['step1']:.3f}" for r in runs))


if __name__ == "__main__":
    main()
