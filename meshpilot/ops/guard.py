"""A guard: the value a Python branch read at capture, checked again on every step's batch.

Where the model's Python reads a tensor's value (``if (mask == 1).all():``, ``assert lengths.max().item() <=
slen``, ``.tolist()``), capture takes the branch the example inputs take and records a guard
(:mod:`meshpilot.graph.capture`): ``meshpilot::guard(loss, pred, expected, where)`` returns the loss unchanged
and raises :class:`GuardError` when ``pred`` (the tensor Python read, computed by the planned graph from the
batch) no longer holds the values ``expected`` it held at capture. So a plan is exact for every batch it
accepts and refuses the others in one line, never silently different.

The planner lays the predicate out replicated (the resharding into it, an all-reduce of a partial reduction or
an all-gather of a sharded one, is priced and counted like any other); the loss passes through in the layout it
has. Its gradient passes through unchanged.

A predicate is often a whole-tensor ``all()`` / ``any()`` of a sharded mask, which DTensor replicates first
(an all-gather of the mask, or no even strategy at all on a small batch): this module also plans them on the
shards, each rank reducing its own piece and the one-value results all-reduced (``min`` for ``all``, ``max``
for ``any``) over the mesh axes that shard the mask.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.errors import UserError
from meshpilot.graph.capture import OpNode
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.reshard import Collective, CollectiveKind
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

TARGET = "meshpilot.guard.default"
"""The guard's target as a captured graph records it (``OpNode.target``)."""


class GuardError(UserError):
    """A batch breaks a property of the values the plan's capture read (its branch would differ)."""


def _shown(values: list[float]) -> str:
    """Values as the model's Python read them: a bool or an integer as such, a few of a long list."""
    shown = [int(v) if float(v).is_integer() else v for v in values[:4]]
    text = ", ".join(str(v) for v in shown) + (", …" if len(values) > 4 else "")
    return text if len(values) == 1 else f"[{text}]"


@torch.library.custom_op("meshpilot::guard", mutates_args=())
def guard(value: Tensor, pred: Tensor, expected: list[float], where: str) -> Tensor:
    """`value` (a copy), after checking that `pred` holds `expected` (flattened); else one line naming `where`."""
    got = [float(v) for v in pred.detach().flatten().tolist()]
    if got != [float(v) for v in expected]:
        raise GuardError(
            f"the batch breaks a property the plan was captured with: {where} read {_shown(expected)} from the "
            f"example inputs and reads {_shown(got)} from this batch, so the branch the plan took would not be "
            "the model's; keep that property in every batch (e.g. the same padding or masking) or plan again with "
            "example inputs that have this batch's"
        )
    return value.clone()


@guard.register_fake
def _guard_fake(value, pred, expected, where):
    return torch.empty_like(value)


def _guard_backward(ctx, grad):
    return grad, None, None, None


guard.register_autograd(_guard_backward)


def _strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """The value passes through as it is laid out (replicated or a partial sum); the predicate replicated."""
    rules = [((Partial(),), (Partial(), Replicate())), ((Replicate(),), (Replicate(), Replicate()))]
    return per_axis_products(b, node, rules, require_first=False)


def _run(call: OwnCall, value: Tensor, pred: Tensor, expected, where) -> Tensor:
    """The check on the local pieces: the predicate is replicated, so each rank holds all of it."""
    return torch.ops.meshpilot.guard(value, pred, expected, where)


_FLAG_BYTES = 4
"""A whole reduction's local result travels as one int32 (gloo all-reduces no bool)."""


def _whole_reduction_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    """``all()`` / ``any()`` of the whole operand on its shards, the replicated one-value result all-reduced
    over each mesh axis that shards it."""
    src = b.graph[node.inputs[0][0]].outputs[node.inputs[0][1]]
    if src is None or len(node.inputs) != 1:
        return []
    rules = [((Replicate(),), (Shard(d),)) for d in range(len(src.shape))]
    rules += [((Replicate(),), (Replicate(),))]

    def colls(outs, ins):
        mesh = b.mesh_shape
        axes = [a for a, p in enumerate(ins[0]) if isinstance(p, Shard) and mesh[a] > 1]
        return tuple(Collective(CollectiveKind.ALL_REDUCE, a, _FLAG_BYTES) for a in axes)

    return per_axis_products(b, node, rules, colls, require_first=False)


def _run_whole_reduction(call: OwnCall, x: Tensor, *args, **kwargs) -> Tensor:
    """This rank's piece reduced, then the flags of the shards combined (all: the minimum; any: the maximum)."""
    local = call.node.fx_node.target(x, *args, **kwargs)
    axes = [a for a, p in enumerate(call.ins[0]) if isinstance(p, Shard) and call.mesh.size(a) > 1]
    if not axes:
        return local
    op = "min" if "all" in str(call.node.target) else "max"
    return call.all_reduce(local.to(torch.int32), op, axes).to(local.dtype)


OPS = (
    OwnOp(TARGET, _strategies, _run, exclusive=True),
    OwnOp("aten.all.default", _whole_reduction_strategies, _run_whole_reduction),
    OwnOp("aten.any.default", _whole_reduction_strategies, _run_whole_reduction),
    # torch.distributions' argument checks (Gemma-3n's Normal.icdf): ``all()`` as a one-value bool tensor
    OwnOp("aten._is_all_true.default", _whole_reduction_strategies, _run_whole_reduction),
)
