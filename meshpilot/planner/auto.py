"""``meshpilot.plan(model, example_inputs, cluster, ...) -> Plan``: capture, enumerate, solve, search meshes.

1. :func:`~meshpilot.graph.capture.capture` traces the joint forward + backward graph on fake tensors.
2. For every candidate mesh shape — each 2D shape ``(d1, d2)`` of the devices (``mesh_shapes_2d``) — the
   ILP's structure is built once (:func:`~meshpilot.planner.ilp.build_structure`: strategies, groups,
   compute costs, memory, edge classes), with a lower bound of any plan's step time on that shape: the
   compute of every class of identical nodes at its cheapest strategy (:func:`compute_lower_bound`; edges
   cost ≥ 0 and the post-pass changes no compute, so it bounds the final step time of every mapping).
3. Shapes are visited in increasing order of that bound; a shape whose bound is at least the best step
   time found so far is skipped (listed in the solver report with both numbers), and one whose least
   possible memory (:func:`min_memory`) exceeds the capacity is reported without solving. For each of two
   device mappings (axis 1 on contiguous ranks, the default, or axis 0 on contiguous ranks) the structure
   is priced on that mapping's :class:`~meshpilot.cluster.CostModel` (:func:`~meshpilot.planner.ilp.price`)
   and solved, then the ZeRO-like post-pass (:func:`zero_pass`) runs on the solution.
4. The candidate with the least predicted step time becomes the :class:`~meshpilot.planner.plan.Plan`; if
   none fits in memory, :class:`~meshpilot.planner.ilp.PlanError` names the smallest need found and the
   capacity.

ZeRO-like post-pass
-------------------
For a parameter stored replicated on mesh axis ``a`` whose gradient arrives by an all-reduce over ``a``,
the post-pass can store it sharded on ``a`` instead (``S(d)`` for the first dim ``d`` that divides evenly,
preferring a dim no other axis shards); its gradient and AdamW states follow. The consumers keep their
planned layouts, so the run (DTensor) all-gathers the weight where it is read and reduce-scatters the
gradient into the shard: all-reduce → reduce-scatter + all-gather, and every rank updates ``1/n_a`` of the
weight. Each switch is priced exactly: ``Δt`` = the gradient's new resharding + the consumers' new
all-gathers − what they cost before (``Resharder``, DTensor's own steps, latency included); ``Δmem`` on
the ILP's two memory rows (``ilp`` docstring, terms from ``meshpilot.planner.accounting``): update row
``(W + O + G + T_opt) · (1/sf' − 1/sf)``, backward row ``(W + O) · (1/sf' − 1/sf)`` plus the gathered copy
where a view of the weight is kept for the backward (:func:`_zero_delta`). The rule, with ``ε = 1e-9``
relative:

* **cheaper**: ``Δt < −ε`` (a hierarchical all-reduce over two axes can get cheaper), or ``|Δt| ≤ ε``
  and ``Δmem < 0``. On a ring, reduce-scatter + all-gather move the same bytes as an all-reduce and
  ``CostModel.all_reduce`` already takes Rabenseifner's reduce-scatter + all-gather when it is fastest,
  so large gradients tie (and the switch wins on memory and on the update work, which the step time does
  not model); small, latency-bound gradients (recursive doubling) stay all-reduced.
* **memory**: if the plan's rows still exceed the capacity, the remaining candidates are applied in
  increasing order of ``Δt / saved bytes`` until they do.

After the pass the plan's peak is computed by liveness (``accounting.memory_use``); a candidate whose peak
exceeds the capacity is re-solved with its rows held below the capacity by its peak − rows gap (at most
``_REFITS`` times), and is dropped (``PlanError``) if it still does not fit.

With ``zero="auto"`` and a finite capacity the ILP is first solved against its ZeRO memory row (what the
plan needs once every replicated update is sharded, ``ilp`` docstring), so it can keep the faster,
less-sharded plan that fits only with the post-pass; if the post-pass cannot make it fit, or fitting cost
time, the plain row is solved too and the faster of the two fitting plans is kept. ``zero="off"`` skips the
pass; ``zero="all"`` applies every candidate switch. Switches are listed in ``Plan.zero`` and the plan's
time, memory and collectives describe the switched plan.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from meshpilot.cluster.mesh import MeshMapping
from meshpilot.errors import UserError
from meshpilot.graph.capture import OpGraph, Precision, capture
from meshpilot.io import fmt_size
from meshpilot.planner.accounting import kept_copy_bytes, memory_use, state_bytes
from meshpilot.planner.ilp import (
    PlanError,
    Pricer,
    Problem,
    Solution,
    Structure,
    _Costs,
    build_structure,
    price,
    solve,
)
from meshpilot.planner.plan import (
    Fallback,
    MemoryUse,
    MeshCandidate,
    NodeChoice,
    Plan,
    PlannedCollective,
    SolverReport,
    StepTime,
    ZeroSwitch,
)
from meshpilot.planner.schedule import accumulate, overlapped
from meshpilot.sharding.placements import is_even, replicated, shard_factor, to_json
from meshpilot.sharding.reshard import UNSUPPORTED_S, CollectiveKind, Resharder
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, StrategySource, fake_device_mesh


class ZeroMode(StrEnum):
    """The ZeRO-like post-pass (module docstring): when parameters, gradients and optimizer state are sharded."""

    AUTO = "auto"
    """Where it is faster, or needed to fit."""
    OFF = "off"
    """Never."""
    ALL = "all"
    """Every candidate switch."""


ZERO_MODES = tuple(ZeroMode)
_EPS = 1e-9
_REFITS = 3
"""Re-solves of one candidate whose liveness peak exceeds the capacity its linear rows were held to."""


@dataclass
class _Candidate:
    shape: tuple[int, ...]
    mapping: str
    prob: Problem
    sol: Solution
    chosen: dict[str, Strategy]
    switches: list[ZeroSwitch]
    time_s: float
    memory: float
    resharder: Resharder
    cm: Any
    lm: Any
    note: str = ""
    precision: str = ""
    usage: MemoryUse | None = None
    """The accounting's peak split (``memory`` is its total)."""


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
    time_limit: float = 30.0,
    mip_gap: float = 1e-3,
    merge_trivial: bool = True,
    force: dict[str, str] | None = None,
    graph: OpGraph | None = None,
    zero: str = "auto",
    precision: str | None = None,
    microbatches: int = 1,
    overlap: bool = False,
) -> Plan:
    """Choose the mesh and every operator's sharding that minimise the predicted step time.

    `cluster` is a :class:`~meshpilot.cluster.Cluster` or a preset name / TOML path. The mesh uses
    `num_devices` of it (default: all); `mesh_shape` fixes the shape instead of searching all 2D shapes.
    `memory_bytes` overrides the device capacity. `force` pins layouts of parameters / inputs by name
    pattern (``{"*": "RR", "input:*": "S(0)R"}`` is data parallelism on a 2D mesh). `zero` is the ZeRO-like
    post-pass: ``auto`` (when cheaper or needed for memory), ``off`` or ``all`` (module docstring).
    `precision` is how the run trains: ``fp32`` or ``bf16`` (the parameters' own dtype; checked), or
    ``bf16-mixed`` (``torch.autocast`` to bfloat16 over fp32 parameters: the step is captured under autocast,
    so its casts and bf16 copies are in the graph, and AdamW keeps fp32 states); default: the parameters'
    dtype. `microbatches` > 1 plans one microbatch (dim 0 of every example input divided by it) and
    accumulates gradients over them (schedule ``F0 B0 F1 B1 … G``: ``meshpilot.planner.schedule``); the
    step time and collectives then count every microbatch, the gradients' synchronisation once.
    ``overlap=True`` gives the plan the ``overlapped`` schedule: each resharding edge's first collective
    issued right after its producer and waited before its consumer, so it runs beside the compute between. See
    :func:`~meshpilot.graph.capture.capture` for what the model must return (or pass `loss_fn`).
    """
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mapped_ranks, mesh_shapes_2d

    if zero not in ZERO_MODES:
        raise PlanError(f"zero={zero!r}: expected one of {', '.join(ZERO_MODES)}")
    zero = ZeroMode(zero)
    t_start = time.perf_counter()
    cl = load_cluster(cluster)
    n = _check_devices(cl, num_devices, mesh_shape)
    capacity = float(memory_bytes if memory_bytes is not None else cl.device.memory_bytes)
    t0 = time.perf_counter()
    precision = check_precision(model, graph, precision)
    if graph is None:
        inputs = microbatch_inputs(example_inputs, microbatches)
        graph = capture(model, inputs, loss_fn=loss_fn, precision=precision)
    capture_s = time.perf_counter() - t0
    for line in unmatched_force(graph, force):
        warnings.warn(line, UserWarning, stacklevel=2)
    uses = _ParamUses(graph)
    shapes = [tuple(mesh_shape)] if mesh_shape else [tuple(s) for s in mesh_shapes_2d(n)]
    best: _Candidate | None = None
    best_builder: StrategyBuilder | None = None
    tried: list[MeshCandidate] = []
    errors: list[PlanError] = []
    build_s = solve_s = post_s = 0.0
    stats = {"ilps": 0}
    # 1. every shape's structure (strategies, groups, classes) and its compute-only lower bound
    shaped = []
    for shape in shapes:
        t1 = time.perf_counter()
        dmesh = fake_device_mesh(shape)
        builder = StrategyBuilder(graph, dmesh)
        cm0 = CostModel(LogicalMesh(cl, shape, mapped_ranks(shape, MeshMapping.ROW)))
        # compute is priced on the device (the same for every mapping); resharding per mapping, below
        struct = build_structure(graph, builder, Resharder(dmesh, cm0), cm0, merge_trivial=merge_trivial, force=force)
        build_s += time.perf_counter() - t1
        shaped.append((compute_lower_bound(struct), len(shaped), shape, dmesh, builder, struct))
    # 2. most promising shape first; a shape whose lower bound reaches the best step time is skipped
    for lower, _, shape, dmesh, builder, struct in sorted(shaped, key=lambda x: (x[0], x[1])):
        maps = [MeshMapping(m) for m in mappings if m == MeshMapping.ROW or sum(d > 1 for d in shape) > 1]
        maps = maps or [MeshMapping.ROW]
        if best is not None and lower >= best.time_s:
            for mapping in maps:
                tried.append(
                    MeshCandidate(
                        shape,
                        mapping,
                        None,
                        f"skipped: compute alone takes at least {lower * 1e3:.1f} ms, "
                        f"the best plan {best.time_s * 1e3:.1f} ms",
                    )
                )
            continue
        need = min_memory(struct, "plain" if zero == ZeroMode.OFF else "zero")
        if need > capacity:
            e = PlanError(
                f"no sharding plan fits: the smallest per-device memory found is {fmt_size(need)} "
                f"but a device holds {fmt_size(capacity)} (mesh {shape})"
                "; use more devices, a smaller batch or model, or a device with more memory",
                mesh_shape=shape,
                need_bytes=need,
                capacity_bytes=capacity,
            )
            errors.append(e)
            tried += [MeshCandidate(shape, mapping, None, str(e), need_bytes=need) for mapping in maps]
            continue
        for mapping in maps:
            lm = LogicalMesh(cl, shape, mapped_ranks(shape, mapping))
            cm = CostModel(lm)
            resharder = Resharder(dmesh, cm)
            t1 = time.perf_counter()
            prob = price(struct, Pricer(struct.table, resharder), capacity)
            build_s += time.perf_counter() - t1
            try:
                cand, s_s, p_s = _solve_candidate(
                    graph, prob, uses, resharder, capacity, zero, time_limit, mip_gap, shape, mapping, stats
                )
                cand.precision = precision
            except PlanError as e:
                errors.append(e)
                tried.append(MeshCandidate(shape, mapping, None, str(e), need_bytes=e.need_bytes))
                continue
            solve_s += s_s
            post_s += p_s
            cand.cm, cand.lm = cm, lm
            tried.append(MeshCandidate(shape, mapping, float(cand.time_s), cand.note))
            if best is None or cand.time_s < best.time_s - 1e-15:
                best = cand
                best_builder = builder
    if best is None:
        raise (
            errors[0]
            if len(errors) == 1
            else PlanError("no sharding plan fits on any mesh shape: " + "; ".join(str(e) for e in errors[:3]))
        )
    result = _assemble(
        graph,
        best,
        uses,
        best_builder,
        capacity,
        (capture_s, build_s, solve_s, post_s, time.perf_counter() - t_start),
        tuple(tried),
        stats["ilps"],
        microbatches,
    )
    if overlap:
        result = dataclasses.replace(result, schedule=overlapped(result, microbatches))
    return result


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


def check_precision(model: torch.nn.Module | None, graph: OpGraph | None, precision: str | None) -> str:
    """The plan's precision (:class:`~meshpilot.graph.capture.Precision`): as asked, or inferred from the
    parameters' dtypes (``fp32``, ``bf16``; another dtype by its name). ``bf16`` casts a float32 model (the
    capture traces it in bfloat16, the runtime casts the model); ``bf16-mixed`` needs float32 parameters
    (the master weights autocast reads)."""
    asked = Precision.parse(precision)
    if model is not None:
        dtypes = {str(p.dtype).removeprefix("torch.") for p in model.parameters()}
    elif graph is not None:
        dtypes = {n.out.dtype for n in graph.nodes if n.kind == "param" and n.out is not None}
    else:
        dtypes = set()
    own = {"float32": "fp32", "bfloat16": "bf16"}.get(next(iter(dtypes)), "") if len(dtypes) == 1 else ""
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


def _solve_candidate(graph, prob, uses, resharder, capacity, zero, time_limit, mip_gap, shape, mapping, stats):
    """Solve one mesh candidate (ILP + ZeRO post-pass); returns (candidate, solve seconds, post seconds).
    ``stats["ilps"]`` counts the HiGHS runs."""
    solve_s = post_s = 0.0

    def attempt(row: str, cap: float) -> _Candidate:
        nonlocal solve_s, post_s
        stats["ilps"] += 1
        sol = solve(prob, time_limit=time_limit, mip_rel_gap=mip_gap, memory=row, capacity=cap)
        solve_s += sol.solve_s
        t = time.perf_counter()
        chosen = {name: prob.strategies[name][j] for name, j in sol.choice.items()}
        switches, d_t, _ = zero_pass(graph, prob, chosen, uses, resharder, sol.rows, cap, zero)
        usage = memory_use(graph, chosen, prob.mesh_shape, capacity)
        post_s += time.perf_counter() - t
        return _Candidate(
            shape,
            mapping,
            prob,
            sol,
            chosen,
            switches,
            sol.objective + d_t,
            usage.total,
            resharder,
            None,
            None,
            usage=usage,
        )

    def fitted(row: str) -> _Candidate:
        """`attempt`; while the plan's liveness peak exceeds the capacity, re-solved (at most `_REFITS`
        times) with the linear rows held to the capacity less the plan's own peak − rows gap (what lives at
        the peak beyond the rows: ``accounting`` docstring). The plan's rows exceed that bound, so each
        re-solve picks another plan."""
        cand = attempt(row, capacity)
        for _ in range(_REFITS):
            if fits(cand) or not math.isfinite(capacity) or cand.usage is None:
                break
            cap = capacity - (cand.memory - cand.usage.row)
            try:
                cand = attempt(row, cap)
            except PlanError:
                break
        return cand

    fits = lambda c: c.memory <= capacity * (1 + _EPS)  # noqa: E731
    if zero == ZeroMode.OFF or not math.isfinite(capacity):
        only = fitted("plain")
        if not fits(only):
            raise PlanError(
                f"no sharding plan fits in {fmt_size(capacity)} per device on mesh {shape}: the best found "
                f"peaks at {fmt_size(only.memory)} (at {only.usage.peak_at if only.usage else '?'})",
                mesh_shape=shape,
                need_bytes=only.memory,
                capacity_bytes=capacity,
            )
        return only, solve_s, post_s
    first = fitted("zero")
    costly = any(s.reason == "memory" and s.delta_s > _EPS * first.time_s for s in first.switches)
    if fits(first) and not costly:
        first.note = _note(first)
        return first, solve_s, post_s
    try:
        second = fitted("plain")
    except PlanError:
        second = None
    options = [c for c in (first, second) if c is not None and fits(c)]
    if not options:
        raise PlanError(
            f"no sharding plan fits in {fmt_size(capacity)} per device on mesh {shape} even with the "
            f"ZeRO post-pass (its predicted peak is {fmt_size(first.memory)})",
            mesh_shape=shape,
            need_bytes=first.memory,
            capacity_bytes=capacity,
        )
    pick = min(options, key=lambda c: c.time_s)
    pick.note = _note(pick)
    return pick, solve_s, post_s


def _note(c: _Candidate) -> str:
    if not c.switches:
        return ""
    why = sorted({s.reason for s in c.switches})
    return f"ZeRO: {len(c.switches)} parameters ({', '.join(why)})"


# ------------------------------------------------------------------------------------------ ZeRO pass


class _ParamUses:
    """Per parameter node: the nodes reading it directly, and which of those are views kept for the
    backward (a copy all-gathered for such a view lives until the backward: activation memory)."""

    def __init__(self, graph: OpGraph):
        self.consumers: dict[str, list[tuple[str, int]]] = {}
        params = {n.name for n in graph.nodes if n.kind == "param"}
        for n in graph.nodes:
            for a, (s, _) in enumerate(n.inputs):
                if s in params:
                    self.consumers.setdefault(s, []).append((n.name, a))
        self.kept: set[tuple[str, str]] = set()
        for n in graph.nodes:
            if not n.saved_for_backward:
                continue
            for _ in range(len(n.outputs)) if n.kind == "op" else [0]:
                chain = graph.view_chain(n.name)
                if len(chain) > 1 and graph[chain[-1]].kind == "param":
                    self.kept.add((chain[-1], chain[-2]))


def _zero_layout(layout, axes, shape, mesh_shape):
    """`layout` with ``S(d)`` on each of `axes` (first evenly divisible dim, unsharded dims first)."""
    from torch.distributed.tensor import Shard

    new = list(layout)
    done = []
    for a in axes:
        sharded = {p.dim for p in new if isinstance(p, Shard)}
        dims = [d for d in range(len(shape)) if d not in sharded] + [d for d in range(len(shape)) if d in sharded]
        for d in dims:
            trial = list(new)
            trial[a] = Shard(d)
            if is_even(tuple(trial), shape, mesh_shape):
                new = trial
                done.append(a)
                break
    return tuple(new), tuple(done)


def _param_edges_s(p, layout, g_layout, g_info, chosen, uses: _ParamUses, resharder: Resharder) -> float:
    """Seconds of the edges a parameter stored in `layout` is on: its gradient in, its readers out."""
    t = resharder.cost(g_layout, layout, g_info)
    for v, a in uses.consumers.get(p.name, ()):
        t += resharder.cost(layout, chosen[v].ins[a], p.out)
    return t


def _gathered_bytes(p, layout, chosen, uses: _ParamUses, mesh_shape) -> float:
    """Bytes per device of the copies of a parameter stored in `layout` that are resharded for a view kept
    for the backward (``accounting.kept_copy_bytes``)."""
    wants = [chosen[v].ins[a] for v, a in uses.consumers.get(p.name, ()) if (p.name, v) in uses.kept]
    return kept_copy_bytes(p.out, layout, wants, mesh_shape)


def zero_pass(
    graph: OpGraph,
    prob: Problem,
    chosen: dict[str, Strategy],
    uses: _ParamUses,
    resharder: Resharder,
    memory: Sequence[float],
    capacity: float,
    mode: str = "auto",
) -> tuple[list[ZeroSwitch], float, np.ndarray]:
    """The ZeRO-like post-pass (module docstring). `memory` is the plan's bytes per device on each linear
    memory row (``Solution.rows``). Updates `chosen` for the switched parameters and returns (switches,
    Δ step seconds, Δ bytes per device on each row)."""
    rows = np.asarray(memory, dtype=float)
    if mode == "off":
        return [], 0.0, np.zeros_like(rows)
    mesh_shape = prob.mesh_shape
    pnodes = {n.fqn: n for n in graph.nodes if n.kind == "param"}
    cands = []
    for fqn, gsrc in graph.grads.items():
        if gsrc is None:
            continue
        p = pnodes[fqn]
        if p.name in prob.forced or p.out is None:
            continue
        old = chosen[p.name].outs[0]
        g_layout = chosen[gsrc[0]].outs[gsrc[1]]
        g_info = graph[gsrc[0]].outputs[gsrc[1]]
        if old is None or g_layout is None or g_info is None:
            continue
        axes = sorted(
            {
                c.axis
                for c in resharder.collectives(g_layout, old, g_info)
                if c.kind == CollectiveKind.ALL_REDUCE and old[c.axis].is_replicate()
            }
        )
        if not axes:
            continue
        new, axes = _zero_layout(old, axes, p.out.shape, mesh_shape)
        if not axes:
            continue
        st = next((s for s in prob.strategies[p.name] if s.outs[0] == new), None)
        if st is None:
            continue

        t_old, t_new = (_param_edges_s(p, lay, g_layout, g_info, chosen, uses, resharder) for lay in (old, new))
        d_rows, saved = _zero_delta(p, old, new, chosen, uses, mesh_shape)
        cands.append((fqn, p.name, old, new, axes, t_new - t_old, d_rows, st, max(t_old, t_new), saved))

    applied: list[tuple] = []
    total_t = 0.0
    total_m = np.zeros_like(rows)
    rest = []
    fits = lambda extra: float((rows + total_m + extra).max()) <= capacity  # noqa: E731
    for c in cands:
        d_t, d_rows, scale = c[5], c[6], c[8]
        tol = _EPS * scale + 1e-15
        cheaper = d_t < -tol or (abs(d_t) <= tol and c[9] > 0)
        if mode == "all" or (cheaper and ((d_rows <= 0).all() or fits(d_rows))):
            applied.append((c, "cheaper" if cheaper else "all"))
            total_t += d_t
            total_m = total_m + d_rows
        else:
            rest.append(c)
    if not fits(0.0):
        for c in sorted((c for c in rest if c[9] > 0), key=lambda c: c[5] / c[9]):
            if fits(0.0):
                break
            applied.append((c, "memory"))
            total_t += c[5]
            total_m = total_m + c[6]
    switches = []
    for (fqn, name, old, new, axes, d_t, _, st, _, saved), reason in applied:
        chosen[name] = st
        switches.append(ZeroSwitch(fqn, axes, tuple(to_json(old)), tuple(to_json(new)), reason, d_t, saved))
    return switches, total_t, total_m


def _zero_delta(p, old, new, chosen, uses: _ParamUses, mesh_shape) -> tuple[np.ndarray, float]:
    """Δ bytes per device on each memory row when parameter `p` moves from layout `old` to `new`, and the
    bytes it saves (weight, gradient, AdamW states and update temporary, less the gathered copies the
    backward keeps): ``accounting.state_bytes`` over the shard factors, ``accounting.kept_copy_bytes``."""
    s = state_bytes(p.out, True)
    scale = 1 / shard_factor(new, mesh_shape) - 1 / shard_factor(old, mesh_shape)
    gathered = _gathered_bytes(p, new, chosen, uses, mesh_shape) - _gathered_bytes(p, old, chosen, uses, mesh_shape)
    update = (s.persistent + s.grad + s.update_temp) * scale
    backward = s.persistent * scale + gathered
    return np.array([update, backward]), -(update + gathered)


# ------------------------------------------------------------------------------------------ assemble


def _assemble(
    graph: OpGraph,
    cand: _Candidate,
    uses: _ParamUses,
    builder: StrategyBuilder,
    capacity: float,
    times: tuple[float, float, float, float, float],
    tried: tuple[MeshCandidate, ...],
    ilps: int = 1,
    microbatches: int = 1,
) -> Plan:
    prob, sol, resharder, cm, lm, chosen = cand.prob, cand.sol, cand.resharder, cand.cm, cand.lm, cand.chosen
    mesh_shape = prob.mesh_shape
    nd = len(mesh_shape)
    costs = _Costs(cm, mesh_shape, graph)
    compute = comm = reshard = 0.0
    colls: list[PlannedCollective] = []

    def edge(src: str, i: int, dst_name: str, dst_layout, phase: str, operand: int = -1) -> None:
        nonlocal comm, reshard
        info = graph[src].outputs[i]
        src_layout = chosen[src].outs[i]
        if info is None or src_layout is None or dst_layout is None:
            return
        times = 1 if dst_name.startswith("grad:") else microbatches  # gradients are synchronised once a step
        for c in resharder.collectives(src_layout, dst_layout, info):
            s = resharder.collective_cost(c)
            if c.is_reduction:
                comm += s * times
            else:
                reshard += s * times
            colls.append(PlannedCollective(c.kind, c.axis, c.nbytes, phase, src, dst_name, s, operand))

    nodes = []
    for node in graph.nodes:
        st = chosen[node.name]
        seconds = costs.node(node, st)
        compute += seconds * microbatches
        phase = "fwd" if node.phase == "fwd" else "bwd"
        for c in st.colls:  # collectives the op issues itself (own strategies): src = dst = the node
            sec = resharder.collective_cost(c)
            if c.is_reduction:
                comm += sec * microbatches
            else:
                reshard += sec * microbatches
            colls.append(PlannedCollective(c.kind, c.axis, c.nbytes, phase, node.name, node.name, sec))
        for a, (src, i) in enumerate(node.inputs):
            edge(src, i, node.name, st.ins[a], phase, a)
        nodes.append(
            NodeChoice(
                node.name,
                node.target,
                node.kind,
                tuple(tuple(to_json(p)) for p in st.ins),
                tuple(tuple(to_json(p)) if p is not None else None for p in st.outs),
                st.source,
                node.phase,
                seconds,
            )
        )
    loss_name, li = graph.loss
    edge(loss_name, li, "loss", replicated(nd), "fwd")
    params = []
    pnode = {n.fqn: n for n in graph.nodes if n.kind == "param"}
    for fqn in graph.param_names:
        p = pnode[fqn]
        layout = chosen[p.name].outs[0]
        params.append((fqn, tuple(to_json(layout))))
        g = graph.grads.get(fqn)
        if g is not None:
            edge(g[0], g[1], f"grad:{fqn}", layout, "bwd")
    for fqn, (src, i) in graph.buffer_updates.items():
        edge(src, i, f"buffer:{fqn}", replicated(nd), "fwd")

    memory = cand.usage if cand.usage is not None else memory_use(graph, chosen, mesh_shape, capacity)
    why = builder.fallbacks
    fallbacks = tuple(
        Fallback(
            n.name, n.target, n.where(), why.get(n.name) or why.get(graph.canonical.get(n.name, ""), "no strategy")
        )
        for n in graph.nodes
        if n.kind == "op" and chosen[n.name].source == StrategySource.FALLBACK
    )
    warnings = _fallback_warnings(fallbacks)
    if sol.gap > 0.01:
        warnings.append(f"ILP stopped at gap {sol.gap:.2%} (time limit)")
    bad = sum(c.kind == "unsupported" for c in colls)
    if bad:
        warnings.append(
            f"{bad} resharding steps DTensor cannot run (shard → partial), priced at {UNSUPPORTED_S:.0f} s each: "
            "no supported plan was found on this mesh"
        )
    if memory.total > capacity * (1 + _EPS):
        warnings.append(f"predicted memory {fmt_size(memory.total)} exceeds {fmt_size(capacity)}")
    capture_s, build_s, solve_s, post_s, total_s = times
    return Plan(
        cluster=lm.cluster.name,
        mesh_shape=tuple(mesh_shape),
        mesh_axes=lm.axis_names(),
        mesh_ranks=tuple(int(r) for r in np.asarray(lm.ranks).reshape(-1)),
        mapping=cand.mapping,
        nodes=tuple(nodes),
        params=tuple(params),
        inputs=tuple(tuple(to_json(chosen[n.name].outs[0])) for n in graph.nodes if n.kind == "input"),
        input_shapes=tuple((i.shape, i.dtype) for i in graph.input_infos),
        time=StepTime(compute, comm, reshard),
        memory=memory,
        collectives=tuple(colls),
        warnings=tuple(warnings),
        solver=SolverReport(
            status=sol.status,
            objective_s=sol.objective,
            gap=sol.gap,
            num_vars=sol.num_vars,
            num_constraints=sol.num_constraints,
            num_groups=len(prob.groups),
            capture_s=capture_s,
            build_s=build_s,
            solve_s=solve_s,
            total_s=total_s,
            candidates=tried,
            post_s=post_s,
            memory_row=sol.row,
            ilps_solved=ilps,
        ),
        fingerprint=graph.fingerprint(),
        zero=tuple(cand.switches),
        fallbacks=fallbacks,
        precision=cand.precision,
        schedule=accumulate(math.prod(mesh_shape), microbatches) if microbatches > 1 else None,
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


def unmatched_force(graph: OpGraph, force: dict[str, str] | None) -> list[str]:
    """One warning per `force` pattern that names no parameter, buffer or input of `graph` (a typo pins nothing),
    listing the names it could have matched."""
    import fnmatch

    if not force:
        return []
    names = [n.fqn or n.name for n in graph.nodes if n.kind in ("param", "buffer", "input")]
    out = []
    for pattern in force:
        if not any(fnmatch.fnmatchcase(x, pattern) for x in names) and not any(
            fnmatch.fnmatchcase(n.name, pattern) for n in graph.nodes
        ):
            shown = ", ".join(names[:12]) + (f", … ({len(names)} in all)" if len(names) > 12 else "")
            out.append(f"force pattern {pattern!r} matches nothing and pins nothing; the names it can match: {shown}")
    return out


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
