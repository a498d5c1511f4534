"""Plan validation: everything that can be checked about a :class:`~meshpilot.planner.plan.Plan` before a process
group starts, in one pure function.

:func:`validate_plan` raises a one-line :class:`~meshpilot.errors.UserError` naming the file (`source`), the key
and the fix for the first problem found:

* ``version``: one this meshpilot reads (:data:`SUPPORTED_VERSIONS`);
* ``mesh_shape``: one or more positive whole sizes;
* ``mesh_axes``: one distinct, non-empty name per mesh axis;
* ``mesh_ranks``: a permutation of ``range(prod(mesh_shape))`` (no duplicate, none missing or out of range);
* every placement string (``inputs``, ``params``, each node's ``ins`` / ``outs``): ``R``, ``P``, ``P(op)`` or
  ``S(d)``, one per mesh axis, and ``d`` below the tensor's rank where the rank is known (the inputs' from
  ``input_shapes``; with `graph`, the parameters' and every node's);
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
    for node in plan.nodes:
        for a, layout in enumerate(node.ins):
            _check_layout(layout, axes, None, where, f"nodes[{node.name}].ins[{a}]")
        ranks_out = node_ranks.get(node.name, [])
        for i, layout in enumerate(node.outs):
            rank = ranks_out[i] if i < len(ranks_out) else None
            _check_layout(layout, axes, rank, where, f"nodes[{node.name}].outs[{i}]")


__all__ = ["SUPPORTED_VERSIONS", "check_version", "validate_plan"]
