"""The ZeRO-like post-pass: shard a replicated parameter's update where that is faster or needed to fit.

For a parameter stored replicated on mesh axis ``a`` whose gradient arrives by an all-reduce over ``a``,
the post-pass can store it sharded on ``a`` instead (``S(d)`` for the first dim ``d`` that divides evenly,
preferring a dim no other axis shards); its gradient and AdamW states follow. The consumers keep their
planned layouts, so the run (DTensor) all-gathers the weight where it is read and reduce-scatters the
gradient into the shard: all-reduce → reduce-scatter + all-gather, and every rank updates ``1/n_a`` of the
weight. Each switch is priced exactly: ``Δt`` = the gradient's new resharding + the consumers' new
all-gathers (each once per microbatch) + the update of the smaller shard − what they cost before
(``accounting.edge_seconds``: the edges and prices of the step time, DTensor's own steps, latency
included; ``accounting.optimizer_seconds``); ``Δmem`` on the ILP's two memory rows
(``ilp`` docstring, terms from ``meshpilot.planner.accounting``): update row
``(W + O + G + T_opt) · (1/sf' − 1/sf)``, backward row ``(W + O) · (1/sf' − 1/sf)`` plus the gathered copy
where a view of the weight is kept for the backward (:func:`_zero_delta`). The rule, with ``ε = 1e-9``
relative:

* **cheaper**: ``Δt < −ε`` (a hierarchical all-reduce over two axes can get cheaper), or ``|Δt| ≤ ε``
  and ``Δmem < 0``. On a ring, reduce-scatter + all-gather move the same bytes as an all-reduce and
  ``CostModel.all_reduce`` already takes Rabenseifner's reduce-scatter + all-gather when it is fastest,
  so for large gradients the communication ties and the smaller update decides (the switch also wins on
  memory); small, latency-bound gradients (recursive doubling) stay all-reduced unless the update saves
  more than the extra collective costs.
* **memory**: if the plan's rows still exceed the capacity, the remaining candidates are applied in
  increasing order of ``Δt / saved bytes`` until they do.

After the pass the plan's peak is computed by liveness (``accounting.memory_use``); a candidate whose peak
exceeds the capacity is re-solved with its rows held below the capacity by its peak − rows gap (at most
``_REFITS`` times), and is dropped (``PlanError``) if it still does not fit.

With ``zero="auto"`` and a finite capacity the ILP is first solved against its ZeRO memory row (what the
plan needs once every replicated update is sharded, ``ilp`` docstring), so it can keep the faster,
less-sharded plan that fits only with the post-pass; if the post-pass cannot make it fit, or fitting cost
time, the plain row is solved too and the faster of the two fitting plans is kept. ``zero="off"`` skips the
pass; ``zero="all"`` applies every candidate switch. Switches are listed in ``Plan.zero`` and the plan's
time, memory and collectives describe the switched plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from meshpilot.graph.capture import NodeKind, OpGraph, OpNode
from meshpilot.planner.accounting import (
    Edge,
    EdgeKind,
    edge_seconds,
    kept_copy_bytes,
    optimizer_seconds,
    state_bytes,
)
from meshpilot.planner.plan import ZeroSwitch
from meshpilot.sharding.placements import is_even, shard_factor, to_json
from meshpilot.sharding.reshard import UNSUPPORTED_S, CollectiveKind, Resharder
from meshpilot.sharding.strategies import Strategy

EPS = 1e-9
"""Relative tolerance of "cheaper" (module docstring)."""


class ZeroMode(StrEnum):
    """When the post-pass shards parameters, gradients and optimizer state (module docstring)."""

    AUTO = "auto"
    """Where it is faster, or needed to fit."""
    OFF = "off"
    """Never."""
    ALL = "all"
    """Every candidate switch."""


ZERO_MODES = tuple(ZeroMode)


@dataclass
class ParamEdges:
    """Per parameter node: the step's edges that read it, its gradient's edge, and which readers are views
    the backward keeps (a copy resharded for such a view lives until the backward: activation memory)."""

    readers: dict[str, list[Edge]] = field(default_factory=dict)
    grad: dict[str, Edge] = field(default_factory=dict)
    kept: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def of(cls, graph: OpGraph, edges: Sequence[Edge]) -> ParamEdges:
        params = {n.name for n in graph.nodes if n.kind == NodeKind.PARAM}
        out = cls()
        for e in edges:
            if e.kind == EdgeKind.OPERAND and e.src in params:
                out.readers.setdefault(e.src, []).append(e)
            elif e.kind == EdgeKind.GRAD:
                out.grad[e.dst] = e
        for n in graph.nodes:
            if not n.saved_for_backward:
                continue
            for _ in range(len(n.outputs)) if n.kind == NodeKind.OP else [0]:
                chain = graph.view_chain(n.name)
                if len(chain) > 1 and graph[chain[-1]].kind == NodeKind.PARAM:
                    out.kept.add((chain[-1], chain[-2]))
        return out


def _zero_layout(layout, axes, shape, mesh_shape):
    """`layout` with ``S(d)`` on each of `axes` (first evenly divisible dim, unsharded dims first)."""
    from torch.distributed.tensor import Shard

    new = list(layout)
    done = []
    for a in axes:
        sharded = {p.dim for p in new if isinstance(p, Shard)}
        dims = [d for d in range(len(shape)) if d not in sharded] + [d for d in range(len(shape)) if d in sharded]
        for d in dims:
            trial = list(new)
            trial[a] = Shard(d)
            if is_even(tuple(trial), shape, mesh_shape):
                new = trial
                done.append(a)
                break
    return tuple(new), tuple(done)


def _param_edges_s(graph, p: OpNode, layout, g_layout, chosen, pe: ParamEdges, resharder, microbatches) -> float:
    """Seconds of the edges a parameter stored in `layout` is on: its gradient in, its readers out."""
    t = edge_seconds(graph, pe.grad[p.name], g_layout, layout, resharder, microbatches)
    for e in pe.readers.get(p.name, ()):
        t += edge_seconds(graph, e, layout, chosen[e.dst].ins[e.operand], resharder, microbatches)
    return t


def _gathered_bytes(p: OpNode, layout, chosen, pe: ParamEdges, mesh_shape) -> float:
    """Bytes per device of the copies of a parameter stored in `layout` that are resharded for a view kept
    for the backward (``accounting.kept_copy_bytes``)."""
    wants = [chosen[e.dst].ins[e.operand] for e in pe.readers.get(p.name, ()) if (p.name, e.dst) in pe.kept]
    return kept_copy_bytes(p.out, layout, wants, mesh_shape)


@dataclass(frozen=True)
class _Option:
    """One parameter the pass could switch."""

    fqn: str
    name: str
    old: Any
    new: Any
    axes: tuple[int, ...]
    delta_s: float
    delta_rows: np.ndarray
    strategy: Strategy
    scale_s: float
    """The larger edge time of the two layouts: what ``EPS`` is relative to."""
    saved: float
    """Bytes per device the switch saves."""


def zero_pass(
    graph: OpGraph,
    strategies: dict[str, list[Strategy]],
    forced: frozenset[str],
    chosen: dict[str, Strategy],
    pe: ParamEdges,
    resharder: Resharder,
    memory: Sequence[float],
    capacity: float,
    mode: ZeroMode | str = ZeroMode.AUTO,
    microbatches: int = 1,
) -> tuple[list[ZeroSwitch], float, np.ndarray]:
    """The ZeRO-like post-pass (module docstring). `memory` is the plan's bytes per device on each linear
    memory row (``Solution.rows``); `strategies` every node's options and `forced` the nodes a ``force``
    pattern pinned (left alone). Updates `chosen` for the switched parameters and returns (switches,
    Δ step seconds, Δ bytes per device on each row)."""
    rows = np.asarray(memory, dtype=float)
    if mode == ZeroMode.OFF:
        return [], 0.0, np.zeros_like(rows)
    mesh_shape = tuple(resharder.mesh_shape)
    pnodes = {n.fqn: n for n in graph.nodes if n.kind == NodeKind.PARAM}
    options: list[_Option] = []
    for fqn, gsrc in graph.grads.items():
        if gsrc is None:
            continue
        p = pnodes[fqn]
        if p.name in forced or p.out is None:
            continue
        old = chosen[p.name].outs[0]
        g_layout = chosen[gsrc[0]].outs[gsrc[1]]
        g_info = graph[gsrc[0]].outputs[gsrc[1]]
        if old is None or g_layout is None or g_info is None:
            continue
        axes = sorted(
            {
                c.axis
                for c in resharder.collectives(g_layout, old, g_info)
                if c.kind == CollectiveKind.ALL_REDUCE and old[c.axis].is_replicate()
            }
        )
        if not axes:
            continue
        new, axes = _zero_layout(old, axes, p.out.shape, mesh_shape)
        if not axes:
            continue
        st = next((s for s in strategies[p.name] if s.outs[0] == new), None)
        if st is None:
            continue
        t_old, t_new = (
            _param_edges_s(graph, p, lay, g_layout, chosen, pe, resharder, microbatches)
            + optimizer_seconds(p.out, shard_factor(lay, mesh_shape), resharder.cost_model.device)
            for lay in (old, new)
        )
        if t_new >= UNSUPPORTED_S > t_old:  # a reader needs a resharding DTensor cannot run from `new`
            continue
        d_rows, saved = _zero_delta(p, old, new, chosen, pe, mesh_shape)
        options.append(_Option(fqn, p.name, old, new, axes, t_new - t_old, d_rows, st, max(t_old, t_new), saved))

    applied: list[tuple[_Option, str]] = []
    total_t = 0.0
    total_m = np.zeros_like(rows)
    rest = []
    fits = lambda extra: float((rows + total_m + extra).max()) <= capacity  # noqa: E731
    for o in options:
        tol = EPS * o.scale_s + 1e-15
        cheaper = o.delta_s < -tol or (abs(o.delta_s) <= tol and o.saved > 0)
        if mode == ZeroMode.ALL or (cheaper and ((o.delta_rows <= 0).all() or fits(o.delta_rows))):
            applied.append((o, "cheaper" if cheaper else "all"))
            total_t += o.delta_s
            total_m = total_m + o.delta_rows
        else:
            rest.append(o)
    if not fits(0.0):
        for o in sorted((o for o in rest if o.saved > 0), key=lambda o: o.delta_s / o.saved):
            if fits(0.0):
                break
            applied.append((o, "memory"))
            total_t += o.delta_s
            total_m = total_m + o.delta_rows
    switches = []
    for o, reason in applied:
        chosen[o.name] = o.strategy
        switches.append(
            ZeroSwitch(o.fqn, o.axes, tuple(to_json(o.old)), tuple(to_json(o.new)), reason, o.delta_s, o.saved)
        )
    return switches, total_t, total_m


def _zero_delta(p: OpNode, old, new, chosen, pe: ParamEdges, mesh_shape) -> tuple[np.ndarray, float]:
    """Δ bytes per device on each memory row when parameter `p` moves from layout `old` to `new`, and the
    bytes it saves (weight, gradient, AdamW states and update temporary, less the gathered copies the
    backward keeps): ``accounting.state_bytes`` over the shard factors, ``accounting.kept_copy_bytes``."""
    s = state_bytes(p.out, True)
    scale = 1 / shard_factor(new, mesh_shape) - 1 / shard_factor(old, mesh_shape)
    gathered = _gathered_bytes(p, new, chosen, pe, mesh_shape) - _gathered_bytes(p, old, chosen, pe, mesh_shape)
    update = (s.persistent + s.grad + s.update_temp) * scale
    backward = s.persistent * scale + gathered
    return np.array([update, backward]), -(update + gathered)
