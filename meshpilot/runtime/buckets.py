"""A plan's flat collectives run: each gradient bucket's gradients (and each gather group's parameter shards)
flattened into one buffer, one collective, split back.

``meshpilot.planner.buckets`` decides the buckets (``StagePlan.grad_buckets``); here
:class:`BucketSync` issues them on local tensors (the gradients as the backward leaves them: partial sums over
the bucket's mesh axis) as ``_c10d_functional`` collectives, which return at once and are waited for by a
later ``wait_tensor``, and gives back each gradient in its parameter's layout:

* all-reduce (replicated parameters): the gradients' elements one after the other, all-reduced in place
  (``all_reduce_``: the bucket is the step's own buffer, so the one copy is the flattening), each gradient a
  view of its part of the result (as DDP's ``gradient_as_bucket_view``);
* reduce-scatter (sharded parameters, ZeRO): each gradient cut along its shard dim into the axis' ``n``
  rank chunks, row ``r`` of the buffer holding every gradient's chunk ``r``; reduce-scattered, this rank's
  row split back into its shards.

:meth:`BucketSync.issue` runs under the tag ``(ISSUE, k)`` and :meth:`BucketSync.finish` under ``(WAIT, k)``
(``runtime.record.tagged``), so in a recorded backward the issue of bucket ``k`` can be moved to right after
its last gradient (:func:`meshpilot.runtime.overlap.issue_when_ready`) while its wait stays at the end.

The reverse for ZeRO-3's parameter gathers (``StagePlan.param_gathers``): :func:`flat_shards` lays a group's
local shards one after the other, one all-gather makes row ``r`` of the result rank ``r``'s buffer, and
:func:`split_gathered` cuts each parameter's columns out of every row into what its own all-gather would have
returned (the rank pieces stacked along dim 0). ``runtime.overlap.group_gathers`` puts them in a recorded
program, tagged ``(GATHER, k)`` and ``(GATHER_WAIT, k)``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshpilot.graph.capture import OpGraph
from meshpilot.planner.buckets import GradBucket, GradMove, grad_move
from meshpilot.planner.plan import StagePlan
from meshpilot.runtime.record import tagged
from meshpilot.sharding.placements import from_json
from meshpilot.sharding.reshard import CollectiveKind

ISSUE, WAIT = "bucket", "bucket-wait"
"""Tags (first element) of a bucket's issuing ops and of its waiting ops in a recorded program."""
GATHER, GATHER_WAIT = "gather", "gather-wait"
"""Tags (first element) of a gather group's issuing ops and of its waiting and splitting ops."""

_funcol = torch.ops._c10d_functional


@dataclass(frozen=True)
class _Member:
    fqn: str
    move: GradMove


class BucketSync:
    """The buckets of one stage's plan whose parameters are all `trainable` here, ready to run on `mesh`."""

    def __init__(self, plan: StagePlan, graph: OpGraph, mesh: DeviceMesh, trainable: list[str]) -> None:
        mine = set(trainable)
        self.buckets: list[GradBucket] = []
        self.members: list[list[_Member]] = []
        for b in plan.grad_buckets:
            if not b.params or not set(b.params) <= mine:
                continue
            members = []
            for fqn in b.params:
                g = graph.grads[fqn]
                held = from_json(plan.node(g[0]).outs[g[1]])
                move = grad_move(held, plan.param_layout(fqn), graph[g[0]].outputs[g[1]].shape, plan.mesh_shape)
                if move is None or move.axis != b.axis or move.kind != b.kind:
                    raise RuntimeError(f"meshpilot internal error: bucket of {b.params} does not match {fqn}'s layouts")
                members.append(_Member(fqn, move))
            self.buckets.append(b)
            self.members.append(members)
        self.params = {m.fqn for ms in self.members for m in ms}
        """Every parameter whose gradient a bucket synchronises."""
        self.mesh = mesh

    def __bool__(self) -> bool:
        return bool(self.buckets)

    def issue(self, k: int, grads: list[torch.Tensor]) -> torch.Tensor:
        """Bucket `k`'s collective on `grads` (its parameters' local gradients, in its order): in flight."""
        b = self.buckets[k]
        group = self.mesh.get_group(b.axis).group_name
        with tagged((ISSUE, k)):
            if b.kind == CollectiveKind.ALL_REDUCE:
                # in place on the bucket's own buffer: the functional all_reduce would copy it first (one more
                # pass over every gradient byte per step, and a second bucket-sized buffer while in flight)
                flat = torch.cat([g.reshape(-1) for g in grads])
                return _funcol.all_reduce_(flat, "sum", group)
            n = self.mesh.size(b.axis)
            rows = [g.movedim(m.move.dim, 0).reshape(n, -1) for g, m in zip(grads, self.members[k])]
            flat = torch.cat(rows, dim=1).reshape(-1)
            return _funcol.reduce_scatter_tensor(flat, "sum", n, group)

    def finish(self, k: int, pending: torch.Tensor, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Wait for bucket `k` and split its result into the gradients in their parameters' layouts (`grads`:
        the local gradients it was issued on, for their shapes)."""
        b = self.buckets[k]
        with tagged((WAIT, k)):
            out = _funcol.wait_tensor(pending)
            if b.kind == CollectiveKind.ALL_REDUCE:
                parts = out.split([g.numel() for g in grads])
                return [p.view(g.shape) for p, g in zip(parts, grads)]
            n = self.mesh.size(b.axis)
            parts = out.split([g.numel() // n for g in grads])
            synced = []
            for p, g, m in zip(parts, grads, self.members[k]):
                moved = g.movedim(m.move.dim, 0).shape
                shard = p.reshape(moved[0] // n, *moved[1:]).movedim(0, m.move.dim)
                synced.append(shard.contiguous())
            return synced

    def run(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every bucket issued, then every bucket waited for: `grads` (local, by parameter) synchronised."""
        pending = []
        for k, members in enumerate(self.members):
            pending.append(self.issue(k, [grads[m.fqn] for m in members]))
        out = {}
        for k, members in enumerate(self.members):
            local = [grads[m.fqn] for m in members]
            out.update(zip((m.fqn for m in members), self.finish(k, pending[k], local)))
        return out


_aten = torch.ops.aten
_PAIRED = (_aten.t.default,)
"""Views that undo themselves when applied twice in a row (``t(t(x))`` is `x`, element for element)."""


def _written_chain(flat_view: torch.fx.Node) -> torch.fx.Node | None:
    """The ``mm`` whose output `flat_view` (a bucket member's ``view(g, [-1])``) flattens in its own element
    order, through ops that only view it (``view``, ``t`` twice in a row) and that nothing else reads; None if
    there is none. Such an ``mm`` can write into the bucket's buffer (``mm.out``) instead of being copied there."""
    x, ts = flat_view.args[0], []
    while isinstance(x, torch.fx.Node) and len(x.users) == 1 and x.op == "call_function":
        if x.target is _aten.view.default:
            if ts:  # a view between two transposes: the order is not the producer's
                return None
        elif x.target in _PAIRED:
            ts.append(x)
        elif x.target is _aten.mm.default:
            return x if len(ts) % 2 == 0 and not _split_pairs(ts) else None
        else:
            return None
        x = x.args[0]
    return None


def _split_pairs(ts: list[torch.fx.Node]) -> bool:
    """Whether the transposes walked back from a member are not adjacent pairs (each one's input the next)."""
    return any(ts[i].args[0] is not ts[i + 1] for i in range(0, len(ts), 2))


def write_into_buckets(gm: torch.fx.GraphModule) -> int:
    """Let each all-reduce bucket's gradients that an ``mm`` computes be computed into the bucket's buffer
    (``mm.out`` into its slice), as DDP's ``gradient_as_bucket_view`` has autograd write into its buckets: the
    buffer is allocated before the bucket's first such ``mm`` and only the other gradients (biases, norms'
    weights: the small ones) are copied in where the flattening ``cat`` was. The values are the ``cat``'s, bit
    for bit (the same kernel, writing into a contiguous slice of the same shape); the collective is the same one
    on the same buffer. Returns how many gradients are no longer copied.

    A recorded backward with its bucket issues (``runtime.buckets``: ``cat`` of ``view(g, [-1])`` tagged
    ``(ISSUE, k)``, then ``all_reduce_``) is what it looks for; anything else is left as it is. Run last: the
    collective reads what the ``mm.out`` ops wrote through the buffer, not through an edge of the graph, so no
    pass may reorder the program after it (``compile=True`` programs keep their ``cat``)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    from meshpilot.runtime.record import VAL

    moved = 0
    for cat in [n for n in graph.nodes if n.target is _aten.cat.default]:
        tag = cat.meta.get("meshpilot_tag")
        if not (isinstance(tag, tuple) and len(tag) == 2 and tag[0] == ISSUE) or len(cat.args) != 1 or cat.kwargs:
            continue
        users = list(cat.users)
        if len(users) != 1 or users[0].target is not _funcol.all_reduce_.default or users[0].args[0] is not cat:
            continue
        issue = users[0]
        members = cat.args[0]
        vals = [m.meta.get(VAL) if isinstance(m, torch.fx.Node) else None for m in members]
        whole = cat.meta.get(VAL)
        if whole is None or any(
            v is None or len(v[0]) != 1 or v[1] != whole[1] or m.target is not _aten.view.default or len(m.users) != 1
            for m, v in zip(members, vals)
        ):
            continue
        chains = [_written_chain(m) for m in members]
        mms = [mm for mm in chains if mm is not None and mm.meta.get(VAL, (None, None))[1] == whole[1]]
        if not mms:
            continue
        first = min(mms, key=order.get)
        sizes = [v[0][0] for v in vals]
        with graph.inserting_before(first):
            flat = graph.call_function(_aten.new_empty.default, (first.args[0], [whole[0][0]]), {"dtype": whole[1]})
            parts = graph.call_function(_aten.split_with_sizes.default, (flat, sizes))
            slices = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(sizes))]
        for k in (flat, parts, *slices):
            k.meta["meshpilot_tag"] = tag
        flat.meta[VAL] = whole
        rest: list[tuple[torch.fx.Node, torch.fx.Node]] = []
        for m, mm, part in zip(members, chains, slices):
            if mm is not None and mm in mms:
                with graph.inserting_before(mm):
                    slot = graph.call_function(_aten.view.default, (part, list(mm.meta[VAL][0])))
                    into = graph.call_function(_aten.mm.out, tuple(mm.args), {"out": slot})
                slot.meta["meshpilot_tag"] = tag  # the bucket's buffer; the product is the gradient's own op
                into.meta["meshpilot_tag"] = mm.meta.get("meshpilot_tag")
                into.meta[VAL] = mm.meta[VAL]
                mm.replace_all_uses_with(into)
                graph.erase_node(mm)
                moved += 1
            else:
                rest.append((part, m))
        if rest:  # the other gradients: copied in with one op where the ``cat`` was
            with graph.inserting_before(issue):
                copy = graph.call_function(_aten._foreach_copy_.default, ([p for p, _ in rest], [m for _, m in rest]))
            copy.meta["meshpilot_tag"] = tag
        issue.replace_input_with(cat, flat)
        graph.erase_node(cat)
        for m in members:  # the written members' flattening views (and the transposes before them): unread now
            x = m
            while isinstance(x, torch.fx.Node) and x.target in (_aten.view.default, *_PAIRED) and not x.users:
                src = x.args[0]
                graph.erase_node(x)
                x = src
    if moved:
        graph.lint()
        gm.recompile()
    return moved


def flat_shards(shards: list[torch.Tensor]) -> torch.Tensor:
    """A gather group's local shards as one flat buffer, one after the other (module docstring)."""
    return torch.cat([s.reshape(-1) for s in shards])


def split_gathered(out: torch.Tensor, n: int, shards: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The flat all-gather `out` of :func:`flat_shards`'s buffers on `n` ranks as each shard's own all-gather
    would return it: ``[n * d0, *rest]`` for a ``[d0, *rest]`` shard, rank ``r``'s piece at rows ``r * d0``;
    contiguous, as a collective's output is (a piece that stays a strided view of the rows, ``d0 == 1``, is
    copied: the program's later ``view`` ops were recorded on a contiguous gather — RWKV's)."""
    rows = out.view(n, -1)  # [n, sum of the shards' numel]: row r is rank r's buffer
    parts = rows.split([s.numel() for s in shards], dim=1)
    shaped = (p.reshape(n * s.shape[0], *s.shape[1:]) if s.dim() else p.reshape(n) for p, s in zip(parts, shards))
    return tuple(p.contiguous() for p in shaped)


__all__ = [
    "GATHER",
    "GATHER_WAIT",
    "ISSUE",
    "WAIT",
    "BucketSync",
    "flat_shards",
    "split_gathered",
    "write_into_buckets",
]
