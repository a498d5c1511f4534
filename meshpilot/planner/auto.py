"""``meshpilot.plan(model, example_inputs, cluster, ...) -> Plan``: capture, enumerate, solve, search meshes.

1. :func:`~meshpilot.graph.capture.capture` traces the joint forward + backward graph on fake tensors.
2. For every candidate mesh — each 2D shape ``(d1, d2)`` of the devices (``mesh_shapes_2d``), and for each
   two device mappings (axis 1 on contiguous ranks, the default, or axis 0 on contiguous ranks) — the
   strategies are enumerated (once per shape: they do not depend on the mapping) and the ILP is built on
   that mesh's :class:`~meshpilot.cluster.CostModel` and solved (:mod:`meshpilot.planner.ilp`).
3. The cheapest feasible candidate becomes the :class:`~meshpilot.planner.plan.Plan`; if none fits in
   memory, :class:`~meshpilot.planner.ilp.PlanError` names the smallest need found and the capacity.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from meshpilot.graph.capture import OpGraph, capture
from meshpilot.planner.ilp import ADAM_STATE_BYTES, PlanError, Problem, Solution, _Costs, build_problem, solve
from meshpilot.planner.plan import (
    MemoryUse,
    MeshCandidate,
    NodeChoice,
    Plan,
    PlannedCollective,
    SolverReport,
    StepTime,
)
from meshpilot.sharding.placements import replicated, shard_factor, to_json
from meshpilot.sharding.reshard import Resharder
from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh


def _mesh_ranks(shape: tuple[int, ...], mapping: str) -> np.ndarray:
    n = math.prod(shape)
    if mapping == "row":
        return np.arange(n).reshape(shape)
    # axis 0 on contiguous ranks
    return np.arange(n).reshape(tuple(reversed(shape))).T.copy()


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    cluster: Any,
    *,
    num_devices: int | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    mappings: Sequence[str] = ("row", "col"),
    loss_fn: Callable[..., torch.Tensor] | None = None,
    memory_bytes: float | None = None,
    time_limit: float = 30.0,
    mip_gap: float = 1e-3,
    merge_trivial: bool = True,
    force: dict[str, str] | None = None,
    graph: OpGraph | None = None,
) -> Plan:
    """Choose the mesh and every operator's sharding that minimise the predicted step time.

    `cluster` is a :class:`~meshpilot.cluster.Cluster` or a preset name / TOML path. The mesh uses
    `num_devices` of it (default: all); `mesh_shape` fixes the shape instead of searching all 2D shapes.
    `memory_bytes` overrides the device capacity. `force` pins layouts of parameters / inputs by name
    pattern (``{"*": "RR", "input:*": "S(0)R"}`` is data parallelism on a 2D mesh). See
    :func:`~meshpilot.graph.capture.capture` for what
    the model must return (or pass `loss_fn`).
    """
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mesh_shapes_2d

    t_start = time.perf_counter()
    cl = load_cluster(cluster)
    n = num_devices or (math.prod(mesh_shape) if mesh_shape else cl.num_devices)
    capacity = float(memory_bytes if memory_bytes is not None else cl.device.memory_bytes)
    t0 = time.perf_counter()
    if graph is None:
        graph = capture(model, example_inputs, loss_fn=loss_fn)
    capture_s = time.perf_counter() - t0

    shapes = [tuple(mesh_shape)] if mesh_shape else [tuple(s) for s in mesh_shapes_2d(n)]
    best = None
    tried: list[MeshCandidate] = []
    errors: list[PlanError] = []
    build_s = solve_s = 0.0
    for shape in shapes:
        dmesh = fake_device_mesh(shape)
        builder = StrategyBuilder(graph, dmesh)
        maps = [m for m in mappings if m == "row" or sum(d > 1 for d in shape) > 1] or ["row"]
        for mapping in maps:
            ranks = _mesh_ranks(shape, mapping)
            lm = LogicalMesh(cl, shape, ranks)
            cm = CostModel(lm)
            resharder = Resharder(dmesh, cm)
            t1 = time.perf_counter()
            prob = build_problem(
                graph, builder, resharder, cm, capacity=capacity, merge_trivial=merge_trivial, force=force
            )
            build_s += time.perf_counter() - t1
            try:
                sol = solve(prob, time_limit=time_limit, mip_rel_gap=mip_gap)
            except PlanError as e:
                errors.append(e)
                tried.append(MeshCandidate(shape, mapping, None, str(e)))
                continue
            solve_s += sol.solve_s
            tried.append(MeshCandidate(shape, mapping, sol.objective))
            if best is None or sol.objective < best[0].objective - 1e-15:
                best = (sol, prob, resharder, cm, lm, mapping, builder)
    if best is None:
        needs = [e for e in errors]
        raise (
            needs[0]
            if len(needs) == 1
            else PlanError("no sharding plan fits on any mesh shape: " + "; ".join(str(e) for e in needs[:3]))
        )
    sol, prob, resharder, cm, lm, mapping, builder = best
    return _assemble(
        graph,
        prob,
        sol,
        resharder,
        cm,
        lm,
        mapping,
        builder,
        capacity,
        SolverTimes(capture_s, build_s, solve_s, time.perf_counter() - t_start),
        tuple(tried),
    )


class SolverTimes(tuple):
    def __new__(cls, capture_s, build_s, solve_s, total_s):
        return super().__new__(cls, (capture_s, build_s, solve_s, total_s))


def _assemble(
    graph: OpGraph,
    prob: Problem,
    sol: Solution,
    resharder: Resharder,
    cm,
    lm,
    mapping: str,
    builder: StrategyBuilder,
    capacity: float,
    times: tuple[float, float, float, float],
    tried: tuple[MeshCandidate, ...],
) -> Plan:
    mesh_shape = prob.mesh_shape
    nd = len(mesh_shape)
    chosen = {name: prob.strategies[name][j] for name, j in sol.choice.items()}
    costs = _Costs(cm, mesh_shape)
    compute = comm = reshard = 0.0
    colls: list[PlannedCollective] = []

    def edge(src: str, i: int, dst_name: str, dst_layout, phase: str) -> None:
        nonlocal comm, reshard
        info = graph[src].outputs[i]
        src_layout = chosen[src].outs[i]
        if info is None or src_layout is None or dst_layout is None:
            return
        for c in resharder.collectives(src_layout, dst_layout, info):
            s = resharder.collective_cost(c)
            if c.is_reduction:
                comm += s
            else:
                reshard += s
            colls.append(PlannedCollective(c.kind, c.axis, c.nbytes, phase, src, dst_name, s))

    nodes = []
    for node in graph.nodes:
        st = chosen[node.name]
        compute += costs.node(node, st)
        for a, (src, i) in enumerate(node.inputs):
            edge(src, i, node.name, st.ins[a], "fwd" if node.phase == "fwd" else "bwd")
        nodes.append(
            NodeChoice(
                node.name,
                node.target,
                node.kind,
                tuple(tuple(to_json(p)) for p in st.ins),
                tuple(tuple(to_json(p)) if p is not None else None for p in st.outs),
                st.source,
                node.phase,
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

    # memory per device
    mp = mg = mo = ma = mi = 0.0
    for n in graph.nodes:
        if n.out is None:
            continue
        if n.kind in ("param", "buffer", "input"):
            sf = shard_factor(chosen[n.name].outs[0], mesh_shape)
            if n.kind == "param":
                mp += n.out.nbytes / sf
                if graph.grads.get(n.fqn) is not None:
                    mg += n.out.nbytes / sf
                    mo += ADAM_STATE_BYTES * n.out.numel / sf
            else:
                mi += n.out.nbytes / sf
    from meshpilot.planner.ilp import _base

    seen = set()
    for n in graph.nodes:
        if not n.saved_for_backward:
            continue
        for i in range(len(n.outputs)) if n.kind == "op" else [0]:
            b = _base(graph, n.name, i)
            if b in seen or graph[b[0]].kind != "op":
                continue
            seen.add(b)
            info = graph[b[0]].outputs[b[1]]
            lay = chosen[b[0]].outs[b[1]]
            if info is not None and lay is not None:
                ma += info.nbytes / shard_factor(lay, mesh_shape)

    warnings = [f"{op}: replicated ({why})" for op, why in sorted(builder.warnings.items())]
    if sol.gap > 0.01:
        warnings.append(f"ILP stopped at gap {sol.gap:.2%} (time limit)")
    capture_s, build_s, solve_s, total_s = times
    return Plan(
        cluster=lm.cluster.name,
        mesh_shape=tuple(mesh_shape),
        mesh_ranks=tuple(int(r) for r in np.asarray(lm.ranks).reshape(-1)),
        mapping=mapping,
        nodes=tuple(nodes),
        params=tuple(params),
        inputs=tuple(tuple(to_json(chosen[n.name].outs[0])) for n in graph.nodes if n.kind == "input"),
        input_shapes=tuple((i.shape, i.dtype) for i in graph.input_infos),
        time=StepTime(compute, comm, reshard),
        memory=MemoryUse(mp, mg, mo, ma, mi, capacity),
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
        ),
        fingerprint=graph.fingerprint(),
    )
