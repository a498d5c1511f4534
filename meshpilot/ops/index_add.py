"""``index_add``: rows added at indices along one dim, sharded on any other dim.

``index_add(self, dim, index, source)`` adds ``source``'s slices along `dim` into ``self`` at ``index``; it is
``index_select``'s backward (XLNet's relative shift selects along its key dim). DTensor has no strategy for it,
so the node fell back to a replica. Along every dim but `dim` the op is elementwise: a rank holding the same
block of ``self`` and ``source`` on such a dim (and the whole ``index``) computes exactly that block of the
output. Per mesh axis: ``self`` and ``source`` ``S(d)`` for ``d ≠ dim`` give ``S(d)``; all ``R`` give ``R``.

``scatter_reduce(self, dim, index, src, reduce)`` (TAPAS's segment means) is the same along the dims where
``self``, ``index`` and ``src`` have one size: each position there scatters within itself, so the three
sharded alike on such a dim give that block of the output.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products


def _strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    out = node.out
    if out is None or len(node.inputs) != 3:
        return []
    rank = len(out.shape)
    dim = node.fx_node.args[1] % max(rank, 1)
    rules = [((Shard(d),), (Shard(d), Replicate(), Shard(d))) for d in range(rank) if d != dim]
    rules += [((Replicate(),), (Replicate(), Replicate(), Replicate()))]
    return per_axis_products(b, node, rules, require_first=False)


def _run_local(call: OwnCall, *args, **kwargs):
    """``index_add`` of the local blocks (``self`` and ``source`` alike, ``index`` whole)."""
    return call.node.fx_node.target(*args, **kwargs)


def _scatter_reduce_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    out = node.out
    if out is None or len(node.inputs) != 3:
        return []
    shapes = [b.graph[src].outputs[i].shape for src, i in node.inputs]
    rank = len(out.shape)
    dim = node.fx_node.args[1] % max(rank, 1)
    same = [d for d in range(rank) if d != dim and all(len(s) == rank and s[d] == out.shape[d] for s in shapes)]
    rules = [((Shard(d),), (Shard(d), Shard(d), Shard(d))) for d in same]
    rules += [((Replicate(),), (Replicate(), Replicate(), Replicate()))]
    return per_axis_products(b, node, rules, require_first=False)


OPS = (
    OwnOp("aten.index_add.default", _strategies, _run_local),
    OwnOp("aten.scatter_reduce.two", _scatter_reduce_strategies, _run_local),
)
