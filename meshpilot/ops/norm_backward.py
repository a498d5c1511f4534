"""LayerNorm's and RMSNorm's backward: the batch-parallel rule, registered where torch's own is not exact.

``native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, weight, bias, mask)`` computes, for
every row ``r`` of the outer dims (those before ``normalized_shape``), with ``x̂[r] = (input[r] - mean[r]) ·
rstd[r]``::

    d_input[r] = rstd[r] · (g[r] - mean_j(g[r]) - x̂[r] · mean_j(g[r] · x̂[r])),   g[r] = grad_out[r] · weight
    d_weight   = Σ_r grad_out[r] · x̂[r]        d_bias = Σ_r grad_out[r]

(``_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight, mask)`` the same without ``mean``
and ``bias``). Each row needs its own statistics and the *whole* weight, so the one exact sharding is: on an
outer dim ``d``, ``grad_out``, ``input``, ``mean`` and ``rstd`` sharded on ``d`` alike (the statistics have the
outer dims too), ``weight`` and ``bias`` replicated; ``d_input`` is then sharded on ``d`` and ``d_weight`` /
``d_bias`` are partial sums. That is the single-dim rule torch 2.13 registers.

torch 2.11 registers instead an op strategy (``_common_norm_backward_strategy``) that takes ``mean``, ``rstd``,
``weight`` and ``bias`` in whatever layout they arrive ("they should be replicated in forward pass"), at no
redistribution cost. DTensor's eager use feeds it the forward's layouts, but the planner offers every layout a
producer can emit (``sharding.strategies``): it priced a ZeRO-3 weight shard read as-is (no all-gather — 18
fewer collectives for a 4-block GPT) and statistics in another layout than the input's, plans whose run hands
the kernel a 1/N weight (``Expected weight to be of same shape as normalized_shape``) or, where the local
shapes happen to agree, pairs rows with other rows' statistics. :func:`register` puts the exact rule in
DTensor's propagator where torch has no single-dim strategy for these ops; a single-dim strategy takes
precedence over an op strategy both in DTensor's dispatch and in ``sharding.strategies``, so the planner and
the runtime see the one rule on every supported torch.
"""

from __future__ import annotations

import torch

from meshpilot import compat

aten = torch.ops.aten
LAYER_NORM = aten.native_layer_norm_backward.default
RMS_NORM = aten._fused_rms_norm_backward.default


def register() -> list[str]:
    """Register the rule for each norm backward that has no single-dim strategy in this torch (idempotent);
    returns the ops it registered for (none on torch 2.13, which has the same rule)."""
    from torch.distributed.tensor import Partial, Replicate

    note = "LayerNorm / RMSNorm backward keep torch's op strategy (its weight and statistics as they arrive)"
    register_single = compat.lookup(compat.REGISTER_SINGLE_DIM, note)
    placeholder = compat.lookup(compat.SHARDING_PLACEHOLDER, note)
    if register_single is None or placeholder is None:
        return []
    osm = compat.op_schema()
    singles, _ = compat.single_dim_registry()

    def rule(args_schema, n_stats: int, affine: list) -> list[list]:
        """One rule per outer dim: [d_input, d_weight, (d_bias), grad_out, input, *stats, *affine present]."""
        shape, normalized = args_schema[1].shape, args_schema[2]
        n_norm = 1 if isinstance(normalized, int) else len(normalized)
        present = [a is not None for a in affine]
        rules = []
        for dim in range(len(shape) - n_norm):
            outs = [placeholder(dim)] + [Partial("sum") if p else None for p in present]
            ins = [placeholder(dim)] * (2 + n_stats) + [Replicate() for p in present if p]
            rules.append(outs + ins)
        return rules

    def layer_norm(op, args_schema, kwargs_schema):
        # (grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask)
        return rule(args_schema, 2, [args_schema[5], args_schema[6]])

    def rms_norm(op, args_schema, kwargs_schema):
        # (grad_out, input, normalized_shape, rstd, weight?, output_mask)
        return rule(args_schema, 1, [args_schema[4]])

    done = []
    for op, fn in ((LAYER_NORM, layer_norm), (RMS_NORM, rms_norm)):
        if op not in singles:
            register_single(op, schema_info=osm.RuntimeSchemaInfo(2))(fn)
            done.append(str(op))
    if done:  # a propagation cached before with torch's own strategy would stand
        compat.sharding_propagator().propagate_op_sharding.cache_clear()
    return done
