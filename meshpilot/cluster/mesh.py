"""Logical device meshes on a cluster, and the bandwidth of each mesh axis (ATP §3.5, Eq. 3-4).

A :class:`LogicalMesh` is a shape (d_1, ..., d_n) plus a map from mesh coordinates to physical ranks.
By default the last axis runs over contiguous ranks (``np.arange(N).reshape(shape)``), which on
DeviceMesh(d1, d2) puts d2 inside a node first, as ATP does.

Collectives along mesh axis ``a`` run in *groups*: the ranks that differ only in coordinate ``a``.
All groups of an axis run at once, so they compete for the links they share.

Eq. 3, generalised to any hierarchy and any mapping (:func:`effective_bandwidth`). For every layer j
that a group *spans* (its members sit in more than one unit of layer j) and every unit u of layer j
that a group *crosses* (it has members inside u and outside u):

    share_j(u)   = number of groups of the axis that cross u               (concurrent groups)
    cap_j(u, g)  = min(GroupBW_j(u), ring_j(u, g))                          if g's other members all lie
                                                                           in sibling units of u
                 = GroupBW_j(u)                                            otherwise
    B'_j         = min over crossed u of  min_g cap_j(u, g) / share_j(u)
    B'           = min over spanned layers j of B'_j                        (the bottleneck)

ring_j(u, g) is what the P2P matrix lets the collective move out of u. With M the member units of g in
u's parent and W_j the widest-path closure of P2P_j (:attr:`Layer.reach`; units without a direct link
talk at the bottleneck of the best relay path, 0 -> 1 -> 2 on a torus ring):

    |M| = 2                      W(u, v)                          the one link, both directions in use
    W uniform among M            sum_{v in M, v != u} W(u, v)     several rings use every link at once
    otherwise                    2 * min_{w in M} second_max_{x in M} W(w, x)
                                 the bottleneck hop of the best bidirectional ring: each member needs
                                 two ring neighbours, so no ring beats the second-best link of its
                                 worst-connected member (two racks joined by slow links: the slow hop)

``share`` is ATP's "divide by d2 when d2 groups share the inter-node bandwidth"; ``cap`` is its P2P
correction ("B2' is lower than the group bandwidth due to the constraints of the P2P matrix"). Groups
that never cross the same unit do not divide each other's bandwidth, so on a single-layer switch (IC5)
or along the rings of a torus (IC6) B' = GroupBW, as ATP §5.4 states. ATP's worked example comes out:
DeviceMesh(8,2) on atp-fig7a gives B2' = 200 GB/s (two GPUs of a node: P2P limits) and B1' = 12.5 GB/s
(two groups share a node's 25 GB/s HDR link).

Eq. 4 (Rabenseifner all-reduce, latency ignored): the algorithm bandwidth of an axis of size d is

    B = d / (2 (d - 1)) * B'

:func:`algorithm_bandwidth` returns it, unless a calibration entry of the cluster was measured on this
axis' rank groups, whose measured B then wins (ATP §5.3 calibrates IC1 this way).

Axis names (:meth:`LogicalMesh.axis_names`, stored in plans as ``Plan.mesh_axes``, given to the runtime's
``DeviceMesh`` as ``mesh_dim_names`` and used by the collective recorder) say where an axis sits in the
cluster: the topmost layer its groups cross, since that layer's links are the ones its collectives pay for
(``node`` for an axis between nodes, ``gpu`` for one inside a node). Two axes crossing the same topmost layer
(every 2D mesh on a one-layer cluster) get the axis index appended (``gpu.0``, ``gpu.1``); an axis of size
one crosses nothing and is ``single``. Where no cluster is known (plans saved before axes had names, a
DeviceMesh built without names) the names are positional: :func:`default_axis_names`.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from meshpilot.cluster.topology import Cluster, Layer
from meshpilot.errors import UserError


def mesh_shapes_2d(n: int) -> list[tuple[int, int]]:
    """Every 2D mesh shape (d1, d2) with d1 * d2 = n, d1 descending: (n,1), ..., (1,n)."""
    return [(n // d2, d2) for d2 in range(1, n + 1) if n % d2 == 0]


def mesh_shapes_3d(cluster: Cluster, n: int) -> list[tuple[int, int, int]]:
    """The 3-axis shapes the single-stage search tries beside the 2D ones on the first `n` ranks of `cluster`:
    ``(u, a, b)`` with ``u`` units of the top layer, ``a * b = m`` the devices one unit holds, ``1 < a <= b``,
    ``a`` ascending. Empty unless

    * the cluster has at least two layers and its top layer is the slow one (every top-level group bandwidth
      below every one of the layer beneath: nodes joined by a network, devices joined inside a node), and
    * the `n` ranks fill ``u >= 2`` whole units (``n = u * m``) and ``m`` is not prime.

    Why these and not every factorisation of n: with the row mapping axis 0 of ``(u, a, b)`` is exactly the
    top level, so its collectives cross only the slow links, and it is searched as data parallelism
    (``planner.axes``: the way real runs use an axis across nodes), while inside a unit the two other axes
    let each operator combine data and tensor parallelism without crossing the slow level. No 2D shape does
    both: ``(u, m)`` has one axis inside the unit, ``(u * a, b)`` an axis over both levels. A one-layer cluster,
    or ranks inside one unit, gain nothing a 2D shape lacks, and other factorisations would put a
    data-parallel-only axis inside a unit or a free axis across units: a 3-axis ILP costs about a 2D one's
    only with the outer axis cut (``planner.axes``), so each shape must earn its place: ``a <= b`` keeps the larger
    inner axis on the contiguous ranks, the closest-linked ones inside a unit, where tensor parallelism goes
    (its mirror ``(u, b, a)`` cost as much planning again and did not beat it on GPT-3 6.7B: docs/benchmarks.md)."""
    layers = cluster.layers
    if len(layers) < 2 or float(np.max(layers[0].group_bw)) >= float(np.min(layers[1].group_bw)):
        return []
    m = math.prod(layer.ranks for layer in layers[1:])
    if n % m or n // m < 2:
        return []
    return [(n // m, a, m // a) for a in range(2, m) if m % a == 0 and a * a <= m]


class MeshMapping(StrEnum):
    """Which mesh axis runs over contiguous physical ranks (stored in plans as ``Plan.mapping``)."""

    ROW = "row"
    """The last axis on contiguous ranks (``np.arange(N).reshape(shape)``): on DeviceMesh(d1, d2), d2 inside a
    node first, as ATP does."""
    COL = "col"
    """Axis 0 on contiguous ranks (the transpose)."""


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """Positional axis names, for meshes without a cluster to name them by: ``axis0``, ``axis1``, ..."""
    return tuple(f"axis{a}" for a in range(ndim))


SINGLE_AXIS = "single"
"""The name of an axis of size one: its groups are single devices and cross no layer of the cluster."""


def mapped_ranks(shape: tuple[int, ...], mapping: MeshMapping | str) -> np.ndarray:
    """The physical rank at every coordinate of a `shape` mesh laid out by `mapping`."""
    n = math.prod(shape)
    if MeshMapping(mapping) == MeshMapping.ROW:
        return np.arange(n).reshape(shape)
    return np.arange(n).reshape(tuple(reversed(shape))).T.copy()


@dataclass(frozen=True, eq=False)
class LogicalMesh:
    """A logical mesh of devices on a cluster: shape plus the physical rank of every coordinate."""

    cluster: Cluster
    """The cluster the mesh's devices belong to."""
    shape: tuple[int, ...]
    """(d_1, ..., d_n): devices along each mesh axis."""
    ranks: np.ndarray = field(default=None)  # type: ignore[assignment]
    """Physical rank at every mesh coordinate, an array of `shape`; default: row-major, last axis contiguous."""

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        n = math.prod(shape)
        if any(d < 1 for d in shape):
            raise UserError(f"mesh shape {shape}: every axis needs at least one device; e.g. ({n}, 1)")
        if n > self.cluster.num_devices:
            raise UserError(
                f"mesh shape {shape} needs {n} devices but cluster {self.cluster.name!r} has "
                f"{self.cluster.num_devices}; choose a shape whose product is at most {self.cluster.num_devices}"
            )
        ranks = np.arange(n).reshape(shape) if self.ranks is None else np.asarray(self.ranks, dtype=np.int64)
        if ranks.shape != shape:
            raise UserError(f"mesh rank map has shape {ranks.shape}, expected {shape}; give one rank per coordinate")
        flat = ranks.reshape(-1)
        if len(set(flat.tolist())) != flat.size or flat.min() < 0 or flat.max() >= self.cluster.num_devices:
            raise UserError(
                f"mesh rank map must name {n} distinct ranks in [0, {self.cluster.num_devices}); got {flat.tolist()}"
            )
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_bw", {})  # Eq. 3 per axis set: the expensive part, asked for repeatedly

    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        return int(self.ranks.size)

    def groups(self, axes: int | Sequence[int]) -> np.ndarray:
        """Concurrent collective groups over `axes`: shape [num_groups, group_size] of physical ranks."""
        axes = _axes(axes, len(self.shape))
        rest = [a for a in range(len(self.shape)) if a not in axes]
        moved = np.transpose(self.ranks, rest + list(axes))
        return moved.reshape(-1, math.prod(self.shape[a] for a in axes))

    def axis_size(self, axes: int | Sequence[int]) -> int:
        """Devices in one group over `axes`."""
        return math.prod(self.shape[a] for a in _axes(axes, len(self.shape)))

    def top_layer(self, axis: int) -> str | None:
        """The name of the topmost cluster layer whose units the groups of `axis` cross (None for size one)."""
        groups = self.groups(axis)
        if groups.shape[1] <= 1:
            return None
        coords = self.cluster.coords(groups.reshape(-1)).reshape(*groups.shape, len(self.cluster.layers))
        differs = (coords != coords[:, :1, :]).any(axis=(0, 1))  # per layer: some group's members differ there
        return self.cluster.layers[int(np.argmax(differs))].name

    def axis_names(self) -> tuple[str, ...]:
        """One name per axis: its topmost crossed layer, made unique (module docstring, "Axis names")."""
        base = [self.top_layer(a) or SINGLE_AXIS for a in range(len(self.shape))]
        return tuple(f"{b}.{a}" if base.count(b) > 1 else b for a, b in enumerate(base))

    def effective_bandwidth(self, axes: int | Sequence[int]) -> float:
        """B' of Eq. 3 for collectives over `axes`, bytes/s (inf for groups of one device)."""
        key = tuple(_axes(axes, len(self.shape)))
        if key not in self._bw:
            self._bw[key] = effective_bandwidth(self.cluster, self.groups(key))
        return self._bw[key]

    def algorithm_bandwidth(self, axes: int | Sequence[int]) -> float:
        """B of Eq. 4 over `axes`, bytes/s; a calibration entry for this shape overrides it."""
        d = self.axis_size(axes)
        if d == 1:
            return math.inf
        measured = self._calibrated(axes, "algbw")
        if measured is not None:
            return measured
        return d / (2 * (d - 1)) * self.effective_bandwidth(axes)

    def bus_bandwidth(self, axes: int | Sequence[int]) -> float:
        """Per-rank link bandwidth the collective formulas use: B' (calibration-aware: B' = 2(d-1)/d * B)."""
        d = self.axis_size(axes)
        if d == 1:
            return math.inf
        measured = self._calibrated(axes, "algbw")
        if measured is not None:
            return measured * 2 * (d - 1) / d
        return self.effective_bandwidth(axes)

    def exchange_seconds_per_byte(self, axes: int | Sequence[int]) -> float:
        """Seconds per byte of each rank's buffer that an all-to-all over `axes` spends at the busiest
        uplink (:func:`exchange_seconds_per_byte`)."""
        return exchange_seconds_per_byte(self.cluster, self.groups(axes))

    def latency(self, axes: int | Sequence[int]) -> float:
        """Alpha of one message over `axes`: a calibration entry's measured alpha for these groups, else the
        largest latency among the layers its groups span."""
        measured = self._calibrated(axes, "latency")
        if measured is not None:
            return measured
        return group_latency(self.cluster, self.groups(axes))

    def allreduce_curve(self, axes: int | Sequence[int]) -> tuple[tuple[int, float], ...] | None:
        """Measured all-reduce ``(bytes, seconds)`` points of a calibration entry whose groups are this axis'
        groups (``Calibration.curve``), or None."""
        return self._calibrated(axes, "curve")

    def allreduce_busy_curve(self, axes: int | Sequence[int]) -> tuple[tuple[int, float], ...] | None:
        """Measured all-reduce ``(bytes, seconds)`` points of this axis while every rank computes
        (``Calibration.busy_curve``), or None."""
        return self._calibrated(axes, "busy_curve")

    def _calibrated(self, axes: int | Sequence[int], what: str) -> Any:
        """The measured value `what` (``algbw``: B; ``latency``: alpha; ``curve``; ``busy_curve``) of the
        calibration entry whose groups are this axis' groups, or None.

        A probe measures mesh ``shape`` with the row mapping (``arange(n).reshape(shape)``), so an entry's axis
        ``j`` holds for exactly those rank groups; a col-mapped (4, 2) mesh's axis 0 is a row-mapped (2, 4)'s
        axis 1. Entries are matched by groups, not by shape alone."""
        axes = _axes(axes, len(self.shape))
        if len(axes) != 1 or not self.cluster.calibration:
            return None
        mine = _group_set(self.groups(axes))
        for entry in self.cluster.calibration:
            if math.prod(entry.mesh) != self.ranks.size:
                continue
            row = np.arange(math.prod(entry.mesh)).reshape(entry.mesh)
            for j, value in enumerate(getattr(entry, what)):
                if value is not None and j < row.ndim and _group_set(_axis_groups(row, j)) == mine:
                    return value
        return None


def _axis_groups(ranks: np.ndarray, axis: int) -> np.ndarray:
    rest = [a for a in range(ranks.ndim) if a != axis]
    return np.transpose(ranks, rest + [axis]).reshape(-1, ranks.shape[axis])


def _group_set(groups: np.ndarray) -> frozenset[frozenset[int]]:
    return frozenset(frozenset(int(r) for r in g) for g in groups)


def _axes(axes: int | Sequence[int], ndim: int) -> list[int]:
    out = [axes] if isinstance(axes, int | np.integer) else list(axes)
    for a in out:
        if not 0 <= a < ndim:
            raise UserError(f"mesh axis {a} does not exist on a {ndim}-D mesh; use 0..{ndim - 1}")
    return [int(a) for a in out]


def _unit_ids(cluster: Cluster, coords: np.ndarray, j: int) -> np.ndarray:
    """Integer id of the layer-j unit holding each device (its coordinate prefix c_1..c_j)."""
    ids = np.zeros(coords.shape[0], dtype=np.int64)
    for k in range(j + 1):
        ids = ids * cluster.layers[k].ranks + coords[:, k]
    return ids


_EQ3: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Eq. 3 per cluster and rank groups: every logical mesh of a planning run over the same groups (a stage
planner builds one per search and device mapping) asks once; on 4,096 ranks one evaluation takes ~0.1 s."""
_EXCHANGE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # exchange_seconds_per_byte, likewise


def _memoised(store: weakref.WeakKeyDictionary, cluster: Cluster, groups: np.ndarray, compute) -> float:
    """`compute(cluster, groups)`, kept in `store` per cluster and rank groups."""
    memo = store.setdefault(cluster, {})
    key = (groups.shape, groups.tobytes())
    if key not in memo:
        memo[key] = compute(cluster, groups)
    return memo[key]


def _layer_units(cluster: Cluster, groups: np.ndarray) -> Iterator[tuple[int, Layer, np.ndarray]]:
    """Per layer j of `cluster`: (j, the layer, the id of the layer-j unit holding each member of `groups`,
    shaped like `groups`)."""
    coords = cluster.coords(groups.reshape(-1)).reshape(*groups.shape, len(cluster.layers))
    for j, layer in enumerate(cluster.layers):
        yield j, layer, _unit_ids(cluster, coords.reshape(-1, coords.shape[-1]), j).reshape(groups.shape)


def effective_bandwidth(cluster: Cluster, groups: np.ndarray) -> float:
    """Eq. 3 (generalised, see module docstring): B' for `groups` [num_groups, group_size] running at once
    (cached per cluster and groups)."""
    groups = np.atleast_2d(np.asarray(groups, dtype=np.int64))
    if groups.shape[1] <= 1:
        return math.inf
    return _memoised(_EQ3, cluster, groups, _effective_bandwidth)


def _effective_bandwidth(cluster: Cluster, groups: np.ndarray) -> float:
    rings: dict[tuple, _Ring] = {}  # ring_j(u, g) depends on the layer, the members and u only
    best = math.inf
    for j, layer, unit in _layer_units(cluster, groups):
        parent = unit // layer.ranks
        share: dict[int, int] = {}
        cap: dict[int, float] = {}
        for g in range(groups.shape[0]):
            # sorted sets, not ``np.unique``: its first call imports ``numpy.ma`` (≈13 ms of CPU, issue 33 item 4)
            units = sorted(set(unit[g].tolist()))
            if len(units) <= 1:
                continue  # this group does not span layer j
            same_parent = len(set(parent[g].tolist())) == 1
            members = [u % layer.ranks for u in units]
            for u in units:
                c = u % layer.ranks
                limit = float(layer.group_bw[c])
                if same_parent:
                    rk = (j, tuple(members))
                    if rk not in rings:
                        rings[rk] = _Ring(layer.reach, members)
                    limit = min(limit, rings[rk].capacity(c))
                share[u] = share.get(u, 0) + 1
                cap[u] = min(cap.get(u, math.inf), limit)
        for u, n in share.items():
            best = min(best, cap[u] / n)
    return best


class _Ring:
    """ring_j(u, g) of the module docstring for the members of one group: what the links among them let
    each member u send (the parts that do not depend on u computed once)."""

    def __init__(self, reach: np.ndarray, members: list[int]):
        self.reach, self.members = reach, members
        sub = reach[np.ix_(members, members)]
        off = sub[~np.eye(len(members), dtype=bool)]
        self.uniform = bool(np.all(off == off[0]))
        self.bottleneck = math.nan
        if len(members) > 2 and not self.uniform:
            second_best = np.sort(sub + np.diag(np.full(len(members), -np.inf)), axis=1)[:, -2]
            self.bottleneck = float(2 * second_best.min())

    def capacity(self, u: int) -> float:
        others = [v for v in self.members if v != u]
        if len(self.members) == 2:
            return float(self.reach[u, others[0]])
        if self.uniform:
            return float(self.reach[u, others].sum())
        return self.bottleneck


def exchange_seconds_per_byte(cluster: Cluster, groups: np.ndarray) -> float:
    """Seconds per byte each rank holds, for an all-to-all in every one of `groups` at once, counted at the
    units' uplinks (module docstring of :mod:`meshpilot.cluster.cost`, all-to-all): for every layer j and
    unit u of it that a group crosses, the bytes leaving u over its group bandwidth. A group with k of
    its n members in u sends k (n - k) / n of a rank's bytes out of u (each of the k sends 1/n to each
    of the n - k outside); the groups crossing u add up. 0 for groups of one device. Cached."""
    groups = np.atleast_2d(np.asarray(groups, dtype=np.int64))
    if groups.shape[1] <= 1:
        return 0.0
    return _memoised(_EXCHANGE, cluster, groups, _exchange_seconds_per_byte)


def _exchange_seconds_per_byte(cluster: Cluster, groups: np.ndarray) -> float:
    n = groups.shape[1]
    worst = 0.0
    for _, layer, unit in _layer_units(cluster, groups):
        out: dict[int, float] = {}
        for g in range(groups.shape[0]):
            units, k = np.unique(unit[g], return_counts=True)
            if units.size <= 1:
                continue  # this group does not cross layer j
            for u, ku in zip(units.tolist(), k.tolist()):
                out[u] = out.get(u, 0.0) + ku * (n - ku) / n
        for u, share in out.items():
            worst = max(worst, share / float(layer.group_bw[u % layer.ranks]))
    return worst


def _differ(rows: np.ndarray) -> bool:
    """Whether `rows` holds two different rows (``np.unique(rows, axis=0)`` longer than one, without its first
    call's import of ``numpy.ma``)."""
    return len(rows) > 1 and bool((rows != rows[0]).any())


def group_latency(cluster: Cluster, groups: np.ndarray) -> float:
    """Largest latency among the layers that `groups` span (0 for single-device groups)."""
    groups = np.atleast_2d(np.asarray(groups, dtype=np.int64))
    coords = cluster.coords(groups.reshape(-1)).reshape(*groups.shape, len(cluster.layers))
    alpha = 0.0
    for j, layer in enumerate(cluster.layers):
        if any(_differ(coords[g, :, : j + 1]) for g in range(groups.shape[0])):
            alpha = max(alpha, layer.latency)
    return alpha


def all_mesh_shapes(n: int, ndim: int = 2) -> list[tuple[int, ...]]:
    """Every ndim-D shape whose product is n."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return [s for s in itertools.product(divisors, repeat=ndim) if math.prod(s) == n]
