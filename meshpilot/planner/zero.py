"""The ZeRO-like post-pass: shard a replicated parameter's update where that is faster or needed to fit.

For a parameter stored replicated on mesh axis ``a`` whose gradient arrives by an all-reduce over ``a``,
the post-pass can store it sharded on ``a`` instead (``S(d)`` for the first dim ``d`` that divides evenly,
preferring a dim no other axis shards); its gradient and AdamW states follow: all-reduce → reduce-scatter
into the shard, and every rank updates ``1/n_a`` of the weight. Where the weight is gathered back is the
switch's stage (``plan.ZeroStage``):

* **stage 3** (gather at use): only the shard is stored; the consumers keep their planned layouts, so the run
  (DTensor) all-gathers the weight where it is read — every reader, every microbatch (the backward's readers
  too). The parameter node's strategy is the sharded one.
* **stage 2** (gather once): the shard is what the optimizer owns, and a full copy in the old layout is what
  the readers read (their edges do not change); the updated shard is all-gathered into the copy once a step
  (``runtime.spmd.GatheredCopies``; the collective into ``gather:<fqn>``). The node's strategy is an
  ``accounting.StoredApart``: ``outs[0]`` the copy's layout, ``stored`` the shard's.

Stage 1 (only AdamW's states sharded) is not told apart from 2: the backward accumulates each microbatch's
gradient locally as a partial sum (``runtime.program``) and synchronises it once a step, so a full-size
gradient lives through the backward either way and the reduce-scatter writes only the shard.

Each option is priced exactly, with ``m`` microbatches, ``E(L → L')`` an edge's seconds
(``accounting.edge_seconds``: DTensor's own steps, latency included) and ``U(L)`` the update of a parameter
stored in ``L`` (``accounting.optimizer_seconds``)::

    t_old = E_grad(g → old) + m · Σ_readers E(old → want) + U(old)
    t_3   = E_grad(g → new) + m · Σ_readers E(new → want) + U(new)         (_options)
    t_2   = E_grad(g → new) + m · Σ_readers E(old → want) + E(new → old) + U(new)

and ``Δt = t − t_old``. Memory, on the ILP's two rows (``ilp`` docstring; ``W``, ``O``, ``G``, ``T_opt`` the
weight's, AdamW states', gradient's and update temporary's whole bytes from ``accounting.state_bytes``,
``sf`` = ``shard_factor``)::

    stage 3   update   (W + O + G + T_opt) · (1/sf(new) − 1/sf(old))                      (_zero_delta)
              backward (W + O) · (1/sf(new) − 1/sf(old)) + gathered copies kept for the backward
    stage 2   update   W / sf(old) + (W + O + G + T_opt) · (1/sf(new) − 1/sf(old))        (_gather_once_delta)
              backward W / sf(old) + (W + O) · (1/sf(new) − 1/sf(old))

(``accounting._parts`` holds the same terms for a ``StoredApart``: the copy ``W / sf(old)`` plus the shard's
state over ``sf(new)``.) With ``m ≥ 2``, or a weight the backward reads again, stage 2 moves fewer bytes
(one all-gather a step instead of one per read per microbatch) and stage 3 saves ``W / sf(old)`` more.
The rule, with ``ε = 1e-9`` relative:

* **cheaper**: an option with ``Δt < −ε`` (a hierarchical all-reduce over two axes can get cheaper), or
  ``|Δt| ≤ ε`` and ``Δmem < 0``; of a parameter's cheaper options the fastest, and of those within ``ε`` the
  one saving more (stage 3). On a ring, reduce-scatter + all-gather move the same bytes as an all-reduce and
  ``CostModel.all_reduce`` already takes Rabenseifner's reduce-scatter + all-gather when it is fastest, so for
  large gradients the communication ties and the smaller update decides (the switch also wins on memory);
  small, latency-bound gradients (recursive doubling) stay all-reduced unless the update saves more than the
  extra collective costs.
* **memory**: if the plan's rows still exceed the capacity, the parameters left are switched at their
  least-sharding stage (2 where it may be chosen) in increasing order of ``Δt / saved bytes`` until they fit;
  if they still do not, stage-2 switches move to stage 3 in increasing order of the extra seconds per extra
  byte saved (``_choose``).

After the pass the plan's peak is computed by liveness (``accounting.memory_use``); a candidate whose peak
exceeds the capacity is re-solved with its rows held below the capacity by its peak − rows gap (at most
``_REFITS`` times), and is dropped (``PlanError``) if it still does not fit.

With ``zero="auto"`` and a finite capacity the ILP is first solved against its ZeRO memory row (what the
plan needs once every replicated update is sharded at stage 3, ``ilp`` docstring), so it can keep the faster,
less-sharded plan that fits only with the post-pass; if the post-pass cannot make it fit, or fitting cost
time, the plain row is solved too and the faster of the two fitting plans is kept. ``zero="off"`` skips the
pass; ``zero="all"`` / ``"3"`` applies every candidate switch at stage 3, ``zero="2"`` at stage 2. Pipeline
stages choose stage 3 only (their runtime gathers at use). Switches are listed in ``Plan.zero`` and the plan's
time, memory and collectives describe the switched plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import numpy as np

from meshpilot.graph.capture import NodeKind, OpGraph, OpNode
from meshpilot.planner.accounting import (
    Edge,
    EdgeKind,
    StoredApart,
    edge_seconds,
    kept_copy_bytes,
    optimizer_seconds,
    state_bytes,
)
from meshpilot.planner.plan import ZeroStage, ZeroSwitch
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
    """Every candidate switch, at stage 3 (the most memory saved)."""
    STAGE2 = "2"
    """Every candidate switch, at stage 2 (tests and benchmarks)."""
    STAGE3 = "3"
    """Every candidate switch, at stage 3 (``all``)."""

    @property
    def forced(self) -> ZeroStage | None:
        """The stage every candidate takes, or None where the pass chooses."""
        return {ZeroMode.ALL: ZeroStage.GATHER_AT_USE, ZeroMode.STAGE3: ZeroStage.GATHER_AT_USE}.get(
            self, ZeroStage.GATHER_ONCE if self == ZeroMode.STAGE2 else None
        )


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


def _readers_s(graph, p: OpNode, layout, chosen, pe: ParamEdges, resharder, microbatches) -> float:
    """Seconds of the edges from a parameter read in `layout` to its readers (each once per microbatch)."""
    t = 0.0
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
    """One way the pass could switch one parameter: to stage 2 or 3."""

    fqn: str
    name: str
    old: Any
    new: Any
    axes: tuple[int, ...]
    stage: ZeroStage
    delta_s: float
    delta_rows: np.ndarray
    strategy: Strategy
    scale_s: float
    """The larger edge time of the two layouts: what ``EPS`` is relative to."""
    saved: float
    """Bytes per device the switch saves."""

    @property
    def tol(self) -> float:
        return EPS * self.scale_s + 1e-15

    @property
    def cheaper(self) -> bool:
        """Faster, or as fast and smaller (module docstring)."""
        return self.delta_s < -self.tol or (abs(self.delta_s) <= self.tol and self.saved > 0)


@dataclass(frozen=True)
class _Param:
    """What the pass knows of one parameter it could switch."""

    node: OpNode
    fqn: str
    old: Any
    new: Any
    axes: tuple[int, ...]
    g_layout: Any
    sharded: Strategy
    """The parameter's strategy stored in `new` (stage 3)."""


def _candidates(graph, strategies, forced, chosen, resharder, mesh_shape) -> list[_Param]:
    """The parameters whose gradient is all-reduced over an axis that replicates them and that have a strategy
    sharded there (module docstring)."""
    pnodes = {n.fqn: n for n in graph.nodes if n.kind == NodeKind.PARAM}
    out = []
    found: dict[tuple, tuple | None] = {}  # the same question of every block's twin parameter answered once
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
        key = (p.out, old, g_layout, g_info, id(strategies[p.name]))
        if key not in found:
            found[key] = _sharded(strategies[p.name], p.out, old, g_layout, g_info, resharder, mesh_shape)
        if found[key] is not None:
            out.append(_Param(p, fqn, old, *found[key][:2], g_layout, found[key][2]))
    return out


def _sharded(strategies, info, old, g_layout, g_info, resharder, mesh_shape) -> tuple | None:
    """``(new, axes, strategy)`` of a parameter stored in `old` whose gradient arrives in `g_layout`: the axes
    its gradient is all-reduced over while it is replicated there, its layout sharded on them and its strategy
    stored so; None when there are no such axes or no such strategy."""
    axes = sorted(
        {
            c.axis
            for c in resharder.collectives(g_layout, old, g_info)
            if c.kind == CollectiveKind.ALL_REDUCE and old[c.axis].is_replicate()
        }
    )
    if not axes:
        return None
    new, axes = _zero_layout(old, axes, info.shape, mesh_shape)
    if not axes:
        return None
    st = next((s for s in strategies if s.outs[0] == new), None)
    return None if st is None else (new, axes, st)


def _options(
    graph: OpGraph, c: _Param, chosen, pe: ParamEdges, resharder, microbatches: int, gather_once: bool
) -> list[_Option]:
    """Parameter `c`'s stage-3 option and, with `gather_once`, its stage-2 option, each priced (module
    docstring: ``Δt``, ``Δmem``)."""
    p, mesh_shape, dev = c.node, tuple(resharder.mesh_shape), resharder.cost_model.device
    grad = lambda lay: edge_seconds(graph, pe.grad[p.name], c.g_layout, lay, resharder, microbatches)  # noqa: E731
    reads = lambda lay: _readers_s(graph, p, lay, chosen, pe, resharder, microbatches)  # noqa: E731
    update = lambda lay: optimizer_seconds(p.out, shard_factor(lay, mesh_shape), dev)  # noqa: E731
    t_old = grad(c.old) + reads(c.old) + update(c.old)
    t3 = grad(c.new) + reads(c.new) + update(c.new)
    out = []
    if not (t3 >= UNSUPPORTED_S > t_old):  # a reader needs a resharding DTensor cannot run from `new`
        rows, saved = _zero_delta(p, c.old, c.new, chosen, pe, mesh_shape)
        out.append(_Option(c.fqn, p.name, c.old, c.new, c.axes, ZeroStage.GATHER_AT_USE, t3 - t_old, rows, c.sharded,
                           max(t_old, t3), saved))  # fmt: skip
    if gather_once:
        t2 = grad(c.new) + reads(c.old) + resharder.cost(c.new, c.old, p.out) + update(c.new)
        st = chosen[p.name]
        apart = StoredApart(st.outs, st.ins, st.source, colls=st.colls, stored=c.new)
        rows, saved = _gather_once_delta(p, c.old, c.new, mesh_shape)
        out.append(_Option(c.fqn, p.name, c.old, c.new, c.axes, ZeroStage.GATHER_ONCE, t2 - t_old, rows, apart,
                           max(t_old, t2), saved))  # fmt: skip
    return out


def _same_options(graph: OpGraph, c: _Param, chosen, pe: ParamEdges, microbatches: int) -> tuple:
    """What :func:`_options` of candidate `c` reads, but for its names: the parameter's tensor and layouts, its
    gradient's tensor and runs, and per reader edge (in order) the tensor, runs, the reader's strategy and
    operand and whether the backward keeps the copy; strategies by identity (a repeated layer's nodes share
    their canonical twin's list, ``ilp._group_nodes``). Two candidates with one key have the same options but
    for ``fqn`` and ``name``: the same layer's parameter in every block is priced once (issue 33 item 4)."""
    p = c.node
    g = pe.grad[p.name]
    readers = tuple(
        (graph[e.src].outputs[e.index], e.runs(microbatches), id(chosen[e.dst]), e.operand, (p.name, e.dst) in pe.kept)
        for e in pe.readers.get(p.name, ())
    )
    grad = (graph[g.src].outputs[g.index], g.runs(microbatches))
    return (p.out, c.old, c.new, c.axes, c.g_layout, id(c.sharded), id(chosen[p.name]), grad, readers)


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
    gather_once: bool = True,
) -> tuple[list[ZeroSwitch], float, np.ndarray]:
    """The ZeRO-like post-pass (module docstring). `memory` is the plan's bytes per device on each linear
    memory row (``Solution.rows``); `strategies` every node's options and `forced` the nodes a ``force``
    pattern pinned (left alone); `gather_once` whether stage 2 may be chosen (the pipeline runtime runs
    stage 3 only). Updates `chosen` for the switched parameters and returns (switches, Δ step seconds, Δ bytes
    per device on each row)."""
    mode = ZeroMode(mode)
    rows = np.asarray(memory, dtype=float)
    if mode == ZeroMode.OFF:
        return [], 0.0, np.zeros_like(rows)
    if mode.forced == ZeroStage.GATHER_ONCE and not gather_once:
        raise ValueError("zero='2' where only stage 3 runs (a pipeline stage)")
    mesh_shape = tuple(resharder.mesh_shape)
    priced: dict[tuple, list[_Option]] = {}
    options = []
    for c in _candidates(graph, strategies, forced, chosen, resharder, mesh_shape):
        key = _same_options(graph, c, chosen, pe, microbatches)
        hit = priced.get(key)
        if hit is None:
            options.append(priced.setdefault(key, _options(graph, c, chosen, pe, resharder, microbatches, gather_once)))
        else:
            options.append([replace(o, fqn=c.fqn, name=c.node.name) for o in hit])
    picked = _choose([o for o in options if o], rows, capacity, mode)
    switches = []
    total_t, total_m = 0.0, np.zeros_like(rows)
    for o, reason in picked:
        chosen[o.name] = o.strategy
        total_t += o.delta_s
        total_m = total_m + o.delta_rows
        switches.append(
            ZeroSwitch(o.fqn, o.axes, tuple(to_json(o.old)), tuple(to_json(o.new)), reason, o.delta_s, o.saved, o.stage)
        )
    return switches, total_t, total_m


def _choose(options: list[list[_Option]], rows: np.ndarray, capacity: float, mode: ZeroMode) -> list[tuple]:
    """(option, reason) per switched parameter (module docstring, "The rule"): `options` holds each
    candidate parameter's options (stage 3 and/or 2)."""
    at: dict[str, tuple[_Option, str]] = {}
    fits = lambda extra=0.0: float((rows + sum((o.delta_rows for o, _ in at.values()), 0.0) + extra).max()) <= capacity  # noqa: E731
    forced = mode.forced
    for opts in options:
        if forced is not None:
            o = next((o for o in opts if o.stage == forced), None)
            if o is not None:
                at[o.fqn] = (o, "all")
            continue
        good = [o for o in opts if o.cheaper]
        if not good:
            continue
        best = min(good, key=lambda o: o.delta_s)
        best = max((o for o in good if o.delta_s <= best.delta_s + best.tol), key=lambda o: o.saved)
        if (best.delta_rows <= 0).all() or fits(best.delta_rows):
            at[best.fqn] = (best, "cheaper")
    if forced is not None or fits():
        return list(at.values())
    # memory: first the least-sharding stage of each parameter left (2 where it may be), then 2 → 3
    first = [min(opts, key=lambda o: o.stage) for opts in options if opts[0].fqn not in at]
    for o in sorted((o for o in first if o.saved > 0), key=lambda o: o.delta_s / o.saved):
        if fits():
            break
        at[o.fqn] = (o, "memory")
    ups = []
    for opts in options:
        cur = at.get(opts[0].fqn)
        three = next((o for o in opts if o.stage == ZeroStage.GATHER_AT_USE), None)
        if (
            cur is not None
            and three is not None
            and cur[0].stage == ZeroStage.GATHER_ONCE
            and three.saved > cur[0].saved
        ):
            ups.append((three, (three.delta_s - cur[0].delta_s) / (three.saved - cur[0].saved)))
    for o, _ in sorted(ups, key=lambda x: x[1]):
        if fits():
            break
        at[o.fqn] = (o, "memory")
    return list(at.values())


def _zero_delta(p: OpNode, old, new, chosen, pe: ParamEdges, mesh_shape) -> tuple[np.ndarray, float]:
    """Δ bytes per device on each memory row when parameter `p` moves from layout `old` to `new` at stage 3,
    and the bytes it saves (weight, gradient, AdamW states and update temporary, less the gathered copies the
    backward keeps): ``accounting.state_bytes`` over the shard factors, ``accounting.kept_copy_bytes``."""
    s = state_bytes(p.out, True)
    scale = 1 / shard_factor(new, mesh_shape) - 1 / shard_factor(old, mesh_shape)
    gathered = _gathered_bytes(p, new, chosen, pe, mesh_shape) - _gathered_bytes(p, old, chosen, pe, mesh_shape)
    update = (s.persistent + s.grad + s.update_temp) * scale
    backward = s.persistent * scale + gathered
    return np.array([update, backward]), -(update + gathered)


def _gather_once_delta(p: OpNode, old, new, mesh_shape) -> tuple[np.ndarray, float]:
    """Δ bytes per device on each memory row when parameter `p` moves from layout `old` to `new` at stage 2,
    and the bytes it saves: the stage-3 terms plus the full copy ``W / sf(old)`` the readers read, held on
    both rows (``accounting._parts``); the readers' edges do not change, so neither do their copies."""
    s = state_bytes(p.out, True)
    copy = s.param / shard_factor(old, mesh_shape)
    scale = 1 / shard_factor(new, mesh_shape) - 1 / shard_factor(old, mesh_shape)
    update = copy + (s.persistent + s.grad + s.update_temp) * scale
    backward = copy + s.persistent * scale
    return np.array([update, backward]), -update
