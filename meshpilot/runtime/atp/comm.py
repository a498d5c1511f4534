"""Collectives over one axis of an ATP device mesh, and the autograd operators built on them.

Every collective here

- is skipped (returns ``None``, records nothing) on a group of one rank, so DeviceMesh(N, 1)
  issues exactly Megatron-LM's collectives and nothing on the size-1 axis;
- is reported to :mod:`meshpilot.runtime.collective_log` (kind, axis name, group size, bytes, phase);
- is a plain ``c10d`` op, so ``CommDebugMode`` counts it too;
- may be launched with ``async_op=True``; the caller waits on the returned work before it
  reads the result (see :class:`Pending`).

Autograd operators (names follow ATP Fig. 6):

- :class:`ConjugateMatmul` is the linear ``Y = f(X A)``: a local GEMM whose output is
  all-reduced over ``fwd_axis`` in the forward pass and whose input gradient is all-reduced over
  ``bwd_axis`` in the backward pass (f1/f3: forward axis 1, backward axis 0; f2/f4: the
  reverse). In backward the input-gradient all-reduce is launched asynchronously and the
  weight-gradient GEMM runs while it is in flight (ATP Sec. 4.2).
- :class:`ScatterLastDim` slices the last dim for this rank's coordinate on an axis (no comm);
  its backward all-gathers the gradient. :class:`GatherLastDim` is the conjugate: an
  all-gather forward (launchable async) and a slice backward.
- :class:`ShardedLayerNormFn` is LayerNorm over a feature dim split across an axis.
- :class:`VocabParallelCrossEntropy` is cross-entropy over logits whose vocab dim is split
  across an axis (Megatron-LM's vocab-parallel loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpilot import compat
from meshpilot.cluster.mesh import default_axis_names
from meshpilot.runtime import collective_log
from meshpilot.sharding.reshard import CollectiveKind

__all__ = [
    "ConjugateMatmul",
    "GatherLastDim",
    "MeshAxis",
    "Pending",
    "ScatterLastDim",
    "ShardedLayerNormFn",
    "VocabParallelCrossEntropy",
    "all_gather_last_dim",
    "all_reduce",
]

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True, eq=False)
class MeshAxis:
    """One dimension of a DeviceMesh: its process group, size and this rank's coordinate."""

    mesh: DeviceMesh
    dim: int

    @property
    def name(self) -> str:
        """The mesh's name for the axis (positional, ``axis0``, ..., on a mesh built without names)."""
        return (self.mesh.mesh_dim_names or default_axis_names(self.mesh.ndim))[self.dim]

    @property
    def size(self) -> int:
        return self.mesh.size(self.dim)

    @property
    def coord(self) -> int:
        """This rank's index along the axis."""
        return self.mesh.get_local_rank(self.dim)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.dim)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(
    t: torch.Tensor,
    axis: MeshAxis,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    async_op: bool = False,
) -> dist.Work | None:
    """In-place all-reduce of ``t`` over ``axis``; ``None`` (and nothing issued) if size 1."""
    if axis.size == 1:
        return None
    collective_log.record(CollectiveKind.ALL_REDUCE, axis.name, axis.size, _nbytes(t))
    return dist.all_reduce(t, op=op, group=axis.group, async_op=async_op)


def _all_gather_dim0(t: torch.Tensor, axis: MeshAxis, async_op: bool) -> tuple[torch.Tensor, dist.Work | None]:
    """All-gather ``t`` along a new leading block: returns [size * t.shape[0], ...]."""
    t = t.contiguous()
    out = torch.empty((axis.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    collective_log.record(CollectiveKind.ALL_GATHER, axis.name, axis.size, _nbytes(out))
    work = compat.all_gather_single()(out, t, group=axis.group, async_op=async_op)
    return out, work


def _blocks_to_last_dim(buf: torch.Tensor, n: int) -> torch.Tensor:
    """[n * b, ..., f] (rank-major blocks from an all-gather) -> [b, ..., n * f]."""
    b = buf.shape[0] // n
    rest = buf.shape[1:-1]
    f = buf.shape[-1]
    x = buf.view(n, b, *rest, f).movedim(0, -2)  # [b, ..., n, f]
    return x.reshape(b, *rest, n * f)


def all_gather_last_dim(t: torch.Tensor, axis: MeshAxis) -> torch.Tensor:
    """Synchronous all-gather concatenating the last dim in rank order (no autograd)."""
    if axis.size == 1:
        return t
    buf, work = _all_gather_dim0(t, axis, async_op=False)
    return _blocks_to_last_dim(buf, axis.size)


class Pending(Generic[T]):
    """A value whose collectives may still be in flight; :meth:`wait` waits, then finishes it.

    The autograd graph already contains the tensors being filled; only reading them must wait.
    """

    __slots__ = ("_finish", "_works")

    def __init__(self, works: list[dist.Work], finish: Callable[[], T]) -> None:
        self._works = works
        self._finish = finish

    @staticmethod
    def ready(value: U) -> Pending[U]:
        return Pending([], lambda: value)

    def then(self, fn: Callable[[T], U]) -> Pending[U]:
        """A Pending that applies ``fn`` to this one's value after waiting."""
        finish = self._finish
        return Pending(self._works, lambda: fn(finish()))

    def wait(self) -> T:
        for w in self._works:
            w.wait()
        self._works = []
        return self._finish()


class ConjugateMatmul(torch.autograd.Function):
    """``Y = X @ A`` all-reduced over ``fwd_axis``; ``dX = dY @ A^T`` all-reduced over ``bwd_axis``.

    ``a`` is the local shard of A in the paper's ``[in, out]`` layout. When ``works`` is a list
    the forward all-reduce is launched asynchronously and its work appended; the caller must
    wait on it before reading ``Y``. Otherwise the forward is synchronous.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        a: torch.Tensor,
        fwd_axis: MeshAxis,
        bwd_axis: MeshAxis,
        works: list[dist.Work] | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, a)
        ctx.bwd_axis = bwd_axis
        y = torch.matmul(x, a)
        work = all_reduce(y, fwd_axis, async_op=works is not None)
        if work is not None and works is not None:
            works.append(work)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, a = ctx.saved_tensors
        dx = da = None
        work = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dy, a.t())
            work = all_reduce(dx, ctx.bwd_axis, async_op=True)
        if ctx.needs_input_grad[1]:
            # Overlaps with the input-gradient all-reduce in flight (ATP Sec. 4.2).
            da = torch.matmul(x.reshape(-1, x.shape[-1]).t(), dy.reshape(-1, dy.shape[-1]))
        if work is not None:
            work.wait()
        return dx, da, None, None, None


class ScatterLastDim(torch.autograd.Function):
    """Forward: this rank's contiguous block of the last dim along ``axis`` (no comm).
    Backward: all-gather of the gradient over ``axis`` (the conjugate of :class:`GatherLastDim`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: MeshAxis) -> torch.Tensor:  # type: ignore[override]
        ctx.axis = axis
        n = x.shape[-1] // axis.size
        return x[..., axis.coord * n : (axis.coord + 1) * n].contiguous()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return all_gather_last_dim(dy, ctx.axis), None


class GatherLastDim(torch.autograd.Function):
    """Forward: all-gather over ``axis`` into a rank-major buffer ``[size * b, ..., f]``
    (async when ``works`` is a list; reshape it with :func:`blocks_to_last_dim` after waiting).
    Backward: this rank's block of the gradient (no comm)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, axis: MeshAxis, works: list[dist.Work] | None
    ) -> torch.Tensor:
        ctx.axis = axis
        ctx.b = x.shape[0]
        buf, work = _all_gather_dim0(x, axis, async_op=works is not None)
        if work is not None and works is not None:
            works.append(work)
        return buf

    @staticmethod
    def backward(ctx: Any, dbuf: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        b, c = ctx.b, ctx.axis.coord
        return dbuf[c * b : (c + 1) * b], None, None


def blocks_to_last_dim(buf: torch.Tensor, n: int) -> torch.Tensor:
    """Differentiable reshape of :class:`GatherLastDim`'s buffer to ``[b, ..., n * f]``."""
    return _blocks_to_last_dim(buf, n)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for the sharded LayerNorm statistics: one step wider than ``dtype``."""
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


class ShardedLayerNormFn(torch.autograd.Function):
    """LayerNorm over a feature dim of global size ``n_features`` split across ``axis``.

    ``mean`` and ``rstd`` (shape ``[..., 1]``) come from :func:`layer_norm_stats` and carry no
    autograd history: this Function's backward differentiates through them exactly, with one
    all-reduce of ``[sum(g), sum(g * xhat)]`` (``g = dy * weight``) over ``axis``, launched
    async while the local weight/bias gradients are computed.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        mean: torch.Tensor,
        rstd: torch.Tensor,
        axis: MeshAxis,
        n_features: int,
    ) -> torch.Tensor:
        xhat = (x - mean) * rstd
        ctx.save_for_backward(xhat, weight, rstd)
        ctx.axis = axis
        ctx.n = n_features
        return xhat * weight + bias

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        xhat, weight, rstd = ctx.saved_tensors
        dx = work = sums = g = None
        if ctx.needs_input_grad[0]:
            g = dy * weight
            acc = stats_dtype(dy.dtype)
            sums = torch.stack([g.sum(-1, dtype=acc), (g * xhat).sum(-1, dtype=acc)], dim=-1)
            work = all_reduce(sums, ctx.axis, async_op=True)
        lead = tuple(range(dy.dim() - 1))
        dweight = (dy * xhat).sum(dim=lead) if ctx.needs_input_grad[1] else None
        dbias = dy.sum(dim=lead) if ctx.needs_input_grad[2] else None
        if work is not None:
            work.wait()
        if sums is not None:
            sums = (sums / ctx.n).to(dy.dtype)
            dx = rstd * (g - sums[..., 0:1] - xhat * sums[..., 1:2])
        return dx, dweight, dbias, None, None, None, None


def layer_norm_stats(
    x: torch.Tensor, axis: MeshAxis, n_features: int, eps: float, works: list[dist.Work] | None
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """Launch the all-reduce of ``[sum(x), sum(x^2)]`` (wide dtype) over ``axis``; returns a
    finisher giving ``(mean, rstd)`` in ``x.dtype`` once the caller has waited on ``works``."""
    acc = stats_dtype(x.dtype)
    with torch.no_grad():
        xs = x.detach().to(acc)
        sums = torch.stack([xs.sum(-1), (xs * xs).sum(-1)], dim=-1)
        work = all_reduce(sums, axis, async_op=works is not None)
        if work is not None and works is not None:
            works.append(work)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        mean = sums[..., 0:1] / n_features
        var = (sums[..., 1:2] / n_features - mean * mean).clamp_min(0.0)
        return mean.to(x.dtype), torch.rsqrt(var + eps).to(x.dtype)

    return finish


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits ``[n, V / size]`` whose vocab dim is split over ``axis``.

    Forward: all-reduce MAX of the row maxima, then one all-reduce SUM of
    ``[sum(exp(l - max)), target logit]``. Backward: ``softmax - onehot`` on the local vocab
    block, no comm.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, axis: MeshAxis
    ) -> torch.Tensor:
        v_local = logits.shape[-1]
        start = axis.coord * v_local
        m = logits.max(dim=-1).values
        all_reduce(m, axis, op=dist.ReduceOp.MAX)
        shifted = logits - m.unsqueeze(-1)
        exp = shifted.exp()
        in_range = (target >= start) & (target < start + v_local)
        local_t = (target - start).clamp(0, v_local - 1)
        t_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * in_range
        sums = torch.stack([exp.sum(-1), t_logit], dim=-1)
        all_reduce(sums, axis)
        loss = sums[:, 0].log() - sums[:, 1]
        ctx.save_for_backward(exp / sums[:, 0:1], local_t, in_range)
        return loss

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        softmax, local_t, in_range = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= in_range.to(grad.dtype)
        return grad * dloss.unsqueeze(-1), None, None
