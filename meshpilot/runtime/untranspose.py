"""ZeRO-3 weights gathered as stored: a recorded program's all-gather of a transposed weight rewritten to gather
the weight itself and read it transposed, as eager ``F.linear`` reads its weight (:func:`gather_untransposed`).

Unlike ``runtime.overlap``'s reordering, this changes ops: two copies go (the shard's transposed ``clone`` before
the collective, the rank blocks' ``split`` + ``cat`` after it) and a ``t`` view comes; the collective carries the
same bytes on the same group under the same tag, and the matrix product reads the same values through other
strides. ``runtime.program`` runs it on each recorded program first, before the issue points and gather groups
move its collectives.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

_aten = torch.ops.aten
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_READS_STRIDED = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2)}
"""Ops that read these operands (positions) through any strides: a transposed view costs them nothing (eager
``F.linear`` hands ``addmm`` its weight's ``t`` view)."""


def _row_major(layout: tuple | None) -> bool:
    """Whether a recorded layout (``record.LAYOUT``: shape, strides, offset, dtype) is a dense row-major one."""
    if layout is None:
        return False
    step = 1
    for d, s in zip(reversed(layout[0]), reversed(layout[1])):
        if d != 1 and s != step:
            return False
        step *= d
    return True


def _transposed_gather(coll: torch.fx.Node) -> tuple | None:
    """``(x, clone, t, pieces, cat, unpadding)`` when `coll` gathers a transposed 2-D tensor and a ``cat`` puts
    the rank blocks side by side, read only by matrix products, directly or through ``unpadding`` (DTensor's
    slices of every column) (:func:`gather_untransposed`); None otherwise."""
    from meshpilot.runtime.record import LAYOUT

    clone, n = coll.args[0], coll.args[1]
    if not (isinstance(clone, torch.fx.Node) and clone.target is _aten.clone.default and len(clone.users) == 1):
        return None
    t = clone.args[0]
    if not (isinstance(t, torch.fx.Node) and t.target is _aten.t.default and isinstance(t.args[0], torch.fx.Node)):
        return None
    x = t.args[0]
    layout = x.meta.get(LAYOUT)
    if not _row_major(layout) or len(layout[0]) != 2 or len(coll.users) != 1:
        return None
    wait = next(iter(coll.users))
    if "wait_tensor" not in str(wait.target) or len(wait.users) != 1:
        return None
    split = next(iter(wait.users))
    if split.target is not _aten.split.Tensor or split.args[1:] not in ((layout[0][1],), (layout[0][1], 0)):
        return None
    pieces = sorted(split.users, key=lambda p: p.args[1] if p.target is operator.getitem else -1)
    if [p.args[1] if p.target is operator.getitem else None for p in pieces] != list(range(n)):
        return None
    cat = next(iter(pieces[0].users)) if len(pieces[0].users) == 1 else None
    if cat is None or cat.target is not _aten.cat.default or cat.args[1:] not in ((1,), (-1,)) or cat.kwargs:
        return None
    if list(cat.args[0]) != pieces or any(len(p.users) != 1 for p in pieces):
        return None
    width = layout[0][0] * n
    whole = [u for u in cat.users if _whole_columns(u, width)]  # DTensor's unpadding of an even shard: a no-op
    for v, u in [(cat, u) for u in cat.users if u not in whole] + [(w, u) for w in whole for u in w.users]:
        spots = _READS_STRIDED.get(u.target)
        if spots is None or v in u.kwargs.values() or any(a is v for i, a in enumerate(u.args) if i not in spots):
            return None
    return x, clone, t, pieces, cat, whole


def _whole_columns(node: torch.fx.Node, width: int) -> bool:
    """Whether `node` slices every column of its ``[b, width]`` operand (``slice(y, 1, 0, ≥ width)``)."""
    if node.target is not _aten.slice.Tensor or node.kwargs:
        return False
    dim, start, end, step = (*node.args[1:], None, None, None, None)[:4]
    return dim in (1, -1) and start in (0, None) and (end is None or end >= width) and step in (1, None)


def gather_untransposed(gm: torch.fx.GraphModule) -> int:
    """Gather a sharded weight as it is stored and transpose the gathered one, instead of gathering its
    transpose: ``cat(split(all_gather(clone(t(x))), b), dim=1)`` — DTensor's all-gather of ``t(x)``, sharded
    on dim 1 because `x` (``[a, b]``, a rank's rows: ZeRO-3's ``Shard(0)`` weight as ``F.linear`` reads it) is
    sharded on dim 0 — becomes ``t(all_gather(x))``. Both are the ``[b, n·a]`` matrix whose column block `r`
    is rank `r`'s ``t(x)``; the first copies `x` into a transposed buffer, then the gathered matrix once more
    to move the rank blocks from rows to columns; the second copies nothing and reads the gathered weight
    through a transposed view, as eager ``F.linear`` reads its weight. The collective (one all-gather of the
    same bytes on the same group, under the same tag) is the same; only the order of the elements it carries
    changes, and the matrix product reads the same values through other strides.

    Made only where the recording shows `x` dense row-major (the collective's input must be contiguous), the
    split's pieces read by the ``cat`` alone, and every reader of the ``cat`` a matrix product reading it as
    an operand (``mm`` / ``addmm`` take any strides; a ``view`` of a transposed tensor would fail), directly or
    through DTensor's unpadding slice of every column (a no-op for an even shard, dropped). Run before
    the gathers are grouped or prefetched (``runtime.program``): a group then flattens `x` itself. Returns how
    many gathers changed."""
    from meshpilot.runtime.record import LAYOUT, VAL

    changed = 0
    for coll in [n for n in gm.graph.nodes if n.target is _ALL_GATHER]:
        found = _transposed_gather(coll)
        if found is None:
            continue
        x, clone, t, pieces, cat, unpadded = found
        wait = next(iter(coll.users))
        (a, b), dtype = x.meta[LAYOUT][0], x.meta[LAYOUT][3]
        rows = a * coll.args[1]
        coll.replace_input_with(clone, x)
        with gm.graph.inserting_before(cat):
            whole = gm.graph.call_function(_aten.t.default, (wait,))
        whole.meta["meshpilot_tag"] = cat.meta.get("meshpilot_tag")
        for node, shape, strides in ((coll, (rows, b), (b, 1)), (wait, (rows, b), (b, 1)), (whole, (b, rows), (1, b))):
            node.meta[VAL] = (shape, dtype)
            node.meta[LAYOUT] = (shape, strides, 0, dtype)
        for u in unpadded:
            u.replace_all_uses_with(whole)
            gm.graph.erase_node(u)
        cat.replace_all_uses_with(whole)
        for dead in (cat, *pieces, pieces[0].args[0], clone):
            gm.graph.erase_node(dead)
        if not t.users:
            gm.graph.erase_node(t)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed
