"""Elementwise ATen ops that DTensor's propagator leaves without a strategy, given its pointwise one.

DTensor registers its pointwise strategy (every operand and the output in one layout, shards on any dim,
partial sums through linear ops only) for ops tagged ``torch.Tag.pointwise`` and a short list of extras.
Some activation backwards compute ``grad_input[i] = f(grad_output[i], x[i])`` elementwise but carry no tag
(``softplus_backward``: xIELU, Apertus' activation; ``log_sigmoid``'s pair; ``hardswish_backward``), nor do
``masked_fill`` with a 0-d tensor value (CPM-Ant) and ``floor_divide`` (Llama-4's chunked-attention mask),
so a captured graph that used them fell back to full replicas. Each op listed here reads and writes one element
per position of operands of one (broadcast) shape, which is what the pointwise strategy assumes; it is exact
under any sharding of that shape.
"""

from __future__ import annotations

import torch

from meshpilot import compat

aten = torch.ops.aten

REGISTER_POINTWISE = "torch.distributed.tensor._ops._pointwise_ops._register_single_dim_pointwise"
# elementwise ops without the pointwise tag: backwards (grad_output, self, *scalars), and masked_fill with a
# 0-d tensor value (CPM-Ant's attention mask; its Scalar overload is tagged), the 0-d operand broadcast
OPS = (
    aten.softplus_backward.default,
    aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
    aten.elu_backward.default,
    aten.mish_backward.default,
    aten.masked_fill.Tensor,
    aten.polar.default,  # complex rotary tables (DeepSeek-V2): polar(abs, angle) element by element
    aten.floor_divide.default,  # chunked attention's block index (Llama-4's masks: position // chunk)
    aten.floor_divide.Scalar,
    aten.log_sigmoid_forward.default,  # (output, buffer), both of the input's shape on CPU (Inkling's router)
    aten.log_sigmoid_backward.default,  # (grad_output, self, buffer)
    aten.hardswish_backward.default,
    aten.hardsigmoid_backward.default,
    aten.leaky_relu_backward.default,
    aten.hardtanh_backward.default,
)


def register_strategies() -> bool:
    """Give every op of :data:`OPS` DTensor's pointwise strategy where it has none (idempotent); False when
    this torch lacks the registration function (the ops then stay replicated, as before)."""
    register = compat.lookup(REGISTER_POINTWISE, "untagged elementwise backwards are replicated")
    if register is None:
        return False
    singles, _ = compat.single_dim_registry()
    prop = compat.sharding_propagator()
    for op in OPS:
        if op not in singles and op not in prop.op_strategy_funcs:
            register(op)
    return True
