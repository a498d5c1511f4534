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

**Overlap (pricing).** With one microbatch the buckets run on one communication stream during the backward:
bucket ``k`` starts at ``s_k = max(r_k, e_{k-1})`` where ``r_k`` is the moment its last gradient is produced
(the backward's node seconds and non-gradient collectives, in graph order, up to that node) and ends at
``e_k = s_k + T_k``. What the step still waits for is ``max(0, e_last - t_backward)``; the rest of ``sum T_k``
is hidden: :attr:`BucketOverlap.hidden_s`, kept in the plan as ``StepTime.hidden_s`` (``StepTime.overlapped_s``
is the predicted step with it; ``StepTime.total_s`` stays the serial step the searchers minimise, which do not
see buckets yet). With several microbatches the buckets are synchronised once after
the last backward (nothing hidden; fewer latencies only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.graph.capture import OpGraph, Phase
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
    kind: str
    """``all_reduce`` or ``reduce_scatter`` (a ``CollectiveKind`` value)."""
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


def plan_buckets(graph: OpGraph, plan: Any, cost: Any, size: int | None = None) -> tuple[GradBucket, ...]:
    """The gradient buckets of `plan` (a ``StagePlan`` of `graph`), each at most about `size` bytes (default:
    :func:`bucket_bytes` of its axis), in the order their last gradients are produced (module docstring)."""
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
    open_: dict[tuple, list] = {}
    done: list[tuple[int, tuple, list]] = []
    for at, fqn, key, nbytes in found:
        cap = size if size is not None else bucket_bytes(cost, key[1])
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
        sec = cost.all_reduce(nbytes, axis) if kind == CollectiveKind.ALL_REDUCE else cost.reduce_scatter(nbytes, axis)
        out.append(GradBucket(tuple(params), str(kind), axis, nbytes, sec))
    return tuple(out)


@dataclass(frozen=True)
class BucketOverlap:
    """The buckets' time in the step (module docstring, *Overlap*)."""

    bucket_s: float
    """Their collectives' seconds, summed."""
    replaced_s: float
    """The per-gradient collectives they replace (what the serial step priced)."""
    exposed_s: float
    """What the step still waits for after the backward."""

    @property
    def hidden_s(self) -> float:
        """What the serial price (`replaced_s`) overstates: the buckets' fewer latencies and their overlap."""
        return self.replaced_s - self.exposed_s


def bucket_overlap(plan: Any, graph: OpGraph, buckets: Sequence[GradBucket], microbatches: int = 1) -> BucketOverlap:
    """Price `buckets` in `plan`'s step (module docstring, *Overlap*)."""
    bucketed = {p for b in buckets for p in b.params}
    replaced = sum(c.seconds for c in plan.collectives if c.dst.startswith("grad:") and c.dst[5:] in bucketed)
    total = sum(b.seconds for b in buckets)
    if microbatches > 1 or not buckets:
        return BucketOverlap(total, replaced, total)
    before: dict[str, float] = {}
    for c in plan.collectives:
        if c.phase == Phase.BWD.value and not c.dst.startswith("grad:"):
            before[c.dst] = before.get(c.dst, 0.0) + c.seconds
    t, ready = 0.0, {}
    for n in plan.nodes:
        if n.phase != Phase.BWD.value:
            continue
        t += n.seconds + before.get(n.name, 0.0)
        ready[n.name] = t
    producer = {fqn: g[0] for fqn, g in graph.grads.items() if g is not None}
    end = 0.0
    for b in buckets:
        start = max(ready.get(producer[b.params[-1]], 0.0) if b.params else 0.0, end)
        end = start + b.seconds
    return BucketOverlap(total, replaced, min(total, max(0.0, end - t)))


def with_buckets(plan: Any, graph: OpGraph, cost: Any, size: int | None = None) -> Any:
    """`plan` (a ``StagePlan`` of `graph`) with its gradient buckets (:func:`plan_buckets` on the cost model
    `cost`) and their overlap priced into its time (``StepTime.hidden_s``)."""
    return _priced(plan, graph, plan_buckets(graph, plan, cost, size))


def repriced_buckets(plan: Any, graph: OpGraph, cost: Any) -> Any:
    """`plan`'s buckets (the same gradients) priced on the cost model `cost` (``accounting.reprice``)."""
    buckets = tuple(
        dataclasses.replace(
            b,
            seconds=cost.all_reduce(b.nbytes, b.axis)
            if b.kind == CollectiveKind.ALL_REDUCE
            else cost.reduce_scatter(b.nbytes, b.axis),
        )
        for b in plan.grad_buckets
    )
    return _priced(plan, graph, buckets)


def _priced(plan: Any, graph: OpGraph, buckets: tuple[GradBucket, ...]) -> Any:
    priced = bucket_overlap(plan, graph, buckets, plan.step_schedule().microbatches)
    time = dataclasses.replace(plan.time, hidden_s=priced.hidden_s)
    return dataclasses.replace(plan, grad_buckets=buckets, time=time)


__all__ = [
    "LATENCY_SHARE",
    "BucketOverlap",
    "GradBucket",
    "GradMove",
    "bucket_bytes",
    "bucket_overlap",
    "grad_move",
    "plan_buckets",
    "repriced_buckets",
    "with_buckets",
]
