"""Capture one training step of an ``nn.Module`` as an operator graph, without allocating it.

:func:`capture` traces ``loss = model(*inputs)`` together with the gradient of every trainable parameter as
one *joint* forward + backward ATen graph, as Alpa plans over the whole training step (its HLO holds both
passes). Parameters, buffers and inputs are fake CPU tensors built from their shapes (a model on the meta
device works the same), so a 175B model is traced without memory. The trace is AOTAutograd's export
(:func:`meshpilot.compat.joint_export`), which makes the graph *functional*:

* in-place writes become out-of-place ops (``z[:, 0] = 1`` is a ``select_scatter``), so no node aliases
  another's storage and the runtime may run any view as a reshape of whatever layout it holds;
* tensors made inside ``forward`` (``torch.tensor([2.0])``, an HF cache started from ``torch.tensor([])``)
  are *constants* (:data:`NodeKind.CONST`), their values kept in the graph;
* a buffer the forward updates (BatchNorm's running statistics, ``num_batches_tracked``) is an output of the
  graph: ``OpGraph.buffer_updates`` names the node holding each buffer's new value, which the runtime
  writes back;
* dropout is ``native_dropout``, one node the runtime can make exact under sharding.

Three things are routed while tracing (:class:`_CaptureMode`): ``F.scaled_dot_product_attention`` becomes the
device-generic ``meshpilot::sdpa`` pair (:mod:`meshpilot.ops.attention`), so a plan made on CPU fake tensors
names no CPU kernel; an ``as_strided`` that is a sliding window or a plain view of a contiguous tensor
(Longformer's overlapping chunks) becomes those views, ``unfold`` and reshapes, which shard off the windowed
dim (:mod:`meshpilot.graph.strided`); and every node records the module path and source line it came from
(``OpNode.module``, ``OpNode.source``; backward nodes those of their forward op), for warnings and errors that
say where.

A model whose longest list of identical blocks holds more than four is traced with four and the other blocks
are copied from a middle one (:mod:`meshpilot.graph.replicate`, after checking the traced blocks are alike
shifted by one): the trace's cost grows with the ops it records, and nearly all of a transformer's are its
blocks'. The copy is the whole trace node for node, names included (``capture(..., stacked=False)`` traces
every block).

A forward that cannot be traced ends in one line (:class:`CaptureError`): the op, the module path and source
line, and a way out — a data-dependent shape (``nonzero``, a boolean mask), inputs whose shapes the model
rejects, an unsupported Python construct.

Where the model's Python reads a tensor's value that depends on the inputs only (``if (mask == 1).all():``, an
assert on the lengths), capture computes it from the real example inputs (:class:`_Shadow`: each torch call
on input-derived tensors is kept, and run on the real inputs only when Python reads one), takes their branch
and records a guard, ``meshpilot::guard`` (:mod:`meshpilot.ops.guard`), which checks the value on every batch
and refuses in one line a batch that would take another branch; ``OpGraph.guards`` keeps the values, so the
runtime's capture on meta inputs takes the same branches. A value read from parameters is refused as above.
The same guards make three data-dependent forms static: indexing with a boolean mask of the inputs alone (all
true: the whole tensor; a broadcast write: ``torch.where``), an in-place write into an input, and one into a
parameter through ``.data``, each where it changes nothing (skipped; the parameter's checked every step).

The same model and inputs give the same graph, names included, in every process: :mod:`meshpilot.graph.order`
orders the iterations of loops over a set (whose order follows the hash seed) by what they compute; capture
stamps each node made inside such a loop with its loop and element (:func:`_user_frame`).

Every FX node becomes an :class:`OpNode`: output shapes and dtypes, FLOPs (``torch.utils.flop_counter``'s
formulas, plus meshpilot's attention; element-wise work otherwise), bytes read and written (zero for views),
whether it is a parameter, whether the forward keeps it for the backward.

:func:`detect_repeats` finds repeated identical layers structurally: each node gets a signature (op, arg
shapes/dtypes, non-tensor args), and the longest run of the signature sequence with a period ``p``
(``S[i] == S[i + p]``) is a stack of identical layers; the search recurses on what is left, so the forward
stack and the (reversed) backward stack are both found. Nodes at the same offset of different periods get
the same *canonical* node, and so do the parameters they read: the planner then decides each layer once.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import linecache
import logging
import math
import operator
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
import torch
import torch.fx
import torch.nn.functional as F
from torch.fx.node import map_arg
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from meshpilot import compat
from meshpilot.errors import UserError, first_line
from meshpilot.graph import order
from meshpilot.graph.views import is_view_op

aten = torch.ops.aten


class NodeKind(StrEnum):
    """What a node of the captured graph is."""

    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"
    CONST = "const"
    """A tensor made inside the forward (its value is in ``OpGraph.consts``)."""
    OP = "op"
    """An ATen call."""
    GETITEM = "getitem"
    """One output of a multi-output op."""


LEAF_KINDS = frozenset({NodeKind.PARAM, NodeKind.BUFFER, NodeKind.INPUT, NodeKind.CONST})


class Phase(StrEnum):
    """When a node runs in the step."""

    FWD = "fwd"
    """The loss or a buffer update depends on it."""
    BWD = "bwd"
    LEAF = "leaf"
    """A placeholder or a constant."""


class Precision(StrEnum):
    """How a step computes (``--precision``)."""

    FP32 = "fp32"
    """Parameters, activations and optimizer state in float32."""
    BF16 = "bf16"
    """Everything in bfloat16 (optimizer state too, as ``torch.optim.AdamW`` allocates it)."""
    FP16 = "fp16"
    """Everything in float16, the same way (Alpa's benchmark rows are built so: ``models.zoo.ALPA_DTYPE``)."""
    BF16_MIXED = "bf16-mixed"
    """float32 parameters and optimizer state; the forward and backward under bfloat16 autocast (matmuls,
    convolutions and attention in bfloat16, reductions and normalisations in float32: autocast's op lists,
    recorded in the graph as explicit casts)."""

    @classmethod
    def parse(cls, value: str | Precision | None) -> Precision | None:
        if value is None or isinstance(value, Precision):
            return value
        if value == "":  # older plans
            return None
        try:
            return cls(value)
        except ValueError:
            raise UserError(
                f"precision {value!r}: choose one of {', '.join(p.value for p in cls)} (or leave it out: the "
                "model's own dtypes)"
            ) from None

    @classmethod
    def of_label(cls, label: str | None) -> Precision | None:
        """The precision a plan is labelled with; None for no label or one naming the parameters' own dtypes
        (``planner.auto.check_precision`` labels a model of other or several dtypes so)."""
        return cls(label) if label in set(cls) else None

    @property
    def cast_dtype(self) -> torch.dtype | None:
        """The dtype a model's floating parameters, buffers and inputs are cast to (``bf16``, ``fp16``)."""
        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(self)

    @property
    def compute_dtype(self) -> str:
        """The dtype the matmuls run in: the device's peak FLOP/s of it is the plan's MFU reference."""
        return {Precision.FP16: "float16", Precision.FP32: "float32"}.get(self, "bfloat16")


class CaptureError(UserError):
    """A forward that cannot be captured: the message names the op, the module and source line, and a fix."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    return getattr(torch, name)


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype of one tensor the graph produces."""

    shape: tuple[int, ...]
    dtype: str

    def __repr__(self) -> str:
        """The dataclass' own repr, written out: the generated one goes through ``reprlib.recursive_repr``, and
        the graph's signatures and fingerprint write ~15,000 of these a plan (issue 33 item 4)."""
        return f"TensorInfo(shape={self.shape!r}, dtype={self.dtype!r})"

    @property
    def itemsize(self) -> int:
        return dtype_from_name(self.dtype).itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class OpNode:
    """One operator of the captured training step."""

    name: str
    """The FX node's name (stable across captures of the same model and input shapes)."""
    kind: NodeKind
    target: str
    """``aten.mm.default``, ``getitem``, ``placeholder`` or ``constant``."""
    inputs: tuple[tuple[str, int], ...]
    """Tensor operands in flattened argument order: (producer node, producer output index)."""
    outputs: tuple[TensorInfo | None, ...]
    """Every output of the node (``None`` for non-tensor outputs)."""
    flops: float = 0.0
    bytes_read: float = 0.0
    bytes_written: float = 0.0
    is_param: bool = False
    fqn: str | None = None
    """Parameter or buffer name (``blocks.0.fc1.weight``), or ``input:<i>`` for the i-th example input."""
    phase: Phase = Phase.FWD
    is_view: bool = False
    saved_for_backward: bool = False
    """A forward node whose output a backward node reads: it lives across the step (activation memory)."""
    depth: int = 0
    """Longest path from a placeholder (Alpa merges trivial ops into their deepest operand)."""
    index: int = 0
    module: str | None = None
    """Path of the module whose forward made this node (``model.layers.0.mlp``; ``""`` for the root)."""
    source: str | None = None
    """``file:line`` of the model code that made this node (a backward node: its forward op's)."""
    float8: bool = False
    """A matrix product that runs as a tensorwise Float8 product, its operands cast from bf16 on the fly
    (``planner.config_plan.float8_stack``, ``--config float8=linears``): priced by ``CostModel.float8_gemm``; its
    values stay as captured (the float8 copies are transient and not counted)."""
    zigzag: bool = False
    """An attention call whose sequence the plan holds in the zig-zag order (``planner.sequence_order``;
    ``planner.config_plan``'s CP stacks): its query rows split over one mesh axis are each rank's two balanced
    chunks, priced so (``CostModel.attention``'s balanced row), not at the contiguous split's slowest rank."""
    fx_node: torch.fx.Node | None = field(default=None, repr=False, compare=False)
    """The node of ``OpGraph.gm`` this one is (None for a node made after the capture: a stage's boundary leaf).
    A pickled ``OpGraph`` links it again (:mod:`meshpilot.graph.portable`); a node pickled alone drops it."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "fx_node": None}

    @property
    def out(self) -> TensorInfo | None:
        return self.outputs[0] if self.outputs else None

    def where(self) -> str:
        """``model.layers.0.mlp (modeling_llama.py:164)``: where the model made this node, or its name."""
        module = self.module if self.module else ("the model's forward" if self.module == "" else None)
        parts = [p for p in (module, f"({self.source})" if self.source else None) if p]
        return " ".join(parts) if parts else self.name


@dataclass
class OpGraph:
    """The captured joint forward + backward graph of one training step."""

    nodes: list[OpNode]
    gm: torch.fx.GraphModule
    param_names: list[str]
    """Parameters in placeholder order (``named_parameters()``, tied ones once)."""
    buffer_names: list[str]
    num_inputs: int
    loss: tuple[str, int] | None
    """The node that produces the scalar loss (None in a pipeline stage's slice without it:
    ``meshpilot.planner.stage``)."""
    grads: dict[str, tuple[str, int] | None]
    """Trainable parameter name -> node producing its gradient (None for parameters the loss does not use)."""
    input_infos: list[TensorInfo]
    buffer_updates: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Buffer name -> the node holding its value after the step (the forward updated it)."""
    consts: dict[str, torch.Tensor] = field(default_factory=dict)
    """Constant node -> its value (real, on the CPU)."""
    precision: Precision | None = None
    """How the step was traced (None: in the model's own dtypes)."""
    canonical: dict[str, str] = field(default_factory=dict)
    """Node -> the node of the first repeated layer it is identical to (itself when not repeated)."""
    repeats: list[tuple[int, int, int]] = field(default_factory=list)
    """(start index, period, count) of every stack of repeated layers found."""
    guards: list[tuple[str, tuple[float, ...]]] = field(default_factory=list)
    """Every value the model's Python read from a tensor while capturing (a branch, an assert, ``.tolist()``),
    in order: where it was read and the values the example inputs gave (:mod:`meshpilot.ops.guard`; a
    ``meshpilot::guard`` node checks each on every batch). A saved plan keeps them (``StagePlan.guards``), so
    the runtime's capture on meta inputs takes the same branches."""

    def __post_init__(self) -> None:
        self.by_name: dict[str, OpNode] = {n.name: n for n in self.nodes}
        users: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for src, _ in n.inputs:
                users[src].append(n.name)
        self.users = users

    def __getstate__(self) -> dict[str, Any]:
        """What pickles: the fields, with the fx graph and its fake values as plain data
        (:mod:`meshpilot.graph.portable`); unpickled, the graph plans and runs as this one."""
        from meshpilot.graph import portable

        return portable.graph_state(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        from meshpilot.graph import portable

        portable.restore(self, state)

    def __getitem__(self, name: str) -> OpNode:
        return self.by_name[name]

    def view_chain(self, name: str, max_hops: int | None = None) -> list[str]:
        """`name`, then the node it views, and so on back to the first node that is not a view (a parameter
        read through a transpose: ``[t, weight]``); at most `max_hops` steps back. The one walk
        back through views the planner, its accounting and the CLI share."""
        chain = [name]
        node = self[name]
        while node.is_view and node.inputs and (max_hops is None or len(chain) <= max_hops):
            chain.append(node.inputs[0][0])  # a view's tensor operand is its first
            node = self[chain[-1]]
        return chain

    @staticmethod
    def input_cone(nodes: Mapping[str, OpNode], seeds: Iterable[str]) -> set[str]:
        """Names of `nodes` that `seeds` are or read, transitively, walking inputs only through `nodes` (a
        stage's backward: what the gradients it sends back need — zero bubble's ``I``)."""
        cone: set[str] = set()
        stack = list(seeds)
        while stack:
            x = stack.pop()
            if x in cone or x not in nodes:
                continue
            cone.add(x)
            stack += [src for src, _ in nodes[x].inputs]
        return cone

    def fingerprint(self) -> str:
        """A hash of the graph's structure: a saved plan checks it against the model it is applied to."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(repr((n.name, n.target, n.inputs, n.outputs)).encode())
        return h.hexdigest()[:16]

    @property
    def param_bytes(self) -> int:
        return sum(n.out.nbytes for n in self.nodes if n.is_param and n.out is not None)

    def summary(self) -> str:
        ops = sum(1 for n in self.nodes if n.kind == NodeKind.OP)
        layers = ", ".join(f"{c} x {p} nodes" for _, p, c in self.repeats) or "none"
        return (
            f"{len(self.nodes)} nodes ({ops} ops), {len(self.param_names)} parameters "
            f"({self.param_bytes / 1e9:.3f} GB), {sum(n.flops for n in self.nodes) / 1e12:.3f} TFLOP per step, "
            f"repeated layers: {layers}"
        )


# ----------------------------------------------------------------------------------------------- capture


def as_inputs(example_inputs: Any) -> tuple[torch.Tensor, ...]:
    """The example inputs as a tuple of tensors: a bare tensor is one input; anything else is one line."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise UserError(
            f"example inputs: got a {type(example_inputs).__name__}; pass a tensor or a tuple of tensors "
            "(the model's positional arguments)"
        )
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise UserError(
                f"example input {i} is a {type(x).__name__}; meshpilot.plan takes tensors only "
                "(close over other arguments in a wrapper module)"
            )
    return tuple(example_inputs)


class _LossStep(torch.nn.Module):
    """``(loss,)`` of the model on the inputs: its output, the first element of a tuple, ``.loss`` of a
    Hugging Face output, or ``loss_fn(output)``; under bfloat16 autocast for mixed precision."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor] | None, autocast: bool) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.autocast = autocast

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(*inputs)
        loss = self.loss_fn(out) if self.loss_fn is not None else out
        if not isinstance(loss, torch.Tensor) and getattr(loss, "loss", None) is not None:
            loss = loss.loss
        if isinstance(loss, (tuple, list)) and loss:
            loss = loss[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UserError(
                "the model must return a scalar loss (or a tuple starting with it, or an output with .loss); "
                "pass loss_fn=... to turn its output into one"
            )
        return (loss,)


def _fake_like(mode, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A fake CPU tensor of `t`'s shape and stride (and dtype, or `dtype` for a floating `t`); nothing is
    allocated, even for a real `t`."""
    dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
    with mode:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device="cpu")


def capture(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] | torch.Tensor,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    precision: Precision | str | None = None,
    stacked: bool = True,
    guards: Sequence[tuple[str, Sequence[float]]] | None = None,
) -> OpGraph:
    """Trace one training step of `model` on `example_inputs` into an :class:`OpGraph`.

    The step is ``loss = model(*example_inputs)`` (the model returns a scalar loss, a tuple whose first
    element is the loss, or an output with ``.loss``), or ``loss = loss_fn(model(*example_inputs))``. Only
    shapes and dtypes of the inputs, parameters and buffers are used: they may live on the meta device or on
    a GPU. A bare tensor is one input. `precision` (:class:`Precision`) traces the step as it will run:
    ``bf16`` (``fp16``) with floating parameters, buffers and inputs in bfloat16 (float16), ``bf16-mixed`` under
    autocast, none as the model is. With `stacked`, a model with a list of more than four identical blocks is
    traced with three (four where its last block is not a middle one) and the others are copied
    (:mod:`meshpilot.graph.replicate`; the same graph, node for node); without it, or when the blocks do not
    pass replicate's checks, every block is traced.

    Where the model's Python reads a tensor's value (``if (mask == 1).all():``, an assert, ``.tolist()``), the
    value is computed from the real example inputs when it depends on them only (not on parameters or
    buffers), the branch they take is traced, and a guard (:mod:`meshpilot.ops.guard`) checks it on every
    batch. `guards` gives those values instead (a saved plan's ``StagePlan.guards``: the runtime captures on
    meta inputs); a value read from parameters, or from inputs on the meta device without `guards`, is refused
    in one line as before.
    """
    inputs = as_inputs(example_inputs)
    precision = Precision.parse(precision)
    params = dict(model.named_parameters())
    pnames, bnames = list(params), list(dict(model.named_buffers()))
    names = pnames + bnames + [f"input:{i}" for i in range(len(inputs))]

    def trace() -> tuple:
        return _trace(model, inputs, loss_fn, precision, guards)

    traced = None
    if stacked:
        from meshpilot.graph import replicate

        traced = replicate.capture_stacked(trace, model, names)
        if traced is not None and traced[3]:
            traced = None  # a guard's predicate may lie in a copied block: trace every block
    joint, _, fake_inputs, reads = traced if traced is not None else trace()
    graph = _build_graph(joint, params, pnames, bnames, fake_inputs)
    graph.precision = precision
    graph.guards = reads
    return graph


def _trace(
    model: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., torch.Tensor] | None,
    precision: Precision | None,
    guards: Sequence[tuple[str, Sequence[float]]] | None = None,
) -> tuple[compat.JointExport, list[str], tuple[torch.Tensor, ...], list[tuple[str, tuple[float, ...]]]]:
    """The joint export of the model's step, the names of its flat arguments (parameters, buffers,
    ``input:<i>``), the fake inputs and the values its Python read (``OpGraph.guards``)."""
    cast = precision.cast_dtype if precision is not None else None
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    pnames, bnames = list(params), list(buffers)
    mode = compat.fake_tensor_mode()(allow_non_fake_inputs=True)
    fakes: dict[str, torch.Tensor] = {}
    for n, p in params.items():
        fakes[n] = torch.nn.Parameter(_fake_like(mode, p, cast), requires_grad=p.requires_grad)
    for n, b in buffers.items():
        fakes[n] = _fake_like(mode, b, cast)
    fake_inputs = [_fake_like(mode, x, cast) for x in inputs]
    step = _LossStep(model, loss_fn, autocast=precision == Precision.BF16_MIXED)
    state = pnames + bnames
    reparametrize = compat.reparametrize_module()

    def functional_step(*flat: torch.Tensor) -> tuple[torch.Tensor]:
        tracing.start_pass(flat[len(state) :], inputs, guards)
        tracing.outer = sys._getframe()  # frames from here out are not the model's (a caller's set loop)
        tracing.real_params = {id(t): params[n] for n, t in zip(pnames, flat)}
        with reparametrize(model, dict(zip(state, flat)), tie_weights=True, strict=False):
            (loss,) = step(*flat[len(state) :])
        return (tracing.guarded(loss),)

    tracing = _CaptureMode({m: path for path, m in model.named_modules()})
    flat = [fakes[n] for n in state] + fake_inputs
    failed: str | None = None
    no_grad_before = {n: p for n, p in params.items() if p.grad is None}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_quiet_fake_tensor_logs())
        stack.enter_context(tracing.module_hooks())
        stack.enter_context(tracing)
        stack.enter_context(compat.tracing_state())
        try:
            joint = compat.joint_export(functional_step, flat, len(state))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - anything the trace raises is explained in one line
            failed, check_at = _explain(e, tracing)
    if failed is not None:
        if check_at is not None:  # a distribution's argument check: what capture meets with it off
            failed = _past_the_check(failed, check_at, model, inputs, loss_fn, precision, guards)
        raise CaptureError(failed)
    _refuse_own_backward(no_grad_before)
    reads = [(where, expected) for _, expected, where in tracing.reads]
    return joint, state + [f"input:{i}" for i in range(len(inputs))], tuple(fake_inputs), reads


# ---------------------------------------------------------------------------------- tracing: routes, places


def _traced_deepcopy(t: torch.Tensor, memo: dict[int, Any] | None) -> torch.Tensor:
    """``copy.deepcopy`` of a tensor the trace made (a fake or functional tensor has no data to copy: Dory's
    forward copies its cache layers, each holding a scalar tensor of its sliding window): a traced clone, which is
    what a deep copy of a tensor without gradient computes; recorded in `memo` as ``Tensor.__deepcopy__`` does."""
    new = t.clone()
    if memo is not None:
        memo[id(t)] = new
    return new


class _CaptureMode(TorchFunctionMode):
    """While capturing: route ``F.scaled_dot_product_attention`` to ``meshpilot::sdpa``, and stamp each node
    made by the model's code with the module path (forward hooks keep the stack) and source line it came from
    (``nn_module_stack`` / ``stack_trace`` of torch.fx's node metadata)."""

    def __init__(self, names: dict[torch.nn.Module, str]) -> None:
        super().__init__()
        self.names = names
        self.stack: list[str] = []
        self.last_source: str | None = None
        self.data_reads: dict[int, torch.Tensor] = {}  # id -> each ``.data`` the forward read (kept alive)
        self.data_write: str | None = None  # "module (file:line)" of the first in-place write through ``.data``
        self.data_of: dict[int, torch.Tensor] = {}  # id of a ``.data`` read -> the traced parameter it reads
        self.real_params: dict[int, torch.Tensor] = {}  # id of a traced parameter -> the model's own (real or meta)
        self.known: dict[int, _Shadow] = {}  # id -> how to compute a tensor's value from the real inputs
        self.reads: list[tuple[torch.Tensor, tuple[float, ...], str]] = []  # (tensor, values, where) read
        self.answers: list[tuple[str, tuple[float, ...]]] | None = None  # a saved plan's guards, in order
        self.keep: dict[int, torch.Tensor] = {}  # the tensors `known` and `reads` name, by id, kept alive
        self.input_ids: set[int] = set()  # the traced inputs' ids whose real values are known
        self.traced_inputs: set[int] = set()  # every traced input's id
        self.closed = False  # the forward has returned: a read now (in a backward) cannot be guarded
        self.outer: Any = None  # the frame that calls the model: where the search for model frames stops
        self.looping = False  # the last stamp named an iteration of a loop over a set

    def start_pass(self, traced_inputs: Sequence[torch.Tensor], real: Sequence[torch.Tensor], answers) -> None:
        """A new run of the forward (the export runs it more than once): the traced inputs' real values are
        known (inputs on the meta device are not), nothing has been read yet, `answers` (a saved plan's
        guards) are to be given in order."""
        real_pairs = [(t, x) for t, x in zip(traced_inputs, real) if isinstance(x, torch.Tensor) and not x.is_meta]
        self.known = {id(t): _Shadow(value=x) for t, x in real_pairs}
        self.input_ids = set(self.known)
        self.traced_inputs = {id(t) for t in traced_inputs}  # real or meta
        self.keep = {id(t): t for t in traced_inputs}
        self.reads = []
        self.answers = [(w, tuple(v)) for w, v in answers] if answers is not None else None
        self.closed = False

    def guarded(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` through one ``meshpilot::guard`` per value read this pass (none: `loss` itself); a read after
        this (in a backward) is refused as capture refused every read before guards."""
        self.closed = True
        if not self.reads:
            return loss
        from meshpilot.ops import guard  # noqa: F401 - registers the op

        for pred, expected, where in self.reads:
            loss = torch.ops.meshpilot.guard(loss, pred, list(expected), where)
        return loss

    def _read(self, func, t: torch.Tensor, source: str | None, what: str | None = None):
        """Python reads `t`'s value (``func``: ``bool()``, ``.item()``, ``.tolist()``, …): the value the real
        inputs give, or the saved plan's next answer, recorded for a guard; None: neither is known, or the
        forward has returned (no guard could hold a read in the backward). `what`: the read's name in the
        guard's message (capture's own reads: :meth:`_static_mask`, :meth:`_unchanged_input`)."""
        if self.closed:
            return None
        what = what or _READ_NAMES[func]
        where = self._where(source, what)
        if self.answers is not None:
            if not self.answers:
                raise CaptureError(
                    f"cannot capture the model: it reads a tensor's value at {where} that the plan's capture did not "
                    "read (a changed model or inputs?); plan it again"
                )
            planned, values = self.answers.pop(0)
            if planned != where:
                raise CaptureError(
                    f"cannot capture the model: it reads a tensor's value at {where} where the plan's capture read "
                    f"one at {planned} (a changed model or inputs?); plan it again"
                )
            with _untraced():
                real = torch.tensor(values, dtype=torch.float64).to(t.dtype).reshape(t.shape)
        else:
            shadow = self.known.get(id(t))
            if shadow is None:
                return None
            real = shadow.evaluate()
        with _untraced():
            values = tuple(float(v) for v in real.flatten().tolist())
            value = func(real)
        self.reads.append((t, values, where))
        self.keep[id(t)] = t
        return value

    def _where(self, source: str | None, what: str) -> str:
        """A read's place, as its guard names it: the source line (or the module) and what was read."""
        return f"{source or self.last_source or 'the model'} ({what})"

    def _answerable(self, where: str) -> bool:
        """Whether a read at `where` can be answered: from the real inputs (planning), or the saved plan's next
        guard is this one (the runtime's meta capture takes the planning capture's rewrites, no others)."""
        if self.closed:
            return False
        return self.answers[0][0] == where if self.answers else self.answers is None

    def _static_mask(self, func, args: tuple, source: str | None) -> Callable[[], Any] | None:
        """``x[mask]`` / ``x[mask] = v`` with a boolean `mask` made from the inputs alone whose shape leads `x`'s:
        a data-dependent shape (``nonzero``, in the backward too), returned in a static form (None: not such a
        call, or no static form).

        The example's (any, all) is read under one guard (which also marks the site for the runtime's capture
        on meta inputs, which takes the same form), then:

        * a write of one value broadcast to every selected position (T5Gemma-2's end-of-image embedding) is
          ``torch.where`` on the mask, exact for every mask (the guard is stricter than it needs);
        * a read, or a write of one row per selected position (X-MOD's per-language adapters), where the mask is
          all true: the whole of `x`, its masked dims flattened; a mask that is not all true stays
          data-dependent."""
        if func not in (_GETITEM, _SETITEM) or len(args) < 2 or not isinstance(args[0], torch.Tensor):
            return None
        x, mask = args[0], args[1]
        if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and 0 < mask.dim() <= x.dim()):
            return None
        if tuple(mask.shape) != tuple(x.shape[: mask.dim()]) or (self.known and id(mask) not in self.known):
            return None
        rest = tuple(x.shape[mask.dim() :])
        where = self._where(source, "a boolean mask")
        if not self._answerable(where):
            return None
        flags = _mask_flags(mask)
        if self.known:
            self.known[id(flags)] = _Shadow(_mask_flags, (mask,), {}, self.known)
            self.keep[id(flags)] = flags
        anyv, allv = self._read(_TB.tolist, flags, source, what="a boolean mask") or (None, None)
        if func is _GETITEM and allv:
            return lambda: x.reshape(-1, *rest).clone()  # a copy, as indexing with a mask gives
        if func is _SETITEM and not _one_per_position(args[2], rest):
            # one value for every selected position: where the mask holds, that value, elsewhere x, for any
            # mask (the gradients too: the value's sums the selected positions', x's is zero there)
            value, cond = args[2], mask.reshape(*mask.shape, *[1] * len(rest))
            return lambda: x.copy_(torch.where(cond, value, x))
        if func is _SETITEM and allv:
            return lambda: _SETITEM(x, Ellipsis, args[2].reshape(x.shape))  # a row per position, in order
        return None

    def _unchanged_input(self, func, args: tuple, kwargs: dict, source: str | None) -> bool:
        """An in-place write into an input (FSMT's ``labels.masked_fill_(labels == -100, pad)``), which a
        functional step cannot return to the caller: where it changes nothing on the example inputs, it is done
        on a copy, the input left as it is, and a guard holds every batch to that (copy equal to the input), so
        the caller's batch is what eager leaves it. True: skip the write; False: not such a write, or one that
        changes the example (refused where the step's outputs are built)."""
        name = getattr(func, "__name__", "")
        if not (func is _SETITEM or (name.endswith("_") and not name.endswith("__"))):
            return False
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is None or id(target) not in self.traced_inputs:
            return False
        tensors = [a for a in pytree.tree_leaves((args[1:], kwargs)) if isinstance(a, torch.Tensor)]
        if self.known and not all(id(a) in self.known for a in tensors):
            return False
        where = self._where(source, "an in-place write into an input")
        if not self._answerable(where):
            return False
        same = _write_changes_nothing(func, *args, **kwargs)
        if self.known:
            self.known[id(same)] = _Shadow(_write_changes_nothing, (func, *args), kwargs, self.known)
            self.keep[id(same)] = same
        return bool(self._read(_TB.__bool__, same, source, what="an in-place write into an input"))

    def _unchanged_parameter(self, func, args: tuple, kwargs: dict, source: str | None) -> bool:
        """An in-place write into a parameter through ``.data`` in the forward (Gemma-3n's
        ``prediction_coefs.weight.data.clamp_(-120, 120)``), which a traced step cannot hold: where it changes
        nothing on the parameter's value at capture, it is skipped, and a guard checks on every step, from the
        parameter's value then, that it still would change nothing (so the step is eager's, or refused in one
        line). True: skip it; False: not such a write (its other operands are tensors), or one that changes the
        parameter (refused as before)."""
        if any(isinstance(a, torch.Tensor) for a in pytree.tree_leaves((args[1:], kwargs))):
            return False
        real = self.real_params.get(id(self.data_of.get(id(args[0]))))
        if real is None or (self.answers is None and real.is_meta):
            return False
        where = self._where(source, "an in-place write into a parameter")
        if not self._answerable(where):
            return False
        same = _write_changes_nothing(func, *args, **kwargs)  # traced: the step computes it from the parameter
        if self.answers is None:
            with _untraced():
                self.known[id(same)] = _Shadow(value=_write_changes_nothing(func, real.detach(), *args[1:], **kwargs))
            self.keep[id(same)] = same
        return bool(self._read(_TB.__bool__, same, source, what="an in-place write into a parameter"))

    def _follow(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """Keep how to compute `out` from the real inputs where every tensor `func` read is so known (a tensor
        made from nothing, such as ``arange``, is); an in-place write keeps its target's new value the same way,
        or forgets it. Nothing is computed here: only a read (:meth:`_read`) evaluates."""
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        known = func in _VALUE_FREE or all(id(a) in self.known for a in tensors)
        name = getattr(func, "__name__", "")
        inplace = func is _SETITEM or (name.endswith("_") and not name.endswith("__"))
        if inplace and tensors:
            target = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if target is None or id(target) not in self.known:
                return
            after = _Shadow(func, args, kwargs, self.known, inplace=True) if known else None
            # the write changes the views and bases of the target that this map holds apart: forget them (a
            # tensor of the target's base), keep the inputs (a write into one is refused later), the others and
            # the target's new value
            base = _base_of(target)
            self.known = {
                i: v for i, v in self.known.items() if i in self.input_ids or _base_of(self.keep[i]) is not base
            }
            if after is not None:
                self.known[id(target)] = after
                self.keep[id(target)] = target
            return
        if not known:
            return
        leaves = pytree.tree_leaves(out)
        if not any(isinstance(x, torch.Tensor) for x in leaves):
            return
        call = _Shadow(func, args, kwargs, self.known)
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and id(x) not in self.known:
                self.known[id(x)] = _Shadow(of=call, index=i)
                self.keep[id(x)] = x

    @contextlib.contextmanager
    def module_hooks(self) -> Iterator[None]:
        def pre(mod, args):
            path = self.names.get(mod)
            if path is not None:
                self.stack.append(path)

        def post(mod, args, out):
            if self.names.get(mod) is not None and self.stack:
                self.stack.pop()

        h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = torch.nn.modules.module.register_module_forward_hook(post)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # only while the model's forward runs: the backward's nodes take their forward op's places
        # (compat._places_from_forward)
        source, loop = _user_frame(self.outer) if self.stack else (None, None)
        if source is not None:
            self.last_source = source
            compat.stamp_node_meta(self.stack[-1], source, loop)
        elif self.looping:
            compat.unstamp_loop()
        self.looping = loop is not None
        if func is F.scaled_dot_product_attention:
            from meshpilot.ops.attention import captured_sdpa

            return captured_sdpa(*args, **kwargs)
        if func is torch.Tensor.__deepcopy__ and not args[0].requires_grad:
            return _traced_deepcopy(args[0], args[1] if len(args) > 1 else kwargs.get("memo"))
        if func in _AS_STRIDED:
            views = _strided_views(args, kwargs)
            if views is not None:
                if self.known:
                    self._follow(func, args, kwargs, views)
                return views
        if self.data_reads and self.data_write is None and args and id(args[0]) in self.data_reads:
            name = getattr(func, "__name__", "")
            if name.endswith("_") and not name.endswith("__"):  # clamp_, copy_, mul_: an in-place method
                if self._unchanged_parameter(func, args, kwargs, source):
                    return args[0]
                self.data_write = f"{self.stack[-1] if self.stack else 'the model'} ({source or self.last_source})"
        if func in _READ_NAMES and args and isinstance(args[0], torch.Tensor) and (self.known or self.answers):
            value = self._read(func, args[0], source)
            if value is not None:
                return value
        if self.known or self.answers:
            static = self._static_mask(func, args, source)
            if static is not None:
                out = static()
                if self.known:
                    self._follow(func, args, kwargs, out)
                return out
            if self._unchanged_input(func, args, kwargs, source):
                return args[0]  # an in-place method returns its target (__setitem__'s None is not read)
        out = func(*args, **kwargs)
        if func == _DATA_GET and self.stack and isinstance(out, torch.Tensor):
            self.data_reads[id(out)] = out  # Gemma-3n's ``weight.data.clamp_``: named if AOTAutograd refuses it
            self.data_of[id(out)] = args[0]
        if self.known:
            self._follow(func, args, kwargs, out)
        return out


_DATA_GET = torch._C.TensorBase.data.__get__
_AS_STRIDED = (torch.Tensor.as_strided, torch.as_strided)


def _strided_views(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """An ``as_strided`` call as the views it is (:func:`meshpilot.graph.strided.as_views`: Longformer's
    overlapping chunks become ``unfold``), or None: keep the call."""
    from meshpilot.graph.strided import as_views

    names = ("input", "size", "stride", "storage_offset")
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    x = bound.get("input", kwargs.get("self"))
    if len(args) + len(kwargs) > 4 or not isinstance(x, torch.Tensor) or "size" not in bound or "stride" not in bound:
        return None
    return as_views(x, bound["size"], bound["stride"], bound.get("storage_offset"))


_SETITEM = torch.Tensor.__setitem__
_GETITEM = torch.Tensor.__getitem__


def _base_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage `t` views (`t` itself when it is no view): two tensors of one base alias."""
    return t._base if t._base is not None else t


def _one_per_position(value: Any, rest: tuple[int, ...]) -> bool:
    """Whether a masked write's `value` gives each selected position a row of its own (``(n, *rest)``), rather
    than one value broadcast to them all."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 + len(rest) and value.shape[0] != 1


def _mask_flags(mask: torch.Tensor) -> torch.Tensor:
    """(any, all) of a boolean mask: whether indexing with it is nothing, everything, or data-dependent."""
    return torch.stack((mask.any(), mask.all()))


def _write_changes_nothing(func, target: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Whether the in-place call ``func(target, *args)`` leaves `target`'s values as they are (done on a copy)."""
    copy = target.clone()
    func(copy, *args, **kwargs)
    return (copy == target).all()


_TB = torch._C.TensorBase
_READ_NAMES = {
    _TB.__bool__: "bool()",
    _TB.item: ".item()",
    _TB.tolist: ".tolist()",
    _TB.__int__: "int()",
    _TB.__float__: "float()",
    _TB.__index__: "an index",
}
"""The ways Python reads a tensor's value, as a guard's message names them."""
_VALUE_FREE = frozenset(
    {_TB.new_zeros, _TB.new_ones, _TB.new_full, _TB.new_tensor, torch.zeros_like, torch.ones_like, torch.full_like}
)
"""Calls whose result takes only the shape and dtype of their tensor operand, not its values."""


class _Blank:
    """The operand of a :data:`_VALUE_FREE` call whose values capture does not know (its result does not read
    them): on a read, a real CPU tensor of its shape and dtype, zeros; nothing is allocated before."""

    __slots__ = ("shape", "dtype")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype = tuple(t.shape), t.dtype

    def evaluate(self) -> torch.Tensor:
        with _untraced():
            return torch.zeros(self.shape, dtype=self.dtype)


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Real tensors computed as eager code would: the fake, functional and tracing modes set aside."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


class _Shadow:
    """How to compute one traced tensor's value from the real example inputs: a real value, or the torch call
    that made it (arguments shadowed by their own :class:`_Shadow`), or one output of such a call; evaluated
    once, on a read, with the tracing modes set aside."""

    __slots__ = ("value", "func", "args", "of", "index", "inplace", "done")

    def __init__(self, func=None, args=(), kwargs=None, known=None, *, value=None, of=None, index=0, inplace=False):
        self.value, self.func, self.of, self.index, self.inplace = value, func, of, index, inplace
        self.done = value is not None
        if func is not None:
            self.args = pytree.tree_map(
                lambda a: known.get(id(a)) or _Blank(a) if isinstance(a, torch.Tensor) else a,
                (tuple(args), dict(kwargs or {})),
            )

    def evaluate(self) -> torch.Tensor:
        if not self.done:
            with _untraced():
                self.value = self._compute()
            self.done = True
        return self.value

    def _compute(self) -> Any:
        if self.of is not None:
            return [x for x in pytree.tree_leaves(self.of.evaluate())][self.index]
        args, kwargs = pytree.tree_map(lambda a: a.evaluate() if isinstance(a, (_Shadow, _Blank)) else a, self.args)
        if self.inplace:
            args = (args[0].clone(), *args[1:])
            out = self.func(*args, **kwargs)
            return args[0] if self.func is _SETITEM or out is None else out
        return self.func(*args, **kwargs)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MESHPILOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MODELS_DIR = _MESHPILOT_DIR + "models" + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _is_model_code(filename: str) -> bool:
    """Not torch, not meshpilot (its model zoo excepted), not the standard library, not generated code."""
    if filename.startswith((_TORCH_DIR, _STDLIB, "<")):
        return False
    return not filename.startswith(_MESHPILOT_DIR) or filename.startswith(_MODELS_DIR)


def _user_frame(outer: Any = None) -> tuple[str | None, tuple | None]:
    """``file:line`` of the innermost frame of model code, and the iteration of a loop over a set that frame
    or one of its callers (up to `outer`, exclusive) runs: ``(the loop's file:line, the frame's id, repr of
    the element)`` for the innermost such loop, None if none (:func:`_set_loops`)."""
    f = sys._getframe(2)
    source = None
    while f is not None and f is not outer:
        info = _file_info(f.f_code.co_filename)
        if info is not None:
            short, loops = info
            line = f.f_lineno
            if source is None:
                source = f"{short}:{line}"
            hit = loops.get(line) if loops else None
            if hit is not None:
                local = f.f_locals
                if all(t in local for t in hit[1]):
                    element = repr(tuple(local[t] for t in hit[1]))
                    return source, (f"{short}:{hit[0]}", id(f), element)
        f = f.f_back
    return source, None


_FILE_INFO: dict[str, tuple[str, dict[int, tuple[int, tuple[str, ...]]]] | None] = {}


def _file_info(name: str) -> tuple[str, dict[int, tuple[int, tuple[str, ...]]]] | None:
    """None for a file that is not the model's (:func:`_is_model_code`), else the file as users name it and its
    loops over a set (:func:`_set_loops`), looked up once per file. By file, not code object: two functions
    alike in all but their file (transformers' "Copied from") are equal code objects."""
    try:
        return _FILE_INFO[name]
    except KeyError:
        info = (_short(name), _set_loops(name)) if _is_model_code(name) else None
        _FILE_INFO[name] = info
        return info


_SET_LOOP_HINT = re.compile(r"\bin\s+(?:(?:frozen)?set\(|\{)|=\s*(?:frozen)?set\(")


def _set_loops(filename: str) -> dict[int, tuple[int, tuple[str, ...]]]:
    """Each line of the body of a loop over a set in `filename` -> (the loop's line, its target names): a
    ``for`` or a comprehension iterating ``set(...)``, ``frozenset(...)``, a set literal or comprehension, or
    a name or ``self.`` attribute only ever assigned one (``patterns = set(config.layer_types)``, then ``for p
    in patterns``: transformers' ``create_masks_for_generate``), whose order of iteration follows the process'
    hash seed. An inner loop's lines are its own. The file is parsed only where its text has ``in set(``,
    ``in {`` or ``= set(``; once per file (:func:`_file_info` keeps the answer)."""
    text = "".join(linecache.getlines(filename))
    if not _SET_LOOP_HINT.search(text):
        return {}
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    attrs = _set_valued(tree, attributes=True)
    local = {id(f): _set_valued(f) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    loops: dict[int, tuple[int, tuple[str, ...]]] = {}
    scopes = [(tree, frozenset())]
    while scopes:  # breadth first: an inner loop comes after (and overwrites) its outer one
        scope, names = scopes.pop(0)
        for node in ast.iter_child_nodes(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scopes.append((node, local[id(node)]))
                continue
            scopes.append((node, names))
            if isinstance(node, (ast.For, ast.AsyncFor)) and _is_set(node.iter, names, attrs):
                targets = _names(node.target)
                for line in range(node.body[0].lineno, node.body[-1].end_lineno + 1):
                    loops[line] = (node.lineno, targets)
            elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                sets = [g for g in node.generators if _is_set(g.iter, names, attrs)]
                if sets:
                    targets = tuple(t for g in sets for t in _names(g.target))
                    for line in range(node.lineno, node.end_lineno + 1):
                        loops[line] = (node.lineno, targets)
    return loops


def _is_set(expr: ast.expr, names: frozenset[str] = frozenset(), attrs: frozenset[str] = frozenset()) -> bool:
    """Whether `expr` makes a set: ``set(...)``, ``frozenset(...)``, a set literal or comprehension; or names
    one: a variable of `names` or a ``self.`` attribute of `attrs` (:func:`_set_valued`)."""
    if isinstance(expr, (ast.Set, ast.SetComp)):
        return True
    if isinstance(expr, ast.Name):
        return expr.id in names
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        return expr.attr in attrs
    return isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in ("set", "frozenset")


def _set_valued(scope: ast.AST, attributes: bool = False) -> frozenset[str]:
    """The variables of function `scope` (with `attributes`: the ``self.`` attributes anywhere in the module
    `scope`) whose every store is an assignment of a set (:func:`_is_set`)."""
    from collections import Counter

    def key(t: ast.AST) -> str | None:
        if attributes:
            is_self = isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            return t.attr if is_self and isinstance(t.ctx, ast.Store) else None
        return t.id if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store) else None

    stores, sets = Counter(), Counter()
    for node in ast.walk(scope):
        if (k := key(node)) is not None:
            stores[k] += 1
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for target, value in _pairs(t, node.value):  # `a, b = {}, set(x)`: b is a set
                    if (k := key(target)) is not None and _is_set(value):
                        sets[k] += 1
    return frozenset(k for k, n in sets.items() if n == stores[k])


def _pairs(target: ast.expr, value: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """The (target, value) pairs of one assignment, unpacking a tuple or list of targets given as many
    values."""
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
        if len(target.elts) == len(value.elts):
            return [p for t, v in zip(target.elts, value.elts) for p in _pairs(t, v)]
        return []
    return [(target, value)]


def _names(target: ast.expr) -> tuple[str, ...]:
    """The variable names a loop's target binds (``k``, ``(i, k)``)."""
    return tuple(n.id for n in ast.walk(target) if isinstance(n, ast.Name))


def _short(path: str) -> str:
    """A file path as users recognise it: from ``site-packages/`` on for installed code, else as given."""
    marker = "site-packages" + os.sep
    i = path.rfind(marker)
    return path[i + len(marker) :] if i >= 0 else path


@contextlib.contextmanager
def _quiet_fake_tensor_logs() -> Iterator[None]:
    """Fake-tensor and dispatch loggers print long traces for ops that fail; the one-line error says it all."""
    loggers = [logging.getLogger(n) for n in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _explain(e: Exception, tracing: _CaptureMode) -> tuple[str, str | None]:
    """One line for an exception raised while tracing: what, where (module, source line), how to fix it; and where
    the refusal is a ``torch.distributions`` argument check, its place (``in <module> (<line>)``; else None), which
    :func:`_past_the_check` looks past."""
    where = _where_raised(e) or tracing.last_source
    module = tracing.stack[-1] if tracing.stack else None
    place = " ".join(p for p in (f"in {module or 'the model'}", f"({where})" if where else "") if p)
    name = type(e).__name__
    text = first_line(e, name)
    op = getattr(e, "func", None)
    if tracing.data_write is not None and "mutation" in text:
        return (
            f"cannot capture the model: {tracing.data_write} writes a parameter in place through .data in its "
            "forward, which a traced training step cannot hold (the parameter requires gradients); clamp or set it "
            "outside the forward (after the optimizer step, under torch.no_grad()) or use an out-of-place copy"
        ), None
    data_dependent = "_local_scalar_dense" in str(op) or "GuardOnDataDependent" in name
    if data_dependent and _raised_in_assert(e):
        return (
            f"cannot capture the model: an assert on tensor values {place} checks data that capture does not "
            "have (fake tensors); it computes nothing, so capture the model with Python's asserts off (python -O, "
            "or PYTHONOPTIMIZE=1 meshpilot plan …)"
        ), None
    if data_dependent and _raised_in_distribution_check(e):
        line = (
            f"cannot capture the model: a {DISTRIBUTION_CHECK} {place} (validate_args: are the "
            "logits or probabilities valid?) reads tensor values that capture does not have (fake tensors); it "
            "computes nothing, so capture with it off (torch.distributions.Distribution.set_default_validate_args("
            "False), or python -O)"
        )
        return line, place
    if data_dependent:
        return (
            f"cannot capture the model: Python reads a tensor's value {place} (an if on a tensor, .item(), "
            "bool()) that capture cannot compute (it depends on parameters or buffers, or the example inputs are "
            "on the meta device; one of real inputs alone is guarded): a branch on data capture cannot follow; "
            "choose the setting that takes the static path (for transformers models a config flag such as "
            "use_cache=False, attn_implementation=sdpa or experts_implementation=meshpilot) or write the branch "
            "with torch.where"
        ), None
    if "DynamicOutputShape" in name or "DataDependent" in name or "data-dependent" in text.lower():
        what = f"{op}" if op is not None else "an op whose output shape depends on tensor values"
        return (
            f"cannot capture the model: {what} {place} has a data-dependent output shape (nonzero, boolean-mask "
            "indexing, unique); meshpilot plans static shapes: write it with static shapes (e.g. capacity-based "
            "routing, torch.where instead of masking) or keep that part outside the planned module"
        ), None
    return (
        f"cannot capture the model: {name} {place}: {text}; check that the example inputs have the shapes and "
        "dtypes the model's forward expects (and that it runs in eager mode on them)"
    ), None


def _refuse_own_backward(no_grad_before: dict[str, torch.nn.Parameter]) -> None:
    """Refuse a model whose backward runs ``.backward()`` itself (Reformer's reversible layers, inside an autograd
    Function): the gradients it makes land on the real parameters, around the traced step, so the joint graph
    lacks them and a plan of it trains without them. Seen as a gradient on a parameter that had none before the
    trace (which is cleared again)."""
    got = [n for n, p in no_grad_before.items() if p.grad is not None]
    for n in got:
        no_grad_before[n].grad = None
    if got:
        raise CaptureError(
            f"cannot capture the model: its backward runs .backward() itself (a gradient reached {got[0]} "
            "outside the traced step, as Reformer's reversible layers do), so a plan would train without those "
            "gradients; write that layer without a backward of its own"
        )


def _raised_in_assert(e: BaseException) -> bool:
    """Whether the innermost model-code frame of `e`'s traceback is at an ``assert`` statement (XLM's
    ``assert lengths.max().item() <= slen``): a check of the data, not a branch of the computation."""
    import linecache

    found = _model_frame(e)
    return found is not None and linecache.getline(*found).lstrip().startswith("assert ")


DISTRIBUTION_CHECK = "torch.distributions argument check"
"""How a refused ``validate_args`` check is named (:func:`_explain`, :func:`_past_the_check`)."""


def _past_the_check(failed: str, place: str, model, inputs, loss_fn, precision, guards) -> str:
    """`failed`, the refusal of a torch.distributions argument check at `place`, with what capture meets once the
    check is off: the model traced again with ``validate_args`` off (restored after), and where that stops too, a
    line naming both — so it does not send the user to turn off a check that only uncovers the next refusal (BLT:
    its patcher's ``nonzero`` after its ``Categorical`` check)."""
    from torch.distributions import Distribution

    before = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        _trace(model, inputs, loss_fn, precision, guards)
    except CaptureError as e:
        after = str(e).removeprefix("cannot capture the model: ")
        return (
            f"cannot capture the model: a {DISTRIBUTION_CHECK} {place} reads tensor values capture does not have, "
            f"and with the check off capture stops again: {after}"
        )
    finally:
        Distribution.set_default_validate_args(before)
    return failed


def _raised_in_distribution_check(e: BaseException) -> bool:
    """Whether `e` was raised while a ``torch.distributions`` distribution checked its arguments (BLT's
    ``Categorical(logits=…)``: ``validate_args``, on by default unless ``python -O``)."""
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(os.path.join("distributions", "distribution.py")) and code.co_name == "__init__":
            return True
        tb = tb.tb_next
    return False


def _where_raised(e: BaseException) -> str | None:
    """``file:line`` of the innermost model-code frame of `e`'s traceback."""
    found = _model_frame(e)
    return f"{_short(found[0])}:{found[1]}" if found is not None else None


def _model_frame(e: BaseException) -> tuple[str, int] | None:
    """(file, line) of the innermost model-code frame of `e`'s traceback (None: none is model code)."""
    found = None
    tb = e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if _is_model_code(name):
            found = (name, tb.tb_lineno)
        tb = tb.tb_next
    return found


# ------------------------------------------------------------------------------------------- graph nodes


def _tensor_info(v: Any) -> TensorInfo | None:
    if isinstance(v, torch.Tensor):
        return TensorInfo(tuple(int(s) for s in v.shape), dtype_name(v.dtype))
    return None


def _flops(target: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """FLOPs of one ATen call on fake tensors."""
    from torch.utils.flop_counter import flop_registry

    from meshpilot.ops.attention import attention_flops

    name = str(target)
    experts = sys.modules.get("meshpilot.ops.moe")  # its ops exist only once it is imported (ops._SELF_DEFINED)
    moe = experts.moe_flops(name, args) if experts is not None else None
    if moe is not None:
        return moe
    if name == "meshpilot.sdpa.default":
        return attention_flops(args[0].shape, args[1].shape, args[2].shape, backward=False)
    if name == "meshpilot.sdpa_backward.default":
        return attention_flops(args[1].shape, args[2].shape, args[3].shape, backward=True)
    packet = getattr(target, "overloadpacket", None)
    if packet in flop_registry:
        try:
            return float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - a formula that does not fit these args: fall through
            pass
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    return float(sum(o.numel() for o in outs))


def _simplify(gm: torch.fx.GraphModule) -> None:
    """Drop what only the trace needed: ``lift_fresh_copy`` of a constant (the functional graph never writes
    to it, so the constant itself serves), ``_assert_tensor_metadata`` checks, and dead nodes that draw no
    random numbers (removing a dead dropout would change the random stream the live ones see). An
    ``index.Tensor`` that indexes every dimension with that dimension's own ``arange`` is the tensor with
    singleton dimensions inserted (:func:`_identity_index`): a ``view``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.lift_fresh_copy.default and node.args[0].op == "get_attr":
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
        elif node.target is aten.index.Tensor and _identity_index(node) and not _made_here(node.args[0]):
            with graph.inserting_before(node):
                view = graph.call_function(aten.view.default, (node.args[0], list(node.meta["val"].shape)))
            view.meta = dict(node.meta)
            node.replace_all_uses_with(view)
            graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node.op in ("call_function", "get_attr") and not node.users:
            tags = getattr(node.target, "tags", ())
            if torch.Tag.nondeterministic_seeded not in tags:
                graph.erase_node(node)
    graph.lint()


_VIEWS = (aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _identity_index(node: torch.fx.Node) -> bool:
    """Whether ``index.Tensor(x, indices)`` reads `x` unchanged, its shape spread over more dimensions:
    index k is ``arange(x.shape[k])`` (plus 0) laid along one dimension of the output, the dimensions in
    `x`'s order. transformers' masks read a padding mask so (``padding_mask[batch_idx, kv_idx]`` in
    ``masking_utils``, broadcast aranges): it is ``x.view(output shape)``, which needs no data."""
    x, indices = node.args[0], node.args[1]
    shape = tuple(getattr(x, "meta", {}).get("val", torch.empty(0)).shape) if isinstance(x, torch.fx.Node) else ()
    out = getattr(node.meta.get("val"), "shape", None)
    if out is None or len(indices) != len(shape) or not shape or any(i is None for i in indices):
        return False
    positions = []
    for n, index in zip(shape, indices):
        ishape = tuple(index.meta["val"].shape) if isinstance(index, torch.fx.Node) and "val" in index.meta else None
        if ishape is None or len(ishape) != len(out) or sorted(ishape)[:-1] != [1] * (len(ishape) - 1):
            return False
        if max(ishape) != n or not _is_arange(index, n):  # one dimension of size n, the others 1
            return False
        if n > 1:
            positions.append(next(p for p, s in enumerate(ishape) if s == n))
    return positions == sorted(set(positions)) and math.prod(out) == math.prod(shape)


_FACTORIES = {
    getattr(aten, name).default
    for name in ("new_ones", "new_zeros", "new_full", "new_empty", "ones_like", "zeros_like", "full_like", "arange")
} | {aten.arange.start, aten.arange.start_step}
"""Ops that make a tensor from no tensor's values (a ``…_like`` or ``new_…`` reads only its argument's shape)."""


def _made_here(x: Any) -> bool:
    """Whether the graph computes `x` from no input's values (from ``arange``, ``new_ones``, …: transformers'
    positions and default masks). Such a tensor is replicated on every rank, and the ``index.Tensor`` reading
    it takes its layout from its indices (a batch ``arange`` sharded over the data-parallel axis makes the mask
    batch-sharded), which a ``view`` of it cannot: the mask would stay whole, and the attention reading it with
    it — a HF Llama's plan moved to head-sharded attention, 10 % slower. It stays an index."""
    seen, stack = set(), [x]
    while stack:
        n = stack.pop()
        if not isinstance(n, torch.fx.Node) or n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            return False
        if n.op == "call_function" and n.target not in _FACTORIES:
            stack += n.all_input_nodes
    return True


def _is_arange(node: torch.fx.Node, n: int) -> bool:
    """Whether `node` is ``arange(n)`` (start 0, step 1), reshaped or plus 0 only."""
    while node.op == "call_function" and (
        node.target in _VIEWS or node.target in (aten.add.Tensor, aten.add.Scalar) and node.args[1] == 0
    ):
        node = node.args[0]
    if node.op != "call_function":
        return False
    if node.target is aten.arange.default:
        return node.args[0] == n
    if node.target is aten.arange.start:
        return node.args[:2] == (0, n)
    if node.target is aten.arange.start_step:
        return node.args[:3] == (0, n, 1)
    return False


def _build_graph(
    joint: Any,
    params: dict[str, torch.nn.Parameter],
    pnames: list[str],
    bnames: list[str],
    example_inputs: tuple[torch.Tensor, ...],
) -> OpGraph:
    """The :class:`OpGraph` of a captured joint step: its leaves (parameters, buffers, inputs), one node per
    constant and per op of the joint graph, depths, what the step returns, and phases."""
    gm: torch.fx.GraphModule = joint.gm
    _simplify(gm)
    order.canonical_order(gm)
    order.order_set_loops(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = _leaf_nodes(placeholders, pnames, bnames)
    consts: dict[str, torch.Tensor] = {}
    measured: dict[tuple, tuple] = {}
    for fx_node in gm.graph.nodes:
        if fx_node.op == "get_attr":
            consts[fx_node.name] = getattr(gm, fx_node.target)
            nodes.append(_const_node(fx_node, consts[fx_node.name]))
        elif fx_node.op == "call_function":
            nodes.append(_op_node(fx_node, measured))

    for i, n in enumerate(nodes):
        n.index = i
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        if n.inputs:
            n.depth = 1 + max(by_name[s].depth for s, _ in n.inputs)

    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    buffer_updates, loss, grads = _step_outputs(joint, list(output_node.args[0]), params, pnames, bnames)
    _assign_phases(nodes, by_name, [loss[0], *(s for s, _ in buffer_updates.values())])
    graph = OpGraph(
        nodes=nodes,
        gm=gm,
        param_names=pnames,
        buffer_names=bnames,
        num_inputs=len(example_inputs),
        loss=loss,
        grads=grads,
        input_infos=[TensorInfo(tuple(x.shape), dtype_name(x.dtype)) for x in example_inputs],
        buffer_updates=buffer_updates,
        consts=consts,
    )
    detect_repeats(graph)
    return graph


def _leaf_nodes(placeholders: list[torch.fx.Node], pnames: list[str], bnames: list[str]) -> list[OpNode]:
    """The joint graph's placeholders, in order: the parameters, then the buffers, then the step's inputs."""
    n_p, n_b = len(pnames), len(bnames)
    nodes = []
    for i, ph in enumerate(placeholders):
        info = _tensor_info(ph.meta.get("val"))
        if i < n_p:
            kind, fqn = NodeKind.PARAM, pnames[i]
        elif i < n_p + n_b:
            kind, fqn = NodeKind.BUFFER, bnames[i - n_p]
        else:
            kind, fqn = NodeKind.INPUT, f"input:{i - n_p - n_b}"
        nodes.append(
            OpNode(
                ph.name,
                kind,
                "placeholder",
                (),
                (info,),
                is_param=kind == NodeKind.PARAM,
                fqn=fqn,
                phase=Phase.LEAF,
                fx_node=ph,
            )
        )
    return nodes


def _const_node(fx_node: torch.fx.Node, value: torch.Tensor) -> OpNode:
    """A constant the graph reads (``get_attr``): a leaf with its shape and dtype."""
    info = TensorInfo(tuple(value.shape), dtype_name(value.dtype))
    node = OpNode(fx_node.name, NodeKind.CONST, "constant", (), (info,), phase=Phase.LEAF)
    node.module, node.source = compat.stamped_place(fx_node)
    node.fx_node = fx_node
    return node


def _op_node(fx_node: torch.fx.Node, measured: dict[tuple, tuple] | None = None) -> OpNode:
    """One ``call_function`` of the joint graph: a getitem of a tuple-valued op, or an op with its tensor
    inputs, its outputs and (unless it is a view) its FLOPs and bytes read and written.

    `measured` (one per graph) memoises the outputs, FLOPs and bytes by the op and the identities of its fake
    output and operand values: ``graph.replicate``'s copies of a block share the template's fake values, so
    every copy after the first is the one before it over again, and the FLOP formulas and shape reads ran
    ~3,000 times for ~100 distinct ops (issue 33 item 4). Two different ops never share a fake output: each
    call the trace records makes its own."""
    val = fx_node.meta.get("val")
    if fx_node.target is operator.getitem:
        src, idx = fx_node.args
        node = OpNode(
            fx_node.name, NodeKind.GETITEM, "getitem", ((src.name, int(idx)),), (_tensor_info(val),), is_view=True
        )
    else:
        tensor_args = [a for a in _arg_nodes(fx_node) if isinstance(a.meta.get("val"), torch.Tensor)]
        inputs = tuple((a.name, 0) for a in tensor_args)
        key = (fx_node.target, id(val), *(id(a.meta["val"]) for a in tensor_args))
        hit = measured.get(key) if measured is not None else None
        if hit is None:
            hit = _measure(fx_node, val, tensor_args)
            if measured is not None:
                measured[key] = hit
        target, outputs, is_view, flops, bytes_read, bytes_written = hit
        node = OpNode(fx_node.name, NodeKind.OP, target, inputs, outputs, is_view=is_view)
        if not is_view:
            node.flops, node.bytes_read, node.bytes_written = flops, bytes_read, bytes_written
    node.module, node.source = compat.stamped_place(fx_node)
    node.fx_node = fx_node
    return node


def _measure(fx_node: torch.fx.Node, val: Any, tensor_args: list[torch.fx.Node]) -> tuple:
    """(target name, outputs, is a view, FLOPs, bytes read, bytes written) of an op node (:func:`_op_node`)."""
    if isinstance(val, (tuple, list)):
        outputs = tuple(_tensor_info(v) for v in val)
    else:
        outputs = (_tensor_info(val),)
    is_view = is_view_op(fx_node.target)
    if is_view:
        return str(fx_node.target), outputs, True, 0.0, 0.0, 0.0
    fake_args = map_arg(fx_node.args, _fake_value)
    fake_kwargs = map_arg(fx_node.kwargs, _fake_value)
    flops = _flops(fx_node.target, fake_args, fake_kwargs, val)
    bytes_read = float(sum(a.meta["val"].nbytes for a in {t: None for t in tensor_args}))
    bytes_written = float(sum(o.nbytes for o in outputs if o is not None))
    return str(fx_node.target), outputs, False, flops, bytes_read, bytes_written


def _step_outputs(
    joint: Any, outs: list[Any], params: dict[str, torch.nn.Parameter], pnames: list[str], bnames: list[str]
) -> tuple[dict[str, tuple[str, int]], tuple[str, int], dict[str, tuple[str, int] | None]]:
    """What the joint step returns, ``(*updated buffers, loss, *gradients of the parameters that receive
    one)``, as (buffer updates by buffer name, the loss, each trainable parameter's gradient or None).
    A forward that writes into a parameter or an input in place is refused in one line."""
    n_p, n_b = len(pnames), len(bnames)
    n_updates = len(joint.mutated_inputs)
    buffer_updates: dict[str, tuple[str, int]] = {}
    for k, i in enumerate(joint.mutated_inputs):
        if not n_p <= i < n_p + n_b:
            what = pnames[i] if i < n_p else f"input {i - n_p - n_b}"
            module, source = compat.stamped_place(outs[k]) if isinstance(outs[k], torch.fx.Node) else (None, None)
            where = f" in {module or 'the model'} ({source})" if source else ""
            raise CaptureError(
                f"the model's forward writes into {what} in place{where}; meshpilot runs functional steps: write to "
                "a copy (or a registered buffer) instead"
            )
        buffer_updates[bnames[i - n_p]] = (outs[k].name, 0)
    loss = (outs[n_updates].name, 0)
    grads: dict[str, tuple[str, int] | None] = {}
    it = iter(outs[n_updates + 1 :])
    for i, name in enumerate(pnames):
        if not params[name].requires_grad:
            continue
        g = next(it) if joint.has_grad[i] else None
        grads[name] = (g.name, 0) if isinstance(g, torch.fx.Node) else None
    return buffer_updates, loss, grads


# fx's own map_arg (in C) walks a node's arguments as pytree would, keeping their containers' types, at a
# fraction of pytree's cost on the ~5,000 nodes of a 32-block step.


def _arg_nodes(fx_node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes among `fx_node`'s arguments and keyword arguments, in order, repeats kept."""
    found: list[torch.fx.Node] = []
    map_arg((fx_node.args, fx_node.kwargs), found.append)
    return found


def _fake_value(a: torch.fx.Node) -> Any:
    return a.meta.get("val")


def _tensor_mark(_: torch.fx.Node) -> str:
    return "T"


def _assign_phases(nodes: list[OpNode], by_name: dict[str, OpNode], roots: list[str]) -> None:
    """Forward = everything the loss or a buffer update depends on; every other op is backward. Forward
    nodes a backward node reads are kept for the backward (activation memory)."""
    fwd: set[str] = set()
    stack = list(roots)
    while stack:
        cur = stack.pop()
        if cur in fwd:
            continue
        fwd.add(cur)
        stack.extend(s for s, _ in by_name[cur].inputs)
    for n in nodes:
        if n.kind in LEAF_KINDS:
            continue
        n.phase = Phase.FWD if n.name in fwd else Phase.BWD
    for n in nodes:
        if n.phase == Phase.BWD:
            for s, _ in n.inputs:
                src = by_name[s]
                if src.phase == Phase.FWD:
                    src.saved_for_backward = True


# -------------------------------------------------------------------------------------- repeated layers


def _signature(n: OpNode, g_by: dict[str, OpNode], fx_node: torch.fx.Node | None) -> str:
    """What makes two nodes interchangeable for the planner: op, operand shapes, non-tensor arguments."""
    ins = tuple((g_by[s].outputs[i], g_by[s].kind if g_by[s].kind != NodeKind.OP else "") for s, i in n.inputs)
    consts: Any = ()
    if fx_node is not None and n.kind == NodeKind.OP:
        consts = map_arg((fx_node.args, fx_node.kwargs), _tensor_mark)
    elif n.kind == NodeKind.GETITEM:
        consts = n.inputs[0][1]
    return repr((n.target, n.outputs, ins, consts))


def _best_period(seq: np.ndarray, min_count: int = 2) -> tuple[int, int, int] | None:
    """(start, period, count) of the longest periodic stretch of `seq`, preferring the shortest period."""
    n = len(seq)
    best: tuple[int, int, int] | None = None
    best_cover = 0
    for p in range(2, n // min_count + 1):
        eq = seq[:-p] == seq[p:]
        hits = int(np.count_nonzero(eq))
        if not hits or hits + p <= best_cover:  # cover = count·p ≤ run + p ≤ hits + p: cannot beat the best
            continue
        # runs of True in eq
        padded = np.concatenate(([False], eq, [False]))
        d = np.diff(padded.astype(np.int8))
        starts = np.flatnonzero(d == 1)
        ends = np.flatnonzero(d == -1)
        lengths = ends - starts
        j = int(np.argmax(lengths))
        run = int(lengths[j])
        count = (run + p) // p
        if count < min_count:
            continue
        cover = count * p
        if cover > best_cover:
            best_cover = cover
            best = (int(starts[j]), p, count)
    return best


def detect_repeats(graph: OpGraph, min_period: int = 8) -> None:
    """Fill ``graph.canonical`` and ``graph.repeats`` (see the module docstring)."""
    ops = [n for n in graph.nodes if n.kind in (NodeKind.OP, NodeKind.GETITEM)]
    by = graph.by_name
    sig_ids: dict[str, int] = {}
    seq = np.array([sig_ids.setdefault(_signature(n, by, n.fx_node), len(sig_ids)) for n in ops], dtype=np.int64)
    canonical = {n.name: n.name for n in graph.nodes}
    repeats: list[tuple[int, int, int]] = []

    def search(lo: int, hi: int, depth: int) -> None:
        if hi - lo < 2 * min_period or depth > 6:
            return
        found = _best_period(seq[lo:hi])
        if found is None:
            return
        start, p, count = found
        if p < min_period:
            return
        start += lo
        repeats.append((start, p, count))
        for c in range(1, count):
            for j in range(p):
                canonical[ops[start + c * p + j].name] = ops[start + j].name
        search(lo, start, depth + 1)
        search(start + p * count, hi, depth + 1)

    search(0, len(ops), 0)

    # parameters read at the same operand position by tied nodes are tied as well
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for n in ops:
        c = canonical[n.name]
        if c == n.name:
            continue
        cn = by[c]
        for (s, _), (cs, _) in zip(n.inputs, cn.inputs):
            a, b = by[s], by[cs]
            if a.kind in (NodeKind.PARAM, NodeKind.BUFFER) and b.kind == a.kind and a.outputs == b.outputs:
                ra, rb = find(a.name), find(b.name)
                if ra != rb:
                    # keep the earliest parameter as the representative
                    if by[ra].index < by[rb].index:
                        parent[rb] = ra
                    else:
                        parent[ra] = rb
    for n in graph.nodes:
        if n.kind in (NodeKind.PARAM, NodeKind.BUFFER):
            canonical[n.name] = find(n.name)
    graph.canonical = canonical
    graph.repeats = sorted(repeats)
