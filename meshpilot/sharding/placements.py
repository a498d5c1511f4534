"""Sharding specs on N-D meshes (Alpa §4.1, Table 1), as tuples of DTensor placements, one per mesh axis.

A tensor's layout is ``(p_0, ..., p_{n-1})`` with ``p_a`` the placement along mesh axis ``a``:
``Replicate()`` (R), ``Shard(d)`` (S(d): tensor dim d split over the axis) or ``Partial()`` (P: every
device holds a partial sum). Alpa's ``S0R`` on a 2D matrix is ``(Shard(0), Replicate())`` = ``S(0)R`` here,
``RS1`` is ``RS(1)``, ``S01R`` (dim 0 over both axes) is ``S(0)S(0)``.

The printable form concatenates the axes (``S(0)S(1)``, ``RP``); JSON stores one string per axis.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]

R = Replicate()


def fmt_placement(p: Placement) -> str:
    """``Shard(0)`` -> ``S(0)``, ``Replicate()`` -> ``R``, ``Partial("sum")`` -> ``P``."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        op = getattr(p, "reduce_op", "sum")
        return "P" if op == "sum" else f"P({op})"
    return str(p)


def fmt(pl: Placements | None) -> str:
    """Printable layout of a tensor: ``S(0)R``; ``-`` for a non-tensor."""
    if pl is None:
        return "-"
    return "".join(fmt_placement(p) for p in pl)


def parse_placement(s: str) -> Placement:
    """Inverse of :func:`fmt_placement`."""
    if s == "R":
        return Replicate()
    if s == "P":
        return Partial()
    if s.startswith("S(") and s.endswith(")"):
        return Shard(int(s[2:-1]))
    if s.startswith("P(") and s.endswith(")"):
        return Partial(s[2:-1])
    raise ValueError(f"unknown placement {s!r}; expected R, P, P(op) or S(d)")


def to_json(pl: Placements | None) -> list[str] | None:
    return None if pl is None else [fmt_placement(p) for p in pl]


@functools.cache
def json_layout(pl: Placements | None) -> tuple[str, ...] | None:
    """:func:`to_json` of `pl` as a tuple (a plan's layouts), made once per layout in the process: a plan
    writes ~10,000 of them, of a few dozen distinct layouts (issue 33 item 4)."""
    return None if pl is None else tuple(fmt_placement(p) for p in pl)


def from_json(v: Sequence[str] | None) -> Placements | None:
    return None if v is None else tuple(parse_placement(s) for s in v)


def replicated(ndim: int) -> Placements:
    return (R,) * ndim


def shard_factor(pl: Placements, mesh_shape: Sequence[int]) -> int:
    """How many pieces the tensor is cut into (its memory per device is size / this)."""
    return math.prod(n for p, n in zip(pl, mesh_shape) if isinstance(p, Shard))


def work_split(pl: Placements, mesh_shape: Sequence[int]) -> int:
    """How many devices share the work that produced a tensor of this layout (Shard and Partial axes)."""
    return math.prod(n for p, n in zip(pl, mesh_shape) if not isinstance(p, Replicate))


def is_even(pl: Placements, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Whether every sharded tensor dim divides evenly over the mesh axes sharding it."""
    per_dim: dict[int, int] = {}
    for p, n in zip(pl, mesh_shape):
        if isinstance(p, Shard):
            d = p.dim if p.dim >= 0 else p.dim + len(shape)
            if d >= len(shape):
                return False
            per_dim[d] = per_dim.get(d, 1) * n
    return all(shape[d] % k == 0 for d, k in per_dim.items())


def candidate_placements(shape: Sequence[int], mesh_shape: Sequence[int], even: bool = True) -> list[Placements]:
    """Every R / S(d) layout of a tensor on the mesh (Alpa Table 1, generalised to N-D meshes).

    With ``even`` only layouts whose sharded dims divide evenly are kept (meshpilot never plans uneven
    shards: DTensor pads them, and the predicted bytes would not match the run).
    """
    per_axis: list[list[Placement]] = []
    for n in mesh_shape:
        opts: list[Placement] = [R]
        if n > 1:
            opts += [Shard(d) for d in range(len(shape))]
        per_axis.append(opts)
    out = []
    for combo in itertools.product(*per_axis):
        if not even or is_even(combo, shape, mesh_shape):
            out.append(tuple(combo))
    return out


def unique(pls: Iterable[Placements]) -> list[Placements]:
    seen: dict[Placements, None] = {}
    for p in pls:
        seen.setdefault(p, None)
    return list(seen)


# Interned layouts: hashing tuples of DTensor placements is slow, so the planner works on small ints.
_IDS: dict[Placements, int] = {}
_PLS: list[Placements] = []


def pid(pl: Placements | None) -> int:
    """A process-wide small-int id for a layout (``-1`` for None)."""
    if pl is None:
        return -1
    i = _IDS.get(pl)
    if i is None:
        i = _IDS[pl] = len(_PLS)
        _PLS.append(pl)
    return i


def by_id(i: int) -> Placements | None:
    return None if i < 0 else _PLS[i]
