"""Capture one training step of an ``nn.Module`` as an operator graph, without allocating it.

:func:`capture` traces ``loss = model(*inputs)`` and ``torch.autograd.grad(loss, params)`` together with
``make_fx`` under a ``FakeTensorMode``: parameters, buffers and inputs are fake CPU tensors (a model on the
meta device works the same), so a 175B model is traced from shapes alone. The result is the *joint*
forward + backward ATen graph, as Alpa plans over the whole training step (its HLO contains both passes).

Every FX node becomes an :class:`OpNode`: output shapes and dtypes, FLOPs (``torch.utils.flop_counter``'s
formulas, plus our own for the CPU flash-attention kernels; element-wise work otherwise), bytes read and
written (zero for views), whether it is a parameter, and whether the forward keeps it for the backward.

:func:`detect_repeats` finds repeated identical layers structurally: each node gets a signature (op, arg
shapes/dtypes, non-tensor args), and the longest run of the signature sequence with a period ``p``
(``S[i] == S[i + p]``) is a stack of identical layers; the search recurses on what is left, so the forward
stack and the (reversed) backward stack are both found. Nodes at the same offset of different periods get
the same *canonical* node, and so do the parameters they read: the planner then decides each layer once.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from meshpilot.errors import UserError

aten = torch.ops.aten

# Ops that only move metadata: zero FLOPs and zero bytes (they alias an input).
_ALIAS_OPS = {
    "aten.detach.default",
    "aten.alias.default",
    "aten.lift_fresh.default",
}


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
    kind: str
    """``param``, ``buffer``, ``input``, ``op`` (an ATen call) or ``getitem`` (one output of a multi-output op)."""
    target: str
    """``aten.mm.default``, ``getitem``, or ``placeholder``."""
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
    phase: str = "fwd"
    """``fwd`` (the loss depends on it), ``bwd``, or ``leaf`` for placeholders."""
    is_view: bool = False
    saved_for_backward: bool = False
    """A forward node whose output a backward node reads: it lives across the step (activation memory)."""
    depth: int = 0
    """Longest path from a placeholder (Alpa merges trivial ops into their deepest operand)."""
    index: int = 0
    fx_node: torch.fx.Node | None = field(default=None, repr=False, compare=False)

    @property
    def out(self) -> TensorInfo | None:
        return self.outputs[0] if self.outputs else None


@dataclass
class OpGraph:
    """The captured joint forward + backward graph of one training step."""

    nodes: list[OpNode]
    gm: torch.fx.GraphModule
    param_names: list[str]
    """Parameters in placeholder order (``named_parameters()``, tied ones once)."""
    buffer_names: list[str]
    num_inputs: int
    loss: tuple[str, int]
    """The node that produces the scalar loss."""
    grads: dict[str, tuple[str, int] | None]
    """Parameter name -> node producing its gradient (None for parameters the loss does not use)."""
    input_infos: list[TensorInfo]
    canonical: dict[str, str] = field(default_factory=dict)
    """Node -> the node of the first repeated layer it is identical to (itself when not repeated)."""
    repeats: list[tuple[int, int, int]] = field(default_factory=list)
    """(start index, period, count) of every stack of repeated layers found."""

    def __post_init__(self) -> None:
        self.by_name: dict[str, OpNode] = {n.name: n for n in self.nodes}
        users: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for src, _ in n.inputs:
                users[src].append(n.name)
        self.users = users

    def __getitem__(self, name: str) -> OpNode:
        return self.by_name[name]

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
        ops = sum(1 for n in self.nodes if n.kind == "op")
        layers = ", ".join(f"{c} x {p} nodes" for _, p, c in self.repeats) or "none"
        return (
            f"{len(self.nodes)} nodes ({ops} ops), {len(self.param_names)} parameters "
            f"({self.param_bytes / 1e9:.3f} GB), {sum(n.flops for n in self.nodes) / 1e12:.3f} TFLOP per step, "
            f"repeated layers: {layers}"
        )


# ----------------------------------------------------------------------------------------------- capture


def _fake_like(mode: FakeTensorMode, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """A fake CPU tensor of `t`'s shape, stride and dtype; nothing is allocated, even for a real `t`."""
    with mode:
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    if requires_grad:
        out.requires_grad_(True)
    return out


def _tensor_info(v: Any) -> TensorInfo | None:
    if isinstance(v, torch.Tensor):
        return TensorInfo(tuple(int(s) for s in v.shape), dtype_name(v.dtype))
    return None


def _flops(target: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """FLOPs of one ATen call on fake tensors."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(target, "overloadpacket", None)
    if packet in flop_registry:
        try:
            return float(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - a formula that does not fit these args: fall through
            pass
    name = str(target)
    if name.startswith("aten._scaled_dot_product_flash_attention_for_cpu"):
        q, k = args[1:3] if "backward" in name else args[0:2]
        b, h, t, e = q.shape
        s = k.shape[-2]
        per = 2 * b * h * t * s * e
        return float(5 * per if "backward" in name else 2 * per)
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
    return float(sum(o.numel() for o in outs))


def _is_view_op(target: Any) -> bool:
    if target is operator.getitem:
        return True
    if str(target) in _ALIAS_OPS:
        return True
    return bool(getattr(target, "is_view", False))


def capture(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> OpGraph:
    """Trace one training step of `model` on `example_inputs` into an :class:`OpGraph`.

    The step is ``loss = model(*example_inputs)`` (the model returns a scalar loss, or a tuple whose first
    element is the loss), or ``loss = loss_fn(model(*example_inputs))`` when `loss_fn` is given. Only shapes
    and dtypes of the inputs, parameters and buffers are used: they may live on the meta device.
    """
    example_inputs = tuple(example_inputs)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    pnames, bnames = list(params), list(buffers)
    n_p, n_b = len(pnames), len(bnames)
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise UserError(
                f"example input {i} is a {type(x).__name__}; meshpilot.plan takes tensors only "
                "(close over other arguments in a wrapper module)"
            )

    def step(*flat: torch.Tensor) -> tuple:
        p = dict(zip(pnames, flat[:n_p]))
        b = dict(zip(bnames, flat[n_p : n_p + n_b]))
        inputs = flat[n_p + n_b :]
        out = torch.func.functional_call(model, {**p, **b}, inputs, tie_weights=True, strict=False)
        loss = loss_fn(out) if loss_fn is not None else out
        if isinstance(loss, (tuple, list)):
            loss = loss[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise UserError(
                "the model must return a scalar loss (or a tuple starting with it); "
                "pass loss_fn=... to turn its output into one"
            )
        trainable = [p[n] for n in pnames if p[n].requires_grad]
        grads = torch.autograd.grad(loss, trainable, allow_unused=True)
        return (loss, *grads)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    flat = [_fake_like(mode, params[n], params[n].requires_grad) for n in pnames]
    flat += [_fake_like(mode, buffers[n]) for n in bnames]
    flat += [_fake_like(mode, x) for x in example_inputs]
    with mode:
        gm = make_fx(step, tracing_mode="real")(*flat)
    return _build_graph(gm, params, pnames, bnames, example_inputs)


def _build_graph(
    gm: torch.fx.GraphModule,
    params: dict[str, torch.nn.Parameter],
    pnames: list[str],
    bnames: list[str],
    example_inputs: tuple[torch.Tensor, ...],
) -> OpGraph:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    n_p, n_b = len(pnames), len(bnames)
    nodes: list[OpNode] = []
    by_fx: dict[torch.fx.Node, OpNode] = {}
    for i, ph in enumerate(placeholders):
        info = _tensor_info(ph.meta.get("val"))
        if i < n_p:
            kind, fqn = "param", pnames[i]
        elif i < n_p + n_b:
            kind, fqn = "buffer", bnames[i - n_p]
        else:
            kind, fqn = "input", f"input:{i - n_p - n_b}"
        node = OpNode(
            ph.name,
            kind,
            "placeholder",
            (),
            (info,),
            is_param=kind == "param",
            fqn=fqn,
            phase="leaf",
            fx_node=ph,
        )
        nodes.append(node)
        by_fx[ph] = node

    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    for fx_node in gm.graph.nodes:
        if fx_node.op != "call_function":
            continue
        val = fx_node.meta.get("val")
        if fx_node.target is operator.getitem:
            src, idx = fx_node.args
            inputs: tuple[tuple[str, int], ...] = ((src.name, int(idx)),)
            node = OpNode(fx_node.name, "getitem", "getitem", inputs, (_tensor_info(val),), is_view=True)
        else:
            leaves = pytree.tree_leaves((fx_node.args, fx_node.kwargs))
            tensor_args = [
                a for a in leaves if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
            ]
            inputs = tuple((a.name, 0) for a in tensor_args)
            if isinstance(val, (tuple, list)):
                outputs = tuple(_tensor_info(v) for v in val)
            else:
                outputs = (_tensor_info(val),)
            is_view = _is_view_op(fx_node.target)
            node = OpNode(fx_node.name, "op", str(fx_node.target), inputs, outputs, is_view=is_view)
            if not is_view:
                fake_args = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"), fx_node.args)
                fake_kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"), fx_node.kwargs)
                node.flops = _flops(fx_node.target, fake_args, fake_kwargs, val)
                node.bytes_read = float(sum(a.meta["val"].nbytes for a in {t: None for t in tensor_args}))
                node.bytes_written = float(sum(o.nbytes for o in outputs if o is not None))
        node.fx_node = fx_node
        nodes.append(node)
        by_fx[fx_node] = node

    for i, n in enumerate(nodes):
        n.index = i
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        if n.inputs:
            n.depth = 1 + max(by_name[s].depth for s, _ in n.inputs)

    # outputs: (loss, *grads of trainable params)
    outs = pytree.tree_leaves(output_node.args[0]) if False else list(output_node.args[0])
    loss_fx = outs[0]
    loss = (loss_fx.name, 0)
    trainable = [n for n in pnames if params[n].requires_grad]
    grads: dict[str, tuple[str, int] | None] = {}
    for name, g in zip(trainable, outs[1:]):
        grads[name] = (g.name, 0) if isinstance(g, torch.fx.Node) else None

    # forward = everything the loss depends on; the rest (but the leaves) is the backward
    fwd: set[str] = set()
    stack = [loss_fx.name]
    while stack:
        cur = stack.pop()
        if cur in fwd:
            continue
        fwd.add(cur)
        stack.extend(s for s, _ in by_name[cur].inputs)
    for n in nodes:
        if n.kind in ("param", "buffer", "input"):
            continue
        n.phase = "fwd" if n.name in fwd else "bwd"
    for n in nodes:
        if n.phase == "bwd":
            for s, _ in n.inputs:
                src = by_name[s]
                if src.phase == "fwd":
                    src.saved_for_backward = True

    graph = OpGraph(
        nodes=nodes,
        gm=gm,
        param_names=pnames,
        buffer_names=bnames,
        num_inputs=len(example_inputs),
        loss=loss,
        grads=grads,
        input_infos=[TensorInfo(tuple(x.shape), dtype_name(x.dtype)) for x in example_inputs],
    )
    detect_repeats(graph)
    return graph


# -------------------------------------------------------------------------------------- repeated layers


def _signature(n: OpNode, g_by: dict[str, OpNode], fx_node: torch.fx.Node | None) -> str:
    """What makes two nodes interchangeable for the planner: op, operand shapes, non-tensor arguments."""
    ins = tuple((g_by[s].outputs[i], g_by[s].kind if g_by[s].kind != "op" else "") for s, i in n.inputs)
    consts: Any = ()
    if fx_node is not None and n.kind == "op":
        consts = pytree.tree_map_only(torch.fx.Node, lambda _: "T", (fx_node.args, fx_node.kwargs))
    elif n.kind == "getitem":
        consts = n.inputs[0][1]
    return repr((n.target, n.outputs, ins, consts))


def _best_period(seq: np.ndarray, min_count: int = 2) -> tuple[int, int, int] | None:
    """(start, period, count) of the longest periodic stretch of `seq`, preferring the shortest period."""
    n = len(seq)
    best: tuple[int, int, int] | None = None
    best_cover = 0
    for p in range(2, n // min_count + 1):
        eq = seq[:-p] == seq[p:]
        if not eq.any():
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
    ops = [n for n in graph.nodes if n.kind in ("op", "getitem")]
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
            if a.kind in ("param", "buffer") and b.kind == a.kind and a.outputs == b.outputs:
                ra, rb = find(a.name), find(b.name)
                if ra != rb:
                    # keep the earliest parameter as the representative
                    if by[ra].index < by[rb].index:
                        parent[rb] = ra
                    else:
                        parent[ra] = rb
    for n in graph.nodes:
        if n.kind in ("param", "buffer"):
            canonical[n.name] = find(n.name)
    graph.canonical = canonical
    graph.repeats = sorted(repeats)
