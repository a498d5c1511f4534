"""meshpilot: plan and run distributed training of PyTorch models, knowing the cluster's interconnect.

    import meshpilot
    cluster = meshpilot.load_cluster("atp-ic3")                    # preset, TOML file, or `meshpilot probe`
    plan = meshpilot.plan(model, (x, y), cluster, num_devices=8)   # pure: FakeTensor capture + Alpa ILP -> Plan
    plan.save("plan.json")                                         # one JSON format, one stage or a pipeline
    # under torchrun:
    pm = meshpilot.parallelize(model, meshpilot.Plan.load("plan.json"))

Names load lazily, so planning never imports the runtime and `meshpilot --help` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "plan": "meshpilot.api",
    "Plan": "meshpilot.planner.plan",
    "StagePlan": "meshpilot.planner.plan",
    "PlanError": "meshpilot.planner.ilp",
    "parallelize": "meshpilot.runtime.spmd",
    "load_cluster": "meshpilot.cluster",
    "Cluster": "meshpilot.cluster",
    "LogicalMesh": "meshpilot.cluster",
    "CostModel": "meshpilot.cluster",
    "UserError": "meshpilot.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "atp":
        return importlib.import_module("meshpilot.atp")
    raise AttributeError(f"module 'meshpilot' has no attribute {name!r}")
