"""``meshpilot.plan(model, example_inputs, cluster, ...) -> Plan``: capture, enumerate, solve, search meshes.

1. :func:`~meshpilot.graph.capture.capture` traces the joint forward + backward graph on fake tensors.
2. For every candidate mesh shape — each 2D shape ``(d1, d2)`` of the devices (``mesh_shapes_2d``), and the
   3-axis shapes the cluster's hierarchy calls for (``mesh_shapes_3d``: its slow top level times two axes
   inside a unit; their axis 0 data-parallel only, :class:`~meshpilot.planner.axes.OuterDataParallel`, and
   searched on the row mapping only, which puts that axis over the top level) — the ILP's structure is built
   once (:func:`~meshpilot.planner.ilp.build_structure`: strategies, groups, compute costs, memory, edge
   classes), with a lower bound of any plan's step time on that shape: the
   compute of every class of identical nodes at its cheapest strategy (:func:`compute_lower_bound`; edges
   cost ≥ 0 and the post-pass changes no compute, so it bounds the final step time of every mapping).
3. Shapes are visited in increasing order of that bound; a shape whose bound is at least the best step
   time found so far is skipped (listed in the solver report with both numbers), and one whose least
   possible memory (:func:`min_memory`) exceeds the capacity is reported without solving. For each of two
   device mappings (axis 1 on contiguous ranks, the default, or axis 0 on contiguous ranks) the structure
   is priced on that mapping's :class:`~meshpilot.cluster.CostModel` and handed to the searcher
   (:class:`~meshpilot.planner.search.SearchTask`; the ILP prices it with :func:`~meshpilot.planner.ilp.price`,
   solves it, and runs the ZeRO-like post-pass, :func:`~meshpilot.planner.zero.zero_pass`): the one mesh
   search, :func:`~meshpilot.planner.meshsearch.search_mesh`, which the stage planner calls too.
4. The candidate with the least predicted step time becomes the :class:`~meshpilot.planner.plan.Plan`; if
   none fits in memory, :class:`~meshpilot.planner.ilp.PlanError` names the smallest need found and the
   capacity.

Per candidate the strategies are chosen by a searcher (``meshpilot.planner.search``: the ILP and the
ZeRO-like post-pass of ``meshpilot.planner.zero``), and every candidate and the final plan are priced by the
one accounting (``meshpilot.planner.accounting``).
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from meshpilot.cluster.mesh import MeshMapping
from meshpilot.errors import UserError
from meshpilot.graph.capture import NodeKind, OpGraph, Precision, capture
from meshpilot.io import fmt_size
from meshpilot.planner import recompute as recompute_choice
from meshpilot.planner import sequence_order
from meshpilot.planner.accounting import ComputeCost, TimeAccount, account, memory_use, step_edges, stored_layout
from meshpilot.planner.buckets import choice_hidden_s, with_buckets
from meshpilot.planner.force import ForceSpec
from meshpilot.planner.forced import sequence_gathers
from meshpilot.planner.heap import kept, spared_from_collection
from meshpilot.planner.ilp import TIME_LIMIT_S, PlanError, Structure, build_structure
from meshpilot.planner.plan import (
    Fallback,
    MeshCandidate,
    NodeChoice,
    SolverReport,
    StagePlan,
)
from meshpilot.planner.schedule import accumulate, overlapped
from meshpilot.planner.schedule import duplex as duplex_schedule
from meshpilot.planner.search import EPS, Candidate, Searcher, get_searcher
from meshpilot.planner.zero import ZERO_MODES, ParamEdges, ZeroMode
from meshpilot.sharding.placements import json_layout
from meshpilot.sharding.reshard import UNSUPPORTED_S, CollectiveKind, Resharder
from meshpilot.sharding.strategies import StrategyBuilder, StrategySource, fake_device_mesh


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cluster: Any,
    *,
    num_devices: int | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    mappings: Sequence[MeshMapping | str] = tuple(MeshMapping),
    loss_fn: Callable[..., torch.Tensor] | None = None,
    memory_bytes: float | None = None,
    time_limit: float = TIME_LIMIT_S,
    mip_gap: float = 1e-3,
    merge_trivial: bool = True,
    force: dict[str, str] | None = None,
    graph: OpGraph | None = None,
    zero: str = "auto",
    precision: str | None = None,
    microbatches: int = 1,
    overlap: bool = False,
    duplex: bool = False,
    searcher: str | Searcher = "ilp",
    recompute: str = "auto",
) -> StagePlan:
    """Choose the mesh and every operator's sharding that minimise the predicted step time.

    `cluster` is a :class:`~meshpilot.cluster.Cluster` or a preset name / TOML path. The mesh uses
    `num_devices` of it (default: all); `mesh_shape` fixes the shape instead of searching all 2D shapes.
    `memory_bytes` overrides the device capacity. `force` pins layouts of parameters / inputs by name
    pattern (``{"*": "RR", "input:*": "S(0)R"}`` is data parallelism on a 2D mesh: the most specific
    pattern wins a name; ``*`` pins parameters, buffers and inputs, not operators; ``meshpilot.planner.force``).
    `zero` is the ZeRO-like post-pass: ``auto`` (when cheaper or needed for memory), ``off`` or ``all``
    (module docstring).
    `precision` is how the run trains: ``fp32`` or ``bf16`` (the parameters' own dtype; checked), or
    ``bf16-mixed`` (``torch.autocast`` to bfloat16 over fp32 parameters: the step is captured under autocast,
    so its casts and bf16 copies are in the graph, and AdamW keeps fp32 states); default: the parameters'
    dtype. `microbatches` > 1 plans one microbatch (dim 0 of every example input divided by it) and
    accumulates gradients over them (schedule ``F0 B0 F1 B1 … G``: ``meshpilot.planner.schedule``); the
    step time and collectives then count every microbatch, the gradients' synchronisation once.
    ``overlap=True`` gives the plan the ``overlapped`` schedule: each resharding edge's first collective
    issued right after its producer and waited before its consumer, so it runs beside the compute between.
    ``duplex=True`` (with ``microbatches=2``) gives it HiDup's ``duplex`` schedule: the two microbatches
    interleaved stage by stage, one's collectives running while the other computes. See
    :func:`~meshpilot.graph.capture.capture` for what the model must return (or pass `loss_fn`). `searcher`
    picks the strategies of each mesh candidate (``meshpilot.planner.search.SEARCHERS``; default the ILP).
    `recompute` is which repeated blocks run their forward again in the backward instead of keeping their
    activations (``meshpilot.planner.recompute``): ``auto`` (only when the plan does not fit the memory
    otherwise), ``none`` or ``full``. Norm outputs that `force` pins as sequence parallelism's gathers
    (``forced.sequence_gathers``) are gathered again in the backward rather than saved, as Megatron-LM does
    (``planner.recompute``, *Re-gathered values*; recorded in the plan's ``recompute``).
    """
    from meshpilot.cluster import load_cluster

    with spared_from_collection():  # planning's objects kept out of full collections (heap)
        zero = _check_options(zero, microbatches, overlap, duplex)
        chooser = get_searcher(searcher)
        t_start = time.perf_counter()
        pinned = dict(force or {})
        force = ForceSpec.of(force)  # every layout read before any work, matched or not
        if force:
            force.check_mesh(len(mesh_shape) if mesh_shape else 2, tuple(mesh_shape) if mesh_shape else None)
        cl = load_cluster(cluster)
        n = _check_devices(cl, num_devices, mesh_shape)
        capacity = float(memory_bytes if memory_bytes is not None else cl.device.memory_bytes)
        t0 = time.perf_counter()
        precision = check_precision(model, graph, precision)
        if graph is None:
            inputs = microbatch_inputs(example_inputs, microbatches)
            with kept():  # no young collections while capturing; the graph, which lives to the end, frozen after
                graph = capture(model, inputs, loss_fn=loss_fn, precision=precision)
        capture_s = time.perf_counter() - t0
        pins = force.bind(graph) if force else None
        if pins is not None:
            pins.check()
        for line in pins.notes() if pins is not None else ():
            warnings.warn(line, UserWarning, stacklevel=2)
        shapes, outer = searched_shapes(cl, n, mesh_shape, bool(force), mappings)

        def search_graph(g: OpGraph) -> StagePlan:
            search = _ShapeSearch(g, cl, n, capacity, zero, microbatches, chooser, time_limit, mip_gap)
            shaped = search.structures(shapes, force, merge_trivial)
            shaped += search.structures(outer, force, merge_trivial, outer_data_parallel=True)
            for shape_struct in sorted(shaped, key=lambda x: (x.lower, x.order)):
                search.visit(shape_struct, mappings)
            return _finish(g, search, capture_s, t_start, precision, pins, overlap, duplex)

        regather = sequence_gathers(graph, pinned)  # sequence parallelism's norm outputs, gathered again (Megatron's)
        mode = recompute_choice.RecomputeMode.parse(recompute)
        return recompute_choice.choose(graph, mode, capacity, cl, search_graph, regather)


def _finish(
    graph: OpGraph, search: _ShapeSearch, capture_s: float, t_start: float, precision: str, pins: Any,
    overlap: bool, duplex: bool,
) -> StagePlan:  # fmt: skip
    """The plan of the search's best candidate on `graph`: priced, assembled, its schedule and buckets."""
    best, microbatches = search.best, search.microbatches
    if best is None:
        raise _no_shape_fits(search.errors)
    acct = search.best_account
    report = search.report(capture_s, time.perf_counter() - t_start)
    lm = search.best_resharder.cost_model.mesh
    result = _assemble(graph, best, acct, search.best_builder, lm, search.capacity, report, precision, microbatches)
    if microbatches == 1:  # causal ring attention balanced by the zig-zag order where the graph allows it
        result = dataclasses.replace(result, sequence_order=sequence_order.choose(graph, best.chosen, best.shape))
    if pins is not None:
        pins.check_plan(result.params, result.inputs)
    if overlap:
        result = dataclasses.replace(result, schedule=overlapped(result, microbatches))
    if duplex:
        result = dataclasses.replace(result, schedule=duplex_schedule(result))
    return _bucketed(result, graph, best, search.capacity, search.best_resharder.cost_model)


MIN_BUCKET_BYTES = 1 << 16
"""The smallest bucket :func:`_bucketed` tries before it plans none."""


def _bucketed(plan: StagePlan, graph: OpGraph, best: Candidate, capacity: float, cost: Any) -> StagePlan:
    """`plan` with its gradient buckets (``planner.buckets.with_buckets``) and its memory counting their flat
    buffers (``accounting.bucket_buffers``). While those push the peak over `capacity` (where the plan fitted
    without them), the buckets are cut to a quarter of the largest; below :data:`MIN_BUCKET_BYTES`, none: each
    gradient is then reduced on its own at the end of the backward, as the search priced it."""
    m = plan.step_schedule().microbatches  # the search's structures sum the gradients of m > 1 (accounting: A)
    bound = max(capacity, plan.memory.total) * (1 + EPS)
    size = None
    while True:
        bucketed = with_buckets(plan, graph, cost, size)
        if not bucketed.grad_buckets:
            return bucketed
        memory = memory_use(
            graph, best.chosen, best.shape, capacity, m, cost.device.is_cpu, bucketed.grad_buckets, best.births
        )
        if memory.total <= bound:
            return dataclasses.replace(bucketed, memory=memory)
        size = int(min(size or math.inf, max(b.nbytes for b in bucketed.grad_buckets)) // 4)
        if size < MIN_BUCKET_BYTES:
            time = dataclasses.replace(bucketed.time, hidden_s=0.0)
            return dataclasses.replace(bucketed, grad_buckets=(), time=time)


def _check_options(zero: str, microbatches: int, overlap: bool, duplex: bool) -> ZeroMode:
    """The options that contradict each other refused before any work; the ZeRO mode read."""
    if duplex and (microbatches != 2 or overlap):
        raise PlanError(
            f"duplex=True interleaves two microbatches: pass microbatches=2 (got {microbatches})"
            + (" and drop overlap=True (one schedule per plan)" if overlap else "")
        )
    if zero not in ZERO_MODES:
        raise PlanError(f"zero={zero!r}: expected one of {', '.join(ZERO_MODES)}")
    return ZeroMode(zero)


def searched_shapes(
    cluster: Any,
    n: int,
    mesh_shape: Sequence[int] | None = None,
    forced: bool = False,
    mappings: Sequence[MeshMapping | str] = tuple(MeshMapping),
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The shapes :func:`plan` searches on `n` devices of `cluster` (a loaded ``Cluster``): (`mesh_shape` alone
    or every 2D shape, the cluster's 3-axis shapes). The 3-axis ones (``mesh_shapes_3d``) have their outer axis
    data-parallel only (``planner.axes``); none when a shape is given, under a forced layout (written for two
    axes) or without the row mapping (which puts the outer axis over the slow level)."""
    from meshpilot.cluster import mesh_shapes_2d, mesh_shapes_3d

    shapes = [tuple(mesh_shape)] if mesh_shape else [tuple(s) for s in mesh_shapes_2d(n)]
    if mesh_shape or forced or MeshMapping.ROW not in map(MeshMapping, mappings):
        return shapes, []
    return shapes, [tuple(s) for s in mesh_shapes_3d(cluster, n)]


@dataclasses.dataclass(frozen=True)
class _ShapeStructure:
    """One mesh shape's ILP structure and the compute-only lower bound of any plan on it."""

    lower: float
    order: int
    shape: tuple[int, ...]
    dmesh: Any
    builder: StrategyBuilder
    struct: Structure
    outer_data_parallel: bool = False
    """Axis 0 data-parallel only (``planner.axes.OuterDataParallel``): searched on the row mapping only, which
    puts that axis over the cluster's slow top level."""


@dataclasses.dataclass
class _ShapeSearch:
    """Steps 2–4 of the module docstring: the shapes' structures, then each shape's mappings searched in
    order of the lower bound, keeping the fastest candidate, every candidate tried and every error."""

    graph: OpGraph
    cluster: Any
    devices: int
    capacity: float
    zero: ZeroMode
    microbatches: int
    chooser: Searcher
    time_limit: float
    mip_gap: float
    best: Candidate | None = None
    best_builder: StrategyBuilder | None = None
    best_resharder: Resharder | None = None
    best_account: TimeAccount | None = None
    """``accounting.account`` of :attr:`best`'s strategies on its resharder: its plan's times and collectives."""
    tried: list[MeshCandidate] = dataclasses.field(default_factory=list)
    errors: list[PlanError] = dataclasses.field(default_factory=list)
    build_s: float = 0.0
    solve_s: float = 0.0
    post_s: float = 0.0
    solves: int = 0
    shapes_built: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    """Every shape whose structure was built, in order (a shape's index breaks ties of the lower bound)."""

    def __post_init__(self) -> None:
        self.edges = step_edges(self.graph)
        self.param_edges = ParamEdges.of(self.graph, self.edges)

    def structures(
        self, shapes: Sequence[tuple[int, ...]], force: Any, merge_trivial: bool, outer_data_parallel: bool = False
    ) -> list[_ShapeStructure]:
        """Every shape's structure (strategies, groups, classes) and its compute-only lower bound; with
        `outer_data_parallel`, on the strategies data-parallel on axis 0 (``planner.axes``)."""
        from meshpilot.cluster import CostModel, LogicalMesh, mapped_ranks
        from meshpilot.planner.axes import OuterDataParallel

        out = []
        for shape in shapes:
            t1 = time.perf_counter()
            dmesh = fake_device_mesh(shape)
            builder = (OuterDataParallel if outer_data_parallel else StrategyBuilder)(self.graph, dmesh)
            cm0 = CostModel(LogicalMesh(self.cluster, shape, mapped_ranks(shape, MeshMapping.ROW)))
            # compute is priced on the device (the same for every mapping); resharding per mapping, in visit
            struct = build_structure(
                self.graph,
                builder,
                Resharder(dmesh, cm0),
                cm0,
                merge_trivial=merge_trivial,
                force=force,
                microbatches=self.microbatches,
            )
            self.build_s += time.perf_counter() - t1
            order = len(self.shapes_built)
            self.shapes_built.append(shape)
            lower = compute_lower_bound(struct)
            out.append(_ShapeStructure(lower, order, shape, dmesh, builder, struct, outer_data_parallel))
        return out

    def visit(self, s: _ShapeStructure, mappings: Sequence[MeshMapping | str]) -> None:
        """Search one shape's mappings, unless its lower bound reaches the best step time or its least memory
        exceeds the capacity (both recorded as candidates with the reason)."""
        from meshpilot.cluster import CostModel, LogicalMesh
        from meshpilot.planner.meshsearch import mappings_of, search_mesh

        maps = [MeshMapping.ROW] if s.outer_data_parallel else mappings_of(s.shape, mappings)
        if self.best is not None and s.lower >= self.best.time_s:
            note = (
                f"skipped: compute alone takes at least {s.lower * 1e3:.1f} ms, "
                f"the best plan {self.best.time_s * 1e3:.1f} ms"
            )
            self.tried += [MeshCandidate(s.shape, mapping, None, note) for mapping in maps]
            return
        need = min_memory(s.struct, "plain" if self.zero == ZeroMode.OFF else "zero")
        if need > self.capacity:
            e = PlanError(
                f"no sharding plan fits: the smallest per-device memory found is {fmt_size(need)} "
                f"but a device holds {fmt_size(self.capacity)} (mesh {s.shape})"
                "; use more devices, a smaller batch or model, or a device with more memory",
                mesh_shape=s.shape,
                need_bytes=need,
                capacity_bytes=self.capacity,
            )
            self.errors.append(e)
            self.tried += [MeshCandidate(s.shape, mapping, None, str(e), need_bytes=need) for mapping in maps]
            return
        cl, shape, dmesh = self.cluster, s.shape, s.dmesh
        found = search_mesh(
            self.graph, s.struct, self.param_edges, self.chooser, range(self.devices), maps,
            lambda _, physical: Resharder(dmesh, CostModel(LogicalMesh(cl, shape, physical))),
            capacity=self.capacity, zero=self.zero, microbatches=self.microbatches, time_limit=self.time_limit,
            mip_gap=self.mip_gap,
        )  # fmt: skip
        for t in found.tries:
            if t.candidate is None:
                self.errors.append(t.error)
                self.tried.append(MeshCandidate(shape, t.mapping, None, str(t.error), need_bytes=t.error.need_bytes))
                continue
            cand = t.candidate
            compute = ComputeCost(t.resharder.cost_model, tuple(t.resharder.mesh_shape), self.graph)
            acct = account(self.graph, cand.chosen, t.resharder, compute, self.microbatches, self.edges)
            # compared by the step it runs: the account's serial step (the ILP's objective prices a CPU device's
            # gradient reductions as shares of a bucket, cost.coalesced) less its buckets' overlap (planner.buckets)
            cand.time_s = acct.time.total_s - choice_hidden_s(
                self.graph, cand.chosen, t.resharder, self.microbatches, acct
            )
            self.build_s += cand.build_s
            self.solve_s += cand.solve_s
            self.post_s += cand.post_s
            self.solves += cand.solves
            self.tried.append(MeshCandidate(shape, t.mapping, float(cand.time_s), cand.note))
            if self.best is None or cand.time_s < self.best.time_s - 1e-15:  # over every shape: the first of ties
                self.best, self.best_builder, self.best_resharder = cand, s.builder, t.resharder
                self.best_account = acct

    def report(self, capture_s: float, total_s: float) -> SolverReport:
        """The solver report of the best candidate, with every candidate tried and the time split."""
        best = self.best
        assert best is not None
        return SolverReport(
            status=best.status,
            objective_s=best.objective_s,
            gap=best.gap,
            num_vars=best.num_vars,
            num_constraints=best.num_constraints,
            num_groups=best.num_groups,
            capture_s=capture_s,
            build_s=self.build_s,
            solve_s=self.solve_s,
            total_s=total_s,
            candidates=tuple(self.tried),
            post_s=self.post_s,
            memory_row=best.memory_row,
            ilps_solved=self.solves,
            searcher=self.chooser.name,
        )


def microbatch_inputs(example_inputs: Any, microbatches: int) -> tuple:
    """The first of `microbatches` equal microbatches of the example inputs (dim 0 of each)."""
    from meshpilot.graph.capture import as_inputs

    inputs = as_inputs(example_inputs)
    if microbatches < 1:
        raise PlanError(f"microbatches={microbatches}: give at least 1")
    if microbatches == 1:
        return inputs
    for i, x in enumerate(inputs):
        if x.dim() == 0 or x.shape[0] % microbatches:
            raise PlanError(
                f"microbatches={microbatches}: example input {i} has shape {tuple(x.shape)}, whose dim 0 (the batch) "
                f"does not split into {microbatches} equal microbatches; pick a divisor of the batch"
            )
    return tuple(x.narrow(0, 0, x.shape[0] // microbatches) for x in inputs)


_OWN_PRECISION = {"float32": Precision.FP32.value, "bfloat16": Precision.BF16.value, "float16": Precision.FP16.value}
"""The precision of a model whose parameters are all of one dtype."""


def check_precision(model: torch.nn.Module | None, graph: OpGraph | None, precision: str | None) -> str:
    """The plan's precision (:class:`~meshpilot.graph.capture.Precision`): as asked, or inferred from the
    parameters' dtypes (``fp32``, ``bf16``, ``fp16``; another dtype by its name). ``bf16`` and ``fp16`` cast a
    float32 model (the capture traces it in that dtype, the runtime casts the model); ``bf16-mixed`` needs
    float32 parameters (the master weights autocast reads)."""
    asked = Precision.parse(precision)
    if model is not None:
        dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
    elif graph is not None:
        dtypes = {n.out.dtype for n in graph.nodes if n.kind == "param" and n.out is not None}
    else:
        dtypes = set()
    own = _OWN_PRECISION.get(next(iter(dtypes)), "") if len(dtypes) == 1 else ""
    if asked is None:
        return graph.precision.value if graph is not None and graph.precision else own or "+".join(sorted(dtypes))
    if graph is not None and model is None:
        return asked.value  # a graph captured by the caller: trust its precision
    if asked in (Precision.FP32, Precision.BF16_MIXED) and own != "fp32":
        raise PlanError(
            f"precision={asked.value!r} needs float32 parameters but the model's are {', '.join(sorted(dtypes))}; "
            "cast the model first (model.float()) or leave precision out to plan it as it is"
        )
    return asked.value


def _no_shape_fits(errors: list[PlanError]) -> PlanError:
    """One error for every mesh shape that found no plan: when each says what it needs, the least need against
    the capacity once (not a clause per shape); else the distinct messages, the first three."""
    if len(errors) == 1:
        return errors[0]
    if all(e.need_bytes is not None and e.capacity_bytes is not None for e in errors):
        least = min(errors, key=lambda e: e.need_bytes)
        shapes = ", ".join(dict.fromkeys(str(e.mesh_shape) for e in errors))
        return PlanError(
            f"no sharding plan fits on any mesh shape ({shapes}): the smallest per-device memory found is "
            f"{fmt_size(least.need_bytes)} (mesh {least.mesh_shape}) but a device holds "
            f"{fmt_size(least.capacity_bytes)}; use more devices, more microbatches (a smaller batch per step), a "
            "smaller model, or a device with more memory",
            mesh_shape=least.mesh_shape,
            need_bytes=least.need_bytes,
            capacity_bytes=least.capacity_bytes,
        )
    return PlanError("no sharding plan fits on any mesh shape: " + "; ".join(list(dict.fromkeys(map(str, errors)))[:3]))


def _compute_dtype(precision: str | None) -> str:
    """The dtype whose peak FLOP/s the plan's MFU is told against: the precision's, float32 for a plan labelled
    with its parameters' dtypes (``check_precision``: a model of several dtypes)."""
    p = Precision.of_label(precision)
    return p.compute_dtype if p is not None else "float32"


def compute_lower_bound(struct: Structure) -> float:
    """A lower bound of the step time of every plan on `struct`'s mesh shape, for any device mapping and
    with or without the ZeRO post-pass: the compute of each class of identical nodes at its cheapest
    strategy (edges cost ≥ 0, the post-pass changes no compute, a group's minimum is at least the sum of
    its classes' minima)."""
    return float(sum(float(per.min()) for _, per in struct.cost_terms))


def min_memory(struct: Structure, row: str = "plain") -> float:
    """A lower bound of the peak bytes per device of every plan on `struct`'s shape: on each memory row
    (``accounting`` docstring) every class at its least; the larger row."""
    k = 1 if row == "plain" else 2
    if not struct.mem_terms:
        return 0.0
    return float(np.max(sum(t[k].min(axis=1) for t in struct.mem_terms)))


# ------------------------------------------------------------------------------------------ assemble


def _assemble(
    graph: OpGraph,
    cand: Candidate,
    acct: TimeAccount,
    builder: StrategyBuilder,
    lm: Any,
    capacity: float,
    report: SolverReport,
    precision: str,
    microbatches: int = 1,
) -> StagePlan:
    """The :class:`StagePlan` of the chosen candidate: its strategies, and its time and collectives as `acct`
    (``accounting.account``) prices them."""
    chosen = cand.chosen
    nodes = tuple(
        NodeChoice(
            node.name,
            node.target,
            node.kind,
            tuple(map(json_layout, chosen[node.name].ins)),
            tuple(map(json_layout, chosen[node.name].outs)),
            chosen[node.name].source,
            node.phase,
            acct.node_seconds[node.name],
        )
        for node in graph.nodes
    )
    pnode = {n.fqn: n for n in graph.nodes if n.kind == "param"}
    params = tuple((fqn, json_layout(stored_layout(chosen[pnode[fqn].name]))) for fqn in graph.param_names)
    memory = cand.usage
    why = builder.fallbacks
    fallbacks = tuple(
        Fallback(
            n.name, n.target, n.where(), why.get(n.name) or why.get(graph.canonical.get(n.name, ""), "no strategy")
        )
        for n in graph.nodes
        if n.kind == "op" and chosen[n.name].source == StrategySource.FALLBACK
    )
    warnings = _fallback_warnings(fallbacks)
    if cand.gap > 0.01:
        warnings.append(f"ILP stopped at gap {cand.gap:.2%} (node or time limit)")
    bad = [c for c in acct.collectives if c.kind == CollectiveKind.UNSUPPORTED]
    if bad:  # what cannot run is refused, never handed to the runtime
        c = bad[0]
        raise PlanError(
            f"no plan on mesh {tuple(cand.shape)} avoids resharding DTensor cannot run: {len(bad)} step(s) "
            f"(priced {UNSUPPORTED_S:.0f} s each), the first from {c.src} into {c.dst} (one partial kind to "
            "another, or a shard into a partial mid-chain); pin that value's layout with force= / --force, or "
            "try another mesh shape",
            mesh_shape=tuple(cand.shape),
        )
    if memory.total > capacity * (1 + EPS):
        warnings.append(f"predicted memory {fmt_size(memory.total)} exceeds {fmt_size(capacity)}")
    return StagePlan(
        cluster=lm.cluster.name,
        mesh_shape=tuple(cand.shape),
        mesh_axes=lm.axis_names(),
        mesh_ranks=tuple(int(r) for r in np.asarray(lm.ranks).reshape(-1)),
        mapping=cand.mapping,
        nodes=nodes,
        params=params,
        inputs=tuple(json_layout(chosen[n.name].outs[0]) for n in graph.nodes if n.kind == "input"),
        input_shapes=tuple((i.shape, i.dtype) for i in graph.input_infos),
        time=acct.time,
        memory=memory,
        collectives=acct.collectives,
        warnings=tuple(warnings),
        solver=report,
        fingerprint=graph.fingerprint(),
        zero=tuple(cand.switches),
        fallbacks=fallbacks,
        precision=precision,
        schedule=accumulate(math.prod(cand.shape), microbatches) if microbatches > 1 else None,
        step_flops=microbatches * sum(n.flops for n in graph.nodes if n.kind == NodeKind.OP),
        peak_flops=lm.cluster.device.flops_for(_compute_dtype(precision)),
        guards=tuple(graph.guards),
    )


def _check_devices(cl: Any, num_devices: int | None, mesh_shape: Sequence[int] | None) -> int:
    """The device count a plan uses; a UserError when `num_devices`, `mesh_shape` and the cluster disagree."""
    if mesh_shape is not None:
        shape = tuple(mesh_shape)
        if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
            raise UserError(
                f"mesh_shape={mesh_shape!r}: sizes must be positive; give one whole size per mesh axis, e.g. (2, 2)"
            )
    if num_devices is not None and (isinstance(num_devices, bool) or not isinstance(num_devices, int)):
        raise UserError(f"num_devices={num_devices!r}: give a whole number of devices, e.g. 4")
    if num_devices is not None and num_devices < 1:
        raise UserError(f"num_devices={num_devices}: must be at least 1; give e.g. num_devices=4")
    if num_devices is not None and mesh_shape is not None and math.prod(mesh_shape) != num_devices:
        raise UserError(
            f"mesh_shape={tuple(mesh_shape)} has {math.prod(mesh_shape)} devices but num_devices={num_devices}; "
            "give one of the two, or make them agree"
        )
    n = num_devices or (math.prod(mesh_shape) if mesh_shape else cl.num_devices)
    if n > cl.num_devices:
        raise UserError(
            f"{n} devices asked for but cluster {cl.name!r} has {cl.num_devices}; plan for at most that many "
            "(num_devices / mesh_shape), or use a bigger cluster"
        )
    return n


def _fallback_warnings(fallbacks: tuple[Fallback, ...]) -> list[str]:
    """One warning per op and place with no strategy (a stack of identical layers is one line with a count)."""
    groups: dict[tuple[str, str, str], int] = {}
    for f in fallbacks:
        key = (f.target, f.where, f.reason)
        groups[key] = groups.get(key, 0) + 1
    return [
        f"{target} in {where}: replicated ({why})" + (f" ×{count}" if count > 1 else "")
        for (target, where, why), count in groups.items()
    ]
