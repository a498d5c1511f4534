"""Ring attention: the attention pair with queries, keys and values all sequence-sharded on one mesh axis.

Context parallelism's third method (``ContextMethod.RING``; Liu et al., *Ring Attention with Blockwise
Transformers*, 2023). Rank ``r`` of the axis's ``P`` holds the rows ``[r·l, (r + 1)·l)`` of q, k, v (``S(2)`` of
``[b, h, t, e]``, ``l = t / P``); the key/value blocks travel round the ring in ``P − 1`` steps, each rank
sending the block it holds to rank ``r + 1`` and receiving the next from ``r − 1`` while it computes on the
one it holds, so a rank holds two key/value blocks at a time (the one it computes on, the one arriving),
never the whole gathered keys and values the all-gather method holds (``ContextMethod.ALL_GATHER``).

Forward (per query row; block ``j``'s output ``O_j`` and log-sum-exp ``L_j``, from the device's kernel)::

    L ← log(exp(L) + exp(L_j)),   O ← exp(L_old − L) · O + exp(L_j − L) · O_j

Backward: as :mod:`meshpilot.ops.causal_rows` explains, each block's backward kernel called with the merged
``O`` and ``L`` returns exactly that block's share, so ``dQ`` sums over the blocks locally, and the ``dK``,
``dV`` of block ``j`` are summed by an accumulator that travels with it: rank ``r`` adds its queries' share of
the block it holds and passes the accumulator on to ``r + 1`` (which holds that block next); after the ``P``-th
step it arrives back at its owner. Sends: forward ``P − 1`` (k and v in one message), backward ``P − 1`` of
k and v and ``P`` of the accumulators (float32 at least) — the collective log records each as one ``SEND``
on the axis (its receive is the other end of the same transfer, not recorded again), and the plan lists the
same (``Strategy.colls``).

Causal calls: ``is_causal`` without a mask, every block pair is placed by the global positions of its rows
and keys (:func:`_pairs`): keys wholly after the rows are skipped (no computation; the block still passes
on), keys wholly before are computed whole, the diagonal block with the kernel's own causal mask. A call
with a mask (transformers builds the causal mask as a tensor) takes the mask's query rows sharded with the
queries (its key columns whole, sliced per block), and every block is computed (the mask masks).

**Priced** (``Strategy.colls``, :func:`sends`): each send is one neighbour transfer of the cost model
(``CostModel.send_recv``: ``α + M / B'``), added to the op's time serially: no credit for the overlap with the
block's computation the kernel allows (it issues step ``i + 1``'s transfer before computing step ``i``). That is
an upper bound; on a CPU mesh gloo's threads share the cores with the ranks' compute, so the overlap there is
small, and a GPU's would hide up to ``min(transfer, block compute)`` a step. **Memory**: the kernel's own
buffers (the two blocks, the float32 accumulators) are added at the op's moment (:func:`inside_bytes`, read by
``accounting.liveness``) and measured inside the op (``memtrack.measured_inside``).

**Zig-zag** (causal load balancing): with contiguous shards rank ``r`` computes ``r + ½`` chunk pairs of the
causal triangle; with ``2P`` chunks, rank ``r`` holding chunks ``r`` and ``2P − 1 − r`` (:func:`zigzag`), every
rank computes the same (:func:`causal_work`, :func:`causal_shares`). The kernels take any chunk order
(``_Ring.order``, placed by global chunk positions in :func:`_pairs`). A plan takes the order where every
attention call is a ring on one axis (or ``is_causal`` by query rows on it) and nothing else mixes positions
(``planner.sequence_order``, recorded as ``StagePlan.sequence_order``): the step then runs on the permuted
sequence (:func:`zigzag_positions`; inputs and position ``arange`` permuted by the runtime), :func:`ring_of`
gives ``is_causal`` calls the zig-zag order and masked calls the contiguous one (their mask, built from
permuted positions, is permuted in its columns too), and ``causal_rows``' ``is_causal`` calls (the all-gather
method by query rows) read their rows' chunks off the same order (``causal_rows.segments``). Priced balanced
only where the graph's calls are marked zig-zag (``OpNode.zigzag``: ``planner.config_plan``'s CP plans,
``CostModel.attention``); ``auto.plan`` chooses the order after its ILP, which priced the contiguous slowest
rank; ``benchmarks/bench_cp.py zigzag`` shows the step with the slowest rank's share.

Why meshpilot's own op and not PyTorch's ``torch.distributed.tensor.experimental._context_parallel``
(``_templated_ring_attention``): that one is written for ``aten._scaled_dot_product_{flash,efficient,cudnn}
_attention`` (CUDA ops; the CPU flash op is not in its dispatch table), swaps DTensor's dispatch for those
ops inside a ``context_parallel`` context that rewrites module buffers in place, and passes blocks with
functional ``permute_tensor`` collectives on the device's process group. A captured meshpilot graph holds
``meshpilot::sdpa`` (device-generic) instead, the planner must price and count each transfer, and the
runtime replays recorded local kernels: so the ring is a custom op here (``ring_sdpa``, recorded as one
opaque call and run afresh at each replay, as the expert-parallel MoE's kernels are) that passes the blocks
with ``torch.distributed`` ``isend``/``irecv`` on the axis's group (gloo carries both) and runs the same
per-device kernels as :mod:`meshpilot.ops.attention`. The two custom ops live in :mod:`meshpilot.ops.ring_kernels`,
defined on a step's first ring call, not when planning imports this module for its strategies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import Replicate, Shard

from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp, causal_rows
from meshpilot.ops.attention import (
    _BACKWARD,
    _FORWARD,
    _expand_kv,
    _float_mask,
    _heads_inner,
    _mask_rule,
    _math_backward,
    _math_forward,
    _scale,
)
from meshpilot.sharding.reshard import Collective, CollectiveKind
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

FORWARD, BACKWARD = causal_rows.FORWARD, causal_rows.BACKWARD


# ------------------------------------------------------------------------------------------- the ring


@dataclass(frozen=True)
class _Ring:
    """The axis a call's ring runs on: its process group (by name), the axis's name, size and this rank's
    index on it; the sequence chunks each rank holds (``chunks`` per rank, rank ``r`` holding chunks
    ``order[r·c : (r + 1)·c]`` of ``P·c`` equal chunks: ``c = 1`` and ``order = 0 … P − 1`` is the contiguous
    split)."""

    group: str
    axis: str
    peers: int
    rank: int
    order: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> _Ring:
        group, axis, peers, rank, order = text.split("\t")
        return cls(group, axis, int(peers), int(rank), tuple(int(c) for c in order.split(",")))

    def text(self) -> str:
        return "\t".join((self.group, self.axis, str(self.peers), str(self.rank), ",".join(map(str, self.order))))

    def chunks(self, rank: int) -> tuple[int, ...]:
        c = len(self.order) // self.peers
        return self.order[rank * c : (rank + 1) * c]


def zigzag(peers: int) -> tuple[int, ...]:
    """The chunk order of causal load balancing: ``2P`` chunks, rank ``r`` holding chunks ``r`` and ``2P − 1 − r``
    (each rank then computes the same number of causal row-key pairs, :func:`causal_work`)."""
    return tuple(c for r in range(peers) for c in (r, 2 * peers - 1 - r))


def zigzag_positions(length: int, peers: int, device=None) -> Tensor:
    """The one-device positions of a zig-zag plan's sequence in the order the step holds them: the chunks of
    :func:`zigzag` one after another (rank ``r``'s contiguous shard of the result is its two chunks)."""
    n = length // (2 * peers)
    return torch.cat([torch.arange(c * n, (c + 1) * n, device=device) for c in zigzag(peers)])


def causal_shares(peers: int, zig: bool) -> list[float]:
    """Each rank's share of a causal call's whole ``t × t`` score square (what ``attention_flops`` counts) in
    the ring: contiguous ``(r + ½) / P²`` (the last rank's ``(P − ½) / P²`` sets the step), zig-zag ``1 / 2P``
    each (:func:`causal_work` over the chunk count squared)."""
    order = zigzag(peers) if zig else tuple(range(peers))
    chunks = len(order)
    return [causal_work(_Ring("", "", peers, r, order), chunks) / chunks**2 for r in range(peers)]


def causal_work(ring: _Ring, rows: int) -> float:
    """Row-key pairs rank ``ring.rank`` computes for causal attention, in units of one chunk pair (a diagonal
    chunk: ½): what the ring's chunk order balances."""
    total = 0.0
    for src in range(ring.peers):
        total += sum(0.5 if diag else 1.0 for _, _, diag in _pairs(ring, src, rows))
    return total


def _pairs(ring: _Ring, src: int, rows: int) -> list[tuple[slice, slice, bool]]:
    """For causal attention of this rank's queries against the keys of rank `src` (`rows` rows a rank, in
    chunks of ``rows / c``): every (query rows, key rows, causal) pair of chunks that sees anything, local
    slices; keys after the queries are left out, the same chunk is the causal diagonal."""
    mine, theirs = ring.chunks(ring.rank), ring.chunks(src)
    n = rows // len(mine)
    out = []
    for i, qc in enumerate(mine):
        for j, kc in enumerate(theirs):
            if kc <= qc:
                out.append((slice(i * n, (i + 1) * n), slice(j * n, (j + 1) * n), kc == qc))
    return out


def _mask_columns(ring: _Ring, src: int, keys: int) -> Tensor:
    """The global key positions of rank `src`'s rows (`keys` a rank): a mask's columns for that block."""
    chunks = ring.chunks(src)
    n = keys // len(chunks)
    return torch.cat([torch.arange(c * n, (c + 1) * n) for c in chunks])


def _pack(*ts: Tensor) -> Tensor:
    """The tensors' bytes in one flat buffer (one message per ring step)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in ts])


def _unpack(buf: Tensor, like: tuple[Tensor, ...]) -> list[Tensor]:
    """:func:`_pack` undone: tensors shaped and typed as `like`."""
    out, at = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(buf[at : at + n].view(t.dtype).view(t.shape))
        at += n
    return out


class _Passer:
    """One step's message round the ring: `buf` sent to rank + 1, the same size received from rank − 1,
    recorded as one ``SEND`` on the axis; `tag` keeps the key/value blocks (0) and the gradient accumulators
    (1) apart."""

    def __init__(self, ring: _Ring, buf: Tensor, tag: int = 0) -> None:
        import torch.distributed as dist

        from meshpilot import compat
        from meshpilot.runtime import collective_log

        group = compat.resolve_process_group()(ring.group)
        nxt = dist.get_global_rank(group, (ring.rank + 1) % ring.peers)
        prv = dist.get_global_rank(group, (ring.rank - 1) % ring.peers)
        collective_log.record(CollectiveKind.SEND, ring.axis, ring.peers, buf.numel() * buf.element_size())
        self.got = torch.empty_like(buf)
        self.works = [dist.isend(buf, nxt, group=group, tag=tag), dist.irecv(self.got, prv, group=group, tag=tag)]

    def wait(self) -> Tensor:
        """The received buffer; the sent one is released (a finished work would keep it alive)."""
        for w in self.works:
            w.wait()
        self.works = []
        got, self.got = self.got, None
        return got


def _kernels(q: Tensor) -> tuple:
    return _FORWARD.get(q.device.type, _math_forward), _BACKWARD.get(q.device.type, _math_backward)


def _acc_dtype(k: Tensor) -> torch.dtype:
    """The key/value gradient accumulators' dtype: float32 at least."""
    return torch.promote_types(k.dtype, torch.float32)


def _blocks(ring: _Ring, src: int, q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool):
    """The (query rows, key rows, mask block, causal) pieces of this rank's queries against rank `src`'s keys."""
    if mask is not None:
        cols = _mask_columns(ring, src, k.shape[2]).to(mask.device)
        block = mask if mask.shape[-1] == 1 else mask.index_select(-1, cols)
        return [(slice(None), slice(None), block.contiguous(), False)]
    if not is_causal:
        return [(slice(None), slice(None), None, False)]
    return [(qs, ks, None, diag) for qs, ks, diag in _pairs(ring, src, q.shape[2])]


def _ring_forward(q, k, v, mask, is_causal, scale, enable_gqa, ring_text):
    ring = _Ring.parse(ring_text)
    fwd, _ = _kernels(q)
    mask = _float_mask(mask, q)
    out = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], -float("inf"), dtype=torch.float32, device=q.device)
    cur = _pack(k, v)
    for step in range(ring.peers):
        passing = _Passer(ring, cur) if step < ring.peers - 1 else None
        src = (ring.rank - step) % ring.peers
        kb, vb = _expand_kv(q, *_unpack(cur, (k, v)), enable_gqa)
        for qs, ks, mb, diag in _blocks(ring, src, q, kb, mask, is_causal):
            o_j, l_j = fwd(q[:, :, qs], kb[:, :, ks].contiguous(), vb[:, :, ks].contiguous(), mb, diag, scale)
            if mb is not None:  # rows the mask hides wholly add nothing (the CPU kernel gives them lse 0, out 0)
                l_j = l_j.masked_fill((mb == -float("inf")).all(-1).expand_as(l_j), -float("inf"))
                o_j = o_j.nan_to_num(0.0)  # (the math path: NaN)
            merged = torch.logaddexp(lse[:, :, qs], l_j)
            out[:, :, qs] *= torch.exp(lse[:, :, qs] - merged).unsqueeze(-1)  # in place: no block-sized temporaries
            out[:, :, qs] += o_j * torch.exp(l_j - merged).unsqueeze(-1)
            lse[:, :, qs] = merged
            del o_j
        if passing is not None:
            cur = passing.wait()
    return _heads_inner(out.to(q.dtype)), lse


def _ring_backward(g, q, k, v, out, lse, mask, is_causal, scale, enable_gqa, ring_text):
    ring = _Ring.parse(ring_text)
    _, bwd = _kernels(q)
    mask = _float_mask(mask, q)
    g = g.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    wide, nk = _acc_dtype(k), k.numel()
    acc = torch.zeros(nk + v.numel(), dtype=wide, device=k.device)  # dK | dV of the block held, flat: sent as is
    cur, accumulating = _pack(k, v), None
    for step in range(ring.peers):
        passing = _Passer(ring, cur) if step < ring.peers - 1 else None
        src = (ring.rank - step) % ring.peers
        kx, vx = _expand_kv(q, *_unpack(cur, (k, v)), enable_gqa)
        dk = torch.zeros(kx.shape, dtype=wide, device=k.device)
        dv = torch.zeros(vx.shape, dtype=wide, device=v.device)
        for qs, ks, mb, diag in _blocks(ring, src, q, kx, mask, is_causal):
            kq, vq = kx[:, :, ks].contiguous(), vx[:, :, ks].contiguous()
            args = (g[:, :, qs].contiguous(), q[:, :, qs], kq, vq, out[:, :, qs], lse[:, :, qs].contiguous())
            dq_j, dk_j, dv_j = bwd(*args, mb, diag, scale)
            dq[:, :, qs] += dq_j
            dk[:, :, ks] += dk_j
            dv[:, :, ks] += dv_j
            del dq_j, dk_j, dv_j
        if kx.shape[1] != k.shape[1]:  # grouped-query: sum the repeated heads' gradients back
            groups = kx.shape[1] // k.shape[1]
            dk, dv = dk.unflatten(1, (k.shape[1], groups)).sum(2), dv.unflatten(1, (v.shape[1], groups)).sum(2)
        if accumulating is not None:  # the block's accumulator, from the rank that held the block before
            acc = accumulating.wait()
        acc[:nk] += dk.reshape(-1)
        acc[nk:] += dv.reshape(-1)
        del dk, dv
        accumulating = _Passer(ring, acc, tag=1)  # on to the rank that holds this block next (last: its owner)
        if passing is not None:
            cur = passing.wait()
    acc = accumulating.wait()
    dk, dv = acc[:nk].view(k.shape), acc[nk:].view(v.shape)
    return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True)  # copies: not views of one buffer


# ------------------------------------------------------------------------------------------- planning


def _mask_meta(node: OpNode, target: str):
    """The mask operand's fake value, or None (no mask)."""
    mask = node.fx_node.args[causal_rows._CAUSAL_ARG[target] - 1]
    return None if mask is None else mask.meta["val"]


def _local_bytes(t, placements, mesh: tuple[int, ...]) -> int:
    """Bytes of `t`'s (a fake value's) local shard under `placements`."""
    n = t.numel() * t.element_size()
    for p, size in zip(placements, mesh):
        if isinstance(p, Shard):
            n //= size
    return n


def sends(k, v, k_placements, v_placements, mesh: tuple[int, ...], axis: int, backward: bool) -> tuple:
    """The ring's ``SEND`` collectives on `axis` (one a step, as :class:`_Passer` records them): forward
    ``P − 1`` of the key/value block; backward those and ``P`` of the float32 gradient accumulators."""
    peers = mesh[axis]
    kv = _local_bytes(k, k_placements, mesh) + _local_bytes(v, v_placements, mesh)
    out = [Collective(CollectiveKind.SEND, axis, kv)] * (peers - 1)
    if backward:
        wide = torch.promote_types(k.dtype, torch.float32).itemsize
        acc = (_local_bytes(k, k_placements, mesh) + _local_bytes(v, v_placements, mesh)) // k.element_size() * wide
        out += [Collective(CollectiveKind.SEND, axis, acc)] * peers
    return tuple(out)


def _strategies(b: StrategyBuilder, node: OpNode, target: str) -> list[Strategy]:
    """Per axis: the ring (every operand's sequence), batch, heads, replicated; the ring on exactly one axis."""
    if node.fx_node is None:
        return []
    backward = target == BACKWARD
    args = node.fx_node.args
    off = 1 if backward else 0
    k, v = args[off + 1].meta["val"], args[off + 2].meta["val"]
    mask = _mask_meta(node, target)
    s0, s1, s2, r = Shard(0), Shard(1), Shard(2), Replicate()

    def with_mask(rule, from_end):
        return rule if mask is None else (*rule, _mask_rule(mask, from_end))

    n_out, n_in = (3, 6) if backward else (2, 3)
    rules = [
        ((s2,) * n_out, with_mask((s2,) * n_in, 2)),
        ((s0,) * n_out, with_mask((s0,) * n_in, 4)),
        ((s1,) * n_out, with_mask((s1,) * n_in, 3)),
        ((r,) * n_out, (r,) * n_in + (() if mask is None else (r,))),
    ]
    mesh = b.mesh_shape

    def colls(outs, ins):
        axes = [a for a, p in enumerate(ins[off]) if p == s2 and mesh[a] > 1]
        if len(axes) != 1:  # the ring on no axis or on two (dropped below)
            return ()
        return sends(k, v, ins[off + 1], ins[off + 2], mesh, axes[0], backward)

    out = per_axis_products(b, node, rules, colls)
    return [s for s in out if sum(p == s2 and n > 1 for p, n in zip(s.ins[off], mesh)) == 1]


def inside_bytes(node: OpNode, strategy: Strategy, mesh: tuple[int, ...]) -> float:
    """Bytes the ring's kernel holds at its peak beyond its operands (0 where the call is not a ring): what
    :func:`_ring_forward` / :func:`_ring_backward` allocate, counted tensor by tensor (``KV``: this rank's key
    and value block, ``KVx`` that repeated to the query heads, ``O`` the output block, ``L`` its log-sum-exp
    rows in float32, ``·4`` float32 copies):

    * forward, inside a step: the block held and the one arriving (``2 KV``), the float32 output accumulator
      and the block's output and their product (``O·4 + O + O·4``), four ``L`` (the running log-sum-exp, the
      block's, the merged one, a weight); ``KVx`` where grouped-query heads are repeated;
    * backward, inside a step: ``2 KV``, the float32 dq accumulator (``Q·4``), the travelling dK|dV accumulator
      and the one arriving (``2 KV·4``), this block's dK, dV (``KVx·4``), the kernel's dq, dk, dv (``Q + KVx``);
      ``KVx`` where repeated;
    * a mask: its rows as float (where it is boolean) and the block's columns of them.

    The memory model adds it at the node's moment in place of its outputs (``accounting.liveness``: the
    ``passing`` bytes); measured by ``memtrack.measured_inside``, which sees inside the custom op."""
    target = str(node.target)
    backward = target == BACKWARD
    off = 1 if backward else 0
    ins = strategy.ins
    if node.fx_node is None or len(ins) <= off + 1:
        return 0.0
    axes = [a for a, p in enumerate(ins[off + 1]) if isinstance(p, Shard) and p.dim == 2 and mesh[a] > 1]
    if not axes:
        return 0.0
    args = node.fx_node.args
    q, k, v = (args[off + i].meta["val"] for i in range(3))
    kv = _local_bytes(k, ins[off + 1], mesh) + _local_bytes(v, ins[off + 2], mesh)
    qb = _local_bytes(q, ins[off], mesh)
    item = q.element_size()
    rows = qb // item // q.shape[-1]  # b·h·t of this rank
    o = rows * v.shape[-1]  # output elements
    enable_gqa = bool(args[9 if backward else 6])
    kvx = kv * q.shape[1] // k.shape[1] if enable_gqa and k.shape[1] != q.shape[1] else 0
    mask = _mask_meta(node, target)
    extra = 0.0
    if mask is not None:
        mb = _local_bytes(mask, ins[-1], mesh) // mask.element_size()  # mask elements of this rank
        extra = (mb * item if mask.dtype == torch.bool else 0) + mb // mesh[axes[0]] * item
    wide = torch.promote_types(k.dtype, torch.float32).itemsize
    if backward:
        block = kvx or kv  # dK, dV of one block at the query heads
        accumulators = 2 * (kv // k.element_size() * wide) + block // k.element_size() * wide
        return 2 * kv + kvx + rows * q.shape[-1] * 4 + accumulators + qb + block + extra
    return 2 * kv + kvx + o * 4 * 2 + o * item + 4 * rows * 4 + extra


def _forward_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """outs (out, lse), ins (q, k, v[, mask]): causal_rows' and the ring's."""
    return causal_rows.OPS[0].strategies(b, node) + _strategies(b, node, FORWARD)


def _backward_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """outs (dq, dk, dv), ins (grad_out, q, k, v, out, lse[, mask]): causal_rows' and the ring's."""
    return causal_rows.OPS[1].strategies(b, node) + _strategies(b, node, BACKWARD)


# ------------------------------------------------------------------------------------------- on the shards


def ring_of(call: OwnCall, key_operand: int, causal: bool = False) -> str:
    """The call's ring as :class:`_Ring` text ("" where the keys are not sequence-sharded: causal_rows' call).
    Its chunk order: :func:`zigzag` for an ``is_causal`` call (`causal`) on the axis of a zig-zag plan
    (``OwnCall.sequence_order``), whose blocks are placed by their global positions; else contiguous (a masked
    call reads its mask's columns in the order the sequence is held: a zig-zag plan's mask, built from
    permuted positions, is permuted in its columns too)."""
    axes = call.sharding_axes(call.ins[key_operand], 2)
    if not axes:
        return ""
    group, name, peers = call.axis_group(axes[0])
    seq = call.sequence_order
    zig = causal and seq is not None and seq.order == "zigzag" and seq.axis == axes[0]
    order = zigzag(peers) if zig else tuple(range(peers))
    return _Ring(group, name, peers, call.mesh.get_local_rank(axes[0]), order).text()


def _run_forward(call: OwnCall, q, k, v, attn_mask, is_causal, scale, enable_gqa):
    ring = ring_of(call, 1, is_causal and attn_mask is None)
    if not ring:
        return causal_rows.OPS[0].run(call, q, k, v, attn_mask, is_causal, scale, enable_gqa)
    from meshpilot.ops.ring_kernels import ring_sdpa

    return ring_sdpa(q, k, v, attn_mask, is_causal, _scale(q, scale), enable_gqa, ring)


def _run_backward(call: OwnCall, grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, enable_gqa):
    ring = ring_of(call, 2, is_causal and attn_mask is None)
    if not ring:
        args = (grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, enable_gqa)
        return causal_rows.OPS[1].run(call, *args)
    from meshpilot.ops.ring_kernels import ring_sdpa_backward

    return ring_sdpa_backward(grad_out, q, k, v, out, lse, attn_mask, is_causal, _scale(q, scale), enable_gqa, ring)


OPS = (
    OwnOp(FORWARD, _forward_strategies, _run_forward, inside=inside_bytes),
    OwnOp(BACKWARD, _backward_strategies, _run_backward, inside=inside_bytes),
)
"""The attention pair's own ops: causal_rows' query-row strategies and the ring's, one run dispatching by the
keys' layout (replaces causal_rows' entries in the registry)."""


def __getattr__(name: str):
    """``ring_sdpa`` and ``ring_sdpa_backward``, the custom ops :mod:`meshpilot.ops.ring_kernels` defines on
    first use (so planning, which imports this module for its strategies, does not define them)."""
    if name in ("ring_sdpa", "ring_sdpa_backward"):
        from meshpilot.ops import ring_kernels

        return getattr(ring_kernels, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
