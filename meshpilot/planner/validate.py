"""Plan validation: everything that can be checked about a :class:`~meshpilot.planner.plan.Plan` before a process
group starts, in one pure function, :func:`validate`, which ``meshpilot train`` (before ``init_process_group``)
and ``meshpilot.parallelize`` (both runtimes) call:

* the world size (when given): the plan's device count;
* the stages' ranks: every rank ``0 … num_devices − 1`` in exactly one rank group;
* every stage's :class:`~meshpilot.planner.plan.StagePlan` by :func:`validate_plan` (below) — with `graph`, a
  pipeline's against its stage's slice of it (``stage.slice_graph``), after the layer count;
* with `graph`, for a pipeline: no random draws (:func:`check_no_random`: its stages would draw them in
  another order than one device does), and its ``transfers`` — what the simulator prices — are the values
  that cross each stage boundary of the graph (``pipeline.stage_transfers``).

:func:`validate_plan` checks one stage plan and raises a one-line :class:`~meshpilot.errors.UserError`
naming the file (`source`), the key and the fix for the first problem found:

* ``version``: one this meshpilot reads (:data:`SUPPORTED_VERSIONS`);
* ``mesh_shape``: one or more positive whole sizes;
* ``mesh_axes``: one distinct, non-empty name per mesh axis;
* ``mesh_ranks``: a permutation of ``range(prod(mesh_shape))`` (no duplicate, none missing or out of range);
* every placement string (``inputs``, ``params``, each node's ``ins`` / ``outs``): ``R``, ``P``, ``P(op)`` or
  ``S(d)``, one per mesh axis, and ``d`` below the tensor's rank where the rank is known (the inputs' from
  ``input_shapes``; with `graph`, the parameters' and every node's);
* ``zero``: each switch's stage is 2 or 3 and its parameter is stored in the switch's sharded layout (with
  `graph`, read where its stage reads it); a pipeline's stages hold no stage-2 switch;
* ``world_size`` (when given): the mesh's device count;
* ``graph`` (when given): the plan's graph fingerprint (a plan for another model or other input shapes).

``meshpilot train --plan`` calls it before ``init_process_group``; ``meshpilot.parallelize`` before it builds
the mesh and again once it has captured the model.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

from meshpilot.errors import UserError

SUPPORTED_VERSIONS = (1,)
"""Plan JSON versions this meshpilot reads."""

_PLACEMENT = re.compile(r"^(R|P|P\((sum|avg|max|min|product)\)|S\((\d+)\))$")


def _fail(where: str, key: str, problem: str, fix: str) -> UserError:
    return UserError(f"{where}{key}: {problem}; {fix}")


def check_version(version: Any, where: str = "") -> None:
    """A UserError unless `version` is one :data:`SUPPORTED_VERSIONS` holds."""
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        supported = ", ".join(map(str, SUPPORTED_VERSIONS))
        raise _fail(
            where,
            "version",
            f"is {version!r}, this meshpilot reads plan version {supported}",
            "make the plan again with this meshpilot (`meshpilot plan ... --out FILE`) or upgrade meshpilot",
        )


def _check_layout(layout: Any, axes: int, rank: int | None, where: str, key: str) -> None:
    fix = "write one placement per mesh axis: R, P or S(d) with d a dim of the tensor; or plan again"
    if layout is None:
        return
    if not isinstance(layout, list | tuple) or len(layout) != axes:
        raise _fail(where, key, f"layout {layout!r} must have {axes} placement(s), one per mesh axis", fix)
    for a, p in enumerate(layout):
        m = _PLACEMENT.match(p) if isinstance(p, str) else None
        if m is None:
            raise _fail(where, f"{key}[{a}]", f"placement {p!r} is not R, P, P(op) or S(d)", fix)
        if m.group(3) is not None and rank is not None and int(m.group(3)) >= rank:
            raise _fail(
                where,
                f"{key}[{a}]",
                f"placement {p} shards dim {m.group(3)} but the tensor has {rank} dim(s)",
                f"shard a dim below {rank} (S(0) … S({rank - 1})) or use R; or plan again",
            )


def validate_plan(plan: Any, *, world_size: int | None = None, graph: Any = None, source: str | None = None) -> None:
    """Check `plan` (see the module docstring); a one-line UserError for the first problem. Pure: no I/O."""
    where = f"{source}: " if source else ""
    check_version(getattr(plan, "version", None), where)

    shape = plan.mesh_shape
    if (
        not isinstance(shape, list | tuple)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
    ):
        raise _fail(where, "mesh_shape", f"is {shape!r}, must be positive whole sizes", "e.g. [2, 2]; or plan again")
    n = math.prod(shape)

    names = plan.mesh_axes
    fix = 'give one distinct name per mesh axis, e.g. ["node", "gpu"], or delete the key for positional names'
    if not isinstance(names, list | tuple) or not all(isinstance(a, str) and a for a in names):
        raise _fail(where, "mesh_axes", f"is {names!r}, must be non-empty names", fix)
    if len(names) != len(shape):
        raise _fail(where, "mesh_axes", f"names {len(names)} axes, the mesh {tuple(shape)} has {len(shape)}", fix)
    dup = sorted(a for a, c in Counter(names).items() if c > 1)
    if dup:
        raise _fail(where, "mesh_axes", f"name {dup[0]!r} appears more than once", fix)

    ranks = plan.mesh_ranks
    fix = f"list every rank 0 … {n - 1} exactly once (row-major over the mesh), or plan again"
    if not isinstance(ranks, list | tuple) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        raise _fail(where, "mesh_ranks", f"must be whole numbers, got {ranks!r}", fix)
    if len(ranks) != n:
        raise _fail(where, "mesh_ranks", f"has {len(ranks)} entries, the mesh {tuple(shape)} has {n} devices", fix)
    bad = sorted(r for r in ranks if not 0 <= r < n)
    if bad:
        raise _fail(where, "mesh_ranks", f"rank {bad[0]} is outside 0 … {n - 1}", fix)
    dup = sorted(r for r, c in Counter(ranks).items() if c > 1)
    if dup:
        raise _fail(where, "mesh_ranks", f"rank {dup[0]} appears more than once", fix)

    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise UserError(f"world size {world_size!r}: must be at least 1; launch with --nproc-per-node {n}")
        if world_size != n:
            raise UserError(
                f"{where}the plan's mesh {tuple(shape)} has {n} devices but the world size is {world_size}; "
                f"launch with --nproc-per-node {n} or plan for this world size"
            )
    if graph is not None and graph.fingerprint() != plan.fingerprint:
        raise UserError(
            f"{where}fingerprint: this plan was made for a different model or input shapes (graph fingerprint "
            f"{plan.fingerprint} vs {graph.fingerprint()}); plan again for this model, or pass the model and "
            "sizes (--model/--layers/--hidden/--heads) it was made for"
        )
    if graph is not None and getattr(plan, "recompute", None) is not None:
        from meshpilot.planner.recompute import apply

        apply(graph, plan.recompute.regions)  # each block is the model's and recomputes exactly, or one line

    axes = len(shape)
    for i, layout in enumerate(plan.inputs):
        rank = len(plan.input_shapes[i][0]) if i < len(plan.input_shapes) else None
        _check_layout(layout, axes, rank, where, f"inputs[{i}]")
    param_rank: dict[str, int] = {}
    node_ranks: dict[str, list[int | None]] = {}
    if graph is not None:
        for node in graph.nodes:
            if node.kind == "param" and node.out is not None:
                param_rank[node.fqn] = len(node.out.shape)
            node_ranks[node.name] = [None if o is None else len(o.shape) for o in node.outputs]
    for fqn, layout in plan.params:
        _check_layout(layout, axes, param_rank.get(fqn), where, f"params[{fqn}]")
    _check_zero(plan, graph, where)
    for node in plan.nodes:
        for a, layout in enumerate(node.ins):
            _check_layout(layout, axes, None, where, f"nodes[{node.name}].ins[{a}]")
        ranks_out = node_ranks.get(node.name, [])
        for i, layout in enumerate(node.outs):
            rank = ranks_out[i] if i < len(ranks_out) else None
            _check_layout(layout, axes, rank, where, f"nodes[{node.name}].outs[{i}]")


def _check_zero(plan: Any, graph: Any, where: str) -> None:
    """Each ZeRO switch (``plan.ZeroSwitch``): a known stage; the parameter stored in its sharded layout; with
    `graph`, its node read in the sharded layout (stage 3) or in the layout before the switch (stage 2, the
    full copy ``runtime.spmd.GatheredCopies`` keeps)."""
    from meshpilot.planner.plan import ZeroStage

    stored = {fqn: tuple(layout) for fqn, layout in plan.params}
    node = {n.fqn: n.name for n in graph.nodes if n.kind == "param"} if graph is not None else {}
    fix = "plan again (`meshpilot plan ... --out FILE`)"
    for i, z in enumerate(plan.zero):
        key = f"zero[{i}]"
        if not isinstance(z.stage, ZeroStage):
            stages = ", ".join(str(int(s)) for s in ZeroStage)
            raise _fail(where, f"{key}.stage", f"is {z.stage!r}, a ZeRO switch is stage {stages}", fix)
        if stored.get(z.param) != tuple(z.after):
            got = stored.get(z.param)
            raise _fail(where, key, f"{z.param} is stored in {got} but the switch shards it to {z.after}", fix)
        if z.param in node:
            read = tuple(plan.node(node[z.param]).outs[0])
            want = tuple(z.before if z.stage == ZeroStage.GATHER_ONCE else z.after)
            if read != want:
                raise _fail(where, key, f"{z.param} is read in {read} but stage {int(z.stage)} reads it in {want}", fix)


def validate(plan: Any, *, world_size: int | None = None, graph: Any = None, source: str | None = None) -> None:
    """Check the :class:`~meshpilot.planner.plan.Plan` `plan` (module docstring): `graph` is the model's step
    captured at one microbatch (a one-stage plan: at its input shapes). One line for the first problem. Pure."""
    where = f"{source}: " if source else ""
    if plan.is_single:
        validate_plan(plan.only, world_size=world_size, graph=graph, source=source)
        return
    n = plan.num_devices
    if world_size is not None and world_size != n:
        raise UserError(
            f"{where}a pipeline of {len(plan.stages)} stages on {n} devices but the world size is {world_size}; "
            f"launch with --nproc-per-node {n}"
        )
    covered = sorted(r for g in plan.groups for r in g)
    if covered != list(range(n)):
        raise UserError(
            f"{where}stages: their ranks {plan.groups} do not hold every rank 0 … {n - 1} once; plan again "
            "(`meshpilot plan ... --out FILE`)"
        )
    for j, (st, p) in enumerate(zip(plan.stages, plan.intra)):
        validate_plan(p, world_size=len(st.ranks), source=f"{where}stage {j}")
        if any(z.gathered_once for z in p.zero):
            raise UserError(
                f"{where}stage {j}: ZeRO stage 2 switches, which the pipeline runtime does not run (it gathers "
                "ZeRO weights where they are read); plan again with zero='3' or 'auto'"
            )
    if graph is None:
        return
    from meshpilot.planner.stage import runnable_layers, slice_graph

    run_layers = runnable_layers(graph)
    if len(run_layers) != plan.stages[-1].layers[1]:
        raise UserError(
            f"{where}planned for {plan.stages[-1].layers[1]} layers but the model has {len(run_layers)}; give the "
            "model the plan was made for"
        )
    for j, (st, p) in enumerate(zip(plan.stages, plan.intra)):
        validate_plan(p, graph=slice_graph(graph, st.layers[0], st.layers[1], run_layers), source=f"{where}stage {j}")
    check_no_random(graph)
    _check_transfers(plan, graph, run_layers, where)


def _check_transfers(plan: Any, graph: Any, run_layers: Any, where: str) -> None:
    """The plan's transfers (``Plan.transfers``: what the simulator prices) are the values that cross its
    stage boundaries in `graph` (``pipeline.stage_transfers``); a plan saved before it kept them has none."""
    from meshpilot.planner.pipeline import stage_transfers

    if not plan.transfers:
        return
    bounds = [st.layers for st in plan.stages]
    ranks = [st.ranks for st in plan.stages]
    free = _FreeLinks()
    found = {(x.src, x.dst, x.forward): x for x in stage_transfers(graph, run_layers, bounds, ranks, free)}
    for x in plan.transfers:  # by count and bytes: a plan costed on a repeated stack names its few blocks' nodes
        y = found.get((x.src, x.dst, x.forward))
        if y is None or (len(y.values), y.nbytes) != (len(x.values), x.nbytes):
            n, b = (len(y.values), y.nbytes) if y is not None else (0, 0.0)
            raise UserError(
                f"{where}transfers: stage {x.src} → {x.dst} carries {len(x.values)} values ({x.nbytes:.0f} bytes) a "
                f"microbatch in the plan but {n} ({b:.0f} bytes) cross that boundary in this model; plan again for "
                "this model (`meshpilot plan ... --out FILE`)"
            )


class _FreeLinks:
    """A cluster whose links cost nothing: :func:`_check_transfers` compares values, not seconds."""

    def p2p_latency(self, a: int, b: int) -> float:
        return 0.0

    def p2p_bandwidth(self, a: int, b: int) -> float:
        return 1.0


def check_no_random(graph: Any) -> None:
    """One line when the model draws random numbers (dropout in training): a pipeline's stages would draw them on
    other ranks, in another order than one device does, so the pipeline could not equal the single device."""
    from meshpilot.graph.capture import NodeKind
    from meshpilot.runtime.spmd import is_random_op

    drawn = next((n for n in graph.nodes if n.kind == NodeKind.OP and is_random_op(n.target)), None)
    if drawn is not None:
        where = f" in {drawn.module}" if drawn.module else ""
        raise UserError(
            f"{drawn.target}{where}: a pipeline's stages draw random numbers on their own ranks, not in one "
            "device's order, so its training would differ from the single device's; set the model's dropout to 0 "
            "(Hugging Face: --hf-config resid_pdrop=0 embd_pdrop=0 attn_pdrop=0 or its *_dropout keys) or plan "
            "one stage (--stages 1)"
        )


__all__ = ["SUPPORTED_VERSIONS", "check_no_random", "check_version", "validate", "validate_plan"]
