"""Cross-mesh resharding: moving a value from one stage's mesh and layout to another stage's (Alpa §6).

A value crossing stages is held by the sender's ranks in the sender stage's planned layout and wanted by the
receiver's ranks in the receiver stage's. This runtime moves it through a *wire layout* on each side: every
placement that is ``Shard(0)`` stays (rows of dim 0 split over that mesh axis), every other becomes
``Replicate``. The sender reshards its planned layout into its wire layout on its own mesh (a ``Partial``
gradient is all-reduced, a feature-sharded activation all-gathered: DTensor's own collectives, counted as
the stage's), the rows cross between the meshes as tiles, and the receiver takes its wire layout to its
planned one locally (slicing a replica; ``Replicate → Partial`` keeps the value on one rank). So any planned
layout on either side is carried; what crosses between meshes is row tiles only.

:func:`rows_of` gives the rows ``[lo, hi)`` of dim 0 a rank holds in a wire layout (dim 0 split evenly over
the ``Shard(0)`` axes, in mesh-axis order as DTensor nests them). :func:`tiles` pairs each receiving rank's
rows with the sender blocks that hold them: one :class:`Tile` per (sender block, receiver) overlap; among the
sender ranks holding a block (replicas over its ``Replicate`` axes) the receiver at position q of its mesh
takes replica ``q mod copies``, so replicated senders share the sending. Both sides compute the same list.

**Local all-gather** (Alpa §6's optimisation, :func:`tiles` with ``local_gather=True``): when the receiver
replicates rows over some of its mesh axes, every tile would cross the slow link once per replica. Instead
each row block crosses once — to the receivers of one *gather group* (the receiving ranks that differ only in
their ``Replicate`` axes), split evenly among them — and the group then all-gathers the pieces on its own
(fast, local) links: :class:`GatherPlan` says which rows each receiver gets over the link and which group
all-gathers them. Bytes across meshes drop by the number of replicas; what the receivers' link carries grows
by an all-gather of the value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from meshpilot.errors import UserError


def wire_layout(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The layout a value crosses meshes in: ``Shard(0)`` kept, anything else ``Replicate`` (module docstring)."""
    return tuple(p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in placements)


def rows_of(n: int, mesh_shape: Sequence[int], wire: Sequence[Placement], coord: Sequence[int]) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of dim 0 (of `n` rows) that the rank at `coord` of a mesh holds in layout `wire`."""
    lo, hi = 0, n
    for axis, p in enumerate(wire):
        if isinstance(p, Shard):
            k = mesh_shape[axis]
            if (hi - lo) % k:
                raise UserError(
                    f"a stage boundary of {n} rows does not split evenly over a mesh axis of {k}; "
                    "give a microbatch whose rows divide by the stages' batch shards"
                )
            step = (hi - lo) // k
            lo, hi = lo + coord[axis] * step, lo + (coord[axis] + 1) * step
    return lo, hi


@dataclass(frozen=True)
class Tile:
    """Rows ``[lo, hi)`` of a value that rank `src` sends rank `dst`."""

    src: int
    dst: int
    lo: int
    hi: int


@dataclass(frozen=True)
class MeshSide:
    """One side of a transfer: the stage's mesh (its physical ranks in row-major order, its shape) and the wire
    layout its ranks hold the value in."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    wire: tuple[Placement, ...]

    def coords(self) -> list[tuple[int, tuple[int, ...]]]:
        out = []
        for k, r in enumerate(self.ranks):
            c, rest = [], k
            for d in reversed(self.shape):
                c.append(rest % d)
                rest //= d
            out.append((r, tuple(reversed(c))))
        return out

    def rows(self, n: int) -> dict[int, tuple[int, int]]:
        return {r: rows_of(n, self.shape, self.wire, c) for r, c in self.coords()}


@dataclass(frozen=True)
class GatherPlan:
    """Local all-gather: who receives which rows over the link, then gathers with whom (module docstring)."""

    tiles: tuple[Tile, ...]
    groups: tuple[tuple[int, ...], ...]
    """Receiving ranks that all-gather their pieces (each holds the group's rows once gathered), in row order."""


def tiles(n: int, src: MeshSide, dst: MeshSide) -> list[Tile]:
    """Every tile of a value of `n` rows moving from `src` to `dst` (module docstring); pure."""
    held: dict[tuple[int, int], list[int]] = {}
    for r, span in src.rows(n).items():
        held.setdefault(span, []).append(r)
    blocks = sorted(held)
    out = []
    for q, (r, (lo, hi)) in enumerate(dst.rows(n).items()):
        for blo, bhi in blocks:
            a, b = max(lo, blo), min(hi, bhi)
            if a < b:
                copies = held[(blo, bhi)]
                out.append(Tile(copies[q % len(copies)], r, a, b))
    return out


def gather_plan(n: int, src: MeshSide, dst: MeshSide) -> GatherPlan:
    """Tiles under Alpa's local all-gather: each row block crosses once, split over the receivers that hold the
    same rows, which then all-gather (module docstring); pure."""
    want = dst.rows(n)
    groups: dict[tuple[int, int], list[int]] = {}
    for r, span in want.items():
        groups.setdefault(span, []).append(r)
    held: dict[tuple[int, int], list[int]] = {}
    for r, span in src.rows(n).items():
        held.setdefault(span, []).append(r)
    blocks = sorted(held)
    out = []
    for (lo, hi), members in sorted(groups.items()):
        members.sort()  # a process group's ranks in order: the all-gather's list order is the rows' order
        k = len(members)
        if (hi - lo) % k:
            raise UserError(
                f"local all-gather: {hi - lo} rows do not split over the {k} receivers holding them; "
                "turn local_gather off or give rows that divide"
            )
        step = (hi - lo) // k
        for q, r in enumerate(members):
            plo, phi = lo + q * step, lo + (q + 1) * step
            for blo, bhi in blocks:
                a, b = max(plo, blo), min(phi, bhi)
                if a < b:
                    copies = held[(blo, bhi)]
                    out.append(Tile(copies[q % len(copies)], r, a, b))
    return GatherPlan(tuple(out), tuple(tuple(m) for _, m in sorted(groups.items())))


def cross_bytes(tile_list: Sequence[Tile], row_bytes: int) -> int:
    """Bytes the tiles carry between the meshes."""
    return sum((t.hi - t.lo) * row_bytes for t in tile_list)


def row_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of one row of dim 0."""
    return math.prod(shape[1:]) * itemsize


__all__ = [
    "GatherPlan",
    "MeshSide",
    "Tile",
    "cross_bytes",
    "gather_plan",
    "row_bytes",
    "rows_of",
    "tiles",
    "wire_layout",
]
