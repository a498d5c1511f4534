"""Ops whose output takes only the *shape* of one operand: ``fill`` and the functional ``copy``.

A functional graph writes ``x[..., 0] = start`` (T5's ``_shift_right``) and a gated activation's backward as
``fill(x, v)`` (a tensor of ``x``'s shape, every element ``v``) and ``copy(dst, src)`` (``src``'s values in
``dst``'s shape and dtype). DTensor has no strategy for either. Both are exact on local shards in any layout
of the shape operand, since its values are not read: per mesh axis the output takes the operand's shard
(``S(d) → S(d)``), a replica stays a replica, and a partial operand gives a replicated output (filling a
partial sum would be wrong; filling each rank's full-size piece with ``v`` is the replicated result). For
``copy`` the source must be laid out as the output (same shape only; a broadcast source is not offered).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

aten = torch.ops.aten


def _fill_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    x = node.out
    if x is None:
        return []
    extra = (Replicate(),) * (len(node.inputs) - 1)  # fill.Tensor's 0-d value: replicated
    rules = [((Shard(d),), (Shard(d), *extra)) for d in range(len(x.shape))]
    rules += [((Replicate(),), (Partial(), *extra))]
    rules += [((Replicate(),), (Replicate(), *extra))]
    return per_axis_products(b, node, rules, require_first=False)


def _copy_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    out = node.out
    if out is None or len(node.inputs) != 2:
        return []
    src = b.graph[node.inputs[1][0]].outputs[node.inputs[1][1]]
    if src is None or src.shape != out.shape:
        return []
    rules = [((Shard(d),), (Shard(d), Shard(d))) for d in range(len(out.shape))]
    rules += [((Replicate(),), (Replicate(), Replicate()))]
    return per_axis_products(b, node, rules, require_first=False)


def _run_local(call: OwnCall, *args, **kwargs):
    """The op itself on the local pieces (the layouts already agree)."""
    return call.node.fx_node.target(*args, **kwargs)


OPS = (
    OwnOp("aten.fill.Scalar", _fill_strategies, _run_local),
    OwnOp("aten.fill.Tensor", _fill_strategies, _run_local),
    OwnOp("aten.copy.default", _copy_strategies, _run_local),
)
