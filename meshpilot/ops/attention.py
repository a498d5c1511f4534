"""Attention as one device-generic node, forward and backward: ``meshpilot::sdpa`` and ``meshpilot::sdpa_backward``.

``F.scaled_dot_product_attention`` is a composite that picks a kernel by device while it is traced, so a
graph captured on CPU fake tensors holds ``_scaled_dot_product_flash_attention_for_cpu`` and its backward,
which a CUDA mesh cannot run. During capture (:func:`meshpilot.graph.capture.capture`) every call without
dropout is routed to :data:`sdpa` instead: a custom op whose backward is :data:`sdpa_backward`, so the joint
graph holds two nodes that say *what* is computed, never *which kernel*. The kernel is chosen when the op
runs, by the tensors' device (:data:`_FORWARD`, :data:`_BACKWARD`):

====== ==================================================================================================
device kernels
====== ==================================================================================================
cpu    ``_scaled_dot_product_flash_attention_for_cpu`` and its backward (what eager CPU attention runs, so a
       planned model equals the eager one to the last bit on an unsharded problem); values of another head
       size than the queries (multi-head latent attention), which that kernel refuses: the math path
cuda   the kernel eager attention picks for the operands (torch's ``_fused_sdp_choice``: cuDNN, flash or
       memory-efficient; no mask), with its backward kernel, so the planned model runs what eager runs; each
       is checked once per process against the math path on a small problem before it is used
       (:func:`_checked`), the next eligible one taking its place if it fails
other  the math path (:func:`_math_forward`, :func:`_math_backward`): softmax(QKᵀ·scale + mask) V and its
       gradient written out; every device runs it, and it is what the checks compare with
====== ==================================================================================================

Outputs are ``(out [b, h, t, e_v], lse [b, h, t] float32)``: the log-sum-exp of each query's scores, saved for
the backward (the math path and CPU kernel fill it; it has the same shape on every device, so plans do not
depend on where they run). Grouped-query attention (``enable_gqa``: fewer key/value heads) repeats the key/
value heads inside the op and sums their gradients back. Calls with dropout stay a composite: they decompose
into matmuls, softmax and ``native_dropout``, which :mod:`meshpilot.ops.dropout` makes exact under sharding.

Sharding (registered into DTensor's propagator, so the planner offers it and DTensor runs it): replicated,
batch-parallel (dim 0 of every tensor) and head-parallel (dim 1; key/value heads must divide like the query
heads). A mask is sharded with the batch or heads where it has that dim, else replicated; a mask made replicated
(built from positions and expanded to the batch, as transformers builds it) is sliced by batch from its replica
on each rank, no communication (:func:`meshpilot.sharding.strategies.replica_sliced_operands`).

**Sequence-parallel** (context parallelism, the all-gather method Llama 3 trained its long contexts with):
the queries, ``out`` and ``lse`` sharded on the sequence (``S(2)`` of ``[b, h, t, e]``), the keys and values
whole on every rank (the resharding before the op all-gathers them); in the backward ``dq`` sharded like the
queries and ``dk``, ``dv`` *partial*: each rank's queries' share of the sum over every query, reduced where
their consumer needs it (a reduce-scatter back to the sequence, or an all-reduce). Exact, as each query row's
softmax needs only its own scores. The causal mask is the catch: a rank's queries begin at an offset the
local op does not know, so a call whose causality is ``is_causal`` (the kernel masks by local row index) is
never sharded this way (:func:`sequence_parallel`). A call with its mask written out is: the mask's query
rows are sharded with the queries, so each rank reads its own rows through ordinary sharding and no rank is
special in the runtime. That is how transformers models call attention (they build the causal mask as a
tensor from positions, ``[b, 1, t, s]``), and since such a mask is made replicated (a chain of index ops on
positions), the planner may take its rows as a free local slice of that replica
(:func:`meshpilot.sharding.strategies.replica_sliced_operands`). The cost: the mask path's kernel instead of the
fused causal one, and the ``t × s`` mask held whole on each rank where it is built. A call with ``is_causal``
is sharded by query rows by meshpilot's own op (:mod:`meshpilot.ops.causal_rows`), which knows each rank's
first row and runs the device's kernel on the visible keys only.

**Ulysses** (context parallelism by all-to-all, DeepSpeed-Ulysses) needs no strategy of its own here: it is the
head-parallel strategy above between ops whose tokens are sharded on the sequence over the same axis. The
resharding of q, k, v from ``S(2)`` (or of the projections' ``[t, h]`` outputs from ``S(0)``) to heads, and of
``out`` back, is ``S(a) → S(b)`` on one axis: an all-to-all, which the planner prices with the cluster's cost
model like every resharding and counts in memory as DTensor runs it (``accounting.reshard_bytes``; on a CPU
mesh DTensor has no all-to-all and all-gathers the axis, then keeps its chunk:
``StagePlan.collective_counts(backend="gloo")`` counts that). Each rank holds full-sequence q, k, v for
``h / n`` heads, so the local kernel is the unsharded one, ``is_causal`` included. Heads must divide the
axis, key/value heads too: grouped-query attention called with ``enable_gqa`` (fewer key/value heads in the
op) is head-parallel only where its key/value heads divide; a model that repeats its key/value heads before the
call (transformers does when it passes a mask) exchanges the repeated copies, each rank receiving the copies its
query heads read, ``h / h_kv`` times the bytes of the unrepeated ones. Whether a plan's head-parallel
attention is Ulysses or tensor parallelism is read off the plan (:func:`context_axes`): all-to-alls on the
axis in the forward.

**Ring** (``ContextMethod.RING``): queries, keys and values all sequence-sharded, the key/value blocks passed
round the axis by the op itself: meshpilot's own strategies and kernels, :mod:`meshpilot.ops.ring`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------- the op pair


@torch.library.custom_op("meshpilot::sdpa", mutates_args=())
def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of scaled dot-product attention, no dropout; the kernel is the device's."""
    if not _grouped(q, k, v, attn_mask, is_causal, _scale(q, scale)):
        k, v = _expand_kv(q, k, v, enable_gqa)
    fn = _FORWARD.get(q.device.type, _math_forward)
    out, lse = fn(q, k, v, _float_mask(attn_mask, q), is_causal, _scale(q, scale))
    return _heads_inner(out), lse


def _heads_inner(out: Tensor) -> Tensor:
    """`out` [b, h, t, e] laid out as [b, t, h, e] in memory, as the flash kernels write it (every kernel's
    output gets that layout, so the strides the trace saw are the strides the run has)."""
    if out.transpose(1, 2).is_contiguous():
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@sdpa.register_fake
def _sdpa_fake(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    b, h, t, _ = q.shape
    out = q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2)  # [b, h, t, e_v], stored [b, t, h, e_v]
    return out, q.new_empty((b, h, t), dtype=torch.float32)  # lse [b, h, t]


@torch.library.custom_op("meshpilot::sdpa_backward", mutates_args=())
def sdpa_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :data:`sdpa`; the kernel is the device's."""
    grouped = _grouped(q, k, v, attn_mask, is_causal, _scale(q, scale))
    kx, vx = (k, v) if grouped else _expand_kv(q, k, v, enable_gqa)
    fn = _BACKWARD.get(q.device.type, _math_backward)
    dq, dk, dv = fn(grad_out.contiguous(), q, kx, vx, out, lse, _float_mask(attn_mask, q), is_causal, _scale(q, scale))
    if kx.shape[1] != k.shape[1]:  # grouped-query: sum the repeated heads' gradients back
        g = kx.shape[1] // k.shape[1]
        dk = dk.unflatten(1, (k.shape[1], g)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], g)).sum(2)
    return dq, dk, dv


@sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, enable_gqa):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, mask, is_causal, scale, enable_gqa = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.args = (is_causal, scale, enable_gqa)
    ctx.mask_grad = mask is not None and mask.requires_grad


def _autograd_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = sdpa_backward(grad_out, q, k, v, out, lse, mask, *ctx.args)
    return dq, dk, dv, None, None, None, None


sdpa.register_autograd(_autograd_backward, setup_context=_setup_context)


def captured_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """What ``F.scaled_dot_product_attention`` becomes while a model is captured: :data:`sdpa` where it is
    exact (no dropout, a mask that needs no gradient, 4-D operands), else the math composite."""
    plain = (
        dropout_p == 0.0
        and query.dim() == 4
        and key.dim() == 4
        and value.dim() == 4
        and (attn_mask is None or not attn_mask.requires_grad)
    )
    if plain:
        return sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa)[0]
    # the math op adds its mask: a boolean one (True = attend) must first become 0 / -inf, as the public
    # F.scaled_dot_product_attention converts it before it dispatches (added as 0 / 1 it masks nothing)
    out, _ = aten._scaled_dot_product_attention_math(
        query, key, value, _float_mask(attn_mask, query), dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return out


# ------------------------------------------------------------------------------------------- kernels


def _scale(q: Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _expand_kv(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """Key/value heads repeated to the query's (grouped-query attention)."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return k, v


def _grouped(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> bool:
    """Whether the device's kernel takes key/value with fewer heads than the query as they are — as eager
    attention passes them (``enable_gqa``) — rather than repeated here: the same kernel call as eager's, the
    groups' gradients summed in the kernel's accumulators, no repeated copies of key and value held."""
    if k.shape[1] == q.shape[1] or mask is not None:
        return False
    if q.device.type == "cpu":
        return int(aten._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=True)) == 1
    if q.device.type == "cuda":
        return _cuda_kernel(q, k, v, None, is_causal, scale) in _GQA_KERNELS
    return False


def _float_mask(mask: Tensor | None, q: Tensor) -> Tensor | None:
    """A boolean mask (True = attend) as the additive float mask the kernels take, as eager sdpa converts it."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=q.dtype, device=mask.device).masked_fill_(mask.logical_not(), -math.inf)


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> Tensor:
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale  # [b, h, t, s], fp32
    if is_causal:
        t, n = s.shape[-2:]
        keep = torch.ones(t, n, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(keep.logical_not(), -math.inf)
    if mask is not None:
        s = s + mask.float()
    return s


def _math_forward(q, k, v, mask, is_causal, scale) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, mask, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # [b, h, t]
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.float()).to(q.dtype), lse


def _math_backward(g, q, k, v, out, lse, mask, is_causal, scale) -> tuple[Tensor, Tensor, Tensor]:
    p = torch.exp(_scores(q, k, mask, is_causal, scale) - lse.unsqueeze(-1))  # [b, h, t, s]
    gf = g.float()
    dv = torch.matmul(p.transpose(-2, -1), gf)
    dp = torch.matmul(gf, v.float().transpose(-2, -1))
    ds = p * (dp - (gf * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.float()) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cpu_forward(q, k, v, mask, is_causal, scale):
    if v.shape[-1] != q.shape[-1]:  # values of another head size (MLA's): the CPU kernel refuses, eager uses math
        return _math_forward(q, k, v, mask, is_causal, scale)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    return out, lse


def _cpu_backward(g, q, k, v, out, lse, mask, is_causal, scale):
    if v.shape[-1] != q.shape[-1]:  # as the forward
        return _math_backward(g, q, k, v, out, lse, mask, is_causal, scale)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return dq, dk, dv


# torch.nn.attention.SDPBackend's values, as ``aten._fused_sdp_choice`` returns them, and our kernels' names
_TORCH_CHOICE = {1: "flash", 2: "efficient", 3: "cudnn"}


def _cuda_kernel(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> str:
    """``cudnn``, ``flash``, ``efficient`` or ``math``: the kernel eager ``F.scaled_dot_product_attention``
    runs for these operands (torch's own choice, ``aten._fused_sdp_choice``, which also follows a user's
    ``sdpa_kernel`` context), so a planned model computes what the eager one does, bit for bit on one device;
    the next eligible one if that kernel failed its check (:func:`_checked`)."""
    if mask is not None:
        return "math"
    gqa = k.shape[1] != q.shape[1]  # key/value heads not repeated: only kernels that take them so
    choice = _TORCH_CHOICE.get(int(aten._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale, enable_gqa=gqa)))
    e = q.shape[-1]
    flash_ok = q.dtype in (torch.float16, torch.bfloat16) and e % 8 == 0 and e <= 256
    for kernel in (choice, "flash" if flash_ok else None, "efficient"):
        if kernel is not None and (not gqa or kernel in _GQA_KERNELS) and _checked(kernel, q.dtype, gqa):
            return kernel
    return "math"


_GQA_KERNELS = ("flash", "cudnn")
"""CUDA kernels that take key/value with fewer heads than the query (grouped-query attention)."""


_CUDNN_LSE_DIMS: dict[torch.dtype, int] = {}
"""How many dims cuDNN's log-sum-exp has (its backward wants it back as its forward gave it)."""


def _kernel_forward(kernel: str, q, k, v, is_causal, scale, mask=None) -> tuple[Tensor, Tensor]:
    """`kernel`'s ``(out, lse [b, h, t])``; only ``math`` takes a `mask`."""
    t = q.shape[-2]
    if kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
        return out, lse
    if kernel == "efficient":
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal, scale=scale)[:2]
        return out, lse[..., :t].contiguous()  # the kernel pads lse to a multiple of 32 rows
    if kernel == "cudnn":
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False, scale=scale)[:2]
        _CUDNN_LSE_DIMS[q.dtype] = lse.dim()
        return out, lse.reshape(q.shape[:3])  # [b, h, t] (cuDNN's may carry a trailing 1)
    return _math_forward(q, k, v, mask, is_causal, scale)


def _kernel_backward(kernel: str, g, q, k, v, out, lse, is_causal, scale, mask=None) -> tuple[Tensor, Tensor, Tensor]:
    """`kernel`'s ``(dq, dk, dv)``; `lse` as :func:`_kernel_forward` returned it; only ``math`` takes a `mask`."""
    t, s = q.shape[-2], k.shape[-2]
    if kernel == "flash":
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)  # read only with dropout
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, None, None, t, s, 0.0, is_causal, seed, offset, scale=scale
        )
        return dq, dk, dv
    if kernel == "efficient":
        padded = F.pad(lse, (0, (-t) % 32))
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], is_causal, scale=scale
        )
        return dq, dk, dv
    if kernel == "cudnn":
        stats = lse.unsqueeze(-1) if _CUDNN_LSE_DIMS.get(q.dtype, 3) == 4 else lse
        # cuDNN's forward writes the output in the query's layout and its backward reads the output and its
        # gradient so: given them in another (the heads-inner copy :data:`sdpa` returns of a [b, h, t, e]-
        # contiguous query), its gradients are wrong, not rounded (2.6 relative on an H200, bf16)
        out, g = _in_layout_of(out, q), _in_layout_of(g, q)
        seed = torch.zeros(1, dtype=torch.int64, device=q.device)  # read only with dropout
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            g, q, k, v, out, stats, seed, seed, None, None, None, t, s, 0.0, is_causal, scale=scale
        )
        return dq, dk, dv
    return _math_backward(g, q, k, v, out, lse, mask, is_causal, scale)


def _in_layout_of(x: Tensor, ref: Tensor) -> Tensor:
    """`x` (of `ref`'s rank) dense with its dims in memory in `ref`'s order, outermost first (a copy where it is
    not so already)."""
    order = sorted(range(ref.dim()), key=lambda i: (-ref.stride(i), i))
    strides, step = [0] * x.dim(), 1
    for i in reversed(order):
        strides[i], step = step, step * x.shape[i]
    if list(x.stride()) == strides:
        return x
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return x.permute(order).contiguous().permute(inverse)


def _cuda_forward(q, k, v, mask, is_causal, scale):
    return _kernel_forward(_cuda_kernel(q, k, v, mask, is_causal, scale), q, k, v, is_causal, scale, mask)


def _cuda_backward(g, q, k, v, out, lse, mask, is_causal, scale):
    kernel = _cuda_kernel(q, k, v, mask, is_causal, scale)
    return _kernel_backward(kernel, g, q, k, v, out, lse, is_causal, scale, mask)


_FORWARD = {"cpu": _cpu_forward, "cuda": _cuda_forward}
_BACKWARD = {"cpu": _cpu_backward, "cuda": _cuda_backward}

_CHECKS: dict[tuple[str, torch.dtype, bool], bool] = {}


def _checked(kernel: str, dtype: torch.dtype, gqa: bool = False) -> bool:
    """Whether CUDA `kernel` agrees with the math path on a small causal problem in `dtype` (forward and
    backward); checked once per process, and a kernel that raises or disagrees is not used (with a warning)."""
    key = (kernel, dtype, gqa)
    if key in _CHECKS:
        return _CHECKS[key]
    ok, why = False, ""
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        # [b, h, t, e] views of [b, t, h, e] storage, as a model's heads are split, and a contiguous gradient
        q, k, v, g = (torch.randn(2, 40, 2, 64, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
        q, k, v, g = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2).contiguous()
        if gqa:  # one key/value head for the two query heads
            k, v = k[:, :1], v[:, :1]
        scale = 0.125
        out, lse = _kernel_forward(kernel, q, k, v, True, scale)
        got = (out, *_kernel_backward(kernel, g, q, k, v, out, lse, True, scale))
        kx, vx = _expand_kv(q, k, v, True)
        ref_out, ref_lse = _math_forward(q, kx, vx, None, True, scale)
        dq, dk, dv = _math_backward(g, q, kx, vx, ref_out, ref_lse, None, True, scale)
        want = (ref_out, dq, dk.sum(1, keepdim=True) if gqa else dk, dv.sum(1, keepdim=True) if gqa else dv)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        err = max(_relative_error(x, y) for x, y in zip(got, want))
        ok = err <= tol
        why = f"relative error {err:.2e} > {tol:g}"
    except Exception as e:  # noqa: BLE001 - any failure means: do not use this kernel
        why = f"{type(e).__name__}: {e}"
    if not ok:
        what = f"{dtype}, grouped-query" if gqa else str(dtype)
        note = f"meshpilot: CUDA {kernel} attention ({what}) not used: {why}; the math path runs instead"
        warnings.warn(note, stacklevel=2)
    _CHECKS[key] = ok
    return ok


def _relative_error(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / (want.float().abs().max() + 1e-6))


# ------------------------------------------------------------------------------------------- FLOPs


def attention_flops(q_shape, k_shape, v_shape, backward: bool) -> float:
    """Two matmuls forward (QKᵀ and PV), five backward (recomputed scores, dV, dP, dQ, dK)."""
    b, h, t, e = q_shape
    s, ev = k_shape[-2], v_shape[-1]
    per = b * h * t * s * (e + ev)  # multiply-adds of QKᵀ and PV together
    return float(2 * per * (2.5 if backward else 1.0))


_IS_CAUSAL_ARG = {"meshpilot.sdpa.default": 4, "meshpilot.sdpa_backward.default": 7}
"""Position of ``is_causal`` among each op's arguments (the mask's is the one before it)."""


def attention_kind(node: Any) -> tuple[bool, bool] | None:
    """``(causal, backward)`` of an attention node (``meshpilot::sdpa`` or its backward), None for any other
    node. Causal: ``is_causal`` with no mask tensor, the call a fused kernel runs skipping the hidden pairs
    (read off the node's FX node; a node read from a file has none and counts as non-causal: every pair)."""
    target = str(node.target)
    at = _IS_CAUSAL_ARG.get(target)
    if at is None:
        return None
    args = node.fx_node.args if node.fx_node is not None else ()
    causal = len(args) > at and bool(args[at]) and args[at - 1] is None
    return causal, target == "meshpilot.sdpa_backward.default"


# ------------------------------------------------------------------------------------------- sharding


def _mask_rule(mask_meta, dim_from_end: int):
    """The mask's placement when the other operands are sharded on batch (4), heads (3) or query rows (2) dims
    from the end: sharded where the mask has that dim with more than one entry, else replicated."""
    from torch.distributed.tensor import Replicate, Shard

    nd = len(mask_meta.shape)
    d = nd - dim_from_end
    if d >= 0 and mask_meta.shape[d] > 1:
        return Shard(d)
    return Replicate()


MASK_OPERAND = {"meshpilot.sdpa.default": 3, "meshpilot.sdpa_backward.default": 6}
"""Position of the mask among each op's tensor operands (when it has one: it is the last)."""


def sequence_parallel(is_causal: bool) -> bool:
    """Whether DTensor may shard a call on its query rows (the sequence-parallel strategy): not when it is
    ``is_causal``, whose mask the kernel builds from the local query index (each rank's chunk would be masked
    as if it began at position 0; :mod:`meshpilot.ops.causal_rows` shards those calls, knowing the offset);
    causal calls with the mask written out (as transformers models build it) are sharded exactly, the mask's
    rows with the queries'."""
    return not is_causal


def register_strategies() -> None:
    """Replicated, batch-parallel, head-parallel and sequence-parallel strategies of both ops, in DTensor's
    propagator."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from meshpilot import compat

    osm = compat.op_schema()
    expand = compat.expand_to_full_mesh_op_strategy()
    prop = compat.sharding_propagator()

    def tensor_args(op_schema) -> list:
        return [a for a in op_schema.args_schema if isinstance(a, osm.OpStrategy)]

    def mask_of(op_schema, mask_index: int, from_end: int) -> list:
        args = tensor_args(op_schema)
        if op_schema.args_schema[mask_index] is None:
            return []
        return [_mask_rule(args[-1].strategies[0].output_spec.tensor_meta, from_end)]

    def rows(op_schema, n_out: int, mask_index: int):
        n = n_out + len(tensor_args(op_schema))
        out = [[Replicate()] * n]
        for dim, from_end in ((0, 4), (1, 3)):
            mask = mask_of(op_schema, mask_index, from_end)  # the last operand's placement, where there is a mask
            out.append([Shard(dim)] * (n - len(mask)) + mask)
        return out

    def forward(op_schema):
        mesh = op_schema.get_mesh_from_args()
        table = rows(op_schema, 2, 3)
        if sequence_parallel(op_schema.args_schema[4]):
            # out, lse, q by query rows; k, v whole (all-gathered by the propagator's resharding)
            table.append([Shard(2), Shard(2), Shard(2), Replicate(), Replicate(), *mask_of(op_schema, 3, 2)])
        return expand(mesh, op_schema, table, input_index=2)

    def backward(op_schema):
        mesh = op_schema.get_mesh_from_args()
        table = rows(op_schema, 3, 6)
        if sequence_parallel(op_schema.args_schema[7]):
            # dq by rows; dk, dv each rank's rows' share of the sum over every query: partial
            s, r = Shard(2), Replicate()
            table.append([s, Partial(), Partial(), s, s, r, r, s, s, *mask_of(op_schema, 6, 2)])
        return expand(mesh, op_schema, table, input_index=3)

    prop.register_op_strategy(torch.ops.meshpilot.sdpa.default, forward, osm.RuntimeSchemaInfo(4))
    prop.register_op_strategy(torch.ops.meshpilot.sdpa_backward.default, backward, osm.RuntimeSchemaInfo(7))


# ------------------------------------------------------------------------------------------- in a plan

SDPA_TARGETS = ("meshpilot.sdpa.default", "meshpilot.sdpa_backward.default")
"""The op pair's targets as a captured graph records them (``OpNode.target``)."""


def _attention_calls(nodes) -> list:
    """The attention forwards among a plan's nodes, recomputed copies (``*_recomputed``) left out."""
    from meshpilot.planner.recompute import is_copy

    return [n for n in nodes if n.target == SDPA_TARGETS[0] and n.ins and not is_copy(n.name)]


class ContextMethod(StrEnum):
    """How a plan's attention divides the sequence over a mesh axis (context parallelism)."""

    ALL_GATHER = "all-gather"
    """Queries sharded by sequence (``S(2)``), keys and values all-gathered (Llama 3's method)."""
    ULYSSES = "ulysses"
    """Heads sharded inside attention (``S(1)``), the sequence outside, all-to-all between (DeepSpeed-Ulysses)."""
    RING = "ring"
    """Queries, keys and values all sharded by sequence, key/value blocks passed round the axis (ring attention,
    :mod:`meshpilot.ops.ring`)."""


_METHOD_TEXT = {
    ContextMethod.ALL_GATHER: (
        "attention sequence-parallel",
        "each device's query rows against every key, keys and values all-gathered, their gradients partial sums "
        "until the resharding reduces them",
    ),
    ContextMethod.ULYSSES: (
        "attention head-parallel inside a sequence-sharded layer (Ulysses)",
        "all-to-alls turn sequence shards into head shards before attention and back after it",
    ),
    ContextMethod.RING: (
        "ring attention",
        "queries, keys and values sequence-sharded, each key/value block sent round the axis in n - 1 steps, "
        "its gradients summed on the way back to their owner",
    ),
}


@dataclass(frozen=True)
class ContextAxis:
    """One mesh axis a plan's attention divides the sequence over, by one method."""

    axis: str
    """The mesh axis's name."""
    method: ContextMethod
    calls: int
    """How many attention forwards do so."""


def context_axes(nodes, mesh_axes: tuple[str, ...], collectives=()) -> list[ContextAxis]:
    """The plan's context parallelism: for each mesh axis and method, how many attention forwards of `nodes`
    (a plan's ``NodeChoice`` list) use it.

    * :attr:`ContextMethod.ALL_GATHER` on axis ``a``: the queries read ``S(2)`` (their sequence) on ``a``;
    * :attr:`ContextMethod.RING` on axis ``a``: the queries and the keys read ``S(2)`` on ``a``;
    * :attr:`ContextMethod.ULYSSES` on axis ``a``: the queries read ``S(1)`` (their heads) on ``a`` while the
      forward issues all-to-alls on ``a`` (`collectives`: the plan's ``PlannedCollective`` list) — the layout
      changes between the sequence-sharded ops around attention and its head shards. Head-parallel attention
      on an axis with no all-to-all is tensor parallelism (the projections' weights sharded), not counted."""
    from meshpilot.sharding.reshard import CollectiveKind

    exchanged = {
        c.axis for c in collectives if c.phase == "fwd" and c.kind == CollectiveKind.ALL_TO_ALL and not c.issued_by_op
    }
    out: dict[tuple[str, ContextMethod], int] = {}
    for n in _attention_calls(nodes):
        for axis, p in enumerate(n.ins[0]):
            if p == "S(2)":
                method = ContextMethod.RING if n.ins[1][axis] == "S(2)" else ContextMethod.ALL_GATHER
            elif p == "S(1)" and axis in exchanged:
                method = ContextMethod.ULYSSES
            else:
                continue
            key = (mesh_axes[axis], method)
            out[key] = out.get(key, 0) + 1
    return [ContextAxis(a, m, k) for (a, m), k in out.items()]


def ulysses_pins(graph, operands: int = 3) -> dict[str, str]:
    """A ``force`` dict (``meshpilot.planner.force``) for Ulysses on mesh axis 0 of a 2-axis mesh: the example
    inputs sharded on their sequence (``S(1)``), the producers of the first `operands` of each attention's q, k,
    v (a captured `graph`'s ``OpGraph``) on theirs (``S(2)`` of ``[b, h, t, e]``), every attention node on its
    heads (``S(1)``): each of those operands then reaches attention by one all-to-all. (At batch > 1 a model's
    key/value view may take no sequence shard: pin q alone, ``operands=1``.)"""
    pins = {"input:*": "S(1)R", "sdpa*": "S(1)R"}
    for n in graph.nodes:
        if n.target == SDPA_TARGETS[0]:
            pins.update({src: "S(2)R" for src, _ in n.inputs[:operands]})
    return pins


def ring_pins(graph, backward: bool = False) -> dict[str, str]:
    """A ``force`` dict for ring attention on mesh axis 0 of a 2-axis mesh: the example inputs sharded on their
    sequence (``S(1)``), the producers of each attention's q, k and v (a captured `graph`'s ``OpGraph``) on
    theirs (``S(2)`` of ``[b, h, t, e]``). Attention's own layout is left to the planner: with its keys and
    values arriving sequence-sharded the ring moves ``(n − 1) / n`` of each block as the all-gather does, and
    keeps no gathered copy. `backward`: each backward's dK and dV pinned ``S(2)`` too, so the backward is a
    ring as well (an ``is_causal`` backward is otherwise free to gather the keys by query rows, which a zig-zag
    plan serves too: ``planner.sequence_order``)."""
    pins = {"input:*": "S(1)R"}
    for n in graph.nodes:
        if n.target == SDPA_TARGETS[0]:
            pins.update({src: "S(2)R" for src, _ in n.inputs[:3]})
        elif backward and n.kind == "getitem" and graph[n.inputs[0][0]].target == SDPA_TARGETS[1]:
            pins.update({n.name: "S(2)R"} if n.fx_node.args[1] in (1, 2) else {})  # dK, dV
    return pins


def context_line(nodes, mesh_axes: tuple[str, ...], mesh_shape: tuple[int, ...], collectives=()) -> str | None:
    """The plan printout's line on context parallelism (None where attention divides no sequence)."""
    found = context_axes(nodes, mesh_axes, collectives)
    if not found:
        return None
    total = len(_attention_calls(nodes))
    parts = []
    for method in ContextMethod:
        axes = [c for c in found if c.method == method]
        if not axes:
            continue
        what, how = _METHOD_TEXT[method]
        where = ", ".join(
            f"axis {c.axis} ({mesh_shape[mesh_axes.index(c.axis)]} devices, {c.calls} of {total} attention calls)"
            for c in axes
        )
        parts.append(f"{what} over {where}: {how}")
    return "; ".join(parts)
