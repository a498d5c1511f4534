"""Forced plans for any model: the ``force=`` dicts of pure data parallelism, Megatron tensor parallelism and
a ZeRO-3-like layout, for ``meshpilot.plan(model, inputs, cluster, mesh_shape=..., force=...)``.

Each helper pins the layout of every parameter (by its exact name) and of every input (``input:<i>``); the
ILP still chooses the operators' algorithms, which the pinned leaves then determine (batch-parallel
matmuls under data parallelism, column/row-parallel ones under Megatron, all-gathered weights under
ZeRO-3). A layout string has one placement per mesh axis (``RS(0)`` on a 2D mesh); mesh axes of size 1
are always ``R``.

* :func:`data_parallel` — every parameter replicated; every input sharded on its batch dim (0) over all
  mesh axes, as far as the batch divides (axes in order; an axis it does not divide stays ``R``).
* :func:`megatron_tp` — tensor parallelism over one mesh axis (``tp_axis``, the last by default), data
  parallelism (batch-sharded inputs) over the others. Column/row pairs are found *structurally* on the
  captured forward graph (:func:`megatron_groups`), not by name:

  1. a *linear* is a forward ``mm``/``addmm``/``bmm`` whose right operand is a parameter seen through
     transposes, permutes and size-1 views (``nn.Linear``'s ``t()``, an einsum's reshuffling of a
     ``[experts, in, out]`` expert weight), with ``addmm``'s 1-D parameter operand as its bias; a
     parameter used by two such ops is not a linear;
  2. each linear's output starts a *chain*, which passes through views/reshapes/transposes/selects, casts,
     ``expand`` (grouped-query attention's repeated key/value heads), ``getitem``, element-wise ops whose
     other tensor operands are chains too (or scalars: ``silu(g) * u`` joins two chains) and scaled-dot-product
     attention whose q, k and v are all chains (head-parallel). A 4-D chain value is taken to be in attention's
     ``[batch, heads, seq, head_dim]`` layout: it also passes element-wise ops whose other operands broadcast
     over its heads and concatenations of chains on another dim — rotary embeddings (``q * cos +
     rotate_half(q) * sin``, cos and sin ``[1, 1, seq, head_dim]``), which head-parallel sharding leaves whole;
  3. a linear whose activation operand is a chain is a *row* linear of the chain's linears, its *columns*;
     any other consumer of a chain (layer norm, softmax over features, a residual add with a non-chain
     tensor, a loss, a reduction) disqualifies the linears of that chain;
  4. pairs are accepted in forward order and a linear takes one role only (``fc1 -> fc2 -> fc3`` gives
     one pair ``fc1 | fc2``; ``fc3`` stays replicated), and a column is kept only if every row it feeds
     is accepted.

  So attention ``q, k, v (or a fused qkv) -> o``, MLP ``up -> down`` (``gate, up -> down`` for a gated
  MLP) and an MoE's expert FFN ``w_in -> w_out`` (sharding the expert hidden dim) are found in any model
  that writes them this way. Column weights are sharded on their output-feature dim (``S(0)`` of a
  ``[out, in]`` weight) and their biases on dim 0; row weights on their input-feature dim (``S(1)``), row
  biases replicated, like every other parameter (embeddings, norms, convolutions, heads feeding a loss).
  A group whose feature dims the TP degree does not divide stays replicated. With
  ``sequence_parallel=True`` (Megatron-LM's sequence parallelism, :func:`residual_adds`) each row linear's
  residual add is pinned sharded on the sequence dim over the TP axis (dim 1 of a ``[batch, seq, hidden]``
  value, dim 0 of a flattened ``[tokens, hidden]``; its batch rows over the other axes as the inputs): the
  residual stream, the norms and dropout between the TP regions then hold 1/TP of the tokens on each rank, and
  the ILP's resharding turns the row linear's partial sums into a reduce-scatter and gathers the sequence
  again (an all-gather) where the next column linear reads it; the bytes moved are an all-reduce's.
  Embedding tables are
  vocabulary-parallel over the TP axis (``S(0)``, Megatron-LM's; the lookup runs meshpilot's own
  strategy: each rank looks up the ids in its rows and the output is a partial sum), and a lookup of an
  input's ids is pinned to that partial output.
* :func:`zero3` — every parameter sharded over every mesh axis (of size > 1): each axis in order shards the
  first dim that still divides evenly (``S(0)S(0)`` for a ``[64, 32]`` weight on 2 x 2, ``S(0)S(1)`` when
  dim 0 only divides by one axis); a parameter with no such dim stays ``R`` on that axis. Inputs are
  batch-sharded as under data parallelism. The runtime then all-gathers weights where an op needs them and
  the gradients arrive reduce-scattered into the parameter shards, as ZeRO-3 does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshpilot.errors import UserError
from meshpilot.graph.capture import OpGraph, capture
from meshpilot.graph.views import LAYOUT_VIEWS, SHAPE_VIEWS

KINDS = ("data_parallel", "megatron_tp", "zero3")


# ------------------------------------------------------------------------------------------ layouts


def _layout(per_axis: Sequence[str]) -> str:
    return "".join(per_axis)


def _replicated(mesh_shape: Sequence[int]) -> str:
    return "R" * len(mesh_shape)


def _exact(name: str) -> str:
    """An fnmatch pattern matching exactly `name`."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _batch_placements(shape: Sequence[int], mesh_shape: Sequence[int], axes: Sequence[int]) -> list[str]:
    """Dim 0 sharded over `axes` (in order) as far as it divides evenly; ``R`` elsewhere."""
    out = ["R"] * len(mesh_shape)
    if not shape:
        return out
    k = 1
    for a in axes:
        n = mesh_shape[a]
        if n > 1 and shape[0] % (k * n) == 0:
            out[a] = "S(0)"
            k *= n
    return out


def _inputs(example_inputs: Sequence[Any], mesh_shape: Sequence[int], axes: Sequence[int]) -> dict[str, str]:
    return {
        f"input:{i}": _layout(_batch_placements(tuple(x.shape), mesh_shape, axes))
        for i, x in enumerate(example_inputs)
        if isinstance(x, torch.Tensor)
    }


def _params(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def _check_mesh(mesh_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(n) for n in mesh_shape)
    if not shape or any(n < 1 for n in shape):
        raise UserError(f"mesh_shape {mesh_shape!r}: give one positive size per mesh axis, e.g. (2, 2)")
    return shape


def data_parallel(model: torch.nn.Module, example_inputs: Sequence[Any], mesh_shape: Sequence[int]) -> dict[str, str]:
    """Pure data parallelism: parameters replicated, inputs batch-sharded over every mesh axis."""
    mesh_shape = _check_mesh(mesh_shape)
    force = {_exact(n): _replicated(mesh_shape) for n in _params(model)}
    force.update(_inputs(example_inputs, mesh_shape, range(len(mesh_shape))))
    return force


def zero3(model: torch.nn.Module, example_inputs: Sequence[Any], mesh_shape: Sequence[int]) -> dict[str, str]:
    """ZeRO-3-like: every parameter sharded over every mesh axis on its first evenly divisible dim."""
    mesh_shape = _check_mesh(mesh_shape)
    force = {}
    for name, shape in _params(model).items():
        out = ["R"] * len(mesh_shape)
        factor = [1] * len(shape)
        for a, n in enumerate(mesh_shape):
            if n == 1:
                continue
            for d, size in enumerate(shape):
                if size % (factor[d] * n) == 0:
                    out[a] = f"S({d})"
                    factor[d] *= n
                    break
        force[_exact(name)] = _layout(out)
    force.update(_inputs(example_inputs, mesh_shape, range(len(mesh_shape))))
    return force


# --------------------------------------------------------------------------------- Megatron structure


@dataclass(frozen=True)
class Linear:
    """A forward matmul with a parameter weight: ``y = x @ W^T (+ b)``, or a batched ``bmm(x, W)``."""

    node: str
    """The ``mm`` / ``addmm`` node."""
    weight: str
    bias: str | None
    out_dim: int
    """The weight's output-feature dim (0 for ``nn.Linear``'s ``[out, in]``)."""
    in_dim: int
    """The weight's input-feature (contracted) dim."""
    act: str
    """The node feeding the activation operand."""


@dataclass(frozen=True)
class TPGroup:
    """Column-parallel linears whose outputs reach only the row-parallel linears of the group."""

    columns: tuple[Linear, ...]
    rows: tuple[Linear, ...]

    def names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(column weights, row weights), e.g. ``(("q.weight", "k.weight", "v.weight"), ("o.weight",))``."""
        return tuple(c.weight for c in self.columns), tuple(r.weight for r in self.rows)


_MM = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default"}
_CAST = "aten._to_copy.default"
"""A dtype cast: autocast's bfloat16 copy of a weight, the logits' float32 copy before the loss."""


def _is_attention(target: str) -> bool:
    """A forward attention node (meshpilot's device-generic op, or an ATen attention kernel)."""
    if target == "meshpilot.sdpa.default":
        return True
    return target.startswith("aten._scaled_dot_product") and "backward" not in target


def find_linears(graph: OpGraph) -> list[Linear]:
    """Every forward matmul whose right operand is a parameter seen through views, in graph order.

    ``mm``/``addmm`` with a 2-D weight (``nn.Linear``: ``x @ W.t()``) and ``bmm`` with a batched weight
    (expert weights of an einsum MoE, ``[experts, in, out]``): the weight's dims that become the matmul's
    contraction and output dims are followed back through transposes, permutes and views that only add or
    drop size-1 dims."""
    found: list[Linear] = []
    for n in graph.nodes:
        if n.phase != "fwd" or n.target not in _MM or len(n.inputs) < 2:
            continue
        rhs = graph[n.inputs[-1][0]].outputs[n.inputs[-1][1]]
        if rhs is None:
            continue
        nd = len(rhs.shape)
        traced = _trace_to_param(graph, n.inputs[-1][0], [nd - 2, nd - 1])
        if traced is None:
            continue
        param, (in_dim, out_dim) = traced
        bias = None
        if n.target == "aten.addmm.default":
            b = graph[n.inputs[0][0]]
            if b.kind == "param" and b.out is not None and len(b.out.shape) == 1:
                bias = b.fqn
        found.append(Linear(n.name, param.fqn, bias, out_dim, in_dim, n.inputs[-2][0]))
    uses: dict[str, int] = {}
    for lin in found:
        uses[lin.weight] = uses.get(lin.weight, 0) + 1
    return [lin for lin in found if uses[lin.weight] == 1]


def _align(src: Sequence[int], dst: Sequence[int]) -> dict[int, int] | None:
    """dst dim -> src dim for a view that only adds or drops size-1 dims (None for any other view)."""
    a = [i for i, n in enumerate(src) if n != 1]
    b = [i for i, n in enumerate(dst) if n != 1]
    if [src[i] for i in a] != [dst[i] for i in b]:
        return None
    return dict(zip(b, a))


def _trace_to_param(graph: OpGraph, name: str, dims: list[int]):
    """Follow `dims` of node `name`'s output back through views to a parameter: (param node, its dims)."""
    node = graph[name]
    while node.kind != "param":
        if node.kind != "op" or not node.inputs or node.fx_node is None:
            return None
        src = graph[node.inputs[0][0]]
        if any(graph[s].kind != "param" and graph[s].phase == "fwd" for s, _ in node.inputs[1:]):
            return None
        out, inp = node.out, src.outputs[node.inputs[0][1]]
        if out is None or inp is None:
            return None
        args = node.fx_node.args
        t = node.target
        if t == "aten.t.default":
            m = {0: 1, 1: 0} if len(out.shape) == 2 else {0: 0}
        elif t == "aten.transpose.int":
            d0, d1 = (int(a) % len(out.shape) for a in args[1:3])
            m = {i: i for i in range(len(out.shape))}
            m[d0], m[d1] = d1, d0
        elif t == "aten.permute.default":
            m = {i: int(p) % len(out.shape) for i, p in enumerate(args[1])}
        elif t in SHAPE_VIEWS or t == _CAST:  # a cast (autocast's bf16 copy of a weight) keeps its dims
            m = _align(inp.shape, out.shape)
            if m is None:
                return None
        else:
            return None
        if any(d not in m for d in dims):
            return None
        dims = [m[d] for d in dims]
        node = src
    return node, tuple(dims)


def megatron_groups(graph: OpGraph) -> list[TPGroup]:
    """Column/row-parallel groups of linears found on the forward graph (rule in the module docstring)."""
    linears = find_linears(graph)
    by_node = {lin.node: i for i, lin in enumerate(linears)}
    chain: dict[str, frozenset[int]] = {lin.node: frozenset([i]) for i, lin in enumerate(linears)}
    feeds: dict[int, frozenset[int]] = {}
    poisoned: set[int] = set()
    for n in graph.nodes:
        if n.phase != "fwd" or n.kind not in ("op", "getitem"):
            continue
        ins = [chain.get(s) for s, _ in n.inputs]
        if not any(ins):
            continue
        if n.name in by_node:
            lin = linears[by_node[n.name]]
            for (s, _), c in zip(n.inputs, ins):
                if c is None:
                    continue
                if s == lin.act and s == n.inputs[-2][0]:
                    feeds[by_node[n.name]] = feeds.get(by_node[n.name], frozenset()) | c
                else:
                    poisoned |= c
            continue
        union = frozenset().union(*(c for c in ins if c))
        if _passes(graph, n, ins):
            chain[n.name] = union
        else:
            poisoned |= union
    loss = chain.get(graph.loss[0])
    if loss:
        poisoned |= loss

    order = {i: graph[lin.node].index for i, lin in enumerate(linears)}
    role: dict[int, str] = {}
    accepted: dict[int, frozenset[int]] = {}
    for b, cols in sorted(feeds.items(), key=lambda kv: min(order[c] for c in kv[1])):
        if cols & poisoned or b in cols:
            continue
        if any(role.get(c) == "row" for c in cols) or role.get(b) == "col":
            continue
        for c in cols:
            role[c] = "col"
        role[b] = "row"
        accepted[b] = cols
    # a column must reach accepted rows only
    while True:
        cols_now = {c for cs in accepted.values() for c in cs}
        bad = {c for b, cs in feeds.items() if b not in accepted for c in cs if c in cols_now}
        if not bad:
            break
        accepted = {b: cs for b, cs in accepted.items() if not (cs & bad)}
    # groups: rows sharing a column are one group
    parent = {b: b for b in accepted}

    def find(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    owner: dict[int, int] = {}
    for b, cols in accepted.items():
        for c in cols:
            if c in owner:
                parent[find(b)] = find(owner[c])
            else:
                owner[c] = b
    comps: dict[int, tuple[set[int], set[int]]] = {}
    for b, cols in accepted.items():
        cs, rs = comps.setdefault(find(b), (set(), set()))
        cs |= cols
        rs.add(b)
    groups = [
        TPGroup(
            tuple(linears[i] for i in sorted(cs, key=order.__getitem__)),
            tuple(linears[i] for i in sorted(rs, key=order.__getitem__)),
        )
        for cs, rs in comps.values()
    ]
    return sorted(groups, key=lambda g: graph[g.columns[0].node].index)


def _passes(graph: OpGraph, n, ins: list) -> bool:
    """Whether a chain passes through node `n` (operand chain sets `ins`, None for non-chain operands)."""
    if n.kind == "getitem":
        return True
    t = n.target
    if t in LAYOUT_VIEWS or t == "aten.expand.default":  # expand: grouped-query attention's repeated kv heads
        return ins[0] is not None and all(c is None for c in ins[1:])
    if _is_attention(t):
        return len(ins) >= 3 and all(c is not None for c in ins[:3]) and all(c is None for c in ins[3:])
    fx = n.fx_node
    if t == "aten.cat.default" and fx is not None:
        # rotary embeddings' rotate-half: halves of the head dim joined again, every part a chain
        return _on_heads(n) and all(c is not None for c in ins) and _dim(fx, 1, 0, n) != HEAD_DIM
    if fx is not None and torch.Tag.pointwise in getattr(fx.target, "tags", ()):
        for (s, i), c in zip(n.inputs, ins):
            if c is None:
                info = graph[s].outputs[i]
                if info is None or (info.numel != 1 and not (_on_heads(n) and _broadcasts_heads(info.shape))):
                    return False
        return True
    return False


HEAD_DIM = 1
"""The heads' dim of a 4-D chain value: attention's ``[batch, heads, seq, head_dim]``, as sdpa takes it."""


def _on_heads(n) -> bool:
    """Whether node `n`'s output is a 4-D value in attention's layout (:data:`HEAD_DIM`)."""
    return n.out is not None and len(n.out.shape) == 4


def _broadcasts_heads(shape: Sequence[int]) -> bool:
    """Whether an operand of `shape` broadcasts over the heads of a 4-D chain value (rotary cos / sin
    ``[1, 1, seq, head_dim]``): head-parallel sharding leaves it whole on every rank."""
    at = len(shape) - 4 + HEAD_DIM
    return len(shape) <= 4 and (at < 0 or shape[at] == 1)


def _dim(fx, pos: int, default: int, n) -> int:
    """The dim argument at `pos` of an FX node (keyword ``dim`` too), made non-negative for `n`'s rank."""
    d = fx.args[pos] if len(fx.args) > pos else fx.kwargs.get("dim", default)
    return int(d) % len(n.out.shape)


def megatron_tp(
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    mesh_shape: Sequence[int],
    *,
    tp_axis: int = -1,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    graph: OpGraph | None = None,
    vocab_loss: bool = True,
    sequence_parallel: bool = False,
) -> dict[str, str]:
    """Megatron tensor parallelism over `tp_axis`, data parallelism over the other axes (module docstring).

    `graph` reuses a capture of the model on these inputs (``meshpilot.graph.capture.capture``).
    `vocab_loss`: a linear whose output reaches a log-softmax through views only (an LM head feeding the
    cross-entropy) is column-parallel and the log-softmax is pinned class-sharded on the TP axis, so the
    loss runs meshpilot's vocabulary-parallel cross-entropy (:func:`vocab_parallel_heads`).
    `sequence_parallel`: the row linears' residual adds sequence-sharded over the TP axis (module docstring)."""
    mesh_shape = _check_mesh(mesh_shape)
    nd = len(mesh_shape)
    tp_axis = tp_axis % nd
    graph = graph if graph is not None else capture(model, example_inputs, loss_fn=loss_fn)
    dp_axes = [a for a in range(nd) if a != tp_axis]
    first = next((x for x in example_inputs if isinstance(x, torch.Tensor)), None)
    lead = _batch_placements(tuple(first.shape), mesh_shape, dp_axes) if first is not None else ["R"] * nd
    pins = _TPPins(graph, _params(model), mesh_shape, tp_axis, [a for a in dp_axes if lead[a] == "S(0)"])
    if mesh_shape[tp_axis] > 1:
        pins.pin_pairs()
        pins.pin_embeddings()
        if vocab_loss:
            pins.pin_vocab_heads()
        if sequence_parallel:
            pins.pin_sequence()
    pins.force.update(_inputs(example_inputs, mesh_shape, dp_axes))
    return pins.force


class _TPPins:
    """The layouts :func:`megatron_tp` pins, built up in :attr:`force`: every parameter replicated to start
    with, then Megatron's pairs, vocabulary-parallel tables and heads sharded over the TP axis, the rows of
    their outputs batch-sharded as the inputs are (over `batch_axes`)."""

    def __init__(self, graph: OpGraph, shapes: dict, mesh_shape: tuple[int, ...], tp_axis: int, batch_axes: list):
        self.graph, self.shapes, self.mesh_shape = graph, shapes, mesh_shape
        self.tp_axis, self.tp, self.batch_axes = tp_axis, mesh_shape[tp_axis], batch_axes
        self.force: dict[str, str] = {_exact(n): _replicated(mesh_shape) for n in shapes}

    def on_tp(self, d: int) -> str:
        """Dim `d` sharded on the TP axis, replicated on the others."""
        out = ["R"] * len(self.mesh_shape)
        out[self.tp_axis] = f"S({d})"
        return _layout(out)

    def rows_on_batch_axes(self, rows: int, tp_placement: str) -> list[str]:
        """A layout whose dim 0 (`rows` long) is sharded over the batch axes that divide it evenly."""
        out, k = ["R"] * len(self.mesh_shape), 1
        for a in self.batch_axes:
            if rows % (k * self.mesh_shape[a]) == 0:
                out[a], k = "S(0)", k * self.mesh_shape[a]
        out[self.tp_axis] = tp_placement
        return out

    def matmul_out(self, node: str, tp_placement: str) -> str | None:
        """The layout of a 2-D linear's output: rows batch-sharded as the inputs, `tp_placement` on TP."""
        info = self.graph[node].out
        if self.graph[node].target == "aten.bmm.default" or info is None or len(info.shape) != 2:
            return None
        return _layout(self.rows_on_batch_axes(info.shape[0], tp_placement))

    def pin_column(self, c) -> None:
        """A column-parallel linear: output features sharded on the TP axis."""
        self.force[_exact(c.weight)] = self.on_tp(c.out_dim)
        if c.bias is not None:
            self.force[_exact(c.bias)] = self.on_tp(0)
        lay = self.matmul_out(c.node, "S(1)")
        if lay is not None:
            self.force[c.node] = lay

    def pin_pairs(self) -> None:
        """Each column / row group (:func:`megatron_groups`) whose weights the TP degree divides: columns
        sharded by output features, rows by input features with partial-sum outputs."""
        shapes, tp = self.shapes, self.tp
        for group in megatron_groups(self.graph):
            ok = all(shapes[c.weight][c.out_dim] % tp == 0 for c in group.columns) and all(
                shapes[r.weight][r.in_dim] % tp == 0 for r in group.rows
            )
            if not ok:
                continue
            for c in group.columns:
                self.pin_column(c)
            for r in group.rows:
                self.force[_exact(r.weight)] = self.on_tp(r.in_dim)
                lay = self.matmul_out(r.node, "P")
                if lay is not None:
                    self.force[r.node] = lay

    def sequence_layout(self, shape: Sequence[int]) -> str | None:
        """The layout of a residual-stream value under sequence parallelism: dim 0's rows over the batch axes,
        the sequence (dim 1 of a 3-D or longer value, dim 0 of ``[tokens, hidden]``) over the TP axis; None
        where the TP degree does not divide what is left of it."""
        if len(shape) < 2:
            return None
        if len(shape) == 2:
            out = self.rows_on_batch_axes(shape[0], "S(0)")
            split = math.prod(self.mesh_shape[a] for a, p in enumerate(out) if p == "S(0)")
            return _layout(out) if shape[0] % split == 0 else None
        if shape[1] % self.tp:
            return None
        return _layout(self.rows_on_batch_axes(shape[0], "S(1)"))

    def pin_sequence(self) -> None:
        """Megatron's sequence parallelism: every pinned row linear's residual add (:func:`residual_adds`)
        sequence-sharded on the TP axis (:meth:`sequence_layout`), and the value each pinned column linear
        (and vocabulary-parallel head) reads, where it is of such an add's shape (the norm's output), pinned
        whole on the TP axis: the sequence is all-gathered once, into the norm's last op, and every column
        reads it as it is (the ILP reshards per edge: left free it would gather once per column)."""
        graph, linears = self.graph, find_linears(self.graph)
        rows = [r.node for r in linears if self.force.get(r.node, "").endswith("P")]
        shapes = set()
        for add in residual_adds(graph, rows):
            info = graph[add].out
            lay = self.sequence_layout(tuple(info.shape)) if info is not None else None
            if lay is not None:
                self.force[add] = lay
                shapes.add(tuple(info.shape))
        columns = [c for c in linears if self.force.get(c.node, "").endswith("S(1)")]
        for c in columns:
            src = graph[c.act]
            while (src.target in SHAPE_VIEWS or src.target == _CAST) and src.inputs:
                src = graph[src.inputs[0][0]]
            if src.kind == "op" and src.out is not None and tuple(src.out.shape) in shapes:
                self.force[src.name] = _layout(self.rows_on_batch_axes(src.out.shape[0], "R"))

    def pin_embeddings(self) -> None:
        """Vocabulary-parallel embedding tables (Megatron-LM's); a lookup of an input's ids keeps its partial
        sums over the TP axis, reduced where they are consumed."""
        graph, nd = self.graph, len(self.mesh_shape)
        for n in graph.nodes:
            if n.phase != "fwd" or n.target != "aten.embedding.default" or len(n.inputs) < 2:
                continue
            table, ids = graph[n.inputs[0][0]], graph[n.inputs[1][0]]
            if table.kind != "param" or table.out is None or table.out.shape[0] % self.tp:
                continue
            if self.force.get(_exact(table.fqn), "R" * nd) != _replicated(self.mesh_shape):
                continue  # a weight some matmul pair already shards
            self.force[_exact(table.fqn)] = self.on_tp(0)
            if ids.kind == "input" and n.out is not None:
                self.force[n.name] = _layout(self.rows_on_batch_axes(n.out.shape[0], "P"))

    def pin_vocab_heads(self) -> None:
        """An LM head feeding the cross-entropy: column-parallel, its log-softmax class-sharded on the TP axis
        and its nll_loss a partial sum over the TP axis, replicated over the batch axes sharding its rows (their
        summed loss and count all-reduced together inside the op, ``ops.vocab``)."""
        graph, force = self.graph, self.force
        for lin, lsm in vocab_parallel_heads(graph):
            if self.shapes[lin.weight][lin.out_dim] % self.tp or force[_exact(lin.weight)] != _replicated(
                self.mesh_shape
            ):
                continue
            info = graph[lsm].out
            cls = graph[lsm].fx_node.args[1] % len(info.shape)
            if cls != 0:
                out = self.rows_on_batch_axes(info.shape[0], f"S({cls})")
            else:  # the class dim is dim 0: no rows to shard
                out = ["R"] * len(self.mesh_shape)
                out[self.tp_axis] = "S(0)"
            self.pin_column(lin)
            force[lsm] = _layout(out)
            for user in graph.users[lsm]:
                if graph[user].target == "aten.nll_loss_forward.default" and graph[user].phase == "fwd":
                    force[user] = _layout(["P" if a == self.tp_axis else "R" for a in range(len(out))])


def residual_adds(graph: OpGraph, rows: Sequence[str]) -> list[str]:
    """The residual add each of the linear nodes `rows` feeds: its output followed through views, casts and
    element-wise ops of one tensor operand (dropout's scale) to the first ``add`` that joins it with another
    value of its shape (``x + attn(ln(x))``); a row whose output is used twice first has none."""
    out = []
    for row in rows:
        node = graph[row]
        while True:
            users = [u for u in graph.users[node.name] if graph[u].phase == "fwd"]
            if len(users) != 1:
                break
            user = graph[users[0]]
            if user.target == "aten.add.Tensor" and len(user.inputs) == 2:
                other = next((s for s, _ in user.inputs if s != node.name), None)
                info = graph[other].out if other is not None else None
                if info is not None and node.out is not None and tuple(info.shape) == tuple(node.out.shape):
                    out.append(user.name)
                break
            if user.target not in SHAPE_VIEWS and user.target != _CAST and not _one_tensor_pointwise(graph, user):
                break
            node = user
    return out


def sequence_gathers(graph: OpGraph, force: dict[str, str]) -> list[str]:
    """The forward ops `force` pins as gathers of a sequence-sharded residual (what ``megatron_tp(...,
    sequence_parallel=True)`` pins whole on TP: the norm outputs the column linears read): an operator of a
    pinned residual add's shape (:func:`residual_adds`) pinned with fewer sharded mesh axes than that add (a
    partial-sum pin is none). The plans gather them again in the backward, as Megatron-LM does
    (``planner.recompute``, *Re-gathered values*)."""
    adds: dict[tuple[int, ...], int] = {}
    ops = []
    for name, lay in force.items():
        node = graph.by_name.get(name)
        if node is None or node.kind != "op" or node.phase != "fwd" or node.out is None:
            continue
        if node.target == "aten.add.Tensor":
            shape = tuple(node.out.shape)
            adds[shape] = max(adds.get(shape, 0), lay.count("S("))
        else:
            ops.append((node, lay))
    # a partial sum (a row linear's output, a lookup) is no gather
    return [n.name for n, lay in ops if "P" not in lay and lay.count("S(") < adds.get(tuple(n.out.shape), 0)]


def _one_tensor_pointwise(graph: OpGraph, n) -> bool:
    """An element-wise op whose other operands are scalars (dropout's scale): the residual branch passes it on
    the way to its add."""
    fx = n.fx_node
    if fx is None or torch.Tag.pointwise not in getattr(fx.target, "tags", ()) or n.out is None:
        return False
    return all(graph[s].outputs[i] is None or graph[s].outputs[i].numel == 1 for s, i in n.inputs[1:])


def vocab_parallel_heads(graph: OpGraph) -> list[tuple[Linear, str]]:
    """(linear, log-softmax node) for every forward log-softmax over the last dim whose input is a linear's
    output seen through views only (``logits.reshape(b * t, -1)``): Megatron-LM's vocabulary-parallel LM
    head and cross-entropy."""
    by_node = {lin.node: lin for lin in find_linears(graph)}
    out = []
    for n in graph.nodes:
        if n.phase != "fwd" or n.target != "aten._log_softmax.default" or n.out is None:
            continue
        if n.fx_node.args[1] % len(n.out.shape) != len(n.out.shape) - 1:
            continue
        src = graph[n.inputs[0][0]]
        while (src.target in SHAPE_VIEWS or src.target == _CAST) and src.inputs and src.out is not None:
            if src.out.shape[-1] != n.out.shape[-1]:
                break
            src = graph[src.inputs[0][0]]
        lin = by_node.get(src.name)
        if lin is not None:
            out.append((lin, n.name))
    return out


def forced(
    kind: str,
    model: torch.nn.Module,
    example_inputs: Sequence[Any],
    mesh_shape: Sequence[int],
    **kwargs: Any,
) -> dict[str, str]:
    """The ``force=`` dict of `kind` (one of :data:`KINDS`)."""
    fns = {"data_parallel": data_parallel, "megatron_tp": megatron_tp, "zero3": zero3}
    if kind not in fns:
        raise UserError(f"unknown forced plan {kind!r}; choose one of {', '.join(KINDS)}")
    return fns[kind](model, example_inputs, mesh_shape, **kwargs)


__all__ = [
    "KINDS",
    "Linear",
    "TPGroup",
    "data_parallel",
    "find_linears",
    "forced",
    "megatron_groups",
    "megatron_tp",
    "residual_adds",
    "sequence_gathers",
    "zero3",
]
