"""``as_strided`` that is a sliding window, written as the views it is: reshape, narrow, ``unfold``, permute.

Longformer and LED cut the sequence into overlapping chunks with ``x.as_strided(size, stride)`` (their own
ONNX branch writes the same as ``x.unfold(1, 2w, w).transpose(2, 3)``). An ``as_strided`` names storage
offsets, not dims: DTensor has no strategy for it (nor for the ``as_strided_scatter`` its backward makes), so
the whole attention fell back to a replica. The same elements, read as views of the input's own dims, shard
like any view: the batch and head dims the window does not cross are sharded, the windowed dim is whole
(:mod:`meshpilot.ops.unfold`), and the backward is ``unfold_backward``.

:func:`as_views` finds that form for an ``as_strided`` of a contiguous tensor (or a transposed one: its dims
permuted to the contiguous order first). Its output dims, taken by
stride from the smallest, are read as mixed-radix digits of the storage offset: a dim whose stride is the
extent of those below it (or more: the dims below are narrowed) starts a new *base* dim of the input, reshaped
to those bases; a dim whose stride is a multiple ``k`` of the base dim below it but shorter than that dim's
extent is the window count of ``unfold(base, size, k)``. Each base is narrowed to the offset's digit and the
length the output reads; a smallest stride above 1 adds a base the output takes one element of. Anything else
(equal or zero strides, an offset or a window crossing a base, two windows on one base, an input no order of
whose dims is contiguous) has no such form: the caller keeps the ``as_strided``. The views' result is
checked to have the ``as_strided``'s shape, strides and storage offset, so where a form is returned it reads
exactly the same elements, and its gradient sums the same positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Base:
    """One dim of the input's reshape: its stride in elements, the output dim that walks it (None: the output
    takes one element of it), and, for a sliding window, the output dim counting windows and their step."""

    stride: int
    out: int | None
    size: int  # the output dim's size (the window's, for an unfold)
    count: int | None = None
    step: int = 0
    count_size: int = 0

    @property
    def length(self) -> int:
        """How many of this base's positions the output reads."""
        return (self.count_size - 1) * self.step + self.size if self.count is not None else self.size


def as_views(
    x: torch.Tensor, size: list[int] | tuple[int, ...], stride: list[int] | tuple[int, ...], storage_offset=None
) -> torch.Tensor | None:
    """``x.as_strided(size, stride, storage_offset)`` as reshape / narrow / ``unfold`` / permute views of `x`, or
    None where it has no such form (module docstring)."""
    size, stride = [int(n) for n in size], [int(s) for s in stride]
    x = _dense(x)
    if len(size) != len(stride) or x is None or x.numel() == 0 or 0 in size:
        return None
    start = x.storage_offset()
    rel = (start if storage_offset is None else int(storage_offset)) - start
    bases = _bases(size, stride)
    if bases is None or rel < 0:
        return None
    views = _read(x, bases, rel, size)
    if views is None:
        return None
    wide = [d for d, n in enumerate(size) if n > 1]
    same = tuple(views.shape) == tuple(size) and views.storage_offset() == start + rel
    if not same or any(views.stride(d) != stride[d] for d in wide):
        return None
    return views


def _dense(x: torch.Tensor) -> torch.Tensor | None:
    """`x`, or its dims permuted so that it is contiguous (a transposed tensor: the same storage, the same
    elements at each offset), or None where no order of its dims is contiguous (a slice, an expand)."""
    if x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.size(d)))
    y = x.permute(order)
    return y if y.is_contiguous() else None


def _bases(size: list[int], stride: list[int]) -> list[_Base] | None:
    """The input's base dims, innermost first, that the output's dims walk (module docstring), or None."""
    dims = sorted((s, n, d) for d, (n, s) in enumerate(zip(size, stride)) if n > 1)
    if not dims or dims[0][0] <= 0 or len({s for s, _, _ in dims}) != len(dims):
        return None
    bases = [] if dims[0][0] == 1 else [_Base(1, None, 1)]
    for s, n, d in dims:
        if not bases:
            bases.append(_Base(1, d, n))
            continue
        top = bases[-1]
        if s % top.stride:
            return None
        if top.out is not None and top.count is None and s < top.stride * top.size:  # overlapping: a window count
            top.count, top.step, top.count_size = d, s // top.stride, n
        elif s >= top.stride * top.length:
            bases.append(_Base(s, d, n))
        else:
            return None
    return bases


def _read(x: torch.Tensor, bases: list[_Base], rel: int, size: list[int]) -> torch.Tensor | None:
    """`x` reshaped to `bases` (outermost first), each narrowed to the offset's digit and the length read,
    windows unfolded, the one-element bases dropped and the dims permuted to the output's order."""
    n = x.numel()
    sizes = [bases[j + 1].stride // b.stride for j, b in enumerate(bases[:-1])]
    if n % bases[-1].stride:
        return None
    sizes.append(n // bases[-1].stride)
    digits = [(rel // b.stride) % m for b, m in zip(bases, sizes)]
    if rel >= n or any(o + b.length > m for b, o, m in zip(bases, digits, sizes)):
        return None
    y = x.reshape(sizes[::-1])
    last = len(bases) - 1
    labels: list[int | None] = []
    for j, b in reversed(list(enumerate(bases))):
        if digits[j] or b.length != sizes[j]:
            y = y.narrow(last - j, digits[j], b.length)
        labels.append(b.count if b.count is not None else b.out)
    for j, b in enumerate(bases):
        if b.count is not None:
            y = y.unfold(last - j, b.size, b.step)
            labels.append(b.out)
    for pos in reversed([p for p, label in enumerate(labels) if label is None]):
        y = y.select(pos, 0)
    labels = [label for label in labels if label is not None]
    order = [labels.index(d) for d in sorted(labels)]
    if order != sorted(order):
        y = y.permute(order)
    for d, m in enumerate(size):
        if m == 1:
            y = y.unsqueeze(d)
    return y
