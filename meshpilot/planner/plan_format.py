"""The one JSON format of a :class:`~meshpilot.planner.plan.Plan`, and the older files it reads.

A saved plan is one object::

    {"format": "meshpilot-plan", "version": 2,
     "cluster", "num_devices", "microbatches", "schedule" (a PipelineKind, null for one stage), "costing",
     "capacity", "dp_step_s", "planning_s", "stage_plans", "t_max_tried", "clustering" (null for one stage),
     "stages": [{"layers" (null: the whole model), "layer_names", "ranks", "mesh_shape", "cost" (null for one
                 stage), "t_s", "in_flight", "memory_bytes", "recv_bytes", "input_share",
                 "plan": a StagePlan.to_dict() (null before Plan.with_intra)}],
     "transfers": [StageTransfer fields], "step_schedule": the schedule's actions (a check, and the full listing)}

Older files load: a one-stage plan of version 1 (no ``format``; the stage plan's fields at the top) becomes
``Plan.single`` of it, and a pipeline plan (``"format": "meshpilot-pipeline-plan/1"``, its stage plans in
``intra``) the same stages. Anything else — another ``format``, a version this meshpilot does not read, a
missing or malformed field — is refused in one line that names the file and says to plan again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshpilot.errors import UserError
from meshpilot.planner.plan import Plan, PlanStage, StagePlan, StageTransfer, _sequence_order_of
from meshpilot.planner.schedule import PipelineKind, Schedule

PLAN_FORMAT = "meshpilot-plan"
"""The ``format`` field of a saved plan."""
PLAN_VERSION = 2
"""The ``version`` this meshpilot writes (and the only one of :data:`PLAN_FORMAT` it reads)."""
OLD_PIPELINE_FORMAT = "meshpilot-pipeline-plan/1"
"""The ``format`` of pipeline plans saved before there was one plan type (read, never written)."""

_SCALARS = ("microbatches", "num_devices", "capacity", "dp_step_s", "planning_s", "stage_plans", "t_max_tried")


def _replan(where: str) -> str:
    return f"{where}plan again with this meshpilot (`meshpilot plan ... --out FILE`)"


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """`plan` as plain data in the one format (module docstring)."""
    d: dict[str, Any] = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "cluster": plan.cluster}
    d.update({k: getattr(plan, k) for k in _SCALARS})
    d["schedule"] = plan.schedule.value if plan.schedule is not None else None
    d["costing"] = plan.costing.value
    d["clustering"] = dataclasses.asdict(plan.clustering) if plan.clustering is not None else None
    d["stages"] = [_stage_to_dict(st) for st in plan.stages]
    d["transfers"] = [dataclasses.asdict(x) for x in plan.transfers]
    d["send_split"] = plan.send_split
    if plan.sequence_order is not None:  # contiguous: files as before the field
        d["sequence_order"] = dataclasses.asdict(plan.sequence_order)
    if plan.sync_overlap:  # the runtime's order (every sync at G): files as before the field
        d["sync_overlap"] = True
    d["step_schedule"] = plan.step_schedule().to_dict()
    return d


def _stage_to_dict(st: PlanStage) -> dict[str, Any]:
    out = {f.name: getattr(st, f.name) for f in dataclasses.fields(st) if f.name not in ("cost", "plan")}
    out["layers"] = list(st.layers) if st.layers is not None else None
    out["cost"] = None
    if st.cost is not None:
        out["cost"] = dataclasses.asdict(st.cost)
        out["cost"]["mapping"] = st.cost.mapping.value
    out["plan"] = st.plan.to_dict() if st.plan is not None else None
    return out


def plan_from_dict(d: Any, source: str | None = None) -> Plan:
    """The plan of `d`: the one format, or an older file (module docstring); one line for anything else."""
    where = f"{source}: " if source else ""
    if not isinstance(d, dict):
        raise UserError(f"{where}not a meshpilot plan (the JSON is a {type(d).__name__}, not an object); {_replan('')}")
    fmt = d.get("format")
    if fmt is None:  # a one-stage plan of version 1 (StagePlan.from_dict says what a damaged one lacks)
        return Plan.single(StagePlan.from_dict(d, source=source))
    if fmt == OLD_PIPELINE_FORMAT:
        return _read(d, where, d.get("intra", []))
    if fmt != PLAN_FORMAT:
        what = f'"format" {fmt!r}' if fmt is not None else 'no "format"'
        raise UserError(f"{where}not a meshpilot plan ({what}); give a plan saved by `meshpilot plan --out FILE`")
    version = d.get("version")
    if isinstance(version, bool) or version != PLAN_VERSION:
        raise UserError(
            f"{where}version: is {version!r}, this meshpilot reads plan version {PLAN_VERSION} (and older one-stage "
            f"and pipeline files); {_replan('')} or upgrade meshpilot"
        )
    return _read(d, where, None)


def _read(d: dict, where: str, intra: list | None) -> Plan:
    """The plan of the one format (`intra` None: each stage's plan in its ``plan``) or of an old pipeline file
    (`intra`: its list of stage plans)."""
    try:
        plan = _build(d, where, intra)
    except UserError:
        raise
    except KeyError as e:
        raise UserError(f"{where}{e.args[0]}: missing from the plan (hand-edited or damaged?); {_replan('')}") from None
    except (TypeError, ValueError, IndexError, AttributeError) as e:
        raise UserError(f"{where}malformed plan ({type(e).__name__}: {e}); {_replan('')}") from None
    # a pipeline's actions are rebuilt from its stages and kind; a one-stage plan's are its stage plan's own
    if "step_schedule" in d and not plan.is_single and Schedule.from_dict(d["step_schedule"]) != plan.step_schedule():
        raise UserError(f"{where}its step_schedule does not match its stages and schedule kind; {_replan('')}")
    return plan


def _build(d: dict, where: str, intra: list | None) -> Plan:
    from meshpilot.planner.pipeline import Clustering

    plans = intra if intra is not None else [st.get("plan") for st in d["stages"]]
    if intra and len(intra) != len(d["stages"]):
        raise UserError(f"{where}{len(intra)} intra-operator plans for {len(d['stages'])} stages; {_replan('')}")
    stages = tuple(
        _stage(st, plans[j] if j < len(plans) else None, f"{where}stage {j}: ") for j, st in enumerate(d["stages"])
    )
    cl = d.get("clustering")
    clustering = (
        Clustering(tuple(tuple(b) for b in cl["bounds"]), tuple(cl["flops"]), tuple(cl["recv_bytes"]), cl["delta"])
        if cl is not None
        else None
    )
    transfers = tuple(
        StageTransfer(x["src"], x["dst"], bool(x["forward"]), tuple(x["values"]),
                      tuple(tuple(sh) for sh in x["shapes"]), float(x["nbytes"]), float(x["seconds"]))
        for x in d.get("transfers", ())
    )  # fmt: skip
    kind = PipelineKind(d["schedule"]) if d.get("schedule") is not None else None
    return Plan(
        stages, clustering=clustering, schedule=kind, costing=d.get("costing", "exact"), transfers=transfers,
        cluster=str(d.get("cluster", "")), send_split=int(d.get("send_split", 1)),
        sequence_order=_sequence_order_of(d.get("sequence_order")), sync_overlap=bool(d.get("sync_overlap", False)),
        **{k: d[k] for k in _SCALARS},
    )  # fmt: skip


def _stage(st: dict, plan: dict | None, where: str) -> PlanStage:
    from meshpilot.cluster.mesh import MeshMapping
    from meshpilot.planner.accounting import PhasePeaks
    from meshpilot.planner.plan import MemoryUse, StepTime
    from meshpilot.planner.stage import StageCost

    c = st["cost"]
    cost = None
    if c is not None:
        cost = StageCost(
            tuple(c["layers"]), tuple(c["ranks"]), tuple(c["mesh_shape"]), MeshMapping(c["mapping"]),
            StepTime(**c["time"]), MemoryUse(**c["memory"]), PhasePeaks(**c["peaks"]), c["forward_s"], c["search_s"],
            sync_s=float(c.get("sync_s", 0.0)),
        )  # fmt: skip
    return PlanStage(
        tuple(st["layers"]) if st["layers"] is not None else None, tuple(st["layer_names"]), tuple(st["ranks"]),
        tuple(st["mesh_shape"]), cost, st["t_s"], st["in_flight"], st["memory_bytes"], st["recv_bytes"],
        st.get("input_share"), StagePlan.from_dict(plan, source=where.rstrip(": ")) if plan is not None else None,
    )  # fmt: skip


__all__ = ["OLD_PIPELINE_FORMAT", "PLAN_FORMAT", "PLAN_VERSION", "plan_from_dict", "plan_to_dict"]
