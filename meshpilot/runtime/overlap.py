"""Collectives issued early: a recorded program reordered so communication runs beside compute.

A schedule's ``+c.m`` action (``meshpilot.planner.schedule``) says: issue collective ``c`` before the compute of
plan node ``at``; its ``-c.m`` says: wait for it before its consumer. The recorded program issues every
collective where the interpreter met it — while resharding the consumer's operand, and waits at once —
so :func:`issue_early` moves the collective (with the few ops that prepare its input, recorded under the
same operand tag) up to just before the first op of node ``at``. The wait stays where it was, right before
the consumer's ops: the compute in between runs while the collective is in flight (gloo and NCCL progress
it on their own threads / streams). Only the program's op order changes; every op and value is the same, so
results are bitwise equal to the unordered program's.

A collective is left in place when an input of what would move is not yet computed at the target position.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from meshpilot.ops import in_flight_targets
from meshpilot.planner.schedule import ActionKind, Schedule


def is_collective(node: torch.fx.Node) -> bool:
    """An op that issues a collective: ``_c10d_functional``'s, less ``wait_tensor`` and DTensor's
    ``_wrap_tensor_autograd`` (which only wraps an issued collective's output), and an own op's kernel that
    returns a collective's output in flight (``meshpilot.ops.OwnOp.in_flight``: the MoE's dispatch and
    combine), waited by a later ``wait_tensor`` like a functional collective."""
    if node.op != "call_function":
        return False
    target = node.target
    if getattr(target, "namespace", "") == "_c10d_functional":
        return not str(target).startswith(("_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd"))
    return getattr(target, "namespace", "") == "meshpilot" and str(target) in in_flight_targets()


def issue_points(schedule: Schedule, plan: Any, kind: ActionKind, rank: int) -> dict[tuple[int, int], int]:
    """``(consumer node index, operand) -> node index before which to issue`` for the edges whose first
    collective the schedule issues early in phase `kind` (microbatch 0; every microbatch runs one program)."""
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    out: dict[tuple[int, int], int] = {}
    acts = schedule.actions(rank)
    for pos, a in enumerate(acts):
        if a.kind != ActionKind.ISSUE or a.microbatch != 0:
            continue
        nxt = next((b for b in acts[pos + 1 :] if b.kind.is_compute), None)
        if nxt is None or nxt.kind != kind or nxt.nodes is None:
            continue
        col = plan.collectives[a.collective]
        if col.dst in index:
            out[(index[col.dst], col.operand)] = nxt.nodes[0]
    return out


def issue_early(gm: torch.fx.GraphModule, points: dict[tuple[int, int], int]) -> int:
    """Move each edge's first collective (and its input's preparation) before the first op of the node
    ``points[edge]`` names; returns how many moved (module docstring)."""
    if not points:
        return 0
    nodes = list(gm.graph.nodes)
    first_of: dict[int, torch.fx.Node] = {}
    for n in nodes:
        tag = n.meta.get("meshpilot_tag")
        if isinstance(tag, tuple) and isinstance(tag[0], int):
            first_of.setdefault(tag[0], n)
    moved = 0
    for edge, at in points.items():
        group = [n for n in nodes if n.meta.get("meshpilot_tag") == edge]
        coll = next((n for n in group if is_collective(n)), None)
        anchor = next((first_of[i] for i in sorted(first_of) if i >= at), None)
        if coll is None or anchor is None:
            continue
        chain = preparation(coll, set(group))
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        if order[anchor] >= order[chain[0]]:
            continue  # already issued by then
        if any(order[i] >= order[anchor] for n in chain for i in n.all_input_nodes if i not in chain):
            continue  # its input is not ready at the earlier point
        for n in chain:
            anchor.prepend(n)
        moved += 1
    gm.graph.lint()
    gm.recompile()
    return moved


def preparation(coll: torch.fx.Node, group: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """`coll` and the ops of its operand tag it depends on, in program order."""
    need: set[torch.fx.Node] = set()
    stack = [coll]
    while stack:
        n = stack.pop()
        if n in need:
            continue
        need.add(n)
        stack.extend(i for i in n.all_input_nodes if i in group)
    return [n for n in coll.graph.nodes if n in need]


def issue_when_ready(gm: torch.fx.GraphModule, kind: str) -> int:
    """Move the ops tagged ``(kind, k)`` of every ``k`` (a gradient bucket's flattening and collective:
    ``runtime.buckets``) to right after the last op that computes one of their inputs: the collective is
    issued the moment its last gradient exists, and the compute recorded after that point runs while it is in
    flight; the waits (tagged otherwise) stay where they were. Returns how many groups moved."""
    groups: dict[Any, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        tag = n.meta.get("meshpilot_tag")
        if isinstance(tag, tuple) and len(tag) == 2 and tag[0] == kind:
            groups.setdefault(tag[1], []).append(n)
    moved = 0
    for chain in groups.values():
        members = set(chain)
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        inputs = [i for n in chain for i in n.all_input_nodes if i not in members]
        last_placeholder = max((n for n in gm.graph.nodes if n.op == "placeholder"), key=order.get, default=None)
        anchor = max(inputs, key=order.get, default=last_placeholder)
        if anchor is None:
            continue
        if anchor.op == "placeholder":
            anchor = last_placeholder
        if order[anchor] + 1 >= order[chain[0]]:
            continue  # already right after it
        prev = anchor
        for n in chain:
            prev.append(n)
            prev = n
        moved += 1
    gm.graph.lint()
    gm.recompile()
    return moved


def prefetch(gm: torch.fx.GraphModule, points: dict[tuple[int, int], int]) -> int:
    """Issue each gather ``edge`` of `points` (``meshpilot.planner.prefetch.prefetch_points``: a sharded
    parameter's all-gather, tagged ``edge``) right before the compute of node ``points[edge]`` (its ops tagged
    ``(node, -1)``, after that node's own operands were resharded), with the ops that prepare its input — and
    the views of a parameter it reads that the program computes later (a transpose), moved along. Its wait
    stays before its consumer. Edges go in consumer order, so the collectives are issued in the order they are
    used. Returns how many moved; one whose input is not ready at the anchor stays where it is."""
    if not points:
        return 0
    anchors: dict[int, torch.fx.Node] = {}
    groups: dict[tuple[int, int], list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        tag = n.meta.get("meshpilot_tag")
        if isinstance(tag, tuple) and len(tag) == 2 and isinstance(tag[0], int):
            if tag[1] == -1:
                anchors.setdefault(tag[0], n)
            elif tag in points:
                groups.setdefault(tag, []).append(n)
    moved = 0
    for edge in sorted(points):
        group, anchor = groups.get(edge, []), anchors.get(points[edge])
        coll = next((n for n in group if is_collective(n)), None)
        if coll is None or anchor is None:
            continue
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        chain = preparation(coll, set(group))
        if order[anchor] >= order[chain[0]]:
            continue  # already issued by then
        views = _late_views(chain, order, order[anchor])
        if views is None:
            continue  # its input is computed after the anchor by more than views
        for n in sorted(views, key=order.get) + chain:
            anchor.prepend(n)
        moved += 1
    gm.graph.lint()
    gm.recompile()
    return moved


@dataclass
class _Member:
    """One edge's all-gather in a recorded program: the ops preparing its input and the collective, the views
    funcol applies to the result in flight, and the wait."""

    chain: list[torch.fx.Node]
    coll: torch.fx.Node
    views: list[torch.fx.Node]
    wait: torch.fx.Node


def group_gathers(gm: torch.fx.GraphModule, groups: list[tuple[list[tuple[int, int]], int | None]]) -> int:
    """Run each gather group (``planner.prefetch.GatherGroup``: its edges ``(consumer, operand)`` and the node
    before whose compute it is issued, None: at its first consumer) as one flat all-gather: every member's
    collective (with its preparation and the views of a parameter it reads) moved before that point, their
    inputs flattened into one buffer (``runtime.buckets.flat_shards``) and gathered once right after the last
    of them, waited for where the first member's wait was and split into what each member's collective
    returned (``split_gathered``; the views funcol applies before a wait then apply to that); the members' own
    collectives and waits are gone. Group ``k``'s ops are tagged
    ``(GATHER, k)`` / ``(GATHER_WAIT, k)``. Returns how many groups run so; raises when a member cannot be
    moved there (the plan's collective count would no longer be the program's)."""
    from meshpilot.runtime.buckets import GATHER, GATHER_WAIT, flat_shards, split_gathered

    for k, (edges, at) in enumerate(groups):
        members = _gather_members(gm, edges)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first_wait = min((m.wait for m in members), key=order.get)
        target = first_wait
        if at is not None:
            anchor = next((n for n in gm.graph.nodes if n.meta.get("meshpilot_tag") == (at, -1)), first_wait)
            target = min(anchor, first_wait, key=order.get)
        for m in members:
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            if order[m.coll] < order[target]:
                continue  # issued before the point already
            views = _late_views(m.chain, order, order[target])
            if views is None:
                raise RuntimeError(f"meshpilot internal error: gather group {k}'s {m.coll} cannot be issued early")
            for n in sorted(views, key=order.get) + m.chain:
                target.prepend(n)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        colls = [m.coll for m in members]
        size, name = colls[0].args[1], colls[0].args[2]
        if any(c.target != colls[0].target or c.args[1:] != (size, name) for c in colls):
            raise RuntimeError(f"meshpilot internal error: gather group {k} mixes collectives: {colls}")
        shards = [c.args[0] for c in colls]
        with gm.graph.inserting_after(max(colls, key=order.get)):
            flat = gm.graph.call_function(flat_shards, (shards,))
        with gm.graph.inserting_after(flat):
            issued = gm.graph.call_function(colls[0].target, (flat, size, name))
        with gm.graph.inserting_before(first_wait):
            done = gm.graph.call_function(members[0].wait.target, (issued,))
            parts = gm.graph.call_function(split_gathered, (done, size, shards))
            pieces = [gm.graph.call_function(operator.getitem, (parts, i)) for i in range(len(members))]
        flat.meta["meshpilot_tag"] = issued.meta["meshpilot_tag"] = (GATHER, k)
        for n in (done, parts, *pieces):
            n.meta["meshpilot_tag"] = (GATHER_WAIT, k)
        for m, piece in zip(members, pieces):
            for v in m.views:  # now of the gathered piece, after the split
                m.wait.prepend(v)
            m.coll.replace_all_uses_with(piece)
            m.wait.replace_all_uses_with(m.wait.args[0])
            gm.graph.erase_node(m.wait)
            gm.graph.erase_node(m.coll)
    gm.graph.lint()
    gm.recompile()
    return len(groups)


def _gather_members(gm: torch.fx.GraphModule, edges: list[tuple[int, int]]) -> list[_Member]:
    """Each edge's all-gather in the program (``group_gathers``)."""
    tagged_ops: dict[tuple[int, int], list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        tag = n.meta.get("meshpilot_tag")
        if tag in edges:
            tagged_ops.setdefault(tag, []).append(n)
    out = []
    for e in edges:
        ops = tagged_ops.get(e, [])
        colls = [n for n in ops if is_collective(n)]
        views: list[torch.fx.Node] = []
        x = colls[0] if len(colls) == 1 else None
        while x is not None and len(x.users) == 1 and _is_view(next(iter(x.users))):
            x = next(iter(x.users))  # a view of the collective in flight (funcol applies it before the wait)
            views.append(x)
        wait = next(iter(x.users)) if x is not None and len(x.users) == 1 else None
        if wait is None or "wait_tensor" not in str(wait.target):
            found = [str(n.target) for n in ops]
            raise RuntimeError(f"meshpilot internal error: operand {e} is not resharded by one all-gather: {found}")
        out.append(_Member(preparation(colls[0], set(ops)), colls[0], views, wait))
    return out


def _is_view(n: torch.fx.Node) -> bool:
    """An op whose result aliases its input (a slice, a view): no collective, nothing written."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None or schema.is_mutable or is_collective(n):
        return False
    return any(a.alias_info is not None for a in schema.returns)


def _late_views(chain: list[torch.fx.Node], order: dict, at: int) -> list[torch.fx.Node] | None:
    """The ops outside `chain` it reads that run at or after position `at`, when each is a view op (no
    collective, nothing written) of values ready before `at`; None when another op stands in the way."""
    out: list[torch.fx.Node] = []
    stack = [i for n in chain for i in n.all_input_nodes if i not in chain]
    while stack:
        n = stack.pop()
        if order[n] < at or n in out:
            continue
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or schema.is_mutable or is_collective(n):
            return None
        if not any(a.alias_info is not None for a in schema.returns) or len(out) >= 4:
            return None  # only views (cheap, no new memory) are moved
        out.append(n)
        stack.extend(n.all_input_nodes)
    return out
