"""Zig-zag order of the sequence for causal context-parallel attention: when a plan takes it, what it permutes.

Ring attention with ``is_causal`` skips the key blocks after a rank's queries (``ops.ring``), and the all-gather
method by query rows the keys after its rows (``ops.causal_rows``), so with contiguous
shards rank ``r`` of ``P`` computes ``r + ½`` chunk pairs and the last rank about twice the average. Cut into
``2P`` chunks, rank ``r`` holding chunks ``r`` and ``2P − 1 − r`` (``ring.zigzag``), every rank computes the
same (``ring.causal_work``). A plan lays the sequence out so (:class:`~meshpilot.planner.plan.SequenceOrder`)
by running the whole step on the **permuted sequence**: every tensor along the sequence is the one-device
tensor with its sequence permuted by ``π`` (the zig-zag chunks one after another), and sharded contiguously
as any other. Operations that treat positions alike (matmuls, norms, elementwise, embeddings of tokens, sums
over tokens such as the loss and the weight gradients) give the permuted result of the permuted inputs;
what knows positions must be told:

* the **inputs** with a sequence dim (token ids, labels) are permuted before they are sharded;
* a **position factory** — an ``arange`` of ``t`` whose values are used as positions (position ids, RoPE's
  and the mask's positions, a learned position table's indices) — is permuted as it is made (``π`` itself);
* an ``arange`` of ``t`` used only as the **indices** of ``aten.index`` into a tensor of the permuted world
  (transformers' mask reads the position ids at ``q_idx`` and ``kv_idx`` so) stays as made: the identity
  in either world;
* the **ring** places ``is_causal`` block pairs by their chunks' global positions (``ring_of`` passes the
  zig-zag order); a masked ring call reads its mask's columns as laid out (the mask, built from permuted
  positions, is permuted in rows and columns alike);
* the **all-gather method by query rows** (``ops.causal_rows``, ``is_causal`` calls: Llama 3's CP) reads its
  rows' chunks off the order (``causal_rows.segments``): each rank's rows are its two chunks, the gathered
  keys in the held order, so its causal work is the average.

Anything else that mixes positions is refused, the plan then keeping the contiguous order: a live op that
shifts, slices, pads, flips, sorts or scans a dim of the sequence's length (transformers' labels shift inside
``ForCausalLMLoss`` — pass ``shift_labels`` pre-shifted instead; a ``tril`` mask; a convolution), an
attention call that is neither a ring on the axis nor an ``is_causal`` call by query rows on it (a masked call
by query rows, by heads, whole), a random op (its
draws follow the layout), a buffer or constant with a dim of the sequence's length, an ambiguous input. The
rules read the sequence as "a dim of length ``t``": conservative (an unrelated dim of that length refuses the
order, never permutes it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import Shard

from meshpilot.graph.capture import NodeKind, OpGraph
from meshpilot.planner.plan import SequenceOrder

SDPA, SDPA_BACKWARD = "meshpilot.sdpa.default", "meshpilot.sdpa_backward.default"

_SCANS = (
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "tril",
    "triu",
    "roll",
    "flip",
    "sort",
    "argsort",
    "topk",
    "convolution",
    "convolution_backward",
)
"""Ops that mix positions along any dim of the sequence's length."""
_ALONG_DIM = {"slice": 1, "slice_backward": 2, "select": 1, "select_backward": 2, "narrow": 1, "cat": 1}
"""Ops that mix positions along their ``dim`` argument (its position among the arguments)."""
_GATHERS = ("index_select", "gather", "scatter", "scatter_add", "index_put", "index_add", "index_copy", "take")
"""Ops that read or write positions by index values (refused where the sequence's length is in their shapes)."""
_RELABEL = {"add", "sub", "unsqueeze", "view", "_unsafe_view", "expand", "reshape", "clone", "_to_copy", "alias"}
"""Ops an index ``arange`` may pass through on its way to ``aten.index`` (scalar offsets, views)."""
_SHAPE_ONLY = {"new_ones", "new_zeros", "new_empty", "new_full", "ones_like", "zeros_like", "empty_like", "sym_size"}
"""Ops that read only a tensor's shape and dtype."""


def _op(target: str) -> str:
    """``aten.cumsum.default`` -> ``cumsum``."""
    parts = str(target).split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _val(node):
    return node.fx_node.meta.get("val") if node.fx_node is not None else None


def _shapes(node) -> list[tuple[int, ...]]:
    """The shapes of a node's tensor operands and outputs."""
    out = []
    vals = _val(node)
    for v in vals if isinstance(vals, (tuple, list)) else (vals,):
        if isinstance(v, torch.Tensor):
            out.append(tuple(v.shape))
    if node.fx_node is not None:
        for a in node.fx_node.all_input_nodes:
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                out.append(tuple(v.shape))
    return out


def _live(graph: OpGraph) -> set[str]:
    """Nodes the step's results (the loss, the gradients, the updated buffers) read, transitively."""
    seeds = [graph.loss[0]] if graph.loss is not None else []
    seeds += [g[0] for g in graph.grads.values() if g is not None]
    seeds += [b[0] for b in graph.buffer_updates.values()]
    live, todo = set(), list(seeds)
    while todo:
        name = todo.pop()
        if name in live:
            continue
        live.add(name)
        todo += [s for s, _ in graph[name].inputs]
    return live


def _index_only(graph: OpGraph, name: str, live: set[str]) -> bool | None:
    """Whether the arange `name` reaches live nodes only as ``aten.index``'s indices (through scalar offsets
    and views): True; only as a value: False; both: None."""
    index = value = False
    todo, seen = [name], set()
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for user in graph.users[cur]:
            if user not in live:
                continue
            node = graph[user]
            op = _op(node.target)
            slots = [i for i, (s, _) in enumerate(node.inputs) if s == cur]
            if op == "index" and all(i > 0 for i in slots):
                index = True
            elif op in _SHAPE_ONLY:
                continue
            elif op in _RELABEL and all(i == 0 for i in slots) and len(node.inputs) == 1:
                todo.append(user)
            else:
                value = True
    if index and value:
        return None
    return index


def _arange_source(graph: OpGraph, name: str) -> str | None:
    """The ``arange`` that `name` is, through scalar offsets and views (None: something else)."""
    node = graph[name]
    while node.kind == NodeKind.OP and _op(node.target) in _RELABEL and len(node.inputs) == 1:
        node = graph[node.inputs[0][0]]
    return node.name if node.kind == NodeKind.OP and _op(node.target) == "arange" else None


def _refusal(graph: OpGraph, live: set[str], t: int) -> str | None:
    """Why the graph cannot run on a permuted sequence of length `t` (None: it can)."""
    from meshpilot.runtime.spmd import is_random_op

    for node in graph.nodes:
        if node.name not in live:
            continue
        if node.kind in (NodeKind.BUFFER, NodeKind.CONST):
            v = _val(node)
            if isinstance(v, torch.Tensor) and t in v.shape:
                return f"{node.name} (a buffer or constant with a dim of {t})"
            continue
        if node.kind != NodeKind.OP:
            continue
        op = _op(node.target)
        if is_random_op(node.target):
            return f"{node.name} (a random op: its draws follow the layout)"
        shapes = _shapes(node)
        near = any(d in (t - 1, t, t + 1) for s in shapes for d in s)
        if not near:
            continue
        if op in _SCANS or op in _GATHERS:
            return f"{node.name} ({op} on the sequence)"
        if op == "index" and any(_arange_source(graph, s) is None for s, _ in node.inputs[1:]):
            return f"{node.name} (index by values that are not an arange's)"
        if op == "constant_pad_nd":
            x = _val(graph[node.inputs[0][0]])
            pads = node.fx_node.args[1]
            padded = [x.shape[len(x.shape) - 1 - i // 2] for i, p in enumerate(pads) if p]
            if any(d in (t - 1, t, t + 1) for d in padded):
                return f"{node.name} (a pad along the sequence: a labels shift?)"
        if op in _ALONG_DIM:
            args = node.fx_node.args
            k = _ALONG_DIM[op]
            dim = args[k] if len(args) > k else node.fx_node.kwargs.get("dim", 0)
            x = _val(graph[node.inputs[0][0]]) if op != "cat" else _val(node)
            if op.endswith("_backward"):
                x = torch.empty(args[1], device="meta")
            along = isinstance(x, torch.Tensor) and x.shape[dim] in (t - 1, t, t + 1)
            if along and (op == "cat" or op.startswith("select") or not _whole_slice(args[k + 1 :], x.shape[dim])):
                return f"{node.name} ({op} along the sequence: a shift or a split by position)"
    return None


def _whole_slice(rest, size: int) -> bool:
    """Whether a slice's (start, end, step) arguments (`rest`, after its dim) take the whole dim."""
    start = rest[0] if len(rest) > 0 else 0
    end = rest[1] if len(rest) > 1 else size
    step = rest[2] if len(rest) > 2 else 1
    return (start or 0) == 0 and (end is None or end >= size) and step == 1


def _placements(p) -> tuple:
    return tuple(p) if p is not None else ()


def _call_axis(node, chosen: Mapping[str, Any], mesh_shape: tuple[int, ...]) -> int | None:
    """The mesh axis an attention call's sequence runs on, where the zig-zag order can serve it: a ring (q and
    k ``S(2)`` on that one axis) or, for an ``is_causal`` call without a mask, the all-gather method by query
    rows (q ``S(2)`` on it, k whole: ``ops.causal_rows``, which reads its rows' chunks off the order); else
    None (attention whole, by heads, masked by query rows, or over two axes)."""
    off = 1 if node.target == SDPA_BACKWARD else 0
    ins = chosen[node.name].ins
    q_axes = {a for a, p in enumerate(_placements(ins[off])) if p == Shard(2) and mesh_shape[a] > 1}
    k_axes = {a for a, p in enumerate(_placements(ins[off + 1])) if p == Shard(2) and mesh_shape[a] > 1}
    if len(q_axes) != 1:
        return None
    if q_axes == k_axes or (not k_axes and _causal(node)):
        return next(iter(q_axes))
    return None


def _causal(node) -> bool:
    """Whether an attention call is ``is_causal`` with no mask tensor."""
    args = node.fx_node.args
    mask = 6 if node.target == SDPA_BACKWARD else 3
    return bool(args[mask + 1]) and args[mask] is None


def choose(graph: OpGraph, chosen: Mapping[str, Any], mesh_shape: tuple[int, ...]) -> SequenceOrder | None:
    """The zig-zag :class:`SequenceOrder` for a plan whose strategies are `chosen` (node -> strategy), or None
    (contiguous): every attention call, forward and backward, must run its sequence on one mesh axis as a ring
    or, ``is_causal``, by query rows (:func:`_call_axis`), and the graph take the order (:func:`zigzag_order`)."""
    calls = [n for n in graph.nodes if n.kind == NodeKind.OP and n.target in (SDPA, SDPA_BACKWARD)]
    if not calls:
        return None
    axes = {_call_axis(n, chosen, mesh_shape) for n in calls}
    if len(axes) != 1 or None in axes:
        return None
    (axis,) = axes
    order = zigzag_order(graph, axis, mesh_shape[axis], chosen)
    return order if isinstance(order, SequenceOrder) else None


def zigzag_order(graph: OpGraph, axis: int, peers: int, chosen: Mapping[str, Any] | None = None) -> SequenceOrder | str:
    """The zig-zag :class:`SequenceOrder` of `graph`'s sequence on mesh `axis` of `peers` devices, or why the
    graph cannot take it (one line): the attention calls' one sequence length ``t`` cut into ``2P`` chunks, no
    op that mixes positions (:func:`_refusal`), each position ``arange`` used only as a value or only as an
    index, each input's sequence dim known (the one `chosen` shards on `axis`, else its one dim of length ``t``).
    What the planner asks after its ILP (:func:`choose`) and what ``config_plan`` asks of a CP stack before
    planning it (its calls then marked ``OpNode.zigzag`` and priced balanced)."""
    calls = [n for n in graph.nodes if n.kind == NodeKind.OP and n.target in (SDPA, SDPA_BACKWARD)]
    if not calls:
        return "no attention call to balance"
    if any(n.kind == NodeKind.INPUT and not str(n.fqn).startswith("input:") for n in graph.nodes):
        return "a pipeline stage's slice (its boundary values are not the model's inputs)"
    lengths = {int(_val(n)[0].shape[2]) for n in calls}  # out or dq: [b, h, t, e]
    if len(lengths) != 1:
        return f"attention calls over {len(lengths)} sequence lengths"
    (t,) = lengths
    if t % (2 * peers):
        return f"{t} tokens do not cut into 2 · {peers} equal chunks"
    live = _live(graph)
    why = _refusal(graph, live, t)
    if why is not None:
        return why
    factories = []
    for n in graph.nodes:
        if n.name in live and n.kind == NodeKind.OP and _op(n.target) == "arange":
            v = _val(n)
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.shape[0] == t:
                how = _index_only(graph, n.name, live)
                if how is None:
                    return f"{n.name} (an arange of {t} used both as positions and as indices)"
                if not how:
                    factories.append((n.name, 0))
    inputs = []
    for n in graph.nodes:
        if n.kind != NodeKind.INPUT:
            continue
        i, v = int(str(n.fqn).split(":")[1]), _val(n)
        if not isinstance(v, torch.Tensor):
            continue
        dims = [d for d, size in enumerate(v.shape) if size == t]
        outs = chosen[n.name].outs[0] if chosen is not None and chosen[n.name].outs else None
        sharded = [d for d in dims if outs is not None and Shard(d) == outs[axis]]
        if sharded:
            inputs.append((i, sharded[0]))
        elif len(dims) == 1:
            inputs.append((i, dims[0]))
        elif dims:
            return f"{n.name} (two dims of {t}: which one is the sequence)"
    causal = sum(_causal(n) for n in calls)
    return SequenceOrder(axis, peers, "zigzag", t, tuple(inputs), tuple(factories), causal)


def why_not(graph: OpGraph, t: int) -> str | None:
    """What in `graph` refuses a permuted sequence of length `t` (None: nothing): for a printout or a test."""
    return _refusal(graph, _live(graph), t)
