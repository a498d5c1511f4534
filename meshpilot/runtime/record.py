"""Record what a function does to plain tensors as an FX program: the local ops under DTensor.

``record(fn, *args)`` runs ``fn`` once for real under a ``TorchDispatchMode`` that steps aside for DTensor
arguments (returns ``NotImplemented``, so DTensor's own dispatcher runs the op) and writes down every op on
plain tensors that follows: the local computations DTensor runs and the functional collectives its
redistributions issue. The recording is an ``fx.GraphModule`` whose placeholders are `args` and whose
output is ``fn``'s result; its generated Python code replays the same ops, in the same order, on new values.

Unlike ``make_fx``, DTensor does not see a tracer (its C++ fast path and sharding caches stay on, which is
several times faster on large graphs), and nothing is traced symbolically: a value read back into Python
(``.item()``) cannot be replayed, so :class:`NotReplayable` is raised and the caller keeps interpreting.
In-place ops and views are replayed as ops, so aliasing is reproduced as it happened. Tensors the function
did not receive and did not make (a mesh's coordinate table, a model constant already on the device) become
constants of the program.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor  # noqa: E402 - a type check only
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from meshpilot import compat


class NotReplayable(RuntimeError):
    """The function read a tensor's value back into Python, so a recording would bake it in."""


_READBACKS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
_DEAD_WRAPS = frozenset({"_c10d_functional._wrap_tensor_autograd.default"})
"""Collective-side ops (by name: registered only once functional collectives are imported) that only wrap a
value for autograd: dropped when nothing reads them."""
_OUTSIDE = [0]
_TAG: list[Any] = [None]
_PART: list[Any] = [None]
VAL = "meshpilot_val"
"""``node.meta`` key: the (shape, dtype) an op's one tensor output had when recorded (passes that allocate
buffers for recorded values read it: ``runtime.buckets.write_into_buckets``)."""
LAYOUT = "meshpilot_layout"
"""``node.meta`` key: how a recorded tensor was laid out — (shape, strides, storage offset, dtype) — for a
program's inputs, constants and ops' tensor outputs (``runtime.fold`` folds a view only where its reader gets
the same layout)."""
PART = "meshpilot_part"
"""``node.meta`` key: the step of an own op's work a kernel was recorded in (``meshpilot.ops.OpPart``)."""


@contextlib.contextmanager
def tagged(tag: Any) -> Iterator[None]:
    """Label the ops recorded meanwhile with `tag` (``node.meta["meshpilot_tag"]``): the runtime tags the
    ops of each plan node and of each operand's resharding, so a pass can find them again."""
    saved = _TAG[0]
    _TAG[0] = tag
    try:
        yield
    finally:
        _TAG[0] = saved


@contextlib.contextmanager
def in_part(part: Any) -> Iterator[None]:
    """Label the ops recorded meanwhile as step `part` (``node.meta["meshpilot_part"]``, a
    ``meshpilot.ops.OpPart``) of the own op whose node they are tagged with: duplex places an op's lead a
    stage early and its tail a stage late (``meshpilot.runtime.duplex``)."""
    saved = _PART[0]
    _PART[0] = part
    try:
        yield
    finally:
        _PART[0] = saved


@contextlib.contextmanager
def outside_program() -> Iterator[None]:
    """Tensor work that is not part of the program being recorded (this rank's offsets in a sharded dim, a
    trial view): it runs, and nothing is written down."""
    _OUTSIDE[0] += 1
    try:
        yield
    finally:
        _OUTSIDE[0] -= 1


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: torch.fx.Graph) -> None:
        super().__init__()
        self.graph = graph
        self.nodes = WeakTensorKeyDictionary()
        self.owner = torch.nn.Module()
        self.consts = 0

    def node_of(self, t: torch.Tensor) -> torch.fx.Node:
        node = self.nodes.get(t)
        if node is None:
            name = f"_const{self.consts}"
            self.consts += 1
            self.owner.register_buffer(name, t)
            node = self.graph.get_attr(name)
            self.nodes[t] = node
            _note_layout(node, t)
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _OUTSIDE[0]:
            return func(*args, **kwargs)
        subclasses = [t for t in types if t is not torch.Tensor and issubclass(t, torch.Tensor)]
        if any(issubclass(t, _FakeTensor) for t in subclasses):
            return func(*args, **kwargs)  # DTensor's shape inference on fake tensors: not part of the program
        if subclasses:
            return NotImplemented  # a DTensor (or a pending collective): its dispatcher runs, its local ops come back
        if func in _READBACKS:
            raise NotReplayable(f"{func} reads a tensor's value into Python")
        out = func(*args, **kwargs)
        f_args, f_kwargs = pytree.tree_map_only(torch.Tensor, self.node_of, (args, kwargs))
        node = self.graph.call_function(func, tuple(f_args), dict(f_kwargs))
        node.meta["meshpilot_tag"] = _TAG[0]
        if _PART[0] is not None:
            node.meta[PART] = _PART[0]
        if isinstance(out, torch.Tensor):
            self.nodes[out] = node
            node.meta[VAL] = (tuple(out.shape), out.dtype)
            _note_layout(node, out)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    self.nodes[o] = self.graph.call_function(_getitem, (node, i))
                    _note_layout(self.nodes[o], o)
        return out


def _note_layout(node: torch.fx.Node, t: torch.Tensor) -> None:
    """Keep `t`'s layout on `node` (:data:`LAYOUT`); a tensor without strides (sparse) gets none."""
    if t.layout == torch.strided and type(t) is torch.Tensor:
        node.meta[LAYOUT] = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def _getitem(xs, i):
    return xs[i]


def _prune(graph: torch.fx.Graph) -> int:
    """Drop ops whose results nothing uses and that change nothing else: DTensor's scratch allocations
    (``empty_strided`` for output metadata), views nobody reads, the autograd wrapper DTensor puts around an
    issued collective's output (17 µs of Python a collective). Kept: ops that write into an argument,
    draw random numbers, or talk to other ranks. Returns how many went."""
    removed = 0
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        target = node.target
        schema = getattr(target, "_schema", None)
        if schema is not None and schema.is_mutable:
            continue
        if torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
            continue
        if getattr(target, "namespace", "") == "_c10d_functional" and str(target) not in _DEAD_WRAPS:
            continue
        graph.erase_node(node)
        removed += 1
    return removed


def _graph_module() -> type[torch.fx.GraphModule]:
    """The class of a recording: torch.fx's lazy graph module, which generates the program's code when it is
    first read or called rather than at every ``recompile()`` — the passes over a recording (``runtime/``) each
    rewrite its graph and recompile, and its code is only read once they are done (``program.direct_ops``)."""
    lazy = compat.lookup(
        "torch.fx._lazy_graph_module._LazyGraphModule", "a recording's code is generated again after every pass"
    )
    return lazy if lazy is not None else torch.fx.GraphModule


def record(fn, *args: torch.Tensor) -> tuple[torch.fx.GraphModule, Any]:
    """(program, fn's result): run ``fn(*args)`` once and record it (module docstring)."""
    import operator

    graph = torch.fx.Graph()
    recorder = _Recorder(graph)
    for i, a in enumerate(args):
        recorder.nodes[a] = graph.placeholder(f"arg{i}")
        if isinstance(a, torch.Tensor):
            _note_layout(recorder.nodes[a], a)
    with recorder:
        result = fn(*args)
    leaves, spec = pytree.tree_flatten(result)
    outs = [recorder.node_of(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    graph.output(tuple(outs))
    for node in graph.nodes:  # getitem as fx's own (readable code)
        if node.target is _getitem:
            node.target = operator.getitem
    _prune(graph)
    gm = _graph_module()(recorder.owner, graph)
    gm.meshpilot_out_spec = spec
    return gm, result
