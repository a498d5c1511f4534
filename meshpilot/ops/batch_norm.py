"""Training BatchNorm with the batch (or any non-channel dim) sharded, exact: statistics over the whole batch.

DTensor shards BatchNorm on the channel dim only. meshpilot plans the training op of the captured (functional)
graph itself, as ``SyncBatchNorm`` computes it. For ``x [N, C, *]`` sharded on non-channel dims over some mesh
axes, with ``n`` = elements per channel in the whole tensor:

forward  ``_native_batch_norm_legit_functional(x, w, b, running_mean, running_var, training, momentum, eps)``
    ``s1 = Σ x`` per channel, all-reduced over those axes → ``mean = s1 / n``;
    ``s2 = Σ (x − mean)²`` all-reduced → ``var = s2 / n``, ``invstd = 1 / √(var + eps)``;
    ``out = (x − mean) · invstd · w + b``;
    ``running_mean ← (1 − momentum) · running_mean + momentum · mean``,
    ``running_var ← (1 − momentum) · running_var + momentum · s2 / (n − 1)`` (unbiased, as torch does).
    Two all-reduces of C fp32 values per axis (the centred sum needs the mean: two passes, as one device
    computes it, not the cancellation-prone ``E[x²] − E[x]²``).
backward ``native_batch_norm_backward(dy, x, w, …, save_mean, save_invstd, train, eps, mask)``
    ``Σ dy`` and ``Σ dy · (x − mean)`` per channel, stacked into one all-reduce of 2C values per axis;
    ``dx = (dy − Σdy / n − (x − mean) · invstd² · Σdy(x−mean) / n) · invstd · w``,
    ``dw = Σdy(x−mean) · invstd``, ``db = Σdy`` (replicated).

The in-op all-reduces are ``Strategy.colls`` (priced by the ILP, listed in the plan, counted at run time).
Strategies, per mesh axis: a non-channel dim sharded (the above), the channel dim sharded (each rank its
channels, no communication), replicated. Both ops are exclusive: DTensor's channel-only strategies are among
these. The running statistics are outputs of the functional graph that the runtime writes back into the
module's buffers (``OpGraph.buffer_updates``), so eval mode later sees what one device would have.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.reshard import Collective, CollectiveKind
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

aten = torch.ops.aten
_F32 = 4


def _stat_axes(x_layout, mesh_shape) -> list[int]:
    """Axes (of more than one device) that shard a non-channel dim of the input."""
    return [a for a, p in enumerate(x_layout) if isinstance(p, Shard) and p.dim != 1 and mesh_shape[a] > 1]


def _local_channels(x_layout, channels: int, mesh_shape) -> int:
    return channels // math.prod(n for p, n in zip(x_layout, mesh_shape) if isinstance(p, Shard) and p.dim == 1)


def _rules(nd: int, n_outs: int, channel_outs: tuple, n_channel_ins: int, n_tensor_ins: int, stats=None):
    """Per-axis rules for an op over ``[N, C, *]`` tensors (the first `n_tensor_ins` operands) and per-channel
    ``[C]`` tensors (the rest): a non-channel dim sharded (per-channel outputs in layout `stats`), the channel
    dim sharded, replicated."""
    stats = stats if stats is not None else Replicate()
    rules = []
    for d in (d for d in range(nd) if d != 1):
        outs = (Shard(d),) + (stats,) * (n_outs - 1)
        rules.append((outs, (Shard(d),) * n_tensor_ins + (Replicate(),) * n_channel_ins))
    rules.append((channel_outs, (Shard(1),) * n_tensor_ins + (Shard(0),) * n_channel_ins))
    rules.append(((Replicate(),) * n_outs, (Replicate(),) * (n_tensor_ins + n_channel_ins)))
    return rules


def _with_absent_outputs(node: OpNode, strategies: list[Strategy]) -> list[Strategy]:
    """Outputs the op does not compute (``output_mask``) carry no layout."""
    if all(o is not None for o in node.outputs):
        return strategies
    return [
        Strategy(
            tuple(p if o is not None else None for p, o in zip(s.outs, node.outputs)),
            s.ins,
            s.source,
            colls=s.colls,
        )
        for s in strategies
    ]


def _forward_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    x = b.graph[node.inputs[0][0]].outputs[node.inputs[0][1]]
    if x is None or len(x.shape) < 2 or node.fx_node is None:
        return []
    mesh, training = b.mesh_shape, bool(node.fx_node.args[5])
    rules = _rules(len(x.shape), 5, (Shard(1),) + (Shard(0),) * 4, len(node.inputs) - 1, 1)

    def colls(outs, ins):
        if not training:  # normalised by the running statistics: element-wise, nothing to reduce
            return ()
        per = _local_channels(ins[0], x.shape[1], mesh) * _F32
        axes = _stat_axes(ins[0], mesh)
        return tuple(Collective(CollectiveKind.ALL_REDUCE, a, per) for _ in range(2) for a in axes)

    return per_axis_products(b, node, rules, colls, require_first=False)


def _backward_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    x = b.graph[node.inputs[1][0]].outputs[node.inputs[1][1]]
    if x is None or len(x.shape) < 2 or node.fx_node is None:
        return []
    mesh, train = b.mesh_shape, bool(node.fx_node.args[7])
    # eval: the batch statistics are not reduced inside the op, so the parameter gradients are partial sums
    stats = Replicate() if train else Partial()
    rules = _rules(len(x.shape), 3, (Shard(1), Shard(0), Shard(0)), len(node.inputs) - 2, 2, stats)

    def colls(outs, ins):
        if not train:
            return ()
        per = 2 * _local_channels(ins[1], x.shape[1], mesh) * _F32
        return tuple(Collective(CollectiveKind.ALL_REDUCE, a, per) for a in _stat_axes(ins[1], mesh))

    return _with_absent_outputs(node, per_axis_products(b, node, rules, colls, require_first=False))


def _count(call: OwnCall, x_arg: int) -> int:
    shape = call.global_shape(x_arg)
    return math.prod(shape) // shape[1]


def _per_channel(t: torch.Tensor, nd: int) -> torch.Tensor:
    return t.view(1, -1, *([1] * (nd - 2)))


def _run_forward(call: OwnCall, x, weight, bias, running_mean, running_var, training, momentum, eps):
    axes = _stat_axes(call.ins[0], call.mesh.shape)
    if not axes or not training:  # this rank holds whole channels: the op as one device runs it
        return aten._native_batch_norm_legit_functional(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
    n = _count(call, 0)
    dims = [0, *range(2, x.dim())]
    mean = call.all_reduce(x.sum(dims, dtype=torch.float32), "sum", axes) / n  # [C]
    xc = x.float() - _per_channel(mean, x.dim())
    s2 = call.all_reduce((xc * xc).sum(dims), "sum", axes)
    invstd = torch.rsqrt(s2 / n + eps)
    out = xc * _per_channel(invstd, x.dim())
    if weight is not None:
        out = out * _per_channel(weight, x.dim())
    if bias is not None:
        out = out + _per_channel(bias, x.dim())
    new_mean = running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum
    new_var = running_var * (1 - momentum) + (s2 / (n - 1)).to(running_var.dtype) * momentum
    return out.to(x.dtype), mean, invstd, new_mean, new_var


def _run_backward(call: OwnCall, dy, x, weight, rmean, rvar, save_mean, save_invstd, train, eps, mask):
    axes = _stat_axes(call.ins[1], call.mesh.shape)
    if not axes or not train:
        return aten.native_batch_norm_backward(dy, x, weight, rmean, rvar, save_mean, save_invstd, train, eps, mask)
    n = _count(call, 1)
    nd, dims = x.dim(), [0, *range(2, x.dim())]
    xc = x.float() - _per_channel(save_mean, nd)
    dyf = dy.float()
    sums = call.all_reduce(torch.stack([dyf.sum(dims), (dyf * xc).sum(dims)]), "sum", axes)  # [2, C]
    sum_dy, sum_dy_xc = sums[0], sums[1]
    grad_x = grad_w = grad_b = None
    if mask[0]:
        k = _per_channel(save_invstd, nd)
        g = (dyf - _per_channel(sum_dy / n, nd) - xc * k * k * _per_channel(sum_dy_xc / n, nd)) * k
        if weight is not None:
            g = g * _per_channel(weight.float(), nd)
        grad_x = g.to(x.dtype)
    if mask[1]:
        grad_w = (sum_dy_xc * save_invstd).to(weight.dtype if weight is not None else x.dtype)
    if mask[2]:
        grad_b = sum_dy.to(weight.dtype if weight is not None else x.dtype)
    return grad_x, grad_w, grad_b


OPS = (
    OwnOp("aten._native_batch_norm_legit_functional.default", _forward_strategies, _run_forward, exclusive=True),
    OwnOp("aten.native_batch_norm_backward.default", _backward_strategies, _run_backward, exclusive=True),
)
