"""Running a pipeline: stages on submeshes, microbatches on a :class:`~meshpilot.planner.schedule.Schedule`.

A :class:`~meshpilot.planner.pipeline.PipelinePlan` that holds its stages' intra-operator plans
(``PipelinePlan.with_intra``) runs each stage with its own plan: :mod:`meshpilot.runtime.pipeline_stages`
(cross-mesh resharding in :mod:`meshpilot.runtime.crossmesh`). This module is the other way, for plans
without them and for split points given with a schedule: every stage data parallel.

Data-parallel stages: :func:`pipeline_parallelize` cuts the model into stages with
``torch.distributed.pipelining.pipeline`` (its tracer splits the forward at the modules that begin stages 1,
2, …, e.g. ``blocks.2``; the loss computed in the model's forward stays in the last stage) and keeps this
rank's stage module. :meth:`PipelineModule.step`
then runs this rank's actions of the schedule (``planner.schedule.pipeline``: GPipe, 1F1B):

``F m``  the stage module on microbatch m — the model's own inputs it reads (every rank passes the full
         global batch: a local slice), the previous stage's output it received; outputs kept for ``B m``
``B m``  autograd backward from the kept output: the last stage from its loss scaled by 1/(B·d), the others
         with the gradient received from the next stage; the gradient of the received input is what ``S``
         sends back
``S m>p`` ``torch.distributed.isend`` of the boundary (activation forward, its gradient backward); not waited
         until the step's end, so a send never blocks the schedule
``R m<p`` ``torch.distributed.recv`` into a buffer of the boundary's shape (known from a fake-tensor shape
         propagation of the split graph), which blocks until the peer sent
``G``     every parameter's gradient all-reduced (sum) over the stage's ranks

Each stage's ranks run data parallel over their submesh: microbatch m of the global batch (dim 0 cut into B
chunks) is cut again into d equal row shards, rank i of the stage takes shard i, parameters are replicated
and their gradients summed once per step at ``G``. A boundary is batch-sharded on both sides, so moving it
between the stages' submeshes (cross-mesh resharding) is tile send/receive: rank i of one stage sends rank j
of the other the rows both hold (``_tiles``) — one tile to the same position when the stages have the same
size, several when they differ (a stage of 1 rank sends a stage of 3 one row-tile each; the receiver
concatenates them). The schedule names the first rank of the peer stage; the tiles say which ranks really
talk. Refused in one line: a batch that does not split into equal shards on every stage, a boundary whose
dim 0 is not the batch, boundaries that are not one tensor from the stage just before (skip connections
across stages). Alpa's local all-gather (cross the slow link once, all-gather on the fast one) is not needed
here: with batch-sharded boundaries every row crosses once already (the stage-plan runtime has it).

With equal shards and a loss that averages over its batch (the GPT's cross-entropy), the step's gradients
equal the single-device full-batch gradients and its loss (the mean over microbatches and shards) the
single-device loss. Every send, receive and all-reduce is reported to ``runtime.collective_log``
(``send`` / ``recv`` on axis ``pp``, ``all_reduce`` on ``dp``) and :meth:`PipelineModule.planned_counts`
says what the schedule asks for, so a test compares them.

Why not ``torch.distributed.pipelining``'s schedule classes: the schedule here is a value the simulator
times and the plan stores (``S``/``R`` actions included); executing that value action by action is what makes
the simulated and the run step the same program. Its ``PipelineStage`` also assumes one rank per stage in a
pipeline group; here a stage is a submesh, its data-parallel gradient sync one of the schedule's actions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import fx

from meshpilot.errors import UserError
from meshpilot.graph.capture import OpGraph, Phase
from meshpilot.planner.schedule import ActionKind, Schedule
from meshpilot.runtime.collective_log import phase_scope, record
from meshpilot.sharding.reshard import CollectiveKind

_RUNS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.SEND, ActionKind.RECV, ActionKind.GRAD_SYNC})

if TYPE_CHECKING:
    from meshpilot.planner.pipeline import PipelinePlan
    from meshpilot.runtime.pipeline_stages import PlannedPipelineModule

PP_AXIS = "pp"
"""The axis name boundary sends and receives are recorded under."""
DP_AXIS = "dp"
"""The axis name of a stage's gradient all-reduce."""


@dataclass(frozen=True)
class StageInputs:
    """Where stage s's forward arguments come from, in order: ``("input", i)`` the model's input i,
    ``("boundary", 0)`` the previous stage's output."""

    sources: tuple[tuple[str, int], ...]


def _stage_inputs(split_gm: fx.GraphModule, num_stages: int) -> list[StageInputs]:
    """Each stage's argument sources from the split graph; one line for what this runtime does not carry."""
    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
    if len(calls) != num_stages:
        raise UserError(f"the model split into {len(calls)} stages, not {num_stages}; check the split points")
    out = []
    for s, call in enumerate(calls):
        src = []
        for a in call.args:
            if isinstance(a, fx.Node) and a.op == "placeholder":
                src.append(("input", placeholders.index(a)))
            elif isinstance(a, fx.Node) and s > 0 and a is calls[s - 1]:
                src.append(("boundary", 0))
            else:
                raise UserError(
                    f"stage {s} reads {a} from an earlier stage than the one before it or a part of a tuple; "
                    "this runtime passes one tensor between neighbouring stages: split where one value crosses"
                )
        out.append(StageInputs(tuple(src)))
    return out


_SPLIT = frozenset({ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})


def check_schedule(schedule: Schedule, stage_ranks: Sequence[Sequence[int]], *, split_backward: bool = False) -> None:
    """One line if `schedule` has actions the pipeline runtimes do not run (``I`` / ``W`` only with
    `split_backward`: the runtime of stages with their own plans) or its stages miss or repeat a rank."""
    runs = _RUNS | _SPLIT if split_backward else _RUNS
    odd = sorted({str(a) for c in schedule.classes for a in c.actions if a.kind not in runs})
    if odd:
        if split_backward:
            raise UserError(
                f"schedule {schedule.name!r} has actions {', '.join(odd[:3])}: this runtime runs F, B, I, W, S, R "
                "and G; give a GPipe, 1F1B or zero-bubble schedule (meshpilot.planner.schedule)"
            )
        raise UserError(
            f"schedule {schedule.name!r} has actions {', '.join(odd[:3])}: this runtime runs F, B, S, R and G; "
            "give a GPipe or 1F1B schedule (meshpilot.planner.schedule.pipeline), or a plan with its stages' plans "
            "(PipelinePlan.with_intra) for a zero-bubble one"
        )
    if [tuple(c.ranks) for c in schedule.classes] != [tuple(r) for r in stage_ranks]:
        raise UserError(
            f"schedule {schedule.name!r} has rank classes {[tuple(c.ranks) for c in schedule.classes]}; a pipeline "
            f"schedule has one per stage, the stages' ranks {[tuple(r) for r in stage_ranks]} in order"
        )
    world = dist.get_world_size()
    if sorted(r for rs in stage_ranks for r in rs) != list(range(world)):
        raise UserError(f"the schedule's stages cover ranks {tuple(stage_ranks)}; give every rank 0..{world - 1} once")


class PipelineModule:
    """This rank's stage of a pipeline and the step that runs it (module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: Sequence[torch.Tensor],
        split_points: Sequence[str],
        schedule: Schedule,
    ) -> None:
        from torch.distributed.pipelining import SplitPoint
        from torch.distributed.pipelining import pipeline as trace_pipeline

        if not dist.is_initialized():
            raise UserError("pipeline_parallelize needs torch.distributed initialised (run under torchrun)")
        self.schedule = schedule
        self.stage_ranks = tuple(c.ranks for c in schedule.classes)
        S, self.M = len(self.stage_ranks), schedule.microbatches
        if len(split_points) != S - 1:
            raise UserError(
                f"{len(split_points)} split points for {S} stages; give one module name per stage after the first"
            )
        check_schedule(schedule, self.stage_ranks)
        rank = dist.get_rank()
        self.stage = next(s for s, rs in enumerate(self.stage_ranks) if rank in rs)
        self.pos = self.stage_ranks[self.stage].index(rank)
        self.d = len(self.stage_ranks[self.stage])
        self._first = {rs[0]: s for s, rs in enumerate(self.stage_ranks)}
        whole = {x.shape[0] for x in inputs}
        sizes = sorted({len(rs) for rs in self.stage_ranks})
        if len(whole) != 1 or any(b % self.M or (b // self.M) % d for b in whole for d in sizes):
            raise UserError(
                f"batch {sorted(whole)} does not split into {self.M} microbatches and each of those into equal shards "
                f"over stages of {sizes} ranks; give one batch size divisible by {self.M} x each of {sizes}"
            )
        self.rows = whole.pop() // self.M
        """Rows (batch dim 0) of one microbatch."""
        local = [self._shard(x, 0) for x in inputs]
        names = dict(model.named_modules())
        for p in split_points:
            if p not in names:
                raise UserError(f"split point {p!r} is no module of the model; give names like 'blocks.2'")
        pipe = trace_pipeline(model, mb_args=tuple(local), split_spec={p: SplitPoint.BEGINNING for p in split_points})
        self.sources = _stage_inputs(pipe.split_gm, S)
        self.module: torch.nn.Module = pipe.get_stage_module(self.stage)
        self.last = self.stage == S - 1
        self._shapes = self._boundary_shapes(pipe.split_gm, local)
        for shape, _ in self._shapes[:-1]:
            if not shape or shape[0] != self.rows // self.d:
                raise UserError(
                    f"a stage boundary of shape {tuple(shape)} does not have the batch as dim 0; this runtime "
                    "shards boundaries by batch rows: split where a [batch, ...] activation crosses"
                )
        self.group = None
        for s, rs in enumerate(self.stage_ranks):  # every rank takes part in creating every group, in one order
            if len(rs) > 1:
                g = dist.new_group(list(rs))
                self.group = g if s == self.stage else self.group

    # ------------------------------------------------------------------ set-up
    def _shard(self, x: torch.Tensor, m: int) -> torch.Tensor:
        lo, hi = self._span(self.stage, self.pos)
        return x[m * self.rows + lo : m * self.rows + hi].contiguous()

    def _span(self, stage: int, pos: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` of a microbatch that the rank at `pos` of `stage` holds."""
        k = self.rows // len(self.stage_ranks[stage])
        return pos * k, (pos + 1) * k

    def _tiles(self, other: int) -> list[tuple[int, int, int]]:
        """The pieces of a boundary between this rank and stage `other`: (peer rank, lo, hi) for each rank of
        `other` whose rows overlap this rank's, the overlap in microbatch rows (cross-mesh resharding of a
        batch-sharded value: tile-for-tile sends; one tile per peer when both stages have the same size)."""
        mlo, mhi = self._span(self.stage, self.pos)
        out = []
        for j, r in enumerate(self.stage_ranks[other]):
            lo, hi = self._span(other, j)
            if max(lo, mlo) < min(hi, mhi):
                out.append((r, max(lo, mlo), min(hi, mhi)))
        return out

    def _boundary_shapes(
        self, split_gm: fx.GraphModule, local: list[torch.Tensor]
    ) -> list[tuple[torch.Size, torch.dtype]]:
        """The output (shape, dtype) of every stage on one shard of one microbatch (fake tensors: no compute)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.shape_prop import ShapeProp

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = [mode.from_tensor(x) for x in local]
        gm = fx.GraphModule(split_gm, split_gm.graph)
        ShapeProp(gm, fake_mode=mode).propagate(*fake)
        calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("submod_")]
        out = []
        for n in calls:
            meta = n.meta.get("tensor_meta")
            if meta is None or not hasattr(meta, "shape"):
                raise UserError(f"stage {n.target} returns {type(meta).__name__}; a stage must return one tensor")
            out.append((meta.shape, meta.dtype))
        return out

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.module.named_parameters())

    # ------------------------------------------------------------------ the step
    def step(self, *inputs: torch.Tensor) -> torch.Tensor | None:
        """One training step on the full global batch `inputs`: the gradients land in ``.grad`` of this stage's
        parameters (summed into what is there); returns the step's loss on the last stage's ranks (this rank's
        shards' mean; the mean over the stage's ranks is the model's loss), None elsewhere."""
        sends: list = []
        recv: dict[tuple[int, int], torch.Tensor] = {}
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        losses: list[torch.Tensor] = []
        boundary_in = self._shapes[self.stage - 1] if self.stage > 0 else None
        for a in self.schedule.actions(dist.get_rank()):
            k, m = a.kind, a.microbatch
            if k in (ActionKind.SEND, ActionKind.RECV):
                peer_stage = self._first[a.peer]
                forward = (peer_stage > self.stage) == (k == ActionKind.SEND)
                phase = Phase.FWD if forward else Phase.BWD
                tag = 2 * m + int(forward)
                mlo = self._span(self.stage, self.pos)[0]
                if k == ActionKind.SEND:
                    t = saved[m][1].detach() if forward else saved.pop(m)[0].grad
                    for peer, lo, hi in self._tiles(peer_stage):
                        piece = t[lo - mlo : hi - mlo].contiguous()
                        record(CollectiveKind.SEND, PP_AXIS, 2, piece.numel() * piece.element_size(), phase)
                        sends.append(dist.isend(piece, peer, tag=tag))
                else:
                    shape, dtype = boundary_in if forward else self._shapes[self.stage]
                    pieces = []
                    for peer, lo, hi in self._tiles(peer_stage):
                        piece = torch.empty((hi - lo, *shape[1:]), dtype=dtype)
                        record(CollectiveKind.RECV, PP_AXIS, 2, piece.numel() * piece.element_size(), phase)
                        dist.recv(piece, peer, tag=tag)
                        pieces.append(piece)
                    recv[(m, int(forward))] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            elif k == ActionKind.FORWARD:
                args = []
                x_in = None
                for kind, i in self.sources[self.stage].sources:
                    if kind == "input":
                        args.append(self._shard(inputs[i], m))
                    else:
                        x_in = recv.pop((m, 1)).requires_grad_()
                        args.append(x_in)
                with phase_scope(Phase.FWD):
                    out = self.module(*args)
                if self.last:
                    losses.append(out.detach())
                saved[m] = (x_in, out)
            elif k == ActionKind.BACKWARD:
                x_in, out = saved[m]
                with phase_scope(Phase.BWD):
                    if self.last:
                        (out / (self.M * self.d)).backward()
                    else:
                        out.backward(recv.pop((m, 0)))
                if self.stage > 0:
                    saved[m] = (x_in, out.detach())
                else:
                    saved.pop(m)
            elif k == ActionKind.GRAD_SYNC:
                self._grad_sync()
        for w in sends:
            w.wait()
        return torch.stack(losses).mean() if self.last else None

    def _grad_sync(self) -> None:
        if self.group is None:
            return
        with phase_scope(Phase.BWD):
            for p in self.module.parameters():
                if p.grad is None:
                    continue
                record(CollectiveKind.ALL_REDUCE, DP_AXIS, self.d, p.grad.numel() * p.grad.element_size())
                dist.all_reduce(p.grad, group=self.group)

    def planned_counts(self) -> Counter[tuple[CollectiveKind, str, int]]:
        """What this rank's actions of the schedule issue, keyed like ``CollectiveLog.counts()``."""
        out: Counter[tuple[CollectiveKind, str, int]] = Counter()
        for a in self.schedule.actions(dist.get_rank()):
            if a.kind in (ActionKind.SEND, ActionKind.RECV):
                peer_stage = self._first[a.peer]
                shape, dtype = self._shapes[min(peer_stage, self.stage)]
                kind = CollectiveKind.SEND if a.kind == ActionKind.SEND else CollectiveKind.RECV
                for _, lo, hi in self._tiles(peer_stage):
                    out[(kind, PP_AXIS, (hi - lo) * math.prod(shape[1:]) * dtype.itemsize)] += 1
            elif a.kind == ActionKind.GRAD_SYNC and self.d > 1:
                for p in self.module.parameters():
                    if p.requires_grad:
                        out[(CollectiveKind.ALL_REDUCE, DP_AXIS, p.numel() * p.element_size())] += 1
        return out


def pipeline_parallelize(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    plan: PipelinePlan | Sequence[str],
    schedule: Schedule | None = None,
    *,
    graph: OpGraph | None = None,
    local_gather: bool = False,
) -> PipelineModule | PlannedPipelineModule:
    """This rank's stage of `model` run on a pipeline: `plan` a :class:`~meshpilot.planner.pipeline.PipelinePlan`
    (its ``split_points`` and ``step_schedule()``), or the module names that begin stages 1, 2, … (``blocks.2``)
    with `schedule` (one rank class per stage). `inputs` is an example global batch (module docstring).

    A plan holding its stages' intra-operator plans (``PipelinePlan.with_intra``) runs each stage with its own
    plan on its own submesh (:mod:`meshpilot.runtime.pipeline_stages`); `graph` then reuses a capture of the
    model on one microbatch (the plan's graph), ``local_gather=True`` moves a boundary the receiving stage
    replicates by Alpa's local all-gather (``runtime.crossmesh``), and `schedule` replaces the plan's own
    (one rank class per stage, e.g. ``planner.schedule.zero_bubble``: backwards split into ``I`` and ``W``).
    Without them every stage runs data parallel (above)."""
    from meshpilot.planner.pipeline import PipelinePlan

    if isinstance(plan, PipelinePlan):
        if plan.chunks > 1 and not plan.intra:
            raise UserError(
                "an interleaved 1F1B plan runs with its stages' own plans; save it with `meshpilot plan --pipeline "
                "--out` (or add them: PipelinePlan.with_intra)"
            )
        if plan.intra:
            from meshpilot.runtime.pipeline_stages import PlannedPipelineModule

            if not dist.is_initialized():
                raise UserError("pipeline_parallelize needs torch.distributed initialised (run under torchrun)")
            return PlannedPipelineModule(
                model, inputs, plan, graph=graph, local_gather=local_gather, schedule=schedule
            )  # fmt: skip
        if schedule is not None:
            raise UserError(
                "a PipelinePlan without its stages' plans runs its own schedule; leave schedule= out, or add the "
                "stages' plans (PipelinePlan.with_intra) to run another (a zero-bubble one)"
            )
        return PipelineModule(model, inputs, plan.split_points, plan.step_schedule())
    if schedule is None:
        raise UserError("split points need a schedule: pass schedule=meshpilot.planner.schedule.pipeline(...)")
    return PipelineModule(model, inputs, list(plan), schedule)


__all__ = ["DP_AXIS", "PP_AXIS", "PipelineModule", "check_schedule", "pipeline_parallelize"]
