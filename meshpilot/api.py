"""The public entry points that build a :class:`~meshpilot.planner.plan.Plan` (``meshpilot.plan``)."""

from __future__ import annotations

from typing import Any

from meshpilot.planner.plan import Plan


def plan(model: Any, example_inputs: Any, cluster: Any, **options: Any) -> Plan:
    """The one-stage :class:`Plan` of `model` on `cluster`: every operator's sharding and the mesh chosen by the
    per-operator search (``meshpilot.planner.auto.plan``: pure, FakeTensor capture; `options` are its keyword
    arguments — ``num_devices``, ``mesh_shape``, ``microbatches``, ``searcher``, …). A pipeline comes from
    ``meshpilot.planner.pipeline.plan_pipeline`` (or ``meshpilot plan``, which weighs both); both are run by
    ``meshpilot.parallelize(model, plan)`` and saved by ``Plan.save``."""
    from meshpilot.planner.auto import plan as plan_one_stage

    return Plan.single(plan_one_stage(model, example_inputs, cluster, **options))


__all__ = ["plan"]
