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
  the operand's layout at the least resharding + compute cost (:func:`_merge_map`);
* a node of a repeated layer joins the group of the identical node in the first layer
  (``OpGraph.canonical``), so every layer is decided once; its costs still add up per layer.

Objective (Eq. 1)
-----------------
    min  Σ_g s_gᵀ d_g  +  Σ_(u,v,a) s_{g(u)}ᵀ R_uva s_{g(v)}

* ``d_g[k] = Σ_{v in g} compute(v, m_v(k))`` — roofline time of the node's shard of the work
  (FLOPs and bytes divided by the devices sharing it, ``CostModel.compute``), in :func:`_node_cost`.
  Alpa sets compute to zero and forbids replicated matmuls instead; we price replication honestly.
  ``c_v`` (an op's own communication) is zero for DTensor strategies: partial sums stay ``Partial`` and
  are reduced on the outgoing edge, where ``R`` prices them.
* ``R_uva[k, l]`` = cost of resharding operand ``a`` of ``v`` from what ``u`` emits under ``k`` to what
  ``v`` needs under ``l`` (:class:`~meshpilot.sharding.reshard.Resharder`, Alpa Table 2 per mesh axis).
  Gradients must arrive in their parameter's layout and the loss replicated: two more edge kinds.

Linearisation: the quadratic term of an edge between two different groups becomes edge variables over
*distinct layouts*: with ``P`` the distinct layouts ``u`` emits and ``Q`` the distinct layouts ``v``
requires, ``e_pq ≥ 0`` with ``Σ_q e_pq = Σ_{k: out(k)=p} s_uk`` and ``Σ_p e_pq = Σ_{l: in(l)=q} s_vl``
(exact: the one-hot rows force ``e`` one-hot), objective ``Σ C_pq e_pq``. Edges inside one group are
diagonal and go to ``d_g``; edges with ``|P| = 1`` or ``|Q| = 1`` too; identical edges (same groups,
same layout maps — every repeated layer) are summed into one block (:meth:`Problem.add_edge`).

Memory (one row, :func:`build_problem`)
---------------------------------------
    Σ_g s_gᵀ mem_g ≤ capacity,    mem_g[k] = Σ params (w + grad) / shards + AdamW m, v (fp32) / shards
                                              + Σ activations kept for the backward / shards
                                              + inputs / shards

Solved by ``scipy.optimize.milp`` (HiGHS) with a time limit; the relative MIP gap is reported. If the
memory row makes it infeasible, :class:`PlanError` says the smallest need found and the capacity.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from meshpilot.errors import UserError
from meshpilot.graph.capture import OpGraph, OpNode, TensorInfo
from meshpilot.sharding.placements import by_id, pid, replicated, shard_factor, work_split
from meshpilot.sharding.reshard import UNSUPPORTED_S, Resharder
from meshpilot.sharding.strategies import Strategy, StrategyBuilder

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32 per parameter element


class PlanError(UserError):
    """No sharding plan fits in device memory (or the problem cannot be solved)."""


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
    owner: str


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

    def new_group(self, size: int, owner: str) -> int:
        self.groups.append(Group(size, np.zeros(size), np.zeros(size), owner))
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


def _labels(values: list) -> tuple[np.ndarray, list]:
    idx: dict = {}
    lab = np.fromiter((idx.setdefault(v, len(idx)) for v in values), dtype=np.int64, count=len(values))
    return lab, list(idx)


class _Costs:
    def __init__(self, cost_model, mesh_shape):
        self.cm = cost_model
        self.mesh_shape = mesh_shape

    def node(self, node: OpNode, s: Strategy) -> float:
        """Roofline seconds of the device's share of `node` under strategy `s`."""
        if node.kind != "op" or node.is_view or (node.flops == 0 and node.bytes_written == 0):
            return 0.0
        out = next((p for p in s.outs if p is not None), None)
        split = work_split(out, self.mesh_shape) if out is not None else 1
        dtype = node.out.dtype if node.out is not None else "float32"
        return self.cm.compute(node.flops / split, (node.bytes_read + node.bytes_written) / split, dtype)


def _base(graph: OpGraph, name: str, idx: int) -> tuple[str, int]:
    """Follow views back to the node whose storage they alias."""
    n = graph[name]
    while n.is_view and n.inputs:
        name, idx = n.inputs[0]
        n = graph[name]
    return name, idx


def build_problem(
    graph: OpGraph,
    builder: StrategyBuilder,
    resharder: Resharder,
    cost_model,
    capacity: float = math.inf,
    merge_trivial: bool = True,
    force: dict[str, str] | None = None,
) -> Problem:
    """Strategies for every node, decision groups, node costs, edge blocks and the memory row.

    `force` pins layouts of leaves: ``{pattern: "S(0)R"}`` where the fnmatch pattern names a parameter
    or buffer (``layers.*.weight``), an input (``input:0``) or a node; forced data parallelism, Megatron
    tensor parallelism and ZeRO-3-like plans are written this way (see ``meshpilot.planner.auto``).
    """
    t0 = time.perf_counter()
    mesh_shape = tuple(builder.mesh_shape)
    costs = _Costs(cost_model, mesh_shape)
    prob = Problem(graph, mesh_shape, {}, capacity=capacity)
    strategies = prob.strategies
    nd = len(mesh_shape)
    canonical = graph.canonical

    def out_of(name: str, i: int) -> list[int]:
        """Interned layout of output i of `name` for every choice of its group."""
        sts = strategies[name]
        return [sts[j].out_ids[i] for j in prob.node_map[name]]

    for node in graph.nodes:
        cands = [StrategyBuilder.out_candidates(strategies[s], i) for s, i in node.inputs]
        sts = builder.for_node(node, cands)
        if force:
            sts = _apply_force(node, sts, force)
        strategies[node.name] = sts
        canon = canonical.get(node.name, node.name)
        if canon != node.name and canon in prob.node_group and strategies[canon] == sts:
            prob.node_group[node.name] = prob.node_group[canon]
            prob.node_map[node.name] = prob.node_map[canon]
        elif merge_trivial and is_trivial(node) and len(sts) > 1:
            # merge into the deepest operand (Alpa §4.2)
            a = max(range(len(node.inputs)), key=lambda j: graph[node.inputs[j][0]].depth)
            src, i = node.inputs[a]
            g = prob.node_group[src]
            prob.node_group[node.name] = g
            prob.node_map[node.name] = _merge_map(node, sts, out_of(src, i), a, graph[src].outputs[i], resharder, costs)
        else:
            g = prob.new_group(len(sts), node.name)
            prob.node_group[node.name] = g
            prob.node_map[node.name] = np.arange(len(sts))

        g = prob.node_group[node.name]
        m = prob.node_map[node.name]
        grp = prob.groups[g]
        # compute cost d_g
        if node.kind == "op":
            per = np.array([costs.node(node, s) for s in sts])
            grp.cost += per[m]
        # edges into the node
        for a, (src, i) in enumerate(node.inputs):
            info = graph[src].outputs[i]
            p_vals = out_of(src, i)
            q_vals = [sts[j].in_ids[a] for j in m]
            _add_reshard_edge(prob, resharder, prob.node_group[src], g, p_vals, q_vals, info)

    # the loss ends replicated; gradients end in their parameter's layout
    loss_name, li = graph.loss
    _add_reshard_edge(
        prob,
        resharder,
        prob.node_group[loss_name],
        prob.node_group[loss_name],
        out_of(loss_name, li),
        [pid(replicated(nd))] * prob.groups[prob.node_group[loss_name]].size,
        graph[loss_name].outputs[li],
    )
    pnode = {n.fqn: n for n in graph.nodes if n.kind == "param"}
    for fqn, gsrc in graph.grads.items():
        if gsrc is None:
            continue
        p = pnode[fqn]
        _add_reshard_edge(
            prob,
            resharder,
            prob.node_group[gsrc[0]],
            prob.node_group[p.name],
            out_of(gsrc[0], gsrc[1]),
            out_of(p.name, 0),
            graph[gsrc[0]].outputs[gsrc[1]],
        )

    # memory per device
    for n in graph.nodes:
        if n.kind in ("param", "buffer", "input") and n.out is not None:
            g = prob.node_group[n.name]
            sf = np.array([shard_factor(by_id(p), mesh_shape) for p in out_of(n.name, 0)], dtype=float)
            per = n.out.nbytes
            if n.kind == "param" and graph.grads.get(n.fqn) is not None:
                per = 2 * n.out.nbytes + ADAM_STATE_BYTES * n.out.numel
            prob.groups[g].mem += per / sf
    saved: dict[tuple[str, int], None] = {}
    for n in graph.nodes:
        if n.saved_for_backward:
            idxs = range(len(n.outputs)) if n.kind == "op" else [0]
            for i in idxs:
                b = _base(graph, n.name, i)
                if graph[b[0]].kind == "op":
                    saved.setdefault(b, None)
    for name, i in saved:
        info = graph[name].outputs[i]
        if info is None:
            continue
        g = prob.node_group[name]
        sf = np.array([shard_factor(by_id(p), mesh_shape) if p >= 0 else 1 for p in out_of(name, i)], dtype=float)
        prob.groups[g].mem += info.nbytes / sf
    prob.build_s = time.perf_counter() - t0
    return prob


def _apply_force(node: OpNode, sts: list[Strategy], force: dict[str, str]) -> list[Strategy]:
    import fnmatch

    from meshpilot.sharding.placements import fmt

    for pattern, layout in force.items():
        if fnmatch.fnmatchcase(node.fqn or "", pattern) or fnmatch.fnmatchcase(node.name, pattern):
            kept = [s for s in sts if s.outs and fmt(s.outs[0]) == layout]
            if not kept:
                raise PlanError(
                    f"cannot force {node.fqn or node.name} to {layout}: its layouts are "
                    f"{sorted({fmt(s.outs[0]) for s in sts})}"
                )
            return kept
    return sts


def _add_reshard_edge(prob: Problem, resharder: Resharder, gu: int, gv: int, p_vals, q_vals, info: TensorInfo):
    if info is None:
        return
    lab_u, P = _labels(p_vals)
    lab_v, Q = _labels(q_vals)
    prob.add_edge(gu, gv, lab_u, lab_v, resharder.cost_matrix(P, Q, info))


def _merge_map(node, sts, src_outs, a, info, resharder, costs) -> np.ndarray:
    """For each choice of the operand's group: the strategy of `node` that reads its layout cheapest."""
    node_cost = np.array([costs.node(node, s) for s in sts])
    lab, P = _labels(src_outs)
    ins = [s.in_ids[a] for s in sts]
    lab_q, Q = _labels(ins)
    if info is None:
        mat = np.zeros((len(P), len(Q)))
    else:
        mat = resharder.cost_matrix(P, Q, info)
    total = mat[:, lab_q] + node_cost[None, :]
    best = np.argmin(total, axis=1)
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


def solve(prob: Problem, time_limit: float = 30.0, mip_rel_gap: float = 1e-3) -> Solution:
    """Build the sparse ILP and run HiGHS (``scipy.optimize.milp``)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    t0 = time.perf_counter()
    groups = prob.groups
    offs = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum([g.size for g in groups], out=offs[1:])
    n_s = int(offs[-1])
    blocks = list(prob.edges.values())
    e_offs = [n_s]
    for b in blocks:
        e_offs.append(e_offs[-1] + b.cost.size)
    n_vars = e_offs[-1]

    c = np.zeros(n_vars)
    for gi, g in enumerate(groups):
        c[offs[gi] : offs[gi + 1]] = g.cost
    rows, cols, vals = [], [], []
    lb, ub = [], []
    r = 0
    for gi, g in enumerate(groups):  # one-hot
        rows.append(np.full(g.size, r))
        cols.append(np.arange(offs[gi], offs[gi + 1]))
        vals.append(np.ones(g.size))
        lb.append(1.0)
        ub.append(1.0)
        r += 1
    for bi, b in enumerate(blocks):
        base = e_offs[bi]
        nP, nQ = b.cost.shape
        c[base : base + nP * nQ] = b.cost.ravel()
        e_idx = base + np.arange(nP * nQ).reshape(nP, nQ)
        # rows: Σ_q e_pq - Σ_{k in p} s_uk = 0
        for p in range(nP):
            ks = np.flatnonzero(b.lab_u == p) + offs[b.gu]
            rows.append(np.full(nQ + len(ks), r))
            cols.append(np.concatenate([e_idx[p], ks]))
            vals.append(np.concatenate([np.ones(nQ), -np.ones(len(ks))]))
            lb.append(0.0)
            ub.append(0.0)
            r += 1
        for q in range(nQ):
            ls = np.flatnonzero(b.lab_v == q) + offs[b.gv]
            rows.append(np.full(nP + len(ls), r))
            cols.append(np.concatenate([e_idx[:, q], ls]))
            vals.append(np.concatenate([np.ones(nP), -np.ones(len(ls))]))
            lb.append(0.0)
            ub.append(0.0)
            r += 1
    mem = np.zeros(n_vars)
    for gi, g in enumerate(groups):
        mem[offs[gi] : offs[gi + 1]] = g.mem
    has_mem_row = math.isfinite(prob.capacity)
    if has_mem_row:
        nz = np.flatnonzero(mem)
        rows.append(np.full(len(nz), r))
        cols.append(nz)
        vals.append(mem[nz])
        lb.append(-np.inf)
        ub.append(prob.capacity)
        r += 1
        min_need = sum(float(g.mem.min()) for g in groups)
        if min_need > prob.capacity:
            raise PlanError(
                f"no sharding plan fits: the smallest per-device memory found is {min_need / 2**30:.2f} GiB "
                f"but a device holds {prob.capacity / 2**30:.2f} GiB (mesh {prob.mesh_shape})"
            )
    A = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r, n_vars)).tocsr()
    integrality = np.zeros(n_vars)
    integrality[:n_s] = 1
    # scale seconds to keep HiGHS' tolerances meaningful
    normal = np.abs(c[c < UNSUPPORTED_S])
    scale = 1.0 / max(float(normal.max()) if normal.size else 1.0, 1e-12)
    res = milp(
        c * scale,
        constraints=LinearConstraint(A, np.array(lb), np.array(ub)),
        integrality=integrality,
        bounds=Bounds(0, 1),
        options={"time_limit": float(time_limit), "mip_rel_gap": float(mip_rel_gap), "presolve": True},
    )
    solve_s = time.perf_counter() - t0
    if res.x is None:
        if has_mem_row:
            raise PlanError(
                f"no sharding plan fits in {prob.capacity / 2**30:.2f} GiB per device on mesh {prob.mesh_shape} "
                f"(HiGHS: {res.message}); the smallest need found is "
                f"{sum(float(g.mem.min()) for g in groups) / 2**30:.2f} GiB"
            )
        raise PlanError(f"the sharding ILP could not be solved on mesh {prob.mesh_shape}: {res.message}")
    x = res.x
    pick = [int(np.argmax(x[offs[gi] : offs[gi + 1]])) for gi in range(len(groups))]
    choice = {name: int(prob.node_map[name][pick[g]]) for name, g in prob.node_group.items()}
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    objective = float(c @ x)
    memory = float(mem[:n_s] @ x[:n_s])
    return Solution(choice, objective, gap, str(res.message), solve_s, n_vars, r, memory)
