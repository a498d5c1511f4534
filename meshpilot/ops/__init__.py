"""meshpilot's own operators: one registry holding, per ATen op, its strategies and its implementation.

DTensor knows how to shard most ops. Where it does not, or where its way is not exact, meshpilot brings its
own: an :class:`OwnOp` names the op, the strategies the planner may choose (planning side, pure) and the
function that runs the op on the local shards (runtime side), so the two never drift apart.

================================  ==========================================================================
module                            ops
================================  ==========================================================================
:mod:`~meshpilot.ops.vocab`       vocabulary-parallel embedding (+ backward) and cross-entropy
                                  (``_log_softmax``, ``nll_loss_forward`` and their backward)
:mod:`~meshpilot.ops.dropout`     ``native_dropout`` exact under any sharding (exclusive)
:mod:`~meshpilot.ops.fill`        ``fill`` and functional ``copy`` (output takes an operand's shape only)
:mod:`~meshpilot.ops.stack`       ``stack`` of operands in one common layout (DTensor's follows the first
                                  operand's producers only)
:mod:`~meshpilot.ops.index_add`   ``index_add`` (``index_select``'s backward) sharded off its indexed dim
:mod:`~meshpilot.ops.unfold`      ``Tensor.unfold`` (sliding windows) and its backward, off the unfolded dim
:mod:`~meshpilot.ops.batched`     ``im2col``, ``col2im``, ``avg_pool2d_backward``: sample- (channel-) parallel
:mod:`~meshpilot.ops.batch_norm`  training BatchNorm with batch-sharded statistics reduced across ranks, its
                                  backward, and running statistics exactly as one device computes them
:mod:`~meshpilot.ops.attention`   the device-generic ``meshpilot::sdpa`` pair (a custom op: its strategies
                                  live in DTensor's propagator, DTensor runs it)
:mod:`~meshpilot.ops.pointwise`   DTensor's pointwise strategy for untagged elementwise backwards
                                  (``softplus_backward``, …)
:mod:`~meshpilot.ops.moe`         dropless top-k experts ``meshpilot::moe_experts`` pair (a custom op, HF's
                                  experts path): replicated, data- and expert-parallel (variable all-to-all)
:mod:`~meshpilot.ops.causal_rows` the attention pair's ``is_causal`` calls sharded by query rows (context
                                  parallelism; each rank's rows know their offset)
:mod:`~meshpilot.ops.ring`        ring attention: q, k, v sequence-sharded, key/value blocks passed round
                                  the axis by send/recv (registered for the pair, with causal_rows' rules)
:mod:`~meshpilot.ops.guard`       ``meshpilot::guard``: a value a Python branch read at capture, checked on
                                  every batch (the predicate replicated; the loss passes through)
================================  ==========================================================================

An own strategy may issue collectives inside the op (``Strategy.colls``); the ILP prices them on the node
and the plan lists them, so the collectives a run issues still equal the plan's. Most ops issue them after
their computation and wait at once; an op may instead run in steps (:class:`OpPart`) with its first
:attr:`OwnOp.leading` collectives issued before its computation and left in flight (its :attr:`OwnOp.in_flight`
kernels, waited by a later ``wait_tensor``): the expert-parallel MoE's dispatch and combine, which HiDup's
duplex hides behind the other microbatch's compute (the schedule, the simulator and the runtime read these
two fields). An *exclusive* op offers
only meshpilot's strategies: DTensor's would run but not exactly (dropout draws each shard's mask from the
local generator; BatchNorm would use per-shard batch statistics).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch


@dataclass(frozen=True)
class OwnOp:
    """One op meshpilot plans and runs itself."""

    target: str
    """The ATen op, as captured graphs name it (``aten.native_dropout.default``)."""
    strategies: Callable[..., list]
    """``(builder: StrategyBuilder, node: OpNode) -> list[Strategy]`` with source ``meshpilot``."""
    run: Callable[..., Any]
    """``(call: OwnCall, *args, **kwargs)`` on the local shards; returns the local outputs."""
    exclusive: bool = False
    """Offer only these strategies (DTensor's would not be exact)."""
    leading: int = 0
    """How many of a strategy's own collectives (``Strategy.colls``, in order) the op issues *before* its
    computation (an MoE's per-expert counts and dispatch); the rest come after it (the combine). 0: all after
    (the op computes, then communicates). The duplex schedule issues the leading ones a stage early and waits
    for the rest a stage late; the simulator places them so (``meshpilot.sim``)."""
    inside: Callable[..., float] | None = None
    """``(node, strategy, mesh_shape) -> bytes`` the op's kernel holds at its peak beyond its operands, for the
    memory model (``accounting.liveness``): ring attention's key/value blocks in flight. None: its outputs."""
    in_flight: tuple[str, ...] = ()
    """Targets of the kernels :attr:`run` records that return a collective's output while it is still in
    flight (the program waits for it with ``_c10d_functional.wait_tensor``): collectives to the runtime's
    reordering passes (``meshpilot.runtime.overlap.is_collective``)."""


class OpPart(StrEnum):
    """Which step of an own op's work a recorded kernel belongs to, relative to the op's computation (the
    runtime records it as ``node.meta["meshpilot_part"]``, ``meshpilot.runtime.record.in_part``)."""

    LEAD = "lead"
    """Before the computation, up to issuing the leading collectives (:attr:`OwnOp.leading`): duplex runs it
    in the stage before the op's."""
    BODY = "body"
    """The computation, from waiting for the leading collectives to issuing the trailing ones (the default)."""
    TAIL = "tail"
    """After the computation, from waiting for the trailing collectives on: duplex runs it in the stage after
    the op's."""


class OwnCall:
    """What an own op's implementation knows about the call it serves: the node, the mesh and the planned
    layouts of its operands (``ins``) and outputs (``outs``); a per-node cache for values that depend on
    them only (this rank's range of a sharded dim); the plan's sequence order (``StagePlan.sequence_order``:
    None, contiguous, or zig-zag on one axis), which ring attention and ``causal_rows`` read."""

    __slots__ = ("node", "mesh", "ins", "outs", "cache", "sequence_order")

    def __init__(self, node, mesh, ins, outs, sequence_order=None) -> None:
        self.node, self.mesh, self.ins, self.outs = node, mesh, ins, outs
        self.cache: dict = {}
        self.sequence_order = sequence_order

    def global_shape(self, arg: int) -> torch.Size:
        """Global shape of the node's `arg`-th positional argument."""
        return self.node.fx_node.args[arg].meta["val"].shape

    def local_range(self, global_shape, placements, dim: int) -> tuple[int, int]:
        """(first index, length) along `dim` of this rank's shard of a tensor laid out as `placements`."""
        key = ("range", tuple(global_shape), tuple(placements), dim)
        hit = self.cache.get(key)
        if hit is None:
            shape, offset = _local_shape_and_offset(global_shape, self.mesh, placements)
            hit = self.cache[key] = (int(offset[dim]), int(shape[dim]))
        return hit

    def local_slices(self, global_shape, placements) -> tuple[slice, ...]:
        """This rank's block of a tensor of `global_shape` laid out as `placements` (Partial axes: all of it)."""
        key = ("slices", tuple(global_shape), tuple(placements))
        hit = self.cache.get(key)
        if hit is None:
            shape, offset = _local_shape_and_offset(global_shape, self.mesh, placements)
            hit = self.cache[key] = tuple(slice(int(o), int(o) + int(s)) for o, s in zip(offset, shape))
        return hit

    def sharding_axes(self, placements, dim: int) -> list[int]:
        """Mesh axes of more than one device that shard tensor dim `dim` in `placements`."""
        return [a for a, p in enumerate(placements) if p.is_shard(dim) and self.mesh.size(a) > 1]

    def axis_group(self, a: int) -> tuple[str, str, int]:
        """Mesh axis `a`'s process group name, axis name and size: what an op that communicates on it itself
        (the experts' all-to-alls, the ring's sends) carries in its call."""
        from meshpilot.cluster.mesh import default_axis_names

        names = self.mesh.mesh_dim_names or default_axis_names(self.mesh.ndim)
        return self.mesh.get_group(a).group_name, names[a], self.mesh.size(a)

    def all_reduce(self, t: torch.Tensor, op: str, axes: list[int]) -> torch.Tensor:
        """`t` all-reduced with `op` over each mesh axis in turn, as functional collectives (what DTensor
        issues, so the collective counter sees them)."""
        for a in axes:
            t = torch.ops._c10d_functional.all_reduce(t.contiguous(), op, self.mesh.get_group(a).group_name)
            t = torch.ops._c10d_functional.wait_tensor(t)
        return t


def _local_shape_and_offset(global_shape, mesh, placements):
    from meshpilot import compat

    return compat.local_shape_and_offset()(torch.Size(global_shape), mesh, tuple(placements))


_OP_MODULES = (
    "vocab", "dropout", "batch_norm", "fill", "stack", "index_add", "unfold", "batched", "moe", "ring", "guard",
)  # fmt: skip
"""The modules whose ``OPS`` make the registry, in the order a later one's entry would win."""

_SELF_DEFINED = frozenset({"moe", "guard"})
"""Op modules whose every op is a custom op the module itself defines (``torch.library.custom_op``): until the
module is imported no graph can hold one of its ops, so the registry leaves it out until then. Defining the
experts' eleven custom ops costs 25–50 ms of CPU after planning's imports (torch looks up each function's
source file), which planning a model without experts need not pay (``docs/benchmarks.md``, issue 33 item 4).
The guard is the same: capture imports it where a Python branch read a value (``graph.capture``), and a model
that reads none is planned without defining it — ≈25 ms of CPU, most of it ``inspect.getmodule`` resolving the
path of every module imported since its last call (torch's ``_register_fake`` looks up the defining line)."""


def registry() -> dict[str, OwnOp]:
    """Every own op by target (imports the op modules once; a :data:`_SELF_DEFINED` one only once it is loaded,
    by whatever defines its ops: the model's source, its tests)."""
    return _registry(_self_defined_loaded())


def _self_defined_loaded() -> tuple[str, ...]:
    """The :data:`_SELF_DEFINED` op modules imported so far."""
    return tuple(m for m in sorted(_SELF_DEFINED) if f"{__name__}.{m}" in sys.modules)


@functools.cache
def _registry(self_defined: tuple[str, ...]) -> dict[str, OwnOp]:
    """The registry with the :data:`_SELF_DEFINED` modules `self_defined` and every other op module."""
    import importlib

    ops: dict[str, OwnOp] = {}
    for name in _OP_MODULES:
        if name in _SELF_DEFINED and name not in self_defined:
            continue
        for op in importlib.import_module(f"{__name__}.{name}").OPS:
            ops[op.target] = op
    return ops


def own_op(target: str) -> OwnOp | None:
    """The own op for an ATen target name, if meshpilot has one. A ``meshpilot.`` target the registry lacks
    loads the :data:`_SELF_DEFINED` modules first (a saved plan read in a process that never defined them)."""
    op = registry().get(target)
    if op is None and str(target).startswith("meshpilot.") and len(_self_defined_loaded()) < len(_SELF_DEFINED):
        import importlib

        for name in _SELF_DEFINED:
            importlib.import_module(f"{__name__}.{name}")
        op = registry().get(target)
    return op


def leading_collectives(target: str) -> int:
    """:attr:`OwnOp.leading` of the op `target` (0 for any other op)."""
    op = own_op(target)
    return op.leading if op is not None else 0


def in_flight_targets() -> frozenset[str]:
    """Every own op's :attr:`OwnOp.in_flight` kernel targets (of the op modules loaded: :func:`registry`)."""
    return _in_flight(_self_defined_loaded())


@functools.cache
def _in_flight(self_defined: tuple[str, ...]) -> frozenset[str]:
    return frozenset(t for op in _registry(self_defined).values() for t in op.in_flight)


_REGISTERED = False


def register_dtensor_strategies() -> None:
    """Strategies meshpilot adds to DTensor's propagator: the attention pair, GroupNorm's backward, the
    convolution's channel-parallel rules, the pointwise rule for untagged elementwise backwards, and LayerNorm's
    and RMSNorm's backward where torch's own is not exact (``ops.norm_backward``: torch 2.11) (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from meshpilot.ops import attention, conv, group_norm, norm_backward, pointwise

    attention.register_strategies()
    norm_backward.register()
    pointwise.register_strategies()
    group_norm.register_backward_strategy()
    conv.register_channel_strategies()
    _REGISTERED = True


def unavailable(target: str) -> str | None:
    """Why an op that meshpilot could shard has no strategy on this torch (a moved private symbol)."""
    from meshpilot.ops import group_norm

    if target == str(group_norm.OP):
        return group_norm.missing_reason()
    return None
