"""``meshpilot::sdpa`` on CPU with values of another head size than the queries and keys (multi-head latent
attention: AXK1, DeepSeek's MLA), which torch's CPU flash kernel refuses: the op takes the math path, as eager
attention does, and equals ``F.scaled_dot_product_attention`` (output and every gradient)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOL = 1e-5


def test_values_of_another_head_size_equal_eager_attention():
    from meshpilot.ops.attention import sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, e, generator=g, requires_grad=True) for e in (16, 16, 8))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    out, _ = sdpa(q, k, v, None, True, None, False)
    assert out.shape == want.shape and (out - want).abs().max().item() <= TOL
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for got, ref in zip(grads, want_grads):
        assert (got - ref).abs().max().item() <= TOL
