"""The captured backward runs the kernels eager autograd runs (``compat.kernel_backwards``).

SiLU's derivative is the fused ``silu_backward`` in eager training but a composite formula when traced through
functional wrapper tensors; the capture puts the kernel back, so a SwiGLU MLP's gradients from the captured joint
graph are bitwise eager's, in float32 and bfloat16. (Before: a Llama's gate-projection gradient 4e-7 apart in
float32 and its bf16 gradients 8e-3 apart at the first step, where eager against eager is 0.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpilot import compat

aten = torch.ops.aten


def _swiglu_loss(w_gate, w_up, w_down, x, extra_sigmoid: bool = False):
    g = x @ w_gate
    h = F.silu(g) * (x @ w_up)
    if extra_sigmoid:  # a sigmoid of the same value the forward keeps: not the derivative's, left alone
        h = h + torch.sigmoid(g)
    return ((h @ w_down) ** 2).mean()


def _weights(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(32, 96, generator=gen), torch.randn(32, 96, generator=gen), torch.randn(96, 32, generator=gen)]
    x = torch.randn(16, 32, generator=gen)
    return [w.to(dtype).requires_grad_() for w in ws], x.to(dtype)


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("extra_sigmoid", [False, True], ids=["swiglu", "swiglu+sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_backward_is_the_eager_kernel_and_gradients_are_bitwise_eager(dtype, extra_sigmoid):
    ws, x = _weights(dtype)
    joint = compat.joint_export(lambda *a: (_swiglu_loss(*a, extra_sigmoid=extra_sigmoid),), [*ws, x], 3)
    ops = _targets(joint.gm)
    assert ops.count(aten.silu_backward.default) == 1
    assert ops.count(aten.sigmoid.default) == (1 if extra_sigmoid else 0)  # the forward's own sigmoid stays
    loss, *grads = joint.gm(*[w.detach() for w in ws], x)
    eager = _swiglu_loss(*ws, x, extra_sigmoid=extra_sigmoid)
    eager.backward()
    assert torch.equal(loss, eager.detach())
    assert len(grads) == 3
    for g, w in zip(grads, ws):
        assert torch.equal(g, w.grad), float((g - w.grad).abs().max())


def test_a_forward_sigmoid_of_the_same_value_keeps_its_own_backward():
    ws, x = _weights(torch.float32)

    def loss(w_gate, w_up, w_down, x):  # σ(g) of the silu's input in the forward product: its own derivative
        g = x @ w_gate
        return ((F.silu(g) * torch.sigmoid(g) * (x @ w_up)) @ w_down).sum()

    joint = compat.joint_export(lambda *a: (loss(*a),), [*ws, x], 3)
    ops = _targets(joint.gm)
    assert (ops.count(aten.sigmoid.default), ops.count(aten.sigmoid_backward.default)) == (1, 1)
    assert ops.count(aten.silu_backward.default) == 1
    out, *grads = joint.gm(*[w.detach() for w in ws], x)
    ref = loss(*ws, x)
    ref.backward()
    assert torch.equal(out, ref.detach())
    for g, w in zip(grads, ws):
        assert torch.equal(g, w.grad)
