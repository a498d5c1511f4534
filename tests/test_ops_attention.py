"""``meshpilot::sdpa`` on CPU with values of another head size than the queries and keys (multi-head latent
attention: AXK1, DeepSeek's MLA), which torch's CPU flash kernel refuses: the op takes the math path, as eager
attention does, and equals ``F.scaled_dot_product_attention`` (output and every gradient); and the layout its
CUDA backward gives cuDNN."""

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


def test_cudnn_backward_operands_are_put_in_the_querys_layout():
    """cuDNN's backward reads the output and its gradient in the layout its forward wrote the output in, the
    query's; given another (the heads-inner copy ``sdpa`` returns of a [b, h, t, e]-contiguous query) an H200
    returned gradients 2.6 relative off. ``_in_layout_of`` gives a tensor the query's dim order, copying only
    where it differs, and keeps its values."""
    from meshpilot.ops.attention import _heads_inner, _in_layout_of

    q = torch.randn(2, 3, 5, 4)  # [b, h, t, e] contiguous
    inner = _heads_inner(torch.randn(2, 3, 5, 4))  # stored [b, t, h, e]
    assert inner.stride() == (60, 4, 12, 1)
    put = _in_layout_of(inner, q)
    assert put.stride() == q.stride() and torch.equal(put, inner)
    assert _in_layout_of(q, q) is q
    back = _in_layout_of(q, inner)
    assert back.stride() == inner.stride() and torch.equal(back, q)
    wider = torch.randn(2, 3, 5, 8)  # a value head size other than the query's: the same dim order
    assert _in_layout_of(wider, inner).stride() == (120, 8, 24, 1)
