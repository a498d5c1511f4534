"""`meshpilot probe`: measure the live cluster it runs on and write a cluster TOML that loads back.

Run one process per device under torchrun, e.g. on one machine with 4 GPUs (or 4 CPU processes):

    torchrun --nproc-per-node 4 -m meshpilot.cli.main probe --out cluster.toml
    torchrun --nproc-per-node 4 --no-python meshpilot probe --out cluster.toml    (the same)

and on 2 machines of 8 GPUs (the same command on each, HOST being the first one):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m meshpilot.cli.main probe --out cluster.toml

It measures the device (matmul FLOP/s, memory bandwidth and capacity), point-to-point bandwidth and
latency between every pair of ranks, each rank's bandwidth to all its node's other ranks at once, the
aggregate bandwidth between nodes, and the all-reduce on each axis of every 2D mesh shape (its bandwidth,
and its time at 4 B, 64 B, 1 KiB, 16 KiB, 128 KiB, 1 MiB and the large message: the curve the cost model
prices all-reduce, all-gather and reduce-scatter from) — on gloo also while every rank computes (1 KiB to
the large message: the busy curve, with which the simulator slows collectives that overlap compute).
Rank 0 writes the hierarchy (node and device layers, from the hostnames; under `meshpilot emulate`, from
the emulated nodes), a [device_profile] with the measured numbers and a [[calibration]] entry per mesh
(B1/B2, alpha1/alpha2, curve1/curve2, busy1/busy2), then prints each mesh's measured B1/B2 next to Eq. 4's prediction
from the measured matrix. Use the file as `--cluster FILE` with any command.

`--matmul-shapes-from MODEL` (a built-in model; `--matmul-dtype bfloat16` for a GPT in bf16) also times every
GEMM of that model's training step at its own shape and writes them as [[device_profile.matmul]]: the cost
model then prices each matmul at the nearest measured shape instead of the best square one
(`docs/cost_model.md`). `--matmul-shapes FILE` does the same for any model: a JSON list of [m, n, k, dtype]
(e.g. every plan's local GEMMs, `meshpilot.planner.accounting.plan_gemms`). The probe also measures the
fixed cost of one tiny operator and of a foreach operator per tensor (`op_overhead_us`, `foreach_overhead_us`),
and the host CPU time of one collective beyond its bytes (`collective_overhead_us`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import socket
import sys
from pathlib import Path

from meshpilot.cli.common import path_arg, positive_float, positive_int
from meshpilot.cli.main import COMMANDS
from meshpilot.errors import UserError

TORCHRUN = "torchrun --nproc-per-node <devices per node> -m meshpilot.cli.main probe --out cluster.toml"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe",
        help=COMMANDS["probe"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        "-o",
        type=path_arg,
        default="cluster-probed.toml",
        metavar="PATH",
        help="where rank 0 writes the cluster TOML",
    )
    p.add_argument("--name", help="the cluster's name in the file (default: probed-<host>-<ranks>)")
    p.add_argument(
        "--backend",
        choices=["gloo", "nccl"],
        help="torch.distributed backend (default: nccl when CUDA is available, else gloo)",
    )
    p.add_argument(
        "--bytes",
        type=_size,
        metavar="SIZE",
        help="message size for P2P and all-reduce, e.g. 4MiB, 512KiB or 1048576 (default: 32MiB on GPU, 4MiB on CPU)",
    )
    p.add_argument("--repeats", type=positive_int, metavar="N", help="timed repeats per measurement; the best counts")
    p.add_argument(
        "--p2p-budget",
        type=positive_float,
        metavar="SECONDS",
        help="stop the pairwise rounds after this long and estimate the pairs left (default 120)",
    )
    p.add_argument(
        "--matmul-shapes-from",
        metavar="MODEL",
        help="also time every GEMM of this built-in model's training step at its own shape (gpt-tiny, atp-m1 … "
        "atp-m4, bert-tiny, mlp, …): the cost model then prices each matmul at the nearest measured shape",
    )
    p.add_argument(
        "--matmul-shapes",
        metavar="FILE",
        help="also time the GEMMs listed in this JSON file ([[m, n, k, dtype], ...]; any captured model's, e.g. "
        "every plan's local shards from meshpilot.planner.accounting.plan_gemms)",
    )
    p.add_argument(
        "--matmul-dtype",
        choices=("float32", "bfloat16"),
        help="GPT models: the dtype of --matmul-shapes-from's parameters and GEMMs (default: the model's)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (tests, smoke runs)")
    p.set_defaults(func=run)


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4MiB, 512KiB or 1048576")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]
    value = int(float(m.group(1)) * scale)
    if value < 4:
        raise argparse.ArgumentTypeError(f"{text!r} is below 4 bytes; give at least one float32")
    return value


def _node_identity() -> str | None:
    """This rank's node for the hierarchy: its hostname, except under `meshpilot emulate`, where every
    emulated node shares the machine's hostname and is told apart by ``MESHPILOT_EMULATE_NODE``."""
    node = os.environ.get("MESHPILOT_EMULATE_NODE")
    return None if node is None else f"{socket.gethostname()}-emulated-node{node}"


def run(args: argparse.Namespace) -> int:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise UserError(f"not launched by torchrun (no {'/'.join(missing)}); run one process per device: {TORCHRUN}")
    if args.name is not None and not args.name.strip():
        raise UserError("--name: empty; give the cluster a name (or leave --name out for probed-<host>-<ranks>)")
    if args.matmul_dtype and not args.matmul_shapes_from:
        raise UserError("--matmul-dtype: no model to cast; give the model too (--matmul-shapes-from MODEL)")
    # before the process group: a mistake in the model is one line on every rank, nothing half-started
    gemms = model_gemm_shapes(args.matmul_shapes_from, args.matmul_dtype) if args.matmul_shapes_from else ()
    if args.matmul_shapes:
        gemms = tuple(dict.fromkeys(gemms + read_gemm_shapes(args.matmul_shapes)))
    import torch
    import torch.distributed as dist

    from meshpilot.cluster.probe import ProbeOptions, build_cluster, probe, write_cluster_toml

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError("--backend nccl needs CUDA, which this torch cannot use; use --backend gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()
    out = Path(args.out)
    try:
        problem = [_check_out(out) if rank == 0 else None]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            if rank == 0:
                raise UserError(problem[0])
            return 2
        cuda = torch.cuda.is_available()
        opts = ProbeOptions.for_device(cuda, args.quick, args.bytes, args.repeats)
        if args.p2p_budget is not None:
            import dataclasses

            opts = dataclasses.replace(opts, budget_s=args.p2p_budget)
        if gemms:
            import dataclasses

            opts = dataclasses.replace(opts, matmul_shapes=gemms)
        m = probe(opts, host=_node_identity(), progress=_progress)
        if m is None:
            return 0
        name = args.name or f"probed-{m.hosts[0]}-{len(m.hosts)}"
        cluster = build_cluster(m, name=name, source=str(out))
        when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        comment = (
            f"Written by `meshpilot probe` on {when}: {len(m.hosts)} ranks on {len(set(m.hosts))} node(s), "
            f"{m.backend}, messages of {m.nbytes} bytes, best of {opts.repeats} after {opts.warmup} warm-up.\n"
            "Layers come from point-to-point and fan-out measurements; each [[calibration]] is a measured all-reduce."
        )
        if m.skipped_pairs:
            comment += f"\n{m.skipped_pairs} rank pairs were not measured (--p2p-budget); their entries are medians."
        write_cluster_toml(cluster, out, comment)
        _summary(m, cluster, out)
        return 0
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def model_gemm_shapes(model: str, dtype: str | None = None) -> tuple[tuple[int, int, int, str], ...]:
    """Every distinct GEMM (m, n, k, dtype) of a built-in model's training step (captured on meta)."""
    from meshpilot.cli.plan import build_model
    from meshpilot.graph.capture import capture
    from meshpilot.graph.gemms import graph_gemms
    from meshpilot.models import builtin_models

    entry = builtin_models().get(model)
    if model != "gpt" and entry is None:
        raise UserError(
            f"--matmul-shapes-from {model!r}: no such built-in model; choose one of {', '.join(builtin_models())}"
        )
    if dtype is not None and model != "gpt" and entry.config is None:
        raise UserError(f"--matmul-dtype {dtype}: only for GPT models; {model!r} keeps its own dtype")
    built = build_model(model, dtype=dtype, device="meta")
    graph = capture(built.model, built.inputs)
    return tuple((g.m, g.n, g.k, g.dtype) for g in graph_gemms(graph))


def read_gemm_shapes(path: str | Path) -> tuple[tuple[int, int, int, str], ...]:
    """The GEMMs ``(m, n, k, dtype)`` of a ``--matmul-shapes`` JSON file (a list of ``[m, n, k, dtype]``)."""
    import json

    from meshpilot.cluster.loader import MATMUL_DTYPES

    fix = 'write a JSON list of [m, n, k, dtype] entries, e.g. [[256, 768, 256, "float32"]]'
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"--matmul-shapes {path}: cannot be read ({e.strerror}); give an existing JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"--matmul-shapes {path}: is not JSON ({e}); {fix}") from None
    if not isinstance(data, list):
        raise UserError(f"--matmul-shapes {path}: is not a list; {fix}")
    out = []
    for i, entry in enumerate(data):
        ok = isinstance(entry, list) and len(entry) == 4 and entry[3] in MATMUL_DTYPES
        ok = ok and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in entry[:3])
        if not ok:
            raise UserError(
                f"--matmul-shapes {path}: entry {i} is {entry!r}, not [m, n, k, dtype] with positive whole m, n, k "
                f"and dtype one of {', '.join(MATMUL_DTYPES)}; {fix}"
            )
        out.append((entry[0], entry[1], entry[2], entry[3]))
    return tuple(out)


def _check_out(out: Path) -> str | None:
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        return f"--out {out}: folder {parent} does not exist; create it or write elsewhere"
    if out.is_dir():
        return f"--out {out}: is a folder; give a file path such as {out / 'cluster.toml'}"
    if not os.access(parent, os.W_OK):
        return f"--out {out}: folder {parent} is not writable; write elsewhere"
    return None


def _progress(msg: str) -> None:
    print(f"meshpilot probe: {msg}", file=sys.stderr, flush=True)


def _summary(m, cluster, out: Path) -> None:  # noqa: ANN001 - Measurements and Cluster, imported late
    import numpy as np
    from rich.table import Table

    from meshpilot.cli.common import console, fmt_gbps
    from meshpilot.cluster import GB, LogicalMesh, mesh_shapes_2d
    from meshpilot.cluster.probe import build_cluster

    d = cluster.device
    t = Table(title=f"Device {d.kind} (median of {len(m.per_rank)} ranks; min … max)")
    for col in ("measure", "value", "spread"):
        t.add_column(col, justify="right" if col != "measure" else "left")

    def spread(key: str, scale: float) -> str:
        vals = [r[key] / scale for r in m.per_rank if r.get(key)]
        return f"{min(vals):.4g} … {max(vals):.4g}" if vals else "—"

    t.add_row("fp32 matmul TFLOP/s", f"{d.flops_for('float32') / 1e12:.4g}", spread("float32", 1e12))
    if "bfloat16" in d.peak_flops:
        t.add_row("bf16 matmul TFLOP/s", f"{d.peak_flops['bfloat16'] / 1e12:.4g}", spread("bfloat16", 1e12))
    t.add_row("memory copy GB/s", f"{d.memory_bandwidth / GB:.4g}", spread("memory_bandwidth", GB))
    for j, r in enumerate(d.matmul):
        vals = [rank["matmul"][j] / 1e12 for rank in m.per_rank if rank.get("matmul")]
        rng = f"{min(vals):.4g} … {max(vals):.4g}" if vals else "—"
        t.add_row(f"GEMM {r.m}×{r.n}×{r.k} {r.dtype} TFLOP/s", f"{r.flops / 1e12:.4g}", rng)
    t.add_row("memory GiB (per rank)", f"{d.memory_bytes / 2**30:.4g}", spread("memory_bytes", 2**30))
    console.print(t)

    h = Table(title=f"Hierarchy ({m.backend}, {len(m.hosts)} ranks, probe took {m.seconds:.1f} s)")
    for col in ("layer", "ranks R", "P2P GB/s", "group GB/s", "latency µs"):
        h.add_column(col, justify="right" if col != "layer" else "left")
    for layer in cluster.layers:
        off = layer.p2p[~np.eye(layer.ranks, dtype=bool)]
        p2p = "—" if off.size == 0 else f"{off.min() / GB:.4g} … {off.max() / GB:.4g}"
        grp = f"{layer.group_bw.min() / GB:.4g} … {layer.group_bw.max() / GB:.4g}"
        h.add_row(layer.name, str(layer.ranks), p2p, grp, f"{layer.latency * 1e6:.4g}")
    console.print(h)

    matrix = build_cluster(m, name=cluster.name, calibrate=False)
    s = Table(title="All-reduce algorithm bandwidth per 2D mesh: measured vs Eq. 4 from the probed matrix")
    for col in ("DeviceMesh", "B1 measured", "B1 Eq. 4", "B2 measured", "B2 Eq. 4"):
        s.add_column(col, justify="right")
    for shape in mesh_shapes_2d(len(m.hosts)):
        measured = m.allreduce.get(shape, (None, None))
        predicted = LogicalMesh(matrix, shape)
        cells = [f"({shape[0]}, {shape[1]})"]
        for axis in (0, 1):
            cells += [
                "—" if measured[axis] is None else fmt_gbps(measured[axis]),
                fmt_gbps(predicted.algorithm_bandwidth(axis)),
            ]
        s.add_row(*cells)
    console.print(s)
    console.print(f"wrote {out} (GB/s; use it as --cluster {out})")
