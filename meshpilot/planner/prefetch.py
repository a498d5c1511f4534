"""Sharded parameters' all-gathers prefetched one layer ahead: where each is issued (ZeRO-3, FSDP's prefetch).

A plan that shards a parameter (ZeRO-3) all-gathers it where an op reads it replicated: the collective is
issued right before that op and waited at once, so the op waits for the whole gather. FSDP instead issues the
next module's gather while the current module computes. This module says where each parameter gather of a
phase is issued so the runtime (``meshpilot.runtime.overlap.prefetch``) and anything that prices the step read
one rule (:func:`prefetch_points`).

**Layers.** The gathers of a phase whose source is a parameter, or a view of one (a transpose the plan
shards and gathers, at most :data:`MAX_VIEW_DEPTH` views from the parameter), are taken in
the order of their consumers. A parameter's *layer* is its name up to the first numeric component
(``blocks.2.attn.qkv.weight`` -> ``blocks.2``), else its module (``wte.weight`` -> ``wte``). Consecutive
gathers of one layer form a group; groups ``G_0, G_1, ...`` follow the consumer order (a tied weight read
at both ends of the forward is two groups).

**Issue points.** Group ``G_{k+1}``'s gathers are issued right before the compute of ``G_k``'s first
consumer (after ``G_k``'s own gathers were waited for: they were issued one group earlier), so they run
while layer ``k`` computes; ``G_0``'s stay where the plan puts them. Each wait stays right before its
consumer. The backward's groups run in its own consumer order: the reverse of the forward's layers. A
gathered copy is then live from ``G_k``'s first consumer to its own last use: one layer longer than
without prefetch (:func:`prefetch_window_bytes` is the most such bytes live at once). The plan's predicted
memory does not count that window yet: it would belong in the ILP's memory row (added to a solved plan, a
plan solved to a tight cap exceeds it).

**Pricing.** :func:`prefetch_issues` is the same rule as the simulator reads it (``meshpilot.sim.simulate``'s
``prefetch``): each prefetched gather an issue before the anchor's compute and a wait at its consumer,
queued on its mesh axis' group in issue order like every collective there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from meshpilot.graph.capture import NodeKind, OpGraph
from meshpilot.sharding.reshard import CollectiveKind

PREFETCHED = ("trivial", "accumulate")
"""Schedules under which the runtime prefetches (the others order their collectives themselves: ``overlapped``,
``duplex``; or run a pipeline's stages)."""
MAX_VIEW_DEPTH = 3
"""How many views (a transpose, a reshape) may stand between a parameter and the value gathered."""

_INDEX = re.compile(r"^(.*?\.\d+)(\.|$)")


@dataclass(frozen=True)
class PrefetchGroup:
    """The gathers of one layer that run back to back in a phase."""

    layer: str
    edges: tuple[tuple[int, int], ...]
    """``(consumer node index, operand)`` of each gather, in consumer order."""
    first: int
    """The index of the group's first consumer node."""
    nbytes: int
    """The gathered bytes of the group (each gather's output)."""


def layer_of(fqn: str) -> str:
    """A parameter's layer: its name up to the first numeric component, else its module (module docstring)."""
    m = _INDEX.match(fqn)
    if m:
        return m.group(1)
    return fqn.rpartition(".")[0] or fqn


def param_root(graph: OpGraph, name: str) -> str | None:
    """The parameter `name` is, or is a view of (``OpGraph.view_chain``, at most :data:`MAX_VIEW_DEPTH`
    views back); None for anything else."""
    node = graph[graph.view_chain(name, MAX_VIEW_DEPTH)[-1]]
    return node.fqn if node.kind == NodeKind.PARAM else None


def prefetch_groups(plan: Any, graph: OpGraph, phase: str) -> list[PrefetchGroup]:
    """The parameter-gather groups of `phase` (``fwd`` / ``bwd``) in consumer order (module docstring)."""
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    seen: set[tuple[str, int]] = set()
    gathers: list[tuple[int, int, str, int]] = []
    for col in plan.collectives:
        if col.phase != phase or col.operand < 0 or col.src == col.dst or col.dst not in index:
            continue
        if (col.dst, col.operand) in seen:  # only an edge's first collective is what the consumer waits for
            continue
        seen.add((col.dst, col.operand))
        if col.kind != CollectiveKind.ALL_GATHER.value or col.src not in graph.by_name:
            continue
        fqn = param_root(graph, col.src)
        if fqn is not None:
            gathers.append((index[col.dst], col.operand, layer_of(fqn), col.nbytes))
    gathers.sort()
    groups: list[PrefetchGroup] = []
    run: list[tuple[int, int, str, int]] = []
    for g in [*gathers, None]:
        if run and (g is None or g[2] != run[0][2]):
            edges = tuple((d, a) for d, a, _, _ in run)
            groups.append(PrefetchGroup(run[0][2], edges, run[0][0], sum(b for *_, b in run)))
            run = []
        if g is not None:
            run.append(g)
    return groups


def prefetch_points(plan: Any, graph: OpGraph, phase: str) -> dict[tuple[int, int], int]:
    """``(consumer index, operand) -> node index`` before whose compute the gather is issued: group ``k+1``'s
    at group ``k``'s first consumer (module docstring)."""
    groups = prefetch_groups(plan, graph, phase)
    return {edge: prev.first for prev, nxt in zip(groups, groups[1:]) for edge in nxt.edges}


def prefetch_issues(plan: Any, graph: OpGraph) -> dict[int, list[int]]:
    """Both phases' prefetch as the simulator reads it (``meshpilot.sim.simulate(prefetch=...)``): node index
    -> the collectives (indices into ``plan.collectives``: each edge's first) issued right before that node's
    compute, in issue order; each is waited for at its consumer instead of blocking there. Empty where the
    plan's schedule does not prefetch (:data:`PREFETCHED`)."""
    if plan.step_schedule().name not in PREFETCHED:
        return {}
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    first: dict[tuple[int, int], int] = {}
    for c, col in enumerate(plan.collectives):
        if col.operand >= 0 and col.src != col.dst and col.dst in index:
            first.setdefault((index[col.dst], col.operand), c)
    out: dict[int, list[int]] = {}
    for phase in ("fwd", "bwd"):
        for edge, at in sorted(prefetch_points(plan, graph, phase).items()):
            out.setdefault(at, []).append(first[edge])
    return out


def prefetch_hidden_s(plan: Any, graph: OpGraph, cost: Any) -> float:
    """Seconds the prefetch takes off the step on the cost model `cost` (module docstring, *Pricing*): each
    phase walked once with every gather blocking at its consumer and once with :func:`prefetch_issues`'s issued
    at their anchors, the difference summed. The walk is the simulator's for one rank: node seconds on the
    compute stream, each axis' collectives one at a time in issue order (``planner.buckets``' queue, busy
    factors included), a wait ending when its own collective does. The gradients' buckets are left out."""
    issues = prefetch_issues(plan, graph)
    if not issues:
        return 0.0
    return sum(_walk(plan, cost, ph, {}) - _walk(plan, cost, ph, issues) for ph in ("fwd", "bwd"))


def _walk(plan: Any, cost: Any, phase: str, issues: dict[int, list[int]]) -> float:
    """The end of `phase`'s compute stream with `issues` prefetched (:func:`prefetch_hidden_s`)."""
    from meshpilot.planner.buckets import _progress, _seconds  # the bucket pricing's own parts

    index = {n.name: i for i, n in enumerate(plan.nodes)}
    before: dict[int, list[int]] = {}
    for c, col in enumerate(plan.collectives):
        if col.phase == phase and col.dst in index and not col.dst.startswith("grad:"):
            before.setdefault(index[col.dst], []).append(c)
    early = {c for cs in issues.values() for c in cs}
    spans: list[tuple[float, float, float]] = []
    free: dict[int, float] = {}
    queued: dict[int, list[tuple[int, float]]] = {}
    ends: dict[int, float] = {}
    t = 0.0

    def drain(axis: int, until: int | None = None) -> float:
        """Run `axis`' queued collectives in issue order (through `until`, else all), now that the compute
        spans they overlap are known (the rank waits from here): when the last of them ends."""
        q = queued.get(axis, [])
        while q:
            c, at = q.pop(0)
            seconds, busy = _seconds(cost, plan.collectives[c])
            ends[c] = free[axis] = _progress(max(at, free.get(axis, 0.0)), seconds, [(a, b, busy) for a, b in spans])
            if c == until:
                break
        return free.get(axis, 0.0)

    for i, n in enumerate(plan.nodes):
        if n.phase != phase:
            continue
        for c in before.get(i, ()):
            axis = plan.collectives[c].axis
            if c in early:  # issued a layer ago: wait for it alone
                t = max(t, ends[c] if c in ends else (drain(axis, c), ends[c])[1])
            else:  # issued now behind what its group has queued, waited at once
                queued.setdefault(axis, []).append((c, t))
                t = max(t, drain(axis))
        for c in issues.get(i, ()):
            queued.setdefault(plan.collectives[c].axis, []).append((c, t))
        if n.seconds > 0:
            spans.append((t, t + n.seconds))
            t += n.seconds
    return t


def prefetch_window_bytes(plan: Any, graph: OpGraph, phase: str) -> int:
    """The most gathered bytes prefetch keeps live beyond what the plan's own accounting counts: while group
    ``k`` computes, group ``k+1``'s gathered copies already exist (the largest such group)."""
    groups = prefetch_groups(plan, graph, phase)
    return max((g.nbytes for g in groups[1:]), default=0)


__all__ = [
    "MAX_VIEW_DEPTH",
    "PREFETCHED",
    "PrefetchGroup",
    "layer_of",
    "param_root",
    "prefetch_groups",
    "prefetch_hidden_s",
    "prefetch_issues",
    "prefetch_points",
    "prefetch_window_bytes",
]
