"""Batch-parallel GroupNorm backward, registered into DTensor's propagator (DTensor has the forward only).

Every sample is normalised on its own, so ``grad_out``, ``input``, ``mean`` and ``rstd`` sharded on the batch
give ``grad_input`` sharded the same way and partial sums of ``grad_weight`` / ``grad_bias``; the scalar
``N`` / ``C`` / ``HxW`` arguments become local sizes the way DTensor adjusts its forward
(``_adjust_group_norm_scalars``). On a torch without that adjuster or without single-dim strategies the op
keeps no strategy: the planner replicates it and the plan's warnings say which symbol was missing
(:mod:`meshpilot.compat`).
"""

from __future__ import annotations

import torch

from meshpilot import compat

OP = torch.ops.aten.native_group_norm_backward.default


def register_backward_strategy() -> bool:
    """Register the strategy (idempotent); False when this torch lacks what it needs."""
    from torch.distributed.tensor import Partial, Replicate

    note = "GroupNorm's backward is replicated (no batch-parallel strategy)"
    adjust = compat.lookup(compat.GROUP_NORM_SCALARS, note)
    register = compat.lookup(compat.REGISTER_SINGLE_DIM, note)
    placeholder = compat.lookup(compat.SHARDING_PLACEHOLDER, note)
    if adjust is None or register is None or placeholder is None:
        return False
    _, tensor_meta = compat.dtensor_spec()
    osm = compat.op_schema()
    prop = compat.sharding_propagator()
    singles, _ = compat.single_dim_registry()
    if OP in singles or OP in prop.op_strategy_funcs:
        return True

    def strategy(op, args_schema, kwargs_schema):
        # native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C, HxW, group, output_mask)
        mask = args_schema[9]
        has_weight = isinstance(args_schema[4], tensor_meta)
        outs = [
            placeholder(0) if mask[0] else None,
            Partial("sum") if mask[1] else None,
            Partial("sum") if mask[2] else None,
        ]
        ins = [placeholder(0)] * 4 + ([Replicate()] if has_weight else [])
        return [outs + ins]

    register(OP, schema_info=osm.RuntimeSchemaInfo(5))(strategy)
    prop.op_to_scalar_shape_adjuster[OP] = adjust
    return True


def missing_reason() -> str | None:
    """Why the backward has no strategy on this torch (None when it has one)."""
    for path in (compat.GROUP_NORM_SCALARS, compat.REGISTER_SINGLE_DIM, compat.SHARDING_PLACEHOLDER):
        note = compat.missing_note(path)
        if note is not None:
            return note
    return None
