"""Fold the recorded programs' no-op views: the same tensors with fewer ops to call.

A recorded program (``runtime.record``) replays every op DTensor and the decompositions ran, one Python call
each (≈ 2–4 µs on a CPU host), and many of them only relabel a tensor: the data-parallel backward of the
loopback bench's GPT (``benchmarks/bench_vs_torch.py``, 4 ranks) holds 166 ``view``, 34 ``t`` and 18 ``detach``
calls among its 376 ops, its ZeRO-3 backward another 106 ``permute`` calls that keep every dim in place.
:func:`fold_views` rewrites, for an op ``y = f(x, …)`` whose operand ``x`` is a tensor of the program:

* **identity** — ``y`` is ``x`` seen the same way: ``detach(x)``, ``alias(x)``, ``permute(x, (0, 1, …))``,
  ``view(x, shape of x)``, ``slice`` or ``expand`` of the whole of ``x`` — any of these views whose recorded
  layout is its operand's — or ``t(t(z))`` / ``transpose(transpose(z, a, b), a, b)`` (then ``y`` is ``z``). Every
  reader of ``y`` reads ``x`` (``z``) instead and the op goes;
* **view of a view** — ``view(view(z, a), b)`` is computed as ``view(z, b)``: the inner view stays only while
  other readers need it.

That takes 61 ops out of that DP backward and 164 out of the ZeRO-3 one (6 out of each forward).

Exactness: a view is the same storage at the same offset read through a shape and strides, so two
descriptions of the same elements read the same bits. A fold is made only where the recording shows the
descriptions equal: the shape, strides and offset a reader gets after the fold are the ones it got when
recorded (``record.LAYOUT``; for a view of a view checked on the meta device: ``view(z, b)`` must exist and have
``y``'s strides). ``view`` keeps the elements' row-major order, so ``view(view(z, a), b)`` and ``view(z, b)``
are the same elements whatever strides a later call's ``z`` has, and the second exists wherever the first does.
Nothing is copied or reordered and every alias stays an alias of the same storage, so in-place writes (a
bucket's ``mm.out``: ``runtime.buckets.write_into_buckets``) land where they did.

What an identity fold changes is which Python object a reader receives. Hence two limits: a value the program
returns is replaced by its operand only where that is a tensor the program made and returns nowhere else (the
caller may hold, mutate or hand autograd what it gets: a returned ``detach(param)`` must not become the
parameter, nor one output another's object; a returned view of a view is still a view of its own); and only
programs that run without autograd are folded, ``detach`` being a no-op only there: the direct programs run
below autograd (``program.direct_ops``), ``compile=True`` ones are left to ``torch.compile``.
"""

from __future__ import annotations

import torch
import torch.fx

from meshpilot.runtime.record import LAYOUT

_aten = torch.ops.aten
_SAME = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
    _aten.permute.default,
    _aten.slice.Tensor,
    _aten.expand.default,
}
"""Views that are their operand where they keep its layout (same shape, strides and offset, same storage):
``detach``, ``view`` to its own shape, ``permute`` keeping every dim, a ``slice`` of a whole dim."""
_SELF_INVERSE = {_aten.t.default, _aten.transpose.int}
"""Ops that applied twice with the same arguments give back their operand's description."""
_VIEWS = _SAME | _SELF_INVERSE
"""The ops folded: a left-over one nobody reads any more goes too."""


def fold_views(gm: torch.fx.GraphModule) -> int:
    """Fold `gm`'s no-op views in place (module docstring); returns how many ops went."""
    graph = gm.graph
    before = len(graph.nodes)
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        same = _same_as(node)
        if same is not None and (not _returned(node) or _handed_out_as_made(same)):
            node.replace_all_uses_with(same)
            graph.erase_node(node)
            changed = True
            continue
        inner = _inner_view(node)
        if inner is not None:
            node.args = (inner.args[0], *node.args[1:])
            changed = True
    for node in reversed(list(graph.nodes)):  # what a fold left unread: t(z) of a t(t(z)), an inner view
        if node.op == "call_function" and node.target in _VIEWS and not node.users:
            graph.erase_node(node)
    if changed:
        graph.lint()
        gm.recompile()
    return before - len(graph.nodes)


def _returned(node: torch.fx.Node) -> bool:
    return any(u.op == "output" for u in node.users)


def _handed_out_as_made(node: torch.fx.Node) -> bool:
    """Whether the program may return `node`'s tensor itself in place of a no-op view of it: one its own ops
    made (not an input or a constant, which the caller holds) and that it does not return already."""
    return node.op == "call_function" and not _returned(node)


def _layout(node) -> tuple | None:
    return node.meta.get(LAYOUT) if isinstance(node, torch.fx.Node) else None


def _same_as(node: torch.fx.Node) -> torch.fx.Node | None:
    """The program value `node` is a no-op of (identity rules), or None."""
    if not node.args or node.kwargs:
        return None
    x = node.args[0]
    mine, theirs = _layout(node), _layout(x)
    if mine is None or theirs is None:
        return None
    target = node.target
    if target in _SAME:
        return x if mine == theirs else None
    if target in _SELF_INVERSE and isinstance(x, torch.fx.Node) and x.target is target and x.args[1:] == node.args[1:]:
        z = x.args[0]
        return z if _layout(z) == mine else None
    return None


def _inner_view(node: torch.fx.Node) -> torch.fx.Node | None:
    """For ``view(view(z, a), b)``: the inner view, where ``view(z, b)`` is ``node``'s tensor; else None."""
    if node.target is not _aten.view.default or node.kwargs or len(node.args) != 2:
        return None
    inner = node.args[0]
    if not isinstance(inner, torch.fx.Node) or inner.target is not _aten.view.default or inner.kwargs:
        return None
    z = inner.args[0]
    src, mine = _layout(z), _layout(node)
    if src is None or mine is None:
        return None
    shape, stride, offset, dtype = src
    try:
        direct = torch.empty_strided(shape, stride, dtype=dtype, device="meta").view(node.args[1])
    except RuntimeError:  # not viewable from z directly: the chain stays
        return None
    return inner if (tuple(direct.shape), direct.stride(), offset, dtype) == mine else None
