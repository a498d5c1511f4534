"""Ops computed independently per sample (and per channel): sharded on those leading dims, on local pieces.

DTensor has no strategy for some image-style kernels that models run on sequences: ``im2col`` (``unfold``;
ConvBERT's span-based convolution) and its inverse ``col2im``, and ``avg_pool2d_backward`` (Funnel's pooling
of the sequence), so their nodes fell back to replicas. Each computes sample ``n`` of its output from sample
``n`` of its inputs only, and the pooling backward also channel ``c`` from channel ``c``: every tensor operand
and the output sharded alike on such a dim (``S(0)``, for the pooling also ``S(1)``) give exactly the local
piece of the output. Batched inputs only (4-D for ``im2col`` and the pooling, 3-D for ``col2im``): an
unbatched call's leading dim is not the sample dim.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

# target -> (the rank of a batched first operand, the dims every operand and the output are independent along)
INDEPENDENT = {
    "aten.im2col.default": (4, (0,)),
    "aten.col2im.default": (3, (0,)),
    "aten.avg_pool2d_backward.default": (4, (0, 1)),
}


def _strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    rank, dims = INDEPENDENT[node.target]
    first = b.graph[node.inputs[0][0]].outputs[node.inputs[0][1]] if node.inputs else None
    if node.out is None or first is None or len(first.shape) != rank:
        return []
    n = len(node.inputs)
    rules = [((Shard(d),), (Shard(d),) * n) for d in dims]
    rules += [((Replicate(),), (Replicate(),) * n)]
    return per_axis_products(b, node, rules, require_first=False)


def _run_local(call: OwnCall, *args, **kwargs):
    """The op on the local samples (every operand holds the same samples and channels)."""
    return call.node.fx_node.target(*args, **kwargs)


OPS = tuple(OwnOp(target, _strategies, _run_local) for target in INDEPENDENT)
