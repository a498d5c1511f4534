"""``stack``: operands laid out alike, joined along a new dim, on the local pieces.

DTensor's strategy for ``aten.stack`` follows the first operand's layouts. Where the operands come from
producers with no layout in common, none of its strategies is reachable and the node fell back to a replica:
the generic ``associative_scan`` that Mamba-style mixers run on CPU (Jamba, Falcon-Mamba) interleaves its odd
and even partial scans with ``stack([even, odd], dim + 1)``, the even ones out of a ``cat``, the odd ones out
of strided slices.

Here every operand takes one layout and the output takes it too, a tensor dim at or after the new one moved
up by one: on each mesh axis all operands ``S(d)`` give ``S(d)`` for ``d < dim`` and ``S(d + 1)`` otherwise,
all ``R`` give ``R``. Stacking the local pieces is then exactly the local piece of the stacked tensor (each
rank holds the same block of every operand, and the new dim is whole on every rank). The planner prices the
resharding into that common layout on each incoming edge.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products


def _stack_dim(node: OpNode, rank: int) -> int:
    """The new dim of ``stack(tensors, dim=0)``, normalised to ``0 ≤ dim ≤ rank``."""
    fx = node.fx_node
    dim = fx.args[1] if len(fx.args) > 1 else fx.kwargs.get("dim", 0)
    return dim + rank + 1 if dim < 0 else dim


def _stack_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    out = node.out
    if out is None or not node.inputs:
        return []
    rank = len(out.shape) - 1
    dim = _stack_dim(node, rank)
    n = len(node.inputs)
    rules = [((Shard(d if d < dim else d + 1),), (Shard(d),) * n) for d in range(rank)]
    rules += [((Replicate(),), (Replicate(),) * n)]
    return per_axis_products(b, node, rules, require_first=False)


def _run_local(call: OwnCall, *args, **kwargs):
    """``stack`` of the local pieces (every operand already in the planned common layout)."""
    return call.node.fx_node.target(*args, **kwargs)


OPS = (OwnOp("aten.stack.default", _stack_strategies, _run_local),)
