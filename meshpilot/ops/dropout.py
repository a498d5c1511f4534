"""Dropout exact under any sharding: every rank draws the mask of the *whole* tensor and keeps its block.

``native_dropout(x, p, train) -> (out, mask)`` draws ``mask`` from the default generator. Run shard by shard
(DTensor's way on a CPU mesh, or its offset-based generator on CUDA), each rank's mask is a fresh draw, not
the block of the mask one device would have drawn: training under a plan would differ from training on one
device, and from the same model under another plan. Here each rank draws ``native_dropout`` of a tensor of
the global shape — the same generator calls, in the same order, as the single device — and keeps the block
its planned layout holds; ``out = x · mask · 1/(1-p)`` as the ATen kernel computes it. Every rank must start
the step with the same generator state (same seed, as every SPMD launch assumes;
:func:`meshpilot.runtime.spmd.parallelize` checks it when a plan holds random ops).

The price is one full-size mask per rank and call (a bool tensor of the activation's global shape, plus
the ones it is drawn from), which the plan's memory does not count; it is planned as exclusive (DTensor's
strategies are not offered). Strategies, per mesh axis: the input sharded on any dim (mask and output the
same), a partial input (dropout is linear given the mask: output partial, mask replicated), replicated.

``exponential``, ``uniform``, ``rand_like`` and ``randn_like`` (``torch.empty_like(x).exponential_()``,
``torch.rand_like(x) > 0.75``: PhiMoE's Gumbel sampling of experts in training) are drawn the same way: the
whole tensor on every rank, each keeping its block (DTensor's ``rand_like`` on a shard draws the shard alone,
another number of values than the single device, which shifts every later draw); their operand's values are
not read, so any layout of it gives that layout's block.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

aten = torch.ops.aten


def _strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    x = node.out
    if x is None:
        return []
    rules = [((Shard(d), Shard(d)), (Shard(d),)) for d in range(len(x.shape))]
    rules += [((Partial(), Replicate()), (Partial(),))]
    rules += [((Replicate(), Replicate()), (Replicate(),))]
    return per_axis_products(b, node, rules, require_first=False)


def _run(call: OwnCall, x: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    shape = call.global_shape(0)
    if not train or tuple(x.shape) == tuple(shape):
        return aten.native_dropout(x, p, train)  # the whole tensor is here: the single device's call
    _, mask = aten.native_dropout(torch.ones(shape, dtype=x.dtype, device=x.device), p, True)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    keep = mask[call.local_slices(shape, call.ins[0])]
    out = x.mul(keep).mul_(scale)
    return out, mask[call.local_slices(shape, call.outs[1])]


def _drawn_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    x = node.out
    if x is None or len(node.inputs) != 1:
        return []
    rules = [((Shard(d),), (Shard(d),)) for d in range(len(x.shape))]
    rules += [((Replicate(),), (Replicate(),))]
    return per_axis_products(b, node, rules, require_first=False)


def _run_drawn(call: OwnCall, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The draw (``exponential``, ``uniform``, ``rand_like``, …) of the whole tensor, this rank's block kept."""
    draw = call.node.fx_node.target
    shape = call.global_shape(0)
    if tuple(x.shape) == tuple(shape):
        return draw(x, *args, **kwargs)  # the whole tensor is here: the single device's call
    whole = draw(torch.empty(shape, dtype=x.dtype, device=x.device), *args, **kwargs)
    return whole[call.local_slices(shape, call.outs[0])]


OPS = (
    OwnOp("aten.native_dropout.default", _strategies, _run, exclusive=True),
    OwnOp("aten.exponential.default", _drawn_strategies, _run_drawn, exclusive=True),
    OwnOp("aten.uniform.default", _drawn_strategies, _run_drawn, exclusive=True),
    OwnOp("aten.rand_like.default", _drawn_strategies, _run_drawn, exclusive=True),
    OwnOp("aten.randn_like.default", _drawn_strategies, _run_drawn, exclusive=True),
)
