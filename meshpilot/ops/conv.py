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

from typing import Any

import torch

from meshpilot import compat

FORWARD = torch.ops.aten.convolution.default
BACKWARD = torch.ops.aten.convolution_backward.default
_MARK = "_meshpilot_channel_rules"


def _plain(transposed: Any, groups: Any) -> bool:
    return not transposed and groups == 1


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

    def forward(op, args_schema, kwargs_schema):
        # convolution(input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
        rules = list(fwd(op, args_schema, kwargs_schema))
        if not _plain(args_schema[6], args_schema[8]):
            return rules
        has_bias = args_schema[2] is not None
        # [output, input, weight, (bias)]
        rules.append([Shard(1), Replicate(), Shard(0)] + ([Shard(0)] if has_bias else []))
        if not has_bias:
            rules.append([Partial("sum"), Shard(1), Shard(1)])
        return rules

    def backward(op, args_schema, kwargs_schema):
        # convolution_backward(grad_output, input, weight, bias_sizes?, stride, padding, dilation, transposed,
        #                      output_padding, groups, output_mask)
        rules = list(bwd(op, args_schema, kwargs_schema))
        if not _plain(args_schema[7], args_schema[9]):
            return rules
        has_bias = args_schema[3] is not None
        # [grad_input, grad_weight, grad_bias, grad_output, input, weight]
        rules.append([Partial("sum"), Shard(0), Shard(0) if has_bias else None, Shard(1), Replicate(), Shard(0)])
        rules.append([Shard(1), Shard(1), Replicate() if has_bias else None, Replicate(), Shard(1), Shard(1)])
        return rules

    for f in (forward, backward):
        setattr(f, _MARK, True)
    singles[FORWARD], singles[BACKWARD] = forward, backward
    return True
