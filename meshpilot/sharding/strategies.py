"""Every operator's parallel algorithms on an N-D mesh: output layouts and the input layouts they need.

Source of truth is DTensor's own sharding propagator, so whatever the planner picks can run: for each node,
each tensor operand is offered as an ``OpStrategy`` holding every layout its producer can emit, and the op's
registered strategy function (``op_single_dim_strategy_funcs`` expanded to the full mesh, or
``op_strategy_funcs``) enumerates the algorithms, e.g. Alpa Table 3 for ``mm``/``bmm``. Two filters follow:

* even shards only (the planner never predicts DTensor's padding);
* *fixed points* of DTensor's selection: given exactly a strategy's input layouts, DTensor's dispatcher
  picks one strategy (``_select_min_cost_strategy``: a negative cost, else the last one needing no
  redistribution); strategies it would never pick are dropped, so the run takes the planned algorithm.

Where DTensor has no strategy, meshpilot registers its own *into DTensor's propagator* (so the run can use
them too): the CPU flash-attention kernels (batch- or head-parallel) and GroupNorm's backward
(batch-parallel). Ops with neither fall back to one
all-replicated strategy; the runtime runs them on local replicas and the plan lists them as warnings.

meshpilot's own strategies (``OWN_OPS``, source ``meshpilot``) are offered beside DTensor's and run by
meshpilot's runtime on the local shards: the vocabulary-parallel embedding (forward and backward) and the
vocabulary-parallel cross-entropy (``_log_softmax``, ``nll_loss_forward`` and their backward with the class
dim sharded, Megatron-LM's). A strategy may issue collectives inside the op (``Strategy.colls``: the
softmax's all-reduces of row maxima and sums, the count of non-ignored targets over row-sharding axes);
the ILP prices them on the node and the plan lists them with the resharding collectives.

Factory ops (no tensor operand) produce replicated tensors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.utils import _pytree as pytree

from meshpilot.graph.capture import OpGraph, OpNode, dtype_from_name
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


@dataclass(frozen=True)
class Strategy:
    """One parallel algorithm of a node: layout of each output and the layout each operand must have."""

    outs: tuple[Placements | None, ...]
    ins: tuple[Placements, ...]
    source: str = "dtensor"
    """``dtensor`` (DTensor's strategy), ``meshpilot`` (ours), ``leaf`` (a placeholder), ``factory``,
    ``fallback`` (no strategy: replicated)."""
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


# ----------------------------------------------------------------------------- meshpilot's own strategies

_REGISTERED = False


def register_meshpilot_strategies() -> None:
    """Register meshpilot's strategies for ops DTensor lacks, in DTensor's own propagator (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    prop = DTensor._op_dispatcher.sharding_propagator

    def _attn_fwd(op_schema: OpSchema):
        mesh = op_schema.get_mesh_from_args()
        n_in = sum(1 for a in op_schema.args_schema if isinstance(a, OpStrategy))
        n_in += sum(1 for a in op_schema.kwargs_schema.values() if isinstance(a, OpStrategy))
        rows = [[Replicate()] * (2 + n_in)]
        if n_in == 3:  # no attention mask: batch- and head-parallel attention
            rows.append([Shard(0)] * 5)
            rows.append([Shard(1)] * 5)
        return expand_to_full_mesh_op_strategy(mesh, op_schema, rows, input_index=2)

    def _attn_bwd(op_schema: OpSchema):
        mesh = op_schema.get_mesh_from_args()
        n_in = sum(1 for a in op_schema.args_schema if isinstance(a, OpStrategy))
        n_in += sum(1 for a in op_schema.kwargs_schema.values() if isinstance(a, OpStrategy))
        rows = [[Replicate()] * (3 + n_in)]
        if n_in == 6:
            rows.append([Shard(0)] * 9)
            rows.append([Shard(1)] * 9)
        return expand_to_full_mesh_op_strategy(mesh, op_schema, rows, input_index=3)

    prop.register_op_strategy(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        _attn_fwd,
        RuntimeSchemaInfo(3, static_kwargkey=["scale"]),
    )
    prop.register_op_strategy(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        _attn_bwd,
        RuntimeSchemaInfo(6, static_kwargkey=["scale"]),
    )
    _register_group_norm_backward(prop)
    prop.propagate_op_sharding.cache.cache_clear() if hasattr(prop.propagate_op_sharding, "cache") else None
    _REGISTERED = True


def _register_group_norm_backward(prop) -> None:
    """Batch-parallel GroupNorm backward (DTensor has the forward only): every sample is normalised on its
    own, so grad_out, input, mean and rstd sharded on the batch give grad_input sharded the same way and
    partial sums of grad_weight / grad_bias; N/C/HxW become the local sizes as in DTensor's forward."""
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._ops._math_ops import _adjust_group_norm_scalars
    from torch.distributed.tensor._ops.single_dim_strategy import (
        _ShardingPlaceholder,
        register_single_dim_strategy,
    )

    op = aten.native_group_norm_backward.default
    if op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs:
        return

    def strategy(op, args_schema, kwargs_schema):
        # native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C, HxW, group, output_mask)
        mask = args_schema[9]
        has_weight = isinstance(args_schema[4], TensorMeta)
        outs = [
            _ShardingPlaceholder(0) if mask[0] else None,
            Partial("sum") if mask[1] else None,
            Partial("sum") if mask[2] else None,
        ]
        ins = [_ShardingPlaceholder(0)] * 4 + ([Replicate()] if has_weight else [])
        return [outs + ins]

    register_single_dim_strategy(op, schema_info=RuntimeSchemaInfo(5))(strategy)
    prop.op_to_scalar_shape_adjuster[op] = _adjust_group_norm_scalars


# ------------------------------------------------------------------------------------------ enumeration

_STRATEGY_CACHE: dict[tuple[int, ...], dict[str, tuple[list, tuple[str, str] | None]]] = {}


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
        register_meshpilot_strategies()
        self.graph = graph
        self.dmesh = dmesh
        self.mesh_shape = tuple(dmesh.shape)
        self.prop = DTensor._op_dispatcher.sharding_propagator
        # shared by every builder on a mesh of this shape: strategies depend on the op, its operand shapes
        # and layouts and the mesh shape only, so forced plans and repeated planning reuse them
        self._cache: dict[str, tuple[list[Strategy], tuple[str, str] | None]] = _STRATEGY_CACHE.setdefault(
            self.mesh_shape, {}
        )
        self.warnings: dict[str, str] = {}

    # candidate layouts a producer can emit at output i
    @staticmethod
    def out_candidates(strategies: list[Strategy], i: int) -> list[Placements]:
        return unique(s.outs[i] for s in strategies if i < len(s.outs) and s.outs[i] is not None)

    def leaf(self, node: OpNode) -> list[Strategy]:
        info = node.out
        if info is None:
            return [Strategy((None,), (), "leaf")]
        return [Strategy((p,), (), "leaf") for p in candidate_placements(info.shape, self.mesh_shape)]

    def for_node(self, node: OpNode, operand_candidates: list[list[Placements]]) -> list[Strategy]:
        """Strategies of `node` given every layout its operands can arrive in."""
        if node.kind in ("param", "buffer", "input"):
            return self.leaf(node)
        if node.kind == "getitem":
            return [Strategy((p,), (p,), "dtensor") for p in operand_candidates[0]]
        key = repr(
            (
                node.target,
                node.outputs,
                [self.graph[s].outputs[i] for s, i in node.inputs],
                operand_candidates,
                _const_key(node),
            )
        )
        hit = self._cache.get(key)
        if hit is not None:
            strategies, warning = hit
            if warning is not None:
                self.warnings.setdefault(*warning)
            return strategies
        self._last_warning = None
        with _no_redistribute_costs():
            strategies = self._compute(node, operand_candidates)
        self._cache[key] = (strategies, self._last_warning)
        return strategies

    def _fallback(self, node: OpNode, why: str) -> list[Strategy]:
        self.warnings.setdefault(node.target, why)
        self._last_warning = (node.target, why)
        outs = tuple(replicated(len(self.mesh_shape)) if o is not None else None for o in node.outputs)
        ins = tuple(replicated(len(self.mesh_shape)) for _ in node.inputs)
        return [Strategy(outs, ins, "fallback")]

    def _compute(self, node: OpNode, cands: list[list[Placements]]) -> list[Strategy]:
        nd = len(self.mesh_shape)
        if not node.inputs:
            outs = tuple(replicated(nd) if o is not None else None for o in node.outputs)
            return [Strategy(outs, (), "factory")]
        fx_node = node.fx_node
        op = fx_node.target
        if not isinstance(op, torch._ops.OpOverload):
            return self._fallback(node, f"{node.target} is not an ATen op")
        single = self.prop.op_single_dim_strategy_funcs.get(op)
        func = self.prop.op_strategy_funcs.get(op)
        if single is None and func is None:
            return self._fallback(node, f"DTensor has no sharding strategy for {node.target}")

        operand_strats: list[OpStrategy] = []
        for (src, i), c in zip(node.inputs, cands):
            tm = tensor_meta(self.graph[src].outputs[i])
            if single is not None:
                # DTensor's single-dim expansion wants one layout per operand; any layout holding a Shard
                # makes it fill its sharding placeholders, and the expansion enumerates every combination.
                rep = next((p for p in c if any(isinstance(x, Shard) for x in p)), c[0])
                operand_strats.append(OpStrategy([OpSpec(DTensorSpec(self.dmesh, rep, tm))]))
            else:
                operand_strats.append(OpStrategy([OpSpec(DTensorSpec(self.dmesh, p, tm)) for p in c]))
        it = iter(operand_strats)

        def wrap(a):
            nonlocal it
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
        kwargs = {k: wrap(v) for k, v in fx_node.kwargs.items()}
        try:
            if single is not None:
                from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh

                info = self.prop.op_to_schema_info_for_single_dim_strategy.get(op)
                schema = OpSchema(op, args, kwargs, schema_info=info)
                val = fx_node.meta.get("val")
                if isinstance(val, (tuple, list)):
                    out_meta = tuple(_meta_of(v) for v in val)
                else:
                    out_meta = _meta_of(val)
                fn = _expand_single_dim_strategy_to_mesh(self.dmesh, schema, single, out_meta)
                result = fn(op, schema.args_meta, schema.kwargs_meta)
            else:
                try:
                    schema = OpSchema(op, args, kwargs, schema_info=self.prop.op_to_schema_info.get(op))
                    result = func(schema)
                except RuntimeError:
                    if len(operand_strats) != 1:
                        raise
                    # a strategy function that rejects some operand layouts outright (strict views refuse
                    # to reshape a sharded dim): ask per layout and keep the ones it accepts; the
                    # replicated layout is always offered, so the operand can be resharded to it
                    specs: list[OpSpec] = []
                    errors: list[str] = []
                    tm = operand_strats[0].strategies[0].output_spec.tensor_meta
                    layouts = unique([*cands[0], replicated(len(self.mesh_shape))])
                    for pl in layouts:
                        it = iter([OpStrategy([OpSpec(DTensorSpec(self.dmesh, pl, tm))])])
                        args = tuple(wrap(a) for a in fx_node.args)
                        kwargs = {k: wrap(v) for k, v in fx_node.kwargs.items()}
                        schema = OpSchema(op, args, kwargs, schema_info=self.prop.op_to_schema_info.get(op))
                        try:
                            specs.extend(func(schema).strategies)
                        except RuntimeError as e:
                            errors.append(str(e))
                    if not specs:
                        raise RuntimeError(errors[0] if errors else "no layout accepted") from None
                    cands = [layouts]
                    result = OpStrategy(specs)
                except (IndexError, AssertionError):
                    # some strategy functions walk their operands' strategies in lockstep: offer every
                    # operand's layouts as lists of one common length and ask again
                    longest = max(len(o.strategies) for o in operand_strats)
                    it = iter(
                        [
                            OpStrategy([o.strategies[j % len(o.strategies)] for j in range(longest)])
                            for o in operand_strats
                        ]
                    )
                    args = tuple(wrap(a) for a in fx_node.args)
                    kwargs = {k: wrap(v) for k, v in fx_node.kwargs.items()}
                    schema = OpSchema(op, args, kwargs, schema_info=self.prop.op_to_schema_info.get(op))
                    result = func(schema)
        except Exception as e:  # noqa: BLE001 - DTensor could not enumerate: replicate
            return self._fallback(node, f"DTensor strategy for {node.target} failed: {type(e).__name__}: {e}")
        if not isinstance(result, OpStrategy):
            return self._fallback(node, f"{node.target}: tuple strategies are not planned yet")

        n_in = len(node.inputs)
        cand_index = [{p: j for j, p in enumerate(c)} for c in cands]
        floats = [
            (info := self.graph[src].outputs[i]) is not None and dtype_from_name(info.dtype).is_floating_point
            for src, i in node.inputs
        ]
        parsed: list[tuple[Strategy, OpSpec]] = []
        any_negative = False
        for spec in result.strategies:
            outs, ins = _spec_list(spec)
            if ins is None:
                ins = tuple(outs[0] for _ in range(n_in))
            if len(ins) != n_in:
                return self._fallback(node, f"{node.target}: operand count mismatch ({len(ins)} vs {n_in})")
            out_pl = tuple(o.placements if o is not None else None for o in outs)
            if len(out_pl) < len(node.outputs):
                out_pl = out_pl + (out_pl[-1],) * (len(node.outputs) - len(out_pl))
            in_pl = tuple(s.placements for s in ins)
            if not (all(_plain(p) for p in in_pl) and all(p is None or _plain(p) for p in out_pl)):
                continue
            if any(
                p not in cand_index[k] and not (floats[k] and _partial_joins(k, in_pl, cands[k]))
                for k, p in enumerate(in_pl)
            ):
                continue  # a partial operand its producer never emits (and that is no bias joining a product)
            ok = all(
                is_even(p, self.graph[src].outputs[i].shape, self.mesh_shape) for p, (src, i) in zip(in_pl, node.inputs)
            ) and all(
                p is None or o is None or is_even(p, o.shape, self.mesh_shape) for p, o in zip(out_pl, node.outputs)
            )
            if not ok:
                continue
            if single is None and spec.redistribute_cost and any(c < 0 for row in spec.redistribute_cost for c in row):
                any_negative = True
            parsed.append((Strategy(out_pl, in_pl, "dtensor"), spec))
        if not parsed:
            return self._fallback(node, f"{node.target}: no evenly sharded strategy on mesh {self.mesh_shape}")

        # fixed points of DTensor's own selection, one per distinct input layout
        chosen: dict[tuple, Strategy] = {}
        if not any_negative:
            for s, _ in parsed:
                chosen[s.ins] = s  # the last one wins, as in _select_min_cost_strategy
        else:
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
        strategies = [s for s in unique_strategies(chosen.values()) if _inputs_available(s, cand_index)]
        strategies += self._own(node)
        if not strategies:
            return self._fallback(node, f"{node.target}: no strategy reachable from its operands")
        return strategies

    def _own(self, node: OpNode) -> list[Strategy]:
        """meshpilot's strategies beside DTensor's, run by meshpilot's runtime (``OWN_OPS``)."""
        fn = _OWN_STRATEGIES.get(node.target)
        return fn(self, node) if fn is not None else []


# -------------------------------------------------------------------- meshpilot-run strategies


def _vocab_parallel_rows(self: StrategyBuilder, node: OpNode, per_axis, colls=None) -> list[Strategy]:
    """Every product over mesh axes of the per-axis rules `per_axis` (lists of (outs, ins) placements) that
    uses the vocabulary-parallel rule (the first of each list) on at least one axis; even shards only.
    ``colls(outs, ins)`` gives the collectives a strategy issues inside the op (``Strategy.colls``)."""
    import itertools

    mesh = self.mesh_shape
    out = []
    for combo in itertools.product(*[per_axis if n > 1 else per_axis[-1:] for n in mesh]):
        if not any(c is per_axis[0] for c in combo):
            continue
        n_out, n_in = len(combo[0][0]), len(combo[0][1])
        outs = tuple(tuple(c[0][k] for c in combo) for k in range(n_out))
        ins = tuple(tuple(c[1][k] for c in combo) for k in range(n_in))
        ok = all(is_even(p, self.graph[src].outputs[i].shape, mesh) for p, (src, i) in zip(ins, node.inputs))
        ok = ok and all(o is None or is_even(p, o.shape, mesh) for p, o in zip(outs, node.outputs))
        if ok:
            out.append(Strategy(outs, ins, "meshpilot", colls=colls(outs, ins) if colls is not None else ()))
    return out


def _embedding_vocab_parallel(self: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``embedding(weight [V, h], ids)`` with the vocabulary sharded (``S(0)`` weight, replicated ids): each
    rank looks up the ids in its rows, zeros the others, and the output is a partial sum (Megatron's
    vocabulary-parallel embedding; DTensor's own version needs a masked partial). Other axes: replicated,
    batch-parallel ids, or the hidden dim sharded, as DTensor does."""
    (w, wi), (ids, ii) = node.inputs
    id_nd = len(self.graph[ids].outputs[ii].shape)
    if node.fx_node is None or self.graph[ids].outputs[ii].dtype not in ("int64", "int32"):
        return []
    rules = [((Partial(),), (Shard(0), Replicate()))]
    rules += [((Shard(d),), (Replicate(), Shard(d))) for d in range(id_nd)]
    rules += [((Shard(id_nd),), (Shard(1), Replicate()))]
    rules += [((Replicate(),), (Replicate(), Replicate()))]
    return _vocab_parallel_rows(self, node, rules)


def _embedding_backward_vocab_parallel(self: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``embedding_dense_backward(grad_out, ids, V, padding_idx, scale_grad_by_freq)`` into a vocabulary-
    sharded gradient: each rank accumulates the rows it holds (the others' ids are masked out)."""
    fx = node.fx_node
    if fx is None or len(fx.args) < 5 or fx.args[4]:  # scale_grad_by_freq needs global counts
        return []
    (g, gi), (ids, ii) = node.inputs
    id_nd = len(self.graph[ids].outputs[ii].shape)
    rules = [((Shard(0),), (Replicate(), Replicate()))]
    rules += [((Partial(),), (Shard(d), Shard(d))) for d in range(id_nd)]
    rules += [((Shard(1),), (Shard(id_nd), Replicate()))]
    rules += [((Replicate(),), (Replicate(), Replicate()))]
    return _vocab_parallel_rows(self, node, rules)


def _float_operands(self: StrategyBuilder, node: OpNode, which: Sequence[int]) -> bool:
    infos = [self.graph[node.inputs[k][0]].outputs[node.inputs[k][1]] for k in which]
    return all(i is not None and dtype_from_name(i.dtype).is_floating_point for i in infos)


def _row_all_reduces(self: StrategyBuilder, info, cls: int, pl: Placements, ops: int) -> tuple[Collective, ...]:
    """`ops` all-reduces per mesh axis sharding the class dim `cls` of `info` (in `pl`), each of one value per
    local row (the other dims as this rank holds them), in the order ``op 0 on every axis, op 1 ...``."""
    mesh = self.mesh_shape
    axes = [a for a, p in enumerate(pl) if isinstance(p, Shard) and p.dim == cls and mesh[a] > 1]
    rows = math.prod(s for d, s in enumerate(info.shape) if d != cls)
    rows //= math.prod(n for p, n in zip(pl, mesh) if isinstance(p, Shard) and p.dim != cls)
    nbytes = rows * dtype_from_name(info.dtype).itemsize
    return tuple(Collective("all_reduce", a, nbytes) for _ in range(ops) for a in axes)


def _class_rules(nd: int, cls: int, n_ops: int):
    """Per-axis rules of an op over the class dim `cls` of `n_ops` same-shaped operands: the class dim
    sharded (first), any other dim sharded (rows, as DTensor does), replicated."""
    rules = [((Shard(cls),), (Shard(cls),) * n_ops)]
    rules += [((Shard(d),), (Shard(d),) * n_ops) for d in range(nd) if d != cls]
    rules += [((Replicate(),), (Replicate(),) * n_ops)]
    return rules


def _log_softmax_vocab_parallel(self: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``_log_softmax(x, dim)`` with the class dim sharded: each rank holds some columns of every row; the
    row max and the row sum of ``exp(x - max)`` are all-reduced (MAX, then SUM) over each axis sharding
    the class dim, one value per local row each, and the output keeps the input's layout (Megatron-LM's
    vocabulary-parallel cross-entropy, first half)."""
    fx = node.fx_node
    out = node.out
    if fx is None or out is None or len(node.inputs) != 1 or fx.args[2] or not _float_operands(self, node, [0]):
        return []
    nd = len(out.shape)
    cls = fx.args[1] % nd
    return _vocab_parallel_rows(
        self, node, _class_rules(nd, cls, 1), lambda outs, ins: _row_all_reduces(self, out, cls, outs[0], 2)
    )


def _log_softmax_backward_vocab_parallel(self: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``_log_softmax_backward_data(g, out, dim)`` = ``g - exp(out) * sum(g, dim)`` with the class dim
    sharded: the row sums of ``g`` are all-reduced (SUM) over each axis sharding it, one value per local row."""
    fx = node.fx_node
    out = node.out
    if fx is None or out is None or len(node.inputs) != 2 or not _float_operands(self, node, [0, 1]):
        return []
    if fx.args[3] != dtype_from_name(out.dtype):  # a half_to_float softmax's backward: not offered
        return []
    nd = len(out.shape)
    cls = fx.args[2] % nd
    return _vocab_parallel_rows(
        self, node, _class_rules(nd, cls, 2), lambda outs, ins: _row_all_reduces(self, out, cls, outs[0], 1)
    )


_MEAN, _SUM = 1, 2  # torch's Reduction enum


def _nll_loss_args_ok(self: StrategyBuilder, node: OpNode, log_probs: int, target: int, weight_arg: int) -> bool:
    """[N, C] float log-probabilities, [N] integer targets, no class weights, reduction mean or sum."""
    fx = node.fx_node
    if fx is None or fx.args[weight_arg] is not None or fx.args[weight_arg + 1] not in (_MEAN, _SUM):
        return False
    lp = self.graph[node.inputs[log_probs][0]].outputs[node.inputs[log_probs][1]]
    tg = self.graph[node.inputs[target][0]].outputs[node.inputs[target][1]]
    return (
        lp is not None
        and tg is not None
        and len(lp.shape) == 2
        and len(tg.shape) == 1
        and dtype_from_name(lp.dtype).is_floating_point
        and tg.dtype in ("int64", "int32")
    )


def _nll_loss_vocab_parallel(self: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``nll_loss_forward(log_probs [N, C], target [N])`` with the classes sharded and the targets replicated
    on that axis: each rank sums the log-probabilities of the targets in its columns (zero elsewhere), so
    the loss is a partial sum over the axis (the edge to its consumer all-reduces one scalar). Rows sharded
    on other axes: the count of non-ignored targets is all-reduced over them inside the op (one scalar per
    axis), so the mean divides by the global count (exact with ignored targets, unlike DTensor's
    ``P(avg)``), the loss is a partial sum there too and ``total_weight`` is replicated everywhere."""
    if len(node.inputs) != 2 or not _nll_loss_args_ok(self, node, 0, 1, 2):
        return []
    lp = self.graph[node.inputs[0][0]].outputs[node.inputs[0][1]]
    nbytes = dtype_from_name(lp.dtype).itemsize
    mesh = self.mesh_shape
    rules = [((Partial(), Replicate()), (Shard(1), Replicate()))]
    rules += [((Partial(), Replicate()), (Shard(0), Shard(0)))]
    rules += [((Replicate(), Replicate()), (Replicate(), Replicate()))]

    def colls(outs, ins):
        rows = [a for a, p in enumerate(ins[1]) if isinstance(p, Shard) and mesh[a] > 1]
        return tuple(Collective("all_reduce", a, nbytes) for a in rows)

    return _vocab_parallel_rows(self, node, rules, colls)


def _nll_loss_backward_vocab_parallel(self: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``nll_loss_backward(g, log_probs, target, ..., total_weight)`` into class-sharded gradients: the only
    non-zero of a row is at its target's column, which one rank holds; no collective. ``g`` and
    ``total_weight`` replicated (scalars); rows may be sharded on other axes."""
    if len(node.inputs) != 4 or not _nll_loss_args_ok(self, node, 1, 2, 3):
        return []
    rules = [((Shard(1),), (Replicate(), Shard(1), Replicate(), Replicate()))]
    rules += [((Shard(0),), (Replicate(), Shard(0), Shard(0), Replicate()))]
    rules += [((Replicate(),), (Replicate(),) * 4)]
    return _vocab_parallel_rows(self, node, rules)


_OWN_STRATEGIES = {
    "aten.embedding.default": _embedding_vocab_parallel,
    "aten.embedding_dense_backward.default": _embedding_backward_vocab_parallel,
    "aten._log_softmax.default": _log_softmax_vocab_parallel,
    "aten._log_softmax_backward_data.default": _log_softmax_backward_vocab_parallel,
    "aten.nll_loss_forward.default": _nll_loss_vocab_parallel,
    "aten.nll_loss_backward.default": _nll_loss_backward_vocab_parallel,
}
OWN_OPS = frozenset(_OWN_STRATEGIES)
"""Ops with meshpilot strategies (source ``meshpilot``) that meshpilot's runtime executes itself."""


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


def _inputs_available(s: Strategy, cand_index: list[dict]) -> bool:
    # strategies whose inputs an operand cannot emit are kept: they are reached by resharding
    return True


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


def _is_tensor_node(a) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)


def _meta_of(v):
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    if isinstance(v, torch.Tensor):
        return TensorMeta(v.shape, v.stride(), v.dtype)
    return None


def _const_key(node: OpNode):
    if node.fx_node is None:
        return None
    return repr(pytree.tree_map_only(torch.fx.Node, lambda _: "T", (node.fx_node.args, node.fx_node.kwargs)))
