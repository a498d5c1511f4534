"""``Tensor.unfold`` (sliding windows along one dim) and its backward, sharded on any other dim.

``x.unfold(dim, size, step)`` views `x` as windows: `dim` becomes the window count and a new last dim of
``size`` holds each window (Inkling2's short convolution over the sequence). DTensor has no strategy for it
nor for ``unfold_backward``, so both fell back to a replica. Along every dim but `dim` the op copies
elementwise, so a rank holding a block of `x` on such a dim computes exactly that block of the windows.

Per mesh axis: ``unfold``: ``S(d)`` for ``d ≠ dim`` gives ``S(d)`` (the new dim is last, so ``d`` keeps its
index), ``R`` gives ``R``; ``unfold_backward(grad, input_sizes, dim, size, step)``: ``S(d)`` gives ``S(d)``,
``R`` gives ``R``. The backward takes the input's sizes as constants, the global ones in the captured graph:
the local call is given the local block's (:func:`_local_sizes`).
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

FORWARD = "aten.unfold.default"
BACKWARD = "aten.unfold_backward.default"


def _strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """Rules for both ops: the unfolded dim whole, any other dim sharded alike on operand and output."""
    out = node.out
    if out is None or len(node.inputs) != 1:
        return []
    backward = str(node.fx_node.target) == BACKWARD
    rank = len(out.shape) if backward else len(out.shape) - 1  # the input's dims (the windows add one)
    dim = node.fx_node.args[2 if backward else 1] % max(rank, 1)
    rules = [((Shard(d),), (Shard(d),)) for d in range(rank) if d != dim]
    rules += [((Replicate(),), (Replicate(),))]
    return per_axis_products(b, node, rules, require_first=False)


def _local_sizes(grad, sizes, dim: int) -> list[int]:
    """`sizes` (the whole input's) with every dim but `dim` taken from the local gradient block."""
    dim %= len(sizes)
    return [s if d == dim else grad.shape[d] for d, s in enumerate(sizes)]


def _run_forward(call: OwnCall, *args, **kwargs):
    """``unfold`` of the local block (whole along the unfolded dim)."""
    return call.node.fx_node.target(*args, **kwargs)


def _run_backward(call: OwnCall, grad, sizes, dim, size, step):
    """``unfold_backward`` of the local gradient block into the local input block's sizes."""
    return call.node.fx_node.target(grad, _local_sizes(grad, sizes, dim), dim, size, step)


OPS = (OwnOp(FORWARD, _strategies, _run_forward), OwnOp(BACKWARD, _strategies, _run_backward))
