"""Causal attention (``is_causal``) sharded by query rows: the all-gather method of context parallelism for the
calls :mod:`meshpilot.ops.attention` cannot shard so.

A call with ``is_causal=True`` masks by the kernel's local row index, so DTensor's query-row strategy would mask
each rank's chunk as if it began at position 0 (:func:`meshpilot.ops.attention.sequence_parallel` refuses it).
This own op knows where its rows begin (``OwnCall.local_range``): rank ``r`` holds query rows ``[o, o + l)`` of
``t`` (``o = r·l``), keys and values whole (all-gathered by the resharding, as for the masked calls), and its
rows see keys ``[0, o + l)`` only. It runs the device's kernel on two blocks and merges them exactly:

* ``A``: rows ``[o, o + l)`` against keys ``[0, o)``, every key visible (no mask);
* ``B``: rows ``[o, o + l)`` against keys ``[o, o + l)``, a square causal block (``is_causal`` as the kernel
  knows it).

Forward (per query row, each block's output ``O_X`` and log-sum-exp ``L_X`` of its scores)::

    L = log(exp(L_A) + exp(L_B)),   O = exp(L_A − L) · O_A + exp(L_B − L) · O_B

Backward: the softmax gradient of a block depends on the whole row only through ``L`` and ``D = rowsum(dO ∘ O)``,
so each block's backward kernel called with the merged ``O`` and ``L`` (not its own) returns exactly that
block's share: ``dQ = dQ_A + dQ_B``; ``dK``, ``dV`` are this rank's rows' contributions, placed at keys
``[0, o)`` and ``[o, o + l)`` (zero beyond ``o + l``) and left *partial* over the axis, reduced where their
consumer needs them, as the masked calls' are. Keys past a rank's rows are never computed: the masked calls'
kernel computes every key and masks, so this path does about half the work — unevenly, rank ``r`` doing
``(r + ½)·l²`` of the ``t²/2`` row-key pairs; the plan prices each rank at ``1/n`` of the whole call (the
slowest rank does ``(n − ½)/n`` of that). Balancing it is what the zig-zag split of ring attention does.

Strategies (per mesh axis; the queries' sequence on one axis at least, :func:`per_axis_products`): rows
``q, out, lse S(2)``, ``k, v R`` (``dq S(2)``, ``dk, dv P``); batch ``S(0)`` or heads ``S(1)`` of every tensor on
another axis; replicated. Only for ``is_causal`` calls without a mask: the others have DTensor's.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.ops.attention import (
    _BACKWARD,
    _FORWARD,
    _expand_kv,
    _heads_inner,
    _math_backward,
    _math_forward,
    _scale,
)
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

FORWARD, BACKWARD = "meshpilot.sdpa.default", "meshpilot.sdpa_backward.default"
_CAUSAL_ARG = {FORWARD: 4, BACKWARD: 7}
"""Position of ``is_causal`` among each op's arguments."""


def _causal_without_mask(node: OpNode, target: str) -> bool:
    """Whether the call is ``is_causal`` with no mask (a node without its FX node, read from a file: no)."""
    if node.fx_node is None:
        return False
    args = node.fx_node.args
    mask = args[_CAUSAL_ARG[target] - 1]
    return bool(args[_CAUSAL_ARG[target]]) and mask is None


def _forward_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """outs (out, lse), ins (q, k, v)."""
    if not _causal_without_mask(node, FORWARD):
        return []
    s0, s1, s2, r = Shard(0), Shard(1), Shard(2), Replicate()
    rules = [((s2, s2), (s2, r, r)), ((s0, s0), (s0, s0, s0)), ((s1, s1), (s1, s1, s1)), ((r, r), (r, r, r))]
    return per_axis_products(b, node, rules)


def _backward_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """outs (dq, dk, dv), ins (grad_out, q, k, v, out, lse)."""
    if not _causal_without_mask(node, BACKWARD):
        return []
    s0, s1, s2, r, p = Shard(0), Shard(1), Shard(2), Replicate(), Partial()
    rules = [
        ((s2, p, p), (s2, s2, r, r, s2, s2)),
        ((s0, s0, s0), (s0,) * 6),
        ((s1, s1, s1), (s1,) * 6),
        ((r, r, r), (r,) * 6),
    ]
    return per_axis_products(b, node, rules)


def _rows(call: OwnCall) -> tuple[int, int]:
    """(first query row, rows) of this rank's queries: operand 0 of the forward, 1 of the backward."""
    arg = 0 if str(call.node.target) == FORWARD else 1
    return call.local_range(call.global_shape(arg), call.ins[arg], 2)


def _blocks(first: int, rows: int) -> tuple[slice, slice]:
    """The key ranges of block A (every key visible) and B (the causal square)."""
    return slice(0, first), slice(first, first + rows)


def _kernels(q: Tensor) -> tuple:
    return _FORWARD.get(q.device.type, _math_forward), _BACKWARD.get(q.device.type, _math_backward)


def _run_forward(call: OwnCall, q, k, v, attn_mask, is_causal, scale, enable_gqa):
    """``(out, lse)`` of this rank's query rows: blocks A and B merged by their log-sum-exps."""
    first, rows = _rows(call)
    sc = _scale(q, scale)
    k, v = _expand_kv(q, k, v, enable_gqa)
    fwd, _ = _kernels(q)
    a, b = _blocks(first, rows)
    out_b, lse_b = fwd(q, k[:, :, b].contiguous(), v[:, :, b].contiguous(), None, True, sc)  # [b, h, l, e], [b, h, l]
    if first == 0:
        return _heads_inner(out_b), lse_b
    out_a, lse_a = fwd(q, k[:, :, a].contiguous(), v[:, :, a].contiguous(), None, False, sc)
    lse = torch.logaddexp(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
    return _heads_inner((wa * out_a.float() + wb * out_b.float()).to(q.dtype)), lse


def _run_backward(call: OwnCall, grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, enable_gqa):
    """``(dq, dk, dv)``: each block's backward with the merged ``out`` and ``lse``; dk, dv this rank's share."""
    first, rows = _rows(call)
    sc = _scale(q, scale)
    kx, vx = _expand_kv(q, k, v, enable_gqa)
    _, bwd = _kernels(q)
    g = grad_out.contiguous()
    a, b = _blocks(first, rows)
    dk, dv = torch.zeros_like(kx), torch.zeros_like(vx)
    dq, dk[:, :, b], dv[:, :, b] = bwd(
        g, q, kx[:, :, b].contiguous(), vx[:, :, b].contiguous(), out, lse, None, True, sc
    )
    if first > 0:
        dq_a, dk[:, :, a], dv[:, :, a] = bwd(
            g, q, kx[:, :, a].contiguous(), vx[:, :, a].contiguous(), out, lse, None, False, sc
        )
        dq = dq + dq_a
    if kx.shape[1] != k.shape[1]:  # grouped-query: sum the repeated heads' gradients back
        groups = kx.shape[1] // k.shape[1]
        dk, dv = dk.unflatten(1, (k.shape[1], groups)).sum(2), dv.unflatten(1, (v.shape[1], groups)).sum(2)
    return dq, dk, dv


OPS = (
    OwnOp(FORWARD, _forward_strategies, _run_forward),
    OwnOp(BACKWARD, _backward_strategies, _run_backward),
)
