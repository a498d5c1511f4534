"""An :class:`~meshpilot.graph.capture.OpGraph` as plain data, so that a capture pickles and one process's capture
serves others (a launch's ranks, a test's ranks) instead of each tracing the model again.

A capture does not pickle as it is made. What stops it, and what travels instead:

* the fx graph: its namespace and node lookup table hold the traced callables (torch's decompositions, such as
  a wrapped ``nll_loss_forward`` that is not the module's own function) and C++ hooks. The graph travels as its
  nodes in order, each its op, name, target, arguments (a node they read by name) and ``meta``; the constants
  its ``get_attr`` nodes read travel as tensors;
* fake tensors (``meta["val"]``, ``meta["eager_input_vals"]``): they keep their ``FakeTensorMode`` through weak
  references. Each travels as its shape, strides, storage offset, dtype, device and ``requires_grad``
  (:class:`_FakeSpec`) and comes back a fake tensor of one fresh mode per graph; a value several nodes share
  (``graph.replicate``'s copies of a block share the template's) comes back shared. Which values shared a
  storage is not kept (nothing after the capture reads storages);
* operators (a node's target, ``meta["original_aten"]``): pybind objects. Each travels as its name
  (``aten.mm.default``) and is looked up in ``torch.ops`` again; meshpilot's own ops
  (``meshpilot::sdpa``, the experts', the guard) are defined first where the process has not yet;
* ``OpNode.fx_node``: travels as the name of its fx node and is linked to the rebuilt graph's node of that name.

Everything else of an ``OpGraph`` and of a node's ``meta`` pickles as it is, so what cannot pickle later (a
new meta key holding a function defined inside another) fails loudly rather than travelling wrong.
``tests/test_portable_graph.py`` pickles the captures of the test models and compares every node and key.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.fx.node import map_arg

from meshpilot import compat

if TYPE_CHECKING:
    from meshpilot.graph.capture import OpGraph

_TENSOR_KEYS = ("val", "eager_input_vals")
"""``node.meta`` keys whose values hold fake tensors (alone or in tuples, lists and dicts)."""

_OP_KEYS = ("original_aten",)
"""``node.meta`` keys whose value is an operator."""

_OWN_OP_MODULES = ("meshpilot.ops.attention", "meshpilot.ops.ring_kernels", "meshpilot.ops.moe", "meshpilot.ops.guard")
"""The modules that define meshpilot's custom ops (``torch.library.custom_op``): imported when a graph names
one this process has not defined."""


@dataclass(frozen=True)
class _FakeSpec:
    """A fake tensor as data: enough to make one with the same metadata."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class _OpName:
    """An operator by its name (``aten.mm.default``)."""

    name: str


@dataclass(frozen=True)
class _Ref:
    """An fx node named in another's arguments."""

    name: str


def graph_state(graph: OpGraph) -> dict[str, Any]:
    """`graph`'s pickled state: its fields, the fx graph as :func:`_fx_state`, each node's fx node by name."""
    state = {k: v for k, v in graph.__dict__.items() if k not in ("by_name", "users", "gm")}
    state["gm"] = _fx_state(graph.gm)
    state["fx_names"] = [None if n.fx_node is None else n.fx_node.name for n in graph.nodes]
    return state


def restore(graph: OpGraph, state: dict[str, Any]) -> None:
    """Fill `graph` (made without ``__init__``) from :func:`graph_state`'s `state`."""
    state = dict(state)
    gm = _from_fx_state(state.pop("gm"))
    fx_names = state.pop("fx_names")
    graph.__dict__.update(state)
    graph.gm = gm
    fx_by_name = {n.name: n for n in gm.graph.nodes}
    for node, name in zip(graph.nodes, fx_names):
        node.fx_node = None if name is None else fx_by_name[name]
    graph.__post_init__()


def _fx_state(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """`gm` as data: per node in order (op, name, target, arguments with :class:`_Ref` for nodes, type, meta
    with :class:`_FakeSpec` and :class:`_OpName` where the module docstring says), its constants, its meta."""
    fake_type = compat.require("torch._subclasses.fake_tensor.FakeTensor")
    fakes: dict[int, _FakeSpec] = {}  # by the fake tensor's id: a value shared by nodes travels once

    def portable_value(v: Any) -> Any:
        if isinstance(v, fake_type):
            spec = fakes.get(id(v))
            if spec is None:
                spec = fakes[id(v)] = _FakeSpec(
                    tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, v.device, v.requires_grad
                )
            return spec
        if isinstance(v, (tuple, list)):
            return _same_kind(v, [portable_value(x) for x in v])
        if isinstance(v, dict):
            return {k: portable_value(x) for k, x in v.items()}
        return v

    nodes = []
    consts: dict[str, Any] = {}
    for n in gm.graph.nodes:
        meta = dict(n.meta)
        for key in _TENSOR_KEYS:
            if key in meta:
                meta[key] = portable_value(meta[key])
        for key in _OP_KEYS:
            if isinstance(meta.get(key), torch._ops.OpOverload):
                meta[key] = _OpName(str(meta[key]))
        target = _OpName(str(n.target)) if isinstance(n.target, torch._ops.OpOverload) else n.target
        if n.op == "get_attr":
            consts[n.target] = _attr(gm, n.target)
        args, kwargs = map_arg((n.args, n.kwargs), lambda a: _Ref(a.name))
        nodes.append((n.op, n.name, target, args, kwargs, n.type, meta))
    return {"nodes": nodes, "consts": consts, "meta": dict(gm.meta)}


def _attr(gm: torch.nn.Module, target: str) -> Any:
    """The attribute a ``get_attr`` node reads (`target` may be dotted)."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _from_fx_state(state: dict[str, Any]) -> torch.fx.GraphModule:
    """The graph module :func:`_fx_state` wrote: the same nodes, names, targets, arguments and meta, its fake
    values those of one new ``FakeTensorMode``."""
    mode = compat.fake_tensor_mode()(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}  # by the spec's id: pickle gives one spec object per value that was shared

    def fake(spec: _FakeSpec) -> torch.Tensor:
        t = fakes.get(id(spec))
        if t is None:
            t = fakes[id(spec)] = _make_fake(mode, spec)
        return t

    def live_value(v: Any) -> Any:
        if isinstance(v, _FakeSpec):
            return fake(v)
        if isinstance(v, (tuple, list)):
            return _same_kind(v, [live_value(x) for x in v])
        if isinstance(v, dict):
            return {k: live_value(x) for k, x in v.items()}
        return v

    graph = torch.fx.Graph()
    made: dict[str, torch.fx.Node] = {}
    for op, name, target, args, kwargs, type_expr, meta in state["nodes"]:
        args, kwargs = _relink((args, kwargs), made)
        target = _operator(target.name) if isinstance(target, _OpName) else target
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
        if node.name != name:
            raise RuntimeError(f"meshpilot internal error: fx node {name!r} came back named {node.name!r}")
        meta = dict(meta)
        for key in _TENSOR_KEYS:
            if key in meta:
                meta[key] = live_value(meta[key])
        for key in _OP_KEYS:
            if isinstance(meta.get(key), _OpName):
                meta[key] = _operator(meta[key].name)
        node.meta = meta
        made[name] = node
    gm = torch.fx.GraphModule(state["consts"], graph)
    gm.meta.update(state["meta"])
    return gm


def _relink(args: Any, made: dict[str, torch.fx.Node]) -> Any:
    """`args` with each :class:`_Ref` the node of its name (tuples, lists and dicts walked)."""
    if isinstance(args, _Ref):
        return made[args.name]
    if isinstance(args, (tuple, list)):
        return _same_kind(args, [_relink(a, made) for a in args])
    if isinstance(args, dict):
        return {k: _relink(a, made) for k, a in args.items()}
    if isinstance(args, slice):
        return slice(_relink(args.start, made), _relink(args.stop, made), _relink(args.step, made))
    return args


def _make_fake(mode: Any, spec: _FakeSpec) -> torch.Tensor:
    """A fake tensor of `mode` with `spec`'s metadata, on its own storage (just large enough): a meta tensor
    wrapped by the mode's converter (a sixth of the CPU of making it through the mode's dispatch, which was most
    of a load), or made under the mode where a torch lacks that."""
    if all(spec.shape):
        reach = spec.offset + 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride))
    else:
        reach = spec.offset
    wrap = getattr(getattr(mode, "fake_tensor_converter", None), "from_meta_and_device", None)
    with contextlib.nullcontext() if wrap is not None else mode:
        device = "meta" if wrap is not None else spec.device
        if spec.offset == 0:
            t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
        else:
            t = torch.empty(reach, dtype=spec.dtype, device=device).as_strided(spec.shape, spec.stride, spec.offset)
    if wrap is not None:
        t = wrap(mode, t, spec.device)
    if spec.requires_grad:
        t.requires_grad_(True)
    return t


def _operator(name: str) -> Any:
    """The operator named `name` (``namespace.op.overload``); meshpilot's own defined first where needed."""
    namespace, op, overload = name.split(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except AttributeError:
        if namespace != "meshpilot":
            raise
    for module in _OWN_OP_MODULES:
        importlib.import_module(module)
    return getattr(getattr(torch.ops.meshpilot, op), overload)


def _same_kind(seq: Any, items: list) -> Any:
    """`items` in a sequence of `seq`'s type (a named tuple's, too)."""
    return type(seq)(*items) if hasattr(seq, "_fields") else type(seq)(items)
