"""Plan validation (placeholder until the full checks land): world size and graph fingerprint."""

from __future__ import annotations

import math

from meshpilot.errors import UserError


def validate_plan(plan, *, world_size: int | None = None, graph=None, source: str | None = None) -> None:
    where = f"{source}: " if source else ""
    n = math.prod(plan.mesh_shape)
    if world_size is not None and world_size != n:
        raise UserError(
            f"{where}the plan's mesh {plan.mesh_shape} has {n} devices but the world size is {world_size}; "
            f"launch with --nproc-per-node {n} or plan for this world size"
        )
    if graph is not None and graph.fingerprint() != plan.fingerprint:
        raise UserError(
            f"{where}this plan was made for a different model or input shapes (graph fingerprint "
            f"{plan.fingerprint} vs {graph.fingerprint()}); plan again for this model"
        )
