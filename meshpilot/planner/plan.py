"""The plan: an immutable, JSON-serialisable record of how to run one training step.

:class:`Plan` is the one plan type: its **stages** (:class:`PlanStage`: layers, physical ranks, logical mesh and
the stage's :class:`StagePlan`), the pipeline **schedule** (a ``PipelineKind``; a one-stage plan's step schedule
is its stage plan's), the **microbatches** and the **transfers** between stages (:class:`StageTransfer`, bytes
per microbatch both ways). SPMD is one stage (:meth:`Plan.single`, what ``meshpilot.plan`` returns); the stage
DP (``planner.pipeline.plan_pipeline``) makes pipelines. ``Plan.save(path)`` / ``Plan.load(path)`` round-trip
through the one JSON format (``planner.plan_format``: a format name and a version; older files load);
``Plan.simulate`` times it and ``meshpilot.parallelize(model, plan)`` runs it.

A :class:`StagePlan` is how one stage runs on its mesh: the mesh (shape, axis names and the physical rank of every
coordinate), every node's chosen strategy (layouts of its operands and outputs, printable as
``linear_3: S(0)R × RS(1) → S(0)S(1)``), each parameter's layout, the collectives the run will issue (kind,
mesh axis, bytes, forward or backward), the predicted step time split into compute / communication (reductions
of partial sums) / resharding (all-gathers, all-to-alls), memory per device, the parameters the ZeRO-like
post-pass sharded (``zero``; their layouts in ``params`` are the sharded ones and ``collectives`` holds their
reduce-scatters and all-gathers; a stage-2 switch's node keeps the layout its readers read, and its once-a-step
all-gather is the collective into ``gather:<fqn>``), the solver's report and warnings. ``str(stage_plan)`` is
the readable form: the summary (mesh, step-time split, memory, collectives, ZeRO, solver gap and time, mesh candidates,
warnings), every parameter's layout, then one line per operator with the collectives that feed it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshpilot.cluster.mesh import default_axis_names
from meshpilot.errors import UserError
from meshpilot.planner.buckets import GradBucket
from meshpilot.planner.prefetch import GatherGroup, active_gathers, grouped_edges
from meshpilot.planner.schedule import DUPLEX, ActionKind, PipelineKind, Schedule, pipeline, trivial
from meshpilot.sharding.placements import Placements, from_json
from meshpilot.sharding.reshard import CollectiveKind, as_issued

if TYPE_CHECKING:
    import numpy as np

    from meshpilot.graph.capture import OpGraph
    from meshpilot.planner.pipeline import Clustering
    from meshpilot.planner.stack import StageCosting
    from meshpilot.planner.stage import Layer, StageCost

Layout = tuple[str, ...]
"""A tensor layout in JSON form: one placement string per mesh axis (``("S(0)", "R")``)."""


def _fmt(layout: Layout | None) -> str:
    return "-" if layout is None else "".join(layout)


@dataclass(frozen=True)
class NodeChoice:
    """The strategy chosen for one node of the captured graph."""

    name: str
    target: str
    kind: str
    ins: tuple[Layout, ...]
    outs: tuple[Layout | None, ...]
    source: str
    phase: str
    seconds: float = 0.0
    """Predicted compute time of this node's shard of the work (the roofline of the cost model)."""

    def short(self) -> str:
        """``mm_3: S(0)R × RS(1) → S(0)S(1)``."""
        lhs = " × ".join(_fmt(p) for p in self.ins) if self.ins else "∅"
        return f"{self.name}: {lhs} → {', '.join(_fmt(p) for p in self.outs)}"

    def in_placements(self, a: int) -> Placements:
        return from_json(self.ins[a])  # type: ignore[return-value]

    def out_placements(self, i: int) -> Placements | None:
        return from_json(self.outs[i])


@dataclass(frozen=True)
class PlannedCollective:
    """One collective the run issues: where, what, how big."""

    kind: str
    """``all_reduce``, ``reduce_scatter``, ``all_gather`` or ``all_to_all`` (a ``CollectiveKind`` value)."""
    axis: int
    """Index of the mesh axis it runs over (its name: ``Plan.mesh_axes[axis]``)."""
    nbytes: int
    """The convention of ``CollectiveKind`` (all-gather output, reduce-scatter input, ...)."""
    phase: str
    """``fwd``, ``bwd`` (including the gradients' final resharding)."""
    src: str
    dst: str
    seconds: float
    operand: int = -1
    """Which operand of ``dst`` it reshards (-1: a collective the op issues itself, or a loss / gradient /
    buffer edge)."""

    @property
    def issued_by_op(self) -> bool:
        """True for a collective the op issues itself (``Strategy.colls``: src = dst, no operand), False for
        a resharding DTensor issues between ops."""
        return self.src == self.dst and self.operand == -1


@dataclass(frozen=True)
class Fallback:
    """A node no sharding strategy covers: it runs on full replicas of its operands."""

    node: str
    target: str
    where: str
    """Module path and source line of the model code that made it (``layers.0.attn (model.py:42)``)."""
    reason: str

    def line(self) -> str:
        return f"{self.node} = {self.target} in {self.where}: replicated ({self.reason})"


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step (no overlap assumed)."""

    compute_s: float
    """Operators of the forward and backward, every microbatch (roofline + fixed cost per operator)."""
    communication_s: float
    resharding_s: float
    optimizer_s: float = 0.0
    """The AdamW update of this device's parameter shards, once a step (``accounting.optimizer_seconds``);
    0 in plans written before it was modelled."""
    hidden_s: float = 0.0
    """Of ``communication_s``, the gradient synchronisation the plan's buckets hide behind the backward (and
    the latencies they save): ``planner.buckets.bucket_overlap``; 0 without buckets."""

    @property
    def total_s(self) -> float:
        """The serial step: every collective exposed (what the ILP's linear objective prices)."""
        return self.compute_s + self.communication_s + self.resharding_s + self.optimizer_s

    @property
    def overlapped_s(self) -> float:
        """The predicted step, the gradient buckets priced as the runtime runs them (in the backward or at
        ``G``): :attr:`total_s` less :attr:`hidden_s`. What the mesh search compares, ``Plan.step_s`` of a
        one-stage plan, and what the simulator gives for a plan whose backward has no collective of its own."""
        return self.total_s - self.hidden_s


@dataclass(frozen=True)
class MemoryUse:
    """Predicted bytes per device at the step's peak, split into what is live there
    (``meshpilot.planner.accounting`` computes it; the parts add up to :attr:`total`)."""

    params: float
    grads: float
    """Gradients live at the peak (all of them when the peak is the optimizer step)."""
    optimizer: float
    """AdamW's ``exp_avg`` and ``exp_avg_sq``, in the parameters' dtype."""
    activations: float
    """Values the backward reads that are live at the peak."""
    inputs: float
    capacity: float
    temporaries: float = 0.0
    """Everything else live at the peak: logits, the loss' upcast and gradient, redistributed copies, the
    optimizer update's temporary. 0 in plans written before the liveness accounting."""
    row: float = 0.0
    """The ILP's linear memory bound for this plan (the larger of its two rows; ``ilp`` docstring)."""
    peak_at: str = ""
    """The node at which the peak occurs, or ``optimizer step``."""

    @property
    def total(self) -> float:
        """The predicted peak (plans written before the liveness accounting: their summed estimate)."""
        return self.params + self.grads + self.optimizer + self.activations + self.inputs + self.temporaries


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh shape and device mapping the search tried."""

    shape: tuple[int, ...]
    mapping: str
    objective_s: float | None
    note: str = ""
    need_bytes: float | None = None
    """When no plan fits on this mesh: the smallest per-device memory one was found to need."""


@dataclass(frozen=True)
class SolverReport:
    status: str
    objective_s: float
    gap: float
    """HiGHS' relative MIP gap at the end (0 = proven optimal)."""
    num_vars: int
    num_constraints: int
    num_groups: int
    capture_s: float
    build_s: float
    solve_s: float
    total_s: float
    candidates: tuple[MeshCandidate, ...] = ()
    post_s: float = 0.0
    """Seconds in the ZeRO post-pass (over all candidates)."""
    memory_row: str = "plain"
    """The ILP's memory row: ``plain``, or ``zero`` (what the plan needs once the post-pass shards updates)."""
    ilps_solved: int = 1
    """HiGHS runs over all mesh candidates (a candidate may be solved on both memory rows)."""
    searcher: str = "ilp"
    """Which searcher chose the strategies (``meshpilot.planner.search.SEARCHERS``)."""


def _zero_stage(value: Any) -> Any:
    """A saved switch's ``stage`` as a :class:`ZeroStage`; anything else as saved, for ``validate`` to name."""
    try:
        return ZeroStage(value)
    except (TypeError, ValueError):
        return value


def _recompute_of(d: dict[str, Any] | None) -> RecomputeChoice | None:
    """The :class:`RecomputeChoice` of a saved stage plan's ``recompute`` (None: absent, as in older files)."""
    if not d:
        return None
    return RecomputeChoice(**{**d, "regions": tuple(d["regions"])})


@dataclass(frozen=True)
class RecomputeChoice:
    """The blocks a plan recomputes in the backward and why (``meshpilot.planner.recompute``)."""

    mode: str
    """``auto`` (chosen because the plan did not fit otherwise) or ``full`` (asked for)."""
    regions: tuple[str, ...]
    """The recomputed blocks' module paths (``model.layers.3``), in the order they were chosen, then the values
    gathered again in the backward (``regather:<node>``: sequence parallelism's norm outputs)."""
    reason: str
    memory_before: float
    """Predicted peak bytes per device without recomputation (0 when not planned: ``full``)."""
    memory_after: float
    """Predicted peak bytes per device of this plan."""
    extra_s: float
    """Seconds a step spends recomputing: the copies' compute and the collectives they issue."""


@dataclass(frozen=True)
class SequenceOrder:
    """The order a plan lays the sequence out in on one mesh axis (``meshpilot.planner.sequence_order``):
    ``zigzag`` — the sequence cut into ``2P`` chunks, rank ``r`` of the axis's ``P`` holding chunks ``r`` and
    ``2P − 1 − r`` (``ops.ring.zigzag``), so causal attention, by the ring or by query rows
    (``ops.causal_rows``), gives every rank the same work. The step runs
    on the permuted sequence: the inputs below permuted along their sequence dim before they are sharded, the
    position-valued factories (``arange``) below permuted as they are made; everything else is unchanged."""

    axis: int
    """The mesh axis the ring runs on."""
    peers: int
    """Its size ``P``."""
    order: str
    """``zigzag``."""
    length: int
    """The sequence length ``t`` (divisible by ``2P``)."""
    inputs: tuple[tuple[int, int], ...]
    """(example input, its sequence dim) of every input permuted."""
    factories: tuple[tuple[str, int], ...]
    """(node, its sequence dim) of every factory output permuted (position ids, ``cache_position``)."""
    causal: int = 0
    """How many ``is_causal`` calls (forward and backward; rings or by query rows) it balances."""

    def line(self, mesh_axes: tuple[str, ...]) -> str:
        """The plan printout's line."""
        axis = mesh_axes[self.axis] if self.axis < len(mesh_axes) else f"axis{self.axis}"
        return (
            f"{self.order} over axis {axis}: {self.length} tokens in chunks of {self.length // (2 * self.peers)}"
            f" (rank r holds chunks r and 2P-1-r), {len(self.inputs)} input(s) and {len(self.factories)} "
            f"position factory(ies) permuted, {self.causal} causal call(s) balanced"
        )


def _sequence_order_of(d: dict[str, Any] | None) -> SequenceOrder | None:
    """The :class:`SequenceOrder` of a saved stage plan (None: absent, as in older files: contiguous)."""
    if not d:
        return None
    return SequenceOrder(
        int(d["axis"]),
        int(d["peers"]),
        d["order"],
        int(d["length"]),
        tuple((int(i), int(dim)) for i, dim in d["inputs"]),
        tuple((str(n), int(dim)) for n, dim in d["factories"]),
        int(d.get("causal", 0)),
    )


ONCE_A_STEP = ("grad:", "gather:")
"""Prefixes of the ``dst`` of collectives a step issues once, not per microbatch: a gradient's synchronisation
and a ZeRO-2 weight's all-gather from its updated shard (:class:`ZeroStage`)."""


class ZeroStage(IntEnum):
    """Where a ZeRO-switched parameter's weight is all-gathered (``meshpilot.planner.zero`` docstring). Both
    reduce-scatter the gradient into the shard the optimizer updates; stage 1 is not told apart from 2: the
    backward accumulates every microbatch's gradient locally and synchronises it once a step either way."""

    GATHER_ONCE = 2
    """ZeRO-2: a full copy in the layout the readers read, all-gathered from the updated shard once a step."""
    GATHER_AT_USE = 3
    """ZeRO-3: only the shard is stored; each reader all-gathers it, every microbatch."""


@dataclass(frozen=True)
class ZeroSwitch:
    """One parameter the ZeRO-like post-pass moved from replicated to sharded on some mesh axes: its gradient
    is reduce-scattered instead of all-reduced, AdamW updates the shard, and the weight is all-gathered where
    it is read (stage 3) or once a step into a full copy the readers read (stage 2): ``meshpilot.planner.zero``
    docstring."""

    param: str
    axes: tuple[int, ...]
    before: Layout
    after: Layout
    reason: str
    """``cheaper`` (faster, or as fast and smaller), ``memory`` (needed to fit) or ``all`` (``zero="all"``)."""
    delta_s: float
    """Change of the predicted step time (seconds; negative = faster)."""
    saved_bytes: float
    """Bytes per device saved (weights, gradients and AdamW states, less any gathered copy kept)."""
    stage: ZeroStage = ZeroStage.GATHER_AT_USE
    """Where the weight is gathered; plans saved before stages existed load as 3 (what they ran)."""

    @property
    def gathered_once(self) -> bool:
        return self.stage == ZeroStage.GATHER_ONCE


@dataclass(frozen=True)
class StagePlan:
    """How one stage runs one training step on its mesh: every operator's strategy (see the module docstring).
    A one-stage :class:`Plan` holds one; a pipeline's stages hold one each."""

    cluster: str
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    """Physical rank of every mesh coordinate, row-major."""
    mapping: str
    nodes: tuple[NodeChoice, ...]
    params: tuple[tuple[str, Layout], ...]
    """(parameter name, layout it is stored and updated in)."""
    inputs: tuple[Layout, ...]
    input_shapes: tuple[tuple[tuple[int, ...], str], ...]
    time: StepTime
    memory: MemoryUse
    collectives: tuple[PlannedCollective, ...]
    warnings: tuple[str, ...]
    solver: SolverReport
    fingerprint: str
    version: int = 1
    zero: tuple[ZeroSwitch, ...] = ()
    """Parameters the ZeRO-like post-pass sharded (their layouts in ``params`` are already the new ones)."""
    fallbacks: tuple[Fallback, ...] = ()
    """Nodes with no strategy but the replicated one, each with where the model made it."""
    schedule: Schedule | None = None
    """The step's actions per rank (``meshpilot.planner.schedule``); None: the trivial ``F0 B0 G``."""
    precision: str = ""
    """``fp32``, ``bf16`` or ``bf16-mixed`` (``meshpilot.graph.capture.Precision``: autocast over fp32
    parameters); empty in older plans."""
    mesh_axes: tuple[str, ...] = ()
    """One name per mesh axis, the runtime's ``mesh_dim_names``: the cluster layer the axis crosses
    (``LogicalMesh.axis_names``, e.g. ``("node", "gpu")``). Plans saved before axes had names, and plans built
    without them, get positional names (``axis0``, ``axis1``: ``cluster.mesh.default_axis_names``)."""
    step_flops: float = 0.0
    """FLOPs of one training step of the whole model (every device's share, every microbatch): the captured
    graph's operator FLOPs; 0 in older plans. ``meshpilot train`` divides it by the step time for MFU."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device of the planned cluster at the plan's compute dtype (bfloat16 for the bf16
    precisions, else float32): MFU's denominator, per device; 0 in older plans."""
    grad_buckets: tuple[GradBucket, ...] = ()
    """Gradients synchronised together, each bucket one collective issued during the backward as soon as its
    last gradient exists (``planner.buckets``); empty in older plans: one collective per gradient after it."""
    param_gathers: tuple[GatherGroup, ...] = ()
    """Sharded parameters' gathers run one flat all-gather a layer, issued one layer ahead
    (``planner.prefetch``); empty in older plans and where the schedule does not run them: one all-gather per
    edge."""
    recompute: RecomputeChoice | None = None
    """The blocks whose forward the backward runs again (their nodes' copies are in :attr:`nodes`, named
    ``<node>_recomputed``); None: none (and in older plans)."""
    sequence_order: SequenceOrder | None = None
    """The sequence's order on the ring's axis (:class:`SequenceOrder`: zig-zag); None: contiguous (every plan
    without a causal ring, and older plans)."""
    guards: tuple[tuple[str, tuple[float, ...]], ...] = ()
    """The values the model's Python read from tensors while capturing (``OpGraph.guards``: where, and the
    values the example inputs gave), in order: the runtime's capture takes the same branches, and a
    ``meshpilot::guard`` node checks each on every batch; empty when the model reads none."""
    _index: dict = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {n.name: n for n in self.nodes})
        if not self.mesh_axes:
            object.__setattr__(self, "mesh_axes", default_axis_names(len(self.mesh_shape)))

    # ---------------------------------------------------------------- access
    def node(self, name: str) -> NodeChoice:
        return self._index[name]

    def step_schedule(self) -> Schedule:
        """The plan's schedule, or the trivial one (``F0 B0 G`` on every rank)."""
        if self.schedule is not None:
            return self.schedule
        n = 1
        for d in self.mesh_shape:
            n *= d
        return trivial(n)

    def run_digest(self) -> str:
        """SHA-256 of what running the plan depends on — mesh, rank order, every node's strategy, the parameter
        and input layouts, the schedule — and not of how it was found (solver times, predictions): two plans
        with one digest run identically."""
        import hashlib

        return hashlib.sha256(json.dumps(list(self.run_view().values())).encode()).hexdigest()

    def run_view(self) -> dict[str, Any]:
        """What :meth:`run_digest` hashes, by key (the JSON form's mesh, rank order, nodes, layouts, schedule)."""
        d = self.to_dict()
        keys = ("mesh_shape", "mesh_ranks", "nodes", "params", "inputs", "schedule")
        keys += ("sequence_order",) if "sequence_order" in d else ()
        return {k: d[k] for k in keys}

    def recompute_line(self) -> str:
        """Which blocks recompute their forward in the backward, why, and what it costs and saves."""
        r = self.recompute
        if r is None:
            return "none: every activation the backward reads is kept from the forward"
        from meshpilot.io import fmt_size

        blocks = [x for x in r.regions if not x.startswith("regather:")]
        shown = ", ".join(blocks[:4]) + (f" … ({len(blocks)} blocks)" if len(blocks) > 4 else "")
        if len(blocks) < len(r.regions):  # sequence parallelism's gathers (``planner.recompute``)
            shown += f"{'; ' if blocks else ''}{len(r.regions) - len(blocks)} gathered values gathered again"
        before = f"{fmt_size(r.memory_before)} → " if r.memory_before else ""
        return (
            f"{shown} ({r.mode}: {r.reason}); memory {before}{fmt_size(r.memory_after)} per device, "
            f"step +{r.extra_s * 1e3:.3f} ms recomputing"
        )

    def param_layout(self, fqn: str) -> Placements:
        for name, layout in self.params:
            if name == fqn:
                return from_json(layout)  # type: ignore[return-value]
        raise KeyError(fqn)

    def axis_name(self, axis: int) -> str:
        """The name of mesh axis `axis` (:attr:`mesh_axes`)."""
        return self.mesh_axes[axis]

    def collective_counts(self, phase: str | None = None, backend: str = "nccl") -> Counter:
        """Counter of (kind, axis name, nbytes) over the collectives one step issues, optionally of one phase:
        each microbatch's once per microbatch of the schedule, the gradients' (``grad:``) and the ZeRO-2 weights'
        (``gather:``) once. The keys are
        those of ``CollectiveLog.counts()`` (``meshpilot.runtime.collective_log``), which records a run.

        With ``backend="gloo"`` an all-to-all is counted as DTensor issues it on CPU process groups
        (which lack all-to-all): an all-gather of the shards, ``n`` times the bytes each rank holds. An op's own
        all-to-all (``src == dst``: expert parallelism's dispatch and combine, :mod:`meshpilot.ops.moe`) is
        issued as ``all_to_all_single``, which gloo carries, and stays an all-to-all.
        """
        per_step = self.step_schedule().microbatches
        out: Counter = Counter()
        bucketed = {f"grad:{p}" for b in self.grad_buckets for p in b.params}
        for b in self.grad_buckets if phase in (None, "bwd") else ():
            out[(CollectiveKind(b.kind), self.axis_name(b.axis), b.nbytes)] += 1
        for g in active_gathers(self):
            if phase in (None, g.phase.value):
                out[(CollectiveKind.ALL_GATHER, self.axis_name(g.axis), g.nbytes)] += per_step
        grouped = grouped_edges(self)
        for c in self.collectives:
            if (phase is not None and c.phase != phase) or c.dst in bucketed:
                continue
            if (c.phase, c.dst, c.operand) in grouped:
                continue
            times = 1 if c.dst.startswith(ONCE_A_STEP) else per_step
            on_gloo = backend == "gloo" and not c.issued_by_op
            kind, nbytes = as_issued(c.kind, c.nbytes, self.mesh_shape[c.axis], on_gloo)
            out[(CollectiveKind(kind), self.axis_name(c.axis), nbytes)] += times
        return out

    # ---------------------------------------------------------------- printing
    def strategy_lines(self, ops_only: bool = True) -> list[str]:
        keep = ("op",) if ops_only else ("op", "getitem", "param", "buffer", "input")
        return [n.short() for n in self.nodes if n.kind in keep]

    def summary(self) -> str:
        """The plan in a few lines: mesh, step-time split, memory, collectives, ZeRO, solver, warnings."""
        t, m, sv = self.time, self.memory, self.solver
        gib, ms = 2**30, 1e3
        tot = t.total_s or 1.0
        n = 1
        for d in self.mesh_shape:
            n *= d
        contiguous = {"row": self.mesh_axes[-1], "col": self.mesh_axes[0]}.get(self.mapping, self.mapping)
        by_kind = Counter(c.kind for c in self.collectives)
        by_phase = Counter(c.phase for c in self.collectives)
        kinds = ", ".join(f"{k} ×{v}" for k, v in sorted(by_kind.items())) or "none"
        status = re.search(r"HiGHS Status \d+: ([^)]*)", sv.status)
        lines = [
            f"Plan on {self.cluster}: mesh {self.mesh_shape} over axes ({', '.join(self.mesh_axes)}) ({n} devices; "
            f"{contiguous} on contiguous ranks, "
            f"{self.mapping} mapping)" + (f", {self.precision}" if self.precision else ""),
            f"  step time    {t.total_s * ms:.3f} ms = compute {t.compute_s * ms:.3f} ({t.compute_s / tot:.0%})"
            f" + communication {t.communication_s * ms:.3f} ({t.communication_s / tot:.0%})"
            f" + resharding {t.resharding_s * ms:.3f} ({t.resharding_s / tot:.0%})"
            f" + optimizer {t.optimizer_s * ms:.3f} ({t.optimizer_s / tot:.0%})",
            f"  memory       {m.total / gib:.3f} GiB per device of {m.capacity / gib:.1f} GiB"
            f" ({m.total / m.capacity if m.capacity else 0:.0%}): params {m.params / gib:.3f},"
            f" grads {m.grads / gib:.3f}, AdamW {m.optimizer / gib:.3f},"
            f" activations {m.activations / gib:.3f}, temporaries {m.temporaries / gib:.3f},"
            f" inputs {m.inputs / gib:.3f}" + (f"; peak at {m.peak_at}" if m.peak_at else ""),
            f"  collectives  {len(self.collectives)} per step (fwd {by_phase.get('fwd', 0)},"
            f" bwd {by_phase.get('bwd', 0)}): {kinds}",
        ]
        if self.grad_buckets:
            size = sum(b.nbytes for b in self.grad_buckets)
            lines.append(
                f"  buckets      {sum(len(b.params) for b in self.grad_buckets)} gradients in "
                f"{len(self.grad_buckets)} buckets ({_bytes(size)}), issued during the backward: "
                f"{t.hidden_s * ms:.3f} ms hidden, step {t.overlapped_s * ms:.3f} ms"
            )
        gathers = active_gathers(self)
        if gathers:
            edges = sum(len(g.edges) for g in gathers)
            lines.append(
                f"  ZeRO-3 gathers: {len(gathers)} groups ({edges} parameter gathers, "
                f"{_bytes(sum(g.nbytes for g in gathers))}), one flat all-gather each, prefetched one layer ahead"
            )
        if self.recompute is not None:
            lines.append("  recompute    " + self.recompute_line())
        from meshpilot.ops.attention import context_line

        cp = context_line(self.nodes, self.mesh_axes, self.mesh_shape, self.collectives)
        if cp is not None:
            lines.append("  context      " + cp)
        if self.sequence_order is not None:
            lines.append("  sequence     " + self.sequence_order.line(self.mesh_axes))
        if self.zero:
            reasons = Counter(f"{z.reason}/stage {int(z.stage)}" for z in self.zero)
            saved = sum(z.saved_bytes for z in self.zero)
            dt = sum(z.delta_s for z in self.zero)
            lines.append(
                f"  ZeRO         {len(self.zero)} parameters sharded on the axes their gradients were all-reduced over "
                f"(reduce-scatter + all-gather instead of all-reduce; "
                + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
                + f"): saves {saved / gib:.3f} GiB per device, step {dt * ms:+.3f} ms"
            )
        lines += [
            f"  solver       HiGHS {status.group(1) if status else sv.status}; gap {sv.gap:.2%}; {sv.num_vars} vars,"
            f" {sv.num_constraints} constraints, {sv.num_groups} groups; memory row {sv.memory_row}",
            f"  planning     {sv.total_s:.2f} s = capture {sv.capture_s:.2f} + build {sv.build_s:.2f}"
            f" + solve {sv.solve_s:.2f} + post-pass {sv.post_s:.2f} (+ other)",
        ]
        if len(sv.candidates) > 1:
            ok = sorted((c for c in sv.candidates if c.objective_s is not None), key=lambda c: c.objective_s)
            skipped = sum(c.note.startswith("skipped") for c in sv.candidates)
            shown = ", ".join(f"{c.shape} {c.mapping} {c.objective_s * ms:.1f} ms" for c in ok[:4])
            lines.append(
                f"  candidates   {len(sv.candidates)} meshes: {len(ok)} solved ({sv.ilps_solved} ILPs),"
                f" {skipped} skipped by the compute lower bound,"
                f" {len(sv.candidates) - len(ok) - skipped} do not fit; best {shown}" + (" …" if len(ok) > 4 else "")
            )
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        """Summary, parameter layouts, then one line per operator with the collectives feeding it."""
        into: dict[str, list[str]] = {}
        for c in self.collectives:
            label = f"{_SHORT.get(c.kind, c.kind)}@{self.axis_name(c.axis)} {_bytes(c.nbytes)}"
            into.setdefault(c.dst, []).append(label)
        switched = {z.param: z for z in self.zero}
        out = [self.summary(), "parameters (stored layout):"]
        for fqn, layout in self.params:
            z = switched.get(fqn)
            extra = f"   ZeRO: was {_fmt(z.before)} ({z.reason}, stage {int(z.stage)})" if z else ""
            grad = into.get(f"grad:{fqn}")
            extra += f"   grad ← {', '.join(grad)}" if grad else ""
            out.append(f"  {fqn}: {_fmt(layout)}{extra}")
        for phase, title in (("fwd", "forward"), ("bwd", "backward")):
            lines = [n for n in self.nodes if n.kind == "op" and n.phase == phase]
            if not lines:
                continue
            out.append(f"{title} ({len(lines)} ops):")
            for n in lines:
                feed = into.get(n.name)
                out.append("  " + n.short() + (f"   ← {', '.join(feed)}" if feed else ""))
        loss = into.get("loss")
        if loss:
            out.append(f"loss ← {', '.join(loss)}")
        return "\n".join(out)

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        if d["sequence_order"] is None:  # contiguous: files as before the field
            del d["sequence_order"]
        out = json.loads(json.dumps(d, default=_default))
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> StagePlan:
        """The stage plan `d` (``to_dict``'s form); a one-line UserError naming `source` and the key when it is
        not one."""
        from meshpilot.planner.validate import check_version

        where = f"{source}: " if source else ""
        fix = "give a plan saved by `meshpilot plan --out FILE` or Plan.save"
        if not isinstance(d, dict):
            raise UserError(f"{where}not a meshpilot plan (the JSON is a {type(d).__name__}, not an object); {fix}")
        missing = [k for k in ("mesh_shape", "mesh_ranks", "nodes", "params", "solver", "fingerprint") if k not in d]
        if missing:
            raise UserError(f"{where}{missing[0]}: missing, so this is not a meshpilot plan; {fix}")
        check_version(d.get("version", 1), where)
        try:
            return cls._from_dict(d)
        except KeyError as e:
            raise UserError(f"{where}{e.args[0]}: missing from the plan (hand-edited or damaged?); {fix}") from None
        except (TypeError, ValueError, IndexError, AttributeError) as e:
            raise UserError(f"{where}malformed plan ({type(e).__name__}: {e}); {fix}") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> StagePlan:
        def tup(x):
            return tuple(tup(v) for v in x) if isinstance(x, list) else x

        solver = d["solver"]
        return cls(
            cluster=d["cluster"],
            mesh_shape=tuple(d["mesh_shape"]),
            mesh_ranks=tuple(d["mesh_ranks"]),
            mapping=d["mapping"],
            nodes=tuple(
                NodeChoice(
                    n["name"],
                    n["target"],
                    n["kind"],
                    tup(n["ins"]),
                    tup(n["outs"]),
                    n["source"],
                    n["phase"],
                    n.get("seconds", 0.0),
                )
                for n in d["nodes"]
            ),
            params=tuple((p[0], tup(p[1])) for p in d["params"]),
            inputs=tup(d["inputs"]),
            input_shapes=tuple((tuple(s), dt) for s, dt in d["input_shapes"]),
            time=StepTime(**d["time"]),
            memory=MemoryUse(**d["memory"]),
            collectives=tuple(PlannedCollective(**c) for c in d["collectives"]),
            warnings=tuple(d["warnings"]),
            solver=SolverReport(
                **{k: v for k, v in solver.items() if k != "candidates"},
                candidates=tuple(
                    MeshCandidate(tuple(c["shape"]), c["mapping"], c["objective_s"], c["note"], c.get("need_bytes"))
                    for c in solver["candidates"]
                ),
            ),
            fingerprint=d["fingerprint"],
            version=d.get("version", 1),
            precision=d.get("precision", ""),
            mesh_axes=tuple(d.get("mesh_axes", ())),
            step_flops=float(d.get("step_flops", 0.0)),
            peak_flops=float(d.get("peak_flops", 0.0)),
            zero=tuple(
                ZeroSwitch(
                    z["param"],
                    tuple(z["axes"]),
                    tup(z["before"]),
                    tup(z["after"]),
                    z["reason"],
                    z["delta_s"],
                    z["saved_bytes"],
                    _zero_stage(z.get("stage", ZeroStage.GATHER_AT_USE)),
                )
                for z in d.get("zero", ())
            ),
            fallbacks=tuple(Fallback(**f) for f in d.get("fallbacks", ())),
            schedule=Schedule.from_dict(d["schedule"]) if d.get("schedule") else None,
            grad_buckets=tuple(
                GradBucket(tuple(b["params"]), CollectiveKind(b["kind"]), b["axis"], b["nbytes"], b.get("seconds", 0.0))
                for b in d.get("grad_buckets", ())
            ),
            param_gathers=tuple(GatherGroup.from_dict(g) for g in d.get("param_gathers", ())),
            recompute=_recompute_of(d.get("recompute")),
            sequence_order=_sequence_order_of(d.get("sequence_order")),
            guards=tuple((str(w), tuple(float(v) for v in vals)) for w, vals in d.get("guards", ())),
        )

    def to_json(self) -> str:
        """This stage plan as a one-stage :class:`Plan`'s JSON: the one plan format (``Plan.to_json``)."""
        return Plan.single(self).to_json()

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> StagePlan:
        """The stage plan of a saved one-stage plan (``Plan.from_json(...).only``; a pipeline: one line)."""
        return Plan.from_json(text, source=source).only

    def save(self, path: str | Path) -> None:
        """Save as a one-stage :class:`Plan` (``Plan.save``)."""
        Plan.single(self).save(path)

    @classmethod
    def load(cls, path: str | Path) -> StagePlan:
        """The stage plan of a saved one-stage plan (``Plan.load(path).only``)."""
        return Plan.load(path).only


_SHORT = {
    CollectiveKind.ALL_REDUCE: "AR",
    CollectiveKind.REDUCE_SCATTER: "RS",
    CollectiveKind.ALL_GATHER: "AG",
    CollectiveKind.ALL_TO_ALL: "A2A",
}


def received_rows_pins(graph: OpGraph, sub: OpGraph, force: dict[str, str]) -> dict[str, str]:
    """Pins for the values a pipeline stage receives (`sub`'s ``boundary:`` leaves, ``stage.slice_graph``) that
    carry the microbatch's rows (dim 0 that of `graph`'s first input): the layout `force` gives ``input:0``, where
    that layout shards its rows and nothing else (``S(0)`` on some axis, ``R`` on the others, as
    ``planner.forced`` pins batches) and no pattern of `force` names the leaf already.

    A stage's ILP prices no layout of a received value (it arrives from another mesh), so sharded and
    replicated tie; replicated, each of the stage's ranks receives every row of it and the sender sends each
    row once per replica (``runtime.crossmesh.tiles``). A forced data-parallel stage would then hold the whole
    microbatch's activations on every rank and double what crosses meshes on 2 ranks, as the ILP happened to
    choose when its variables changed (docs/benchmarks.md, issue 31). ``planner.config_plan.boundary_pins``
    pins the same leaves of a configuration's pieces."""
    from meshpilot.graph.capture import NodeKind
    from meshpilot.planner.force import ForceSpec
    from meshpilot.planner.forced import _exact
    from meshpilot.planner.stage import received_row_leaves

    spec = ForceSpec.of(force)
    first = next((n for n in graph.nodes if n.kind == NodeKind.INPUT and n.fqn == "input:0"), None)
    rule = spec.winner("input:0") if spec is not None else None
    if first is None or first.out is None or not first.out.shape or rule is None:
        return {}
    if "S(0)" not in rule.placements or any(p not in ("R", "S(0)") for p in rule.placements):
        return {}  # the inputs not pinned as batch rows: nothing to follow
    rows = first.out.shape[0]
    return {_exact(name): rule.layout for name, _ in received_row_leaves(sub, rows) if spec.winner(name) is None}


IN_FLIGHT_REFITS = 4
"""Searches of one stage's slice, each under a lower capacity, for a plan whose microbatches in flight fit
(:func:`_in_flight_fit`)."""


def _in_flight_fit(search: Callable[..., StagePlan], sub, capacity: float, microbatches: int, in_flight: int,
                   on_cpu: bool) -> tuple[StagePlan, float]:  # fmt: skip
    """The stage plan ``search(memory_bytes=…)`` finds for a slice whose schedule keeps `in_flight` microbatches'
    saved values (``accounting.in_flight_peak``, Eq. 5 as the stage table checks it), and that Eq. 5: searched
    at `capacity` and, while its Eq. 5 exceeds `capacity`, again under a capacity lowered by the excess (at most
    :data:`IN_FLIGHT_REFITS` times). ``auto.plan`` holds one microbatch's step to the capacity it is given, so
    without this a stage of the first of S stages could be planned faster than its table entry, and hold more
    than the device once its f(S) microbatches are in flight. Raises ``PlanError`` when no search fits."""
    from meshpilot.planner.accounting import in_flight_peak, plan_strategies
    from meshpilot.planner.ilp import PlanError
    from meshpilot.planner.recompute import for_plan

    cap, need = capacity, math.inf
    for _ in range(IN_FLIGHT_REFITS + 1):
        try:
            p = search(memory_bytes=cap)
        except PlanError:
            if cap == capacity:
                raise
            break  # nothing under the lowered capacity: the last plan's need is the answer
        if in_flight <= 1:  # Eq. 5 of one microbatch in flight: the plan's own peak, held to the capacity
            return p, p.memory.total
        run = for_plan(sub, p)  # the graph the plan was made on: its recomputed copies in the backward
        need = in_flight_peak(run, plan_strategies(p, run), p.mesh_shape, microbatches, in_flight, on_cpu,
                              p.grad_buckets)  # fmt: skip
        if need <= capacity * (1 + 1e-9):
            return dataclasses.replace(p, memory=dataclasses.replace(p.memory, capacity=capacity)), need
        cap -= need - capacity
        if cap <= 0:
            break
    raise PlanError(
        f"no sharding plan of the stage holds its {in_flight} microbatches in flight in {_bytes(capacity)} per "
        f"device (the last one searched needs {_bytes(need)})",
        mesh_shape=tuple(p.mesh_shape), need_bytes=need, capacity_bytes=capacity,
    )  # fmt: skip


class _StageDoesNotFit(Exception):
    """Stage `stage`'s own search (:meth:`Plan.with_intra`) found no plan: its ``PlanError`` is `error`."""

    def __init__(self, stage: int, error: Exception) -> None:
        super().__init__(str(error))
        self.stage, self.error = stage, error


def _bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


def _default(o: Any) -> Any:
    """JSON of what ``json`` does not know: a schedule's ``to_dict``, a dataclass's fields one level deep (json
    comes back here for the dataclasses inside them). ``dataclasses.asdict`` gave the same JSON but deep-copied
    every value of every node first: 0.3 s of saving GPT-39B's 12 stage plans (docs/benchmarks.md, issue 29)."""
    if isinstance(o, Schedule):
        return o.to_dict()
    if hasattr(o, "__dataclass_fields__"):
        return {f.name: getattr(o, f.name) for f in fields(o) if not f.name.startswith("_")}
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ------------------------------------------------------------------------------------------------ the whole plan


@dataclass(frozen=True)
class StageTransfer:
    """The values one stage sends another each microbatch (``planner.pipeline`` docstring, section 8): what
    ``runtime.pipeline_stages.find_transfers`` finds in the stages' slices, read off the whole graph."""

    src: int
    """The sending stage."""
    dst: int
    """The receiving stage: ``src + 1`` for the forward's values, ``src − 1`` for the backward's gradients."""
    forward: bool
    values: tuple[str, ...]
    """Each value as ``node:output`` of the graph the plan was made from."""
    shapes: tuple[tuple[int, ...], ...]
    nbytes: float
    """Per microbatch: the values' bytes added up (each crosses the link once)."""
    seconds: float
    """Per microbatch over the cluster's link between the two stages' first ranks (``CostModel.send_recv_ranks``:
    the latency of the highest layer they differ in + ``nbytes`` over its P2P bandwidth)."""


@dataclass(frozen=True)
class PlanStage:
    """One stage of a :class:`Plan`: which layers, on which ranks, planned how."""

    layers: tuple[int, int] | None
    """Layers ``[start, stop)`` of ``stage.runnable_layers(graph)``; None: the whole model (a one-stage plan)."""
    layer_names: tuple[str, ...]
    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    cost: StageCost | None
    """The stage DP's cost of the stage on `ranks` as `mesh_shape` over the plan's microbatches (None: a
    one-stage plan, whose :attr:`plan` prices it)."""
    t_s: float
    """Per microbatch: ``cost.time.total_s / microbatches`` (forward + backward, gradient sync amortised); once
    ``Plan.with_intra`` planned the stage, its :attr:`plan`'s ``time.total_s / microbatches`` (what the step reads)."""
    in_flight: int
    """Microbatches whose activations the stage holds at most under the plan's schedule (1F1B: min(B, stages
    from it to the end); GPipe: B): ``pipeline.stage_in_flight``."""
    memory_bytes: float
    """Per device: Eq. 5's left side (``pipeline.stage_memory``; once ``Plan.with_intra`` planned the stage, its
    plan's: ``accounting.in_flight_peak``); a one-stage plan's predicted peak."""
    recv_bytes: float
    """Bytes per microbatch the stage reads from other stages (Eq. 6's C; the sends priced are
    ``Plan.transfers``)."""
    input_share: float | None = None
    """Of the stage's backward, the share a zero-bubble schedule runs as ``I`` (the input gradients sent to the
    previous stage), the rest being ``W``: ``pipeline.input_grad_share`` (None: not kept)."""
    plan: StagePlan | None = None
    """The stage's intra-operator plan: every node's strategy on its logical mesh, its ``mesh_ranks`` indices
    into :attr:`ranks` (None in a pipeline plan before ``Plan.with_intra``)."""

    @classmethod
    def costed(
        cls, layers: Sequence[Layer], start: int, stop: int, ranks: tuple[int, ...], cost: StageCost,
        microbatches: int, in_flight: int, C: np.ndarray, input_share: float | None,
    ) -> PlanStage:  # fmt: skip
        """The stage of `layers` ``[start, stop)`` on `ranks`, planned as `cost` (its mesh), with `in_flight`
        microbatches held; ``C`` is ``pipeline.received_bytes`` over the same layers."""
        from meshpilot.planner.pipeline import stage_memory

        return cls(
            (start, stop), tuple(x.name for x in layers[start:stop]), ranks, cost.mesh_shape, cost,
            cost.time.total_s / microbatches, in_flight, stage_memory(cost, in_flight), float(C[start, stop - 1]),
            input_share,
        )  # fmt: skip


_SPLIT = frozenset({ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})
_PARTS = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
"""The compute actions :meth:`Plan.simulate` gives node spans: its stand-in's f, i + w, i, w."""


@dataclass(frozen=True)
class Plan:
    """How to run one training step: the stages (each its layers, ranks and :class:`StagePlan`), the schedule,
    the microbatches and the transfers between stages. A one-stage plan (:meth:`single`, what
    ``meshpilot.plan`` returns) is the whole model on every device with no transfers; a pipeline's comes from the
    stage DP (``planner.pipeline.plan_pipeline``). One JSON format (``planner.plan_format``)."""

    stages: tuple[PlanStage, ...]
    microbatches: int
    num_devices: int
    clustering: Clustering | None
    """The stage DP's layer clusters (None: a one-stage plan)."""
    capacity: float
    dp_step_s: float
    """The DP's T* on the canonical ranks each size was costed on (equals :attr:`step_s` when the placed
    stages cost the same, as on the presets' aligned blocks); a one-stage plan's predicted step."""
    planning_s: float
    stage_plans: int
    """Stage costs searched (StagePlanner cache misses) by the stage DP."""
    t_max_tried: int
    """Bounds on every stage's t the DP ran under (Interleaved1F1B: on every chunk's, over every group count and
    group sizes; ZB-H1 without a fixed depth: over every depth)."""
    schedule: PipelineKind | None = PipelineKind.ONE_F_ONE_B
    """The pipeline schedule's kind (None: a one-stage plan, whose stage plan holds its step's schedule)."""
    costing: StageCosting | str = "exact"
    """How the stage table was filled (a ``stack.StageCosting``): every range searched, or composed from a
    repeated block's plan (``planner.stack``)."""
    transfers: tuple[StageTransfer, ...] = ()
    """Each stage boundary's values per microbatch, both directions (``pipeline.stage_transfers``): what
    :meth:`simulate` sends and the runtime moves."""
    cluster: str = ""
    """The name of the cluster the plan was made for ("" in a pipeline plan saved before it was kept)."""
    send_split: int = 1
    """Ranks of a stage that each send their own share of a boundary's :attr:`transfers`, in parallel on their
    own links (a configuration's plan, ``planner.config_plan``: its DP replicas' rows); :meth:`simulate` sends
    ``nbytes / send_split`` from the stand-in rank. 1: the whole transfer over one link."""
    sequence_order: SequenceOrder | None = None
    """A configuration's plan with context parallelism: the zig-zag order its stages hold the sequence in
    (``planner.config_plan``, *Balanced CP*); None: contiguous, or a one-stage plan (its stage plan's)."""
    sync_overlap: bool = False
    """Whether each stage's gradient synchronisation runs beside the later backwards: issued when the stage's last
    backward ends, waited for at ``G`` (Megatron's ``overlap_grad_reduce``, Llama 3's FSDP; a configuration's
    plan, ``planner.config_plan``, which meshpilot's runtime does not run). False: as the pipeline runtime runs
    it, every stage's sync at ``G``; :meth:`simulate` then spreads it over the stage's backwards, as Eq. 2 does."""
    without_stage: Callable[[int], Plan] | None = field(default=None, compare=False, repr=False)
    """The stage DP's best plan with this plan's stage j, as placed (its layers, submesh size and position in
    the pipeline), ruled out of its table (``pipeline._dp_plan``; raises ``PlanError`` when nothing is left):
    how :meth:`with_intra` moves on when a stage's own plan does not fit where its table entry said it would.
    None where the table is not kept (a loaded plan; interleaved and zero-bubble schedules). Not saved."""

    def __post_init__(self) -> None:
        from meshpilot.planner.stack import StageCosting  # stack.py imports this module: not at the top

        object.__setattr__(self, "costing", StageCosting(self.costing))

    # ---------------------------------------------------------------- one stage
    @classmethod
    def single(cls, plan: StagePlan) -> Plan:
        """The one-stage plan of `plan`: the whole model on its mesh's devices, no transfers."""
        n = math.prod(plan.mesh_shape)
        B = plan.step_schedule().microbatches
        total = plan.time.total_s
        held = 2 if plan.step_schedule().name == DUPLEX else 1  # accumulation holds one microbatch at a time
        stage = PlanStage(
            None, (), tuple(range(n)), tuple(plan.mesh_shape), None, total / B, held, plan.memory.total, 0.0, plan=plan
        )
        return cls((stage,), B, n, None, plan.memory.capacity, total, plan.solver.total_s, 0, 0, None,
                   cluster=plan.cluster)  # fmt: skip

    @property
    def is_single(self) -> bool:
        """Whether this is a one-stage plan (the whole model on every device)."""
        return len(self.stages) == 1 and self.stages[0].layers is None

    @property
    def only(self) -> StagePlan:
        """The stage plan of a one-stage plan; one line for a pipeline."""
        if not self.is_single or self.stages[0].plan is None:
            raise UserError(
                f"this plan is a pipeline of {len(self.stages)} stages, not one stage; read its stages' plans "
                "(Plan.stages[j].plan) or make a one-stage plan (`meshpilot plan --stages 1`)"
            )
        return self.stages[0].plan

    @property
    def intra(self) -> tuple[StagePlan, ...]:
        """Every stage's plan, in stage order; empty when a stage has none (a pipeline before :meth:`with_intra`)."""
        plans = tuple(st.plan for st in self.stages)
        return () if any(p is None for p in plans) else plans  # type: ignore[return-value]

    @property
    def precision(self) -> str:
        """The stages' plans' precision ("" without them: the model's own)."""
        return self.stages[0].plan.precision if self.stages[0].plan is not None else ""

    @property
    def input_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        """One microbatch's input shapes and dtypes: the first stage plan's (a pipeline's first stage reads the
        model's first inputs, then the values other stages send it); () without one."""
        return self.stages[0].plan.input_shapes if self.stages[0].plan is not None else ()

    def run_digest(self) -> str:
        """SHA-256 of what running the plan depends on (:meth:`run_view`: every stage's ranks, layers and stage
        plan, the schedule), not of how it was found: two plans with one digest run identically. A one-stage plan's
        is its stage plan's (``StagePlan.run_digest``)."""
        import hashlib

        if self.is_single:
            return self.only.run_digest()
        return hashlib.sha256(json.dumps(self.run_view()).encode()).hexdigest()

    def run_view(self) -> dict[str, Any]:
        """What running the plan depends on, by key, in JSON form (``StagePlan.run_view`` per stage): where two
        plans' digests differ, :func:`first_difference` of their views says where."""
        if self.is_single:
            return self.only.run_view()
        stages = [
            {"layers": st.layers, "ranks": st.ranks} | (st.plan.run_view() if st.plan else {}) for st in self.stages
        ]
        return {"stages": json.loads(json.dumps(stages)), "schedule": self.step_schedule().to_dict()}

    # ---------------------------------------------------------------- stages
    @property
    def split_points(self) -> tuple[str, ...]:
        """The first layer of every stage after the first (``blocks.2``): where the runtime cuts the model."""
        return tuple(s.layer_names[0] for s in self.stages[1:])

    def with_intra(
        self,
        graph: OpGraph,
        cluster,
        *,
        force: Sequence[dict[str, str] | None] | None = None,
        time_limit: float | None = None,
        retries: int = 8,
        on_retry: Callable[[str], Any] | None = None,
        workers: int = 1,
        share_identical: bool = True,
    ) -> Plan:
        """This plan with every stage's :attr:`PlanStage.plan`: its slice (layers of ``stage.runnable_layers``)
        searched on the stage's logical mesh and mapping over the plan's microbatches (``planner.auto.plan``
        with the slice as its graph; costed on the canonical ranks ``0..size−1``, as the stage DP costs them).
        `graph` is the one-microbatch graph the plan was made from (the whole model's); ``force[j]`` pins
        layouts in stage j (``meshpilot.planner.forced``: a Megatron stage beside a data-parallel one), and the
        values stage j receives with the microbatch's rows as it pins the model's inputs
        (:func:`received_rows_pins`). The :attr:`transfers` are read off `graph` again
        (``pipeline.stage_transfers``), naming its nodes. `time_limit`: each HiGHS solve's wall-clock safety net
        (None: ``ilp.TIME_LIMIT_S``). Pure.

        Each stage is planned for the microbatches its schedule keeps in flight (:attr:`PlanStage.in_flight`):
        its plan's Eq. 5 (``accounting.in_flight_peak``, what the stage table checks) within the capacity
        (:func:`_in_flight_fit`), not one microbatch's step only.

        A stage table composed from a repeated block's plans (``planner.stack``) can price a stage below what its
        own search then needs (GPT-39B on ``alpa-p3x8``: a last stage of 18 blocks and the head at 13.4 GiB in
        the table, 19.3 GiB planned). Where a stage's own plan does not fit and the plan keeps its table
        (:attr:`without_stage`), that stage is ruled out and the DP's next best plan is planned instead, up to
        `retries` times; `on_retry` gets a line saying which stage and why. The plan returned is then that
        next best: its stages may differ from this one's.

        `workers`: forked processes the stages' searches run in, the largest slice on the most devices first
        (``planner.parallel``; 1, the default: one after the other here). The stages are independent searches, so
        the plan is the same with any number; ``meshpilot plan`` passes its ``--workers``. GPT-39B's 12 stages
        on ``alpa-p3x8`` are ~11 CPU s of the default command's ~50 (docs/benchmarks.md, issue 29 item 6):
        two workers halve their wall time on two cores.

        `share_identical`: stages whose slices are the same search up to names (``planner.identical``: nine of
        those twelve, three middle blocks on 4x1) are searched once and the plan told in each one's names, each
        still fitted to its own microbatches in flight — the plans one search per stage gives (False: that, for
        the tests that hold the two alike)."""
        from meshpilot.planner.ilp import TIME_LIMIT_S, PlanError

        time_limit = TIME_LIMIT_S if time_limit is None else time_limit
        plan = self
        for _ in range(retries + 1):
            try:
                return plan._planned_stages(graph, cluster, force, time_limit, workers, share_identical)
            except _StageDoesNotFit as e:
                if plan.without_stage is None or force is not None:
                    raise e.error from None
                if on_retry is not None:
                    st = plan.stages[e.stage]
                    on_retry(
                        f"stage {e.stage} (layers {st.layers[0]}–{st.layers[1] - 1} on {st.mesh_shape}) does not "
                        f"fit as its table entry said ({e.error}); planning the stage DP's next best without it"
                    )
                plan = plan.without_stage(e.stage)
        raise PlanError(
            f"the stage DP's best {retries + 1} pipelines each had a stage whose own plan does not fit in "
            f"{_bytes(self.capacity)} per device; give more devices or more microbatches"
        )

    def _planned_stages(
        self, graph: OpGraph, cluster, force: Sequence[dict[str, str] | None] | None, time_limit: float, workers: int,
        share_identical: bool = True,
    ) -> Plan:  # fmt: skip
        """:meth:`with_intra` of this plan's stages as they are; a stage whose search finds no plan raises
        :class:`_StageDoesNotFit` naming it (the first such in stage order, as one after the other would)."""
        from meshpilot.cluster import load_cluster
        from meshpilot.planner.identical import identical_stages
        from meshpilot.planner.ilp import PlanError
        from meshpilot.planner.parallel import map_columns
        from meshpilot.planner.pipeline import stage_transfers
        from meshpilot.planner.stage import runnable_layers, slice_graph

        force = list(force) if force is not None else [None] * len(self.stages)
        if len(force) != len(self.stages):
            raise UserError(f"force= has {len(force)} entries for {len(self.stages)} stages; give one (or None) each")
        run_layers = runnable_layers(graph)
        on_cpu = load_cluster(cluster).device.is_cpu
        # identical stages (the middle of a repeated stack) searched once, their plan told in each one's names
        groups = identical_stages(graph, run_layers, self.stages, force) if share_identical else None
        groups = groups or [(j,) for j in range(len(self.stages))]
        subs = {g[0]: slice_graph(graph, *self.stages[g[0]].layers, run_layers) for g in groups}
        search = functools.partial(self._group_search, graph, run_layers, subs, force, cluster, time_limit, on_cpu)
        found: dict[int, Any] = {}
        if workers <= 1:  # one after the other, in stage order, up to the first stage that does not fit
            for g in groups:
                found.update(zip(g, search((g[0], g))))
                failed = [j for j, r in found.items() if isinstance(r, PlanError)]
                if failed and all(j in found for j in range(min(failed))):
                    break
        else:  # the largest searches on the most devices first: the workers take the tasks in this order
            # a group dealt out to the workers (its first search made once in each): its stages' refits for their
            # microbatches in flight are their own searches, which one worker alone would make one after the other
            tasks = [(g[0], g[k :: min(workers, len(g))]) for g in groups for k in range(min(workers, len(g)))]
            order = sorted(tasks, key=lambda x: (-len(subs[x[0]].nodes) * len(self.stages[x[0]].ranks), x[1]))
            for (_, members), res in zip(order, map_columns(search, order, (), workers)):
                found.update(zip(members, res))
        stages = []
        for j, st in enumerate(self.stages):
            if isinstance(found[j], PlanError):
                raise _StageDoesNotFit(j, found[j])
            p, need = found[j]
            # the stage's t and Eq. 5 its own plan's, not its table entry's: the step printed and saved is the plan's
            stages.append(dataclasses.replace(st, plan=p, t_s=p.time.total_s / self.microbatches, memory_bytes=need))
        # the transfers read off this graph (a plan costed on a few blocks of a stack named theirs): what the
        # runtime moves (``runtime.pipeline_stages``) and the simulator prices; a boundary the plan priced keeps
        # its seconds (on the plan's cluster, which `cluster` — data-parallel stages' — need not be)
        bounds, ranks = [st.layers for st in stages], [st.ranks for st in stages]
        priced = {(x.src, x.dst, x.forward): x for x in self.transfers}
        transfers = []
        for y in stage_transfers(graph, run_layers, bounds, ranks, load_cluster(cluster)):
            x = priced.get((y.src, y.dst, y.forward))
            transfers.append(dataclasses.replace(y, seconds=x.seconds) if x is not None and x.nbytes == y.nbytes else y)
        return dataclasses.replace(self, stages=tuple(stages), transfers=tuple(transfers))

    def _group_search(
        self, graph: OpGraph, run_layers: list, subs: dict, force: list, cluster, time_limit: float, on_cpu: bool,
        task: tuple[int, tuple[int, ...]],
    ) -> list[tuple[StagePlan, float] | Exception]:  # fmt: skip
        """:meth:`_stage_search` of each stage of ``task = (rep, members)`` (stages of one group of
        ``identical.identical_stages``: the same search up to names, but for the microbatches each keeps in flight)
        on stage rep's slice ``subs[rep]``, the searches at the same capacity made once, each plan told in its
        stage's names (``identical.StageNames``). A stage whose names do not line up with rep's is searched on its
        own slice."""
        from meshpilot.planner.identical import StageNames
        from meshpilot.planner.stage import slice_graph

        rep, members = task
        memo: dict[tuple, Any] = {}
        out: list[tuple[StagePlan, float] | Exception] = []
        for j in members:
            names = None if j == rep else StageNames.of(graph, run_layers, subs[rep], self.stages[rep].layers,
                                                         self.stages[j].layers)  # fmt: skip
            if j != rep and names is None:
                own = slice_graph(graph, *self.stages[j].layers, run_layers)
                out.append(self._stage_search(graph, own, force[j], cluster, time_limit, on_cpu, j, {}))
                continue
            res = self._stage_search(graph, subs[rep], force[j], cluster, time_limit, on_cpu, j, memo)
            if names is not None and not isinstance(res, Exception):
                res = (names.plan(res[0], subs[rep]), res[1])
            out.append(res)
        return out

    def _stage_search(
        self, graph: OpGraph, sub, pinned, cluster, time_limit: float, on_cpu: bool, j: int, memo: dict
    ) -> tuple[StagePlan, float] | Exception:
        """Stage j's own plan and its Eq. 5 (:func:`_in_flight_fit`) on the slice `sub` (its own, or an identical
        stage's: :meth:`_group_search`), or the ``PlanError`` of its last ZeRO mode as a value (a worker of
        :meth:`_planned_stages` sends it back). `memo` keeps the searches' answers by (ZeRO mode, capacity): an
        identical stage asks the same first search."""
        from meshpilot.planner.auto import plan as plan_intra
        from meshpilot.planner.ilp import PlanError

        st = self.stages[j]
        if pinned is not None:
            pinned = {**pinned, **received_rows_pins(graph, sub, pinned)}
        search = functools.partial(
            plan_intra, None, (), cluster, graph=sub, mesh_shape=st.mesh_shape, mappings=[st.cost.mapping],
            microbatches=self.microbatches, force=pinned, time_limit=time_limit,
            # every block of the slice recomputed where the stage was costed so (``StageCost.recompute``;
            # the runtime applies the plan's regions to its slice: ``runtime.pipeline_stages``)
            recompute=st.cost.recompute.value if st.cost is not None else "none",
        )  # fmt: skip

        def searched(zero: Any, memory_bytes: float) -> StagePlan:
            key = (str(zero), memory_bytes)
            if key not in memo:
                try:
                    memo[key] = search(zero=zero, memory_bytes=memory_bytes)
                except PlanError as e:
                    memo[key] = e
            if isinstance(memo[key], PlanError):
                raise memo[key]
            return memo[key]

        # ZeRO as it was costed; where the table left the search its choice, then the mode the table priced
        # the stage with when that choice does not fit (``StageCost.zero_fallback``: the estimated table)
        first = st.cost.zero if st.cost is not None and st.cost.zero else "auto"
        fallback = st.cost.zero_fallback if st.cost is not None else None
        modes = [first] + ([fallback] if fallback and fallback != first else [])
        error: Exception | None = None
        with warnings.catch_warnings():  # patterns for other stages' parameters match nothing here
            warnings.simplefilter("ignore", UserWarning)
            for zero in modes:
                try:
                    return _in_flight_fit(functools.partial(searched, zero), sub, self.capacity,
                                          self.microbatches, st.in_flight, on_cpu)  # fmt: skip
                except PlanError as e:
                    error = e
        return error

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The rank classes: every stage's ranks, once, in stage order (Interleaved1F1B: stage j runs on
        ``groups[j % P]``; otherwise one per stage)."""
        out: list[tuple[int, ...]] = []
        for st in self.stages:
            if st.ranks not in out:
                out.append(st.ranks)
        return tuple(out)

    @property
    def chunks(self) -> int:
        """Stages per rank class (v: 1 but under Interleaved1F1B)."""
        return len(self.stages) // len(self.groups)

    # ---------------------------------------------------------------- the schedule
    def step_schedule(self) -> Schedule:
        """The step as a :class:`~meshpilot.planner.schedule.Schedule`: a one-stage plan's own (its stage plan's),
        a pipeline's one rank class per stage (per group of :attr:`chunks` stages under Interleaved1F1B)."""
        if self.schedule is None:
            return self.only.step_schedule()
        return self._schedule_on(self.groups)

    def _schedule_on(self, groups: Sequence[Sequence[int]]) -> Schedule:
        return pipeline(groups, self.microbatches, self.schedule, self.chunks)

    def schedule_lines(self, full: bool = False, width: int = 6) -> list[str]:
        """The schedule's actions, one line per rank class: every action with `full`, else the first and last
        `width` with the count between (``2F0 2F1 … (120 more) … 3B63 G``) — a 64-microbatch pipeline's
        whole listing is thousands of tokens a line (``meshpilot plan --json`` saves it: ``step_schedule``)."""
        sched = self.step_schedule()
        out = [str(sched).splitlines()[0]]
        for c in sched.classes:
            if full or len(c.actions) <= 2 * width + 1:
                out.append(str(c))
                continue
            head = str(dataclasses.replace(c, actions=c.actions[:width]))
            tail = " ".join(str(a) for a in c.actions[-width:])
            out.append(f"{head} … ({len(c.actions) - 2 * width} more) … {tail}")
        return out

    # ---------------------------------------------------------------- time
    @property
    def sum_s(self) -> float:
        """Σ t_i: one microbatch through every stage (the pipeline's fill and drain)."""
        return sum(s.t_s for s in self.stages)

    @property
    def max_s(self) -> float:
        """The slowest rank class's time per microbatch: max t_i (under Interleaved1F1B: of each group's
        chunks' t_i added up)."""
        per: dict[tuple[int, ...], float] = {}
        for s in self.stages:
            per[s.ranks] = per.get(s.ranks, 0.0) + s.t_s
        return max(per.values())

    @property
    def step_s(self) -> float:
        """Eq. 2: Σ t_i + (B − 1) · max t_i, i.e. B · max t_i + the bubble (Interleaved1F1B: with the groups'
        times for max t_i and its v-fold smaller bubble; Narayanan et al. §2.2); a one-stage plan's predicted
        step (``StagePlan.time.overlapped_s``: its gradient buckets priced as they run)."""
        if self.is_single and self.stages[0].plan is not None:
            return self.only.time.overlapped_s
        return self.microbatches * self.max_s + self.bubble_s

    @property
    def bubble_s(self) -> float:
        """What the step spends beyond the slowest stage's B microbatches: Σ t_i − max t_i (Interleaved1F1B:
        that over v, the fill and drain running chunks a v-th of a group's work)."""
        return (self.sum_s - self.max_s) / self.chunks

    def simulate(self, cluster=None, p2p_bytes: float | None = None, **kw: Any):
        """The step's timeline from the simulator (``meshpilot.sim.simulate``). A one-stage plan: its stage plan's
        schedule on every rank (`kw`: the simulator's options, stragglers). A pipeline: every stage's ranks run
        :meth:`step_schedule` (simulated once per stage, at its first rank), each ``F`` taking the stage's forward
        per microbatch (``cost.forward_s / B``) and each ``B`` the rest of its t (backward and the amortised
        gradient sync; with :attr:`sync_overlap` the sync and the update run once, the sync issued after the
        stage's last backward: :meth:`stage_syncs`), each send over the cluster's link between the stages' first
        ranks, its latency included
        (Eq. 2 leaves sends out), carrying its boundary's :attr:`transfers` bytes over :attr:`send_split` (or
        `p2p_bytes`, every send alike, when given). `cluster` defaults to the plan's own. Returns the
        ``SimResult``."""
        from meshpilot.cluster import load_cluster
        from meshpilot.sim import simulate

        if cluster is None and not self.cluster:
            raise UserError("plan: it does not name its cluster (saved before it did); give the cluster")
        cl = load_cluster(cluster if cluster is not None else self.cluster)
        if self.is_single:
            return simulate(self.only, cluster=cl, **kw)
        sends: float | dict[tuple[int, int], float] = (
            float(p2p_bytes)
            if p2p_bytes is not None
            else {(x.src, x.dst): x.nbytes / self.send_split for x in self.transfers}
        )
        stand_in, sched = self._stand_in(cl)
        if self.sync_overlap:
            kw = dict(kw, grad_syncs=self.stage_syncs(), sync_layer=self._sync_layer(cl))
        return simulate(stand_in, cluster=cl, schedule=sched, p2p_bytes=sends, **kw)

    def stage_syncs(self) -> dict[int, tuple[float, float]]:
        """Per stage (with :attr:`sync_overlap`): (its gradient sync's seconds ``StageCost.sync_s``, its update's
        ``time.optimizer_s``), what :meth:`simulate` issues after its last backward and runs at ``G``."""
        return {j: (st.cost.sync_s, st.cost.time.optimizer_s) for j, st in enumerate(self.stages) if st.cost}

    def _sync_layer(self, cl) -> int:
        """The cluster layer the syncs run on: the outermost one the first stage's ranks span (a configuration's
        DP ring, TP inside a server)."""
        import numpy as np

        coords = cl.coords(np.asarray(self.stages[0].ranks, dtype=np.int64))
        varies = (coords.max(axis=0) != coords.min(axis=0)) if len(coords) else np.zeros(0, dtype=bool)
        return int(np.argmax(varies)) if varies.any() else len(cl.layers) - 1

    def _stand_in(self, cl) -> tuple[StagePlan, Schedule]:
        """One simulated rank per stage group, at its first physical rank (its ranks share one timeline: the
        stand-in has no collectives), with an f, i and w node per stage; the simulator takes a send's peer
        literally, so peers become stage indices (under Interleaved1F1B one per group, its actions' stages
        naming their spans). With :attr:`sync_overlap` a stage's backward is its t less its sync and update over
        B (``stage_syncs``: the simulator runs those once, after its last backward and at ``G``)."""
        B = self.microbatches
        split = any(a.kind in _SPLIT for c in self.step_schedule().classes for a in c.actions)
        nodes: list[NodeChoice] = []
        spans: list[dict[ActionKind, tuple[int, int]]] = []
        for j, st in enumerate(self.stages):
            f = st.cost.forward_s / B
            if split and st.input_share is None:
                raise UserError("pipeline plan: its stages lack their input-gradient share (input_share); plan again")
            once = (st.cost.sync_s + st.cost.time.optimizer_s) / B if self.sync_overlap else 0.0
            back = st.t_s - f - once
            b_in = back * (st.input_share or 0.0)
            at = len(nodes)
            spans.append(dict(zip(_PARTS, ((at, at + 1), (at + 1, at + 3), (at + 1, at + 2), (at + 2, at + 3)))))
            nodes += [NodeChoice(f"f{j}", "stage", "op", (), (), "s", "fwd", f)]
            nodes += [NodeChoice(f"i{j}", "stage", "op", (), (), "s", "bwd", b_in)]
            nodes += [NodeChoice(f"w{j}", "stage", "op", (), (), "s", "bwd", back - b_in)]
        P = len(self.groups)
        sched = self._schedule_on([[j] for j in range(P)])
        classes = []
        for j, rc in enumerate(sched.classes):
            acts = tuple(
                dataclasses.replace(a, nodes=spans[j if a.stage is None else a.stage][a.kind])
                if a.kind.is_compute
                else a
                for a in rc.actions
            )
            classes.append(dataclasses.replace(rc, actions=acts))
        firsts = tuple(g[0] for g in self.groups)
        stand_in = StagePlan(
            cluster=cl.name, mesh_shape=(P,), mesh_ranks=firsts, mapping="row", nodes=tuple(nodes),
            params=(), inputs=(), input_shapes=(), time=StepTime(self.step_s, 0.0, 0.0),
            memory=MemoryUse(0, 0, 0, 0, 0, self.capacity), collectives=(), warnings=(),
            solver=SolverReport("pipeline", self.step_s, 0, 0, 0, 0, 0, 0, 0, self.planning_s), fingerprint="",
        )  # fmt: skip
        return stand_in, Schedule(tuple(classes), sched.microbatches, sched.name)

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The one plan format (``planner.plan_format``)."""
        from meshpilot.planner.plan_format import plan_to_dict

        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, d: Any, source: str | None = None) -> Plan:
        """The plan of a dict in the one format, or of an older file (a one-stage plan, a pipeline plan); one
        line naming `source` for anything else (``planner.plan_format``)."""
        from meshpilot.planner.plan_format import plan_from_dict

        return plan_from_dict(d, source)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            where = f"{source}: " if source else ""
            fix = "give a plan saved by `meshpilot plan --out FILE` or Plan.save"
            raise UserError(f"{where}not JSON ({e}); {fix}") from None
        return cls.from_dict(data, source=source)

    def save(self, path: str | Path) -> None:
        """Write the JSON atomically (temp file + rename), mode 0666 less the umask."""
        from meshpilot.io import atomic_write

        atomic_write(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a saved plan; a one-line UserError naming the file (and key) when it is not one."""
        path = Path(path)
        if path.is_dir():
            raise UserError(f"{path}: is a folder, not a plan file; give the JSON file `meshpilot plan --out` wrote")
        if not path.is_file():
            raise UserError(f"{path}: no such plan file; write one with `meshpilot plan ... --out {path}`")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise UserError(f"{path}: not a text file; give a plan JSON saved by `meshpilot plan --out`") from None
        except OSError as e:
            raise UserError(f"{path}: cannot be read ({e.strerror}); check its permissions") from None
        return cls.from_json(text, source=str(path))

    # ---------------------------------------------------------------- printing
    def summary(self) -> str:
        """A one-stage plan's summary (``StagePlan.summary``); a pipeline's stage table."""
        return self.only.summary() if self.is_single else self._table()

    def __str__(self) -> str:
        """A one-stage plan's full listing (``StagePlan.__str__``); a pipeline's stage table and transfers."""
        if self.is_single:
            return str(self.only)
        return "\n".join([self._table(), *self.transfer_lines()])

    def transfer_lines(self) -> list[str]:
        """One line per stage boundary and direction: the values' count and bytes per microbatch."""
        out = []
        for x in self.transfers:
            what = "activations" if x.forward else "gradients"
            out.append(
                f"  transfer {x.src} → {x.dst} ({what}): {len(x.values)} values, {_size(x.nbytes)} per microbatch,"
                f" {_secs(x.seconds)} on the link"
            )
        if self.send_split > 1 and out:
            out.append(f"  each sent as {self.send_split} shares on their own ranks' links (send_split; simulated so)")
        if self.sequence_order is not None:
            out.append(f"  sequence     {self.sequence_order.line(('dp', 'cp', 'tp'))}")
        return out

    def _table(self) -> str:
        B, S = self.microbatches, len(self.stages)
        kind = self.schedule.value if self.schedule is not None else "one stage"
        clusters = (
            f", {len(self.clustering.bounds)} layer clusters (δ={self.clustering.delta:g})" if self.clustering else ""
        )
        head = f"pipeline: {S} stage{'s' * (S != 1)} on {self.num_devices} devices, {B} microbatches ({kind}){clusters}"
        rows = [head, "  stage  layers                        ranks      mesh      t/microbatch     mem/dev  in flight"]
        for j, s in enumerate(self.stages):
            names = s.layer_names[0] if len(s.layer_names) == 1 else f"{s.layer_names[0]}..{s.layer_names[-1]}"
            layers = f"[{s.layers[0]},{s.layers[1]})" if s.layers is not None else "all"
            rk = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else str(s.ranks[0])
            mesh = "x".join(map(str, s.mesh_shape))
            rows.append(
                f"  {j:<5}  {layers} {names:<22.22} {rk:<10} {mesh:<8} "
                f"{_secs(s.t_s):>12}  {_size(s.memory_bytes):>10}  {s.in_flight}"
            )
        if self.chunks > 1:
            rows.append(
                f"  step = B·max T_g + (Σ t_i − max T_g)/v = {B}·{_secs(self.max_s)} + {_secs(self.bubble_s)} = "
                f"{_secs(self.step_s)} ({self.chunks} chunks per group: T_g the sum of a group's chunks' t_i)"
            )
        else:
            rows.append(
                f"  step = Σ t_i + (B−1)·max t_i = {_secs(self.sum_s)} + {B - 1}·{_secs(self.max_s)} = "
                f"{_secs(self.step_s)} (bubble Σ t_i − max t_i = {_secs(self.bubble_s)})"
            )
        rows.append(
            f"  planned in {self.planning_s:.2f} s: {self.stage_plans} stage searches ({self.costing.value} stage "
            f"costs), {self.t_max_tried} t_max tried"
        )
        return "\n".join(rows)


def _secs(x: float) -> str:
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3f} ms"
    return f"{x * 1e6:.2f} µs"


def _size(b: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= f:
            return f"{b / f:.1f} {unit}"
    return f"{b:.0f} B"


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two JSON values first differ, as ``path: a vs b`` (a list element that has a ``name`` is named by
    it: ``nodes[17 'mm_3'].ins[0]``); None when they are equal. Shown where two plans that should agree do not
    (``meshpilot train --plan auto``: a rank whose plan is not rank 0's)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            at = f"{path}.{k}" if path else str(k)
            if k not in a or k not in b:
                return f"{at}: {'absent' if k not in a else 'present'} vs {'absent' if k not in b else 'present'}"
            got = first_difference(a[k], b[k], at)
            if got is not None:
                return got
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            name = f" {x['name']!r}" if isinstance(x, dict) and isinstance(x.get("name"), str) else ""
            got = first_difference(x, y, f"{path}[{i}{name}]")
            if got is not None:
                return got
        return None if len(a) == len(b) else f"{path}: {len(a)} entries vs {len(b)}"
    if a == b:
        return None
    short = [json.dumps(v)[:80] for v in (a, b)]
    return f"{path}: {short[0]} vs {short[1]}"
