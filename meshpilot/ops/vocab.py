"""Megatron-LM's vocabulary parallelism as meshpilot's own ops: the embedding and the cross-entropy with the
vocabulary (rows of the table, class columns of the logits) sharded over mesh axes.

* ``embedding(weight [V, h], ids)`` with ``S(0)`` rows: each rank looks up the ids in its rows, zeros the
  others, and the output is a partial sum (DTensor's own version needs a masked partial). Backward: each
  rank accumulates the gradient rows it holds.
* ``_log_softmax`` / ``_log_softmax_backward_data`` with the class dim sharded: the row max and the row sum
  of exponentials are all-reduced inside the op (``Strategy.colls``: two all-reduces forward, one backward).
* ``nll_loss_forward`` / ``nll_loss_backward`` with classes sharded and targets replicated on that axis: each
  rank sums the log-probabilities of the targets in its columns, so the loss is a partial sum there. Over the
  axes sharding the rows (a data-parallel loss) the pair ``[s_r, n_r]`` (this rank's summed ``-log p`` of its
  non-ignored targets, their count) is all-reduced as one two-element collective, and the loss is
  ``(Σ_r s_r) / (Σ_r n_r)``, replicated there: the batch's mean, exact with ignored targets, in one collective
  where a partial loss (``s_r / Σ n``) would take two (the count's, then the loss' own to replicate it).
  ``total_weight = Σ n`` is replicated everywhere, all the backward needs.

Offered only where exact: no class weights, reduction mean or sum, [N, C] float log-probabilities, even
shards, no half-to-float softmax. Strategies (planning side) and implementations (``_run_*``, on the local
shards) sit side by side; :data:`OPS` registers them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.graph.capture import OpNode, dtype_from_name
from meshpilot.ops import OwnOp
from meshpilot.sharding.placements import Placements
from meshpilot.sharding.reshard import Collective, CollectiveKind
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

# ----------------------------------------------------------------------------------------- strategies


def _embedding_vocab_parallel(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``embedding(weight [V, h], ids)`` with the vocabulary sharded (``S(0)`` weight, replicated ids): each
    rank looks up the ids in its rows, zeros the others, and the output is a partial sum (Megatron's
    vocabulary-parallel embedding; DTensor's own version needs a masked partial). Other axes: replicated,
    batch-parallel ids, or the hidden dim sharded, as DTensor does."""
    (w, wi), (ids, ii) = node.inputs
    id_nd = len(b.graph[ids].outputs[ii].shape)
    if node.fx_node is None or b.graph[ids].outputs[ii].dtype not in ("int64", "int32"):
        return []
    rules = [((Partial(),), (Shard(0), Replicate()))]
    rules += [((Shard(d),), (Replicate(), Shard(d))) for d in range(id_nd)]
    rules += [((Shard(id_nd),), (Shard(1), Replicate()))]
    rules += [((Replicate(),), (Replicate(), Replicate()))]
    return per_axis_products(b, node, rules)


def _embedding_backward_vocab_parallel(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``embedding_dense_backward(grad_out, ids, V, padding_idx, scale_grad_by_freq)`` into a vocabulary-
    sharded gradient: each rank accumulates the rows it holds (the others' ids are masked out)."""
    fx = node.fx_node
    if fx is None or len(fx.args) < 5 or fx.args[4]:  # scale_grad_by_freq needs global counts
        return []
    (g, gi), (ids, ii) = node.inputs
    id_nd = len(b.graph[ids].outputs[ii].shape)
    rules = [((Shard(0),), (Replicate(), Replicate()))]
    rules += [((Partial(),), (Shard(d), Shard(d))) for d in range(id_nd)]
    rules += [((Shard(1),), (Shard(id_nd), Replicate()))]
    rules += [((Replicate(),), (Replicate(), Replicate()))]
    return per_axis_products(b, node, rules)


def _float_operands(b: StrategyBuilder, node: OpNode, which: Sequence[int]) -> bool:
    infos = [b.graph[node.inputs[k][0]].outputs[node.inputs[k][1]] for k in which]
    return all(i is not None and dtype_from_name(i.dtype).is_floating_point for i in infos)


def _row_all_reduces(b: StrategyBuilder, info, cls: int, pl: Placements, ops: int) -> tuple[Collective, ...]:
    """`ops` all-reduces per mesh axis sharding the class dim `cls` of `info` (in `pl`), each of one value per
    local row (the other dims as this rank holds them), in the order ``op 0 on every axis, op 1 ...``."""
    mesh = b.mesh_shape
    axes = [a for a, p in enumerate(pl) if isinstance(p, Shard) and p.dim == cls and mesh[a] > 1]
    rows = math.prod(s for d, s in enumerate(info.shape) if d != cls)
    rows //= math.prod(n for p, n in zip(pl, mesh) if isinstance(p, Shard) and p.dim != cls)
    nbytes = rows * dtype_from_name(info.dtype).itemsize
    return tuple(Collective(CollectiveKind.ALL_REDUCE, a, nbytes) for _ in range(ops) for a in axes)


def _class_rules(nd: int, cls: int, n_ops: int):
    """Per-axis rules of an op over the class dim `cls` of `n_ops` same-shaped operands: the class dim
    sharded (first), any other dim sharded (rows, as DTensor does), replicated."""
    rules = [((Shard(cls),), (Shard(cls),) * n_ops)]
    rules += [((Shard(d),), (Shard(d),) * n_ops) for d in range(nd) if d != cls]
    rules += [((Replicate(),), (Replicate(),) * n_ops)]
    return rules


def _log_softmax_vocab_parallel(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``_log_softmax(x, dim)`` with the class dim sharded: each rank holds some columns of every row; the
    row max and the row sum of ``exp(x - max)`` are all-reduced (MAX, then SUM) over each axis sharding
    the class dim, one value per local row each, and the output keeps the input's layout (Megatron-LM's
    vocabulary-parallel cross-entropy, first half)."""
    fx = node.fx_node
    out = node.out
    if fx is None or out is None or len(node.inputs) != 1 or fx.args[2] or not _float_operands(b, node, [0]):
        return []
    nd = len(out.shape)
    cls = fx.args[1] % nd
    return per_axis_products(
        b, node, _class_rules(nd, cls, 1), lambda outs, ins: _row_all_reduces(b, out, cls, outs[0], 2)
    )


def _log_softmax_backward_vocab_parallel(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``_log_softmax_backward_data(g, out, dim)`` = ``g - exp(out) * sum(g, dim)`` with the class dim
    sharded: the row sums of ``g`` are all-reduced (SUM) over each axis sharding it, one value per local row."""
    fx = node.fx_node
    out = node.out
    if fx is None or out is None or len(node.inputs) != 2 or not _float_operands(b, node, [0, 1]):
        return []
    if fx.args[3] != dtype_from_name(out.dtype):  # a half_to_float softmax's backward: not offered
        return []
    nd = len(out.shape)
    cls = fx.args[2] % nd
    return per_axis_products(
        b, node, _class_rules(nd, cls, 2), lambda outs, ins: _row_all_reduces(b, out, cls, outs[0], 1)
    )


_MEAN, _SUM = 1, 2  # torch's Reduction enum


def _nll_loss_args_ok(b: StrategyBuilder, node: OpNode, log_probs: int, target: int, weight_arg: int) -> bool:
    """[N, C] float log-probabilities, [N] integer targets, no class weights, reduction mean or sum."""
    fx = node.fx_node
    if fx is None or fx.args[weight_arg] is not None or fx.args[weight_arg + 1] not in (_MEAN, _SUM):
        return False
    lp = b.graph[node.inputs[log_probs][0]].outputs[node.inputs[log_probs][1]]
    tg = b.graph[node.inputs[target][0]].outputs[node.inputs[target][1]]
    return (
        lp is not None
        and tg is not None
        and len(lp.shape) == 2
        and len(tg.shape) == 1
        and dtype_from_name(lp.dtype).is_floating_point
        and tg.dtype in ("int64", "int32")
    )


def _nll_loss_vocab_parallel(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``nll_loss_forward(log_probs [N, C], target [N])`` with the classes sharded and the targets replicated
    on that axis: each rank sums the log-probabilities of the targets in its columns (zero elsewhere), so
    the loss is a partial sum over the axis (the edge to its consumer all-reduces one scalar). Rows sharded
    on other axes, or on every axis with the classes whole (a data-parallel loss): the summed loss and the
    count of non-ignored targets are all-reduced over them together inside the op (one two-scalar
    collective per axis, :func:`_loss_reductions`), so the loss is the batch's mean, replicated there (exact
    with ignored targets, unlike DTensor's ``P(avg)``), and ``total_weight`` is replicated everywhere."""
    if len(node.inputs) != 2 or not _nll_loss_args_ok(b, node, 0, 1, 2):
        return []
    lp = b.graph[node.inputs[0][0]].outputs[node.inputs[0][1]]
    itemsize = dtype_from_name(lp.dtype).itemsize
    mesh = b.mesh_shape
    rules = [((Partial(), Replicate()), (Shard(1), Replicate()))]
    rules += [((Replicate(), Replicate()), (Shard(0), Shard(0)))]
    rules += [((Replicate(), Replicate()), (Replicate(), Replicate()))]

    def colls(outs, ins):
        joint, count = _loss_reductions(outs[0], ins[1], lambda a: mesh[a] > 1)
        return tuple(Collective(CollectiveKind.ALL_REDUCE, a, 2 * itemsize) for a in joint) + tuple(
            Collective(CollectiveKind.ALL_REDUCE, a, itemsize) for a in count
        )

    # and rows sharded with the classes whole: DTensor's own row-sharded mean is P(avg), which
    # ``sharding.strategies.AVG_INEXACT`` drops
    return per_axis_products(b, node, rules, colls) + per_axis_products(b, node, rules[1:], colls)


def _loss_reductions(loss: Placements, target: Placements, multi) -> tuple[list[int], list[int]]:
    """The mesh axes (of more than one device, ``multi(a)``) sharding the targets' rows, split by the loss'
    layout there: (replicated: the summed loss and the count all-reduced together as two scalars; partial: the
    count alone, the loss left a partial sum — a plan from before the joint rule), each in axis order, the
    order the op issues them."""
    rows = [a for a, p in enumerate(target) if isinstance(p, Shard) and p.dim == 0 and multi(a)]
    joint = [a for a in rows if isinstance(loss[a], Replicate)]
    return joint, [a for a in rows if a not in joint]


def _nll_loss_backward_vocab_parallel(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``nll_loss_backward(g, log_probs, target, ..., total_weight)`` into class-sharded gradients: the only
    non-zero of a row is at its target's column, which one rank holds; no collective. ``g`` and
    ``total_weight`` replicated (scalars); rows may be sharded on other axes, or on every axis with the classes
    whole: the data-parallel loss' backward, each rank writing its own rows (``g`` and ``total_weight`` are the
    batch's, replicated by the forward's joint all-reduce), as DDP does. Without it a row-sharded loss'
    backward was replicated: it gathered the saved log-probabilities and wrote the whole ``[N, C]`` gradient on
    every rank (issue 30)."""
    if len(node.inputs) != 4 or not _nll_loss_args_ok(b, node, 1, 2, 3):
        return []
    rules = [((Shard(1),), (Replicate(), Shard(1), Replicate(), Replicate()))]
    rules += [((Shard(0),), (Replicate(), Shard(0), Shard(0), Replicate()))]
    rules += [((Replicate(),), (Replicate(),) * 4)]
    return per_axis_products(b, node, rules) + per_axis_products(b, node, rules[1:])


# ------------------------------------------------------------------------------------- implementations


def _run_embedding(call, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Vocabulary-parallel lookup: this rank's rows for the ids it holds, zeros elsewhere (a partial sum)."""
    off, rows = call.local_range(call.global_shape(0), call.ins[0], 0)
    mask = (ids >= off) & (ids < off + rows)
    out = torch.ops.aten.embedding.default(weight, torch.where(mask, ids - off, torch.zeros_like(ids)))
    return out * mask.unsqueeze(-1).to(out.dtype)


def _run_embedding_backward(call, grad, ids, num_weights, padding_idx, scale_grad_by_freq):
    """The gradient rows this rank holds: other ranks' ids contribute nothing here."""
    hidden = call.node.out.shape[1]
    off, rows = call.local_range((num_weights, hidden), call.outs[0], 0)
    mask = (ids >= off) & (ids < off + rows)
    grad = grad * mask.unsqueeze(-1).to(grad.dtype)
    pad = padding_idx - off if 0 <= padding_idx - off < rows and padding_idx >= 0 else -1
    local_ids = torch.where(mask, ids - off, torch.zeros_like(ids))
    return torch.ops.aten.embedding_dense_backward.default(grad, local_ids, rows, pad, scale_grad_by_freq)


def _run_log_softmax(call, x, dim, half_to_float):
    """log_softmax over a class dim sharded on some mesh axes: the row max and the row sum of exponentials
    are all-reduced (MAX, then SUM) over those axes; the output keeps the input's layout."""
    cls = dim % x.dim()
    axes = call.sharding_axes(call.ins[0], cls)
    m = call.all_reduce(x.amax(dim=cls, keepdim=True), "max", axes)
    shifted = x - m
    s = call.all_reduce(shifted.exp().sum(dim=cls, keepdim=True), "sum", axes)
    return shifted - s.log()


def _run_log_softmax_backward(call, grad, out, dim, input_dtype):
    """``grad - exp(out) * sum(grad, dim)``, the row sums of `grad` all-reduced over the class-sharding axes."""
    cls = dim % grad.dim()
    axes = call.sharding_axes(call.ins[0], cls)
    s = call.all_reduce(grad.sum(dim=cls, keepdim=True), "sum", axes)
    return (grad - out.exp() * s).to(input_dtype)


def _local_targets(call, target, ignore_index, lp_layout, lp_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's column of each target, or 0; whether the target is in its columns and not ignored)."""
    off, cols = call.local_range(lp_shape, lp_layout, 1)
    mine = (target >= off) & (target < off + cols) & (target != ignore_index)
    return torch.where(mine, target - off, torch.zeros_like(target)), mine


def _run_nll_loss(call, lp, target, weight, reduction, ignore_index):
    """Minus the sum of the targets' log-probabilities held here (a partial sum over the class-sharding axes),
    divided for the mean by the count of non-ignored targets: whole over the class-sharding axes (targets
    are replicated there); over the row-sharding axes where the loss is planned replicated, the sum and the
    count all-reduced together as one ``[2]`` tensor (:func:`_loss_reductions`), over any where it is planned
    partial, the count alone."""
    lp_shape = call.global_shape(0)
    local, mine = _local_targets(call, target, ignore_index, call.ins[0], lp_shape)
    picked = lp.gather(1, local.unsqueeze(1)).squeeze(1)
    loss = -(picked * mine.to(lp.dtype)).sum()
    total = (target != ignore_index).sum().to(lp.dtype)
    joint, count = _loss_reductions(call.outs[0], call.ins[1], lambda a: call.mesh.size(a) > 1)
    if joint:
        loss, total = call.all_reduce(torch.stack((loss, total)), "sum", joint).unbind()
    total = call.all_reduce(total, "sum", count)
    return (loss / total if reduction == 1 else loss), total


def _run_nll_loss_backward(call, grad, lp, target, weight, reduction, ignore_index, total):
    """The gradient columns held here: ``-grad`` (``/ total_weight`` for the mean) at each row's target
    column if this rank holds it; zeros elsewhere. No collective."""
    lp_shape = call.global_shape(1)
    local, mine = _local_targets(call, target, ignore_index, call.ins[1], lp_shape)
    g = -grad / total if reduction == 1 else -grad
    out = torch.zeros_like(lp)
    return out.scatter_(1, local.unsqueeze(1), (g * mine.to(lp.dtype)).unsqueeze(1))


OPS = (
    OwnOp("aten.embedding.default", _embedding_vocab_parallel, _run_embedding),
    OwnOp("aten.embedding_dense_backward.default", _embedding_backward_vocab_parallel, _run_embedding_backward),
    OwnOp("aten._log_softmax.default", _log_softmax_vocab_parallel, _run_log_softmax),
    OwnOp("aten._log_softmax_backward_data.default", _log_softmax_backward_vocab_parallel, _run_log_softmax_backward),
    OwnOp("aten.nll_loss_forward.default", _nll_loss_vocab_parallel, _run_nll_loss),
    OwnOp("aten.nll_loss_backward.default", _nll_loss_backward_vocab_parallel, _run_nll_loss_backward),
)
