"""Ring attention's two custom ops, ``meshpilot::ring_sdpa`` and ``meshpilot::ring_sdpa_backward``
(:mod:`meshpilot.ops.ring`): defined only when a step runs a ring (``ring._run_forward``, ``ring._run_backward``
import this module), not when planning imports the op registry.

Defining a custom op is not free: torch reads each function's source (``inspect.getsourcelines`` scans every
loaded module), 0.03–0.05 CPU s for these two after planning's imports — paid by every ``plan()`` of a model
with no ring, since the registry imports :mod:`meshpilot.ops.ring` for its strategies (``docs/benchmarks.md``,
issue 33 item 4). A recorded step calls the op through ``ring._run_forward`` first, so the op exists before any
replay of the recorded program looks it up.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshpilot.ops.ring import _ring_backward, _ring_forward


@torch.library.custom_op("meshpilot::ring_sdpa", mutates_args=())
def ring_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
    ring: str,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of this rank's query rows, the key/value blocks passed round the ring `ring`
    (:class:`_Ring` as text)."""
    from meshpilot.cluster.memtrack import measured_inside

    return measured_inside("ring_sdpa", _ring_forward, q, k, v, attn_mask, is_causal, scale, enable_gqa, ring)


@ring_sdpa.register_fake
def _ring_sdpa_fake(q, k, v, attn_mask, is_causal, scale, enable_gqa, ring):
    b, h, t, _ = q.shape
    return q.new_empty((b, t, h, v.shape[-1])).transpose(1, 2), q.new_empty((b, h, t), dtype=torch.float32)


@torch.library.custom_op("meshpilot::ring_sdpa_backward", mutates_args=())
def ring_sdpa_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
    ring: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of this rank's rows: dq local, dk and dv summed round the ring to their owner."""
    from meshpilot.cluster.memtrack import measured_inside

    args = (grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, enable_gqa, ring)
    return measured_inside("ring_sdpa_backward", _ring_backward, *args)


@ring_sdpa_backward.register_fake
def _ring_sdpa_backward_fake(grad_out, q, k, v, out, lse, attn_mask, is_causal, scale, enable_gqa, ring):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
