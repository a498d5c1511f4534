"""Channel-parallel convolution (Alpa's sharding of a Wide-ResNet's convolutions), added to DTensor's propagator.

DTensor shards a convolution on the batch only (its single-dim rule: input and output ``Shard(0)``, the weight
replicated), so a conv net's weights stay whole on every device of a mesh and a large one (Wide-ResNet 6.8B
and up, Alpa's Table 8) fits nowhere. Two more rules per mesh axis, for plain convolutions (not transposed,
``groups == 1``), with weight ``[C_out, C_in, kh, kw]``:

* **output channels**: input replicated, weight ``Shard(0)``, bias ``Shard(0)`` → output ``Shard(1)``;
  backward: ``grad_output`` ``Shard(1)``, input replicated, weight ``Shard(0)`` → ``grad_input`` partial sums,
  ``grad_weight`` / ``grad_bias`` ``Shard(0)``;
* **input channels** (no bias: a replicated bias would be added once per device to the partial sums): input
  ``Shard(1)``, weight ``Shard(1)`` → output partial sums; backward: ``grad_output`` replicated, input and
  weight ``Shard(1)`` → ``grad_input`` and ``grad_weight`` ``Shard(1)``, ``grad_bias`` replicated.

Each is exact on the local shards: a device convolves its slice of the channels (output channels: its filters
over the whole input; input channels: every filter over its slice of the input, the sum over slices being the
convolution). meshpilot's runtime runs convolutions on the local shards anyway (``runtime.interpret``'s
``local`` mode, whatever the layouts), so the rules only tell the planner what may be chosen; they are
appended to DTensor's own batch rule, which stays. ``convolution_backward`` keeps its global ``bias_sizes``
argument on the local call: the CPU and CUDA kernels size ``grad_bias`` from ``grad_output``.
"""

from __future__ import annotations

import torch

from meshpilot import compat

FORWARD = torch.ops.aten.convolution.default
BACKWARD = torch.ops.aten.convolution_backward.default
_MARK = "_meshpilot_channel_rules"


def _with_channel_rules(base, transposed_at: int, bias_at: int, channel_rules):
    """DTensor's single-dim strategy `base` with ``channel_rules(has_bias)`` appended for plain convolutions:
    ``args_schema[transposed_at]`` is the op's ``transposed`` flag and the slot two after it its ``groups``
    (both ops' schemas); ``args_schema[bias_at]`` its bias (the forward) or ``bias_sizes`` (the backward)."""

    def strategy(op, args_schema, kwargs_schema):
        rules = list(base(op, args_schema, kwargs_schema))
        if args_schema[transposed_at] or args_schema[transposed_at + 2] != 1:
            return rules
        return rules + channel_rules(args_schema[bias_at] is not None)

    setattr(strategy, _MARK, True)
    return strategy


def register_channel_strategies() -> bool:
    """Append the two channel rules to DTensor's single-dim convolution strategies (idempotent); False when
    this torch has no single-dim strategy for the convolution to extend."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    singles, _ = compat.single_dim_registry()
    fwd, bwd = singles.get(FORWARD), singles.get(BACKWARD)
    if fwd is None or bwd is None:
        return False
    if getattr(fwd, _MARK, False):
        return True

    def forward(has_bias: bool) -> list:
        # convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
        # rules: [output, input, weight, (bias)]; input channels only without a bias
        out_channels = [Shard(1), Replicate(), Shard(0)] + ([Shard(0)] if has_bias else [])
        return [out_channels] if has_bias else [out_channels, [Partial("sum"), Shard(1), Shard(1)]]

    def backward(has_bias: bool) -> list:
        # convolution_backward(grad_output, input, weight, bias_sizes?, stride, padding, dilation, transposed,
        #                      output_padding, groups, output_mask)
        # rules: [grad_input, grad_weight, grad_bias, grad_output, input, weight]
        return [
            [Partial("sum"), Shard(0), Shard(0) if has_bias else None, Shard(1), Replicate(), Shard(0)],
            [Shard(1), Shard(1), Replicate() if has_bias else None, Replicate(), Shard(1), Shard(1)],
        ]

    singles[FORWARD] = _with_channel_rules(fwd, 6, 2, forward)
    singles[BACKWARD] = _with_channel_rules(bwd, 7, 3, backward)
    return True
