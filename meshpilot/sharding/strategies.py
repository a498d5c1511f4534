"""Every operator's parallel algorithms on an N-D mesh: output layouts and the input layouts they need.

Source of truth is DTensor's own sharding propagator, so whatever the planner picks can run: for each node,
each tensor operand is offered as an ``OpStrategy`` holding every layout its producer can emit, and the op's
registered strategy function (``op_single_dim_strategy_funcs`` expanded to the full mesh, or
``op_strategy_funcs``) enumerates the algorithms, e.g. Alpa Table 3 for ``mm``/``bmm``. Two filters follow:

* even shards only (the planner never predicts DTensor's padding);
* *fixed points* of DTensor's selection: given exactly a strategy's input layouts, DTensor's dispatcher
  picks one strategy (``_select_min_cost_strategy``: a negative cost, else the last one needing no
  redistribution); strategies it would never pick are dropped, so the run takes the planned algorithm.

meshpilot adds strategies where DTensor has none (:mod:`meshpilot.ops`): into DTensor's propagator for the
device-generic attention pair and GroupNorm's backward, so DTensor runs them; and its *own* ops (source
``meshpilot``, run by meshpilot's runtime on the local shards) beside DTensor's — vocabulary-parallel
embedding and cross-entropy — or instead of DTensor's where those are not exact (dropout, training
BatchNorm). A strategy may issue collectives inside the op (``Strategy.colls``); the ILP prices them on the
node and the plan lists them with the resharding collectives.

Ops with no strategy at all fall back to one all-replicated strategy: the runtime runs them on local
replicas and the plan lists each such node (``StrategyBuilder.fallbacks``) with its module and source line.
Factory ops (no tensor operand) produce replicated tensors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils import _pytree as pytree

from meshpilot import compat
from meshpilot.graph.capture import LEAF_KINDS, NodeKind, OpGraph, OpNode, dtype_from_name
from meshpilot.graph.views import SHAPE_VIEWS
from meshpilot.ops import own_op, register_dtensor_strategies
from meshpilot.sharding.placements import (
    Placements,
    candidate_placements,
    fmt,
    is_even,
    pid,
    replicated,
    unique,
)
from meshpilot.sharding.reshard import Collective, tensor_meta

aten = torch.ops.aten
DTensorSpec, TensorMeta = compat.dtensor_spec()
_osm = compat.op_schema()
OpSchema, OpSpec, OpStrategy, TupleStrategy = _osm.OpSchema, _osm.OpSpec, _osm.OpStrategy, _osm.TupleStrategy


class StrategySource(StrEnum):
    """Where a node's strategy came from (stored in plans as ``NodeChoice.source``)."""

    DTENSOR = "dtensor"
    """DTensor's own sharding strategy for the op."""
    MESHPILOT = "meshpilot"
    """One of meshpilot's own ops (``meshpilot.ops``): strategy and implementation registered together."""
    LEAF = "leaf"
    """A placeholder (parameter, buffer, input, constant): its layout."""
    FACTORY = "factory"
    """A tensor made from nothing (``zeros``, ``arange``): laid out as its consumers want."""
    FALLBACK = "fallback"
    """No strategy covers the op: it runs replicated, and the plan lists it in ``Plan.fallbacks``."""


@dataclass(frozen=True)
class Strategy:
    """One parallel algorithm of a node: layout of each output and the layout each operand must have."""

    outs: tuple[Placements | None, ...]
    ins: tuple[Placements, ...]
    source: StrategySource = StrategySource.DTENSOR
    out_ids: tuple[int, ...] = ()
    in_ids: tuple[int, ...] = ()
    colls: tuple[Collective, ...] = ()
    """Collectives the op issues itself (not resharding its operands): a vocabulary-parallel softmax's
    all-reduces of row maxima and sums. The ILP adds their cost to the node and the plan lists them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_ids", tuple(pid(p) for p in self.outs))
        object.__setattr__(self, "in_ids", tuple(pid(p) for p in self.ins))

    def short(self, name: str = "") -> str:
        """``linear_3: S(0)R × RS(1) → S(0)S(1)``."""
        lhs = " × ".join(fmt(p) for p in self.ins) if self.ins else "∅"
        rhs = ", ".join(fmt(p) for p in self.outs)
        return f"{name + ': ' if name else ''}{lhs} → {rhs}"


def fake_device_mesh(shape: Sequence[int], ranks: np.ndarray | None = None) -> DeviceMesh:
    """A DeviceMesh of `shape` for planning: no process group, nothing initialised."""
    mesh = np.arange(math.prod(shape)).reshape(tuple(shape)) if ranks is None else np.asarray(ranks)
    return DeviceMesh("cpu", torch.as_tensor(mesh, dtype=torch.int), _init_backend=False, _rank=0)


# ------------------------------------------------------------------------------------------ enumeration

_STRATEGY_CACHE: dict[tuple[int, ...], dict[tuple, tuple[list, str | None]]] = {}
"""Per mesh shape: (node key, operand layout ids) -> the node's strategies and why it fell back (if it did)."""

_SINGLE_DIM_CACHE: dict[tuple[int, ...], dict[tuple, Any]] = {}
"""Per mesh shape: (node key, the one layout per operand DTensor's single-dim expansion is asked with, the
output metas) -> its expanded ``OpStrategy``. The strategy cache above is keyed by every layout each operand's
producer can emit, but the expansion reads one of them per operand (the first with a shard,
``_operand_strategies``), so nodes whose candidates differ elsewhere ask it the same question: on the planning
benchmark (issue 33 item 4) 9 of its 29 expansions, ≈0.05 of 0.14 CPU s. The answer is only read (its
placements and costs), never changed, so nodes share it."""

_CONST_KEY = "meshpilot_const_key"
"""The fx node ``meta`` entry holding :func:`_const_key`."""


_COST_MODULES: list | None = None


@contextlib.contextmanager
def _no_redistribute_costs():
    """DTensor's strategy functions price every strategy against every operand layout; the planner
    prices edges itself and only needs the strategies, so that work is skipped while enumerating."""
    import sys

    def zeros(src_strategy, dst_spec):
        return [0.0] * len(src_strategy.strategies)

    global _COST_MODULES
    if _COST_MODULES is None:
        _COST_MODULES = [
            mod
            for name, mod in list(sys.modules.items())
            if name.startswith("torch.distributed.tensor._ops") and hasattr(mod, "generate_redistribute_costs")
        ]
    saved = []
    for mod in _COST_MODULES:
        saved.append((mod, mod.generate_redistribute_costs))
        mod.generate_redistribute_costs = zeros
    try:
        yield
    finally:
        for mod, fn in saved:
            mod.generate_redistribute_costs = fn


def _spec_list(st: OpSpec) -> tuple[tuple[DTensorSpec | None, ...], tuple[DTensorSpec, ...] | None]:
    outs = st.output_specs
    outs_t = (outs,) if isinstance(outs, DTensorSpec) or outs is None else tuple(outs)
    return outs_t, (tuple(st.input_specs) if st.input_specs is not None else None)


class StrategyBuilder:
    """Enumerates strategies of graph nodes on one mesh, caching identical nodes (repeated layers hit it)."""

    def __init__(self, graph: OpGraph, dmesh: DeviceMesh):
        register_dtensor_strategies()
        self.graph = graph
        self.dmesh = dmesh
        self.mesh_shape = tuple(dmesh.shape)
        self.prop = compat.sharding_propagator()
        self._singles, self._single_infos = compat.single_dim_registry()
        self._expand_single = compat.lookup(
            compat.EXPAND_SINGLE_DIM, "DTensor's single-dim strategies are not enumerated: those ops are replicated"
        )
        # shared by every builder on a mesh of this shape: strategies depend on the op, its operand shapes
        # and layouts and the mesh shape only, so forced plans and repeated planning reuse them
        self._cache: dict[tuple, tuple[list[Strategy], str | None]] = _STRATEGY_CACHE.setdefault(self.mesh_shape, {})
        self._single_dim: dict[tuple, Any] = _SINGLE_DIM_CACHE.setdefault(self.mesh_shape, {})
        self.fallbacks: dict[str, str] = {}
        """Node -> why it has no strategy but the replicated one (the plan lists these per node)."""

    # candidate layouts a producer can emit at output i
    @staticmethod
    def out_candidates(strategies: list[Strategy], i: int) -> list[Placements]:
        return unique(s.outs[i] for s in strategies if i < len(s.outs) and s.outs[i] is not None)

    def leaf(self, node: OpNode) -> list[Strategy]:
        """Parameters and inputs may be stored in any even layout; buffers and constants are held whole on
        every rank (the module keeps buffers as plain tensors, and writes their updates back), so their
        readers take slices of a replica."""
        info = node.out
        if info is None:
            return [Strategy((None,), (), StrategySource.LEAF)]
        if node.kind in (NodeKind.BUFFER, NodeKind.CONST):
            return [Strategy((replicated(len(self.mesh_shape)),), (), StrategySource.LEAF)]
        return [Strategy((p,), (), StrategySource.LEAF) for p in candidate_placements(info.shape, self.mesh_shape)]

    def for_node(self, node: OpNode, operand_candidates: list[list[Placements]]) -> list[Strategy]:
        """Strategies of `node` given every layout its operands can arrive in."""
        if node.kind in LEAF_KINDS:
            return self.leaf(node)
        if node.kind == "getitem":
            return [Strategy((p,), (p,), StrategySource.DTENSOR) for p in operand_candidates[0]]
        key = (self._node_key(node), tuple(tuple(map(pid, c)) for c in operand_candidates), _FOLDED[0])
        hit = self._cache.get(key)
        if hit is not None:
            strategies, why = hit
            if why is not None:
                self.fallbacks[node.name] = why
            return strategies
        self._last_fallback = None
        with _no_redistribute_costs():
            strategies = self._compute(node, operand_candidates)
        self._cache[key] = (strategies, self._last_fallback)
        return strategies

    def _node_key(self, node: OpNode) -> tuple:
        """What the strategies of `node` depend on besides its operands' layouts: the op, its outputs, its
        operands' shapes and dtypes and its constant arguments (hashable values, compared as they are)."""
        operands = tuple(self.graph[s].outputs[i] for s, i in node.inputs)
        return (node.target, tuple(node.outputs), operands, _const_key(node))

    def _fallback(self, node: OpNode, why: str) -> list[Strategy]:
        from meshpilot.ops import unavailable

        missing = unavailable(node.target)
        why = f"{why} ({missing})" if missing else why
        self.fallbacks[node.name] = why
        self._last_fallback = why
        outs = tuple(replicated(len(self.mesh_shape)) if o is not None else None for o in node.outputs)
        ins = tuple(replicated(len(self.mesh_shape)) for _ in node.inputs)
        return [Strategy(outs, ins, StrategySource.FALLBACK)]

    def _compute(self, node: OpNode, cands: list[list[Placements]]) -> list[Strategy]:
        """`node`'s strategies: an own op's, or DTensor's for its ATen op (:meth:`_dtensor_strategies`, each
        layout canonical, even and reachable from what the operands' producers emit, one per input layout as
        DTensor would select it) and meshpilot's beside them; the replicated fallback where none applies."""
        nd = len(self.mesh_shape)
        if not node.inputs:
            outs = tuple(replicated(nd) if o is not None else None for o in node.outputs)
            return [Strategy(outs, (), StrategySource.FACTORY)]
        own = own_op(node.target)
        if own is not None and own.exclusive:
            return own.strategies(self, node) or self._fallback(node, f"{node.target}: no exact strategy applies")
        op = node.fx_node.target
        if not isinstance(op, torch._ops.OpOverload):
            return self._fallback(node, f"{node.target} is not an ATen op")
        single = self._singles.get(op) if self._expand_single is not None else None
        func = self.prop.op_strategy_funcs.get(op)
        if single is None and func is None:
            return self._own(node) or self._fallback(node, f"DTensor has no sharding strategy for {node.target}")
        try:
            result, cands = self._dtensor_strategies(node, op, single, func, cands)
        except Exception as e:  # noqa: BLE001 - DTensor could not enumerate: replicate
            return self._fallback(node, f"DTensor strategy for {node.target} failed: {type(e).__name__}: {e}")
        if not isinstance(result, OpStrategy):
            return self._fallback(node, f"{node.target}: tuple strategies are not planned yet")
        plain = self._plain_specs(node, result)
        if isinstance(plain, str):
            return self._fallback(node, plain)
        cand_index = [{p: j for j, p in enumerate(c)} for c in cands]
        parsed = self._reachable(node, plain, cands, cand_index)
        if not parsed and len(cands) == 1:
            parsed, cand_index = self._gathered(node, op, single, func, cands[0])
        if not parsed and _FOLDED[0] and node.target in SHAPE_VIEWS:
            folded = folded_views(node, self.graph, self.mesh_shape, cands)
            if folded:
                return folded
        if not parsed:
            return self._own(node) or self._fallback(
                node, f"{node.target}: no evenly sharded strategy on mesh {self.mesh_shape}"
            )
        strategies = unique_strategies(_selected(parsed, cand_index, negative_costs_count=single is None).values())
        strategies += self._own(node)
        if _FOLDED[0] and node.target in SHAPE_VIEWS:
            strategies += [x for x in folded_views(node, self.graph, self.mesh_shape, cands) if x not in strategies]
        if not strategies:
            return self._fallback(node, f"{node.target}: no strategy reachable from its operands")
        return strategies

    def _gathered(self, node: OpNode, op: Any, single: Any, func: Any, cands: list[Placements]) -> tuple[list, list]:
        """For a one-operand op none of whose operand's layouts DTensor shards plainly (a flatten of
        ``[batch, seq, …]`` sharded on the sequence over one mesh axis and on the batch over another: DTensor
        answers with a strided shard), the strategies of the layouts with one sharded axis made whole (an
        all-gather on it, the batch kept sharded), and their candidate index; none found: ``([], [])``."""
        whole = [_whole_on(c, a) for c in cands for a, p in enumerate(c) if isinstance(p, Shard)]
        wider = unique([*cands, *(w for w in whole if any(isinstance(p, Shard) for p in w))])
        if len(wider) == len(cands):
            return [], []
        try:
            result, got = self._dtensor_strategies(node, op, single, func, [wider])
        except Exception:  # noqa: BLE001 - DTensor could not enumerate these either: the fallback stands
            return [], []
        plain = self._plain_specs(node, result) if isinstance(result, OpStrategy) else "tuple"
        if isinstance(plain, str):
            return [], []
        index = [{p: j for j, p in enumerate(c)} for c in got]
        return self._reachable(node, plain, got, index), index

    def _operand_strategies(self, node: OpNode, single: Any, cands: list[list[Placements]]) -> list[OpStrategy]:
        """Each operand's candidate layouts as DTensor's ``OpStrategy``. DTensor's single-dim expansion wants
        one layout per operand; any layout holding a Shard makes it fill its sharding placeholders, and the
        expansion enumerates every combination."""
        out: list[OpStrategy] = []
        infos = [self.graph[src].outputs[i] for src, i in node.inputs]
        sliced = replica_sliced_operands(node.target, infos) if single is not None else frozenset()
        for k, c in enumerate(cands):
            tm = tensor_meta(infos[k])
            if k in sliced and _replica_only(c):  # the slices it may be planned as fill the placeholders
                c = [*c, *_slices(infos[k].shape, self.mesh_shape)]
            if single is not None:
                rep = next((p for p in c if any(isinstance(x, Shard) for x in p)), c[0])
                out.append(OpStrategy([OpSpec(DTensorSpec(self.dmesh, rep, tm))]))
            else:
                out.append(OpStrategy([OpSpec(DTensorSpec(self.dmesh, p, tm)) for p in c]))
        return out

    def _dtensor_strategies(
        self, node: OpNode, op: Any, single: Any, func: Any, cands: list[list[Placements]]
    ) -> tuple[Any, list[list[Placements]]]:
        """DTensor's strategies for `op` given the operands' candidate layouts, and the candidates they were
        asked with (a strategy function that rejects some layouts of a single operand is asked per layout,
        with the replicated one added). Raises whatever DTensor raises when it cannot enumerate."""
        fx_node = node.fx_node
        operand_strats = self._operand_strategies(node, single, cands)
        if single is not None:
            val = fx_node.meta.get("val")
            out_meta = tuple(_meta_of(v) for v in val) if isinstance(val, (tuple, list)) else _meta_of(val)
            # DTensor sees one layout per operand here: nodes whose candidates differ but not in those layouts
            # get the same expansion (:data:`_SINGLE_DIM_CACHE`)
            key = (
                self._node_key(node),
                tuple(pid(o.strategies[0].output_spec.placements) for o in operand_strats),
                out_meta,
            )
            hit = self._single_dim.get(key)
            if hit is None:
                args, kwargs = _schema_args(fx_node, operand_strats)
                schema = OpSchema(op, args, kwargs, schema_info=self._single_infos.get(op))
                fn = self._expand_single(self.dmesh, schema, single, out_meta)
                hit = self._single_dim[key] = fn(op, schema.args_meta, schema.kwargs_meta)
            return hit, cands
        info = self.prop.op_to_schema_info.get(op)

        def ask(strats: list[OpStrategy]) -> Any:
            args, kwargs = _schema_args(fx_node, strats)
            return func(OpSchema(op, args, kwargs, schema_info=info))

        try:
            return ask(operand_strats), cands
        except (RuntimeError, KeyError):
            if len(operand_strats) != 1:
                raise
            # a strategy function that rejects some operand layouts outright (strict views refuse to reshape a
            # sharded dim): ask per layout and keep the ones it accepts; the replicated layout is always
            # offered, so the operand can be resharded to it
            specs: list[OpSpec] = []
            errors: list[str] = []
            tm = operand_strats[0].strategies[0].output_spec.tensor_meta
            layouts = unique([*cands[0], replicated(len(self.mesh_shape))])
            for pl in layouts:
                try:
                    specs.extend(ask([OpStrategy([OpSpec(DTensorSpec(self.dmesh, pl, tm))])]).strategies)
                except (RuntimeError, KeyError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
            if not specs:
                raise RuntimeError(errors[0] if errors else "no layout accepted") from None
            return OpStrategy(specs), [layouts]
        except (IndexError, AssertionError):
            # some strategy functions walk their operands' strategies in lockstep: offer every operand's
            # layouts as lists of one common length and ask again
            longest = max(len(o.strategies) for o in operand_strats)
            return ask(
                [OpStrategy([o.strategies[j % len(o.strategies)] for j in range(longest)]) for o in operand_strats]
            ), cands

    def _plain_specs(self, node: OpNode, result: OpStrategy) -> list[tuple[tuple, tuple, OpSpec]] | str:
        """DTensor's strategies as (output layouts, input layouts, spec), canonical, keeping those made of
        plain placements and even on every operand and output; a one-line reason where DTensor's answer does
        not match the node."""
        n_in = len(node.inputs)
        plain: list[tuple[tuple, tuple, OpSpec]] = []
        for spec in result.strategies:
            outs, ins = _spec_list(spec)
            if ins is None:
                ins = tuple(outs[0] for _ in range(n_in))
            if len(ins) != n_in:
                return f"{node.target}: operand count mismatch ({len(ins)} vs {n_in})"
            out_pl = tuple(self._canonical(o.placements) if o is not None else None for o in outs)
            if len(out_pl) < len(node.outputs):
                out_pl = out_pl + (out_pl[-1],) * (len(node.outputs) - len(out_pl))
            in_pl = tuple(self._canonical(s.placements) for s in ins)
            if not (all(_plain(p) for p in in_pl) and all(p is None or _plain(p) for p in out_pl)):
                continue
            if node.target in AVG_INEXACT and any(p is not None and _averaged(p) for p in out_pl):
                continue
            ok = all(
                is_even(p, self.graph[src].outputs[i].shape, self.mesh_shape) for p, (src, i) in zip(in_pl, node.inputs)
            ) and all(
                p is None or o is None or is_even(p, o.shape, self.mesh_shape) for p, o in zip(out_pl, node.outputs)
            )
            if ok:
                plain.append((out_pl, in_pl, spec))
        return plain

    def _reachable(
        self, node: OpNode, plain: list[tuple[tuple, tuple, OpSpec]], cands: list[list[Placements]], cand_index
    ) -> list[tuple[Strategy, OpSpec]]:
        """The strategies whose operand layouts their producers emit (a partial operand only as a bias joining
        a product); where none is common to every operand (a replicated mask meeting a sharded one), layouts
        a producer's replica reaches by local slicing too."""
        floats = [
            (info := self.graph[src].outputs[i]) is not None and dtype_from_name(info.dtype).is_floating_point
            for src, i in node.inputs
        ]

        from_replica = replica_sliced_operands(node.target, [self.graph[src].outputs[i] for src, i in node.inputs])

        def reachable(in_pl: tuple, sliced: bool) -> bool:
            return all(
                p in cand_index[k]
                or (floats[k] and _partial_joins(k, in_pl, cands[k]))
                or (sliced and any(_slice_of(c, p) for c in cands[k]))
                or (k in from_replica and _replica_only(cands[k]) and _slice_of(cands[k][0], p))
                for k, p in enumerate(in_pl)
            )

        keep = [x for x in plain if reachable(x[1], False)] or [x for x in plain if reachable(x[1], True)]
        return [(Strategy(o, i, StrategySource.DTENSOR), spec) for o, i, spec in keep]

    def _canonical(self, pl: Placements) -> Placements:
        """`pl` with ``R`` on every mesh axis of one device (a shard or partial sum over one device is the
        whole tensor): DTensor's strategies may name either, and the plan must not tell them apart."""
        if all(n > 1 or isinstance(p, Replicate) for p, n in zip(pl, self.mesh_shape)):
            return pl
        return tuple(p if n > 1 else Replicate() for p, n in zip(pl, self.mesh_shape))

    def _own(self, node: OpNode) -> list[Strategy]:
        """meshpilot's strategies beside DTensor's, run by meshpilot's runtime (:mod:`meshpilot.ops`)."""
        own = own_op(node.target)
        return own.strategies(self, node) if own is not None else []


# -------------------------------------------------------------------- views of a folded batch

_FOLDED = [False]
"""Whether :func:`folded_views` strategies are offered (:func:`folded_batch_views`); part of the cache key."""


@contextlib.contextmanager
def folded_batch_views():
    """Offer :func:`folded_views` while planning inside this context (context parallelism's stages:
    ``planner.config_plan``); other plans keep DTensor's view strategies only."""
    was = _FOLDED[0]
    _FOLDED[0] = True
    try:
        yield
    finally:
        _FOLDED[0] = was


def folded_views(node: OpNode, graph: OpGraph, mesh: tuple[int, ...], cands: list[list[Placements]]) -> list:
    """Strategies of a reshape (``SHAPE_VIEWS``) whose operand's dim 0 is sharded *down to one row* over the
    leading mesh axes, beside a shard of another dim over later axes: ``[b, t, h]`` as ``S(0)`` over DP (b = DP,
    one sequence a replica) and ``S(1)`` over CP, flattened to ``[b·t, h]``. DTensor offers none (the sequence
    is not the flatten's first dim, so it answers with a strided shard and the planner would gather it), yet
    each rank's local rows are the same contiguous block either way: with the leading axes ``A`` splitting
    dim 0 into single rows, rank ``(a, c)`` holds row ``a``'s shard ``c`` before the view and the nested
    ``S(0)`` rows ``a · t + c · t / CP …`` after it (and back: ``[b·t, h]`` sharded ``S(0)`` over DP, then CP,
    viewed as ``[b, t, h]``). So the view is planned on the rest of the mesh with dim 0 of both shapes divided
    by the rows (DTensor's own view rule, ``propagate_shape_and_sharding``), and the axes ``A`` shard dim 0 of
    the output, nested first. Only where the input's or the output's dim 0 is exactly those rows and both are
    multiples of them (row-major: each row a contiguous block on both sides); no resharding."""
    from torch.distributed.tensor._ops._view_ops import propagate_shape_and_sharding, view_groups

    if len(node.inputs) < 1 or len(node.outputs) != 1 or node.out is None or len(cands) < 1:
        return []
    src = graph[node.inputs[0][0]].outputs[node.inputs[0][1]]
    if src is None:
        return []
    i_shape, o_shape = tuple(src.shape), tuple(node.out.shape)
    if not i_shape or not o_shape or i_shape == o_shape:
        return []
    out = []
    for p in cands[0]:
        lead = 0
        while lead < len(mesh) and p[lead] == Shard(0):
            lead += 1
        for k in range(lead, 0, -1):  # the leading axes that split dim 0 into single rows (on one side)
            rows = math.prod(mesh[:k])
            if i_shape[0] % rows or o_shape[0] % rows or rows not in (i_shape[0], o_shape[0]):
                continue
            rest = tuple(p[k:])
            small_in, small_out = (i_shape[0] // rows, *i_shape[1:]), (o_shape[0] // rows, *o_shape[1:])
            try:
                want, got = propagate_shape_and_sharding(rest, small_in, view_groups(small_in, small_out), mesh[k:])
            except Exception:  # noqa: BLE001 - DTensor refuses this reshape of the rest: none here
                continue
            outs = ((*p[:k], *got),)
            if (
                tuple(want) != rest
                or not any(isinstance(x, Shard) for x in rest)
                or not is_even(outs[0], o_shape, mesh)
            ):
                continue
            ins = (tuple(p), *[replicated(len(mesh))] * (len(node.inputs) - 1))
            out.append(Strategy(outs, ins, StrategySource.DTENSOR))
            break
    return unique_strategies(out)


# -------------------------------------------------------------------- meshpilot-run strategies


def per_axis_products(
    self: StrategyBuilder, node: OpNode, per_axis, colls=None, *, require_first: bool = True
) -> list[Strategy]:
    """Every product over mesh axes of the per-axis rules `per_axis` (lists of (outs, ins) placements; an axis
    of one device takes the last rule, which must be the replicated one), with the first rule (the op's own,
    e.g. vocabulary-parallel) on at least one axis unless `require_first` is False; even shards only.
    ``colls(outs, ins)`` gives the collectives a strategy issues inside the op (``Strategy.colls``)."""
    import itertools

    mesh = self.mesh_shape
    out = []
    for combo in itertools.product(*[per_axis if n > 1 else per_axis[-1:] for n in mesh]):
        if require_first and not any(c is per_axis[0] for c in combo):
            continue
        n_out, n_in = len(combo[0][0]), len(combo[0][1])
        outs = tuple(tuple(c[0][k] for c in combo) for k in range(n_out))
        ins = tuple(tuple(c[1][k] for c in combo) for k in range(n_in))
        ok = all(is_even(p, self.graph[src].outputs[i].shape, mesh) for p, (src, i) in zip(ins, node.inputs))
        ok = ok and all(o is None or is_even(p, o.shape, mesh) for p, o in zip(outs, node.outputs))
        if ok:
            out.append(
                Strategy(outs, ins, StrategySource.MESHPILOT, colls=colls(outs, ins) if colls is not None else ())
            )
    return out


def _dtensor_pick(specs: list[OpSpec], strats: list[Strategy], idx: list[int], ins: tuple) -> Strategy | None:
    """Which strategy DTensor's dispatcher takes when the operands arrive exactly as `ins`."""
    costs = []
    for sp in specs:
        if not sp.redistribute_cost:
            costs.append(0.0)
            continue
        costs.append(sum(float(row[j]) for row, j in zip(sp.redistribute_cost, idx)))
    neg = [k for k, c in enumerate(costs) if c < 0]
    if neg:
        return strats[min(neg, key=lambda k: costs[k])]
    exact = [k for k, s in enumerate(strats) if s.ins == ins and costs[k] == 0]
    if exact:
        return strats[exact[-1]]
    return None


def _partial_joins(k: int, ins: tuple[Placements, ...], candidates: list[Placements]) -> bool:
    """Whether float operand `k` may be planned partial although its producer never emits that layout: it joins a
    partial product made by sharded operands (an ``addmm``'s replicated bias added to a row-parallel
    matmul's partial sums). On every axis where it is partial, its producer has a replica (``R -> P`` is a
    free local step: each rank keeps 1/n, as DTensor does) and another operand is sharded. Splitting a
    replica into partials merely to divide an op's work is not allowed: each rank would still do all of it.
    """
    p = ins[k]
    axes = [a for a, x in enumerate(p) if isinstance(x, Partial)]
    if not axes:
        return True
    if not any(isinstance(ins[j][a], Shard) for a in axes for j in range(len(ins)) if j != k):
        return False
    if not all(any(isinstance(ins[j][a], Shard) for j in range(len(ins)) if j != k) for a in axes):
        return False
    return any(all(isinstance(c[a], Replicate) for a in axes) for c in candidates)


def _whole_on(pl: Placements, axis: int) -> Placements:
    """`pl` with mesh axis `axis` replicated (an all-gather of that axis' shards)."""
    return tuple(Replicate() if a == axis else p for a, p in enumerate(pl))


def _slice_of(have: Placements, want: Placements) -> bool:
    """Whether layout `want` is a local slice of layout `have`: on every mesh axis the same placement, or a
    replica that the axis shards (``R -> S(d)``: each rank keeps its block, no communication)."""
    return all(h == w or (isinstance(h, Replicate) and isinstance(w, Shard)) for h, w in zip(have, want))


def replica_sliced_operands(target: str, operands: list) -> frozenset[int]:
    """Positions of the operands of `target` that may be planned as a slice (on any dim) of their producer's
    replica even where other layouts need no slicing — only where that producer emits nothing but the replica
    (a chain of position arithmetic from an ``arange``), so the slice is the only way to shard what the operand
    feeds.

    * attention's mask, on any dim: by query rows for the sequence-parallel strategy, by batch (or heads, where
      it has them) for the batch- and head-parallel ones (:mod:`meshpilot.ops.attention`) — a mask built from
      positions and expanded to the batch (transformers' ``[b, 1, t, s]``) otherwise leaves only the replicated
      and row strategies reachable, and a data-parallel plan gathers q, k and v around every attention;
    * ``index.Tensor``'s index tensors: a causal mask built from positions (``kv_pos <= q_pos``, as
      transformers writes it) is then built by query rows too, each rank its ``t / n`` rows of the ``t × s``
      mask, rather than whole on every rank.
    """
    from meshpilot.ops.attention import MASK_OPERAND

    if target == "aten.index.Tensor":
        return frozenset(range(1, len(operands)))
    k = MASK_OPERAND.get(target)
    if k is None or k >= len(operands) or operands[k] is None:
        return frozenset()
    return frozenset((k,))


def _slices(shape, mesh_shape: Sequence[int]) -> list[Placements]:
    """Layouts sharding one dim of `shape` of more than one entry over one mesh axis."""
    dims = [d for d, n in enumerate(shape) if n > 1]
    out = []
    for a, n in enumerate(mesh_shape):
        if n > 1:
            for d in dims:
                out.append(tuple(Shard(d) if b == a else Replicate() for b in range(len(mesh_shape))))
    return out


def _replica_only(candidates: list[Placements]) -> bool:
    """Whether a producer's only layout is the replica."""
    return len(candidates) == 1 and all(isinstance(p, Replicate) for p in candidates[0])


def unique_strategies(strats) -> list[Strategy]:
    seen: dict[tuple, Strategy] = {}
    for s in strats:
        seen.setdefault((s.outs, s.ins), s)
    return list(seen.values())


def _plain(pl: Placements) -> bool:
    """R, S(d) and P(sum)/P(avg) only: no strided shards, no max/min partials."""
    for p in pl:
        if type(p) is Shard or isinstance(p, Replicate):
            continue
        if isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            continue
        return False
    return True


AVG_INEXACT = frozenset({"aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default"})
"""Ops whose DTensor ``P(avg)`` output is not their value: a mean loss over row-sharded targets is the mean of
the shards' means, which differs from the whole batch's mean wherever the shards hold unequal numbers of ignored
targets (padding labelled ``ignore_index``; DTensor checks only that the rows divide evenly). Those strategies
are dropped: ``ops.vocab``'s rule all-reduces the count of targets instead (a partial sum, exact), and where it
does not apply the loss is computed whole."""


def _averaged(pl: Placements) -> bool:
    return any(isinstance(p, Partial) and p.reduce_op == "avg" for p in pl)


def _is_tensor_node(a) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _meta_of(v):
    if isinstance(v, torch.Tensor):
        return TensorMeta(v.shape, v.stride(), v.dtype)
    return None


def _const_key(node: OpNode) -> str | None:
    """The fx node's arguments with its tensor operands blanked out (its constants), as a string; kept in the
    fx node's ``meta`` (a stage's slice of the graph shares its fx nodes, and the pipeline planner asks for
    the strategies of every node once per range and mesh shape: the pytree walk was a tenth of a Wide-ResNet
    plan's time)."""
    fx = node.fx_node
    if fx is None:
        return None
    key = fx.meta.get(_CONST_KEY)
    if key is None:
        key = fx.meta[_CONST_KEY] = repr(pytree.tree_map_only(torch.fx.Node, lambda _: "T", (fx.args, fx.kwargs)))
    return key


def _schema_args(fx_node: torch.fx.Node, operand_strats: list[OpStrategy]) -> tuple[tuple, dict]:
    """`fx_node`'s arguments for an ``OpSchema``: each tensor operand replaced, in order, by the next of
    `operand_strats` (a list of tensors by a ``TupleStrategy``), other nodes by their values."""
    it = iter(operand_strats)

    def wrap(a: Any) -> Any:
        if isinstance(a, (list, tuple)) and a and all(_is_tensor_node(x) for x in a):
            kids = [next(it) for _ in a]
            return TupleStrategy(tuple(kids) if isinstance(a, tuple) else kids)
        if _is_tensor_node(a):
            return next(it)
        if isinstance(a, (list, tuple)):
            return type(a)(wrap(x) for x in a)
        if isinstance(a, torch.fx.Node):
            return a.meta.get("val")
        return a

    args = tuple(wrap(a) for a in fx_node.args)
    return args, {k: wrap(v) for k, v in fx_node.kwargs.items()}


def _selected(parsed: list[tuple[Strategy, OpSpec]], cand_index: list[dict], negative_costs_count: bool) -> dict:
    """The fixed points of DTensor's own selection, one strategy per distinct input layout: the last one
    wins, as in ``_select_min_cost_strategy``, unless the specs carry negative redistribution costs (counted
    only for non-single-dim strategies), where DTensor's pick for that layout is kept when it is a fixed point."""
    any_negative = negative_costs_count and any(
        spec.redistribute_cost and any(c < 0 for row in spec.redistribute_cost for c in row) for _, spec in parsed
    )
    chosen: dict[tuple, Strategy] = {}
    if not any_negative:
        for s, _ in parsed:
            chosen[s.ins] = s
        return chosen
    all_specs = [sp for _, sp in parsed]
    for s, _ in parsed:
        if s.ins in chosen:
            continue
        idx = [cand_index[k].get(p) for k, p in enumerate(s.ins)]
        if any(j is None for j in idx):
            continue
        pick = _dtensor_pick(all_specs, [st for st, _ in parsed], idx, s.ins)
        if pick is not None and pick.ins == s.ins:
            chosen[s.ins] = pick
    return chosen
