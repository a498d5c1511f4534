"""Step time of `meshpilot.parallelize`'d GPT against a hand-written DTensor tensor-parallel GPT.

One torchrun launch of --nproc gloo processes (default 4) trains three copies of the same GPT
(`meshpilot.models.gpt.GPT`, same seed, same batches), interleaving their steps so they share the machine's
noise:

  hand-written  `parallelize_module` with ColwiseParallel on attn.qkv and mlp.fc and RowwiseParallel on
                attn.proj and mlp.proj of every block (Megatron-LM); the fused QKV's output features are laid
                out [heads, 3, head_dim], so a contiguous shard of them is whole heads with their q, k, v, and
                each rank runs attention on its heads/N local heads. Embeddings, LayerNorms and the lm head
                stay replicated (plain tensors, computed redundantly, as in Megatron without its vocab split).
  plan: forced  `meshpilot.plan(..., mesh_shape=(1, N), force=...)` pinning the same Megatron layouts of every
                parameter (and replicated inputs), run by `meshpilot.parallelize`.
  plan: solver  the solver's own plan for N devices (every 2D mesh shape) on a cluster describing this box
                (one node of N CPU ranks over loopback, ~2 GB/s), run by `meshpilot.parallelize`.

A step is forward + backward + AdamW step + zero_grad, timed on rank 0 between two barriers (so it is the
slowest rank's step); the table shows the median of --steps steps after --warmup steps, and the ratio to the
hand-written step. --profile adds, for one more step of each variant, the split of rank 0's step into ATen
compute, collectives and the rest (Python: graph interpretation, DTensor sharding propagation and
redistribution planning), from the torch profiler and cProfile.

    python benchmarks/bench_step_time.py                   # h=1024, 16 heads, 2 layers, s=256, b=4
    python benchmarks/bench_step_time.py --profile --doc   # + the profile; (re)write its docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADING = "## Auto-sharding step time vs hand-written DTensor TP"
FINDINGS = "### Findings"  # a hand-written subsection of ours that --doc keeps when it rewrites the numbers
VARIANTS = ("hand-written", "plan: forced", "plan: solver")


def local_cluster(n: int, tflops: float, gbps: float, latency_us: float) -> dict:
    """One node of `n` CPU ranks talking gloo over loopback: what the solver plans for.

    The defaults of --gbps / --latency-us are what a gloo all-reduce among 4 processes on this 2-core box
    measured (4 B: 0.5 ms, 256 KiB: 4.3 ms, 4 MiB: 25 ms, so about 0.25 GB/s and 125 µs a ring step);
    --tflops defaults to a single-thread float32 matmul measured at start, shared by the processes."""
    return {
        "name": f"local-cpu-{n}",
        "device_profile": {
            "kind": "local-cpu",
            "peak_tflops_fp32": tflops,
            "memory_GBps": 10.0,
            "memory_GiB": 16.0,
            "compute_efficiency": 1.0,
        },
        "layers": [{"name": "rank", "ranks": n, "p2p_GBps": gbps, "group_GBps": gbps, "latency_us": latency_us}],
    }


def matmul_tflops(n: int = 512, reps: int = 5) -> float:
    """Single-thread float32 matmul TFLOP/s (best of `reps`)."""
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best / 1e12


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def megatron_force() -> dict[str, str]:
    """Megatron-LM's layouts on a (1, N) mesh: qkv / fc column-parallel, the projections row-parallel."""
    return {
        "blocks.*.attn.qkv.weight": "RS(0)",
        "blocks.*.attn.qkv.bias": "RS(0)",
        "blocks.*.mlp.fc.weight": "RS(0)",
        "blocks.*.mlp.fc.bias": "RS(0)",
        "blocks.*.attn.proj.weight": "RS(1)",
        "blocks.*.mlp.proj.weight": "RS(1)",
        "blocks.*.attn.proj.bias": "RR",
        "blocks.*.mlp.proj.bias": "RR",
        "blocks.*.ln*": "RR",
        "wte.weight": "RR",
        "wpe.weight": "RR",
        "ln_f.*": "RR",
        "lm_head.weight": "RR",
        "input:*": "RR",
    }


def config(args: argparse.Namespace):
    from meshpilot.models.gpt import GPTConfig

    return GPTConfig(
        vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch
    )


# ----------------------------------------------------------------------------------------------- parent


def make_plans(args: argparse.Namespace, folder: Path) -> dict[str, str]:
    from meshpilot.cluster.loader import cluster_from_dict
    from meshpilot.models.gpt import GPT
    from meshpilot.planner.auto import plan

    cfg = config(args)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.empty(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
    tflops = args.tflops or matmul_tflops() * min(1.0, (os.cpu_count() or 1) / args.nproc)
    cluster = cluster_from_dict(local_cluster(args.nproc, tflops, args.gbps, args.latency_us), source="bench_step_time")
    print(
        f"planning for {args.nproc} CPU ranks: {tflops * 1e3:.1f} GFLOP/s each, {args.gbps} GB/s, {args.latency_us} µs",
        flush=True,
    )
    args.tflops = tflops
    paths = {}
    for name, kw in (
        ("plan: forced", {"mesh_shape": (1, args.nproc), "force": megatron_force()}),
        ("plan: solver", {"num_devices": args.nproc}),
    ):
        t0 = time.perf_counter()
        p = plan(model, (idx, idx), cluster, **kw)
        path = folder / (name.split()[-1] + ".json")
        p.save(path)
        paths[name] = str(path)
        print(
            f"{name}: mesh {p.mesh_shape}, {len(p.collectives)} collectives, predicted {p.time.total_s * 1e3:.1f} ms, "
            f"planned in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    return paths


def interpretation_overhead(args: argparse.Namespace, steps: int = 6) -> dict:
    """CPU time of the same model's step (forward + backward) in one process: eager autograd against
    `parallelize` running a 1-device plan (mesh (1, 1): every op through the joint-graph interpreter and
    DTensor's dispatcher, no collective). What the interpretation itself costs, free of communication."""
    import torch.distributed as dist

    from meshpilot.cluster.loader import cluster_from_dict
    from meshpilot.models.gpt import GPT
    from meshpilot.planner.auto import plan
    from meshpilot.runtime.spmd import parallelize
    from meshpilot.runtime.train import batches, reference_model

    torch.set_num_threads(1)
    cfg = config(args)
    with tempfile.TemporaryDirectory(prefix="bench-step-store-") as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            with torch.device("meta"):
                meta = GPT(cfg)
            idx = torch.empty(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
            cluster = cluster_from_dict(local_cluster(1, 0.05, 1.0, 1.0), source="bench_step_time")
            p = plan(meta, (idx, idx), cluster, mesh_shape=(1, 1))
            models = {"eager": reference_model(cfg, 0), "parallelize": parallelize(reference_model(cfg, 0), p)}
            data = batches(cfg, steps + 1, seed=0)
            cpu: dict[str, list[float]] = {k: [] for k in models}
            for i in range(steps + 1):
                for name, model in models.items():
                    c0 = time.process_time()
                    loss = model(*data[i])
                    loss.backward()
                    for q in model.parameters():
                        q.grad = None
                    if i:  # the first is warm-up
                        cpu[name].append(time.process_time() - c0)
            nodes = sum(n.kind == "op" for n in models["parallelize"].graph.nodes)
        finally:
            dist.destroy_process_group()
    e, q = statistics.median(cpu["eager"]), statistics.median(cpu["parallelize"])
    return {"eager_ms": e * 1e3, "parallelize_ms": q * 1e3, "ratio": q / e, "ops": nodes, "steps": steps}


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model or platform.processor(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=4, help="processes = tensor-parallel degree (default 4)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    ap.add_argument("--tflops", type=float, help="the solver's device FLOP/s per rank (default: measured)")
    ap.add_argument("--gbps", type=float, default=0.25, help="the solver's loopback bandwidth, GB/s (default 0.25)")
    ap.add_argument("--latency-us", type=float, default=125.0, help="the solver's latency per step, µs (default 125)")
    ap.add_argument("--profile", action="store_true", help="split one more step of each variant by where it goes")
    ap.add_argument("--doc", action="store_true", help=f"write the results under '{HEADING}' in {DOC.name}")
    ap.add_argument("--json-out", type=Path, help="also save the results (and the command, machine) as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plans", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    command = "python benchmarks/bench_step_time.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    load0 = os.getloadavg()
    overhead = None
    if args.profile:
        print("interpretation overhead: eager vs a 1-device plan in one process …", flush=True)
        overhead = interpretation_overhead(args)
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp:
        plans = make_plans(args, Path(tmp))
        result = Path(tmp) / "result.json"
        passthrough = [a for a in sys.argv[1:] if a != "--doc"]
        if "--json-out" in passthrough:  # the parent's option
            j = passthrough.index("--json-out")
            del passthrough[j : j + 2]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc}",
            str(Path(__file__).resolve()),
            *passthrough,
            "--worker",
            "--plans",
            json.dumps(plans),
            "--result",
            str(result),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env)
        if proc.returncode != 0:
            print(f"the {args.nproc}-process run failed (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
        res = json.loads(result.read_text())
    res["wall_s"] = time.perf_counter() - t0
    res["overhead"] = overhead
    res["load"] = [load0, os.getloadavg()]
    res["machine"] = machine()
    res["command"] = command
    res["args"] = {
        k: getattr(args, k)
        for k in ("hidden", "heads", "layers", "seq", "batch", "vocab", "nproc", "tflops", "gbps", "latency_us")
    }
    show(res)
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=1))
    if args.doc:
        write_doc(res)
    return 0


def _summary(res: dict) -> list[dict]:
    base = statistics.median(res["variants"]["hand-written"]["times"])
    base_cpu = statistics.median(res["variants"]["hand-written"]["cpu"])
    rows = []
    for name in VARIANTS:
        v = res["variants"][name]
        med = statistics.median(v["times"])
        q = statistics.quantiles(v["times"], n=4) if len(v["times"]) > 1 else [med, med, med]
        rows.append(
            {
                "name": name,
                "mesh": v["mesh"],
                "median_ms": med * 1e3,
                "q1_ms": q[0] * 1e3,
                "q3_ms": q[2] * 1e3,
                "ratio": med / base,
                "paired": statistics.median(
                    [a / b for a, b in zip(v["times"], res["variants"]["hand-written"]["times"])]
                ),
                "cpu_ms": statistics.median(v["cpu"]) * 1e3,
                "cpu_ratio": statistics.median(v["cpu"]) / base_cpu,
                "collectives": v["collectives"],
                "loss_diff": v["loss_diff"],
                "profile": v.get("profile"),
            }
        )
    return rows


COLUMNS = (
    "variant",
    "mesh",
    "median step",
    "quartiles",
    "vs hand-written",
    "paired ratio",
    "CPU / step",
    "CPU vs hand-written",
    "collectives / step",
    "collective bytes / step",
    "max |Δloss|",
)


def _cells(r: dict) -> list[str]:
    c = r["collectives"]
    planned = f" (planned {c['planned']})" if c["planned"] is not None else ""
    return [
        r["name"],
        str(tuple(r["mesh"])),
        f"{r['median_ms']:.0f} ms",
        f"{r['q1_ms']:.0f} – {r['q3_ms']:.0f} ms",
        f"{r['ratio']:.3f}×",
        f"{r['paired']:.3f}×",
        f"{r['cpu_ms']:.0f} ms",
        f"{r['cpu_ratio']:.3f}×",
        f"{c['count']}{planned}",
        f"{c['bytes'] / 2**20:.0f} MiB",
        f"{r['loss_diff']:.1e}",
    ]


def show(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    a = res["args"]
    t = Table(
        title=f"GPT L={a['layers']} h={a['hidden']} heads={a['heads']} s={a['seq']} b={a['batch']} vocab={a['vocab']}, "
        f"{a['nproc']} gloo processes, {res['steps']} steps after {res['warmup']} warm-up"
    )
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("variant", "mesh") else "right")
    for r in _summary(res):
        t.add_row(*_cells(r))
    c = Console(width=max(Console().width, 160))
    c.print(t)
    for r in _summary(res):
        c.print(f"{r['name']}: {_kinds(r)}" + (f"; {_profile_text(r['profile'])}" if r["profile"] else ""))
    if res.get("overhead"):
        c.print(_overhead_text(res["overhead"]))
    m = res["machine"]
    c.print(
        f"[dim]{m['cpus']} CPUs ({m['cpu_model']}), torch {m['torch']}, load average {res['load'][0][0]:.1f} → "
        f"{res['load'][1][0]:.1f}, {res['wall_s']:.0f} s[/dim]"
    )


def _overhead_text(o: dict) -> str:
    return (
        f"interpretation overhead (one process, forward + backward, CPU time, median of {o['steps']}): eager "
        f"{o['eager_ms']:.0f} ms, parallelize on a 1-device plan ({o['ops']} ops) {o['parallelize_ms']:.0f} ms: "
        f"{o['ratio']:.3f}×"
    )


def _kinds(r: dict) -> str:
    kinds = r["collectives"]["kinds"]
    return "collectives " + (", ".join(f"{k} ×{v}" for k, v in sorted(kinds.items())) or "none")


def _profile_text(p: dict) -> str:
    return (
        f"step {p['step_ms']:.0f} ms = ATen compute {p['compute_ms']:.0f} + collectives {p['comm_ms']:.0f} + "
        f"other {p['other_ms']:.0f} ms; {p['aten_calls']} ATen calls, {p['collectives']} c10d collectives; "
        f"cProfile (cumulative): {p['cprofile']}"
    )


def write_doc(res: dict) -> None:
    a, m = res["args"], res["machine"]
    rows = _summary(res)
    lines = [
        HEADING,
        "",
        f"`{res['command']}` — one `torchrun --standalone --nproc-per-node {a['nproc']}` launch, gloo, "
        f"`OMP_NUM_THREADS=1`; GPT (`meshpilot.models.gpt.GPT`) L={a['layers']}, h={a['hidden']}, {a['heads']} heads, "
        f"s={a['seq']}, b={a['batch']}, vocab {a['vocab']}, float32, AdamW. The three variants run the same model "
        f"(same seed, same batches), their steps interleaved; median of {res['steps']} steps after {res['warmup']} "
        "warm-up steps, timed on rank 0 between barriers.",
        "",
        f"Machine: {m['cpus']} CPU cores ({m['cpu_model']}), shared with other jobs (load average "
        f"{res['load'][0][0]:.1f} at the start, {res['load'][1][0]:.1f} at the end), {a['nproc']} processes on them; "
        f"torch {m['torch']}, Python {m['python']}, {m['os']}.",
        "",
        "| " + " | ".join(c.replace("|", "\\|") for c in COLUMNS) + " |",
        "|" + " --- |" * len(COLUMNS),
    ]
    for r in rows:
        lines.append("| " + " | ".join(_cells(r)) + " |")
    lines += [
        "",
        "hand-written: `parallelize_module` with `ColwiseParallel` (attn.qkv, mlp.fc) and `RowwiseParallel` "
        f"(attn.proj, mlp.proj), local heads; plan: forced: `meshpilot.plan(..., mesh_shape=(1, {a['nproc']}), "
        "force=...)` "
        "with the same parameter layouts, run by `meshpilot.parallelize`; plan: solver: the solver's own plan for "
        f"{a['nproc']} devices (every 2D mesh) on a one-node CPU cluster describing this box ({a['tflops'] * 1e3:.1f} "
        f"GFLOP/s per rank, {a['gbps']} GB/s, {a['latency_us']:g} µs per collective step). Paired ratio: median "
        "over steps of the step's time over the hand-written step of the same round (adjacent in time, so they "
        "share the machine's load). CPU / step: CPU seconds the busiest rank's process used in the step (all its "
        "threads), median; less sensitive than the wall time to the machine's other jobs. Collectives: one step's, "
        "as DTensor issued them (meshpilot's `record_collectives`; bytes: all-gather output, reduce-scatter input, "
        "all-reduce buffer; gloo has no all-to-all, so DTensor all-gathers instead), and what the plan predicted. "
        "Δloss: against the hand-written model's loss, every step.",
    ]
    lines += [
        "",
        "Collectives of one step, and where a step goes (rank 0, one more step each, torch profiler + "
        "cProfile, with --profile):",
        "",
    ]
    lines += [
        f"- {r['name']}: {_kinds(r)}" + (f"; {_profile_text(r['profile'])}" if r["profile"] else "") for r in rows
    ]
    if res.get("overhead"):
        lines += [f"- {_overhead_text(res['overhead'])}"]
    wrapped = []
    for line in lines:  # prose wrapped like the rest of docs/, tables and headings as they are
        if line.startswith(("|", "#")) or len(line) <= 110:
            wrapped.append(line)
        else:
            indent = "  " if line.startswith("- ") else ""
            wrapped.append(
                textwrap.fill(line, 110, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
            )
    section = "\n".join(wrapped) + "\n"
    # Read right before writing, and replace only this section: other sections are other people's.
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    start = text.find(HEADING + "\n")
    if start >= 0:
        nxt = text.find("\n## ", start + len(HEADING))
        old = text[start : nxt + 1 if nxt >= 0 else len(text)]
        keep = old.find("\n" + FINDINGS)  # hand-written analysis under the section: kept
        if keep >= 0:
            section += old[keep:].rstrip("\n") + "\n"
        text = text[:start] + section + ("\n" + text[nxt + 1 :] if nxt >= 0 else "")
        text = text.rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + "\n\n" + section
    tmp = DOC.with_name(f".{DOC.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, DOC)
    print(f"wrote the section '{HEADING}' of {DOC}")


# ----------------------------------------------------------------------------------------------- worker


def _local_heads_forward(self, x: torch.Tensor) -> torch.Tensor:
    """CausalSelfAttention.forward on this rank's heads (qkv column-parallel: [b, t, 3h/N] local output)."""
    import torch.nn.functional as F

    b, t, _ = x.shape
    qkv = self.qkv(x).view(b, t, self.heads, 3, self.head_dim)
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def hand_written_tp(model, mesh):
    """Megatron-LM tensor parallelism with DTensor's parallel styles (module docstring)."""
    import types

    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n = mesh.size()
    for blk in model.blocks:
        parallelize_module(
            blk,
            mesh,
            {
                "attn.qkv": ColwiseParallel(),
                "attn.proj": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            },
        )
        assert blk.attn.heads % n == 0, f"{blk.attn.heads} heads do not split over {n} ranks"
        blk.attn.heads //= n
        blk.attn.forward = types.MethodType(_local_heads_forward, blk.attn)
    return model


def worker(args: argparse.Namespace) -> int:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.spmd import parallelize
    from meshpilot.runtime.train import batches, reference_model

    warnings.filterwarnings("ignore", message="Full backward hook")  # the parallel styles' hooks, harmless
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config(args)
    plans = {k: Plan.load(v) for k, v in json.loads(args.plans).items()}
    mesh = init_device_mesh("cpu", (world,))
    models = {
        "hand-written": hand_written_tp(reference_model(cfg, 0), mesh),
        "plan: forced": parallelize(reference_model(cfg, 0), plans["plan: forced"]),
        "plan: solver": parallelize(reference_model(cfg, 0), plans["plan: solver"]),
    }
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    data = batches(cfg, args.warmup + args.steps + 2, seed=0)

    def step(name: str, i: int) -> float:
        idx, tgt = data[i]
        loss = models[name](idx, tgt)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad()
        return float(loss.detach())

    times = {k: [] for k in VARIANTS}
    cpu = {k: [] for k in VARIANTS}
    losses = {k: [] for k in VARIANTS}
    for i in range(args.warmup + args.steps):
        order = VARIANTS[i % 3 :] + VARIANTS[: i % 3]  # rotate, so no variant always runs first
        for name in order:
            dist.barrier()
            c0 = time.process_time()
            t0 = time.perf_counter()
            loss = step(name, i)
            dist.barrier()
            dt = time.perf_counter() - t0
            # CPU seconds this rank's process used in the step (all its threads): less sensitive than the
            # wall time to other jobs on the machine; the busiest rank's is kept
            used = torch.tensor([time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(used, op=dist.ReduceOp.MAX)
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(dt)
                cpu[name].append(float(used))
        if rank == 0:
            what = ", ".join(f"{k} {times[k][-1] * 1e3:.0f} ms" for k in VARIANTS) if i >= args.warmup else "warm-up"
            print(f"step {i}: {what}", flush=True)

    # collectives of one step, counted where DTensor issues them (functional collectives: kind, bytes)
    from meshpilot.runtime.collective_log import record_collectives

    i = args.warmup + args.steps
    collectives = {}
    for name in VARIANTS:
        with record_collectives(mesh if name == "hand-written" else models[name].mesh) as log:
            step(name, i)
        kinds = {}
        for entry in log:
            kinds[str(entry.kind)] = kinds.get(str(entry.kind), 0) + 1
        collectives[name] = {
            "count": len(log),
            "bytes": sum(entry.nbytes for entry in log),
            "kinds": kinds,
            "planned": len(plans[name].collectives) if name in plans else None,
        }
    profiles = {}
    if args.profile:
        for name in VARIANTS:
            profiles[name] = profile_step(lambda name=name: step(name, i + 1), rank)
    if rank == 0:
        out = {
            "steps": args.steps,
            "warmup": args.warmup,
            "variants": {
                k: {
                    "times": times[k],
                    "cpu": cpu[k],
                    "mesh": list(plans[k].mesh_shape) if k in plans else [world],
                    "collectives": collectives[k],
                    "loss_diff": max(abs(a - b) for a, b in zip(losses[k], losses["hand-written"])),
                    "profile": profiles.get(k),
                }
                for k in VARIANTS
            },
        }
        Path(args.result).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def profile_step(fn, rank: int) -> dict:
    """One step split (torch profiler, self CPU times) into ATen compute, collectives (launch + wait) and the
    rest (Python: graph interpretation, DTensor dispatch and redistribution planning, autograd); then the same
    step under cProfile for the Python side: cumulative seconds in a few functions of ours and DTensor's."""
    import cProfile
    import io
    import pstats

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        step_s = time.perf_counter() - t0
    compute = comm = 0.0
    aten_calls = colls = 0
    for e in prof.key_averages():
        key = e.key
        if key.startswith(("c10d::", "gloo:", "_c10d_functional::", "record_param_comms")):
            comm += e.self_cpu_time_total
            if key.startswith("c10d::") and "barrier" not in key:
                colls += e.count
        elif key.startswith("aten::"):
            compute += e.self_cpu_time_total
            aten_calls += e.count
    # the barrier that ends the step waits for the slowest rank: count it as collective time
    dist.barrier()
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    dist.barrier()
    st = pstats.Stats(pr, stream=io.StringIO())
    if rank == 0 and os.environ.get("BENCH_PSTATS"):
        with open(os.environ["BENCH_PSTATS"], "a") as f:
            f.write(f"\n===== step {step_s * 1e3:.0f} ms\n")
            pstats.Stats(pr, stream=f).sort_stats("cumulative").print_stats(45)
    cum: dict[str, float] = {}
    for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in st.stats.items():
        for tag, where, name in (
            ("collective waits", "", "wait_tensor"),
            ("redistribute_local_tensor", "_redistribute.py", "redistribute_local_tensor"),
            ("meshpilot ParallelModule._call", "spmd.py", "_call"),
            ("pytree maps", "_pytree.py", "tree_map_only"),
        ):
            if where in file and func == name:
                cum[tag] = cum.get(tag, 0.0) + ct
    text = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in cum.items()) or "-"
    return {
        "step_ms": step_s * 1e3,
        "compute_ms": compute / 1e3,
        "comm_ms": comm / 1e3,
        "other_ms": max(step_s * 1e3 - compute / 1e3 - comm / 1e3, 0.0),
        "aten_calls": aten_calls,
        "collectives": colls,
        "cprofile": text,
    }


if __name__ == "__main__":
    sys.exit(main())
