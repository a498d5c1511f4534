"""Running a pipeline: ``pipeline_parallelize(model, inputs, plan)``, `plan` a ``planner.plan.Plan`` of stages.

Every stage runs its own intra-operator plan on its own submesh (:mod:`meshpilot.runtime.pipeline_stages`:
the stage's slice of the captured step, the same DTensor interpreter and recorded programs as
``parallelize``; values crossing stages by :mod:`meshpilot.runtime.crossmesh`). A plan holds those stage
plans once it went through ``Plan.with_intra`` (``meshpilot plan --pipeline --out`` saves them). A
plan without them runs **data-parallel stages**, which are ordinary stage plans too: :func:`data_parallel_stages`
makes them — every stage's slice planned with its parameters pinned replicated and the model's inputs pinned
batch-sharded over the stage's ranks (``planner.forced.data_parallel``), and so the values it receives with the
microbatch's rows (``Plan.with_intra``: ``planner.plan.received_rows_pins``): the boundaries arrive as batch
rows; the ILP chooses the rest (the gradients are all-reduced over the stage's ranks at ``G``) — and the
pipeline then runs exactly as a searched one: one runtime, whatever the stages' layouts.

The stage plans are searched on rank 0 only and broadcast (``broadcast_object_list``), so every rank runs
the same plans whatever the solver's ties, and the other ranks spend no time on it. The cluster they are
costed on (``cluster=``, default ``atp-ic5`` of the plan's size) only picks the operators' algorithms: every
layout that decides the collectives is pinned.

Refused in one line, before any stage is built: a data-parallel stage whose microbatch does not split into
equal row shards over its ranks, and a schedule with actions the runtime does not run or stages that miss or
repeat a rank (:func:`check_schedule`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshpilot.errors import UserError
from meshpilot.graph.capture import OpGraph
from meshpilot.planner.schedule import ActionKind, Schedule

if TYPE_CHECKING:
    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.pipeline_stages import PlannedPipelineModule

_RUNS = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
        ActionKind.SEND,
        ActionKind.RECV,
        ActionKind.GRAD_SYNC,
    }
)
"""The actions the pipeline runtime runs."""


def check_schedule(schedule: Schedule, stage_ranks: Sequence[Sequence[int]]) -> None:
    """One line if `schedule` has actions the pipeline runtime does not run or its rank classes are not
    `stage_ranks` (each rank once)."""
    odd = sorted({str(a) for c in schedule.classes for a in c.actions if a.kind not in _RUNS})
    if odd:
        raise UserError(
            f"schedule {schedule.name!r} has actions {', '.join(odd[:3])}: this runtime runs F, B, I, W, S, R and G; "
            "give a GPipe, 1F1B, interleaved or zero-bubble schedule (meshpilot.planner.schedule)"
        )
    if [tuple(c.ranks) for c in schedule.classes] != [tuple(r) for r in stage_ranks]:
        raise UserError(
            f"schedule {schedule.name!r} has rank classes {[tuple(c.ranks) for c in schedule.classes]}; a pipeline "
            f"schedule has one per stage, the stages' ranks {[tuple(r) for r in stage_ranks]} in order"
        )
    world = dist.get_world_size()
    if sorted(r for rs in stage_ranks for r in rs) != list(range(world)):
        raise UserError(f"the schedule's stages cover ranks {tuple(stage_ranks)}; give every rank 0..{world - 1} once")


def microbatch_examples(inputs: Sequence[torch.Tensor], microbatches: int) -> list[torch.Tensor]:
    """Meta tensors of one microbatch of the global batch `inputs` (dim 0 cut into `microbatches`); one line
    when it does not split."""
    whole = {x.shape[0] for x in inputs if x.dim() > 0}
    if len(whole) != 1 or next(iter(whole)) % microbatches:
        raise UserError(
            f"inputs of batch sizes {sorted({x.shape[0] for x in inputs})} do not split into the plan's "
            f"{microbatches} microbatches; give one batch size divisible by {microbatches}"
        )
    return [torch.empty((x.shape[0] // microbatches, *x.shape[1:]), dtype=x.dtype, device="meta") for x in inputs]


def data_parallel_stages(
    pplan: Plan, model: torch.nn.Module, examples: Sequence[torch.Tensor], graph: OpGraph, cluster: Any
) -> Plan:
    """`pplan` with a data-parallel plan for every stage (module docstring): `examples` one microbatch of the
    model's inputs, `graph` the model's step captured on them. Pure (searched where called)."""
    from meshpilot.planner import forced

    rows = examples[0].shape[0] if examples and examples[0].dim() > 0 else 0
    for j, st in enumerate(pplan.stages):
        d = len(st.ranks)
        if rows % d:
            B = pplan.microbatches
            raise UserError(
                f"stage {j} runs data parallel on {d} ranks, which do not split a microbatch of {rows} rows into equal "
                f"shards; give a global batch divisible by {B} x each stage's size, or a plan with its stages' plans "
                "(`meshpilot plan --pipeline --out`)"
            )
    force = [forced.data_parallel(model, examples, st.mesh_shape) for st in pplan.stages]
    return pplan.with_intra(graph, cluster, force=force)


def pipeline_parallelize(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    plan: Plan,
    schedule: Schedule | None = None,
    *,
    graph: OpGraph | None = None,
    local_gather: bool = False,
    cluster: Any = None,
    compile: bool | str = False,
) -> PlannedPipelineModule:
    """This rank's stages of `model` run on the pipeline `plan`: each stage its own intra-operator plan on its
    own submesh, data-parallel ones where the plan holds none (module docstring). `inputs` is an example global
    batch; `graph` reuses a capture of the model on one microbatch (the plan's graph); ``local_gather=True``
    moves a boundary the receiving stage replicates by Alpa's local all-gather (``runtime.crossmesh``);
    `schedule` replaces the plan's own (one rank class per stage group, e.g. ``planner.schedule.zero_bubble``:
    backwards split into ``I`` and ``W``); `cluster` costs the data-parallel stages' plans; `compile` hands
    every stage's programs to ``torch.compile`` as ``parallelize`` does."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.pipeline_stages import PlannedPipelineModule

    if not dist.is_initialized():
        raise UserError("pipeline_parallelize needs torch.distributed initialised (run under torchrun)")
    if not isinstance(plan, Plan) or plan.is_single:
        raise UserError(
            f"pipeline_parallelize runs a Plan of stages, not a {type(plan).__name__} of one; make one with "
            "meshpilot.planner.pipeline.plan_pipeline or fixed_pipeline (split points: layer ranges)"
        )
    examples = microbatch_examples(inputs, plan.microbatches)
    if not plan.intra:
        if graph is None:
            graph = capture(model, examples)
        box: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                dp = data_parallel_stages(plan, model, examples, graph, cluster or f"atp-ic5:{plan.num_devices}")
                box[0] = dp.to_json()
            except UserError as e:
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], UserError):
            raise box[0]
        plan = Plan.from_json(box[0])
    return PlannedPipelineModule(
        model, inputs, plan, graph=graph, local_gather=local_gather, schedule=schedule, compile=compile
    )


__all__ = ["check_schedule", "data_parallel_stages", "microbatch_examples", "pipeline_parallelize"]
