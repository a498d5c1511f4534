"""Which bytes go where when a checkpoint saved under one plan is loaded under another, planned offline.

A checkpoint (``meshpilot.runtime.checkpoint``) holds every parameter and its AdamW states as shards: under
plan A, physical rank ``r`` holds, of a parameter of global shape ``(n_0, …)``, the *box* ``[lo_d, hi_d)`` per
dim that its layout and mesh coordinate give it. Loading under plan B, each rank of B needs its own box;
torch.distributed.checkpoint reads the overlapping pieces of A's files. This module computes those pieces
without touching a process group or a file, so a user (and ``meshpilot train --resume``) can see before
loading what moves: per parameter, per destination rank, which source rank's shard supplies which box.

Boxes (:func:`shard_box`): for each mesh axis in order, ``Shard(d)`` cuts dim ``d``'s current extent into
``mesh_shape[axis]`` chunks of ``ceil(extent / n)`` and keeps the coordinate's (``torch.chunk``, as DTensor
cuts); ``Replicate`` keeps the extent. Parameters are never ``Partial``.

Plan (:func:`plan_reshard`): for every parameter and destination rank, the intersection of its box with each
*distinct* source box; each non-empty piece is read from one of the source ranks holding that box — the
destination's own physical rank when it holds it (a local read), else the holder that has sent the fewest
bytes so far (replicas share the load). Every destination box is covered exactly once (the source boxes of
one layout tile the tensor). Bytes count the parameter and its ``state_factor − 1`` AdamW states (AdamW: 3).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from torch.distributed.tensor import Shard

from meshpilot.errors import UserError
from meshpilot.sharding.placements import Placements, from_json

Box = tuple[tuple[int, int], ...]


def shard_box(shape: Sequence[int], layout: Placements, mesh_shape: Sequence[int], coord: Sequence[int]) -> Box:
    """The ``[lo, hi)`` per dim that mesh coordinate `coord` holds of a tensor of `shape` in `layout`."""
    box = [[0, int(n)] for n in shape]
    for axis, p in enumerate(layout):
        if isinstance(p, Shard):
            d = p.dim % len(shape)
            lo, hi = box[d]
            chunk = -(-(hi - lo) // mesh_shape[axis])
            start = min(lo + coord[axis] * chunk, hi)
            box[d] = [start, min(start + chunk, hi)]
    return tuple((lo, hi) for lo, hi in box)


def _volume(box: Box) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in box)


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


@dataclass(frozen=True)
class Piece:
    """One read: `box` of parameter `param` from source rank `src`'s shard into destination rank `dst`."""

    param: str
    src: int
    dst: int
    box: Box
    nbytes: int
    """Bytes of the piece times the state factor (the parameter and its optimizer states)."""


@dataclass
class ReshardPlan:
    """Every piece of a checkpoint's move from plan A's shards to plan B's, and what it adds up to."""

    pieces: list[Piece] = field(default_factory=list)
    local_bytes: int = 0
    """Read by a rank from its own earlier shard."""
    remote_bytes: int = 0
    """Read from another rank's shard."""
    per_dst: dict[int, int] = field(default_factory=dict)
    per_src: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    """How long planning took."""

    @property
    def total_bytes(self) -> int:
        return self.local_bytes + self.remote_bytes

    def summary(self) -> str:
        from meshpilot.io import fmt_size

        return (
            f"{len(self.pieces)} pieces, {fmt_size(self.total_bytes)} (weights and AdamW states): "
            f"{fmt_size(self.local_bytes)} from a rank's own shard, {fmt_size(self.remote_bytes)} from others'; "
            f"at most {fmt_size(max(self.per_dst.values(), default=0))} into one rank "
            f"(planned in {self.seconds * 1e3:.0f} ms)"
        )


def _ranks_by_coord(mesh_shape: Sequence[int], ranks: Sequence[int]) -> list[tuple[tuple[int, ...], int]]:
    """(mesh coordinate, physical rank) of every device of a plan (``Plan.mesh_ranks`` is row-major)."""
    coords = []
    for flat, r in enumerate(ranks):
        c, rest = [], flat
        for n in reversed(mesh_shape):
            c.append(rest % n)
            rest //= n
        coords.append((tuple(reversed(c)), int(r)))
    return coords


def plan_reshard(
    src_plan,
    dst_plan,
    shapes: Mapping[str, tuple[Sequence[int], int]],
    *,
    state_factor: int = 3,
) -> ReshardPlan:
    """The pieces that move a checkpoint of `src_plan`'s shards to `dst_plan`'s (module docstring).

    `shapes` maps each parameter name to (global shape, bytes per element); a parameter missing from either
    plan or from `shapes` is one clear line."""
    t0 = time.perf_counter()
    src_layouts, dst_layouts = dict(src_plan.params), dict(dst_plan.params)
    if set(src_layouts) != set(dst_layouts):
        only = sorted(set(src_layouts) ^ set(dst_layouts))[:3]
        raise UserError(f"the two plans are for different models: parameters {only} are in only one of them")
    missing = sorted(set(src_layouts) - set(shapes))[:3]
    if missing:
        raise UserError(f"no shape given for parameters {missing}; pass every parameter's (shape, element size)")
    src_devs = _ranks_by_coord(src_plan.mesh_shape, src_plan.mesh_ranks)
    dst_devs = _ranks_by_coord(dst_plan.mesh_shape, dst_plan.mesh_ranks)
    out = ReshardPlan()
    sent: dict[int, int] = {}
    for name, (shape, itemsize) in shapes.items():
        if name not in src_layouts:
            continue
        shape = tuple(int(n) for n in shape)
        s_layout, d_layout = from_json(src_layouts[name]), from_json(dst_layouts[name])
        holders: dict[Box, list[int]] = {}
        for coord, r in src_devs:
            holders.setdefault(shard_box(shape, s_layout, src_plan.mesh_shape, coord), []).append(r)
        for coord, dst in dst_devs:
            want = shard_box(shape, d_layout, dst_plan.mesh_shape, coord)
            for box, ranks in holders.items():
                piece = _intersect(want, box)
                if piece is None:
                    continue
                src = dst if dst in ranks else min(ranks, key=lambda r: (sent.get(r, 0), r))
                nbytes = _volume(piece) * itemsize * state_factor
                sent[src] = sent.get(src, 0) + nbytes
                out.pieces.append(Piece(name, src, dst, piece, nbytes))
                out.per_dst[dst] = out.per_dst.get(dst, 0) + nbytes
                out.per_src[src] = out.per_src.get(src, 0) + nbytes
                if src == dst:
                    out.local_bytes += nbytes
                else:
                    out.remote_bytes += nbytes
    out.seconds = time.perf_counter() - t0
    return out


@dataclass(frozen=True)
class Layouts:
    """What :func:`plan_reshard` reads of a plan — its mesh, ranks and parameter layouts — as a checkpoint's
    manifest keeps it (``to_dict`` / ``from_dict``), so a resume can say what moves after the plan file is gone."""

    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    params: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def of(cls, plan) -> Layouts:
        return cls(tuple(plan.mesh_shape), tuple(plan.mesh_ranks), tuple((f, tuple(lay)) for f, lay in plan.params))

    def to_dict(self) -> dict:
        return {"mesh_shape": list(self.mesh_shape), "mesh_ranks": list(self.mesh_ranks), "params": self.params}

    @classmethod
    def from_dict(cls, d: Mapping) -> Layouts:
        return cls(tuple(d["mesh_shape"]), tuple(d["mesh_ranks"]), tuple((f, tuple(lay)) for f, lay in d["params"]))


def shapes_from_signature(sig: Mapping[str, Sequence]) -> dict[str, tuple[tuple[int, ...], int]]:
    """(global shape, element size) of every tensor of a checkpoint signature (``checkpoint.signature``)."""
    import torch

    return {name: (tuple(shape), getattr(torch, dtype).itemsize) for name, (shape, dtype) in sig.items()}
