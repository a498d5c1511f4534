"""A pipeline whose stages each run their own intra-operator plan on their own submesh.

:func:`meshpilot.runtime.pipeline.pipeline_parallelize` runs every
:class:`~meshpilot.planner.plan.Plan` of stages here, with the stages' plans it holds (``Plan.with_intra``)
or data-parallel ones made for it (``pipeline.data_parallel_stages``).
Stage s's work is the slice of the model's captured step that its plan was searched on
(``stage.slice_graph`` over ``pipeline.runnable_layers``: its layers' forward and backward nodes), so every
node runs the strategy the stage's search chose, through the same machinery as ``parallelize``: the
:class:`~meshpilot.runtime.interpret.Interpreter` on a ``DeviceMesh`` of the stage's ranks (its logical mesh,
``StagePlan.mesh_ranks`` indexing ``PlanStage.ranks``), recorded into programs on the first step
(:mod:`meshpilot.runtime.record`) and replayed after. Per stage, three programs (:class:`StageProgram`):

* forward ``F m`` — (parameters, buffers, microbatch m of the model's inputs, values received from the
  previous stage) → (the loss on the last stage, buffer updates, what the backward keeps, values for the
  next stage);
* backward ``B m`` — (what the forward kept, gradients received from the next stage) → (this stage's part of
  each gradient, gradients for the previous stage);
* gradient sync ``G`` — each gradient into its parameter's layout (the stage plan's ``grad:`` collectives).

Under a zero-bubble schedule (``planner.schedule.zero_bubble``) the backward runs as two programs instead:
``I m`` — the backward nodes the gradients sent to the previous stage depend on (data flow from those
values back through the slice), ending with those gradients and what ``W`` will read of its values and of
the received gradients — and ``W m``, the remaining nodes (the weight gradients).

Under Interleaved1F1B (``planner.schedule.interleaved_1f1b``) a rank holds the v stages of its group: one
:class:`StageProgram`, mesh and set of parameters each (stages on the same ranks in the same arrangement share
one ``DeviceMesh``), and each action names its stage (``2F3``; a send or receive both stages).

Values crossing stages (:class:`Transfer`) are the slice's ``boundary:`` inputs: the activations (and anything
else of the previous stage's forward) a stage reads, sent after ``F`` on the schedule's ``S``; the gradients
it reads from the next stage's backward, sent after ``B``. Each moves between the two meshes as
:mod:`meshpilot.runtime.crossmesh` says: the sender's program ends by resharding it into the wire layout
(its collectives run on the sender's mesh), row tiles cross by ``isend`` / ``recv``, and the receiver's
program starts by taking the wire layout to its planned one (local). Model inputs and constants a stage reads
are its own copies (every rank passes the full batch), not transfers. Which values cross is the plan's
(``Plan.transfers``, lowered by the planner: :func:`planned_transfers`); a plan file without them has them
read off the slices here (:func:`find_transfers`, which the tests hold equal to the plan's).

Tied weights: a parameter several stages read (GPT-2's embedding and LM head) is a copy in each of them
(``stage.slice_graph``, *Tied parameters*), Megatron-LM's embedding group. Each stage keeps its own part of
the gradient: its copy's gradient is the part it makes, and where a stage's slice reads another stage's part
(the sum autograd makes of them) it reads zeros instead (:func:`zero_filled`; no transfer). After the step,
once every stage has synchronised its gradients, the copies' gradients are summed across the stages holding
one (:class:`TiedSync`): each holder's gradient as a full tensor (all-gathered on its mesh), contributed by
the stage's first rank, all-reduced over a group of the holders' ranks, and each copy's shard of the sum added
to its gradient (this step's parts only: gradients accumulated over steps stay right); the copies then take the
same AdamW step. A checkpoint writes the first holder's copy; every
copy reads it back.

Refused in one line: a value crossing more than one stage or against the schedule's direction (a later stage's
backward reading an earlier stage's backward), a buffer used by two stages, a tied weight read by two stages
of one rank group (Interleaved1F1B), a scalar boundary, a batch that does not split into the plan's
microbatches, a plan made for another model.

Microbatch m's gradients are scaled by 1/B where they are accumulated (the boundary gradients are not: the
scaling is linear), so with a loss that averages over its batch the step's gradients equal the single-device
full-batch gradients and its loss is the mean of the microbatches'. :meth:`PlannedPipelineModule.planned_counts`
is what the step issues according to the plans — each stage plan's collectives (``StagePlan.collective_counts``),
the senders' wire reshards (``Resharder``), the tiles' sends and receives and the tied sync's gathers and
all-reduce — keyed like
``CollectiveLog.counts()`` on the stage's mesh.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from meshpilot.errors import UserError
from meshpilot.graph.capture import NodeKind, OpGraph, Phase, TensorInfo, capture, dtype_from_name
from meshpilot.planner import recompute
from meshpilot.planner.plan import Plan, StagePlan
from meshpilot.planner.schedule import ActionKind, Schedule
from meshpilot.planner.stage import BOUNDARY, slice_graph, stays_in_stage, tied_params
from meshpilot.runtime.collective_log import record
from meshpilot.runtime.crossmesh import MeshSide, Tile, gather_plan, rows_of, tiles, wire_layout
from meshpilot.runtime.executor import StepRun, executed_actions
from meshpilot.runtime.groups import device_mesh
from meshpilot.runtime.interpret import Interpreter, to_dtensor
from meshpilot.runtime.program import StageLinks, StageProgram
from meshpilot.sharding.placements import Placements, replicated
from meshpilot.sharding.reshard import CollectiveKind

PP_AXIS = "pp"
"""The axis name tile sends and receives are recorded under."""
LOCAL_AXIS = "local"
"""The axis name of a local all-gather among the receivers of a replicated boundary (``crossmesh``)."""


TIED_AXIS = "tied"
"""The axis name the all-reduce of a tied weight's gradient across its stages is recorded under."""


@dataclass(frozen=True)
class TiedSync:
    """A tied weight that several stages hold a copy of (module docstring, *Tied weights*)."""

    fqn: str
    holders: tuple[int, ...]
    """The stages holding a copy, ascending: the first one's copy is what a checkpoint saves."""
    info: TensorInfo
    group: Any
    """The process group of the holders' ranks (None on a rank outside it)."""
    size: int
    mine: tuple[int, ...]
    """This rank's stages among the holders."""


@dataclass(frozen=True)
class Transfer:
    """One value crossing from stage `src` to stage `dst` each microbatch (module docstring)."""

    node: str
    index: int
    src: int
    dst: int
    forward: bool
    """Sent after the producer's ``F`` (to the next stage) or after its ``B`` (to the previous stage)."""
    info: TensorInfo
    boundary: str
    """The receiving slice's input leaf for it."""
    k: int
    """Its number among the pipeline's transfers (the message tag is ``microbatch · count + k``)."""


def _boundary_source(name: str) -> tuple[str, int]:
    src, _, i = name[len(BOUNDARY) + 1 :].rpartition(":")
    return src, int(i)


def zero_filled(slices: Sequence[OpGraph], stage_of: dict[str, int], stays) -> dict[int, list[str]]:
    """Per stage, its boundary inputs that are another stage's part of a tied weight's gradient, read only by
    the additions of its parts (`stays`: ``stage.stays_in_stage``): each stage keeps its own part as its copy's
    gradient, so here they read zeros and the parts meet in the tied sync (module docstring, *Tied weights*)."""
    out: dict[int, list[str]] = {}
    for s, sub in enumerate(slices):
        for leaf in sub.nodes:
            if leaf.kind != NodeKind.INPUT or not leaf.name.startswith(BOUNDARY + ":"):
                continue
            src, i = _boundary_source(leaf.name)
            parts = [stays(src, u) for u in sub.users[leaf.name]]
            if not any(parts):
                continue
            maker = stage_of[src]
            if not all(parts) or (src, i) not in slices[maker].grads.values():
                raise UserError(
                    f"stage {s} reads {src}, a part of a tied weight's gradient that stage {maker} makes, other than "
                    "as the sum of the parts; choose other split points"
                )
            out.setdefault(s, []).append(leaf.name)
    return out


def find_transfers(
    graph: OpGraph, slices: Sequence[OpGraph], stage_of: dict[str, int], zeros: dict[int, list[str]] | None = None
) -> list[Transfer]:
    """Every value one stage's slice reads from another (module docstring), but the parts of a tied weight's
    gradient each stage reads as zeros (`zeros`, :func:`zero_filled`); one line for what is not carried."""
    out: list[Transfer] = []
    zeros = zeros or {}
    for s, sub in enumerate(slices):
        for leaf in sub.nodes:
            if leaf.kind != NodeKind.INPUT or not leaf.name.startswith(BOUNDARY + ":"):
                continue
            if leaf.name in zeros.get(s, ()):
                continue
            src, i = _boundary_source(leaf.name)
            made = graph[src]
            if made.kind in (NodeKind.INPUT, NodeKind.CONST):
                continue  # every stage has the model's inputs and constants
            if made.kind in (NodeKind.PARAM, NodeKind.BUFFER):
                raise UserError(
                    f"{made.kind} {made.fqn} is used by stages {stage_of[src]} and {s} (tied weights); this runtime "
                    "gives a parameter to one stage: split so both users are in one stage, or untie it"
                )
            a = stage_of[src]
            readers = {graph[u].phase for u in graph.users[src] if stage_of.get(u) == s}
            if a == s - 1 and made.phase == Phase.FWD:
                forward = True
            elif a == s + 1 and made.phase == Phase.BWD and readers == {Phase.BWD}:
                forward = False
            else:
                raise UserError(
                    f"stage {s} reads {src} ({made.phase} of stage {a}, {made.where()}); this runtime passes forward "
                    "values to the next stage and gradients to the previous one: choose other split points"
                )
            info = made.outputs[i]
            if not info.shape:
                raise UserError(
                    f"stage {s} reads the scalar {src} from stage {a}; split where a tensor with rows crosses"
                )
            out.append(Transfer(src, i, a, s, forward, info, leaf.name, len(out)))
    return out


def planned_transfers(
    plan: Plan, graph: OpGraph, slices: Sequence[OpGraph], zeros: dict[int, list[str]]
) -> list[Transfer] | None:
    """The plan's own transfers (``Plan.transfers``, lowered by the planner and checked by ``validate``) as the
    values this runtime moves, in the plan's order; None when the plan holds none, or names a value this graph
    does not make or the receiving slice does not read from another stage (`zeros`: :func:`zero_filled`) — a
    plan saved before it kept them, or costed on a stack's few blocks and not passed through
    ``Plan.with_intra``: :func:`find_transfers` then reads them off the slices."""
    if not plan.transfers:
        return None
    out: list[Transfer] = []
    for x in plan.transfers:
        for value in x.values:
            node, _, i = value.rpartition(":")
            boundary = f"{BOUNDARY}:{value}"
            if node not in graph.by_name or boundary not in slices[x.dst].by_name or boundary in zeros.get(x.dst, ()):
                return None
            info = graph[node].outputs[int(i)]
            if not info.shape:
                raise UserError(
                    f"stage {x.dst} reads the scalar {node} from stage {x.src}; split where a tensor with rows crosses"
                )
            out.append(Transfer(node, int(i), x.src, x.dst, x.forward, info, boundary, len(out)))
    return out


def stage_mesh(plan: StagePlan, ranks: Sequence[int], device_type: str) -> DeviceMesh:
    """The DeviceMesh of a stage: its plan's logical mesh over the stage's physical ranks (every rank of the
    world must create every stage's mesh, in one order: new process groups are collective)."""
    physical = torch.tensor([ranks[i] for i in plan.mesh_ranks], dtype=torch.int).reshape(plan.mesh_shape)
    return device_mesh(device_type, physical, tuple(plan.mesh_axes))


def _side(plan: StagePlan, ranks: Sequence[int], layout: Placements) -> MeshSide:
    flat = tuple(int(r) for r in np.asarray([ranks[i] for i in plan.mesh_ranks]))
    return MeshSide(flat, tuple(plan.mesh_shape), wire_layout(layout))


class PlannedPipelineModule:
    """This rank's stages of a pipeline whose stages run their own plans (module docstring): one, or under
    Interleaved1F1B the v stages of its rank group."""

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: Sequence[torch.Tensor],
        pplan: Plan,
        *,
        graph: OpGraph | None = None,
        local_gather: bool = False,
        schedule: Schedule | None = None,
        compile: bool | str = False,
    ) -> None:
        from meshpilot.ops import register_dtensor_strategies
        from meshpilot.planner.validate import validate
        from meshpilot.runtime.pipeline import microbatch_examples
        from meshpilot.runtime.spmd import agreed, model_device

        register_dtensor_strategies()
        self.pplan = pplan
        self.M = pplan.microbatches
        self._use_schedule(schedule)
        rank = dist.get_rank()
        self.stage_ranks = tuple(st.ranks for st in pplan.stages)
        self.stages = tuple(s for s, rs in enumerate(self.stage_ranks) if rank in rs)
        """This rank's stages, ascending (several under Interleaved1F1B)."""
        self.stage = self.stages[0]
        self.last = len(pplan.stages) - 1 in self.stages
        self._first = {rs[0]: s for s, rs in enumerate(self.stage_ranks)}
        self.device = model_device(model)
        with agreed("the plan"):  # what each rank does alone; every rank hears of a refusal before any goes on
            examples = microbatch_examples(inputs, self.M)  # one line when the batch does not split
            if graph is None:
                graph = capture(model, examples, precision=pplan.precision)
            validate(pplan, world_size=dist.get_world_size(), graph=graph)
        self.whole = graph
        slices, zeros, ties = self._slice(graph)
        self._make_meshes()
        wires = self._make_tiles(local_gather)
        self._make_programs(model, slices, wires, zeros, compile)
        self._make_ties(ties, slices)

    def _use_schedule(self, schedule: Schedule | None) -> None:
        """The plan's schedule or `schedule` (one rank class per stage group), checked against the plan."""
        from meshpilot.runtime.pipeline import check_schedule

        self.schedule: Schedule = schedule if schedule is not None else self.pplan.step_schedule()
        if self.schedule.microbatches != self.M:
            raise UserError(
                f"schedule {self.schedule.name!r} runs {self.schedule.microbatches} microbatches, the plan was made "
                f"for {self.M}; give a schedule of {self.M}"
            )
        check_schedule(self.schedule, self.pplan.groups)

    def _slice(self, graph: OpGraph) -> tuple[list[OpGraph], dict[int, list[str]], set[str]]:
        """Every stage's slice of `graph`, the boundary inputs each reads as zeros, the tied weights; sets
        :attr:`transfers` (module docstring)."""
        from meshpilot.planner.stage import runnable_layers

        run_layers = runnable_layers(graph)
        slices = [slice_graph(graph, st.layers[0], st.layers[1], run_layers) for st in self.pplan.stages]
        stage_of: dict[str, int] = {}
        for s, st in enumerate(self.pplan.stages):
            for layer in run_layers[st.layers[0] : st.layers[1]]:
                for name in layer.nodes:
                    stage_of[name] = s
        zeros = zero_filled(slices, stage_of, stays_in_stage(graph, run_layers))
        planned = planned_transfers(self.pplan, graph, slices, zeros)
        self.transfers = planned if planned is not None else find_transfers(graph, slices, stage_of, zeros)
        # a stage whose plan recomputes blocks runs its slice with their forwards copied into the backward
        # (``planner.recompute.for_plan``, as ``Plan.with_intra`` planned it); the boundaries are unchanged
        slices = [recompute.for_plan(g, p) for g, p in zip(slices, self.pplan.intra)] or slices
        return slices, zeros, tied_params(graph, run_layers)

    def _make_meshes(self) -> None:
        """Every stage's DeviceMesh (all ranks create all, in one order); stages on the same ranks in the same
        arrangement share one."""
        plans = self.pplan.intra
        meshes: dict[tuple, DeviceMesh] = {}
        self.meshes = []
        for p, st in zip(plans, self.pplan.stages):
            key = (tuple(st.ranks[i] for i in p.mesh_ranks), tuple(p.mesh_shape), tuple(p.mesh_axes))
            if key not in meshes:
                meshes[key] = stage_mesh(p, st.ranks, self.device.type)
            self.meshes.append(meshes[key])
        self.mesh = self.meshes[self.stage]
        self.plan = plans[self.stage]

    def _make_tiles(self, local_gather: bool) -> dict[int, dict[int, tuple[Placements, Placements]]]:
        """The wire layouts and row tiles of every transfer (and the local all-gather groups where asked): sets
        :attr:`tiles` and :attr:`gathers`; returns, per stage of this rank, each transfer's (wire, planned)."""
        plans, rank = self.pplan.intra, dist.get_rank()
        self.tiles: dict[int, list[Tile]] = {}
        self.gathers: dict[int, tuple[Any, int]] = {}
        """Transfers this rank all-gathers after receiving (local all-gather): (process group, its size)."""
        wires: dict[int, dict[int, tuple[Placements, Placements]]] = {s: {} for s in self.stages}
        for t in self.transfers:
            src_layout = plans[t.src].node(t.node).out_placements(t.index)
            dst_layout = plans[t.dst].node(t.boundary).out_placements(0)
            src = _side(plans[t.src], self.stage_ranks[t.src], src_layout)
            dst = _side(plans[t.dst], self.stage_ranks[t.dst], dst_layout)
            replicas = math.prod(n for n, p in zip(dst.shape, dst.wire) if not isinstance(p, Shard))
            if local_gather and replicas > 1:
                gp = gather_plan(t.info.shape[0], src, dst)
                self.tiles[t.k] = list(gp.tiles)
                for members in gp.groups:  # new groups are collective: every rank creates each, in one order
                    group = dist.new_group(list(members))
                    if rank in members:
                        self.gathers[t.k] = (group, len(members))
            else:
                self.tiles[t.k] = tiles(t.info.shape[0], src, dst)
            if t.src in wires:
                wires[t.src][t.k] = (src.wire, tuple(src_layout))
            if t.dst in wires:
                wires[t.dst][t.k] = (dst.wire, tuple(dst_layout))
        return wires

    def _make_programs(self, model, slices, wires, zeros, compile: bool | str) -> None:
        """This rank's stages' parameters as DTensors of their plans and their :class:`StageProgram`\\ s."""
        from meshpilot.runtime.spmd import distribute_parameters

        self.module = model
        """The model whose parameters this rank's stages replaced by their DTensors (its state dict names them)."""
        self.model_parameter_names = tuple(n for n, _ in model.named_parameters())
        names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(n)
        self.aliases = {ns[0]: tuple(ns) for ns in names.values()}
        """Each parameter's names in the model (a weight tied by assignment has several; its state dict has all)."""
        self._buffers = dict(model.named_buffers())
        self._persistent = tuple(k for k in model.state_dict() if k in self._buffers)
        self.programs: dict[int, StageProgram] = {}
        self._params_of: dict[int, list[torch.nn.Parameter]] = {}
        self._trainable_of: dict[int, list[str]] = {}
        plans = self.pplan.intra
        for s in self.stages:
            params, trainable = distribute_parameters(model, slices[s].param_names, plans[s], self.meshes[s])
            self._params_of[s], self._trainable_of[s] = params, trainable
            mine = [t for t in self.transfers if s in (t.src, t.dst)]
            into, out = [t for t in mine if t.dst == s], [t for t in mine if t.src == s]
            links = StageLinks(
                tuple(t for t in into if t.forward), tuple(t for t in into if not t.forward),
                tuple(t for t in out if t.forward), tuple(t for t in out if not t.forward),
                wires[s], tuple(zeros.get(s, ())),
            )  # fmt: skip
            interp = Interpreter(slices[s], plans[s], self.meshes[s], self.device)
            self.programs[s] = StageProgram(interp, trainable, links=links, whole=self.whole, compile=compile)
        self.program = self.programs[self.stage]
        self.graph = slices[self.stage]

    def _make_ties(self, ties: set[str], slices: Sequence[OpGraph]) -> None:
        """The tied weights several stages hold a copy of (module docstring, *Tied weights*), each with the
        process group of its holders' ranks (collective: every rank creates every one, in one order)."""
        rank = dist.get_rank()
        self.tied: list[TiedSync] = []
        """The tied weights several stages hold a copy of, each summed across them after the step."""
        self._parts: dict[tuple[int, str], DTensor] = {}
        """This step's synchronised gradient of each copy (stage, name), until the tied sync adds it up."""
        for fqn in sorted(ties):
            holders = tuple(j for j, sub in enumerate(slices) if fqn in sub.param_names)
            if len(holders) < 2:
                continue
            for i, a in enumerate(holders):
                for b in holders[i + 1 :]:
                    if set(self.stage_ranks[a]) & set(self.stage_ranks[b]):
                        raise UserError(
                            f"the tied weight {fqn} is read by stages {a} and {b}, which share ranks "
                            "(Interleaved1F1B); put its readers in stages of different rank groups, or in one stage"
                        )
            members = sorted({r for h in holders for r in self.stage_ranks[h]})
            group = dist.new_group(members)
            info = self.whole[next(n.name for n in self.whole.nodes if n.kind == NodeKind.PARAM and n.fqn == fqn)].out
            mine = tuple(h for h in holders if h in self.stages)
            self.tied.append(TiedSync(fqn, holders, info, group if rank in members else None, len(members), mine))

    # ------------------------------------------------------------------ parameters
    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's stages' parameters: DTensors on their meshes in their plans' layouts."""
        return [p for s in self.stages for p in self._params_of[s]]

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for s in self.stages for n, p in zip(self.programs[s].graph.param_names, self._params_of[s])]

    def saved_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """:meth:`named_parameters` but the copies of a tied weight in stages other than its first holder: what
        a checkpoint writes (one layout per name); a load fills the copies too."""
        copies = {(s, t.fqn) for t in self.tied for s in t.holders[1:]}
        return [
            (n, p) for s in self.stages for n, p in zip(self.programs[s].graph.param_names, self._params_of[s])
            if (s, n) not in copies
        ]  # fmt: skip

    def owned_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's stages' buffers that the model's state dict holds (the persistent ones), by name: what a
        checkpoint saves of them (``runtime.checkpoint``); the stages update them in place."""
        mine = {n for s in self.stages for n in self.programs[s].graph.buffer_names}
        return {n: self._buffers[n] for n in self._persistent if n in mine}

    @property
    def mismatches(self) -> list[str]:
        """Nodes of this rank's stages where DTensor chose another output layout than the plan."""
        return [m for s in self.stages for m in self.programs[s].interp.mismatches]

    # ------------------------------------------------------------------ the step
    def _tag(self, m: int, t: Transfer) -> int:
        return m * len(self.transfers) + t.k

    def _first_row(self, t: Transfer) -> int:
        """The first row of the wire piece of transfer `t` this (sending) rank holds."""
        wire, _ = self.programs[t.src].wires[t.k]
        mesh = self.meshes[t.src]
        return rows_of(t.info.shape[0], tuple(mesh.shape), wire, mesh.get_coordinate())[0]

    def _exchange(self, a, stage: int, outgoing: dict, received: dict, sends: list) -> None:
        """A send (``S``) or receive (``R``) of `stage`'s boundary values: the tiles this rank sends or receives,
        and a local all-gather after a receive where the plan has one."""
        rank = dist.get_rank()
        k, m = a.kind, a.microbatch
        forward, todo = self._moved(a, stage)
        phase = Phase.FWD if forward else Phase.BWD
        if k == ActionKind.SEND:
            for t, local in zip(todo, outgoing.pop((stage, m, forward))):
                first = self._first_row(t)
                for tile in self.tiles[t.k]:
                    if tile.src != rank:
                        continue
                    piece = local[tile.lo - first : tile.hi - first].contiguous()
                    record(CollectiveKind.SEND, PP_AXIS, 2, piece.numel() * piece.element_size(), phase)
                    sends.append(dist.isend(piece, tile.dst, tag=self._tag(m, t)))
            return
        got = []
        for t in todo:
            pieces = []
            for tile in self.tiles[t.k]:
                if tile.dst != rank:
                    continue
                shape = (tile.hi - tile.lo, *t.info.shape[1:])
                buf = torch.empty(shape, dtype=dtype_from_name(t.info.dtype), device=self.device)
                record(CollectiveKind.RECV, PP_AXIS, 2, buf.numel() * buf.element_size(), phase)
                dist.recv(buf, tile.src, tag=self._tag(m, t))
                pieces.append(buf)
            mine = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            if t.k in self.gathers:  # local all-gather: the rows of the other receivers holding them
                group, size = self.gathers[t.k]
                parts = [torch.empty_like(mine) for _ in range(size)]
                nbytes = mine.numel() * mine.element_size() * size
                record(CollectiveKind.ALL_GATHER, LOCAL_AXIS, size, nbytes, phase)
                dist.all_gather(parts, mine, group=group)
                mine = torch.cat(parts)
            got.append(mine)
        received[(stage, m, forward)] = got

    def _moved(self, a, stage: int) -> tuple[bool, list[Transfer]]:
        """Whether send / receive `a` of `stage` goes forward, and the transfers it moves."""
        prog = self.programs[stage]
        forward = a.forward
        if forward is None:
            forward = (self._first[a.peer] > stage) == (a.kind == ActionKind.SEND)
        if a.kind == ActionKind.SEND:
            return forward, prog.send_fwd if forward else prog.send_bwd
        return forward, prog.recv_fwd if forward else prog.recv_bwd

    def scheduled_p2p(self) -> Counter[tuple[CollectiveKind, str, int]]:
        """The sends and receives this rank's actions of the schedule issue: each ``S`` / ``R`` the tiles of its
        stage's transfers that way that this rank sends or receives (keyed like ``CollectiveLog.counts()``)."""
        rank = dist.get_rank()
        out: Counter = Counter()
        for a in self.schedule.actions(rank):
            if a.kind not in (ActionKind.SEND, ActionKind.RECV):
                continue
            send = a.kind == ActionKind.SEND
            kind = CollectiveKind.SEND if send else CollectiveKind.RECV
            _, todo = self._moved(a, a.stage if a.stage is not None else self.stage)
            for t in todo:
                row = math.prod(t.info.shape[1:]) * t.info.itemsize
                for tile in self.tiles[t.k]:
                    if (tile.src if send else tile.dst) == rank:
                        out[(kind, PP_AXIS, (tile.hi - tile.lo) * row)] += 1
        return out

    def step(self, *inputs: torch.Tensor) -> torch.Tensor | None:
        """One training step on the full global batch `inputs`: this rank's actions of the schedule run by the
        one loop (``runtime.executor.StepRun``: ``S`` / ``R`` by :meth:`_exchange`); the gradients land in
        ``.grad`` of this rank's stages' parameters (summed into what is there), the tied weights' summed across
        their stages; returns the step's loss on the last stage's ranks (the mean of the microbatches' losses),
        None elsewhere."""
        actions, paired = executed_actions(self.schedule, dist.get_rank())
        params = {s: [p._local_tensor for p in self._params_of[s]] for s in self.stages}
        run = StepRun(
            actions, paired, self.programs, params, self._buffers, [x.to(self.device) for x in inputs], self.M,
            stage=self.stage, exchange=self._exchange,
        )  # fmt: skip
        run.run()
        run.wait()
        for s in self.stages:
            if s in run.synced:
                self._set_grads(s, run.synced[s])
        self._sync_tied()
        return run.loss() if self.last else None

    def train_step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """:meth:`step`, its loss sent from the last stage's first rank to every rank: one training step as
        ``ParallelModule.train_step`` is one (``runtime.train`` runs both the same way)."""
        loss = self.step(*inputs)
        seen = torch.zeros((), device=self.device) if loss is None else loss.detach().float().clone()
        dist.broadcast(seen, src=self.stage_ranks[-1][0])
        return seen

    def _param(self, s: int, fqn: str) -> torch.nn.Parameter:
        return self._params_of[s][self.programs[s].graph.param_names.index(fqn)]

    def _sync_tied(self) -> None:
        """Each tied weight's gradient of this step summed over the stages holding a copy (module docstring,
        *Tied weights*): every holder's part as a full tensor, contributed by the stage's first rank, all-reduced
        over the holders' ranks, and each copy's shard of the sum added to its gradient (which may hold earlier
        steps' when they are accumulated)."""
        rank = dist.get_rank()
        for t in self.tied:
            if t.group is None:
                continue
            full = torch.zeros(t.info.shape, dtype=dtype_from_name(t.info.dtype), device=self.device)
            for s in t.mine:
                part = self._parts.pop((s, t.fqn), None)
                if part is not None:
                    whole = part.full_tensor()
                    if rank == self.stage_ranks[s][0]:
                        full += whole
            record(CollectiveKind.ALL_REDUCE, TIED_AXIS, t.size, full.nbytes, Phase.BWD)
            dist.all_reduce(full, group=t.group)
            for s in t.mine:
                p = self._param(s, t.fqn)
                d = to_dtensor(full, self.meshes[s], p.placements)
                p.grad = d if p.grad is None else p.grad + d

    def _set_grads(self, s: int, synced: list) -> None:
        """Stage `s`'s synchronised gradients (``G``) added to its parameters' ``.grad``; a tied weight's kept
        for the tied sync."""
        prog = self.programs[s]
        by_name = dict(zip(prog.graph.param_names, self._params_of[s]))
        tied = {t.fqn for t in self.tied}
        for fqn, x in zip(self._trainable_of[s], synced):
            if x is None:
                continue
            p = by_name[fqn]
            d = DTensor(x, p._spec, requires_grad=False)
            if fqn in tied:  # this step's part: added once summed across the copies (_sync_tied)
                self._parts[(s, fqn)] = d
                continue
            p.grad = d if p.grad is None else p.grad + d

    def planned_counts(self) -> Counter[tuple[CollectiveKind, str, int]]:
        """What this rank's step issues according to the plans (module docstring), keyed like
        ``CollectiveLog.counts()`` on this rank's meshes."""
        from meshpilot.sharding.reshard import Resharder
        from meshpilot.sharding.strategies import fake_device_mesh

        rank = dist.get_rank()
        out: Counter = Counter()
        for s in self.stages:
            plan = self.programs[s].interp.plan
            out.update(plan.collective_counts(backend="gloo"))
            resharder = Resharder(fake_device_mesh(tuple(plan.mesh_shape)), None)
            for t in self.transfers:
                if t.src == s:
                    wire, planned = self.programs[s].wires[t.k]
                    for c in resharder.collectives(planned, wire, t.info):
                        out[(c.kind, plan.axis_name(c.axis), c.nbytes)] += self.M
        for t in self.tied:
            for s in t.mine:
                plan = self.programs[s].interp.plan
                resharder = Resharder(fake_device_mesh(tuple(plan.mesh_shape)), None)
                for c in resharder.collectives(
                    tuple(plan.param_layout(t.fqn)), replicated(len(plan.mesh_shape)), t.info
                ):
                    out[(c.kind, plan.axis_name(c.axis), c.nbytes)] += 1
            if t.group is not None:
                out[(CollectiveKind.ALL_REDUCE, TIED_AXIS, t.info.nbytes)] += 1
        for t in self.transfers:
            row = math.prod(t.info.shape[1:]) * t.info.itemsize
            if t.k in self.gathers:
                out[(CollectiveKind.ALL_GATHER, LOCAL_AXIS, t.info.shape[0] * row)] += self.M
            for tile in self.tiles[t.k]:
                if tile.src == rank:
                    out[(CollectiveKind.SEND, PP_AXIS, (tile.hi - tile.lo) * row)] += self.M
                if tile.dst == rank:
                    out[(CollectiveKind.RECV, PP_AXIS, (tile.hi - tile.lo) * row)] += self.M
        return out


__all__ = [
    "LOCAL_AXIS",
    "PP_AXIS",
    "TIED_AXIS",
    "PlannedPipelineModule",
    "StageProgram",
    "Transfer",
    "find_transfers",
    "stage_mesh",
]
