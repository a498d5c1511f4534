"""Alpa's intra-operator ILP (§4.2, Eq. 1) over the joint forward + backward graph, solved with HiGHS.

Decision variables
------------------
Nodes are partitioned into *decision groups*; a group ``g`` has a one-hot vector ``s_g`` over ``K_g``
choices and each node ``v`` in it reads its strategy off the group's choice through a map ``m_v``
(:class:`Problem`, built by :func:`build_problem`):

* a non-trivial node (matmul, attention, embedding, layer norm, losses, parameters, inputs) owns a group
  whose choices are its strategies (``m_v`` = identity);
* a *trivial* node (views, ``getitem``, element-wise ops) is merged into its deepest operand as Alpa does:
  it joins the operand's group, and for each choice ``k`` it takes the strategy ``m_v(k)`` that reads
  the operand's layout at the least resharding + compute cost (:func:`_merge_map_ids`); the loss' ``getitem``,
  on a tie, the one that reads it as it is (the loss edge wants it replicated: a replicated loss read as a
  free ``R -> P`` partial sum would be all-reduced again there; other merged nodes keep the first cheapest,
  which other plans' prices rest on);
* a node of a repeated layer joins the group of the identical node in the first layer
  (``OpGraph.canonical``), so every layer is decided once; its costs still add up per layer.

Objective (Eq. 1)
-----------------
    min  Σ_g s_gᵀ d_g  +  Σ_(u,v,a) s_{g(u)}ᵀ R_uva s_{g(v)}

* ``d_g[k] = Σ_{v in g} compute(v, m_v(k))`` — roofline time of the node's shard of the work
  (FLOPs and bytes divided by the devices sharing it, ``CostModel.compute``; a matmul at the rate the
  device profile measured for the nearest GEMM shape to its shard's, ``DeviceProfile.matmul_flops``) plus
  the device's fixed cost per operator, in :meth:`accounting.ComputeCost.node`. Views and ``_unsafe_view``
  cost nothing. A trainable parameter's choice also carries the optimizer's update of its shard, once a
  step (:meth:`accounting.ComputeCost.update`: a sharded weight updates less).
  Alpa sets compute to zero and forbids replicated matmuls instead; we price replication honestly.
  ``c_v`` (an op's own communication) is zero for DTensor strategies: partial sums stay ``Partial`` and
  are reduced on the outgoing edge, where ``R`` prices them. meshpilot's own strategies may issue
  collectives inside the op (``Strategy.colls``: a vocabulary-parallel softmax all-reduces its row maxima
  and sums); ``c_v`` is their cost on the mapping's ``CostModel``, added to ``d_g`` in :func:`price`.
* ``R_uva[k, l]`` = cost of resharding operand ``a`` of ``v`` from what ``u`` emits under ``k`` to what
  ``v`` needs under ``l`` (:class:`~meshpilot.sharding.reshard.Resharder`, Alpa Table 2 per mesh axis).
  Gradients must arrive in their parameter's layout and the loss replicated: two more edge kinds.
  On a CPU device a gradient's reduction, which the runtime issues in a bucket with others
  (``planner.buckets``), is priced as its share of a collective of the bucket size, ``CostModel.coalesced``
  (:meth:`Pricer.matrix`): priced one by one, each would pay the fixed cost of a call the runtime makes once per
  bucket (on gloo: a probed curve's milliseconds and the host cost). On a GPU the gradients stay priced one by
  one for now: the same rule there lowers every predicted step of ``tests/test_ilp.py``'s bench graph on
  ``dgx-h100:2`` and ``alpa-p3x8`` (e.g. 186 → 157 µs on a 4 × 4 mesh) but changes GPU plans, which this
  change was not to do (docs/benchmarks.md, issue 30). A parameter's all-gather
  (a gather group, ``planner.prefetch``) stays priced on its own on every device: the plan's predicted step
  (``StepTime``) counts every gather on its own, so the ILP pricing them grouped chose, on a GPU, plans the step
  prices dearer.

Linearisation: the quadratic term of an edge between two different groups becomes edge variables over
*distinct layouts*: with ``P`` the distinct layouts ``u`` emits and ``Q`` the distinct layouts ``v``
requires, ``e_pq ≥ 0`` with ``Σ_q e_pq = Σ_{k: out(k)=p} s_uk`` and ``Σ_p e_pq = Σ_{l: in(l)=q} s_vl``
(exact: the one-hot rows force ``e`` one-hot), objective ``Σ C_pq e_pq``. Edges inside one group are
diagonal and go to ``d_g``; edges with ``|P| = 1`` or ``|Q| = 1`` too; identical edges (same groups,
same layout maps — every repeated layer) are summed into one block (:meth:`Problem.add_edge`).

Memory (two rows, :func:`build_structure`; terms from ``meshpilot.planner.accounting``)
-----------------------------------------------------------------------------------------
The plan reports the step's *peak* bytes per device by liveness over the joint graph
(``accounting.memory_use``): ``max(W + O + I + max_i live(i), W + O + I + G + T_opt)`` with parameters
``W``, AdamW states ``O`` (2 × the parameter, in its dtype), inputs and buffers ``I``, gradients ``G`` and
the foreach update's ``sqrt(exp_avg_sq)`` temporary ``T_opt``. ``max_i live(i)`` is not linear in the
choices, so the ILP holds two linear *lower bounds* of the peak to the capacity, one row each
(``accounting.MEMORY_ROWS``; ``Group.mem[row, k]``)::

    update:    Σ_g s_gᵀ mem_g[update]   ≤ capacity,  mem[update][k]   = Σ params (W + O + G + T_opt) / sf
                                                                        + inputs / sf
    backward:  Σ_g s_gᵀ mem_g[backward] ≤ capacity,  mem[backward][k] = Σ params (W + O) / sf + inputs / sf
                                                                        + Σ values the backward reads / sf

``update`` is the optimizer step exactly; ``backward`` is the start of the backward, where every saved
value is live (``accounting.row_bytes``, ``accounting.saved_values``). The peak exceeds ``max(rows)`` by
what lives at the peak node beyond them: the transient temporaries (a loss' logits and their fp32 upcast,
the loss' gradient), gradients produced before the peak, redistributed operand copies. ``MemoryUse.row``
records ``max(rows)`` next to the peak; when the peak exceeds the capacity while the rows fit, the planner
re-solves with the capacity the rows are held to lowered by that gap (``search.ILPSearcher``).
:func:`_min_need` (each group at its least, per row, the larger row) is a true lower bound of the peak.

``mem_zero_g`` are the same rows when the ZeRO post-pass (``meshpilot.planner.zero``) will shard the
weight update over every mesh axis where a parameter is replicated: a parameter stored in layout ``L``
with ``n_R`` devices replicating it (product of its ``R`` axes) then needs ``(W + O + G + T_opt) / (sf · n_R)``
on the update row and ``W / sf`` (the all-gathered copy kept for the backward) ``+ (W + O) / (sf · n_R)``
on the backward row (``accounting.zero_row_bytes``; the smaller of plain and ZeRO is used).
:func:`solve` takes either pair (``memory="zero"``); the post-pass then makes the ZeRO rows true, or the
caller falls back to the plain rows.

Solved by HiGHS (``planner.highs``: ``highspy``, with the model and options of ``scipy.optimize.milp``) to a
relative MIP gap (10⁻³) or :data:`NODE_LIMIT` branch-and-bound nodes, whichever comes first: both count the
solver's work, not the clock, so a plan does not depend on how loaded the machine is (a wall-clock limit cut
the capped block solves of GPT-39B's stage table short at load 10–17, and so changed the table). The time
limit (:data:`TIME_LIMIT_S` by default) is only a safety net far above what a solve takes. The gap reached is
reported. If the memory row makes it infeasible, :class:`PlanError` says the smallest need found and the capacity.

Structure once per mesh shape, prices per device mapping
---------------------------------------------------------
Nothing but the resharding seconds depends on how mesh coordinates map to devices, so the work is split:

* :func:`build_structure` (once per mesh shape): strategies (a repeated layer's node asks DTensor once:
  its strategies are memoised by canonical node and operand candidates), groups, the compute-cost vector
  of every strategy (roofline on the device, mapping-independent), the memory rows, and the edge
  *classes*: all edges ``(u, i) → (v, a)`` whose endpoints share canonical node and layer position (32
  layers → one class with multiplicity 32) are priced once and multiplied. For every ``(P, Q, tensor)``
  layout matrix the table records which collectives (kind, axis, bytes) each entry needs
  (:class:`ReshardTable`, DTensor's transform steps, computed once per shape).
* :func:`price` (per device mapping): each distinct collective is priced once by that mapping's
  ``CostModel``; every matrix is then a ``bincount`` of those seconds (:class:`Pricer`); merged trivial
  nodes get their maps (they depend on resharding seconds), and the groups, edge blocks and memory rows
  are filled from the classes.

:func:`build_problem` (structure + price) is the one-call form. :func:`priced` keeps each mapping's problem on
its structure (a stage searched under several memory caps is priced once), and :func:`solve` keeps each
problem's matrices per memory row kind: between solves of one problem only the memory rows' bound changes.
It keeps the answers too: the plan without memory rows (solved once per problem; LP-integral on a repeated
block, a tenth of a capped solve) answers every capacity its rows fit, and a plan found under a capacity
answers any smaller one its rows still fit (the feasible set only shrank), and a plan found on the ZeRO rows
answers the plain rows where its plain rows fit (a plan's ZeRO rows are at most its plain rows: the plain feasible
set lies inside the ZeRO one) — all exact within the MIP gap.

Relaxed solves
--------------
``solve(relaxed=True)`` (:func:`_relaxed_then_fixed`) answers from the LP relaxation (every selection ``s_g ∈
[0, 1]``): where the relaxation's optimum selects one strategy per group it is the ILP's optimum too (a relaxation
is a lower bound, and that point is integral; on a tie HiGHS may return another optimal vertex than the ILP's, the
same objective); where some selections are fractional, those integral in it are fixed and the ILP is solved over
the rest (the whole ILP only where that has no plan). The answer's objective z is within ``(z − z_LP) / z`` of the
optimum, z_LP the relaxation's, and that bound is the gap it reports (``Solution.gap``): it is an estimate for
pricing, not a plan of its own — the estimated stage table's searches at the device's capacity
(``stack.RELAXED_PRICING``); the chosen stages are planned with the whole ILP. At the device's capacity (no memory
row binds) a piece's relaxation is mostly integral and its solve a fraction of the ILP's (the root's presolve,
cuts and heuristics skipped): GPT-39B's estimated table's pre and post pieces, 158 solves, 155 with an integral
relaxation, take 4.2 CPU s as ILPs and 1.5 as relaxations (replayed; ``docs/benchmarks.md``, issue 29 item 6,
cheap29).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
import torch

from meshpilot.errors import UserError
from meshpilot.graph.capture import NodeKind, OpGraph, OpNode, TensorInfo
from meshpilot.graph.gemms import node_gemm
from meshpilot.io import fmt_size
from meshpilot.planner.accounting import (
    MEMORY_ROWS,
    ComputeCost,
    EdgeKind,
    row_bytes,
    saved_values,
    step_edges,
    zero_row_bytes,
)
from meshpilot.planner.force import BoundForce, ForceRule, ForceSpec
from meshpilot.planner.highs import Csc, MilpAnswer, solve_milp
from meshpilot.sharding.placements import by_id, pid, replicated, shard_factor
from meshpilot.sharding.reshard import UNSUPPORTED_S, Collective, CollectiveKind, Resharder
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, StrategySource


class PlanError(UserError):
    """No sharding plan fits in device memory (or the problem cannot be solved).

    The facts travel as fields, not only as text: ``mesh_shape`` (the mesh it was on, if one),
    ``need_bytes`` (the smallest per-device memory a plan was found to need) and ``capacity_bytes`` (what
    a device holds). The CLI's candidate table reads them; the message says the same for a person."""

    def __init__(
        self,
        message: str,
        *,
        mesh_shape: tuple[int, ...] | None = None,
        need_bytes: float | None = None,
        capacity_bytes: float | None = None,
    ) -> None:
        super().__init__(message)
        self.mesh_shape = tuple(mesh_shape) if mesh_shape is not None else None
        self.need_bytes = need_bytes
        self.capacity_bytes = capacity_bytes

    def __reduce__(self):  # pickled with its fields (a planning worker returns the stages that fit nowhere)
        return (_plan_error, (str(self), self.mesh_shape, self.need_bytes, self.capacity_bytes))


def _plan_error(message: str, mesh_shape, need_bytes, capacity_bytes) -> PlanError:
    return PlanError(message, mesh_shape=mesh_shape, need_bytes=need_bytes, capacity_bytes=capacity_bytes)


_TRIVIAL_TARGETS = {
    "aten.clone.default",
    "aten._to_copy.default",
    "aten.contiguous.default",
    "aten.ones_like.default",
    "aten.zeros_like.default",
    "aten.fill.Scalar",
}


def is_trivial(node: OpNode) -> bool:
    """Alpa merges computationally trivial operators (element-wise, views) into an operand."""
    if node.kind == "getitem":
        return True
    if node.kind != "op" or not node.inputs:
        return False
    if node.is_view or node.target in _TRIVIAL_TARGETS:
        return True
    fx = node.fx_node
    tags = getattr(fx.target, "tags", ()) if fx is not None else ()
    return torch.Tag.pointwise in tags


@dataclass
class Group:
    size: int
    cost: np.ndarray
    mem: np.ndarray
    """[rows, size]: bytes per device of each choice on each memory row (``accounting.MEMORY_ROWS``)."""
    owner: str
    mem_zero: np.ndarray | None = None
    """The memory rows if the ZeRO post-pass shards every replicated parameter's update (module docstring)."""


@dataclass
class EdgeBlock:
    gu: int
    gv: int
    lab_u: np.ndarray
    lab_v: np.ndarray
    cost: np.ndarray  # [|P|, |Q|]


@dataclass
class Problem:
    """The ILP before it is handed to HiGHS (see the module docstring)."""

    graph: OpGraph
    mesh_shape: tuple[int, ...]
    strategies: dict[str, list[Strategy]]
    groups: list[Group] = field(default_factory=list)
    node_group: dict[str, int] = field(default_factory=dict)
    node_map: dict[str, np.ndarray] = field(default_factory=dict)
    edges: dict[tuple, EdgeBlock] = field(default_factory=dict)
    capacity: float = math.inf
    build_s: float = 0.0
    forced: frozenset[str] = frozenset()
    """Nodes whose layout a ``force`` pattern pinned (the ZeRO post-pass leaves them alone)."""
    lp: dict = field(default_factory=dict, repr=False, compare=False)
    """:func:`solve`'s matrices per memory row kind: only the capacity changes between solves of one problem."""

    def new_group(self, size: int, owner: str) -> int:
        rows = len(MEMORY_ROWS)
        self.groups.append(Group(size, np.zeros(size), np.zeros((rows, size)), owner, np.zeros((rows, size))))
        return len(self.groups) - 1

    def add_edge(self, gu: int, gv: int, lab_u: np.ndarray, lab_v: np.ndarray, cost: np.ndarray) -> None:
        if not cost.any():
            return
        if gu == gv:
            self.groups[gu].cost += cost[lab_u, lab_v]
            return
        if cost.shape[0] == 1 or self.groups[gu].size == 1:
            self.groups[gv].cost += cost[lab_u[0], lab_v]
            return
        if cost.shape[1] == 1 or self.groups[gv].size == 1:
            self.groups[gu].cost += cost[lab_u, lab_v[0]]
            return
        key = (gu, gv, lab_u.tobytes(), lab_v.tobytes())
        blk = self.edges.get(key)
        if blk is None:
            self.edges[key] = EdgeBlock(gu, gv, lab_u, lab_v, cost.copy())
        else:
            blk.cost += cost

    @property
    def num_choices(self) -> int:
        return sum(g.size for g in self.groups)


def _labels(values) -> tuple[np.ndarray, list]:
    """Label every value by its first appearance: ``[7, 3, 7] -> ([0, 1, 0], [7, 3])``.

    A dict over the values, not ``np.unique``: the arrays are a group's strategies (a few to a few dozen)
    and pricing calls this twice per edge class — ``np.unique``'s fixed cost was a tenth of a
    Wide-ResNet plan's time."""
    first: dict[int, int] = {}
    lab = [first.setdefault(v, len(first)) for v in np.asarray(values, dtype=np.int64).reshape(-1).tolist()]
    return np.array(lab, dtype=np.int64), list(first)


# ------------------------------------------------------------------------------------- resharding prices


class ReshardTable:
    """Which collectives every entry of a ``(P, Q, tensor)`` resharding matrix needs, on one mesh shape.

    Independent of the device mapping (DTensor's transform steps depend on the mesh shape only), so it is
    computed once per shape and shared by the :class:`Pricer` of every mapping and every plan in the process
    (:meth:`for_shape`).
    """

    _SHARED: dict[tuple[int, ...], ReshardTable] = {}

    @classmethod
    def for_shape(cls, resharder: Resharder) -> ReshardTable:
        """The process's table for `resharder`'s mesh shape."""
        key = tuple(resharder.mesh_shape)
        table = cls._SHARED.get(key)
        if table is None:
            table = cls._SHARED[key] = cls(resharder)
        return table

    def __init__(self, resharder: Resharder):
        self.resharder = resharder
        self.colls: list[Collective] = []
        self._cid: dict[Collective, int] = {}
        self._spec: dict[tuple, tuple[int, int, np.ndarray, np.ndarray]] = {}
        self._steps: dict[tuple[int, int, int], tuple[tuple[str, int, float], ...]] = {}

    def spec(self, P: tuple[int, ...], Q: tuple[int, ...], info: TensorInfo):
        """``(|P|, |Q|, entry, collective)``: entry ``p·|Q| + q`` needs ``colls[collective]``."""
        key = (P, Q, info)
        hit = self._spec.get(key)
        if hit is not None:
            return hit
        ent: list[int] = []
        cid: list[int] = []
        nq, ndim, nbytes = len(Q), len(info.shape), info.nbytes
        for a, p in enumerate(P):
            if p < 0:
                continue
            for b, q in enumerate(Q):
                if q == p or q < 0:
                    continue
                for kind, axis, frac in self._pair(p, q, ndim):
                    c = Collective(kind, axis, round(frac * nbytes))  # as Resharder.collectives makes it
                    j = self._cid.get(c)
                    if j is None:
                        j = self._cid[c] = len(self.colls)
                        self.colls.append(c)
                    ent.append(a * nq + b)
                    cid.append(j)
        hit = self._spec[key] = (len(P), nq, np.asarray(ent, dtype=np.int64), np.asarray(cid, dtype=np.int64))
        return hit

    def _pair(self, p: int, q: int, ndim: int) -> tuple[tuple[str, int, float], ...]:
        """``Resharder.steps`` between interned layouts: keyed by ids, which hash faster than placements."""
        key = (p, q, ndim)
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = self.resharder.steps(by_id(p), by_id(q), ndim)
        return hit


BUCKETED = frozenset((CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER))
"""The collective kinds of a gradient's resharding that join a gradient bucket (``planner.buckets``)."""


def is_gradient(graph: OpGraph, ec: EdgeClass) -> bool:
    """Whether edge class `ec` carries a gradient into its parameter's layout (its reduction joins a bucket)."""
    return ec.end == EdgeEnd.OUTPUT and graph[ec.dst].kind == NodeKind.PARAM


class Pricer:
    """Seconds of resharding matrices on one device mapping: each distinct collective is priced once by
    the mapping's ``CostModel`` (through ``Resharder.collective_cost``), every matrix is a sum of them. On a
    gradient's edge (`bucketed`) of a CPU device an entry whose resharding is one reduction takes its share of
    a bucket-sized one instead (``CostModel.coalesced``, the size ``planner.buckets.bucket_bytes`` of its axis)."""

    def __init__(self, table: ReshardTable, resharder: Resharder):
        self.table = table
        self.resharder = resharder
        self._sec = np.zeros(0)
        self._share: dict[int, float] = {}
        self._size: dict[int, int] = {}
        self._mat: dict[tuple, np.ndarray] = {}

    def matrix(self, P: tuple[int, ...], Q: tuple[int, ...], info: TensorInfo, bucketed: bool = False) -> np.ndarray:
        bucketed = bucketed and self.resharder.cost_model.device.is_cpu  # GPU plans unchanged (module docstring)
        key = (P, Q, info, bucketed)
        m = self._mat.get(key)
        if m is not None:
            return m
        n_p, n_q, ent, cid = self.table.spec(P, Q, info)
        colls = self.table.colls
        if len(self._sec) < len(colls):
            cc = self.resharder.collective_cost
            extra = np.fromiter((cc(c) for c in colls[len(self._sec) :]), dtype=float)
            self._sec = np.concatenate([self._sec, extra])
        if ent.size:
            sec = self._sec[cid]
            if bucketed:
                alone = np.bincount(ent, minlength=n_p * n_q)[ent] == 1  # one collective on the entry
                sec = np.array([self._bucketed(j) if a else s for j, a, s in zip(cid, alone, sec)])
            m = np.bincount(ent, weights=sec, minlength=n_p * n_q).reshape(n_p, n_q)
        else:
            m = np.zeros((n_p, n_q))
        self._mat[key] = m
        return m

    def _bucketed(self, j: int) -> float:
        """Seconds of ``table.colls[j]`` on a gradient's edge: a reduction (as issued) as its share of a bucket."""
        from meshpilot.planner.buckets import bucket_bytes
        from meshpilot.sharding.reshard import as_issued

        c = self.table.colls[j]
        cost = self.resharder.cost_model
        kind, nbytes = as_issued(c.kind, c.nbytes, self.resharder.mesh_shape[c.axis], cost.device.is_cpu)
        if kind not in BUCKETED:
            return float(self._sec[j])
        hit = self._share.get(j)
        if hit is None:
            if c.axis not in self._size:
                self._size[c.axis] = bucket_bytes(cost, c.axis)
            hit = self._share[j] = cost.coalesced(CollectiveKind(kind).value, nbytes, c.axis, self._size[c.axis])
        return hit


# ------------------------------------------------------------------------------------------ structure


@dataclass
class Structure:
    """Everything about one mesh shape's ILP that the device mapping does not change (module docstring)."""

    graph: OpGraph
    mesh_shape: tuple[int, ...]
    strategies: dict[str, list[Strategy]]
    rep: dict[str, str]
    """Node -> the node whose group and strategy map it shares (itself, or its canonical twin)."""
    reps: list[str]
    """Representatives in topological order."""
    group_of: dict[str, int]
    """Representative -> group."""
    group_sizes: list[int]
    group_owner: list[str]
    merge: dict[str, tuple[str, int, int]]
    """Merged trivial representative -> (operand node, its output index, operand position)."""
    merge_cost: dict[str, np.ndarray]
    out_ids: dict[str, np.ndarray]
    """Representative -> [strategies, outputs] interned output layouts (-1: not a tensor)."""
    in_ids: dict[str, np.ndarray]
    cost_terms: list[tuple[str, np.ndarray]]
    """(representative, compute seconds per strategy summed over the nodes of its class)."""
    edge_terms: list[EdgeClass]
    mem_terms: list[tuple[str, np.ndarray, np.ndarray]]
    """(representative, [rows, strategies] bytes per device, the same on the ZeRO rows)."""
    table: ReshardTable
    forced: frozenset[str]
    build_s: float = 0.0
    accumulating: bool = False
    """Whether the memory rows (and ``search``'s ``memory_use``) hold the earlier microbatches' summed
    gradients (``accounting``: ``A``): a one-stage plan over more than one microbatch. Pipeline stages do not
    yet: their check (``planner.pipeline``) composes peaks without it."""
    coll_terms: list[tuple[str, int]] = field(default_factory=list)
    priced: dict = field(default_factory=dict, repr=False, compare=False)
    """:func:`price`'s problems by the resharder they were priced with (:func:`priced`): a stage searched under
    several memory caps prices each device mapping once."""
    """(representative, nodes of its class) for representatives with strategies that issue collectives
    inside the op (``Strategy.colls``); priced per mapping like edges."""


class EdgeEnd(StrEnum):
    """Where an edge class delivers its value: the layout it must arrive in."""

    OPERAND = "operand"
    """Operand ``slot`` of the reading node's strategy."""
    OUTPUT = "output"
    """Output ``slot`` of the destination's strategy (a gradient into its parameter, a buffer update)."""
    FIXED = "fixed"
    """The layout with id ``slot`` (the replicated loss)."""


@dataclass(frozen=True)
class EdgeClass:
    """Identical edges of the step (same representatives, same tensor — every repeated layer's), priced
    once and multiplied by ``count`` (crossings per step: ``accounting.Edge.runs`` summed)."""

    src: str
    index: int
    dst: str
    end: EdgeEnd
    slot: int
    info: TensorInfo
    count: int


def _placeholder(node: OpNode, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """One strategy for a node nothing was offered for: a ``getitem`` of an output that is not a tensor
    (``convolution_backward``'s bias gradient when there is no bias) — no tensor flows, nothing is priced."""
    rep = replicated(len(mesh_shape))
    outs = tuple(rep if o is not None else None for o in node.outputs) or (None,)
    return [
        Strategy(
            outs,
            tuple(rep for _ in node.inputs),
            StrategySource.DTENSOR if node.kind == "getitem" else StrategySource.FALLBACK,
        )
    ]


def _id_matrix(rows: list[tuple[int, ...]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), -1, dtype=np.int64)
    for j, r in enumerate(rows):
        out[j, : len(r)] = r
    return out


def build_structure(
    graph: OpGraph,
    builder: StrategyBuilder,
    resharder: Resharder,
    cost_model,
    merge_trivial: bool = True,
    force: dict[str, str] | None = None,
    microbatches: int = 1,
    accumulating: bool | None = None,
) -> Structure:
    """Strategies, groups, compute costs, memory vectors and edge classes of one mesh shape.

    `cost_model` prices compute only (roofline on the device: the same for every mapping); `resharder`
    supplies DTensor's transform steps (its cost model is not used here). `force` pins layouts of leaves:
    ``{pattern: "S(0)R"}`` where the fnmatch pattern names a parameter or buffer (``layers.*.weight``), an
    input (``input:0``) or a node; forced data parallelism, Megatron tensor parallelism and ZeRO-3-like
    plans are written this way (see ``meshpilot.planner.auto``). With `microbatches` m, compute, the ops' own
    collectives and every edge but the gradients' count m times (``accounting``: ``Edge.runs``), and
    (`accumulating`, by default ``m > 1``) the backward memory row holds the summed gradients.
    """
    accumulating = microbatches > 1 if accumulating is None else accumulating
    t0 = time.perf_counter()
    mesh_shape = tuple(builder.mesh_shape)
    pins = ForceSpec.of(force).bind(graph) if force else None
    if pins is not None:
        pins.spec.check_mesh(len(mesh_shape), mesh_shape)
    g = _group_nodes(graph, builder, pins, mesh_shape, merge_trivial)
    costs = ComputeCost(cost_model, mesh_shape, graph)
    out_ids = {r: _id_matrix([s.out_ids for s in g.strategies[r]]) for r in g.reps}
    in_ids = {r: _id_matrix([s.in_ids for s in g.strategies[r]]) for r in g.reps}
    merge_cost = {r: np.array([costs.node(graph[r], s) for s in g.strategies[r]], dtype=float) for r in g.merge}
    return Structure(
        graph=graph,
        mesh_shape=mesh_shape,
        strategies=g.strategies,
        rep=g.rep,
        reps=g.reps,
        group_of=g.group_of,
        group_sizes=g.sizes,
        group_owner=g.owners,
        merge=g.merge,
        merge_cost=merge_cost,
        out_ids=out_ids,
        in_ids=in_ids,
        cost_terms=_cost_terms(graph, g, costs, microbatches),
        edge_terms=_edge_classes(graph, g.rep, len(mesh_shape), microbatches),
        mem_terms=_memory_terms(graph, g, out_ids, mesh_shape, accumulating),
        accumulating=accumulating,
        table=ReshardTable.for_shape(resharder),
        coll_terms=[(r, count * microbatches) for r, count in g.coll_count.items()],
        forced=frozenset(g.forced),
        build_s=time.perf_counter() - t0,
    )


@dataclass
class _Grouped:
    """The node pass of :func:`build_structure`: each node's strategies, its representative (a repeated
    layer's node shares its canonical twin's; a trivial op is merged into its deepest operand, Alpa §4.2),
    the ILP's groups, and the compute and collective terms keyed so that identical nodes count once."""

    strategies: dict[str, list[Strategy]] = field(default_factory=dict)
    rep: dict[str, str] = field(default_factory=dict)
    reps: list[str] = field(default_factory=list)
    group_of: dict[str, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    merge: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    forced: set[str] = field(default_factory=set)
    cost_count: dict[tuple, list] = field(default_factory=dict)
    """(representative, FLOPs, bytes, dtype, GEMM) → [a node, how many]."""
    coll_count: dict[str, int] = field(default_factory=dict)
    """Representative → nodes whose strategies issue collectives of their own."""


def _group_nodes(graph: OpGraph, builder: StrategyBuilder, pins, mesh_shape: tuple[int, ...], merge_trivial: bool):
    """Every node's strategies (forced layouts applied) and its group: :class:`_Grouped`."""
    g = _Grouped()
    canonical = graph.canonical
    cand_cache: dict[tuple[int, int], list] = {}
    memo: dict[tuple, list[Strategy]] = {}

    def cands_of(src: str, i: int) -> list:
        sts = g.strategies[src]
        key = (id(sts), i)
        c = cand_cache.get(key)
        if c is None:
            c = cand_cache[key] = StrategyBuilder.out_candidates(sts, i)
        return c

    for node in graph.nodes:
        name = node.name
        canon = canonical.get(name, name)
        cands = [cands_of(s, i) for s, i in node.inputs]
        # a repeated layer's node has its canonical twin's strategies for the same operand candidates
        mkey = (canon, tuple(map(id, cands)))
        sts = memo.get(mkey)
        if sts is None:
            sts = memo[mkey] = builder.for_node(node, cands) or _placeholder(node, mesh_shape)
        if pins is not None and node.kind == "op":
            sts = _reach_pin(graph, builder, node, cands, sts, pins, memo)
        if pins is not None:
            kept = _apply_force(node, sts, pins, mesh_shape)
            if kept is not sts:
                g.forced.add(name)
                sts = kept
        g.strategies[name] = sts
        if canon != name and canon in g.rep and (g.strategies[canon] is sts or g.strategies[canon] == sts):
            r = g.rep[name] = g.rep[canon]
        elif merge_trivial and is_trivial(node) and len(sts) > 1:
            # merge into the deepest operand (Alpa §4.2)
            a = max(range(len(node.inputs)), key=lambda j: graph[node.inputs[j][0]].depth)
            src, i = node.inputs[a]
            r = g.rep[name] = name
            g.reps.append(name)
            g.group_of[name] = g.group_of[g.rep[src]]
            g.merge[name] = (src, i, a)
        else:
            r = g.rep[name] = name
            g.reps.append(name)
            g.group_of[name] = len(g.sizes)
            g.sizes.append(len(sts))
            g.owners.append(name)
        if node.kind == "op":
            gemm = node_gemm(graph, node)
            dtype = node.out.dtype if node.out else None
            key = (r, node.flops, node.bytes_read + node.bytes_written, dtype, gemm, node.float8)
            hit = g.cost_count.get(key)
            if hit is None:
                g.cost_count[key] = [node, 1]
            else:
                hit[1] += 1
            if any(st.colls for st in sts):
                g.coll_count[r] = g.coll_count.get(r, 0) + 1
    return g


def _edge_classes(graph: OpGraph, rep: dict[str, str], nd: int, microbatches: int) -> list[EdgeClass]:
    """The step's edges (``accounting.step_edges``): operands; the loss, replicated; gradients into their
    parameter's layout; updated buffers into theirs — identical ones (repeated layers) priced once."""
    edge_count: dict[tuple, list] = {}
    for e in step_edges(graph):
        info = graph[e.src].outputs[e.index]
        if e.kind == EdgeKind.OPERAND:
            key = (rep[e.src], e.index, rep[e.dst], EdgeEnd.OPERAND, e.operand, info)
        elif e.kind == EdgeKind.LOSS:
            key = (rep[e.src], e.index, rep[e.src], EdgeEnd.FIXED, pid(replicated(nd)), info)
        else:
            key = (rep[e.src], e.index, rep[e.dst], EdgeEnd.OUTPUT, 0, info)
        edge_count.setdefault(key, [0])[0] += e.runs(microbatches)
    return [EdgeClass(*k, c[0]) for k, c in edge_count.items() if k[5] is not None]


def _cost_terms(graph: OpGraph, g: _Grouped, costs: ComputeCost, microbatches: int) -> list:
    """Seconds per strategy of each representative: its ops' compute, every microbatch, and the optimizer's
    update of each trainable parameter, once a step, by the layout it is stored in."""
    terms = []
    for (r, *_), (node, count) in g.cost_count.items():
        count *= microbatches
        per = np.array([costs.node(node, s) for s in g.strategies[r]], dtype=float)
        if per.any():
            terms.append((r, per * count if count != 1 else per))
    update_count: dict[tuple, list] = {}
    for n in graph.nodes:
        if n.kind == "param" and n.out is not None and graph.grads.get(n.fqn) is not None:
            update_count.setdefault((g.rep[n.name], n.out), [n, 0])[1] += 1
    for (r, _), (node, count) in update_count.items():
        per = np.array([costs.update(node, s) for s in g.strategies[r]], dtype=float)
        if per.any():
            terms.append((r, per * count))
    return terms


def _memory_terms(
    graph: OpGraph, g: _Grouped, out_ids: dict, mesh_shape: tuple[int, ...], accumulating: bool = False
) -> list:
    """Bytes per device of each representative on the ILP's two memory rows, plain and with the ZeRO
    post-pass's sharded updates: leaves (weights, gradients, optimizer states; buffers; inputs) and the
    values the backward reads (on the backward row only); `accumulating` (more than one microbatch): the
    earlier microbatches' summed gradients on the backward row (``accounting.row_bytes``)."""

    def sf_of(r: str, i: int) -> np.ndarray:
        ids = out_ids[r][:, i]
        return np.array([shard_factor(by_id(p), mesh_shape) if p >= 0 else 1 for p in ids], dtype=float)

    def repl_of(r: str) -> np.ndarray:
        """Devices replicating each strategy's output 0 (product of its R axes)."""
        out = []
        for p in out_ids[r][:, 0]:
            pl = by_id(p)
            out.append(math.prod(k for x, k in zip(pl, mesh_shape) if x.is_replicate()) if pl is not None else 1)
        return np.array(out, dtype=float)

    mem_count: dict[tuple, list] = {}
    for n in graph.nodes:
        if n.kind in ("param", "buffer", "input") and n.out is not None:
            trainable = n.kind == "param" and graph.grads.get(n.fqn) is not None
            key = ("leaf", g.rep[n.name], 0, n.out, n.kind, trainable, n.name in g.forced)
            mem_count.setdefault(key, [0, n])[0] += 1
    for name, i in saved_values(graph):
        info = graph[name].outputs[i]
        mem_count.setdefault(("saved", g.rep[name], i, info, "op", False, False), [0, graph[name]])[0] += 1
    terms = []
    for (kind, r, i, info, _, trainable, is_forced), (count, node) in mem_count.items():
        sf = sf_of(r, i)[None, :]  # [1, K]
        if kind == "leaf":
            std = np.array(row_bytes(node, trainable, accumulating).as_tuple())[:, None] / sf  # [rows, K]
            zero = std
            if trainable and not is_forced:
                z = zero_row_bytes(node, repl_of(r), accumulating)  # arrays over the strategies
                zero = np.minimum(std, np.stack([z.update, z.backward]) / sf)
        else:  # a value the backward reads: on the backward row only
            std = zero = np.array([0.0, float(info.nbytes)])[:, None] / sf
        terms.append((r, std * count, zero * count))
    return terms


def price(struct: Structure, pricer: Pricer, capacity: float = math.inf) -> Problem:
    """The ILP of `struct` on one device mapping (its resharding seconds come from `pricer`)."""
    t0 = time.perf_counter()
    prob = Problem(struct.graph, struct.mesh_shape, struct.strategies, capacity=capacity, forced=struct.forced)
    for size, owner in zip(struct.group_sizes, struct.group_owner):
        prob.new_group(size, owner)
    out_ids, in_ids, rep, group_of = struct.out_ids, struct.in_ids, struct.rep, struct.group_of
    nmap: dict[str, np.ndarray] = {}
    graph = struct.graph
    for r in struct.reps:
        m = struct.merge.get(r)
        if m is None:
            nmap[r] = np.arange(len(struct.strategies[r]))
            continue
        src, i, a = m
        rs = rep[src]
        p_vals = out_ids[rs][nmap[rs], i]
        as_is = graph.loss is not None and r == graph.loss[0] and graph[r].kind == NodeKind.GETITEM
        nmap[r] = _merge_map_ids(struct.merge_cost[r], p_vals, in_ids[r][:, a], graph[src].outputs[i], pricer, as_is)
    groups = prob.groups
    for r, per in struct.cost_terms:
        groups[group_of[r]].cost += per[nmap[r]]
    cc = pricer.resharder.op_collective_cost
    for r, count in struct.coll_terms:
        per = np.array([sum(cc(c) for c in s.colls) for s in struct.strategies[r]], dtype=float)
        groups[group_of[r]].cost += per[nmap[r]] * count
    for ec in struct.edge_terms:
        u, v, info, count = ec.src, ec.dst, ec.info, ec.count
        mu, mv = nmap[u], nmap[v]
        p_vals = out_ids[u][mu, ec.index]
        if ec.end == EdgeEnd.OPERAND:
            q_vals = in_ids[v][mv, ec.slot]
        elif ec.end == EdgeEnd.OUTPUT:
            q_vals = out_ids[v][mv, ec.slot]
        else:
            q_vals = np.full(len(mv), ec.slot, dtype=np.int64)
        lab_u, P = _labels(p_vals)
        lab_v, Q = _labels(q_vals)
        mat = pricer.matrix(tuple(P), tuple(Q), info, is_gradient(graph, ec))
        prob.add_edge(group_of[u], group_of[v], lab_u, lab_v, mat * count if count != 1 else mat)
    for r, std, zero in struct.mem_terms:
        g = groups[group_of[r]]
        m = nmap[r]
        g.mem += std[:, m]
        g.mem_zero += zero[:, m]
    prob.node_group = {n: group_of[r] for n, r in rep.items()}
    prob.node_map = {n: nmap[r] for n, r in rep.items()}
    prob.build_s = time.perf_counter() - t0
    return prob


def priced(struct: Structure, resharder: Resharder, capacity: float = math.inf) -> Problem:
    """:func:`price` of `struct` on `resharder`'s mapping, kept on the structure: the same problem (prices
    depend on the mapping only) whatever the capacity, which is set on it for this call."""
    hit = struct.priced.get(id(resharder))
    if hit is None or hit[0] is not resharder:
        hit = struct.priced[id(resharder)] = (resharder, price(struct, Pricer(struct.table, resharder)))
    prob = hit[1]
    prob.capacity = capacity
    return prob


def build_problem(
    graph: OpGraph,
    builder: StrategyBuilder,
    resharder: Resharder,
    cost_model,
    capacity: float = math.inf,
    merge_trivial: bool = True,
    force: dict[str, str] | None = None,
    microbatches: int = 1,
) -> Problem:
    """Strategies for every node, decision groups, node costs, edge blocks and the memory row.

    One call of :func:`build_structure` and :func:`price` (see those for `force`); the mesh search builds
    the structure once per shape and prices it per device mapping.
    """
    t0 = time.perf_counter()
    struct = build_structure(
        graph, builder, resharder, cost_model, merge_trivial=merge_trivial, force=force, microbatches=microbatches
    )
    prob = price(struct, Pricer(struct.table, resharder), capacity)
    prob.build_s = time.perf_counter() - t0
    return prob


def _reach_pin(graph: OpGraph, builder: StrategyBuilder, node: OpNode, cands: list, sts: list, pins, memo) -> list:
    """`sts`, or where an operator node is pinned to a layout none of them emits, its strategies asked again with
    that layout offered for every float operand of the node's own shape: a pin may ask for a layout the
    producers never emit (Megatron's sequence parallelism pins a residual add ``S(1)`` on the TP axis where
    the row-parallel product arrives partial), the edge then pricing the resharding (a reduce-scatter)."""
    from meshpilot.sharding.placements import fmt, parse_placement

    rule = pins.rule_for(node)
    if rule is None or node.out is None or any(s.outs and fmt(s.outs[0]) == rule.layout for s in sts):
        return sts
    want = tuple(parse_placement(p) for p in rule.placements)
    more = []
    for (src, i), c in zip(node.inputs, cands):
        info = graph[src].outputs[i]
        same = info is not None and tuple(info.shape) == tuple(node.out.shape) and info.dtype == node.out.dtype
        more.append([*c, want] if same and want not in c else c)
    key = (node.name, "pin", tuple(tuple(map(pid, c)) for c in more))
    if key not in memo:
        memo[key] = builder.for_node(node, more) or sts
    return memo[key]


def _apply_force(node: OpNode, sts: list[Strategy], pins: BoundForce, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    """The strategies a force pattern leaves (`sts` itself when no pattern pins the node): the winning pattern's
    layout (``planner.force``: the most specific pattern wins; patterns matching a parameter, buffer or input
    pin those, the others operator nodes by name)."""
    from meshpilot.sharding.placements import fmt

    rule = pins.rule_for(node)
    kept = sts
    if rule is not None:
        pins.check_dims(rule, node)
        kept = [s for s in sts if s.outs and fmt(s.outs[0]) == rule.layout]
        if not kept:
            can = sorted({fmt(s.outs[0]) for s in sts if s.outs})
            shape = tuple(node.out.shape) if node.out is not None else ()
            raise PlanError(
                f"{rule.where}: {node.fqn or node.name} (shape {shape}) cannot be {rule.layout} on mesh "
                f"{mesh_shape}; pin one of {', '.join(can)} (S(d) needs dim d divisible by that mesh axis)",
                mesh_shape=mesh_shape,
            )
    for i, elem in _pinned_elements(node, pins):  # a pinned getitem pins its producer's output i
        have = kept
        kept = [s for s in have if len(s.outs) > i and s.outs[i] is not None and fmt(s.outs[i]) == elem.layout]
        if not kept:
            can = sorted({fmt(s.outs[i]) for s in have if len(s.outs) > i and s.outs[i] is not None})
            raise PlanError(
                f"{elem.where}: output {i} of {node.name} cannot be {elem.layout} on mesh {mesh_shape}; "
                f"pin one of {', '.join(can)}",
                mesh_shape=mesh_shape,
            )
    return kept


def _pinned_elements(node: OpNode, pins: BoundForce) -> list[tuple[int, ForceRule]]:
    """(output index, rule) of each element of a several-output op whose ``getitem`` a force pattern pins by
    name: the op then produces it in that layout (``ring_pins(backward=True)``: the backward's dK, dV), not
    a layout resharded at the getitem."""
    if node.kind != NodeKind.OP:
        return []
    out = []
    for user in pins.graph.users.get(node.name, ()):
        elem = pins.graph[user]
        if elem.kind == NodeKind.GETITEM and elem.fx_node is not None:
            rule = pins.rule_for(elem)
            if rule is not None:
                out.append((int(elem.fx_node.args[1]), rule))
    return out


def _merge_map_ids(
    node_cost: np.ndarray, src_outs: np.ndarray, ins: np.ndarray, info, pricer: Pricer, as_is: bool = False
) -> np.ndarray:
    """For each choice of the operand's group: the strategy of the node that reads its layout cheapest (the
    first such); with `as_is` (the loss' ``getitem``), on a tie the first that reads it as it is."""
    lab, P = _labels(src_outs)
    lab_q, Q = _labels(ins)
    mat = np.zeros((len(P), len(Q))) if info is None else pricer.matrix(tuple(P), tuple(Q), info)
    total = mat[:, lab_q] + node_cost[None, :]
    if not as_is:
        return np.argmin(total, axis=1)[lab]
    cheapest = total == total.min(axis=1, keepdims=True)
    same = cheapest & (np.asarray(P)[:, None] == np.asarray(Q)[lab_q][None, :])
    best = np.where(same.any(axis=1), np.argmax(same, axis=1), np.argmax(cheapest, axis=1))
    return best[lab]


# ------------------------------------------------------------------------------------------------ solve


@dataclass
class Solution:
    choice: dict[str, int]
    """Node -> index of its chosen strategy."""
    objective: float
    gap: float
    status: str
    solve_s: float
    num_vars: int
    num_constraints: int
    memory: float
    """Bytes per device on the plain memory rows (the larger of the two)."""
    memory_zero: float = 0.0
    """Bytes per device on the ZeRO rows (what the plan needs once the post-pass shards every update)."""
    row: str = "plain"
    """The memory rows the ILP was solved against: ``plain`` or ``zero``."""
    rows: tuple[float, ...] = ()
    """Bytes per device on each plain row (``accounting.MEMORY_ROWS``)."""


def _lp(prob: Problem, memory: str, has_mem_row: bool):
    """:func:`solve`'s objective, constraint matrix and row bounds (the memory rows' upper bounds left open),
    built from `prob` (module docstring, *Linearisation*)."""
    groups = prob.groups
    sizes = np.array([g.size for g in groups], dtype=np.int64)
    offs = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offs[1:])
    n_s = int(offs[-1])
    blocks = list(prob.edges.values())
    e_offs = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum([b.cost.size for b in blocks], out=e_offs[1:])
    e_offs += n_s
    n_vars = int(e_offs[-1])

    c = np.zeros(n_vars)
    c[:n_s] = np.concatenate([g.cost for g in groups]) if groups else []
    # one-hot rows, one per group
    rows = [np.repeat(np.arange(len(groups)), sizes)]
    cols = [np.arange(n_s)]
    vals = [np.ones(n_s)]
    r = len(groups)
    for bi, b in enumerate(blocks):
        base = int(e_offs[bi])
        n_p, n_q = b.cost.shape
        c[base : base + n_p * n_q] = b.cost.ravel()
        e_idx = base + np.arange(n_p * n_q)
        # rows r .. r+n_p-1: Σ_q e_pq - Σ_{k in p} s_uk = 0 ; rows r+n_p ..: Σ_p e_pq - Σ_{l in q} s_vl = 0
        rows += [
            r + np.repeat(np.arange(n_p), n_q),
            r + b.lab_u,
            r + n_p + np.tile(np.arange(n_q), n_p),
            r + n_p + b.lab_v,
        ]
        cols += [e_idx, offs[b.gu] + np.arange(len(b.lab_u)), e_idx, offs[b.gv] + np.arange(len(b.lab_v))]
        vals += [np.ones(n_p * n_q), -np.ones(len(b.lab_u)), np.ones(n_p * n_q), -np.ones(len(b.lab_v))]
        r += n_p + n_q
    lb = np.zeros(r)
    ub = np.zeros(r)
    lb[: len(groups)] = 1.0
    ub[: len(groups)] = 1.0
    n_rows = len(MEMORY_ROWS)
    mem_plain = np.concatenate([g.mem for g in groups], axis=1) if groups else np.zeros((n_rows, 0))
    mem_zero = (
        np.concatenate([g.mem if g.mem_zero is None else g.mem_zero for g in groups], axis=1) if groups else mem_plain
    )
    held = mem_zero if memory == "zero" else mem_plain
    if has_mem_row:
        for row in held:
            nz = np.flatnonzero(row)
            rows.append(np.full(len(nz), r))
            cols.append(nz)
            vals.append(row[nz])
            lb = np.append(lb, -np.inf)
            ub = np.append(ub, np.inf)
            r += 1
    A = Csc.from_entries(np.concatenate(rows), np.concatenate(cols), np.concatenate(vals), (r, n_vars))
    return c, A, lb, ub, offs, n_s, n_vars, r, mem_plain, mem_zero


NODE_LIMIT = 1_000
"""Branch-and-bound nodes a HiGHS solve may explore (``mip_max_nodes``): the deterministic stop besides the gap
(module docstring, *Solved by*). GPT-39B's stage table (1,060 solves) needs at most 21: HiGHS closes these
ILPs at or near the root."""

TIME_LIMIT_S = 300.0
"""Default wall-clock seconds of one HiGHS solve: a safety net only. The largest solve of GPT-39B's stage table
takes 5.9 s of CPU, and 32 s of wall time at load 8 on 2 cores: past the 30 s limit this replaced, which cut
such solves short and so made the plan depend on the machine's load."""


def solve(
    prob: Problem,
    time_limit: float = TIME_LIMIT_S,
    mip_rel_gap: float = 1e-3,
    memory: str = "plain",
    capacity: float | None = None,
    relaxed: bool = False,
) -> Solution:
    """The plan of `prob` under a memory capacity: HiGHS (:func:`planner.highs.solve_milp`) on the sparse ILP.

    ``memory="zero"`` holds the ZeRO memory rows (module docstring) to the capacity instead of the plain
    ones; `capacity` overrides ``prob.capacity`` (the planner lowers it when the liveness peak exceeds it).

    A problem is solved under several capacities (a stage's cap levels, the refits), and the memory rows are
    what makes a solve slow (their knapsack gap; without them the relaxation of a repeated block is already
    integral). So each problem keeps what it has solved (:func:`_known`) and a capacity is answered, in this
    order, by: an answer found under a capacity at least as large whose rows fit this one (the feasible set
    only shrank, so it is still optimal within the gap) or that had no plan; the plan without memory rows,
    solved once per problem, when its rows fit; and only then a solve with the rows.

    ``relaxed``: every solve is :func:`_relaxed_then_fixed` (its LP relaxation, then the ILP over its fractional
    selections only) instead of the whole ILP: an estimate for pricing, its distance from the optimum bounded by
    the gap it reports (module docstring, *Relaxed solves*).
    """
    t0 = time.perf_counter()
    groups = prob.groups
    cap = prob.capacity if capacity is None else capacity
    has_mem_row = math.isfinite(cap)
    settings = (time_limit, mip_rel_gap, relaxed)
    if not has_mem_row:
        return replace(_free(prob, settings), row=_row_kind(memory), solve_s=time.perf_counter() - t0)
    need = prob.lp.get(("need", memory))
    if need is None:
        need = prob.lp[("need", memory)] = _min_need(groups, memory)
    if need > cap:
        raise PlanError(
            f"no sharding plan fits: the smallest per-device memory found is {fmt_size(need)} "
            f"but a device holds {fmt_size(cap)} (mesh {prob.mesh_shape})"
            "; use more devices, a smaller batch or model, or a device with more memory",
            mesh_shape=prob.mesh_shape,
            need_bytes=need,
            capacity_bytes=cap,
        )
    known = _known(prob, memory, cap, settings)
    if known is None:
        free = _free(prob, settings)
        known = free if _held(free, memory) <= cap else _capped(prob, memory, cap, settings)
    if isinstance(known, _NoPlan):
        raise PlanError(
            f"no sharding plan fits in {fmt_size(cap)} per device on mesh {prob.mesh_shape} "
            f"(HiGHS: {known.highs}); the smallest need found is {fmt_size(need)}"
            "; use more devices, a smaller batch or model, or a device with more memory",
            mesh_shape=prob.mesh_shape,
            need_bytes=need,
            capacity_bytes=cap,
        )
    return replace(known, row=_row_kind(memory), solve_s=time.perf_counter() - t0)


@dataclass
class _NoPlan:
    """A capacity under which HiGHS found no plan, and what it said."""

    highs: str
    infeasible: bool
    """HiGHS proved that no plan fits (not: ran out of time before finding one)."""


def _row_kind(memory: str) -> str:
    return "zero" if memory == "zero" else "plain"


def _held(sol: Solution, memory: str) -> float:
    """The larger of `sol`'s memory rows of the kind `memory` holds to the capacity."""
    return sol.memory_zero if memory == "zero" else sol.memory


def _known(prob: Problem, memory: str, cap: float, settings: tuple) -> Solution | _NoPlan | None:
    """What an earlier solve of `prob` with the same `settings` (time limit, gap, relaxed) already answers for `cap`:
    a plan solved under a capacity ``c ≥ cap`` (or none) whose held rows fit `cap` — optimal here too, within
    its gap, as every plan under `cap` was feasible there — or a capacity ``c ≥ cap`` proven to have no
    plan; None when neither. For the plain rows the ZeRO rows' answers count too: a plan's ZeRO rows are at most its
    plain rows (``_memory_terms``: the smaller of the two per leaf), so the plain problem's feasible set lies inside
    the ZeRO one's at the same capacity, and a ZeRO answer whose plain rows fit `cap` is optimal here as well (its
    bound holds for the smaller set); a capacity proven to have no ZeRO plan has no plain one."""
    kinds = ("zero",) if memory == "zero" else ("plain", "zero")
    for kind in kinds:
        for c, ans in prob.lp.get(("solved", kind, settings), ()):
            if c >= cap and (ans.infeasible if isinstance(ans, _NoPlan) else _held(ans, memory) <= cap):
                return ans
    free = prob.lp.get(("solved", None, settings))
    if isinstance(free, Solution) and _held(free, memory) <= cap:
        return free
    return None


def _free(prob: Problem, settings: tuple) -> Solution:
    """The plan of `prob` without memory rows (one answer for both row kinds: solved once, as the plain one),
    kept on `prob`."""
    free = prob.lp.get(("solved", None, settings))
    if free is None:
        free = prob.lp[("solved", None, settings)] = _milp(prob, "plain", math.inf, *settings)
    if isinstance(free, _NoPlan):
        raise PlanError(
            f"the sharding ILP could not be solved on mesh {prob.mesh_shape}: {free.highs}",
            mesh_shape=prob.mesh_shape,
        )
    return free


def _capped(prob: Problem, memory: str, cap: float, settings: tuple) -> Solution | _NoPlan:
    """:func:`_milp` with the `memory` rows held to `cap`, its answer kept on `prob` for :func:`_known`."""
    ans = _milp(prob, memory, cap, *settings)
    prob.lp.setdefault(("solved", _row_kind(memory), settings), []).append((cap, ans))
    return ans


def _milp(
    prob: Problem, memory: str, cap: float, time_limit: float, mip_rel_gap: float, relaxed: bool = False
) -> Solution | _NoPlan:
    """One HiGHS solve of `prob` with the `memory` rows held to `cap` (none when ``inf``); `relaxed`: by
    :func:`_relaxed_then_fixed`."""
    t0 = time.perf_counter()
    has_mem_row = math.isfinite(cap)
    lp = prob.lp.get((memory, has_mem_row))
    if lp is None:  # everything but the capacity: built once per problem and row kind
        lp = prob.lp[(memory, has_mem_row)] = _lp(prob, memory, has_mem_row)
    c, A, lb, ub_open, offs, n_s, n_vars, r, mem_plain, mem_zero = lp
    ub = ub_open.copy()
    if has_mem_row:
        ub[r - len(MEMORY_ROWS) :] = cap
    integrality = np.zeros(n_vars)
    integrality[:n_s] = 1
    # scale seconds to keep HiGHS' tolerances meaningful
    normal = np.abs(c[c < UNSUPPORTED_S])
    scale = 1.0 / max(float(normal.max()) if normal.size else 1.0, 1e-12)
    # the time limit is a safety net only: the stop is the gap or the node limit
    limits = dict(time_limit=time_limit, node_limit=NODE_LIMIT, mip_rel_gap=mip_rel_gap)
    with highs_stdout_filtered():
        if relaxed:
            res = _relaxed_then_fixed(c * scale, A, lb, ub, integrality, limits)
        else:
            res = solve_milp(c * scale, A, lb, ub, integrality, **limits)
    if res.x is None:
        return _NoPlan(res.message, infeasible=res.infeasible)
    x = res.x
    groups = prob.groups
    pick = [int(np.argmax(x[offs[gi] : offs[gi + 1]])) for gi in range(len(groups))]
    choice = {name: int(prob.node_map[name][pick[g]]) for name, g in prob.node_group.items()}
    gap = res.mip_gap
    objective = float(c @ x)
    xs = np.zeros(n_s)
    xs[offs[:-1] + np.array(pick, dtype=np.int64)] = 1.0
    return Solution(
        choice,
        objective,
        gap,
        res.message,
        time.perf_counter() - t0,
        n_vars,
        r,
        float((mem_plain @ xs).max()),
        float((mem_zero @ xs).max()),
        _row_kind(memory),
        tuple(float(v) for v in mem_plain @ xs),
    )


INTEGRAL_TOL = 1e-6
"""How far from 0 or 1 a selection of the LP relaxation may be and count as integral (HiGHS' own
``mip_feasibility_tolerance``)."""


def _relaxed_then_fixed(c, A, lb, ub, integrality, limits: dict) -> MilpAnswer:
    """The ILP solved from its LP relaxation (module docstring, *Relaxed solves*): the relaxation's optimum when
    every selection in it is integral (then it is the ILP's optimum too), else the ILP with those integral
    selections fixed at their values — the whole ILP only where that has no solution. The gap reported is
    ``(z − z_LP) / z``, z the answer's objective and z_LP the relaxation's, a lower bound of every plan's: the
    answer is within it of the optimum (or HiGHS' own gap, when larger)."""
    relaxation = solve_milp(c, A, lb, ub, np.zeros_like(integrality), **limits)
    if relaxation.x is None:  # no fractional plan fits: no integral one does
        return relaxation
    chosen = integrality > 0
    sel = relaxation.x[chosen]
    whole = (sel <= INTEGRAL_TOL) | (sel >= 1 - INTEGRAL_TOL)
    if whole.all():
        return replace(relaxation, mip_gap=0.0)
    lo, hi = np.zeros(len(c)), np.ones(len(c))
    fix = np.flatnonzero(chosen)[whole]
    lo[fix] = hi[fix] = np.round(relaxation.x[fix])
    fixed = solve_milp(c, A, lb, ub, integrality, col_lower=lo, col_upper=hi, **limits)
    if fixed.x is None:  # the fixed selections leave no plan: the whole ILP
        return solve_milp(c, A, lb, ub, integrality, **limits)
    z, z_lp = float(c @ fixed.x), float(c @ relaxation.x)
    bound = (z - z_lp) / abs(z) if z else 0.0
    return replace(fixed, mip_gap=max(fixed.mip_gap, bound))


HIGHS_DEBUG_PREFIX = b"HighsMipSolverData::"
"""What the debug print in HiGHS 1.12 (scipy's and ``highspy``'s) starts with: on some MIPs it writes
``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();`` to the C stdout (one of the 210
large ILPs of the GPT-39B plan), which ``meshpilot plan --json > plan.json`` would carry into the JSON."""


@contextlib.contextmanager
def highs_stdout_filtered() -> Iterator[None]:
    """Run a solve with the process' C stdout (file descriptor 1) sent to a temporary file, then pass on what
    was written there except HiGHS' debug lines (:data:`HIGHS_DEBUG_PREFIX`): nothing else is lost (a
    thread's print lands after the solve instead of during it), and stdout stays the plan's own."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no usable stdout: nothing to keep clean
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            _libc_fflush()  # what the solver left in the C library's buffer goes to the file, not to stdout later
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not line.startswith(HIGHS_DEBUG_PREFIX)]
            if kept:
                os.write(1, b"".join(kept))


def _libc_fflush() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # no C library to flush (not on glibc / musl / macOS)
        ctypes.CDLL(None).fflush(None)


def _min_need(groups: list[Group], memory: str) -> float:
    """A lower bound of every plan's memory: per row, each group at its least; the larger row."""
    if not groups:
        return 0.0
    mats = [g.mem if memory != "zero" or g.mem_zero is None else g.mem_zero for g in groups]
    return float(np.max(sum(m.min(axis=1) for m in mats)))
