"""One mesh search: a logical mesh shape's device mappings, each searched, the fastest kept.

Both planners that choose operator strategies on a mesh call :func:`search_mesh`: the single-stage planner
(``planner.auto.plan``: every 2D shape of all n devices and the cluster's 3-axis ones, one after the other) and
the stage planner (``planner.stage.StagePlanner``: a stage's layers on its submesh, for the pipeline's stage
DP). What differs between them is only what they give it: the graph (the whole step or a stage's slice), the
ranks (``0..n−1`` or the submesh's), which mappings are the same problem, and whether resharders are kept across
calls.

For a shape (d1, d2) and each device mapping m (``cluster.mesh.MeshMapping``: which physical ranks form each
axis, ``mapped_ranks``), the mesh is ``LogicalMesh(cluster, shape, ranks[mapped_ranks(shape, m)])``; the
mapping-independent structure (strategies, groups, compute: ``ilp.build_structure``) is built once by the
caller, and a :class:`~meshpilot.planner.search.SearchTask` on the mapping's resharder goes to the searcher
(``search.Searcher``: the ILP, HiDup's Pareto DP or both). The answer, per shape,

    best = argmin_m  time(searcher(structure, resharder_m))       (the first of equal times: ``MeshSearch.best``)

with every mapping's outcome (a plan or its ``PlanError``) kept for the caller's report
(:class:`MeshSearch`). Mappings whose axes the search prices alike (``same``: equal group sizes, bandwidths,
latencies on every axis set) are one problem: only the first is searched.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from meshpilot.cluster.mesh import MeshMapping, mapped_ranks
from meshpilot.graph.capture import OpGraph
from meshpilot.planner.ilp import PlanError, Structure
from meshpilot.planner.search import Candidate, Searcher, SearchTask
from meshpilot.planner.zero import ParamEdges, ZeroMode
from meshpilot.sharding.reshard import Resharder


def mappings_of(shape: Sequence[int], allowed: Sequence[MeshMapping | str] = tuple(MeshMapping)) -> list[MeshMapping]:
    """The device mappings searched on `shape`: those of `allowed`, the column mapping only when two axes have
    devices (on one axis it is the row mapping); at least the row mapping."""
    spread = sum(d > 1 for d in shape) > 1
    maps = [MeshMapping(m) for m in allowed if MeshMapping(m) == MeshMapping.ROW or spread]
    return maps or [MeshMapping.ROW]


@dataclass(frozen=True)
class MappingTry:
    """One device mapping's search: its resharder and its plan, or why it has none."""

    mapping: MeshMapping
    resharder: Resharder
    candidate: Candidate | None
    error: PlanError | None


@dataclass(frozen=True)
class MeshSearch:
    """Every mapping searched on one shape, in order, and the fastest."""

    tries: tuple[MappingTry, ...]

    @property
    def best(self) -> MappingTry | None:
        """The try with the least step time (the first of equal ones), None where no mapping has a plan."""
        best = None
        for t in self.tries:
            if t.candidate is not None and (best is None or t.candidate.time_s < best.candidate.time_s):
                best = t
        return best

    @property
    def errors(self) -> list[PlanError]:
        return [t.error for t in self.tries if t.error is not None]


def search_mesh(
    graph: OpGraph,
    struct: Structure,
    param_edges: ParamEdges,
    searcher: Searcher,
    ranks: Sequence[int],
    mappings: Sequence[MeshMapping],
    resharder: Callable[[MeshMapping, np.ndarray], Resharder],
    *,
    capacity: float,
    zero: ZeroMode,
    microbatches: int,
    time_limit: float,
    mip_gap: float | None = None,
    relaxed: bool = False,
    gather_once: bool = True,
    same: Callable[[MeshMapping], Hashable] | None = None,
) -> MeshSearch:
    """Search `struct` (``ilp.build_structure`` of `graph` on the shape) under each of `mappings` of `ranks`
    (module docstring). ``resharder(mapping, physical)`` gives the resharder of the mesh whose row-major ranks
    are `physical` (the caller may keep them across calls); ``same(mapping)``, when given, keys the mappings
    that are one problem: a mapping whose key was searched already is skipped. `mip_gap` and `relaxed` go to
    the :class:`SearchTask` (None, False: its defaults)."""
    shape = tuple(struct.mesh_shape)
    tries: list[MappingTry] = []
    seen: set[Hashable] = set()
    for mapping in mappings:
        if same is not None:
            key = same(mapping)
            if key in seen:  # the same ILP as a mapping tried before: the same plan, which that one keeps
                continue
            seen.add(key)
        physical = np.asarray(ranks)[mapped_ranks(shape, mapping)]
        rs = resharder(mapping, physical)
        extra = {} if mip_gap is None else {"mip_gap": mip_gap}
        task = SearchTask(
            graph, struct, rs, param_edges, mapping, capacity=capacity, zero=zero, microbatches=microbatches,
            time_limit=time_limit, gather_once=gather_once, relaxed=relaxed, **extra,
        )  # fmt: skip
        try:
            tries.append(MappingTry(mapping, rs, searcher.search(task), None))
        except PlanError as e:
            tries.append(MappingTry(mapping, rs, None, e))
    return MeshSearch(tuple(tries))
