"""Gradient buckets: which gradients share one collective, and how much of it the backward hides.

A plan's gradient synchronisation reshards every gradient from the layout the backward leaves it in (a partial
sum over the data-parallel axis) into its parameter's layout: one all-reduce (parameter replicated) or one
reduce-scatter (parameter sharded, ZeRO) per gradient, issued after the whole backward. Production runtimes
(DDP, FSDP) instead group gradients into buckets in the order the backward produces them, flatten each bucket
into one buffer and issue its collective the moment the bucket's last gradient exists, so it runs while the
backward computes the gradients of earlier layers; the step waits for the buckets only before the optimizer.
This module decides the buckets (:func:`plan_buckets`) and prices the overlap (:func:`bucket_overlap`);
``meshpilot.runtime.program`` issues them.

**Which gradients.** A gradient joins a bucket when its resharding is one collective on one mesh axis ``a``
(every other axis' placement already the parameter's): ``P -> R`` on ``a`` (an all-reduce) or ``P -> S(d)``
on ``a`` (a reduce-scatter; ``d`` divisible by the axis and sharded by no other axis), with a sum partial.
Gradients of one bucket share (kind, axis, dtype). Anything else keeps its own collectives, after the backward.

**Bucket size (alpha-beta).** A ring all-reduce of ``M`` bytes over ``n`` ranks takes
``T(M) = 2(n-1) alpha + 2(n-1)/n * M / B'`` (``meshpilot.cluster.cost``). The latency term is wasted per
collective, so a bucket should be big enough that it is a small fraction ``f`` of ``T``:

    2(n-1) alpha <= f * T(M)   <=>   M >= n * alpha * B' * (1 - f) / f.

Buckets much bigger than that hide less: the last bucket is issued only after the last gradient and is
never hidden, and a bucket's collective cannot start before its last gradient. So the size is the smallest
``M`` with latency share ``<= f`` (``f = LATENCY_SHARE`` = 10 %), found by bisection on the cost model's own
``T`` (so a probed curve counts, not only alpha and B'), clamped to [``MIN_BUCKET``, ``MAX_BUCKET``] (DDP's
25 MiB default is the top). On this repository's 4 gloo ranks over loopback (alpha 125 us, B' 0.25 GB/s) that
is about 1.1 MB.

**Bucket size with a host cost on the compute stream.** On a CPU device each collective also takes
``h = DeviceProfile.collective_overhead`` from the rank's compute (``CostModel.compute_host_s``): ``K`` buckets
of ``G`` gradient bytes cost ``K h`` that nothing hides, where the latency rule above weighs ``h`` as if it
ran beside the backward. There :func:`plan_buckets` prices the step's buckets (:func:`bucket_overlap`, below,
``h`` on the compute stream) at every size of :func:`candidate_sizes` (the latency rule's, and ``MIN_BUCKET``
doubling to ``MAX_BUCKET``) and keeps the one whose buckets the step waits for least (``exposed_s``; the
smaller size on a tie): ``K h`` against the last buckets' exposed tail. Elsewhere (``h`` = 0, or a GPU whose
``h`` stays latency) the latency rule alone decides, as before.

**Overlap (pricing).** Where a step runs the backward once (:func:`backward_issues_buckets`: one microbatch,
no ``I``/``W`` split) the backward issues bucket ``k`` the moment its last gradient exists and waits for every
bucket at its end (``meshpilot.runtime.program``); elsewhere ``G`` issues them all after the last backward and
waits for them. A mesh axis' process group runs one collective at a time, in issue order (gloo's work queue,
NCCL's stream), so a bucket starts when it is issued and its group's previous collective is done — and a
collective of the backward itself (tensor parallelism, ZeRO-3's gathers) on that group waits for the buckets
issued before it, delaying the backward. :func:`bucket_overlap` walks the backward as the simulator lowers it
(:func:`_own_collectives`: node seconds, its own collectives blocking where the plan places them) with a queue
per group (:class:`_Groups`): with ``T_k`` bucket ``k``'s time (:func:`collective_parts`, the simulator's), ``f_k``
its busy factor (``CostModel.busy_factor``; 1 on GPUs), ``r_k`` the moment its last gradient is ready and
``adv(t, x)`` the moment ``x`` alone-seconds started at ``t`` are done (rate ``1/f_k`` in the backward's compute
spans, 1 elsewhere: :func:`_progress`),

    e_k = adv(max(r_k, e_prev), T_k)     (e_prev: the group's previous collective's end; at ``G``: r_k = 0)

a blocking collective ``c`` of the backward runs ``max(t, e_prev) .. + T_c`` and the compute stream resumes
after it. On a CPU device a collective's host cost ``h_k`` (``CostModel.compute_host_s``) is paid by the
compute stream when it is issued (``t += h_k``, never counted in ``t_alone``) and ``T_k`` excludes it.
The step then waits ``(t_backward - t_alone) + max(0, max_k e_k - t_backward)`` for the buckets:
how much they delayed the backward (``t_alone``: its end with no bucket ahead of its collectives) and what
runs after it (at ``G``: ``max_k e_k``). Equal to the simulated step (``tests/test_sim_buckets.py``,
``test_sim``) but where the simulator shares a cluster layer's link between two groups' transfers at once
(processor sharing), which this closed form does not model. The serial step's per-gradient collectives cost
beyond that is hidden: :attr:`BucketOverlap.hidden_s`, kept as ``StepTime.hidden_s``; the predicted step
``StepTime.overlapped_s`` is what the mesh search compares (:func:`choice_hidden_s`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.graph.capture import NodeKind, OpGraph, Phase
from meshpilot.ops import leading_collectives
from meshpilot.planner.schedule import ActionKind
from meshpilot.sharding.placements import from_json
from meshpilot.sharding.reshard import CollectiveKind

LATENCY_SHARE = 0.1
"""``f``: the largest share of a bucket's collective time its latency may take (module docstring)."""
MIN_BUCKET = 256 * 1024
MAX_BUCKET = 25 * 1024 * 1024
"""Bucket size bounds in bytes (the top is DDP's default ``bucket_cap_mb``)."""


@dataclass(frozen=True)
class GradBucket:
    """Gradients synchronised by one collective on one flat buffer."""

    params: tuple[str, ...]
    """Parameter names, in the order the backward produces their gradients."""
    kind: CollectiveKind
    """``ALL_REDUCE`` or ``REDUCE_SCATTER`` (stored in plan files as its value)."""
    axis: int
    """The mesh axis it runs over."""
    nbytes: int
    """The flat buffer one rank issues (the gradients as the backward leaves them)."""
    seconds: float = 0.0
    """The collective's time on the planned cluster."""


@dataclass(frozen=True)
class GradMove:
    """How one gradient reaches its parameter's layout, when it is one bucketable collective."""

    kind: CollectiveKind
    axis: int
    dim: int
    """The shard dim of a reduce-scatter (-1 for an all-reduce)."""


def grad_move(held: Sequence[Any], target: Sequence[Any], shape: Sequence[int], mesh_shape: Sequence[int]):
    """The :class:`GradMove` from layout `held` to `target` of a gradient of global `shape`, or None when it is
    not one sum-reduction on one axis (module docstring, *Which gradients*)."""
    diff = [a for a, n in enumerate(mesh_shape) if n > 1 and held[a] != target[a]]
    if len(diff) != 1:
        return None
    a = diff[0]
    src, dst = held[a], target[a]
    if not isinstance(src, Partial) or getattr(src, "reduce_op", "sum") != "sum":
        return None
    if isinstance(dst, Replicate):
        return GradMove(CollectiveKind.ALL_REDUCE, a, -1)
    if not isinstance(dst, Shard):
        return None
    d = dst.dim
    others = [b for b, p in enumerate(held) if b != a and isinstance(p, Shard) and p.dim == d and mesh_shape[b] > 1]
    if others or d >= len(shape) or shape[d] % mesh_shape[a]:
        return None
    return GradMove(CollectiveKind.REDUCE_SCATTER, a, d)


def local_numel(shape: Sequence[int], layout: Sequence[Any], mesh_shape: Sequence[int]) -> int:
    """Elements of one rank's piece of a tensor of `shape` in `layout` (even shards: ceil)."""
    dims = list(shape)
    for a, p in enumerate(layout):
        if isinstance(p, Shard) and mesh_shape[a] > 1:
            dims[p.dim] = -(-dims[p.dim] // mesh_shape[a])
    n = 1
    for d in dims:
        n *= d
    return n


def bucket_bytes(cost: Any, axis: int, share: float = LATENCY_SHARE) -> int:
    """The bucket size on mesh axis `axis` of the cost model `cost` (module docstring, *Bucket size*): the
    smallest ``M`` whose all-reduce spends at most `share` of its time on latency."""
    latency = cost.all_reduce(1, axis)
    if latency <= 0:
        return MAX_BUCKET
    lo, hi = MIN_BUCKET, MAX_BUCKET
    if cost.all_reduce(hi, axis) * share < latency:
        return MAX_BUCKET
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        if cost.all_reduce(mid, axis) * share >= latency:
            hi = mid
        else:
            lo = mid
    return hi


def plan_buckets(
    graph: OpGraph, plan: Any, cost: Any, size: int | None = None, in_backward: bool = True
) -> tuple[GradBucket, ...]:
    """The gradient buckets of `plan` (a ``StagePlan`` of `graph`), each at most about `size` bytes (default:
    :func:`bucket_bytes` of its axis; on a device whose host cost per collective the compute stream pays, the
    size of :func:`candidate_sizes` whose buckets `plan`'s step, issuing them in the backward (`in_backward`)
    or at ``G``, waits for least), in the order their last gradients are produced (module docstring)."""
    found = _bucketable(graph, plan)
    if size is not None or not found or not cost.host_on_compute:
        return _grouped(found, cost, size)
    best: tuple[float, tuple[GradBucket, ...]] | None = None
    for cap in candidate_sizes(cost, {key[1] for _, _, key, _ in found}):
        buckets = _grouped(found, cost, cap)
        waited = bucket_overlap(plan, buckets, cost, in_backward).exposed_s
        if best is None or waited < best[0] * (1 - 1e-9):
            best = (waited, buckets)
    assert best is not None
    return best[1]


def candidate_sizes(cost: Any, axes: set[int]) -> list[int]:
    """Bucket sizes :func:`plan_buckets` prices where the compute stream pays a host cost per collective: the
    latency rule's (:func:`bucket_bytes`) on `axes`, and ``MIN_BUCKET`` doubling up to ``MAX_BUCKET``."""
    sizes = {bucket_bytes(cost, a) for a in axes}
    m = MIN_BUCKET
    while m < MAX_BUCKET:
        sizes.add(m)
        m *= 2
    sizes.add(MAX_BUCKET)
    return sorted(sizes)


def _bucketable(graph: OpGraph, plan: Any) -> list[tuple[int, str, tuple, int]]:
    """(node index, parameter, (kind, axis, dtype), bytes) of every gradient one collective synchronises, in the
    order the backward produces them (module docstring, *Which gradients*)."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    found = []
    for fqn, g in graph.grads.items():
        if g is None:
            continue
        held, target = from_json(plan.node(g[0]).outs[g[1]]), plan.param_layout(fqn)
        info = graph[g[0]].outputs[g[1]]
        if held is None or info is None:
            continue
        move = grad_move(held, target, info.shape, plan.mesh_shape)
        if move is None:
            continue
        nbytes = local_numel(info.shape, held, plan.mesh_shape) * info.itemsize
        found.append((index[g[0]], fqn, (move.kind, move.axis, info.dtype), nbytes))
    found.sort(key=lambda x: x[0])
    return found


def _grouped(found: list[tuple[int, str, tuple, int]], cost: Any, size: int | None) -> tuple[GradBucket, ...]:
    """`found` (:func:`_bucketable`) cut into buckets of at most about `size` bytes (default: :func:`bucket_bytes`
    of each axis), each closed once it reaches the size, ordered by their last gradient."""
    open_: dict[tuple, list] = {}
    done: list[tuple[int, tuple, list]] = []
    caps: dict[int, int] = {}  # each axis' size searched once, not once per gradient (~18 prices a search)
    for at, fqn, key, nbytes in found:
        if size is not None:
            cap = size
        elif (cap := caps.get(key[1])) is None:
            cap = caps[key[1]] = bucket_bytes(cost, key[1])
        b = open_.setdefault(key, [[], 0])
        b[0].append(fqn)
        b[1] += nbytes
        if b[1] >= cap:
            done.append((at, key, open_.pop(key)))
    last = {fqn: at for at, fqn, _, _ in found}
    done += [(last[b[0][-1]], key, b) for key, b in open_.items()]
    done.sort(key=lambda x: x[0])
    out = []
    for _, (kind, axis, _), (params, nbytes) in done:
        out.append(GradBucket(tuple(params), kind, axis, nbytes, bucket_fn(cost, kind)(nbytes, axis)))
    return tuple(out)


@dataclass(frozen=True)
class BucketOverlap:
    """The buckets' time in the step (module docstring, *Overlap*)."""

    bucket_s: float
    """Their collectives' seconds, summed."""
    replaced_s: float
    """The per-gradient collectives they replace (what the serial step priced)."""
    exposed_s: float
    """What the step still waits for after the backward (or, synchronised at ``G``, the buckets' span there)."""

    @property
    def hidden_s(self) -> float:
        """What the serial price (`replaced_s`) overstates: the buckets' fewer latencies and their overlap."""
        return self.replaced_s - self.exposed_s


def backward_issues_buckets(schedule: Any) -> bool:
    """Whether a step of `schedule` runs a stage's backward program exactly once (one microbatch, the backward
    not cut into ``I`` and ``W``), so the backward issues each bucket right after its last gradient; otherwise
    ``G`` issues every bucket after the last backward. ``meshpilot.runtime.program`` decides by this rule, and
    the pricing here and the simulator follow it."""
    if schedule is None or schedule.microbatches != 1:
        return False
    split = (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    return not any(a.kind in split for c in schedule.classes for a in c.actions)


def latency_work(cost_fn: Callable[[float, int], float], nbytes: float, axis: int) -> tuple[float, float]:
    """(latency ``L``, bandwidth part ``W``) of a collective whose time is ``cost_fn(nbytes, axis)``: ``L = 2 t(M)
    - t(2M)`` clamped to ``[0, t]`` (exact while one algorithm wins at M and 2M), ``W = t - L``."""
    t, t2 = cost_fn(nbytes, axis), cost_fn(2 * nbytes, axis)
    lat = min(max(2 * t - t2, 0.0), t)
    return lat, t - lat


@dataclass(frozen=True)
class Parts:
    """A collective as the simulator runs it: a latency off the link, a bandwidth part on it, and how many
    times slower both progress while its rank computes."""

    latency_s: float
    work_s: float
    busy: float = 1.0
    host_s: float = 0.0
    """What the rank's compute stream pays when it issues the collective (``CostModel.compute_host_s``), not in
    the two parts above."""


def collective_parts(cost: Any, kind: str, nbytes: float, axis: int, *, by_op: bool, seconds: float) -> Parts:
    """:class:`Parts` of a collective of `kind` and `nbytes` on mesh `axis`, as issued (``reshard.as_issued``:
    a CPU mesh's all-to-all resharding is an all-gather), split by :func:`latency_work`, less the host cost
    the compute stream pays (``Parts.host_s``: out of the latency, where :func:`latency_work` puts a constant);
    a kind the cost model does not price (a send): its `seconds`, all on the link. The one split of the
    simulator (``meshpilot.sim``, *Durations*) and of this module's pricing."""
    from meshpilot.sharding.reshard import as_issued

    if kind not in _PRICED:
        return Parts(0.0, float(seconds))
    kind, nbytes = as_issued(CollectiveKind(kind), nbytes, cost.mesh.shape[axis], cost.device.is_cpu and not by_op)
    fn = getattr(cost, kind)
    lat, work = latency_work(fn, nbytes, axis)
    host = cost.compute_host_s(fn(nbytes, axis))
    return Parts(max(0.0, lat - host), work, cost.busy_factor(nbytes, axis), host)


_PRICED = frozenset(("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"))


def bucket_fn(cost: Any, kind: CollectiveKind) -> Callable[[float, int], float]:
    """The cost model's function of a bucket's collective."""
    return cost.all_reduce if kind == CollectiveKind.ALL_REDUCE else cost.reduce_scatter


def _own_collectives(plan: Any) -> tuple[dict[str, list], dict[str, list], list]:
    """The backward's collectives but the gradients' (``grad:``), as the simulator places them: (before a node,
    after a node, after the backward's last node). An edge's before its consumer; an op's own after it, the
    first ``OwnOp.leading`` of them before it; one whose consumer is no node (a buffer's) at the end."""
    pre: dict[str, list] = {}
    post: dict[str, list] = {}
    tail: list = []
    own: dict[str, int] = {}
    names = {n.name: n for n in plan.nodes}
    for c in plan.collectives:
        if c.phase != Phase.BWD.value or c.dst.startswith("grad:"):
            continue
        if c.dst not in names:
            tail.append(c)
        elif c.src == c.dst:
            k = own[c.dst] = own.get(c.dst, -1) + 1
            (pre if k < leading_collectives(names[c.dst].target) else post).setdefault(c.dst, []).append(c)
        else:
            pre.setdefault(c.dst, []).append(c)
    return pre, post, tail


class _Groups:
    """Each mesh axis' process group runs its collectives one at a time, in the order they are issued (gloo's
    work queue, NCCL's stream): a collective starts when it is issued and the group's previous one is done,
    and takes its alone-time, ``busy`` times slower while the rank computes (``spans``, known up to the moment
    an answer is asked for: a rank waiting for a group computes nothing until the group is done)."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self.free: dict[int, float] = {}
        self.queued: dict[int, list[tuple[float, float, float]]] = {}

    def compute(self, at: float, seconds: float) -> float:
        """The compute stream runs `seconds` from `at` (a span the queued collectives are slowed in); its end."""
        if seconds > 0:
            self.spans.append((at, at + seconds))
        return at + seconds

    def issue(self, axis: int, at: float, seconds: float, busy: float) -> None:
        self.queued.setdefault(axis, []).append((at, seconds, busy))

    def done(self, axis: int) -> float:
        """When everything issued on `axis` so far ends."""
        t = self.free.get(axis, 0.0)
        for at, seconds, busy in self.queued.pop(axis, ()):
            t = _progress(max(at, t), seconds, self.spans, busy)
        self.free[axis] = t
        return t


def _progress(start: float, amount: float, spans: Sequence[tuple[float, float]], slow: float) -> float:
    """When `amount` seconds of a transfer's alone-time are done, started at `start`: the compute `spans`
    (sorted, disjoint ``(from, to)``) slow it by `slow`, 1 elsewhere. Read in place from the span that holds
    or follows `start` (a backward has thousands)."""
    t, left = start, amount
    for k in range(max(0, bisect.bisect_right(spans, (t, math.inf)) - 1), len(spans)):
        a, b = spans[k]
        if b <= t:
            continue
        if a > t:
            if left <= a - t:
                return t + left
            left -= a - t
            t = a
        if left * slow <= b - t:
            return t + left * slow
        left -= (b - t) / slow
        t = b
    return t + left


def grad_producers(plan: Any) -> dict[str, str]:
    """Parameter name -> the node whose output is its gradient (the ``src`` of its ``grad:`` collectives)."""
    return {c.dst[5:]: c.src for c in plan.collectives if c.dst.startswith("grad:")}


def _seconds(cost: Any, c: Any) -> tuple[float, float, float]:
    """(alone seconds on its group, busy factor, host seconds the compute stream pays at its issue) of a planned
    collective or a bucket (:func:`collective_parts`)."""
    kind, by_op = c.kind, getattr(c, "issued_by_op", False)
    parts = collective_parts(cost, kind, c.nbytes, c.axis, by_op=by_op, seconds=c.seconds)
    return parts.latency_s + parts.work_s, parts.busy, parts.host_s


def bucket_overlap(plan: Any, buckets: Sequence[GradBucket], cost: Any, in_backward: bool) -> BucketOverlap:
    """Price `buckets` in `plan`'s step on the cost model `cost` (module docstring, *Overlap*): issued by the
    backward (`in_backward`) or all at ``G``."""
    bucketed = {p for b in buckets for p in b.params}
    replaced = sum(c.seconds for c in plan.collectives if c.dst.startswith("grad:") and c.dst[5:] in bucketed)
    total = sum(b.seconds for b in buckets)
    if not buckets:
        return BucketOverlap(0.0, replaced, 0.0)
    groups = _Groups()
    if not in_backward:
        t = 0.0
        for b in buckets:
            seconds, busy, host = _seconds(cost, b)
            t = groups.compute(t, host)
            groups.issue(b.axis, t, seconds, busy)
        return BucketOverlap(total, replaced, max(t, *(groups.done(a) for a in {b.axis for b in buckets})))
    producer = grad_producers(plan)
    at: dict[str, list[GradBucket]] = {}
    for b in buckets:
        at.setdefault(producer.get(b.params[-1], ""), []).append(b)
    pre, post, tail = _own_collectives(plan)
    t = alone = 0.0  # the backward's end so far, and what it would be with no bucket ahead of its collectives

    def block(cs) -> None:  # the compute stream waits for each: its group drains first
        nonlocal t, alone
        for c in cs:
            seconds, _, host = _seconds(cost, c)
            t = max(groups.compute(t, host), groups.done(c.axis)) + seconds
            alone += host + seconds
            groups.free[c.axis] = t

    def issue(b: GradBucket) -> None:  # the compute stream pays its host cost, its group runs the rest
        nonlocal t
        seconds, busy, host = _seconds(cost, b)
        t = groups.compute(t, host)
        groups.issue(b.axis, t, seconds, busy)

    bwd = [n for n in plan.nodes if n.phase == Phase.BWD.value]
    for b in [*at.pop("", ()), *(b for n in plan.nodes if n.phase != Phase.BWD.value for b in at.pop(n.name, ()))]:
        issue(b)  # a gradient the forward already holds
    for n in bwd:
        block(pre.get(n.name, ()))
        if n.seconds > 0:
            t = groups.compute(t, n.seconds)
            alone += n.seconds
        block(post.get(n.name, ()))
        for b in at.get(n.name, ()):
            issue(b)
    block(tail)
    last = max(groups.done(a) for a in {b.axis for b in buckets})
    return BucketOverlap(total, replaced, (t - alone) + max(0.0, last - t))


@dataclass(frozen=True)
class _Choice:
    """A searcher's choice read as the parts of a ``StagePlan`` that :func:`plan_buckets` and
    :func:`bucket_overlap` read: nodes (name, target, phase, seconds, output layouts), the parameters'
    layouts, the accounting's collectives."""

    mesh_shape: tuple[int, ...]
    nodes: tuple[Any, ...]
    collectives: tuple[Any, ...]
    layouts: dict[str, Any]
    _index: dict[str, Any] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {n.name: n for n in self.nodes})

    def node(self, name: str) -> Any:
        return self._index[name]

    def param_layout(self, fqn: str) -> Any:
        return self.layouts[fqn]


def choice_hidden_s(graph: OpGraph, chosen: dict[str, Any], resharder: Any, microbatches: int, acct: Any) -> float:
    """``StepTime.hidden_s`` of the plan the strategies `chosen` (by node) make on `resharder`'s mesh, whose
    ``accounting.account`` is `acct`: its buckets (:func:`plan_buckets`) priced as the runtime runs them
    (:func:`bucket_overlap`; one microbatch: in the backward). The mesh search subtracts it from a candidate's
    serial step, so shapes and mappings are compared by the step they run (``planner.auto``, which keeps the
    best candidate's `acct` for its plan)."""
    from meshpilot.planner.accounting import stored_layout
    from meshpilot.planner.plan import NodeChoice
    from meshpilot.sharding.placements import json_layout

    cost = resharder.cost_model
    shape = tuple(resharder.mesh_shape)
    nodes = []
    for n in graph.nodes:
        outs = tuple(map(json_layout, chosen[n.name].outs))
        nodes.append(NodeChoice(n.name, n.target, n.kind, (), outs, "", n.phase, acct.node_seconds[n.name]))
    layouts = {n.fqn: stored_layout(chosen[n.name]) for n in graph.nodes if n.kind == NodeKind.PARAM}
    view = _Choice(shape, tuple(nodes), tuple(acct.collectives), layouts)
    buckets = plan_buckets(graph, view, cost, in_backward=microbatches == 1)
    return bucket_overlap(view, buckets, cost, microbatches == 1).hidden_s


def with_buckets(plan: Any, graph: OpGraph, cost: Any, size: int | None = None) -> Any:
    """`plan` (a ``StagePlan`` of `graph`) with its gradient buckets (:func:`plan_buckets` on the cost model
    `cost`) and their overlap priced into its time (``StepTime.hidden_s``), and its sharded parameters' gather
    groups (``planner.prefetch.plan_gathers``: the other flat collectives of the step)."""
    from meshpilot.planner.prefetch import plan_gathers

    in_backward = backward_issues_buckets(plan.step_schedule())
    priced = _priced(plan, plan_buckets(graph, plan, cost, size, in_backward), cost)
    return dataclasses.replace(priced, param_gathers=plan_gathers(priced, graph, cost))


def repriced_buckets(plan: Any, cost: Any) -> Any:
    """`plan`'s buckets (the same gradients) and gather groups priced on the cost model `cost`
    (``accounting.reprice``)."""
    buckets = tuple(
        dataclasses.replace(b, seconds=bucket_fn(cost, b.kind)(b.nbytes, b.axis)) for b in plan.grad_buckets
    )
    gathers = tuple(dataclasses.replace(g, seconds=cost.all_gather(g.nbytes, g.axis)) for g in plan.param_gathers)
    return dataclasses.replace(_priced(plan, buckets, cost), param_gathers=gathers)


def _priced(plan: Any, buckets: tuple[GradBucket, ...], cost: Any) -> Any:
    priced = bucket_overlap(plan, buckets, cost, backward_issues_buckets(plan.step_schedule()))
    time = dataclasses.replace(plan.time, hidden_s=priced.hidden_s)
    return dataclasses.replace(plan, grad_buckets=buckets, time=time)


__all__ = [
    "LATENCY_SHARE",
    "BucketOverlap",
    "GradBucket",
    "GradMove",
    "backward_issues_buckets",
    "bucket_bytes",
    "bucket_fn",
    "bucket_overlap",
    "candidate_sizes",
    "choice_hidden_s",
    "collective_parts",
    "grad_producers",
    "latency_work",
    "grad_move",
    "plan_buckets",
    "repriced_buckets",
    "with_buckets",
]
