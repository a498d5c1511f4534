"""Resharding: the collectives that turn one layout into another, and what they cost (Alpa Table 2).

The steps are DTensor's own redistribute plan (``_gen_transform_infos``, the greedy planner the runtime
uses, with transform flattening switched off at run time), so the collectives predicted here are the ones
the run issues. Each step acts on one mesh axis and becomes one collective of the cluster's cost model:

    P -> R        all-reduce(M_a, axis a)         "communication" (the partial sums an op left behind)
    P -> S(d)     reduce-scatter(M_a, axis a)     "communication"
    S(d) -> R     all-gather(M_a, axis a)         "resharding"    (Table 2 #2, #3)
    S(d) -> S(e)  all-to-all(M_a / n_a, axis a)   "resharding"    (Table 2 #4, #5)
    R -> S(d), R -> P                             free: a local slice (Table 2 #1)
    S(d) -> P     all-gather(M_a, axis a), then R -> P   (DTensor has no such step: :func:`via_replicate`)
    P(x) -> P(y)  all-reduce(M_a, axis a), then R -> P(y) (one partial kind to another, P(avg) -> P(sum): neither)

``M_a`` follows the local tensor through the steps (the whole tensor cut by every shard it has right then),
counted as :class:`CollectiveKind` says (an all-gather's gathered output, a reduce-scatter's input, ...).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import NamedTuple

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from meshpilot.graph.capture import TensorInfo, dtype_from_name
from meshpilot.sharding.placements import Placements, by_id

UNSUPPORTED_S = 1e3
"""Cost of a resharding DTensor cannot do (shard -> partial and one partial kind -> another go through a replica,
:func:`via_replicate`; what is left is a chain DTensor's planner builds through such a step): large enough that
no plan uses it."""


class CollectiveKind(StrEnum):
    """What a collective does: the planner's, the runtimes' and the recorders' one vocabulary (the values are
    what plans store in JSON).

    **Bytes.** Everywhere meshpilot gives a collective's size in bytes (``Collective.nbytes`` here,
    ``PlannedCollective.nbytes`` in plans, the cost model's ``M``, ``CollectiveRecord.nbytes`` of the
    runtimes' recorder) it is the full buffer the collective moves on one rank: ``ALL_REDUCE`` the reduced
    buffer; ``ALL_GATHER`` the gathered output (the local shard times the group size); ``REDUCE_SCATTER`` the
    un-reduced input; ``ALL_TO_ALL`` what each rank holds (its input); ``BROADCAST`` the buffer; ``SEND`` /
    ``RECV`` the message. ``CollectiveRecord.ring_bytes`` turns it into the bytes one rank sends.
    """

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"
    UNSUPPORTED = "unsupported"
    """A resharding DTensor cannot run (one partial kind → another): priced at ``UNSUPPORTED_S`` so no plan uses
    it."""

    @property
    def is_reduction(self) -> bool:
        return self in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER)


class Collective(NamedTuple):
    """One collective on one mesh axis: kind, axis, bytes (as :class:`CollectiveKind` counts them)."""

    kind: CollectiveKind
    axis: int
    nbytes: int

    @property
    def is_reduction(self) -> bool:
        return CollectiveKind(self.kind).is_reduction


def as_issued(kind: CollectiveKind, nbytes: int, group: int, on_cpu: bool) -> tuple[CollectiveKind, int]:
    """The collective DTensor really issues for a resharding collective of `kind` and `nbytes` on a mesh
    axis of `group` ranks: on a CPU mesh (gloo) DTensor has no all-to-all and reshards ``S(i) -> S(j)`` by
    an all-gather of every rank's shard (``group`` times the bytes each holds) and a local chunk
    (``torch.distributed.tensor._collective_utils.shard_dim_alltoall``); everything else as planned. The
    planner prices what this returns and the collective counts compare runs against it."""
    if on_cpu and kind == CollectiveKind.ALL_TO_ALL:
        return CollectiveKind.ALL_GATHER, nbytes * group
    return kind, nbytes


def tensor_meta(info: TensorInfo) -> TensorMeta:
    shape = torch.Size(info.shape)
    stride = []
    acc = 1
    for s in reversed(info.shape):
        stride.append(acc)
        acc *= max(s, 1)
    return TensorMeta(shape, tuple(reversed(stride)), dtype_from_name(info.dtype))


# DTensor's redistribute steps depend on the layouts and the mesh shape only: shared by every Resharder
_STRUCTURES: dict[tuple[int, ...], dict[tuple, tuple[tuple[str, int, float], ...]]] = {}


def via_replicate(src: Placements, dst: Placements) -> Placements | None:
    """The layout a ``src -> dst`` resharding passes through where DTensor cannot take it in one go: `dst` with
    every mesh axis that goes from a shard, or from another kind of partial (``P(avg) -> P(sum)``), to a
    partial replicated instead. DTensor takes neither step; gathering (or all-reducing with the source's own
    reduction) first and then keeping a partial share of the replica is exact: the shares of ``R -> P(y)`` reduce
    with ``y`` to the replica. ``None`` where no axis needs it. The planner prices ``src -> via -> dst`` and the
    runtime (``runtime.interpret.redistribute``) runs it, so the collectives are the ones planned."""
    if not any(_needs_replica(a, b) for a, b in zip(src, dst)):
        return None
    return tuple(Replicate() if _needs_replica(a, b) else b for a, b in zip(src, dst))


def _needs_replica(a, b) -> bool:
    """Whether placement `a` becomes partial `b` on one mesh axis only through a replica."""
    return b.is_partial() and (a.is_shard() or (a.is_partial() and a != b))


class Resharder:
    """Collectives and seconds of ``src -> dst`` for tensors on one mesh, cached by (src, dst, tensor)."""

    def __init__(self, dmesh: DeviceMesh, cost_model):
        self.dmesh = dmesh
        self.cost_model = cost_model
        self.mesh_shape = tuple(dmesh.shape)
        self._struct = _STRUCTURES.setdefault(self.mesh_shape, {})
        self._cost: dict[tuple, float] = {}
        self._meta: dict[TensorInfo, TensorMeta] = {}
        self._mat: dict[tuple, np.ndarray] = {}
        self._cost_ids: dict[tuple, float] = {}
        self._specs: dict[tuple[Placements, int], DTensorSpec] = {}

    def steps(self, src: Placements, dst: Placements, ndim: int) -> tuple[tuple[str, int, float], ...]:
        """DTensor's steps for ``src -> dst`` on an ``ndim``-D tensor: (kind, axis, fraction of the tensor).

        Computed once per layout pair on a canonical tensor whose every dim is the mesh size, so each
        step's logical shape is an exact fraction of the whole; real tensors scale it by their bytes
        (meshpilot plans even shards only, where that is exact).
        """
        key = (src, dst, ndim)
        hit = self._struct.get(key)
        if hit is not None:
            return hit
        via = via_replicate(src, dst)
        if via is not None:  # shard -> partial: gathered first (its steps), then a free partial share
            res = self.steps(src, via, ndim) + self.steps(via, dst, ndim)
            self._struct[key] = res
            return res
        from torch.distributed.tensor._redistribute import _gen_transform_infos

        steps = _gen_transform_infos(self._spec(src, ndim), self._spec(dst, ndim))
        out = []
        current = list(src)
        for t in steps:
            a, b = t.src_dst_placements
            n = self.mesh_shape[t.mesh_dim]
            # bytes of the local tensor right before this step: the whole cut by every current shard
            local = 1.0 / math.prod(k for p, k in zip(current, self.mesh_shape) if p.is_shard())
            current[t.mesh_dim] = b
            if b.is_partial() and not (a.is_replicate() or a == b):
                # DTensor turns no other kind of partial (P(avg) -> P(sum)) into a partial (a shard met
                # mid-chain neither; a shard in `src` went through via_replicate above): never plan it
                out.append((CollectiveKind.UNSUPPORTED, t.mesh_dim, 0.0))
                continue
            kind = t._comm_type_key()
            if kind is None or n == 1:
                continue
            frac = local * n if kind == CollectiveKind.ALL_GATHER else local
            out.append((kind, t.mesh_dim, frac))
        res = tuple(out)
        self._struct[key] = res
        return res

    def _spec(self, pl: Placements, ndim: int) -> DTensorSpec:
        """`pl` on the canonical ``ndim``-D tensor of :meth:`steps` (every dim the mesh size, so every even
        layout is valid on it); made once per layout: a plan asks :meth:`steps` for ~1,000 pairs of a few dozen
        layouts, and making DTensor's spec (its checks of the shard order) was half of each pair's cost."""
        key = (pl, ndim)
        spec = self._specs.get(key)
        if spec is None:
            m = math.prod(self.mesh_shape)
            spec = self._specs[key] = DTensorSpec(self.dmesh, pl, tensor_meta(TensorInfo((m,) * ndim, "float32")))
        return spec

    def collectives(self, src: Placements, dst: Placements, info: TensorInfo) -> tuple[Collective, ...]:
        """The collectives DTensor issues to reshard a tensor `info` from `src` to `dst`."""
        if src == dst:
            return ()
        return tuple(
            Collective(kind, axis, round(frac * info.nbytes))
            for kind, axis, frac in self.steps(src, dst, len(info.shape))
        )

    def cost(self, src: Placements, dst: Placements, info: TensorInfo) -> float:
        """Seconds to reshard a tensor `info` from `src` to `dst`."""
        if src == dst:
            return 0.0
        key = (src, dst, info)
        c = self._cost.get(key)
        if c is None:
            c = sum(self.collective_cost(col) for col in self.collectives(src, dst, info))
            self._cost[key] = c
        return c

    def cost_matrix(self, P: list[int], Q: list[int], info: TensorInfo) -> np.ndarray:
        """``[len(P), len(Q)]`` seconds between interned layouts (see ``placements.pid``)."""
        key = (tuple(P), tuple(Q), info)
        m = self._mat.get(key)
        if m is None:
            m = np.array([[self.cost_ids(p, q, info) for q in Q] for p in P], dtype=float).reshape(len(P), len(Q))
            self._mat[key] = m
        return m

    def cost_ids(self, p: int, q: int, info: TensorInfo) -> float:
        if p == q or p < 0 or q < 0:
            return 0.0
        key = (p, q, info)
        c = self._cost_ids.get(key)
        if c is None:
            c = self._cost_ids[key] = self.cost(by_id(p), by_id(q), info)
        return c

    def collective_cost(self, col: Collective) -> float:
        """Seconds of one collective of a resharding, as DTensor issues it on this mesh (:func:`as_issued`)."""
        if col.kind == CollectiveKind.UNSUPPORTED:
            return UNSUPPORTED_S
        kind, nbytes = as_issued(col.kind, col.nbytes, self.mesh_shape[col.axis], self.cost_model.device.is_cpu)
        return getattr(self.cost_model, kind)(nbytes, col.axis)

    def op_collective_cost(self, col: Collective) -> float:
        """Seconds of a collective an op issues itself (``Strategy.colls``: meshpilot's own ops call the
        process group directly, e.g. ``all_to_all_single``, which gloo carries): priced as planned; a ``SEND``
        (ring attention's blocks, :mod:`meshpilot.ops.ring`) as one neighbour-to-neighbour transfer."""
        if col.kind == CollectiveKind.SEND:
            return self.cost_model.send_recv(col.nbytes, col.axis)
        return getattr(self.cost_model, col.kind)(col.nbytes, col.axis)
