"""Views: which ATen ops return their input's storage, and the op sets the planner and runtime treat as views.

One home for what was listed in five places. Targets are ATen overload names as the capture records them
(``OpNode.target``, ``str(op)``).

* :func:`is_view_op` — the capture's test (``OpNode.is_view``): ATen's own ``is_view`` tag, ``getitem``,
  and :data:`ALIAS_OPS` (metadata-only ops ATen does not tag).
* :data:`UNTRACKED_ALIASES` — ops the capture does not mark as views that nonetheless return their input's
  storage (``matmul``'s ``_unsafe_view`` of its ``mm`` output: no kernel, no autograd view tracking); with
  views they make :func:`aliases_input`, the accounting's "allocates nothing" test.
* :data:`STRICT_VIEWS` — views that need a compatible stride (``view``): the runtime makes an operand
  contiguous first where a redistributed layout no longer fits (``runtime.interpret``).
* :data:`SHAPE_VIEWS` — reshapes and copies that keep every element in order (the forced Megatron plans
  align a dimension through them: ``planner.forced``); :data:`LAYOUT_VIEWS` adds the ones that reorder or
  select dims and the splits (a Megatron chain passes through them).
"""

from __future__ import annotations

import operator
from typing import Any

ALIAS_OPS = frozenset({"aten.detach.default", "aten.alias.default", "aten.lift_fresh.default"})
"""Metadata-only ops ATen does not tag as views: zero FLOPs, zero bytes, the input's storage."""

UNTRACKED_ALIASES = frozenset({"aten._unsafe_view.default"})

STRICT_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default"})

SHAPE_VIEWS = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.clone.default",
        "aten.contiguous.default",
        "aten.alias.default",
        "aten.detach.default",
    }
)

LAYOUT_VIEWS = SHAPE_VIEWS | {
    "aten.transpose.int",
    "aten.permute.default",
    "aten.t.default",
    "aten.select.int",
    "aten.slice.Tensor",
    "aten._to_copy.default",
    "aten.split.Tensor",
    "aten.split_with_sizes.default",
    "aten.unbind.int",
    "aten.chunk.default",
}


def is_view_op(target: Any) -> bool:
    """Whether an FX target returns a view of its input (module docstring)."""
    if target is operator.getitem:
        return True
    if str(target) in ALIAS_OPS:
        return True
    return bool(getattr(target, "is_view", False))


def aliases_input(node: Any) -> bool:
    """Whether an ``OpNode`` returns (a view of) its first operand's storage instead of allocating."""
    return bool(node.inputs) and (node.is_view or node.kind == "getitem" or node.target in UNTRACKED_ALIASES)
