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
plan solved to a tight cap exceeds it). A gather group keeps every member's gathered copy from the group's wait
(before its first consumer) to the member's last use, and while it splits the flat result it holds the flat
buffer and the copies at once (twice the group's bytes, briefly): also not counted.

**Gather groups (one flat collective a layer).** Issued one per edge, a ZeRO-3 step of the zoo GPT runs 88
all-gathers where FSDP2 runs 9, and on a CPU host each collective costs about as much as its bytes. So the
planner groups them as FSDP2 does (:func:`plan_gathers`, recorded as ``StagePlan.param_gathers``): within a
layer's group above, the edges whose whole resharding is one all-gather (one collective on the edge) with the
same mesh axis and dtype form a :class:`GatherGroup`, run as one all-gather of the members' local shards
flattened into one buffer (``meshpilot.runtime.overlap.group_gathers``), issued where the rule above issues the
layer's gathers (``issue_at``: the previous group's first consumer; the phase's first group at its own first
consumer) and waited for before the group's first consumer. Edges resharded by several collectives (a 2-D
mesh's gather over two axes) keep their own, prefetched as above. The backward gathers again (FSDP2's
reshard-after-forward): the forward's gathered copies are not kept for it, as the plan's memory accounting
assumes. Groups run under the :data:`PREFETCHED` schedules only (:func:`active_gathers`).

**Pricing.** :func:`prefetch_issues` is the same rule as the simulator reads it (``meshpilot.sim.simulate``'s
``prefetch``): each prefetched gather an issue before the anchor's compute and a wait at its consumer,
queued on its mesh axis' group in issue order like every collective there; a gather group one collective of
its summed bytes (one latency), issued at ``issue_at`` and waited at its first consumer. The closed form
:func:`gather_hidden_s` walks each phase the same way (what the grouping and the prefetch take off the
plan's serial price, which counts every gather on its own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from meshpilot.graph.capture import NodeKind, OpGraph, Phase
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


@dataclass(frozen=True)
class GatherGroup:
    """Sharded parameters' gathers of one layer run as one all-gather of their local shards, flattened into one
    buffer (module docstring, *Gather groups*)."""

    layer: str
    phase: Phase
    axis: int
    """The mesh axis it gathers over."""
    params: tuple[str, ...]
    """The parameter each member gathers (itself or through a view), in consumer order."""
    edges: tuple[tuple[str, int], ...]
    """``(consumer node, operand)`` of each member, in consumer order: the plan's collectives it replaces."""
    nbytes: int
    """The gathered output, every member's summed (``CollectiveKind``'s all-gather convention)."""
    issue_at: str = ""
    """The node before whose compute it is issued (the previous group's first consumer); empty: right before
    its own first consumer."""
    seconds: float = 0.0
    """The collective's time on the planned cluster."""

    kind = CollectiveKind.ALL_GATHER
    issued_by_op = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GatherGroup:
        """A group as a plan file stores it (the plan's ``dataclasses.asdict``)."""
        edges = tuple((str(n), int(a)) for n, a in d["edges"])
        return cls(d["layer"], Phase(d["phase"]), int(d["axis"]), tuple(d["params"]), edges, int(d["nbytes"]),
                   d.get("issue_at", ""), float(d.get("seconds", 0.0)))  # fmt: skip


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


def plan_gathers(plan: Any, graph: OpGraph, cost: Any) -> tuple[GatherGroup, ...]:
    """The gather groups of `plan` (a ``StagePlan`` of `graph`), both phases, priced on the cost model `cost`
    (module docstring, *Gather groups*); none where its schedule does not prefetch (:data:`PREFETCHED`)."""
    if plan.step_schedule().name not in PREFETCHED:
        return ()
    per_edge: dict[tuple[str, str, int], list[Any]] = {}
    for col in plan.collectives:
        if col.operand >= 0 and col.src != col.dst:
            per_edge.setdefault((col.phase, col.dst, col.operand), []).append(col)
    out: list[GatherGroup] = []
    for phase in (Phase.FWD, Phase.BWD):
        layers = prefetch_groups(plan, graph, phase.value)
        for k, g in enumerate(layers):
            issue_at = plan.nodes[layers[k - 1].first].name if k else ""
            runs: dict[tuple[int, str], list[tuple[tuple[str, int], Any]]] = {}
            for d, a in g.edges:
                edge = (plan.nodes[d].name, a)
                cols = per_edge.get((phase.value, *edge), [])
                if len(cols) != 1:  # resharded by more than its gather: keeps its own collectives
                    continue
                dtype = str(graph[cols[0].src].outputs[0].dtype)
                runs.setdefault((cols[0].axis, dtype), []).append((edge, cols[0]))
            for (axis, _), members in runs.items():
                nbytes = sum(c.nbytes for _, c in members)
                params = tuple(param_root(graph, c.src) or "" for _, c in members)
                edges = tuple(e for e, _ in members)
                seconds = cost.all_gather(nbytes, axis)
                out.append(GatherGroup(g.layer, phase, axis, params, edges, nbytes, issue_at, seconds))
    return tuple(out)


def active_gathers(plan: Any) -> tuple[GatherGroup, ...]:
    """The plan's gather groups where its schedule runs them (:data:`PREFETCHED`), else none: the runtime, the
    collective count and the simulator read this one rule."""
    groups = getattr(plan, "param_gathers", ())
    if not groups or plan.step_schedule().name not in PREFETCHED:
        return ()
    return tuple(groups)


def grouped_edges(plan: Any) -> set[tuple[str, str, int]]:
    """``(phase, consumer, operand)`` of every edge whose gather a group of :func:`active_gathers` runs."""
    return {(g.phase.value, n, a) for g in active_gathers(plan) for n, a in g.edges}


def prefetch_points(plan: Any, graph: OpGraph, phase: str) -> dict[tuple[int, int], int]:
    """``(consumer index, operand) -> node index`` before whose compute the gather is issued: group ``k+1``'s
    at group ``k``'s first consumer (module docstring)."""
    groups = prefetch_groups(plan, graph, phase)
    return {edge: prev.first for prev, nxt in zip(groups, groups[1:]) for edge in nxt.edges}


def prefetch_issues(plan: Any, graph: OpGraph) -> dict[int, list[int]]:
    """Both phases' prefetch of the gathers no group runs, as the simulator reads it
    (``meshpilot.sim.simulate(prefetch=...)``; the groups it reads from the plan): node index -> the collectives
    (indices into ``plan.collectives``: each edge's first) issued right before that node's compute, in issue
    order; each is waited for at its consumer instead of blocking there. Empty where the plan's schedule does
    not prefetch (:data:`PREFETCHED`)."""
    if plan.step_schedule().name not in PREFETCHED:
        return {}
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    grouped = grouped_edges(plan)
    first: dict[tuple[int, int], int] = {}
    for c, col in enumerate(plan.collectives):
        if col.operand >= 0 and col.src != col.dst and col.dst in index:
            first.setdefault((index[col.dst], col.operand), c)
    out: dict[int, list[int]] = {}
    for phase in ("fwd", "bwd"):
        for edge, at in sorted(prefetch_points(plan, graph, phase).items()):
            if (phase, plan.nodes[edge[0]].name, edge[1]) not in grouped:
                out.setdefault(at, []).append(first[edge])
    return out


def gather_hidden_s(plan: Any, graph: OpGraph, cost: Any) -> float:
    """Seconds the gather groups and the prefetch take off the step on the cost model `cost` (module docstring,
    *Pricing*): each phase walked once as the plan's serial price has it (every gather its own collective,
    blocking at its consumer) and once as the runtime runs it (each group one collective issued at its
    ``issue_at``, the other gathers at :func:`prefetch_issues`' anchors), the difference summed. The walk is the
    simulator's for one rank: node seconds on the compute stream, each axis' collectives one at a time in issue
    order (``planner.buckets``' queue, busy factors included), a wait ending when its own collective does. The
    gradients' buckets are left out."""
    issues = prefetch_issues(plan, graph)
    groups = active_gathers(plan)
    if not issues and not groups:
        return 0.0
    serial = sum(_walk(plan, cost, ph, {}, ()) for ph in ("fwd", "bwd"))
    return serial - sum(_walk(plan, cost, ph, issues, groups) for ph in ("fwd", "bwd"))


def _walk(plan: Any, cost: Any, phase: str, issues: dict[int, list[int]], groups: tuple[GatherGroup, ...]) -> float:
    """The end of `phase`'s compute stream with `issues` prefetched and `groups` run (:func:`gather_hidden_s`).
    A collective is named by its index in ``plan.collectives``, a group by ``("group", k)``."""
    from meshpilot.planner.buckets import _progress, _seconds  # the bucket pricing's own parts

    index = {n.name: i for i, n in enumerate(plan.nodes)}
    grouped = {(g.phase.value, n, a) for g in groups for n, a in g.edges}
    coll: dict[Any, Any] = dict(enumerate(plan.collectives))
    before: dict[int, list[Any]] = {}
    early: set[Any] = {c for cs in issues.values() for c in cs}
    at: dict[int, list[Any]] = {i: list(cs) for i, cs in issues.items()}
    for k, g in enumerate(groups):
        if g.phase.value != phase:
            continue
        coll[("group", k)] = g
        before.setdefault(min(index[n] for n, _ in g.edges), []).append(("group", k))
        if g.issue_at:
            early.add(("group", k))
            at.setdefault(index[g.issue_at], []).append(("group", k))
    for c, col in enumerate(plan.collectives):
        own = (col.phase, col.dst, col.operand) not in grouped
        if own and col.phase == phase and col.dst in index and not col.dst.startswith("grad:"):
            before.setdefault(index[col.dst], []).append(c)
    spans: list[tuple[float, float]] = []
    free: dict[int, float] = {}
    queued: dict[int, list[tuple[Any, float]]] = {}
    ends: dict[Any, float] = {}
    t = 0.0

    def drain(axis: int, until: Any = None) -> float:
        """Run `axis`' queued collectives in issue order (through `until`, else all), now that the compute
        spans they overlap are known (the rank waits from here): when the last of them ends."""
        q = queued.get(axis, [])
        while q:
            c, start = q.pop(0)
            seconds, busy, _ = _seconds(cost, coll[c])
            ends[c] = free[axis] = _progress(max(start, free.get(axis, 0.0)), seconds, spans, busy)
            if c == until:
                break
        return free.get(axis, 0.0)

    for i, n in enumerate(plan.nodes):
        if n.phase != phase:
            continue
        for c in before.get(i, ()):
            axis = coll[c].axis
            if c in early:  # issued a layer ago: wait for it alone
                t = max(t, ends[c] if c in ends else (drain(axis, c), ends[c])[1])
            else:  # issued now behind what its group has queued, waited at once
                t += _seconds(cost, coll[c])[2]  # its host cost, on the compute stream
                queued.setdefault(axis, []).append((c, t))
                t = max(t, drain(axis))
        for c in at.get(i, ()):
            t += _seconds(cost, coll[c])[2]
            queued.setdefault(coll[c].axis, []).append((c, t))
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
    "GatherGroup",
    "PrefetchGroup",
    "active_gathers",
    "gather_hidden_s",
    "grouped_edges",
    "plan_gathers",
    "layer_of",
    "param_root",
    "prefetch_groups",
    "prefetch_issues",
    "prefetch_points",
    "prefetch_window_bytes",
]
