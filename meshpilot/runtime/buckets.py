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


__all__ = ["GATHER", "GATHER_WAIT", "ISSUE", "WAIT", "BucketSync", "flat_shards", "split_gathered"]
