"""ATP's row-/column-first 2D tensor-parallel layers (ATP paper Sec. 3.2, Fig. 5, Fig. 6).

Conventions
-----------
DeviceMesh(d1, d2): axis 0 ("atp0") has size d1, axis 1 ("atp1") size d2, rank = i0*d2 + i1.
A linear is ``Y = X A`` with ``A`` of shape ``[in, out]`` (torch's ``nn.Linear.weight`` is
``A^T``). Placements are per mesh axis, ``[axis0, axis1]``; ``Shard(-1)`` is the last
(feature) dim of an activation.

=============  ======================  =====================  ======================  ==========  ==========
layer          weight A [in, out]      input X                output Y                fwd AR on   bwd AR on
=============  ======================  =====================  ======================  ==========  ==========
column-first   [Shard(1), Shard(0)]    [Replicate, Shard(-1)]  [Shard(-1), Replicate]  atp1        atp0
row-first      [Shard(0), Shard(1)]    [Shard(-1), Replicate]  [Replicate, Shard(-1)]  atp0        atp1
=============  ======================  =====================  ======================  ==========  ==========

Column-first: the local GEMM ``[b, in/d2] x [in/d2, out/d1]`` is partial over atp1 and is
all-reduced there (``b*out/d1`` elements); the input gradient ``dY_local A_local^T`` is partial
over atp0 (``b*in/d2``). Row-first is the mirror image. The bias is sharded like the output
features (column-first ``[Shard(0), Replicate]``, row-first ``[Replicate, Shard(0)]``) and added
once, after the all-reduce. Weight and bias gradients need no communication: every rank holds
the complete gradient of its own shard.

Communication of one transformer block (Fig. 6) and ATP Eq. 2
--------------------------------------------------------------
Activations ``[b, s, .]`` with element size ``e``; ``M`` is the full buffer of the collective
(the reduced buffer of an all-reduce, the gathered output of an all-gather).

==========  ===============================  ==========  ==========  ===================
phase       operator                         collective  axis        M / (b*s*e)
==========  ===============================  ==========  ==========  ===================
forward     LN1 statistics                   all-reduce  atp1        2 (in the wide dtype)
forward     f1: QKV, column-first            all-reduce  atp1        3h/d1
forward     scatter heads over atp1          (none)      -           -
forward     gather heads over atp1           all-gather  atp1        h/d1
forward     f2: out-proj, row-first          all-reduce  atp0        h/d2
forward     LN2 statistics                   all-reduce  atp1        2 (in the wide dtype)
forward     f3: MLP up, column-first         all-reduce  atp1        4h/d1
forward     f4: MLP down, row-first          all-reduce  atp0        h/d2
backward    f4: MLP-down input gradient      all-reduce  atp1        4h/d1
backward    f3: MLP-up input gradient        all-reduce  atp0        h/d2
backward    LN2 (sum g, sum g*xhat)          all-reduce  atp1        2 (in the wide dtype)
backward    f2: out-proj input gradient      all-reduce  atp1        h/d1
backward    gather's backward (slice)        (none)      -           -
backward    scatter's backward               all-gather  atp1        3h/d1
backward    f1: QKV input gradient           all-reduce  atp0        h/d2
backward    LN1 (sum g, sum g*xhat)          all-reduce  atp1        2 (in the wide dtype)
==========  ===============================  ==========  ==========  ===================

A ring all-gather of ``M`` bytes costs ``(n-1)/n * M / B`` and a ring all-reduce
``2(n-1)/n * M / B``, so an all-gather counts as half an all-reduce of the same ``M``.
Leaving out the LayerNorm statistics, the all-reduce-equivalent bytes per block are
``(3 + 1/2 + 4 + 4 + 1 + 3/2) h/d1 = 2 * 7h/d1`` on atp1 and ``(1 + 1 + 1 + 1) h/d2 = 2 * 2h/d2``
on atp0, i.e. the time is ``2 * (7h / (d1 B2) + 2h / (d2 B1)) * b * s * e`` -- ATP's Eq. 2 per
layer (B1/B2: all-reduce algorithm bandwidth on atp0/atp1). Note the paper's Fig. 6 caption
says f1/f3 all-reduce over the *first* mesh dimension in the forward pass; its Eq. 2 (f1 costs
``3h/(d1 B2)``) and the placements above put it on the second, which is what is implemented.

LayerNorm with the hidden dim split over atp1 (``[Replicate, Shard(-1)]``): the cheapest exact
way is to all-reduce per-token statistics, not the activations. Forward: one all-reduce of
``[sum x, sum x^2]`` accumulated in a dtype one step wider than the activations (float64 for
float32: the one-pass variance then loses nothing that matters at float32 precision).
Backward: one all-reduce of ``[sum g, sum g*xhat]`` (``g = dy * gamma``), same dtype. That is
``2 * b * s`` elements per LayerNorm per direction instead of ``b * s * h`` for a gather. On a
size-1 atp1 (DeviceMesh(N, 1)) LayerNorm is plain ``F.layer_norm``: no collective at all, so
DeviceMesh(N, 1) issues exactly Megatron-LM's 2 forward + 2 backward all-reduces per block.

Every collective skips groups of one rank, reports to :mod:`meshpilot.runtime.collective_log`, and is a
``c10d`` op (visible to ``CommDebugMode``).

Chunk-based overlap (Sec. 4.1-4.2): each layer has a ``start(x) -> Pending`` that launches its
collective asynchronously; ``forward`` with ``chunks=k`` splits the batch (dim 0) into k chunks,
starts them all, then waits, so chunk i's all-reduce runs while chunk i+1's GEMM computes. The
block/model (:mod:`meshpilot.runtime.atp.gpt`) chains the ``start`` calls of consecutive layers
per chunk, so the overlap spans the whole block. In backward every linear launches its
input-gradient all-reduce asynchronously and computes the weight gradient while it runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from meshpilot.runtime.atp.comm import (
    ConjugateMatmul,
    MeshAxis,
    Pending,
    ShardedLayerNormFn,
    layer_norm_stats,
)

__all__ = [
    "COLUMN_FIRST",
    "ROW_FIRST",
    "ATPLinear",
    "ShardedEmbedding",
    "ShardedLayerNorm",
    "local_of",
    "shard_parameter",
]

COLUMN_FIRST = "column"
ROW_FIRST = "row"

# (weight A [in, out], bias [out], input X, output Y) placements per strategy.
_PLACEMENTS: dict[str, tuple[tuple[Placement, Placement], ...]] = {
    COLUMN_FIRST: (
        (Shard(1), Shard(0)),
        (Shard(0), Replicate()),
        (Replicate(), Shard(-1)),
        (Shard(-1), Replicate()),
    ),
    ROW_FIRST: (
        (Shard(0), Shard(1)),
        (Replicate(), Shard(0)),
        (Shard(-1), Replicate()),
        (Replicate(), Shard(-1)),
    ),
}


def _check_mesh(mesh: DeviceMesh) -> None:
    if mesh.ndim != 2:
        raise ValueError(
            f"ATP layers need a 2D DeviceMesh(d1, d2), got a {mesh.ndim}D mesh of shape "
            f"{tuple(mesh.shape)}; build one with init_mesh((d1, d2))"
        )


def _shard_generator(seed: int, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Generator:
    """A generator equal on every rank holding the same shard (coords of sharded axes only)."""
    key = seed
    for dim, p in enumerate(placements):
        coord = mesh.get_local_rank(dim) if isinstance(p, Shard) else 0
        key = key * 1_000_003 + coord
    return torch.Generator().manual_seed(key % (2**63))


def shard_parameter(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> nn.Parameter:
    """A DTensor parameter holding this rank's shard of ``full`` (sliced locally, no comm).

    ``full`` must be identical on every rank (e.g. the same seeded single-device model).
    """
    d = distribute_tensor(full.detach(), mesh, list(placements), src_data_rank=None)
    return nn.Parameter(d)


def local_of(p: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor parameter (differentiable), or the tensor itself."""
    return p.to_local() if isinstance(p, DTensor) else p


def _new_param(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], global_shape: Sequence[int]
) -> nn.Parameter:
    d = DTensor.from_local(local, mesh, list(placements), run_check=False)
    if tuple(d.shape) != tuple(global_shape):  # even sharding is checked by the callers
        raise AssertionError(f"shard {tuple(local.shape)} does not tile {tuple(global_shape)}")
    return nn.Parameter(d)


class ATPLinear(nn.Module):
    """Column-first or row-first 2D tensor-parallel ``Y = X A + b`` on DeviceMesh(d1, d2).

    ``forward``/``start`` take and return *local* activation shards: the input with
    :attr:`input_placements`, the output with :attr:`output_placements` (see the module
    docstring). ``weight`` is a DTensor of global shape ``[in_features, out_features]`` (the
    paper's ``A``; torch's ``nn.Linear.weight`` is its transpose) and ``weight.placements``
    reports its sharding; ``bias`` is a DTensor of shape ``[out_features]``.

    ``chunks=k`` splits the batch (dim 0) of ``forward``'s input into k chunks whose
    all-reduces overlap the next chunk's GEMM. Parameters are initialised like ``nn.Linear``
    from a generator seeded by ``seed`` and the shard coordinates, so ranks holding the same
    shard hold the same values; use :meth:`from_linear` to copy a single-device layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mesh: DeviceMesh,
        first: str = COLUMN_FIRST,
        bias: bool = True,
        chunks: int = 1,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_mesh(mesh)
        if first not in _PLACEMENTS:
            raise ValueError(f"first={first!r} must be {COLUMN_FIRST!r} or {ROW_FIRST!r}")
        if chunks < 1:
            raise ValueError(f"chunks={chunks} must be >= 1 (1 disables chunk overlap)")
        d1, d2 = mesh.size(0), mesh.size(1)
        in_split, out_split = (d2, d1) if first == COLUMN_FIRST else (d1, d2)
        if in_features % in_split or out_features % out_split:
            raise ValueError(
                f"{first}-first ATPLinear({in_features}, {out_features}) on DeviceMesh({d1}, {d2}) "
                f"needs in_features divisible by {in_split} and out_features divisible by "
                f"{out_split}; pad the features or choose another mesh"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.mesh = mesh
        self.first = first
        self.chunks = chunks
        w_pl, b_pl, self.input_placements, self.output_placements = _PLACEMENTS[first]
        self.axis0 = MeshAxis(mesh, 0)
        self.axis1 = MeshAxis(mesh, 1)
        if first == COLUMN_FIRST:
            self.fwd_axis, self.bwd_axis = self.axis1, self.axis0
        else:
            self.fwd_axis, self.bwd_axis = self.axis0, self.axis1

        dtype = dtype or torch.get_default_dtype()
        device = torch.device(mesh.device_type)
        bound = 1.0 / math.sqrt(in_features)
        w_local = torch.empty(in_features // in_split, out_features // out_split, dtype=dtype)
        w_local.uniform_(-bound, bound, generator=_shard_generator(seed, mesh, w_pl))
        self.weight = _new_param(w_local.to(device), mesh, w_pl, (in_features, out_features))
        if bias:
            b_local = torch.empty(out_features // out_split, dtype=dtype)
            b_local.uniform_(-bound, bound, generator=_shard_generator(seed + 1, mesh, b_pl))
            self.bias: nn.Parameter | None = _new_param(b_local.to(device), mesh, b_pl, (out_features,))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh: DeviceMesh, first: str = COLUMN_FIRST, chunks: int = 1) -> ATPLinear:
        """Shard a single-device ``nn.Linear`` (identical on every rank) exactly."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            mesh,
            first,
            bias=linear.bias is not None,
            chunks=chunks,
            dtype=linear.weight.dtype,
        )
        layer.load_full_(linear.weight.detach().t(), None if linear.bias is None else linear.bias.detach())
        return layer

    @torch.no_grad()
    def load_full_(self, a: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard of the full ``A`` [in, out] (and bias [out])."""
        w = distribute_tensor(a, self.mesh, list(self.weight.placements), src_data_rank=None)
        local_of(self.weight).copy_(w.to_local())
        if bias is not None:
            if self.bias is None:
                raise ValueError("this ATPLinear has no bias to load into")
            b = distribute_tensor(bias, self.mesh, list(self.bias.placements), src_data_rank=None)
            local_of(self.bias).copy_(b.to_local())

    def start(self, x: torch.Tensor) -> Pending[torch.Tensor]:
        """Run the local GEMM and launch the forward all-reduce; wait() adds the bias."""
        works: list[dist.Work] = []
        y = ConjugateMatmul.apply(x, local_of(self.weight), self.fwd_axis, self.bwd_axis, works)
        if self.bias is None:
            return Pending(works, lambda: y)
        b = local_of(self.bias)
        return Pending(works, lambda: y + b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunks == 1 or x.dim() < 2 or x.shape[0] < 2:
            return self.start(x).wait()
        pending = [self.start(c) for c in x.chunk(self.chunks, dim=0)]
        return torch.cat([p.wait() for p in pending], dim=0)

    def extra_repr(self) -> str:
        d1, d2 = self.mesh.size(0), self.mesh.size(1)
        return (
            f"in={self.in_features}, out={self.out_features}, first={self.first}, "
            f"mesh=({d1}, {d2}), bias={self.bias is not None}, chunks={self.chunks}"
        )


class ShardedLayerNorm(nn.Module):
    """LayerNorm over a hidden dim split across mesh axis ``axis`` (default 1: input
    ``[Replicate, Shard(-1)]``). ``weight``/``bias`` are DTensors sharded the same way
    (``[Replicate, Shard(0)]`` for axis 1). Exact: see the module docstring."""

    def __init__(
        self,
        n_features: int,
        mesh: DeviceMesh,
        eps: float = 1e-5,
        axis: int = 1,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_mesh(mesh)
        self.axis = MeshAxis(mesh, axis)
        if n_features % self.axis.size:
            raise ValueError(
                f"ShardedLayerNorm({n_features}) needs n_features divisible by the size "
                f"{self.axis.size} of mesh axis {self.axis.name}"
            )
        self.n_features = n_features
        self.eps = eps
        self.mesh = mesh
        pl: list[Placement] = [Replicate(), Replicate()]
        pl[axis] = Shard(0)
        n_local = n_features // self.axis.size
        dtype = dtype or torch.get_default_dtype()
        device = torch.device(mesh.device_type)
        self.weight = _new_param(torch.ones(n_local, dtype=dtype, device=device), mesh, pl, (n_features,))
        self.bias = _new_param(torch.zeros(n_local, dtype=dtype, device=device), mesh, pl, (n_features,))

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        pl = list(self.weight.placements)
        local_of(self.weight).copy_(distribute_tensor(weight, self.mesh, pl, src_data_rank=None).to_local())
        local_of(self.bias).copy_(distribute_tensor(bias, self.mesh, pl, src_data_rank=None).to_local())

    def start(self, x: torch.Tensor) -> Pending[torch.Tensor]:
        """Launch the statistics all-reduce; wait() normalises."""
        w, b = local_of(self.weight), local_of(self.bias)
        if self.axis.size == 1:
            return Pending.ready(F.layer_norm(x, (self.n_features,), w, b, self.eps))
        works: list[dist.Work] = []
        stats = layer_norm_stats(x, self.axis, self.n_features, self.eps, works)

        def finish() -> torch.Tensor:
            mean, rstd = stats()
            return ShardedLayerNormFn.apply(x, w, b, mean, rstd, self.axis, self.n_features)

        return Pending(works, finish)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.start(x).wait()


class ShardedEmbedding(nn.Module):
    """Embedding table ``[num, dim]`` with the embedding dim split over axis 1
    (``[Replicate, Shard(1)]``): the lookup yields ``[Replicate, Shard(-1)]`` activations
    directly, and the gradient of every shard is local. No communication either way."""

    def __init__(self, num: int, dim: int, mesh: DeviceMesh, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        _check_mesh(mesh)
        d2 = mesh.size(1)
        if dim % d2:
            raise ValueError(f"ShardedEmbedding dim={dim} must be divisible by d2={d2}")
        self.mesh = mesh
        pl = (Replicate(), Shard(1))
        dtype = dtype or torch.get_default_dtype()
        local = torch.empty(num, dim // d2, dtype=dtype)
        local.normal_(0.0, 0.02, generator=_shard_generator(0, mesh, pl))
        self.weight = _new_param(local.to(torch.device(mesh.device_type)), mesh, pl, (num, dim))

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor) -> None:
        d = distribute_tensor(weight, self.mesh, list(self.weight.placements), src_data_rank=None)
        local_of(self.weight).copy_(d.to_local())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, local_of(self.weight))
