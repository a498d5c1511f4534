"""meshpilot's data-parallel and ZeRO-3 steps against PyTorch's own: ``DistributedDataParallel`` and ``fully_shard``.

One torchrun launch of --nproc gloo processes (default 4, loopback) per model trains every variant from the same
weights (same seed) on the same batch, their steps interleaved (the order rotated every round) so they share
the machine's noise:

  DDP            ``torch.nn.parallel.DistributedDataParallel`` (its default 25 MiB buckets), each rank its
                 1/N of the batch;
  FSDP2          ``fully_shard`` on every block (every element of the model's ``nn.ModuleList``s) and the root;
  mp: DP         ``meshpilot.plan(..., mesh_shape=(N,), force=forced.data_parallel(...))`` run by
                 ``meshpilot.parallelize`` (every parameter replicated, the inputs batch-sharded), with the
                 gradient buckets the planner chose (``meshpilot.planner.buckets``);
  mp: ZeRO-3     the same with ``forced.zero3`` (every parameter sharded on its first divisible dim);
  mp: solver     the solver's own plan for N devices on a cluster describing this box
                 (``bench_step_time.local_cluster``), compared with the faster of DDP and FSDP2;
  (every meshpilot variant is planned on that loopback cluster with what a collective costs here measured at
                 launch on N gloo ranks with ``meshpilot probe``'s code, ``measure_loopback``: its host CPU per
                 collective and the world group's all-reduce alone and beside compute; and the device as every
                 rank gets it while all N run, as the probe measures it: matmul FLOP/s and the models' local
                 GEMMs, copy bandwidth, the fixed cost of an operator and of a foreach tensor, the host time
                 of one call of a recorded program and the foreach AdamW step's rates; ``--nominal``
                 skips it and plans on a single-thread matmul rate and a nominal 10 GB/s)
  (``--plan-on-probed``: every meshpilot variant planned on the ``--probed`` cluster instead, so its measured
                 curves and host cost per collective choose the buckets and price the step)
  mp: DP, 25 MiB buckets  (``--big-buckets``) the DP plan bucketed at DDP's size instead of the planner's;
  mp: DP, buckets at h µs a collective  (``--host-cost-us H[,H...]``) the DP plan bucketed by the planner's rule
                 (``planner.buckets.bucket_bytes``) on the same cluster with ``collective_overhead_us = H``: the
                 host CPU per collective that ``meshpilot probe`` measures, seen by the bucket size;
  ..., no buckets  (``--unbucketed``) the DP and ZeRO-3 plans without their buckets: one collective per
                 gradient after the backward, as before buckets existed (before / after in one launch);
  mp: DP, DTensor parameters  (``--dtensor-params``) the DP plan with every parameter a DTensor, as before
                 plain replicated parameters (``ParallelModule.plain``; before / after in one launch);
  mp: ZeRO-3, per-parameter gathers  (``--ungrouped``) the ZeRO-3 plan without its gather groups
                 (``StagePlan.param_gathers``): one all-gather per parameter read, prefetched one layer ahead
                 (before / after the groups in one launch).

Models: ``gpt`` (the zoo's GPT, ``gpt-tiny`` grown to 4 layers, h 256, batch 8 x 128) and ``llama`` (a tiny
``transformers`` Llama: 4 layers, h 256, vocab 2048, batch 8 x 128, ``use_cache=False`` as for training).
``--overlap`` plans every meshpilot variant with ``overlap=True`` (each resharding collective, ZeRO-3's weight
all-gathers included, issued right after its producer and waited for before its consumer).

``--emulate FILE`` launches the ranks under ``meshpilot emulate`` instead (one network namespace per node of FILE,
the link between nodes shaped by tc; root only) and plans the meshpilot variants on FILE, so DDP's 25 MiB buckets
and the planner's meet a slow inter-node link (``examples/clusters/emulated-2x2-slow.toml``: 2 nodes x 2 ranks).
The device is measured at launch as on loopback (the links stay the file's); that file's link rates are nominal: to
plan and predict on measured ones, probe the same emulated topology first and
pass the result with ``--probed FILE --plan-on-probed`` (``examples/clusters/probed/emulated-2x2-slow.probed.toml``
was written so, at load 8-11 on a 2-core box; ``GEMMS`` a JSON list of the plans' local GEMMs,
``meshpilot.planner.accounting.plan_gemms``)::

    OMP_NUM_THREADS=1 meshpilot emulate -c examples/clusters/emulated-2x2-slow.toml -- python -m meshpilot.cli.main \\
        probe --out probed.toml --matmul-shapes GEMMS --p2p-budget 30
    python benchmarks/bench_vs_torch.py --emulate examples/clusters/emulated-2x2-slow.toml \\
        --probed probed.toml --plan-on-probed

A step is forward + backward + AdamW (foreach) step + zero_grad on the full global batch, timed between two
barriers (the slowest rank's step). The table shows the median of --steps steps after --warmup, the CPU
seconds of the busiest rank's process in the step (all its threads: less sensitive to other jobs), the CPU
floor (that CPU x ranks / cores, ``cpu_floor_ms``: the step no schedule beats where ranks share cores), the ratio
to DDP or FSDP2, the plan's predicted step (``StepTime.overlapped_s``: the buckets' overlap priced, less
what the sharded parameters' gather groups and prefetch hide, ``planner.prefetch.gather_hidden_s``; with
``--probed FILE``, a cluster ``meshpilot probe`` measured on this box, also the plan re-priced on it in closed
form and simulated, each over the measured median), and the
collectives one step ran (the torch profiler's ``gloo:*`` events: DDP's, FSDP's and DTensor's alike). One more
step of each variant is split by the torch profiler into ATen compute, communication (issue + wait, as the
calling thread sees it) and the rest (host: Python, DTensor dispatch, autograd)
(``bench_step_time.profile_step``). The first step's loss of every variant is compared with DDP's.

A second table splits each variant's step into its forward, backward and optimizer (AdamW's step, zero_grad,
and for DDP / FSDP2 the loss' all-reduce), CPU and wall ms of the busiest rank per part; with ``--comm-cost``
it also gives what the collectives of forward + backward cost the host: each rank's CPU with them and without
them (meshpilot: its recorded programs with every functional collective replaced by a local op of the same
output shape, ``without_collectives``; DDP: the same step under ``no_sync()``), interleaved, the difference
per collective the programs issue. A third table splits rank 0's wall per part by the scheduler (:class:`Schedstat`):
its main thread's CPU, that thread's wait for a core (runnable, not running: 4 ranks on 2 cores), the rest asleep
(waiting for a collective's peers), and its other threads' CPU (gloo's). ``--no-solver`` leaves the solver's plan
out.

    python benchmarks/bench_vs_torch.py --unbucketed            # GPT and Llama, with the before/after rows
    python benchmarks/bench_vs_torch.py --models gpt --overlap
    python benchmarks/bench_vs_torch.py --no-profile --no-solver --comm-cost   # where the step's host time goes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

TORCH = ("DDP", "FSDP2")
UNBUCKETED = ", no buckets"
UNGROUPED = ", per-parameter gathers"
BASE = {
    "mp: DP": "DDP",
    "mp: ZeRO-3": "FSDP2",
    "mp: DP" + UNBUCKETED: "DDP",
    "mp: ZeRO-3" + UNBUCKETED: "FSDP2",
    "mp: ZeRO-3" + UNGROUPED: "FSDP2",
}
BASE["mp: DP, 25 MiB buckets"] = "DDP"
DTENSOR_PARAMS = ", DTensor parameters"
"""The suffix of the ``--dtensor-params`` variant: the DP plan run with ``ParallelModule.plain = False``."""
BASE["mp: DP" + DTENSOR_PARAMS] = "DDP"
HOST = "mp: DP, buckets at "
"""The prefix of the ``--host-cost-us`` variants (compared with DDP)."""
PHASES = ("forward", "backward", "optimizer")
"""A step's parts as timed (``optimizer``: AdamW's step, zero_grad and, for DDP and FSDP2, the loss' all-reduce)."""
"""What each meshpilot variant is compared with (the solver's plan: the faster of the two)."""
MODELS = {
    "gpt": {"name": "gpt-tiny", "layers": 4, "hidden": 256, "heads": 8, "batch": 8, "seq": 128},
    "llama": {
        "name": "hf:llama",
        "hf_config": [
            "hidden_size=256",
            "intermediate_size=688",
            "num_hidden_layers=4",
            "num_attention_heads=8",
            "num_key_value_heads=8",
            "vocab_size=2048",
            "use_cache=False",  # as people train it (no key/value cache: no empty cache `cat` in the graph)
        ],
        "batch": 8,
        "seq": 128,
    },
}


def build(spec: dict, device: str, seed: int = 0):
    from meshpilot.models.sources import build_model

    kw = {k: v for k, v in spec.items() if k != "name"}
    torch.manual_seed(seed)  # built-in models take the global generator's: every variant the same weights
    return build_model(spec["name"], device=device, seed=seed, **kw)


# ----------------------------------------------------------------------------------------------- parent


def predictions(p, graph, probed, cost) -> dict[str, float]:
    """The plan's predicted step in ms on the cluster it was planned for (``StepTime.overlapped_s`` less what the
    runtime's parameter gather groups and prefetch hide, ``planner.prefetch.gather_hidden_s`` on the cost model
    `cost`) and,
    given a `probed` cluster, re-priced on it (``accounting.reprice``) in closed form and simulated
    (``meshpilot.sim``, with the prefetch)."""
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.planner.prefetch import gather_hidden_s, prefetch_issues

    hidden = gather_hidden_s(p, graph, cost)
    out = {"predicted_ms": (p.time.overlapped_s - hidden) * 1e3, "gathers_hidden_ms": hidden * 1e3}
    if probed is not None:
        from meshpilot.planner.accounting import reprice
        from meshpilot.sim import simulate

        q = reprice(p, graph, probed)
        on_probed = gather_hidden_s(q, graph, CostModel(LogicalMesh(probed, tuple(q.mesh_shape))))
        out["probed_ms"] = (q.time.overlapped_s - on_probed) * 1e3
        out["simulated_ms"] = simulate(q, cluster=probed, prefetch=prefetch_issues(q, graph)).step_s * 1e3
    return out


def loopback_cluster(n: int, tflops: float, args: argparse.Namespace) -> dict:
    """The alpha-beta loopback cluster the meshpilot variants are planned on (``bench_step_time.local_cluster``)
    with ``collective_overhead_us`` = ``args.collective_overhead_us``: the host CPU one collective costs a rank
    here, which the bucket rule weighs against the exposed tail (``planner.buckets``, *Bucket size with a host
    cost*). Without it the rule sees only the 125 µs latency and cuts the GPT's gradients into 13 buckets, the
    Llama's into 22, where DDP issues 3-4 all-reduces (docs/benchmarks.md, "Issue 30: the one-collective
    data-parallel loss re-landed ..."); a collective here costs its rank 0.75-0.9 ms of CPU (the probes there)."""
    from bench_step_time import local_cluster

    spec = local_cluster(n, tflops, args.gbps, args.latency_us)
    measured = getattr(args, "loopback_device", None)
    if measured:  # the device as measured at launch (measure_loopback); --tflops still overrides the peak
        spec["device_profile"].update(measured if not args.tflops else dict(measured, peak_tflops_fp32=tflops))
    if args.collective_overhead_us:
        spec["device_profile"]["collective_overhead_us"] = args.collective_overhead_us
    if getattr(args, "loopback_calibration", None):
        spec["calibration"] = list(args.loopback_calibration)
    return spec


def loopback_gemms(keys: list[str], n: int) -> list[list]:
    """The distinct local GEMMs ``[m, n, k, dtype]`` of the `keys` models' data-parallel and ZeRO-3 plans on `n`
    ranks: each model captured on meta with 1/n of its batch (``graph.gemms.graph_gemms``), what
    ``accounting.plan_gemms`` lists for those plans. The solver's own plan is priced at the nearest of them."""
    from meshpilot.graph.capture import capture
    from meshpilot.graph.gemms import graph_gemms

    seen: dict[tuple, None] = {}
    for key in (k for k in keys if k in MODELS):  # an unknown key: main's message
        spec = dict(MODELS[key], batch=max(1, MODELS[key]["batch"] // n))
        built = build(spec, "meta")
        for g in graph_gemms(capture(built.model, built.inputs)):
            seen[(g.m, g.n, g.k, g.dtype)] = None
    return [list(g) for g in seen]


PER_RANK = ("float32", "memory_bandwidth", "op_overhead", "foreach_overhead", "call_overhead", "adamw_bandwidth")
"""The device measurements :func:`measure_loopback` prints per rank."""


def device_spec(d) -> dict:
    """A ``[device_profile]`` table's measured keys from a probe's ``DeviceProfile`` `d` (``loader`` units)."""
    return {
        "peak_tflops_fp32": d.flops_for("float32") / 1e12,
        "memory_GBps": d.memory_bandwidth / 1e9,
        "memory_efficiency": d.memory_efficiency,
        "op_overhead_us": d.op_overhead * 1e6,
        "foreach_overhead_us": d.foreach_overhead * 1e6,
        "call_overhead_us": d.call_overhead * 1e6,
        "adamw_GBps": d.adamw_bandwidth / 1e9,
        "adamw_overhead_us": d.adamw_overhead * 1e6,
        "matmul": [{"m": r.m, "n": r.n, "k": r.k, "dtype": r.dtype, "tflops": r.flops / 1e12} for r in d.matmul],
    }


def measure_loopback(n: int, gemms: list[list] | None = None) -> dict:
    """What one collective costs among `n` gloo ranks on this box, measured with ``meshpilot probe``'s own code
    (``cluster.probe._Runner``) in one short launch of `n` ranks before the plans are made, so the plans see the
    load they will run under:

    * ``collective_overhead_us``: the process CPU one collective costs a rank beyond its bytes
      (``_Runner.collective_cpu``: 16 against 4 asynchronous all-reduces of the same 4 MiB beside the same 32
      matmuls, the CPU difference per collective, median over 5 repeats, then over the ranks as
      ``probe.summarize`` takes it). An isolated one-element all-reduce measures about a quarter of it.
    * ``calibration``: the probe's all-reduce phase (``_Runner.allreduce``) as its ``[[calibration]]`` entries,
      one per 2D mesh shape of the `n` ranks (``B1_GBps``, ``alpha1_us``, ``curve1`` from 4 B to 4 MiB alone,
      ``busy1`` beside back-to-back matmuls, and axis 2's), so the mesh search compares measured meshes with
      measured meshes: with the world group's entry alone, the solver priced a (2, 2) mesh on the nominal rates
      and took it for the GPT (90 planned collectives, CPU 1.27x DDP's; docs/benchmarks.md). The busy curve is
      what tells the bucket rule that on 4 ranks sharing 2 cores a bucket issued during the backward runs
      several times slower than alone (``CostModel.busy_factor``), so small buckets hide little: planned on
      the host cost alone the GPT's DP plan keeps 13 buckets, with the curves 2.
    * ``device``: with `gemms` (:func:`loopback_gemms`), the probe's device phase (``probe.measure_device``,
      every timing started in lockstep on the `n` ranks, so each rate is what a rank gets while all `n` run)
      reduced as ``meshpilot probe`` reduces it (``probe.device_profile``: the median over ranks) into a
      ``[device_profile]``'s keys (:func:`device_spec`): the float32 matmul peak and the GEMM table,
      ``memory_GBps`` (a copy's), ``op_overhead_us``, ``foreach_overhead_us``. On 4 ranks sharing 2 cores the
      bench planned on a single-thread matmul rate halved and a nominal 10 GB/s without fixed costs, and
      predicted its steps 17-49 % short (docs/benchmarks.md, issue 30 item 5).

    The nominal alpha-beta rates (``--gbps``, ``--latency-us``) stay for what the entry does not cover."""
    with tempfile.TemporaryDirectory(prefix="bench-vs-torch-h-") as tmp:
        out = Path(tmp) / "h.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
        cmd += [str(Path(__file__).resolve()), "--measure-loopback", "--result", str(out)]
        if gemms:
            (Path(tmp) / "gemms.json").write_text(json.dumps(gemms))
            cmd += ["--plans", str(Path(tmp) / "gemms.json")]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"the {n}-process loopback measurement failed (exit {proc.returncode})")
        return json.loads(out.read_text())


def loopback_worker(args: argparse.Namespace) -> int:
    """One rank of :func:`measure_loopback`: ``collective_cpu``, then the probe's all-reduce phase
    (``_Runner.allreduce``: every 2D mesh shape of the world, every axis of size > 1, alone and beside compute),
    reduced per axis by ``probe.allreduce_by_mesh``, as ``probe.summarize`` does, and written as a cluster file's
    ``[[calibration]]`` entries; with ``--plans GEMMS`` (a JSON list of [m, n, k, dtype]), the probe's device
    phase too (``probe.measure_device`` in lockstep, reduced by ``probe.device_profile``)."""
    import torch.distributed as dist

    from meshpilot.cluster import probe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    opts = probe.ProbeOptions()
    run = probe._Runner(opts, torch.device("cpu"))
    rec = {"h": run.collective_cpu(), "ar": {}, "ar_small": {}, "ar_curve": {}, "ar_busy": {}}
    run.allreduce(rec, lambda msg: None)
    gemms = tuple(tuple(g) for g in json.loads(Path(args.plans).read_text())) if args.plans else None
    if gemms is not None:
        dev_opts = dataclasses.replace(opts, matmul_shapes=gemms)
        rec["device"] = probe.measure_device(torch.device("cpu"), dev_opts, barrier=dist.barrier)
    every: list = [None] * world
    dist.all_gather_object(every, rec)
    if dist.get_rank() == 0:
        device = None
        if gemms is not None:
            hosts = [socket.gethostname()] * world
            device = device_spec(probe.device_profile([r["device"] for r in every], hosts, dev_opts, "local-cpu"))
            device["per_rank"] = [{k: r["device"][k] for k in PER_RANK} for r in every]
        entries = []
        allreduce, alphas, curves, busy = probe.allreduce_by_mesh(every, world, opts.nbytes)
        for shape in probe.mesh_shapes_2d(world):
            entry: dict = {"mesh": list(shape)}
            for axis in (0, 1):
                j = axis + 1
                if allreduce[shape][axis] is None:
                    continue
                entry[f"B{j}_GBps"] = allreduce[shape][axis] / 1e9
                entry[f"alpha{j}_us"] = alphas[shape][axis] * 1e6
                curve, loaded = curves[shape][axis], busy[shape][axis]
                if curve:
                    entry[f"curve{j}"] = [[b, t * 1e6] for b, t in curve]
                    if loaded:
                        entry[f"busy{j}"] = [[b, t * 1e6] for b, t in loaded]
            entries.append(entry)
        us = [r["h"] * 1e6 for r in every]
        Path(args.result).write_text(
            json.dumps(
                {"collective_overhead_us": probe._median(us), "per_rank_us": us, "calibration": entries}
                | ({"device": device} if device else {})
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def make_plans(spec: dict, args: argparse.Namespace, folder: Path) -> dict[str, dict]:
    from bench_step_time import matmul_tflops

    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.loader import cluster_from_dict
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.graph.capture import capture
    from meshpilot.planner import forced
    from meshpilot.planner.auto import plan
    from meshpilot.planner.buckets import with_buckets

    built = build(spec, "meta")
    graph = capture(built.model, built.inputs)
    n = args.nproc
    measured = getattr(args, "loopback_device", None)
    tflops = args.tflops or (
        measured["peak_tflops_fp32"] if measured else matmul_tflops() * min(1.0, (os.cpu_count() or 1) / n)
    )
    cluster = cluster_from_dict(loopback_cluster(n, tflops, args), source="bench_vs_torch")
    probed = None
    if args.probed:
        from meshpilot.cluster import load_cluster

        probed = load_cluster(str(args.probed))
    if args.emulate and not args.plan_on_probed:  # the solver sees the shaped link the launch runs under
        from meshpilot.cluster import load_cluster

        measured_device = cluster.device
        cluster = load_cluster(str(args.emulate))
        if cluster.num_devices != n:
            raise SystemExit(
                f"bench_vs_torch: --emulate {args.emulate} describes {cluster.num_devices} devices, --nproc is {n}: "
                "give a cluster file of --nproc devices (e.g. examples/clusters/emulated-2x2-slow.toml for 4)"
            )
        if measured:  # the file's links, the device as measured at launch (its rates, a call, AdamW)
            cluster = dataclasses.replace(cluster, device=measured_device)
    if args.plan_on_probed:
        if probed is None:
            raise SystemExit("bench_vs_torch: --plan-on-probed needs --probed FILE (a `meshpilot probe` cluster file)")
        cluster = probed
    out = {}
    for name, kw in (
        ("mp: DP", {"mesh_shape": (n,), "force": forced.data_parallel(built.model, built.inputs, (n,))}),
        ("mp: ZeRO-3", {"mesh_shape": (n,), "force": forced.zero3(built.model, built.inputs, (n,))}),
        ("mp: solver", {"num_devices": n}),
    ):
        if name == "mp: solver" and args.no_solver:
            continue
        t0 = time.perf_counter()
        p = plan(built.model, built.inputs, cluster, graph=graph, overlap=args.overlap, **kw)
        path = folder / (name.split()[-1] + ".json")
        p.save(path)
        cost = CostModel(LogicalMesh(cluster, tuple(p.mesh_shape)))
        out[name] = {"path": str(path), "buckets": len(p.grad_buckets)} | predictions(p, graph, probed, cost)
        if args.dtensor_params and name == "mp: DP":  # the same plan, its parameters DTensors
            out[name + DTENSOR_PARAMS] = dict(out[name], dtensor_params=True)
        if args.big_buckets and name == "mp: DP":  # DDP's bucket size instead of the alpha-beta one
            big = with_buckets(p, graph, CostModel(LogicalMesh(cluster, (n,))), size=25 * 2**20)
            big.save(path.with_name(path.stem + "-big.json"))
            out[name + ", 25 MiB buckets"] = {
                "path": str(path.with_name(path.stem + "-big.json")),
                "buckets": len(big.grad_buckets),
            } | predictions(big, graph, probed, cost)
        for us in args.host_cost_us if name == "mp: DP" else ():  # the bucket rule seeing a host cost
            spec_h = loopback_cluster(n, tflops, args)
            spec_h["device_profile"]["collective_overhead_us"] = us
            host = cluster_from_dict(spec_h, source=f"bench_vs_torch, {us:g} us a collective")
            q = with_buckets(p, graph, CostModel(LogicalMesh(host, (n,))))
            q_path = path.with_name(f"{path.stem}-host{us:g}.json")
            q.save(q_path)
            out[f"{HOST}{us:g} µs a collective"] = {"path": str(q_path), "buckets": len(q.grad_buckets)}
            out[f"{HOST}{us:g} µs a collective"] |= predictions(q, graph, probed, cost)
            print(f"  {HOST}{us:g} µs a collective: {len(q.grad_buckets)} gradient buckets", flush=True)
        if args.unbucketed and name != "mp: solver":  # the same plan without buckets: one collective a gradient
            bare = dataclasses.replace(p, grad_buckets=(), time=dataclasses.replace(p.time, hidden_s=0.0))
            bare.save(path.with_name(path.stem + "-bare.json"))
            out[name + UNBUCKETED] = {"path": str(path.with_name(path.stem + "-bare.json")), "buckets": 0}
            out[name + UNBUCKETED] |= predictions(bare, graph, probed, cost)
        if args.ungrouped and name == "mp: ZeRO-3":  # the same plan with one all-gather per parameter read
            flat = dataclasses.replace(p, param_gathers=())
            flat.save(path.with_name(path.stem + "-ungrouped.json"))
            out[name + UNGROUPED] = {
                "path": str(path.with_name(path.stem + "-ungrouped.json")),
                "buckets": len(p.grad_buckets),
            }
            out[name + UNGROUPED] |= predictions(flat, graph, probed, cost)
        got = out[name]
        print(
            f"  {name}: mesh {p.mesh_shape}, {len(p.collectives)} planned collectives, {len(p.grad_buckets)} "
            f"gradient buckets, {len(p.param_gathers)} gather groups, predicted {got['predicted_ms']:.0f} ms "
            f"({got['gathers_hidden_ms']:.0f} ms of it taken off by the gather groups and prefetch; "
            f"serial {p.time.total_s * 1e3:.0f} ms), "
            f"planned in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    return out


PARENT_ONLY = ("--json-out", "--nproc")
"""The parent's own options, not handed to the ranks: torchrun reads its arguments, the script's included, for
abbreviations of its own options, so a ``--nproc`` after the script stops it (ambiguous with ``--nproc-per-node``)."""


def worker_args(argv: list[str]) -> list[str]:
    """The command line's options the ranks get (``run_model``): `argv` less :data:`PARENT_ONLY` and their values."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in PARENT_ONLY:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in PARENT_ONLY)):
            out.append(a)
    return out


def run_model(key: str, args: argparse.Namespace, passthrough: list[str]) -> dict:
    spec = MODELS[key]
    print(f"{key}: planning …", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-vs-torch-") as tmp:
        plans = make_plans(spec, args, Path(tmp))
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
        if args.emulate:  # one torchrun agent per emulated node, each in its own network namespace
            cmd = [sys.executable, "-m", "meshpilot.cli.main", "emulate", "--cluster", str(args.emulate), "-q"]
            cmd += ["--", sys.executable]
        cmd += [str(Path(__file__).resolve()), *passthrough, "--worker", key, "--plans", json.dumps(plans)]
        cmd += ["--result", str(result)]
        proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0 or not result.is_file():
            raise SystemExit(f"the {args.nproc}-process run of {key} failed (exit {proc.returncode})")
        res = json.loads(result.read_text())
    for name, p in plans.items():
        res["variants"][name].update({k: v for k, v in p.items() if k.endswith("_ms")})
    return res


def table(key: str, res: dict) -> list[str]:
    v = res["variants"]
    med = {k: statistics.median(x["times"]) * 1e3 for k, x in v.items()}
    cpu = {k: statistics.median(x["cpu"]) * 1e3 for k, x in v.items()}
    lines = [
        f"**{key}** ({res['label']}), {res['steps']} steps after {res['warmup']} warm-up, {res['world']} gloo ranks",
        "",
        "| variant | median ms | CPU ms (busiest rank) | CPU floor ms (floor / median) | vs | ratio | predicted ms |"
        " probed: predicted / simulated ms (pred / meas) | collectives | compute / comm / host ms (one profiled"
        " step) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for k in v:
        base = BASE.get(k) or ("DDP" if k.startswith(HOST) else None)
        if k == "mp: solver":
            base = min(("DDP", "FSDP2"), key=lambda b: med[b])
        ratio = f"{med[k] / med[base]:.2f}x" if base else ""
        p = v[k].get("profile") or {}
        split = f"{p['compute_ms']:.0f} / {p['comm_ms']:.0f} / {p['other_ms']:.0f}" if p else ""
        pred = f"{v[k]['predicted_ms']:.0f}" if "predicted_ms" in v[k] else ""
        probed = ""
        if "probed_ms" in v[k]:
            pr, sim = v[k]["probed_ms"], v[k]["simulated_ms"]
            probed = f"{pr:.0f} / {sim:.0f} ({pr / med[k]:.2f} / {sim / med[k]:.2f})"
        colls = v[k]["collectives"]
        count = f"{sum(colls.values())} ({', '.join(f'{n} {c}' for c, n in sorted(colls.items()))})"
        floor = cpu_floor_ms(cpu[k], res["world"], cores)
        row = (
            f"| {k} | {med[k]:.0f} | {cpu[k]:.0f} | {floor:.0f} ({floor / med[k]:.2f}) | {base or ''} | {ratio}"
            f" | {pred} | {probed} | {count} | {split} |"
        )
        lines.append(row)
    diffs = {k: x["loss0_diff"] for k, x in v.items()}
    lines.append("")
    lines.append("|first loss - DDP's|: " + ", ".join(f"{k} {d:.1e}" for k, d in diffs.items()))
    return lines + phase_table(v)


def cpu_floor_ms(cpu_ms: float, ranks: int, cores: int) -> float:
    """The step no schedule can beat when `ranks` processes share `cores` and each needs `cpu_ms` of CPU a step
    (the busiest rank's, all its threads): ``cpu_ms`` × ranks / cores, or the rank's own CPU where every rank
    has a core. On the 2-core box every runtime's quiet median step was 1.00–1.08× this (docs/benchmarks.md,
    2026-12-05): there the step is the ranks' CPU, and overlap hides nothing."""
    return cpu_ms * max(1.0, ranks / cores)


def phase_table(v: dict) -> list[str]:
    """Each variant's median CPU and wall ms per part of the step (each the busiest rank's) and, where measured
    (``--comm-cost``), what its forward + backward cost with and without its collectives."""
    n = len(PHASES)
    lines = [
        "",
        "| variant | " + " | ".join(f"{p} CPU / wall ms" for p in PHASES) + " | fwd+bwd CPU ms: with"
        " collectives / without (collectives; CPU ms each) |",
        "|---|" + "---:|" * (n + 1),
    ]
    for k, x in v.items():
        cols = []
        for j in range(n):
            c = statistics.median(s[j] for s in x["phases"]) * 1e3
            w = statistics.median(s[n + j] for s in x["phases"]) * 1e3
            cols.append(f"{c:.0f} / {w:.0f}")
        cc = x.get("comm_cost")
        comm = ""
        if cc:
            extra = cc["with_ms"] - cc["without_ms"]
            each = f"; {extra / cc['collectives']:.2f}" if cc.get("collectives") else ""
            comm = f"{cc['with_ms']:.0f} / {cc['without_ms']:.0f} ({cc.get('collectives') or 'DDP'}{each})"
        lines.append(f"| {k} | " + " | ".join(cols) + f" | {comm} |")
    return lines + wait_table(v)


def wait_table(v: dict) -> list[str]:
    """Rank 0's wall per part of the step split by the scheduler (:class:`Schedstat`; medians over the steps, ms):
    its main thread's CPU, the main thread's wait for a core (runnable, not running), the rest of the wall (asleep:
    waiting for a collective's peers), and its other threads' CPU (gloo's)."""
    n = len(PHASES)
    if not any(d["on"] or d["threads_on"] for x in v.values() for r in x.get("own_phases") or [] for d in r):
        return []  # no schedstat on this host
    lines = [
        "",
        "Rank 0, per part: wall = main thread CPU + its wait for a core + asleep (ms; + its other threads' CPU)",
        "",
        "| variant | " + " | ".join(f"{p}: wall = CPU + wait + asleep (+ threads)" for p in PHASES) + " |",
        "|---|" + "---:|" * n,
    ]
    for k, x in v.items():
        rows = x.get("own_phases") or []
        if not rows:
            continue
        cols = []
        for j in range(n):
            d = [Mark(**r[j]) for r in rows]  # this phase's clocks' deltas, one per timed step
            wall, on, wait = (statistics.median(getattr(m, f) for m in d) * 1e3 for f in ("wall", "on", "wait"))
            asleep = statistics.median(m.wall - m.on - m.wait for m in d) * 1e3
            others = statistics.median(m.threads_on - m.on for m in d) * 1e3  # gloo's threads
            cols.append(f"{wall:.0f} = {on:.0f} + {wait:.0f} + {asleep:.0f} (+{others:.0f})")
        lines.append(f"| {k} | " + " | ".join(cols) + " |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,llama", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled split of one more step")
    ap.add_argument("--no-solver", action="store_true", help="leave the solver's own plan out (no search)")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="plan with overlap=True: every resharding collective (ZeRO-3's weight all-gathers too) issued right "
        "after its producer and waited for before its consumer (meshpilot.planner.schedule.overlapped)",
    )
    ap.add_argument(
        "--big-buckets",
        action="store_true",
        help="also run the data-parallel plan with DDP's 25 MiB buckets instead of the planner's alpha-beta size",
    )
    ap.add_argument(
        "--unbucketed",
        action="store_true",
        help="also run the data-parallel and ZeRO-3 plans without their gradient buckets (before / after)",
    )
    ap.add_argument(
        "--dtensor-params",
        action="store_true",
        help="also run the data-parallel plan with DTensor parameters (ParallelModule.plain = False), as before "
        "it kept the model's plain replicated parameters (before / after in one launch)",
    )
    ap.add_argument(
        "--ungrouped",
        action="store_true",
        help="also run the ZeRO-3 plan without its gather groups: one all-gather per parameter read (before / after)",
    )
    ap.add_argument(
        "--host-cost-us",
        type=lambda text: [float(x) for x in text.split(",") if x],
        default=[],
        metavar="H[,H...]",
        help="also run the data-parallel plan bucketed on the same cluster with collective_overhead_us = H (the "
        "host CPU per collective `meshpilot probe` measures), one variant per value",
    )
    ap.add_argument(
        "--collective-overhead-us",
        type=float,
        metavar="H",
        help="the loopback cluster's host CPU per collective, µs (collective_overhead_us: the bucket size and the "
        "step's price see it); default: measured at launch on --nproc gloo ranks with `meshpilot probe`'s "
        "measurement; 0 plans without it, as before",
    )
    ap.add_argument(
        "--nominal",
        action="store_true",
        help="plan on the nominal alpha-beta loopback cluster alone (--gbps, --latency-us, no host cost per "
        "collective unless --collective-overhead-us; a single-thread matmul rate shared by the ranks, 10 GB/s, "
        "no fixed cost per operator): no measurement at launch, as before",
    )
    ap.add_argument("--measure-loopback", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tflops", type=float, help="the solver's device FLOP/s per rank (default: measured)")
    ap.add_argument("--gbps", type=float, default=0.25, help="the solver's loopback bandwidth, GB/s")
    ap.add_argument("--latency-us", type=float, default=125.0, help="the solver's latency per ring step, µs")
    ap.add_argument(
        "--probed",
        type=Path,
        help="a cluster file `meshpilot probe` wrote on this box with --nproc ranks: every meshpilot plan is also "
        "re-priced on it and simulated (predicted / measured per variant)",
    )
    ap.add_argument(
        "--plan-on-probed",
        action="store_true",
        help="plan every meshpilot variant on the --probed cluster (its measured curves and host cost per "
        "collective choose the buckets and price the step) instead of the alpha-beta loopback cluster",
    )
    ap.add_argument(
        "--cprofile",
        type=Path,
        help="also run --steps more steps of each variant under cProfile on every rank and save the stats as "
        "DIR/<variant>-rank<r>.prof (where a step's CPU time goes, by Python function)",
    )
    ap.add_argument(
        "--comm-cost",
        action="store_true",
        help="also measure what the collectives of forward + backward cost the host: each meshpilot variant's "
        "recorded programs with their collectives replaced by local copies of the same shapes, DDP under no_sync(), "
        "--steps rounds interleaved with the real ones (results of the stubbed runs are thrown away)",
    )
    ap.add_argument(
        "--emulate",
        type=Path,
        help="launch under `meshpilot emulate --cluster FILE` (a network namespace per node, the inter-node link "
        "shaped by tc; needs root) instead of on loopback, and plan every meshpilot variant on FILE unless "
        "--plan-on-probed: e.g. examples/clusters/emulated-2x2-slow.toml with --nproc 4",
    )
    ap.add_argument("--json-out", type=Path, help="also save the results as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--plans", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.measure_loopback:
        return loopback_worker(args)
    command = "python benchmarks/bench_vs_torch.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    passthrough = worker_args(sys.argv[1:])
    all_res = {"command": command, "load": [os.getloadavg()], "models": {}}
    args.loopback_calibration = None
    args.loopback_device = None
    if not (args.nominal or args.plan_on_probed):  # under --emulate: the device's (the links are the file's)
        t0 = time.perf_counter()
        got = measure_loopback(args.nproc, loopback_gemms(args.models.split(","), args.nproc))
        if args.collective_overhead_us is None:
            args.collective_overhead_us = got["collective_overhead_us"]
        args.loopback_calibration = got["calibration"]
        all_res["loopback"] = got
        ranks = ", ".join(f"{x:.0f}" for x in got["per_rank_us"])
        print(
            f"loopback measured on {args.nproc} gloo ranks in {time.perf_counter() - t0:.1f} s: host CPU per "
            f"collective {got['collective_overhead_us']:.0f} µs (ranks {ranks}); "
            f"all-reduce {json.dumps(got['calibration'])}",
            flush=True,
        )
        if got.get("device"):
            dev = got["device"]
            args.loopback_device = {k: v for k, v in dev.items() if k != "per_rank"}
            per = dev["per_rank"]

            def ranks(key: str, scale: float, digits: int) -> str:
                return "[" + ", ".join(f"{r[key] * scale:.{digits}f}" for r in per) + "]"

            gemm = [r["tflops"] for r in dev["matmul"]]
            print(
                f"device measured in lockstep on {args.nproc} ranks (median over ranks, per rank in brackets): "
                f"float32 matmul {dev['peak_tflops_fp32']:.4f} TFLOP/s {ranks('float32', 1e-12, 4)}, "
                f"{len(gemm)} GEMMs {min(gemm, default=0):.4f}-{max(gemm, default=0):.4f} TFLOP/s, "
                f"copy {dev['memory_GBps']:.2f} GB/s {ranks('memory_bandwidth', 1e-9, 2)}, "
                f"op {dev['op_overhead_us']:.1f} µs {ranks('op_overhead', 1e6, 1)}, "
                f"foreach {dev['foreach_overhead_us']:.2f} µs a tensor {ranks('foreach_overhead', 1e6, 2)}, "
                f"call {dev['call_overhead_us']:.1f} µs {ranks('call_overhead', 1e6, 1)}, "
                f"AdamW {dev['adamw_GBps']:.3f} GB/s of parameters {ranks('adamw_bandwidth', 1e-9, 3)} "
                f"+ {dev['adamw_overhead_us']:.1f} µs a tensor",
                flush=True,
            )
    all_res["collective_overhead_us"] = args.collective_overhead_us
    for key in args.models.split(","):
        if key not in MODELS:
            raise SystemExit(f"--models: unknown model {key!r}; choose from {', '.join(MODELS)}")
        all_res["models"][key] = run_model(key, args, passthrough)
        print("\n".join(table(key, all_res["models"][key])), flush=True)
    all_res["load"].append(os.getloadavg())
    print(f"\n{command}; load average before/after: {all_res['load']}")
    if args.json_out:
        args.json_out.write_text(json.dumps(all_res, indent=1))
    return 0


# ----------------------------------------------------------------------------------------------- worker


def wrap_torch(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "DDP":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            for block in m:
                fully_shard(block)
    return fully_shard(model)


def count_collectives(fn) -> dict[str, int]:
    """The collectives one call of `fn` runs, by gloo's name for them (the torch profiler's ``gloo:*`` events:
    every process-group collective, DDP's and FSDP's and DTensor's functional ones alike; barriers left out)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    kinds: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("gloo:") and "barrier" not in e.name:
            kinds[e.name[5:]] = kinds.get(e.name[5:], 0) + 1
    dist.barrier()
    return kinds


def cprofile_steps(folder: Path, variants, step, steps: int, rank: int) -> None:
    """`steps` steps of each variant under cProfile, saved as ``folder/<variant>-rank<rank>.prof``."""
    import cProfile

    import torch.distributed as dist

    folder.mkdir(parents=True, exist_ok=True)
    for k in variants:
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        for _ in range(steps):
            step(k)
        prof.disable()
        dist.barrier()
        prof.dump_stats(folder / f"{k.replace(':', '').replace(' ', '_').replace(',', '')}-rank{rank}.prof")


_funcol = torch.ops._c10d_functional


def _no_all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return x.clone()


def _no_all_reduce_(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return x


def _no_all_gather(x: torch.Tensor, n: int, group: str) -> torch.Tensor:
    return x.repeat(n, *([1] * (x.dim() - 1))) if x.dim() else x.repeat(n)


def _no_reduce_scatter(x: torch.Tensor, op: str, n: int, group: str) -> torch.Tensor:
    return x.narrow(0, 0, x.shape[0] // n).clone()


def _no_wait(x: torch.Tensor) -> torch.Tensor:
    return x


_STUBS = {
    _funcol.all_reduce.default: _no_all_reduce,
    _funcol.all_reduce_.default: _no_all_reduce_,
    _funcol.all_gather_into_tensor.default: _no_all_gather,
    _funcol.reduce_scatter_tensor.default: _no_reduce_scatter,
    _funcol.wait_tensor.default: _no_wait,
}


def without_collectives(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """A copy of the recorded program `gm` with every functional collective replaced by a local op that makes a
    tensor of the same shape (the same allocation and copy, no communication), and how many it replaced."""
    import copy

    stub = copy.deepcopy(gm)
    n = 0
    for node in stub.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", "") != "_c10d_functional":
            continue
        if node.target not in _STUBS:
            raise SystemExit(f"--comm-cost: no local stand-in for {node.target}")
        n += node.target is not _funcol.wait_tensor.default
        node.target = _STUBS[node.target]
    stub.recompile()
    return stub, n


def comm_cost(models: dict, inputs: dict, opts: dict, variants, rounds: int) -> dict[str, dict]:
    """Forward + backward CPU seconds of each rank with the step's collectives and without them (meshpilot: the
    programs of :func:`without_collectives`; DDP: ``no_sync()``), `rounds` of each interleaved; the mean over
    ranks of each one's median. No optimizer step runs (the stubbed gradients are wrong): zero_grad after each."""
    import contextlib

    import torch.distributed as dist

    swaps: dict[str, dict[str, tuple]] = {}
    counts: dict[str, int] = {}
    for k in variants:
        program = getattr(models[k], "program", None)
        if program is None:
            continue
        swaps[k], counts[k] = {}, 0
        for name in ("forward", "backward", "grad_sync"):
            gm = getattr(program, f"{name}_gm")
            if gm is not None:
                stub, n = without_collectives(gm)
                swaps[k][f"_{name}_fn"] = (getattr(program, f"_{name}_fn"), stub)
                counts[k] += n

    def run(k: str, real: bool) -> float:
        program = getattr(models[k], "program", None)
        for attr, (orig, stub) in swaps.get(k, {}).items():
            setattr(program, attr, orig if real else stub)
        quiet = models[k].no_sync() if (k == "DDP" and not real) else contextlib.nullcontext()
        dist.barrier()
        c0 = time.process_time()
        with quiet:
            models[k](*inputs[k]).backward()
        used = time.process_time() - c0
        opts[k].zero_grad()
        for attr, (orig, _) in swaps.get(k, {}).items():
            setattr(program, attr, orig)
        return used

    measured = [k for k in variants if k in swaps or k == "DDP"]
    cpu = {(k, real): [] for k in measured for real in (True, False)}
    for _ in range(rounds):
        for k in measured:
            for real in (True, False):
                cpu[(k, real)].append(run(k, real))
    mine = {key: statistics.median(v) for key, v in cpu.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for k in measured:
        with_c = statistics.mean(e[(k, True)] for e in every)
        without = statistics.mean(e[(k, False)] for e in every)
        out[k] = {"with_ms": with_c * 1e3, "without_ms": without * 1e3, "collectives": counts.get(k)}
    return out


class Mark(NamedTuple):
    """One instant of a rank's clocks (seconds): process CPU, wall, then :meth:`Schedstat.read`'s four."""

    cpu: float
    wall: float
    on: float
    wait: float
    threads_on: float
    threads_wait: float

    def since(self, before: Mark) -> Mark:
        return Mark(*(a - b for a, b in zip(self, before, strict=True)))


class Schedstat:
    """One process's threads as Linux's scheduler counts them (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds
    on a CPU, nanoseconds runnable on a run queue but not running, time slices). :meth:`read` gives, in seconds,
    the calling (main) thread's CPU and run-queue wait, then the same summed over every thread of the process
    (gloo's worker threads: a collective's reduction and copies run there). So a phase's wall on one rank splits
    into its main thread's CPU, its wait for a core (4 ranks on 2 cores: runnable, not running) and the rest,
    where the thread sleeps (a collective's wait for its peers, a barrier). Zeros where /proc has no schedstat."""

    def __init__(self) -> None:
        self.main = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self.ok = os.path.exists(self.main)

    @staticmethod
    def _two(path: str) -> tuple[float, float]:
        try:
            with open(path) as f:
                on, wait = f.read().split()[:2]
        except (OSError, ValueError):  # a thread gone between listing and reading
            return 0.0, 0.0
        return int(on) * 1e-9, int(wait) * 1e-9

    def read(self) -> tuple[float, float, float, float]:
        if not self.ok:
            return 0.0, 0.0, 0.0, 0.0
        on, wait = self._two(self.main)
        every = [self._two(f"/proc/self/task/{t}/schedstat") for t in os.listdir("/proc/self/task")]
        return on, wait, sum(x[0] for x in every), sum(x[1] for x in every)


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from bench_step_time import profile_step

    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.spmd import ParallelModule, parallelize
    from meshpilot.runtime.train import adamw

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = MODELS[args.worker]
    plans = json.loads(args.plans)
    variants = (*TORCH, *plans)
    full = build(spec, "cpu").inputs
    rows = full[0].shape[0] // world
    mine = tuple(x[rank * rows : (rank + 1) * rows] for x in full)
    models, inputs = {}, {}
    for k in variants:
        m = build(spec, "cpu").model
        if k in plans:
            ParallelModule.plain = not plans[k].get("dtensor_params", False)
            models[k], inputs[k] = parallelize(m, Plan.load(plans[k]["path"])), full
            ParallelModule.plain = True
        else:
            models[k], inputs[k] = wrap_torch(k, m), mine
    opts = {k: adamw(m.parameters(), lr=1e-4) for k, m in models.items()}

    marks: list[Mark] = []
    threads = Schedstat()

    def mark() -> None:
        marks.append(Mark(time.process_time(), time.perf_counter(), *threads.read()))

    def step(name: str) -> float:
        marks.clear()
        mark()
        loss = models[name](*inputs[name])
        mark()
        loss.backward()
        mark()
        opts[name].step()
        opts[name].zero_grad()
        t = loss.detach().clone()
        if name in ("DDP", "FSDP2"):  # each rank's loss is its rows' mean: the batch's is their mean
            dist.all_reduce(t)
            t /= world
        mark()
        return float(t)

    times = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    phases: dict[str, list[list[float]]] = {k: [] for k in variants}
    own: dict[str, list[list[dict]]] = {k: [] for k in variants}  # per timed step: each phase's Mark delta
    losses = {k: [] for k in variants}
    for i in range(args.warmup + args.steps):
        order = variants[i % len(variants) :] + variants[: i % len(variants)]
        for name in order:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            loss = step(name)
            dist.barrier()
            dt = time.perf_counter() - t0
            deltas = [marks[j + 1].since(marks[j]) for j in range(len(PHASES))]
            split = [*(d.cpu for d in deltas), *(d.wall for d in deltas)]  # every phase's CPU, then its wall
            used = torch.tensor([time.process_time() - c0, dt, *split], dtype=torch.float64)
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(float(used[1]))
                cpu[name].append(float(used[0]))
                phases[name].append([float(x) for x in used[2:]])
                own[name].append([d._asdict() for d in deltas])
        if rank == 0 and i >= args.warmup:
            print(f"step {i}: " + ", ".join(f"{k} {times[k][-1] * 1e3:.0f} ms" for k in variants), flush=True)
    colls = {k: count_collectives(lambda k=k: step(k)) for k in variants}
    profiles = {k: None for k in variants}
    if not args.no_profile:
        for k in variants:
            profiles[k] = profile_step(lambda k=k: step(k), rank)
    if args.cprofile:
        cprofile_steps(args.cprofile, variants, step, args.steps, rank)
    comm = comm_cost(models, inputs, opts, variants, args.steps) if args.comm_cost else {}
    if rank == 0:
        out = {
            "label": build(spec, "meta").label,
            "world": world,
            "steps": args.steps,
            "warmup": args.warmup,
            "variants": {
                k: {
                    "times": times[k],
                    "cpu": cpu[k],
                    "phases": phases[k],
                    "own_phases": own[k],
                    "comm_cost": comm.get(k),
                    "collectives": colls[k],
                    "loss0_diff": abs(losses[k][0] - losses["DDP"][0]),
                    "profile": profiles[k],
                }
                for k in variants
            },
        }
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
