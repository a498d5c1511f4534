"""`meshpilot plan`: choose the mesh and every operator's sharding for a built-in model (Alpa's ILP on DTensor).

The model is built on the meta device (nothing is allocated: a 175B GPT plans on a laptop), its joint
forward + backward graph is captured on fake tensors, and the ILP picks, for every operator, the layout that
minimises the predicted step time within each device's memory, on every 2D mesh shape of the devices
(or the one given by --mesh). The output shows the chosen mesh, the predicted step time split into compute,
communication (reductions of partial sums) and resharding (gathers, all-to-alls), memory per device against
its capacity, each parameter's layout, the per-operator strategies (a stack of identical layers once) with the
collectives in front of each, the warnings and the solver's gap and time.

Examples:
  meshpilot plan --model gpt-tiny --cluster atp-ic3 --devices 4
  meshpilot plan --model atp-m2 --cluster dgx-h100:2 --devices 16 --mesh 2x8 --out plan.json
  meshpilot plan --model gpt --layers 96 --hidden 12288 --heads 96 --cluster dgx-h100:8 --dtype bfloat16
  meshpilot plan --model mlp --cluster atp-ic3 --devices 4 --json > plan.json
  meshpilot plan --model gpt-tiny --layers 4 --cluster alpa-p3x8 --devices 4 --pipeline --microbatches 4

One stage or a pipeline: without --stages, the command plans both — one stage (the per-operator plan above on
all the devices) and the stage DP's best pipeline (below) — and keeps the shorter step (the pipeline's
simulated, its sends priced), printing the other and why (meshpilot/planner/decide.py). A model whose weights,
AdamW states and whole-batch saved activations exceed the devices' memory even spread evenly is not searched
as one stage. --stages 1 (or --mesh, --force, a one-stage --schedule or --searcher) plans one stage only;
--stages N (N >= 2) or --pipeline a pipeline only. Without --microbatches the pipeline takes the fewest
(a power of two, at least 4) whose activations leave half a device free, doubled while no pipeline fits.

--pipeline plans stages (Alpa's stage DP: layers cut into stages, devices into submeshes, each stage
planned on its own logical mesh, the schedule's microbatches in flight checked against memory); --batch is
then the global batch, cut into --microbatches. It prints the stages, the predicted step with its bubble
and the schedule's actions per stage, and --out / --json save the pipeline plan with every stage's own
intra-operator plan (searched once more on the stage's logical mesh: what `meshpilot train --plan` runs).
A model built of many identical blocks is traced with 4 of them and its stages costed from one block's plan
(the printout says "repeated-block stage costs"); only --out / --json then trace the whole model.
The table is costed, by default, as --table estimated: one block planned per TP degree, every other logical
mesh priced as copies of it in closed form (a whole server's meshes searched under memory caps too), then the
chosen stages planned exactly on their own meshes: GPT-39B on alpa-p3x8 in about 50 CPU s, its final plan within
1 % of the exact table's or faster on the five Alpa GPT rows (39B: 0.984; docs/benchmarks.md). --table exact
searches the block under every memory cap level on every logical mesh (GPT-39B: about 330 CPU s); --table
approximate (or --approximate-table) costs it from each logical mesh's block plan at full memory, ZeRO-sharded
and recomputed, with memory-capped searches only for ranges none of those fits where they may beat that table's
plan: within 1 % of the exact table's or faster on the Alpa GPT rows, at 34-70 % of its CPU from GPT-2.6B up.

A layout is one placement per mesh axis: R (replicated), S(d) (tensor dim d split over the axis) or P (partial
sums): `S(0)R` is the batch split over axis 0. Run a saved plan with `meshpilot train --plan plan.json` under
torchrun, or `meshpilot.parallelize(model, meshpilot.Plan.load("plan.json"))`.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import time
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshpilot.cli.common import (
    add_cluster_arg,
    add_hf_config_arg,
    console,
    get_cluster,
    make_console,
    path_arg,
    positive_float,
    positive_int,
)
from meshpilot.cli.main import COMMANDS
from meshpilot.errors import UserError
from meshpilot.graph.capture import Precision
from meshpilot.io import fmt_size
from meshpilot.models.sources import FACTORY_PROTOCOL, Built, build_model  # noqa: F401 - re-exported
from meshpilot.planner.force import ForceSpec
from meshpilot.planner.ilp import NODE_LIMIT, TIME_LIMIT_S
from meshpilot.planner.recompute import RecomputeMode
from meshpilot.planner.schedule import PipelineKind
from meshpilot.planner.stack import TableCosting
from meshpilot.planner.zero import ZeroMode

GPT_DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = tuple(p.value for p in Precision)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help=COMMANDS["plan"],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_args(p)
    _add_search_args(p)
    _add_pipeline_args(p)
    p.add_argument("--out", "-o", type=path_arg, help="save the plan as JSON here (written atomically)")
    p.add_argument("--json", action="store_true", help="print the plan's JSON (what --out saves) instead of tables")
    p.set_defaults(func=run)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, its sizes and precision, and the cluster and devices it is planned for."""
    p.add_argument(
        "--model",
        "-m",
        required=True,
        metavar="M",
        help="a built-in model (`meshpilot presets` lists each with its size: gpt-tiny, atp-m1 … atp-m4, mlp, "
        "bert-tiny, wrn-tiny, moe-tiny, bench-transformer; HiDup's bert-sgmoe, bert-switch, vit-sgmoe, vit-switch "
        "and their -tiny versions; Alpa's Tables 6-8: gpt3-350m … gpt3-39b, gshard-moe-380m … gshard-moe-70b, "
        "wresnet-250m … wresnet-13b), 'gpt' (24 layers, h=4096, 32 heads) sized with --layers/--hidden/--heads, "
        "hf:<name> (a transformers model without weights: hf:gpt2, hf:llama, hf:bert, hf:t5, hf:mixtral or any "
        "AutoConfig model_type; sized with --hf-config) or package.module:factory (your own: " + FACTORY_PROTOCOL + ")",
    )
    add_hf_config_arg(
        p,
        "hf:<name> models: config overrides on the library default (repeatable; values read as "
        "int/float/bool/str), or a config.json; e.g. --hf-config num_hidden_layers=2 hidden_size=256",
    )
    add_cluster_arg(p)
    p.add_argument(
        "--devices", "-n", type=positive_int, help="devices the plan uses (default: --mesh's, or all of the cluster)"
    )
    p.add_argument(
        "--mesh",
        metavar="d1xd2[xd3]",
        help="fix the mesh shape, 2 or 3 axes (default: search every 2D shape)",
    )
    p.add_argument("--batch", "-b", type=positive_int, help="global batch size (default: the model's)")
    p.add_argument("--seq", "-s", type=positive_int, help="GPTs and hf:<name> models: sequence length")
    p.add_argument("--layers", type=positive_int, help="GPTs: transformer blocks")
    p.add_argument("--hidden", type=positive_int, help="GPTs: hidden size")
    p.add_argument("--heads", type=positive_int, help="GPTs: attention heads (must divide --hidden)")
    p.add_argument("--dtype", choices=GPT_DTYPES, help="GPTs: parameter and activation dtype (default float32)")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="how the run trains, stored in the plan: fp32, bf16 / fp16 (the model cast to bfloat16 / float16) or "
        "bf16-mixed (fp32 master weights, forward and backward under bfloat16 autocast); default: the "
        "parameters' dtype",
    )


def _add_search_args(p: argparse.ArgumentParser) -> None:
    """What steers the per-operator search: pinned layouts, schedule, searcher, memory, recomputation."""
    p.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="PATTERN=LAYOUT",
        help="pin the layout of parameters / inputs matching an fnmatch pattern, e.g. 'blocks.*.mlp.fc.weight=RS(0)' "
        "or 'input:*=S(0)R' (repeatable; the most specific pattern wins: an exact name, then the pattern with more "
        "literal characters; a pattern naming no parameter, buffer or input pins operator nodes by name; "
        "meshpilot.planner.force)",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES + PIPELINE_SCHEDULES,
        default=None,
        help="the step's schedule saved with the plan: trivial (F0 B0 G, default), accumulate (--microbatches, "
        "gradients reduced once), overlapped (collectives issued right after their producer), duplex (HiDup: "
        "2 microbatches interleaved stage by stage, one's collectives beside the other's compute); with "
        "--pipeline: 1f1b (default: stage s holds S-s microbatches), gpipe (all forwards, then all backwards: "
        "B in flight), interleaved-1f1b (P device groups holding 2 chunks each, split by the stage DP: a v-fold "
        "smaller bubble for v times the sends), zb-h1 (zero bubble: each backward split into input- and "
        "weight-gradient work, weight work filling 1F1B's drain; min(B, S) in flight on every stage) or auto "
        "(the shortest simulated step of them all)",
    )
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="microbatches the global batch is cut into (accumulate, overlapped; duplex: 2; default 1; "
        "--pipeline: default 4)",
    )
    p.add_argument(
        "--searcher",
        choices=SEARCHER_NAMES,
        default="ilp",
        help="what chooses each operator's strategy per mesh candidate: ilp (default; Alpa's ILP, HiGHS: the "
        "least step time with computation and communication added up), pareto (HiDup's duplex-aware Pareto DP "
        "over graph cuts, seeded by the ILP's plan: the least step when one microbatch's collectives run beside "
        "the other's compute, as --schedule duplex runs it; its duplex time is in the candidates' notes) or best "
        "(both, the faster by the plan's own accounting); recorded in the plan",
    )
    p.add_argument("--memory-gib", type=positive_float, help="device memory in GiB (default: the cluster's device)")
    p.add_argument(
        "--recompute",
        choices=[m.value for m in RecomputeMode],
        default=RecomputeMode.AUTO.value,
        help="one stage: which repeated blocks run their forward again in the backward instead of keeping their "
        "activations: auto (default: only when the plan does not fit the memory otherwise, the fastest plan that "
        "fits over the counts of regions it tries, selective ones first), none, selective (every block's norms, "
        "activations, rotary and copies run again, its matrix products and attention kept: Megatron's selective "
        "recompute) or full (every block); recorded in the plan. A pipeline: which of these each stage may choose "
        "where it pays (auto: selective or full; none: no stage recomputes)",
    )
    p.add_argument(
        "--zero",
        choices=[m.value for m in ZeroMode],
        default=ZeroMode.AUTO.value,
        help="one stage: which replicated parameters are stored sharded, their gradients reduce-scattered and "
        "their AdamW states sharded (meshpilot/planner/zero.py): auto (default: per parameter where faster or "
        "needed to fit, at stage 2 — a full copy read, the shard gathered once a step — or stage 3 — gathered at "
        "every read), off, all (every candidate at stage 3), 2 or 3 (every candidate at that stage); recorded in "
        "the plan",
    )
    p.add_argument(
        "--time-limit",
        type=positive_float,
        default=TIME_LIMIT_S,
        help=f"wall-clock safety net per HiGHS solve, s (default {TIME_LIMIT_S:.0f}); a solve stops at its gap or "
        f"{NODE_LIMIT:,} nodes, so the plan does not depend on the machine's load",
    )
    p.add_argument(
        "--ops",
        choices=("summary", "all", "none"),
        default="summary",
        help="per-operator table: 'summary' (default) shows the operators that read a parameter, multiply, "
        "produce partial sums or have a collective in front, 'all' every node, 'none' skips the table; a stack of "
        "repeated layers is shown once either way",
    )


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    """Stages: the stage DP's options, and a published configuration planned as stated (``--config``)."""
    p.add_argument(
        "--pipeline", action="store_true", help="plan a pipeline: stages on submeshes (Alpa's stage DP; see above)"
    )
    p.add_argument(
        "--stages",
        type=positive_int,
        help="--pipeline: the number of stages (interleaved-1f1b: of device groups, each holding 2 chunks; default: "
        "the search chooses)",
    )
    p.add_argument(
        "--workers",
        type=positive_int,
        help="--pipeline: processes the stage searches run in, one submesh size each at a time, and then the "
        "chosen stages' own plans, one stage each at a time (default: $MESHPILOT_PLAN_WORKERS or the usable CPUs, "
        "up to 8); the plan is the same with any number",
    )
    p.add_argument(
        "--table",
        choices=[c.value for c in TableCosting],
        default=TableCosting.ESTIMATED.value,
        help="a model of repeated blocks, how the stage table is costed (the chosen stages are then planned "
        "exactly on their own meshes whichever it is): estimated (default: one block plan per TP degree, every "
        "other mesh priced as its copies in closed form, a whole server's meshes searched under memory caps; "
        "GPT-39B on alpa-p3x8 in about 50 CPU s, its final plan within 1 %% of exact's or faster on the five Alpa "
        "GPT rows), exact (the block searched under every memory cap level on every mesh: GPT-39B about 330 "
        "CPU s), approximate (the block at full memory, ZeRO-sharded and recomputed, capped only where none of "
        "those fits: within 1 %% of exact on the Alpa GPT rows at 34-70 %% of its CPU); docs/benchmarks.md",
    )
    p.add_argument(
        "--approximate-table",
        dest="table",
        action="store_const",
        const=TableCosting.APPROXIMATE.value,
        help="the same as --table approximate",
    )
    p.add_argument(
        "--config",
        metavar="KEY=V,…",
        help="plan a published configuration as stated, searching nothing but each stage's operators: tp, pp, dp "
        "degrees, schedule (1f1b, zb-h1, interleaved-1f1b with virtual=V chunks a group), microbatches, micro_batch, "
        "recompute=none|selective|full, zero, precision, split=even|ends, sp=1|0 (Megatron's sequence parallelism, "
        "on by default where tp > 1), cp (context parallelism: the sequence on a CP axis, one sequence a replica's "
        "microbatch; ep is refused), float8=none|linears (the block linears' products priced at the device's "
        "Float8 rate with their casts; needs precision=bf16 and a cluster whose device has Float8 rates, e.g. "
        "torchtitan-h100 or llama3-h100); Llama 3's rank order, Megatron's "
        "layouts (meshpilot/planner/config_plan.py), e.g. tp=8,pp=16,dp=64,"
        "schedule=interleaved-1f1b,virtual=8,microbatches=32 (--batch, if given, must be dp x microbatches x "
        "micro_batch); a model of repeated blocks. --config auto: meshpilot searches the configuration itself "
        "(TP / PP / DP, schedule, microbatches and their size, recompute, split within --memory-gib; "
        "meshpilot/planner/config_search.py) for --batch sequences a step on --devices (default: the cluster's)",
    )


# ------------------------------------------------------------------------------------------------ model

SCHEDULES = ("trivial", "accumulate", "overlapped", "duplex")
SEARCHER_NAMES = ("ilp", "pareto", "best")
"""``--searcher``: ``meshpilot.planner.search.SEARCHERS``."""
PIPELINE_SCHEDULES = (*(k.value for k in PipelineKind), "auto")
PIPELINE_MICROBATCHES = 4


def schedule_options(schedule: str | None, microbatches: int | None) -> dict[str, Any]:
    """``meshpilot.plan`` keywords for ``--schedule`` and ``--microbatches`` (one line if they disagree)."""
    schedule = schedule or "trivial"
    if schedule in PIPELINE_SCHEDULES:
        raise UserError(f"--schedule {schedule} orders pipeline stages; add --pipeline (or give {'/'.join(SCHEDULES)})")
    if schedule == "duplex":
        if microbatches not in (None, 2):
            raise UserError(f"--schedule duplex interleaves 2 microbatches; drop --microbatches {microbatches}")
        return {"microbatches": 2, "duplex": True}
    if schedule == "trivial" and microbatches not in (None, 1):
        raise UserError(f"--microbatches {microbatches}: the trivial schedule has one; add --schedule accumulate")
    if schedule == "accumulate" and (microbatches or 1) < 2:
        raise UserError("--schedule accumulate: one microbatch is the trivial schedule; give --microbatches 2 or more")
    return {"microbatches": microbatches or 1, "overlap": schedule == "overlapped"}


MESH_AXES = (2, 3)
"""Axes a --mesh may have: the 2D shapes the search visits, or a 3-axis mesh (e.g. node x data x tensor) given."""


def parse_mesh(text: str) -> tuple[int, ...]:
    parts = text.lower().replace(",", "x").split("x")
    if len(parts) not in MESH_AXES or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise UserError(
            f"--mesh {text!r}: not a mesh shape; write two or three positive sizes as d1xd2 or d1xd2xd3, e.g. 2x4"
        )
    return tuple(int(p) for p in parts)


def parse_force(items: list[str], ndim: int = 2) -> ForceSpec | None:
    """``--force PATTERN=LAYOUT …`` read and checked (every layout, matched or not; one per axis of an
    `ndim`-axis mesh)."""
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        pattern, sep, layout = item.partition("=")
        if not sep or not pattern.strip() or not layout.strip():
            raise UserError(f"--force {item!r}: not PATTERN=LAYOUT; write e.g. 'blocks.*.mlp.fc.weight=RS(0)'")
        pattern, layout = pattern.strip(), layout.strip().replace(" ", "")
        if out.get(pattern, layout) != layout:
            raise UserError(f"--force {pattern!r}: given twice, as {out[pattern]} and {layout}; keep one")
        out[pattern] = layout
    spec = ForceSpec(out, flag="--force")
    spec.check_mesh(ndim)
    return spec


# ------------------------------------------------------------------------------------------------ run


def run(args: argparse.Namespace) -> int:
    cluster = get_cluster(args)
    if args.config:
        return run_config(args, cluster)
    shape = parse_mesh(args.mesh) if args.mesh else None
    n = args.devices or (math.prod(shape) if shape else cluster.num_devices)
    if n < 1:
        raise UserError(f"--devices {n}: give at least 1 device")
    if n > cluster.num_devices:
        given = f"--devices {n}" if args.devices else f"--mesh {args.mesh} ({n} devices)"
        raise UserError(
            f"{given}: cluster {cluster.name!r} has only {cluster.num_devices} devices; pick 1..that "
            "(or a bigger cluster, e.g. dgx-h100:NODES)"
        )
    if shape and math.prod(shape) != n:
        raise UserError(
            f"--mesh {args.mesh}: {math.prod(shape)} devices, but --devices is {n}; make them agree or give only one"
        )
    if args.time_limit <= 0:
        raise UserError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    force = parse_force(args.force, len(shape) if shape else 2)
    if args.out:
        check_out(args.out)
    memory = args.memory_gib * 2**30 if args.memory_gib is not None else None
    if memory is not None and memory <= 0:
        raise UserError(f"--memory-gib {args.memory_gib}: give a positive size")
    mode = plan_mode(args)
    if mode is PlanMode.PIPELINE and args.zero != ZeroMode.AUTO:
        raise UserError(
            f"--zero {args.zero}: a pipeline's stages choose their own ZeRO switches (stage 3 only); plan one stage "
            "(--stages 1) for it"
        )
    if mode is PlanMode.PIPELINE:
        return run_pipeline(args, cluster, n, memory)
    if mode is PlanMode.WEIGH:
        return run_weighed(args, cluster, n, memory)
    if args.stages not in (None, 1):
        raise UserError("--stages plans a pipeline; drop --mesh / --force / a one-stage --schedule or --searcher")
    if args.workers is not None:
        raise UserError("--workers runs a pipeline's stage searches; drop it (or --stages 1)")
    plan, graph, built = one_stage_plan(args, cluster, n, shape, force, memory)
    if args.json or args.out:
        _save_or_print(args, plan)
        if args.json:
            return 0
    show_one_stage(args, plan, graph, built, cluster, n)
    return 0


CONFIG_CONFLICTS = ("mesh", "force", "stages", "pipeline", "schedule", "microbatches", "devices", "searcher")


def run_config(args: argparse.Namespace, cluster: Any) -> int:
    """``meshpilot plan --config``: the configuration's plan (``planner.config_plan``), its simulated step."""
    from meshpilot.models.sources import pre_shifted_labels, unpacked_sequences
    from meshpilot.planner.config_plan import parse_config, plan_config
    from meshpilot.planner.stack import Stack, capture_stack

    if args.config.strip() == "auto":
        return run_config_search(args, cluster)
    cfg = parse_config(args.config)
    given = [f"--{k}" for k in CONFIG_CONFLICTS if getattr(args, k) not in (None, False, [], "ilp")]
    if given:
        raise UserError(f"{', '.join(given)}: --config states the plan; put its degrees and schedule in --config")
    if args.precision and args.precision != cfg.precision:
        raise UserError(f"--precision {args.precision}: --config says precision={cfg.precision}; give it once")
    if args.batch is not None and args.batch != cfg.global_batch:
        raise UserError(
            f"--batch {args.batch}: --config's step is dp x microbatches x micro_batch = {cfg.global_batch}"
        )
    if args.out:
        check_out(args.out)
    progress = make_console(stderr=True)
    built = build_model(args.model, batch=cfg.graph_batch, **_model_kw(args))
    model, inputs = built.model, tuple(built.inputs)
    if cfg.cp > 1:  # labels pre-shifted, as Megatron's loader gives them: CP's balanced order can be taken
        model, inputs = pre_shifted_labels(model, inputs)
    unpacked = unpacked_sequences()  # is_causal, no mask tensor: what eager runs on whole sequences
    with (
        progress.status(f"capturing one microbatch of {built.name} ({cfg.graph_batch} rows) on meta tensors …"),
        unpacked,
    ):
        stack = capture_stack(model, inputs, precision=cfg.precision)
    if not isinstance(stack, Stack):
        raise UserError(
            f"--config: {built.name} is not a stack of at least 5 identical blocks; plan it without --config"
        )
    with progress.status(f"planning {cfg.short()} on {cfg.devices:,} devices …"):
        cp = plan_config(model, inputs, stack, cluster, cfg)
        sim = cp.plan.simulate(cluster)
    if args.json or args.out:
        _save_or_print(args, cp.plan)
        if args.json:
            return 0
    console.print(f"{built.label}: {cfg.short()}, global batch {cfg.global_batch}", soft_wrap=True)
    console.print(str(cp.plan), soft_wrap=True, markup=False, highlight=False)
    if cp.contiguous_why:
        why = cp.contiguous_why
        console.print(f"  CP in contiguous chunks, the last rank's causal work priced: {why}", markup=False)
    console.print(
        f"simulated step {fmt_s(sim.step_s)} (Eq. 2: {fmt_s(cp.plan.step_s)}), planned in {cp.planning_s:.1f} s; "
        "the stages carry no operator plans (`meshpilot simulate` it; not `train`)",
        soft_wrap=True,
    )
    if args.out:
        console.print(f"saved the plan to [bold]{args.out}[/bold]")
    return 0


def run_config_search(args: argparse.Namespace, cluster: Any) -> int:
    """``meshpilot plan --config auto``: meshpilot's own configuration (``planner.config_search``), its
    candidates and its plan."""
    from meshpilot.planner.config_search import config_string, search_configs

    given = [f"--{k}" for k in CONFIG_CONFLICTS if k != "devices" and getattr(args, k) not in (None, False, [], "ilp")]
    if given:
        raise UserError(f"{', '.join(given)}: --config auto chooses the plan; drop them")
    if args.batch is None:
        raise UserError("--config auto: give the global batch in sequences (--batch N), what the step must train")
    if args.out:
        check_out(args.out)
    devices = args.devices or cluster.num_devices
    precision = args.precision or "bf16-mixed"
    capacity = args.memory_gib * 2**30 if args.memory_gib is not None else None

    def build(rows: int) -> tuple[Any, Any]:
        b = build_model(args.model, batch=rows, **_model_kw(args))
        return b.model, b.inputs

    with make_console(stderr=True).status(f"searching configurations of {devices:,} devices …"):
        res = search_configs(build, cluster, devices, args.batch, precision=precision, capacity=capacity)
    if args.json or args.out:
        _save_or_print(args, res.best.plan)
        if args.json:
            return 0
    t = Table(title=f"best estimates within {res.capacity / 2**30:.1f} GiB a GPU (Eq. 5 per pipeline group)")
    for col in ("configuration", "estimate", "simulated", "memory bound", "plan's memory"):
        t.add_column(col)
    for c in res.leading:
        sim = fmt_s(c.simulated_s) if c.simulated_s is not None else "—"
        pm = fmt_size(c.plan_memory_bytes) if c.plan_memory_bytes is not None else "—"
        t.add_row(c.config.short() + f" m{c.config.micro_batch} rc={c.config.recompute.value}",
                  fmt_s(c.estimate_s), sim, fmt_size(c.memory_bytes), pm)  # fmt: skip
    console.print(t)
    console.print(
        f"chose --config {config_string(res.best.config)}: simulated step {fmt_s(res.best_step_s)}; "
        f"{res.enumerated} configurations, {res.over_memory} of the leading ones over memory; searched in "
        f"{res.planning_s:.1f} s ({res.cpu_s:.1f} s CPU)",
        soft_wrap=True,
        markup=False,
    )
    if args.out:
        console.print(f"saved the plan to [bold]{args.out}[/bold]")
    return 0


class PlanMode(StrEnum):
    """What the flags ask ``meshpilot plan`` for (module docstring, *One stage or a pipeline*)."""

    ONE_STAGE = "one stage"
    """``--stages 1``, or a flag only a one-stage plan takes (``--mesh``, ``--force``, its schedules,
    ``--searcher``)."""
    PIPELINE = "pipeline"
    """``--pipeline``, ``--stages N`` (N ≥ 2) or a pipeline schedule."""
    WEIGH = "weigh"
    """Neither: both planned (``planner.decide``), the shorter step kept."""


def plan_mode(args: argparse.Namespace) -> PlanMode:
    """The :class:`PlanMode` of the command line."""
    if args.pipeline or (args.stages or 0) > 1 or args.schedule in PIPELINE_SCHEDULES:
        return PlanMode.PIPELINE
    one_only = args.mesh or args.force or args.schedule is not None or args.searcher != "ilp"
    return PlanMode.ONE_STAGE if args.stages == 1 or one_only else PlanMode.WEIGH


def one_stage_plan(args, cluster, n: int, shape, force, memory, progress: Console | None = None):
    """Today's SPMD plan of the whole batch on `n` devices: (plan, captured graph, built model)."""
    sched = schedule_options(args.schedule, args.microbatches)
    built = build_model(
        args.model, batch=args.batch, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
        dtype=args.dtype, hf_config=args.hf_config,
    )  # fmt: skip
    m = sched["microbatches"]
    whole = built.inputs[0].shape[0] if built.inputs and built.inputs[0].dim() else None
    if m > 1 and whole is not None and whole % m:
        flag = f"--microbatches {m}" if args.microbatches else f"--schedule {args.schedule} ({m} microbatches)"
        raise UserError(f"{flag}: the batch {whole} does not split into {m}; give a --batch divisible by {m}")
    # progress goes to stderr, so `--json > plan.json` stays clean
    plan, graph = make_plan(
        built, cluster, n, shape, force=force, memory_bytes=memory, time_limit=args.time_limit,
        progress=progress or make_console(stderr=True), precision=args.precision, schedule=sched,
        searcher=args.searcher, recompute=args.recompute, zero=args.zero,
    )  # fmt: skip
    return plan, graph, built


def _save_or_print(args: argparse.Namespace, plan: Any) -> None:
    """``--out`` (atomically) and ``--json`` (to stdout) of the chosen plan, one stage or a pipeline."""
    import sys

    if args.out:
        save_plan(plan, args.out)
    if args.json:
        sys.stdout.write(plan.to_json() + "\n")
        if args.out:
            make_console(stderr=True).print(f"saved the plan to {args.out}")


def show_one_stage(args, plan, graph, built, cluster, n: int) -> None:
    """The one-stage plan's tables, and how to train with a saved one."""
    render(plan, graph, built.label, n, console, ops=args.ops, cluster=cluster)
    if args.out:
        console.print(f"saved the plan to [bold]{args.out}[/bold]")
        if built.config is None or built.config.dtype == "float32":
            sizes = "".join(f" --{k} {getattr(args, k)}" for k in ("layers", "hidden", "heads") if getattr(args, k))
            if args.hf_config:
                sizes += " --hf-config " + " ".join(args.hf_config)
            console.print(
                f"train with it: torchrun --standalone --nproc-per-node {n} -m meshpilot.cli.main train "
                f"--plan {args.out} --model {args.model}{sizes}"
            )


def run_pipeline(args: argparse.Namespace, cluster: Any, n: int, memory: float | None) -> int:
    """``meshpilot plan --pipeline`` (or ``--stages N``): capture one microbatch's step, run the stage DP, print /
    save the result."""
    if args.mesh or args.force:
        raise UserError("--pipeline chooses each stage's mesh itself; drop --mesh / --force")
    schedule = args.schedule or "1f1b"
    if schedule not in PIPELINE_SCHEDULES:
        raise UserError(f"--schedule {schedule}: a pipeline runs {', '.join(PIPELINE_SCHEDULES)}; give one of those")
    progress = make_console(stderr=True)
    staged = Staged.search(args, cluster, n, memory, progress, schedule)
    return staged.finish(args, cluster, progress)


def _model_kw(args: argparse.Namespace) -> dict[str, Any]:
    kw = dict(seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads, dtype=args.dtype)
    kw["hf_config"] = args.hf_config
    return kw


@dataclass
class Staged:
    """A pipeline plan and what it was planned from: the built microbatch model, its captured graph (a
    ``planner.stack.Stack`` for a repeated stack), the global batch and the microbatches."""

    pp: Any
    graph: Any
    built: Built
    whole: int
    microbatches: int
    searched: tuple = ()
    """(cluster, devices, memory, schedule) the stage DP ran with: what :meth:`finish` searches again with twice
    the microbatches when no pipeline of these fits once its stages are planned (empty: not searched here)."""
    whole_graph: Any = None
    """The whole model's graph of :attr:`built`, when captured while the stage DP waited (:meth:`search`); None:
    :meth:`_whole_graph` captures it."""

    @classmethod
    def capture(cls, args: argparse.Namespace, whole: int, microbatches: int, progress: Console):
        """(built, graph) of one microbatch of ``whole / microbatches`` rows."""
        from meshpilot.planner.auto import check_precision
        from meshpilot.planner.stack import capture_stack

        if whole % microbatches:
            raise UserError(
                f"--batch {whole} does not split into --microbatches {microbatches}; give a batch divisible by "
                f"{microbatches}"
            )
        built = build_model(args.model, batch=whole // microbatches, **_model_kw(args))
        precision = check_precision(built.model, None, args.precision)
        with progress.status(f"capturing one microbatch's step of {built.name} on meta tensors …"):
            # a model of many identical blocks is traced with a few of them (planner.stack): its stages are costed
            # from one block's plan, and capture no longer grows with the depth
            return built, capture_stack(built.model, built.inputs, precision=precision)

    @classmethod
    def search(cls, args, cluster, n: int, memory, progress: Console, schedule: str = "1f1b", first=None) -> Staged:
        """The stage DP at ``--microbatches``, or by default at ``planner.decide.default_microbatches``, doubled
        while no pipeline fits (module docstring of ``planner.decide``, 2). `first`: (microbatches, built, graph)
        already captured."""
        from meshpilot.planner.decide import default_microbatches, model_bytes
        from meshpilot.planner.ilp import PlanError
        from meshpilot.planner.parallel import while_waiting
        from meshpilot.planner.pipeline import plan_pipeline

        if first:  # the batch the first capture split (Staged.capture checked it divides): no model built for it
            whole = first[0] * first[1].inputs[0].shape[0]
        else:
            whole = args.batch or build_model(args.model, batch=None, **_model_kw(args)).inputs[0].shape[0]
        B = args.microbatches or (PIPELINE_MICROBATCHES if whole % PIPELINE_MICROBATCHES == 0 else 1)
        built, graph = first[1:] if first else cls.capture(args, whole, B, progress)
        if args.microbatches is None:
            cap = memory or cluster.device.memory_bytes
            chosen = default_microbatches(model_bytes(graph), n, whole, cap)
            if chosen != B:
                B = chosen
                built, graph = cls.capture(args, whole, B, progress)
        while True:
            held: dict[str, Any] = {}
            try:
                with (
                    progress.status(f"planning stages on {n} devices ({B} microbatches) …"),
                    while_waiting(functools.partial(_capture_whole, args, built, graph, held)),
                ):
                    pp = plan_pipeline(
                        graph, cluster, microbatches=B, num_devices=n, num_stages=args.stages, memory_bytes=memory,
                        schedule=schedule, time_limit=args.time_limit, workers=args.workers,
                        costing=args.table, recompute=args.recompute,
                    )  # fmt: skip
                return cls(pp, graph, built, whole, B, (cluster, n, memory, schedule), held.get("graph"))
            except PlanError as e:  # only memory is helped by more microbatches
                if args.microbatches is not None or whole % (2 * B) or not str(e).startswith("no pipeline fits"):
                    raise
            B *= 2  # the default's floor was not enough: smaller microbatches hold less
            progress.print(f"no pipeline fits with {B // 2} microbatches: trying {B}")
            built, graph = cls.capture(args, whole, B, progress)

    def _whole_graph(self, args: argparse.Namespace, progress: Console) -> Any:
        """The whole model's graph of one microbatch, which each stage's own plan needs (the DP's graph is a
        few blocks of a repeated stack: ``planner.stack``)."""
        from meshpilot.graph.capture import capture
        from meshpilot.planner.auto import check_precision
        from meshpilot.planner.stack import Stack

        if not isinstance(self.graph, Stack):
            return self.graph
        if self.whole_graph is not None:  # captured while the stage DP waited (:meth:`search`)
            return self.whole_graph
        with progress.status(f"capturing all of {self.built.name} for the stages' operators …"):
            precision = check_precision(self.built.model, None, args.precision)
            return capture(self.built.model, self.built.inputs, precision=precision)

    def _planned_stages(self, args: argparse.Namespace, cluster: Any, progress: Console, retry: Any) -> Any:
        """``Plan.with_intra`` of the pipeline: each stage's own plan on the whole model's graph. Where every
        pipeline the DP offers has a stage whose own plan does not fit (its microbatches in flight counted), the
        DP is run again with twice the microbatches — smaller ones hold less — as long as the batch divides
        and ``--microbatches`` was not given; this object then holds that search's answer."""
        from meshpilot.planner.ilp import PlanError
        from meshpilot.planner.parallel import plan_workers

        while True:
            graph = self._whole_graph(args, progress)
            try:
                with progress.status(f"planning the {len(self.pp.stages)} stages' operators …"):
                    self.pp = self.pp.with_intra(
                        graph, cluster, time_limit=args.time_limit, on_retry=retry, workers=plan_workers(args.workers)
                    )
                return self.pp
            except PlanError as e:
                B = self.microbatches
                if args.microbatches is not None or self.whole % (2 * B) or not self.searched:
                    raise
                progress.print(
                    escape(f"no pipeline at {B} microbatches fits once its stages are planned ({e}): trying {2 * B}"),
                    soft_wrap=True,
                )
            _, n, memory, schedule = self.searched
            again = argparse.Namespace(**{**vars(args), "microbatches": 2 * B})
            found = Staged.search(again, cluster, n, memory, progress, schedule)
            self.pp, self.graph, self.built, self.microbatches = found.pp, found.graph, found.built, 2 * B
            self.whole_graph = found.whole_graph

    def finish(self, args: argparse.Namespace, cluster: Any, progress: Console, note: str = "") -> int:
        """Save (each stage's own intra-operator plan first: the whole model's graph) and print."""
        if args.out or args.json:  # a saved plan runs as planned: each stage with its own intra-operator plan
            ruled_out: list[str] = []

            def retry(line: str) -> None:
                ruled_out.append(line)
                progress.print(escape(line), soft_wrap=True)

            B = self.microbatches
            pp = self._planned_stages(args, cluster, progress, retry)
            if self.microbatches != B:  # the line weighing one stage against the pipeline was about B
                note += (
                    f"\nno pipeline at {B} microbatches fit once its stages were planned (above): saved the stage "
                    f"DP's best at {self.microbatches}, {len(pp.stages)} stages, simulated step "
                    f"{fmt_s(pp.simulate().step_s)}"
                )
            elif ruled_out:  # the line weighing one stage against the pipeline was about the DP's first choice
                note += (
                    f"\n{len(ruled_out)} stage(s) of that pipeline did not fit when planned on their own (above): "
                    f"saved the stage DP's next best, {len(pp.stages)} stages, simulated step "
                    f"{fmt_s(pp.simulate().step_s)}"
                )
            _save_or_print(args, pp)
            if args.json:
                return 0
        pp, built = self.pp, self.built
        B = self.microbatches
        console.print(
            f"{built.label}: global batch {self.whole} in {B} microbatches of {self.whole // B}", soft_wrap=True
        )
        console.print(str(pp), soft_wrap=True, markup=False, highlight=False)
        console.print("\n".join(pp.schedule_lines()), soft_wrap=True, markup=False, highlight=False)
        if pp.split_points:
            console.print(f"cut before: {', '.join(pp.split_points)}", soft_wrap=True, markup=False)
        if note:
            console.print(note, soft_wrap=True, markup=False, highlight=False)
        if args.out:
            console.print(f"saved the pipeline plan to [bold]{args.out}[/bold]")
        return 0


def _capture_whole(args: argparse.Namespace, built: Built, graph: Any, held: dict[str, Any]) -> None:
    """``held["graph"]``: the whole model's graph of `built` (what ``Staged._whole_graph`` captures), for a stack
    `graph` only; run by the stage DP while it waits for its cap levels' process (``parallel.while_waiting``). A
    capture that fails leaves it unset: ``Staged._whole_graph`` captures again and reports it there."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import check_precision
    from meshpilot.planner.stack import Stack

    if not isinstance(graph, Stack):
        return
    try:
        precision = check_precision(built.model, None, args.precision)
        held["graph"] = capture(built.model, built.inputs, precision=precision)
    except Exception:  # noqa: BLE001 - the same capture is made again later, where its error is reported
        held.pop("graph", None)


def run_weighed(args: argparse.Namespace, cluster: Any, n: int, memory: float | None) -> int:
    """Neither ``--stages`` nor a flag of one kind: one stage and the stage DP's best both planned, the shorter
    step kept and why printed (``planner.decide``)."""
    from meshpilot.planner.decide import Choice, model_bytes, one_stage_floor, weigh
    from meshpilot.planner.ilp import PlanError

    progress = make_console(stderr=True)
    whole = args.batch or build_model(args.model, batch=None, **_model_kw(args)).inputs[0].shape[0]
    B0 = args.microbatches or (PIPELINE_MICROBATCHES if whole % PIPELINE_MICROBATCHES == 0 else 1)
    built, graph = Staged.capture(args, whole, B0, progress)
    cap = memory or cluster.device.memory_bytes
    recomputing = args.recompute != RecomputeMode.NONE
    floor = one_stage_floor(model_bytes(graph, recompute=recomputing), n, B0)
    one = None
    if floor > cap:
        kept = "what the backward keeps with every block recomputed" if recomputing else "every saved activation"
        why_one = (
            f"one stage does not fit: with the whole batch at once each of the {n} devices holds at least "
            f"{fmt_size(floor)} (weights, AdamW states and {kept} spread evenly) against {fmt_size(cap)}"
        )
    else:
        try:
            # the whole batch at once (today's one-stage plan); --microbatches is the pipeline's
            whole_batch = argparse.Namespace(**{**vars(args), "microbatches": None})
            one = one_stage_plan(whole_batch, cluster, n, None, None, memory, progress)
            why_one = f"one stage (SPMD on all {n} devices): predicted step {fmt_s(one[0].time.overlapped_s)}"
        except PlanError as e:
            why_one = f"one stage: {e}"
    try:
        staged = Staged.search(args, cluster, n, memory, progress, first=(B0, built, graph))
        pp_s = staged.pp.simulate(cluster).step_s
        S = len(staged.pp.stages)
        layout = " ".join(
            f"[{a},{b})@{'x'.join(map(str, st.mesh_shape))}" for st in staged.pp.stages for a, b in [st.layers]
        )
        why_pp = (
            f"the pipeline of {S} stage{'s' * (S != 1)} {layout} ({staged.microbatches} microbatches): simulated "
            f"step {fmt_s(pp_s)}"
        )
    except PlanError as e:
        if one is None:
            raise PlanError(f"{why_one}; and no pipeline fits: {e}") from None
        staged, pp_s, why_pp = None, math.inf, f"a pipeline, of which none fits: {e}"
    weighed = weigh(one[0].time.overlapped_s if one else None, pp_s if staged else None, why_one, why_pp)
    if weighed.choice is Choice.PIPELINE:
        return staged.finish(args, cluster, progress, note=weighed.why)
    plan, g1, b1 = one
    if args.json or args.out:
        _save_or_print(args, plan)
        if args.json:
            return 0
    show_one_stage(args, plan, g1, b1, cluster, n)
    console.print(weighed.why, soft_wrap=True)
    return 0


def make_plan(
    built: Built,
    cluster: Any,
    n: int,
    shape: tuple[int, int] | None,
    *,
    force: dict[str, str] | None = None,
    memory_bytes: float | None = None,
    time_limit: float = TIME_LIMIT_S,
    progress: Console | None = None,
    precision: str | None = None,
    schedule: dict[str, Any] | None = None,
    searcher: str = "ilp",
    recompute: str = "auto",
    zero: str = "auto",
    graph: Any = None,
):
    """Capture then solve, with a spinner per stage on `progress`; returns (plan, captured graph). `schedule`:
    ``meshpilot.plan``'s microbatches / overlap / duplex keywords (:func:`schedule_options`); `searcher` one of
    ``meshpilot.planner.search.SEARCHERS``; `graph` an earlier call's capture of the same model, inputs,
    microbatches and precision (not captured again)."""
    from meshpilot.cluster import load_cluster
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import check_precision, microbatch_inputs, searched_shapes
    from meshpilot.planner.auto import plan as plan_fn

    schedule = schedule or {}
    progress = progress or make_console(stderr=True)
    shapes, outer = searched_shapes(load_cluster(cluster), n, shape, bool(force))
    candidates = sum(2 if sum(d > 1 for d in s) > 1 else 1 for s in shapes) + len(outer)  # the 3-axis: row only
    shapes = shapes + outer
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:  # shown after the search, one line each
        warnings.simplefilter("always")
        precision = check_precision(built.model, None, precision)
        if graph is None:
            with progress.status(f"capturing the training step of {built.name} on meta tensors …"):
                inputs = microbatch_inputs(built.inputs, schedule.get("microbatches", 1))
                graph = capture(built.model, inputs, precision=precision)
        capture_s = time.perf_counter() - t0
        what = f"mesh {shape}" if shape else f"{len(shapes)} mesh shapes"
        with progress.status(f"searching ({searcher}) on {what} ({candidates} candidate{'s' * (candidates > 1)}) …"):
            plan = plan_fn(
                built.model,
                built.inputs,
                cluster,
                num_devices=n,
                mesh_shape=shape,
                force=force,
                memory_bytes=memory_bytes,
                time_limit=time_limit,
                graph=graph,
                precision=precision,
                searcher=searcher,
                recompute=recompute,
                zero=zero,
                **schedule,
            )
    for w in caught:  # e.g. a --force pattern that matches nothing
        progress.print(f"[yellow]warning:[/yellow] {escape(str(w.message))}", soft_wrap=True)
    # the planner was handed the graph: record the capture it did not time itself
    solver = replace(plan.solver, capture_s=capture_s, total_s=plan.solver.total_s + capture_s)
    return replace(plan, solver=solver), graph


def check_out(path: Path, flag: str = "--out") -> Path:
    """The folder `path` will be written in; a UserError if it cannot be (checked before planning)."""
    from meshpilot.io import check_writable

    return check_writable(path, flag)


def save_plan(plan: Any, path: Path, flag: str = "--out") -> None:
    """Write the plan's JSON to `path` atomically (a temporary file in the same folder, then a rename)."""
    from meshpilot.io import atomic_write

    check_out(path, flag)
    atomic_write(path, plan.to_json())


# ------------------------------------------------------------------------------------------------ printing


def fmt_s(s: float) -> str:
    """Seconds in the unit that reads best: 12.3 µs, 4.56 ms, 7.89 s."""
    s = float(s)
    if s == 0:
        return "0"
    if abs(s) < 1e-3:
        return f"{s * 1e6:.3g} µs"
    if abs(s) < 1:
        return f"{s * 1e3:.4g} ms"
    return f"{s:.4g} s"


_LAYER_INDEX = re.compile(r"\.\d+\.")


def _layer_pattern(fqn: str) -> str:
    """blocks.3.mlp.fc.weight -> blocks.*.mlp.fc.weight."""
    return _LAYER_INDEX.sub(".*.", fqn)


def _short_target(target: str) -> str:
    t = target.removeprefix("aten.")
    for suffix in (".default", ".Tensor", ".int", ".Scalar", ".dim_IntList"):
        t = t.removesuffix(suffix)
    return t


def _param_read(graph: Any, node: Any) -> str:
    """The largest parameter an op reads (through up to 3 views, e.g. a Linear weight's transpose), or ''."""
    best, size = "", -1
    for src, _ in node.inputs:
        s = graph[graph.view_chain(src, max_hops=3)[-1]]
        if s.kind == "param" and s.out is not None and s.out.numel > size:
            best, size = s.fqn, s.out.numel
    return best


def _short_note(c: Any) -> str:
    """A mesh candidate's note (its PlanError when it failed), shortened for the table."""
    if c.need_bytes is not None:
        return f"does not fit: the best plan found needs {fmt_size(c.need_bytes)} per device"
    return c.note if len(c.note) < 90 else c.note[:87] + "…"


def op_sections(graph: Any) -> list[tuple[tuple[int, int] | None, list[Any]]]:
    """The op/getitem nodes in order, split into plain runs and repeated-layer stacks (each stack's first
    layer only): [(None, nodes) | ((period, count), first layer's nodes)]."""
    ops = [n for n in graph.nodes if n.kind in ("op", "getitem")]
    out: list[tuple[tuple[int, int] | None, list[Any]]] = []
    i = 0
    for start, period, count in sorted(graph.repeats):
        if start < i:
            continue
        if i < start:
            out.append((None, ops[i:start]))
        out.append(((period, count), ops[start : start + period]))
        i = start + period * count
    if i < len(ops):
        out.append((None, ops[i:]))
    return out


def render(plan: Any, graph: Any, label: str, n: int, out: Console, ops: str = "summary", cluster: Any = None) -> None:
    """The plan as rich tables (see the module docstring). `graph` is the model's capture; a plan that
    recomputes blocks is shown on the graph it was made for (``recompute.for_plan``)."""
    from meshpilot.planner.recompute import for_plan

    graph = for_plan(graph, plan)
    t, m, s = plan.time, plan.memory, plan.solver
    mesh = ", ".join(f"{a}={d}" for a, d in zip(plan.mesh_axes, plan.mesh_shape))
    contiguous = plan.mesh_axes[-1 if plan.mapping == "row" else 0]
    out.print(
        f"[bold]{label}[/bold]\non {plan.cluster}, {n} devices: [bold]DeviceMesh({mesh})[/bold], {plan.mapping} "
        f"mapping ({contiguous} on contiguous ranks), predicted step "
        f"[bold]{fmt_s(t.overlapped_s)}[/bold], {fmt_size(m.total)} per device"
    )
    if len(plan.mesh_shape) > 2:  # a 3-axis mesh: what each axis is used for (the search keeps axis 0 data-parallel)
        from meshpilot.planner.axes import axis_uses

        uses = ", ".join(f"{a} {u}" for a, u in zip(plan.mesh_axes, axis_uses(plan)))
        out.print(f"mesh axes: {uses}")
    out.print(f"[dim]training step captured on meta tensors: {graph.summary()}[/dim]")

    out.print(_candidates_table(plan))

    out.print(_time_table(plan, cluster))

    out.print(_memory_table(plan))
    if plan.recompute is not None:
        out.print(f"recompute: {plan.recompute_line()}", soft_wrap=True)

    pt = Table(title="Parameter layouts (layer indices as *)")
    pt.add_column("parameters")
    pt.add_column("count", justify="right")
    pt.add_column("layout")
    groups: dict[tuple[str, str], int] = {}
    for fqn, layout in plan.params:
        key = (_layer_pattern(fqn), "".join(layout))
        groups[key] = groups.get(key, 0) + 1
    for (pattern, layout), count in groups.items():
        pt.add_row(pattern, str(count), layout)
    out.print(pt)

    zero = getattr(plan, "zero", ())  # the ZeRO-like post-pass's switches, where the planner has one
    if zero:
        zt = Table(
            title="ZeRO post-pass: parameters sharded over their data-parallel axes (gradients reduce-scattered)"
        )
        for col in ("parameters", "count", "layout", "why", "step change", "saved / device"):
            zt.add_column(col, justify="right" if col in ("count", "step change", "saved / device") else "left")
        zg: dict[tuple[str, str, str, str], list[float]] = {}
        for z in zero:
            key = (_layer_pattern(z.param), "".join(z.before), "".join(z.after), z.reason)
            acc = zg.setdefault(key, [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += z.delta_s
            acc[2] += z.saved_bytes
        for (pattern, before, after, why), (count, dt, saved) in zg.items():
            zt.add_row(pattern, str(int(count)), f"{before} → {after}", why, f"{dt * 1e3:+.3g} ms", fmt_size(saved))
        out.print(zt)

    if ops != "none":
        out.print(op_table(plan, graph, all_nodes=ops == "all"))

    ct = Table(title="Collectives per step")
    for col in ("phase", "kind", "mesh axis", "count", "bytes", "predicted"):
        ct.add_column(col, justify="right" if col in ("count", "bytes", "predicted", "mesh axis") else "left")
    agg: dict[tuple[str, str, str], list[float]] = {}
    for c in plan.collectives:
        a = agg.setdefault((c.phase, c.kind, plan.axis_name(c.axis)), [0, 0.0, 0.0])
        a[0] += 1
        a[1] += c.nbytes
        a[2] += float(c.seconds)
    for (phase, kind, axis), (count, nbytes, sec) in sorted(agg.items()):
        ct.add_row(phase, kind, axis, str(int(count)), fmt_size(nbytes), fmt_s(sec))
    if not agg:
        ct.add_row("—", "none: every operator runs on local data", "", "", "", "")
    out.print(ct)

    for w in plan.warnings:
        out.print(f"[yellow]warning:[/yellow] {w}")
    post = getattr(s, "post_s", 0.0)
    out.print(
        f"solver: {s.searcher}, {s.status}; gap {s.gap:.2%}; {s.num_vars:,} variables, "
        f"{s.num_constraints:,} constraints, "
        f"{s.num_groups:,} decision groups; {s.total_s:.2f} s (capture {s.capture_s:.2f}, build "
        f"{s.build_s:.2f}, solve {s.solve_s:.2f}" + (f", post-pass {post:.2f}" if post else "") + ") over "
        f"{len(s.candidates)} mesh candidate(s)"
    )


_HEAVY = ("mm", "bmm", "addmm", "baddbmm", "convolution", "embedding", "_scaled_dot_product", "linear")


def _candidates_table(plan: Any) -> Table:
    """Every mesh candidate's predicted step, relative to the chosen one's."""
    s = plan.solver
    cand = Table(title="Mesh candidates (predicted step time of each one's optimal plan)")
    for col in ("", "mesh", "mapping", "step", "vs chosen", "note"):
        cand.add_column(col, justify="right" if col in ("step", "vs chosen") else "left")
    # relative to the chosen candidate's step (``s.objective_s`` is the searcher's own objective: the pareto
    # searcher's is its duplex step, not the step the candidates are ranked by)
    ref = next(
        (c.objective_s for c in s.candidates if tuple(c.shape) == tuple(plan.mesh_shape) and c.mapping == plan.mapping),
        s.objective_s,
    )
    for c in s.candidates:
        chosen = tuple(c.shape) == tuple(plan.mesh_shape) and c.mapping == plan.mapping
        step = fmt_s(c.objective_s) if c.objective_s is not None else "—"
        ratio = f"{c.objective_s / ref:.2f}x" if c.objective_s is not None and ref else "—"
        note = _short_note(c)
        cand.add_row("★" if chosen else "", str(tuple(c.shape)), c.mapping, step, ratio, note or "")
    return cand


def _time_table(plan: Any, cluster: Any) -> Table:
    """The predicted step split into parts, its overlapped step and the simulated one."""
    t = plan.time
    tt = Table(title="Predicted step time (no overlap)")
    tt.add_column("part")
    tt.add_column("time", justify="right")
    tt.add_column("share", justify="right")
    tt.add_column("what")
    total = t.total_s or 1.0
    for name, v, what in (
        ("compute", t.compute_s, "operators on the device (roofline: FLOPs and bytes; fixed cost per operator)"),
        ("communication", t.communication_s, "reductions of partial sums (all-reduce, reduce-scatter)"),
        ("resharding", t.resharding_s, "layout changes (all-gather, all-to-all)"),
        ("optimizer", t.optimizer_s, "AdamW update of this device's parameter shards (bytes / memory bandwidth)"),
    ):
        tt.add_row(name, fmt_s(v), f"{v / total:.1%}", what)
    tt.add_section()
    tt.add_row("[bold]total[/bold]", f"[bold]{fmt_s(t.total_s)}[/bold]", "100%", f"{len(plan.collectives)} collectives")
    if t.overlapped_s < t.total_s:  # the step the search ranks by: buckets behind the backward
        tt.add_row(
            "overlapped",
            fmt_s(t.overlapped_s),
            f"{t.overlapped_s / total:.1%}",
            "the gradient buckets issued during the backward, as the runtime runs them (planner/buckets.py)",
        )
    try:  # the simulated step beside the closed form (meshpilot.sim) on the cluster the plan was made for
        from meshpilot.sim import simulate

        sim = simulate(plan, cluster=cluster)
        what = f"simulated, {plan.step_schedule().name} schedule (`meshpilot simulate`)"
        if any(c.hidden_comm_s > 0 for c in sim.classes):  # HiDup Table 4's ratio, the lowest over rank classes
            what += f"; overlap ratio {min(c.overlap_ratio for c in sim.classes):.0%}"
        tt.add_row("simulated", fmt_s(sim.step_s), f"{sim.step_s / total:.1%}", what)
    except UserError:
        pass
    return tt


def _memory_table(plan: Any) -> Table:
    """Memory per device by kind, against the capacity."""
    m = plan.memory
    mt = Table(title="Memory per device")
    mt.add_column("part")
    mt.add_column("bytes", justify="right")
    mt.add_column("of capacity", justify="right")
    cap = m.capacity or 1.0
    for name, v in (
        ("parameters", m.params),
        ("gradients", m.grads),
        ("AdamW states (fp32)", m.optimizer),
        ("saved activations", m.activations),
        ("inputs", m.inputs),
    ):
        mt.add_row(name, fmt_size(v), f"{v / cap:.1%}")
    mt.add_section()
    style = "green" if m.total <= m.capacity else "red"
    mt.add_row(
        "[bold]total[/bold]", f"[{style}]{fmt_size(m.total)}[/{style}]", f"[{style}]{m.total / cap:.1%}[/{style}]"
    )
    mt.add_row("capacity", fmt_size(m.capacity), "")
    return mt


def _shown(graph: Any, node: Any, choice: Any, collectives: Counter) -> bool:
    """In the summary: operators that read a parameter, do the heavy lifting, produce partial sums or have a
    collective in front of them."""
    if node.kind != "op" or (node.is_view and not collectives):
        return False
    name = node.target.removeprefix("aten.")
    return bool(
        collectives
        or name.startswith(_HEAVY)
        or _param_read(graph, node)
        or any(o is not None and any(p.startswith("P") for p in o) for o in choice.outs)
    )


def op_table(plan: Any, graph: Any, all_nodes: bool = False) -> Table:
    """Per-operator strategies, repeated layers once, with the collectives that feed each operator."""
    into: dict[str, Counter] = {}
    for c in plan.collectives:
        into.setdefault(c.dst, Counter())[(c.kind, plan.axis_name(c.axis), c.nbytes)] += 1
    title = "Per-operator strategies: operands × … → outputs, and the collectives that reshard its operands"
    table = Table(title=title)
    for col in ("op", "reads", "strategy", "collectives in"):
        table.add_column(col, overflow="fold")
    hidden = 0
    for rep, nodes in op_sections(graph):
        if rep is not None:
            period, count = rep
            phase = Counter(n.phase for n in nodes).most_common(1)[0][0]
            table.add_section()
            table.add_row(
                "", "", f"[bold]{count} identical layers ({phase}, {period} nodes each); one shown[/bold]", ""
            )
        for node in nodes:
            coll = into.get(node.name, Counter())
            choice = plan.node(node.name)
            if not all_nodes and not _shown(graph, node, choice, coll):
                hidden += 1
                continue
            reads = _param_read(graph, node)
            if rep is not None:
                reads = _layer_pattern(reads)
            text = ", ".join(
                f"{k}@{a} {fmt_size(b)}" + (f" ×{c}" if c > 1 else "") for (k, a, b), c in sorted(coll.items())
            )
            table.add_row(node.name, reads, choice.short().split(": ", 1)[1], text)
        if rep is not None:
            table.add_section()
    if hidden:
        table.caption = (
            f"{hidden} nodes hidden: views, tuple items and element-wise ops without a collective or partial "
            "sum (--ops all shows every node)"
        )
    return table
