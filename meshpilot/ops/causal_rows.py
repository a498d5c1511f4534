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
kernel computes every key and masks, so this path does about half the work — unevenly with contiguous rows,
rank ``r`` doing ``(r + ½)·l²`` of the ``t²/2`` row-key pairs (the slowest rank ``(n − ½)·l²``).

**Balanced (zig-zag) rows**, Llama 3's layout (§3.3.2): in a plan whose sequence is zig-zag-ordered
(``planner.sequence_order``, ``OwnCall.sequence_order``) the step runs on the permuted sequence, so a rank's
contiguous rows of the permuted q are the **segments** of natural positions its chunks hold (rank ``r`` of the
order's axis: chunks ``r`` and ``2n − 1 − r`` of ``m = t / 2n`` rows each, :func:`segments`), and the gathered
k, v are in the permuted order too. Each segment ``[f, f + m)`` is the contiguous case above: block ``A`` its
rows against the natural keys ``[0, f)`` (read out of the permuted keys by their slots,
``ring.zigzag_positions`` inverted), block ``B`` the causal square of its own keys; the segments' outputs are
concatenated, their ``dK``, ``dV`` added at the slots they read. Every rank then computes
``(2n − 1)·m²`` whole pairs and two causal squares: the average (``CostModel.attention``, balanced).

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


def _rows(call: OwnCall) -> tuple[int, int, int]:
    """(first query row, rows, sequence length) of this rank's queries: operand 0 of the forward, 1 of the
    backward (rows in the order the step holds the sequence)."""
    arg = 0 if str(call.node.target) == FORWARD else 1
    shape = call.global_shape(arg)
    first, rows = call.local_range(shape, call.ins[arg], 2)
    return first, rows, int(shape[2]) if shape is not None else first + rows


def segments(first: int, rows: int, positions: Tensor | None) -> list[tuple[int, int, int]]:
    """(local row, natural position, length) of each run of this rank's rows ``[first, first + rows)`` whose
    natural positions are consecutive: `positions` the natural position of each slot of the held sequence
    (``ring.zigzag_positions``; None: contiguous, one run)."""
    if positions is None:
        return [(0, first, rows)]
    pos = positions[first : first + rows].tolist()
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(pos):
        if out and out[-1][1] + out[-1][2] == p:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, p, 1))
    return out


class _Layout:
    """Where a call's rows and keys sit in the held sequence: its :func:`segments`, each segment's rows' own
    keys (a slice of the held keys: the same slots as its queries) and the held slots of the natural keys
    before it (a slice when contiguous, else an index tensor)."""

    def __init__(self, call: OwnCall, device) -> None:
        first, rows, t = _rows(call)
        order = call.sequence_order
        positions = self.slots = None
        if order is not None:
            if order.length != t:
                raise RuntimeError(
                    f"{call.node.name}: attention over {t} positions in a plan whose sequence order is of "
                    f"{order.length}; plan again"
                )
            positions, self.slots = _zigzag(call, t, order.peers, device)
        self.first = first
        self.segments = segments(first, rows, positions)

    def before(self, natural: int):
        """The held slots of the natural keys ``[0, natural)``."""
        return slice(0, natural) if self.slots is None else self.slots[:natural]

    def own(self, local: int, length: int) -> slice:
        return slice(self.first + local, self.first + local + length)


def _zigzag(call: OwnCall, length: int, peers: int, device) -> tuple[Tensor, Tensor]:
    """``ring.zigzag_positions`` of the call's sequence (the natural position of each held slot) and its
    inverse on `device` (the held slot of each natural position), kept in the call's cache."""
    from meshpilot.ops.ring import zigzag_positions

    key = ("zigzag", length, peers, str(device))
    if key not in call.cache:
        positions = zigzag_positions(length, peers)
        call.cache[key] = (positions, torch.argsort(positions).to(device))
    return call.cache[key]


def _take(x: Tensor, where) -> Tensor:
    """Sequence positions `where` (a slice or held slots) of ``[b, h, t, e]`` `x`, contiguous."""
    return x[:, :, where].contiguous() if isinstance(where, slice) else x.index_select(2, where)


def _rows_of(x: Tensor, rows: slice) -> Tensor:
    """This segment's `rows` of the rank's own ``[b, h, l, …]`` `x`: `x` itself when they are all of it."""
    return x if rows.start == 0 and rows.stop >= x.shape[2] else x[:, :, rows].contiguous()


def _put(acc: Tensor, where, x: Tensor) -> None:
    """Add `x` into `acc` at sequence positions `where` (:func:`_take`'s)."""
    if isinstance(where, slice):
        acc[:, :, where] += x
    else:
        acc.index_add_(2, where, x)


def _kernels(q: Tensor) -> tuple:
    return _FORWARD.get(q.device.type, _math_forward), _BACKWARD.get(q.device.type, _math_backward)


def _segment_forward(fwd, q, k, v, layout: _Layout, seg: tuple[int, int, int], sc) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one segment's rows ``[b, h, l, e]``: blocks A and B merged by their log-sum-exps."""
    local, natural, length = seg
    own = layout.own(local, length)
    out_b, lse_b = fwd(q, _take(k, own), _take(v, own), None, True, sc)
    if natural == 0:
        return out_b, lse_b
    before = layout.before(natural)
    out_a, lse_a = fwd(q, _take(k, before), _take(v, before), None, False, sc)
    lse = torch.logaddexp(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - lse).unsqueeze(-1), torch.exp(lse_b - lse).unsqueeze(-1)
    return (wa * out_a.float() + wb * out_b.float()).to(q.dtype), lse


def _run_forward(call: OwnCall, q, k, v, attn_mask, is_causal, scale, enable_gqa):
    """``(out, lse)`` of this rank's query rows: each segment's blocks A and B merged by their log-sum-exps."""
    layout = _Layout(call, q.device)
    sc = _scale(q, scale)
    k, v = _expand_kv(q, k, v, enable_gqa)
    fwd, _ = _kernels(q)
    parts = [
        _segment_forward(fwd, _rows_of(q, slice(loc, loc + n)), k, v, layout, (loc, nat, n), sc)
        for loc, nat, n in layout.segments
    ]
    if len(parts) == 1:
        return _heads_inner(parts[0][0]), parts[0][1]
    return _heads_inner(torch.cat([o for o, _ in parts], 2)), torch.cat([s for _, s in parts], 2)


def _run_backward(call: OwnCall, grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, enable_gqa):
    """``(dq, dk, dv)``: each segment's blocks' backward with the merged ``out`` and ``lse``; dk, dv this rank's
    share, at the held slots the blocks read."""
    layout = _Layout(call, q.device)
    sc = _scale(q, scale)
    kx, vx = _expand_kv(q, k, v, enable_gqa)
    _, bwd = _kernels(q)
    g = grad_out.contiguous()
    dk, dv = torch.zeros_like(kx), torch.zeros_like(vx)
    dqs = []
    for local, natural, length in layout.segments:
        rows = slice(local, local + length)
        gq, qq, oq, lq = (_rows_of(x, rows) for x in (g, q, out, lse))
        blocks = [(layout.own(local, length), True)] + ([(layout.before(natural), False)] if natural else [])
        dq = None
        for where, causal in blocks:
            dq_x, dk_x, dv_x = bwd(gq, qq, _take(kx, where), _take(vx, where), oq, lq, None, causal, sc)
            dq = dq_x if dq is None else dq + dq_x
            _put(dk, where, dk_x)
            _put(dv, where, dv_x)
        dqs.append(dq)
    dq = dqs[0] if len(dqs) == 1 else torch.cat(dqs, 2)
    if kx.shape[1] != k.shape[1]:  # grouped-query: sum the repeated heads' gradients back
        groups = kx.shape[1] // k.shape[1]
        dk, dv = dk.unflatten(1, (k.shape[1], groups)).sum(2), dv.unflatten(1, (v.shape[1], groups)).sum(2)
    return dq, dk, dv


OPS = (
    OwnOp(FORWARD, _forward_strategies, _run_forward),
    OwnOp(BACKWARD, _backward_strategies, _run_backward),
)
