"""Run a range of a planned graph's nodes on DTensors: the reference executor that programs are traced from.

For each node the operands are redistributed to the layouts the planned strategy needs (exactly the plan's
resharding edges, with DTensor's transform steps: :func:`redistribute`), then the node runs one of four ways
(:class:`ExecMode`, chosen once per node in :class:`NodeCall`):

* ``dtensor`` — DTensor's dispatcher runs the op; its inputs match the planned strategy, so it takes it;
* ``own`` — one of meshpilot's own strategies (:mod:`meshpilot.ops`), run on the local shards;
* ``local`` — the op runs on the local shards and its outputs are labelled with the planned layouts:
  convolution forward and backward (DTensor's handler rejects a batch sharded over two mesh axes), and the
  DTensor-planned ops whose DTensor run is that same local call (:func:`runs_on_shards`: matrix products and
  pointwise ops), where DTensor's dispatcher would only find again the strategy the plan fixed;
* ``fallback`` — no strategy: the op runs on full replicas of its operands, its outputs are replicated.

Views run as the layout actually held allows: the captured graph is functional, so a ``view`` whose local
operand cannot be viewed to the planned local shape (a layout change left it non-contiguous where the trace
had a contiguous tensor) runs on a contiguous copy — reshape semantics, exact because nothing writes through
views (:func:`_viewable`). Nothing here depends on the strides the trace saw.

:class:`Interpreter` holds the prepared calls of one plan on one mesh; :meth:`Interpreter.run` executes a list
of nodes on an environment ``{node: (value per output)}``. :mod:`meshpilot.runtime.program` traces it.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from meshpilot import compat
from meshpilot.graph.capture import NodeKind, OpGraph, OpNode
from meshpilot.graph.views import STRICT_VIEWS
from meshpilot.ops import OwnCall, own_op
from meshpilot.planner.plan import NodeChoice, StagePlan
from meshpilot.runtime.record import outside_program, tagged
from meshpilot.sharding.placements import Placements, from_json, replicated
from meshpilot.sharding.reshard import via_replicate
from meshpilot.sharding.strategies import StrategySource

aten = torch.ops.aten


class ExecMode(StrEnum):
    """How the runtime runs a node (module docstring)."""

    DTENSOR = "dtensor"
    OWN = "own"
    LOCAL = "local"
    FALLBACK = "fallback"


# Convolutions run on the local shards: exact for any strategy of their sharding rule, and DTensor's own
# handler rejects a batch sharded over two mesh axes (``S(0)S(0)``).
_LOCAL_OPS = {aten.convolution.default, aten.convolution_backward.default}

# DTensor runs these as the same op on the local shards under any of their strategies (no argument rewritten,
# no collective inside): given the plan's input layouts its dispatcher would only find again the plan's strategy
# (``sharding.strategies`` keeps only those it picks), by a sharding propagation that on a cache miss costs more
# than the op (a new shape, mesh or layout: every op of a first step).
_ON_SHARDS = [True]
"""Whether :func:`runs_on_shards` ops skip DTensor's dispatcher (``tests/test_record_programs.py``: both ways)."""
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def runs_on_shards(target: Any, ins: tuple[Placements, ...], outs: tuple[Placements | None, ...]) -> bool:
    """Whether a node DTensor's strategy covers (planned input layouts `ins`, output layouts `outs`) computes
    what DTensor would by running `target` on the local shards and labelling the outputs `outs`: a matrix
    product under any strategy (its partial sums are linear); a pointwise op that neither writes in place nor
    draws random numbers (DTensor offsets a sharded tensor's generator), with no partial sum among its layouts
    (DTensor may redistribute one against a scalar operand)."""
    if not isinstance(target, torch._ops.OpOverload) or not outs or any(o is None for o in outs):
        return False
    if target in _MATMULS:
        return True
    tags = target.tags
    if torch.Tag.pointwise not in tags or torch.Tag.nondeterministic_seeded in tags or target._schema.is_mutable:
        return False
    return not any(p.is_partial() for pl in (*ins, *outs) for p in pl)


# Views whose result depends on the operand's strides: run on a contiguous copy when the local operand
# cannot be viewed to the planned shape.


def redistribute(x: DTensor, placements: Placements) -> DTensor:
    """``x`` in `placements` (Partial targets allowed), by DTensor's own transform steps; no autograd. Layouts
    that differ only on mesh axes of one device are the same tensor: relabelled, no collective. A shard that
    must become a partial sum is gathered first (``sharding.reshard.via_replicate``, as the planner prices it)."""
    placements = tuple(placements)
    if tuple(x.placements) == placements:
        return x
    via = via_replicate(tuple(x.placements), placements)
    if via is not None:
        x = redistribute(x, via)
    spec_cls, _ = compat.dtensor_spec()
    spec = spec_cls(x.device_mesh, placements, tensor_meta=x._spec.tensor_meta)
    sizes = x.device_mesh.shape
    if all(a == b or n == 1 for a, b, n in zip(x.placements, placements, sizes)):
        return DTensor(x._local_tensor, spec, requires_grad=False)
    local = compat.redistribute_local_tensor()(x._local_tensor, x._spec, spec)
    return DTensor(local, spec, requires_grad=False)


def to_dtensor(x: torch.Tensor, mesh: DeviceMesh, layout: Placements) -> DTensor:
    """A DTensor of the (replicated, identical on every rank) tensor `x` in `layout`: a local slice."""
    if isinstance(x, DTensor):
        return redistribute(x, layout)
    d = DTensor.from_local(x, mesh, replicated(mesh.ndim), run_check=False)
    return redistribute(d, layout)


def wrap_local(local: torch.Tensor, mesh: DeviceMesh, placements: Placements, global_val: torch.Tensor) -> DTensor:
    """A DTensor of `local` (this rank's piece) in `placements`, of `global_val`'s global shape."""
    spec_cls, meta_cls = compat.dtensor_spec()
    meta = meta_cls(global_val.shape, global_val.stride(), global_val.dtype)
    want = local_shape(global_val.shape, mesh, placements)
    if tuple(local.shape) != want:  # a mislabelled value would compute silently wrong or fail far away
        raise RuntimeError(
            f"meshpilot internal error: a local piece of shape {tuple(local.shape)} labelled "
            f"{tuple(placements)} of a {tuple(global_val.shape)} tensor (expected {want})"
        )
    return DTensor(local, spec_cls(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def permute_sequence(x: torch.Tensor, dim: int, order) -> torch.Tensor:
    """`x` (whole, not a DTensor) with its sequence dim `dim` in the plan's order (``StagePlan.sequence_order``):
    the zig-zag chunks one after another (``ops.ring.zigzag_positions``)."""
    from meshpilot.ops.ring import zigzag_positions

    if isinstance(x, DTensor) or x.shape[dim] != order.length:
        raise RuntimeError(
            f"meshpilot internal error: a {order.order} sequence of {order.length} permuted on dim {dim} of a "
            f"{'DTensor' if isinstance(x, DTensor) else 'tensor'} of shape {tuple(x.shape)}"
        )
    return x.index_select(dim, zigzag_positions(order.length, order.peers, x.device))


def local_shape(global_shape, mesh: DeviceMesh, placements: Placements) -> tuple[int, ...]:
    shape, _ = compat.local_shape_and_offset()(torch.Size(global_shape), mesh, tuple(placements))
    return tuple(int(s) for s in shape)


class NodeCall:
    """How the runtime calls one node, prepared once: the planned layouts parsed, the execution mode, and
    the op's arguments as a template whose tensor slots take the operands."""

    __slots__ = (
        "node",
        "target",
        "ins",
        "outs",
        "vals",
        "mode",
        "own",
        "_leaves",
        "_slots",
        "_spec",
        "_nargs",
        "_keys",
        "permute",
    )

    def __init__(
        self, node: OpNode, choice: NodeChoice, mesh: DeviceMesh, device: torch.device, sequence_order=None
    ) -> None:
        fx = node.fx_node
        self.node = node
        self.target = fx.target
        self.ins = tuple(tuple(from_json(p)) for p in choice.ins)
        self.outs = tuple(tuple(from_json(p)) if p is not None else None for p in choice.outs)
        vals = fx.meta.get("val")
        self.vals = tuple(vals) if isinstance(vals, (tuple, list)) else (vals,)
        op = own_op(node.target) if choice.source == StrategySource.MESHPILOT else None
        self.own = OwnCall(node, mesh, self.ins, self.outs, sequence_order) if op is not None else None
        if choice.source == StrategySource.FALLBACK:
            self.mode = ExecMode.FALLBACK
        elif op is not None:
            self.mode = ExecMode.OWN
        elif fx.target in _LOCAL_OPS or (
            _ON_SHARDS[0] and choice.source == StrategySource.DTENSOR and runs_on_shards(fx.target, self.ins, self.outs)
        ):
            self.mode = ExecMode.LOCAL
        else:
            self.mode = ExecMode.DTENSOR
        top = (*fx.args, *fx.kwargs.values())
        nested = any(
            isinstance(a, (list, tuple, dict)) and any(isinstance(x, torch.fx.Node) for x in pytree.tree_leaves(a))
            for a in top
        )
        # flat: one leaf per top-level argument (constant lists such as a view's shape stay whole)
        leaves, spec = pytree.tree_flatten((fx.args, fx.kwargs)) if nested else (list(top), None)
        self._leaves, self._slots = [], []
        k = 0
        for pos, a in enumerate(leaves):
            if isinstance(a, torch.fx.Node):
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    self._slots.append((pos, k))
                    k += 1
                    a = None
                else:
                    a = v
            elif isinstance(a, torch.device):
                # Capture ran on CPU or meta tensors, so factories (arange) and casts (_to_copy under
                # autocast or a dtype change) carry that device as an argument: run them on this rank's.
                a = device
            self._leaves.append(a)
        self._spec = spec
        self._nargs = len(fx.args)
        self._keys = tuple(fx.kwargs)
        self.permute = None
        """(dim, order) where the node is a position factory the plan's sequence order permutes."""
        if sequence_order is not None:
            from meshpilot.planner.recompute import original

            dims = dict(sequence_order.factories)
            dim = dims.get(node.name, dims.get(original(node.name)))  # a recomputed copy: its original's
            if dim is not None:
                self.permute = (dim, sequence_order)

    def arguments(self, operands: list) -> tuple[tuple, dict]:
        vals = list(self._leaves)
        for pos, k in self._slots:
            vals[pos] = operands[k]
        if self._spec is None:
            n = self._nargs
            return tuple(vals[:n]), dict(zip(self._keys, vals[n:]))
        return pytree.tree_unflatten(vals, self._spec)


class Interpreter:
    """Executes nodes of one plan's graph on one mesh (module docstring)."""

    def __init__(self, graph: OpGraph, plan: StagePlan, mesh: DeviceMesh, device: torch.device) -> None:
        self.graph, self.plan, self.mesh, self.device = graph, plan, mesh, device
        self.calls: dict[str, NodeCall] = {}
        self.mismatches: list[str] = []
        """Nodes where DTensor chose another output layout than the plan (redistributed to the plan's)."""
        self.copied_views = 0
        """Views whose held layout could not be viewed as traced, run on a contiguous copy instead."""

    def leaf(self, node: OpNode, value: torch.Tensor) -> DTensor:
        """The DTensor of a leaf (parameter, buffer, input or constant) in its planned layout."""
        if isinstance(value, DTensor):
            return value
        if node.kind == NodeKind.CONST:
            value = value.to(self.device)
        order = self.plan.sequence_order
        if order is not None and node.kind == NodeKind.INPUT:
            dim = dict(order.inputs).get(int(str(node.fqn).split(":")[1]))
            if dim is not None:  # the step runs on the permuted sequence (``planner.sequence_order``)
                value = permute_sequence(value, dim, order)
        layout = self.plan.node(node.name).out_placements(0)
        return to_dtensor(value, self.mesh, layout)

    def run(self, nodes: Iterable[OpNode], env: dict[str, tuple], last_use: dict[str, int] | None = None) -> None:
        """Execute `nodes` (ops and getitems, in graph order) on `env`, freeing values after their last use."""
        for node in nodes:
            if node.kind == NodeKind.GETITEM:
                src, i = node.inputs[0]
                v = env[src][i]
                # The plan may take the element in another layout than its producer left it (an edge
                # like any other, priced by the search): reshard here, or the value would be labelled
                # with a layout it does not hold.
                want = self.plan.node(node.name).in_placements(0) if isinstance(v, DTensor) else None
                if want is not None and tuple(v._spec.placements) != tuple(want):
                    with tagged((node.index, 0)):
                        v = redistribute(v, want)
                env[node.name] = (v,)
            else:
                env[node.name] = self.call(node, env)
            if last_use is not None:
                for s, _ in node.inputs:
                    if last_use.get(s, -1) <= node.index and s in env:
                        del env[s]

    def call(self, node: OpNode, env: dict[str, tuple]) -> tuple:
        ex = self.calls.get(node.name)
        if ex is None:
            choice = self.plan.node(node.name)
            ex = self.calls[node.name] = NodeCall(node, choice, self.mesh, self.device, self.plan.sequence_order)
        operands = []
        for a, (src, i) in enumerate(node.inputs):
            v = env[src][i]
            want = ex.ins[a]
            if isinstance(v, DTensor) and v._spec.placements != want:
                with tagged((node.index, a)):  # the resharding edge into operand a
                    v = redistribute(v, want)
            if ex.mode != ExecMode.DTENSOR and isinstance(v, DTensor):
                v = v._local_tensor
            operands.append(v)
        with tagged((node.index, -1)):
            if ex.mode == ExecMode.DTENSOR and str(ex.target) in STRICT_VIEWS:
                operands[0] = self._viewable(operands[0], ex)
            args, kwargs = ex.arguments(operands)
            if ex.mode == ExecMode.OWN:
                out = own_op(node.target).run(ex.own, *args, **kwargs)
            else:
                out = ex.target(*args, **kwargs)
            outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            if ex.permute is not None:  # a position factory of a zig-zag plan: made permuted
                outs = (permute_sequence(outs[0], *ex.permute), *outs[1:])
            return tuple(self._label(node, ex, i, o) for i, o in enumerate(outs))

    def _label(self, node: OpNode, ex: NodeCall, i: int, o: Any) -> Any:
        """Output `i` as a DTensor in its planned layout."""
        want = ex.outs[i] if i < len(ex.outs) else None
        if not isinstance(o, torch.Tensor):
            return o
        if ex.mode in (ExecMode.LOCAL, ExecMode.OWN):
            if want is not None and isinstance(ex.vals[i], torch.Tensor):
                return wrap_local(o, self.mesh, want, ex.vals[i])
            return o
        if not isinstance(o, DTensor):
            o = DTensor.from_local(o, self.mesh, replicated(self.mesh.ndim), run_check=False)
            return redistribute(o, want) if want is not None and want != o._spec.placements else o
        if want is not None and o._spec.placements != want:
            sizes = self.mesh.shape
            if not all(a == b or n == 1 for a, b, n in zip(o._spec.placements, want, sizes)):
                self.mismatches.append(f"{node.name}: DTensor chose {o.placements}, plan says {want}")
            return redistribute(o, want)
        return o

    def _viewable(self, x: DTensor, ex: NodeCall) -> DTensor:
        """`x`, or a contiguous copy of it if its local tensor cannot be viewed to the planned local shape."""
        local = x._local_tensor
        if local.is_contiguous() or ex.outs[0] is None:
            return x
        shape = local_shape(ex.vals[0].shape, self.mesh, ex.outs[0])
        with outside_program():  # a trial, not part of the program
            try:
                local.view(shape)
                return x
            except RuntimeError:
                pass
        self.copied_views += 1
        return DTensor(local.contiguous(), x._spec, requires_grad=False)
