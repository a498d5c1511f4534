"""Each rank's step as generated code: the planned graph lowered to local tensors and collectives, per phase.

The :class:`~meshpilot.runtime.interpret.Interpreter` walks the plan's nodes on DTensors, which costs
Python and DTensor dispatch for every node of every step (≈ 18 µs a node on an H100 host: the step of a
small model on one GPU). Instead, the first time a phase runs, it runs under a recorder
(:func:`meshpilot.runtime.record.record`): DTensor runs every op as usual, and the recorder writes down the
local op it runs and every functional collective its redistributions issue, with this rank's shapes,
slices and process groups as constants. The recording is an ``fx.GraphModule`` — Python code
(``program.forward_gm.code`` shows it) that later steps call directly: one op per line, no interpretation,
no DTensor, no no-op views (``runtime.fold``), no autograd (:func:`direct_ops`). The first call's own
outputs are used, so no step is spent on recording.

One class, :class:`StageProgram`, holds the programs of every stage of every plan: the SPMD step of
``parallelize`` is the one stage with no transfers (:data:`NO_LINKS`), a pipeline stage
(``runtime.pipeline_stages``) the same programs with values received at their start and sent at their end
(:class:`StageLinks`). Per kind of schedule action (``meshpilot.planner.schedule``):

* **forward** (``F``) ``(*parameter locals, *buffer locals, *inputs, *received) -> (loss, *buffer updates,
  *saved, *sent)`` runs the forward nodes of one microbatch; ``saved`` are the local tensors the backward
  reads (activations, inputs, parameters); a stage without the loss returns none, one that sends forward
  ends by resharding those values into their wire layout (``runtime.crossmesh``);
* **backward** (``B``) ``(*saved, *received) -> (*gradients, *sent)`` runs the backward nodes and returns
  each gradient as it was produced (partial sums unreduced), so microbatches' gradients add up locally;
* **input / weight** (``I`` / ``W``, zero-bubble schedules) the backward cut in two by data flow: ``I`` the
  nodes the gradients sent to the previous stage depend on, ``W`` the rest (the weight gradients);
* **gradient synchronisation** (``G``) ``(*gradients) -> (*gradients)`` reshards each into its parameter's
  layout (the plan's ``grad:`` collectives), once per step. The plan's gradient buckets
  (``StagePlan.grad_buckets``, ``runtime.buckets``) go one flat collective a bucket; where a step runs the
  backward program once (one microbatch, no ``I``/``W`` split) the backward issues them itself, each right
  after its last gradient (``runtime.overlap.issue_when_ready``), and waits for them at its end, so they run
  behind the rest of the backward and ``G`` reshards only the other gradients.

Under the plain schedules (one microbatch or accumulation) the forward and backward programs issue each
layer's sharded-parameter gathers (ZeRO-3) while the layer before it computes, waited for right before use
(``planner.prefetch``: the rule, ``runtime.overlap.prefetch``: the reordering), each layer's as one flat
all-gather where the plan groups them (``StagePlan.param_gathers``, ``runtime.overlap.group_gathers``).
With the plan's schedule given (``overlapped``), the forward and backward programs are reordered so
early-issued collectives overlap compute (``runtime.overlap``); under ``duplex`` two microbatches' programs
are interleaved into one (``forward_pair`` / ``backward_pair``, ``runtime.duplex``).

Programs are specialised to the plan, the rank and the input shapes (the caller checks the shapes).
``compile=True`` hands every program to ``torch.compile`` (``compile="cudagraphs"``: its CUDA-graph backend,
the recorded kernels replayed without Python between them). ``MESHPILOT_INTERPRET=1`` interprets every step
instead (for debugging the runtime: the same ops, without the recording).
"""

from __future__ import annotations

import contextlib
import os
import re
import types
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshpilot import compat
from meshpilot.errors import UserError
from meshpilot.graph.capture import LEAF_KINDS, NodeKind, OpGraph, Phase, dtype_from_name
from meshpilot.planner.buckets import backward_issues_buckets
from meshpilot.planner.prefetch import PREFETCHED, active_gathers, prefetch_points
from meshpilot.planner.schedule import DUPLEX, ActionKind, Schedule, stage_starts
from meshpilot.planner.stage import BOUNDARY
from meshpilot.runtime.buckets import ISSUE, BucketSync, write_into_buckets
from meshpilot.runtime.collective_log import unrecorded
from meshpilot.runtime.duplex import interleave
from meshpilot.runtime.fold import fold_views
from meshpilot.runtime.interpret import Interpreter, redistribute, wrap_local
from meshpilot.runtime.overlap import group_gathers, issue_early, issue_points, issue_when_ready, prefetch
from meshpilot.runtime.record import record, tagged
from meshpilot.runtime.untranspose import gather_untransposed
from meshpilot.sharding.placements import replicated

_INTERPRET = os.environ.get("MESHPILOT_INTERPRET") == "1"


@dataclass(frozen=True)
class StageLinks:
    """What a pipeline stage exchanges with its neighbours (``runtime.pipeline_stages``): the transfers it
    receives and sends each way, their (wire, planned) layouts by transfer number, and the boundary inputs of
    its backward that read zeros (other stages' parts of a tied weight's gradient). The SPMD step is the stage
    with none: :data:`NO_LINKS`."""

    recv_fwd: tuple = ()
    recv_bwd: tuple = ()
    send_fwd: tuple = ()
    send_bwd: tuple = ()
    wires: dict = field(default_factory=dict)
    zero_fill: tuple[str, ...] = ()


NO_LINKS = StageLinks()


class StageProgram:
    """The recorded programs of one stage of a plan on this rank (module docstring): the SPMD step is the one
    stage with no transfers; a pipeline stage receives and sends values at its programs' edges."""

    def __init__(
        self,
        interp: Interpreter,
        trainable: list[str],
        *,
        links: StageLinks = NO_LINKS,
        compile: bool | str = False,
        schedule: Schedule | None = None,
        whole: OpGraph | None = None,
    ) -> None:
        self.interp = interp
        g = self.graph = interp.graph
        self.whole = whole if whole is not None else g
        """The model's whole graph (a stage's boundary leaves that are model inputs or constants are found there)."""
        self.trainable = trainable
        self.schedule = schedule
        self.compile = compile
        self.links = links
        self.recv_fwd, self.recv_bwd = list(links.recv_fwd), list(links.recv_bwd)
        self.send_fwd, self.send_bwd = list(links.send_fwd), list(links.send_bwd)
        self.wires = links.wires
        self.late = {t.boundary: j for j, t in enumerate(self.recv_bwd)}
        self.early = {t.boundary: j for j, t in enumerate(self.recv_fwd)}
        self.zero_fill = tuple(links.zero_fill)
        # a forward value only the backward sends is kept like the backward's inputs
        self.fwd_nodes, self.bwd_nodes, self.leaves, self.saved = split_phases(
            g,
            trainable,
            late=set(self.late) | set(self.zero_fill),
            also_saved=[(t.node, t.index) for t in self.send_bwd],
        )
        self.saved_specs: list[Any] = []
        keep = {s for s, _ in self.saved} | {t.node for t in (*self.send_fwd, *self.send_bwd)}
        keep |= {s for s, _ in g.buffer_updates.values()} | {v[0] for v in g.grads.values() if v is not None}
        if g.loss is not None:
            keep.add(g.loss[0])
        self._last_use = _last_uses(self.fwd_nodes + self.bwd_nodes, keep=keep)
        self.num_model_inputs = 0
        for name in ("forward", "backward", "grad_sync", "input", "weight", "forward_pair", "backward_pair"):
            setattr(self, f"{name}_gm", None)  # the recorded program: its .code shows it
            setattr(self, f"_{name}_fn", None)  # what runs it: the program, or torch.compile's of it
        self.issued_early: dict[ActionKind, int] = {}
        """Collectives each phase's program issues ahead of their consumer (the schedule's ``+c`` actions)."""
        self.prefetched: dict[ActionKind, int] = {}
        """Parameter gathers each phase's program issues one layer ahead on their own (``planner.prefetch``)."""
        self.gather_groups: dict[ActionKind, int] = {}
        """Gather groups each phase's program runs as one flat all-gather (``StagePlan.param_gathers``)."""
        self.buckets = BucketSync(interp.plan, g, interp.mesh, trainable)
        """The plan's gradient buckets of this stage (``runtime.buckets``)."""
        self.buckets_in_backward = bool(self.buckets) and backward_issues_buckets(schedule)
        """Whether the backward program issues the buckets (one backward a step: each bucket as soon as its
        last gradient exists, waited for at the program's end); otherwise ``G`` runs them."""
        self.untransposed: dict[str, int] = {}
        """Weight gathers each program's recording took of a transpose and its direct code takes of the weight as
        stored, transposed after (``runtime.untranspose.gather_untransposed``)."""
        self.folded: dict[str, int] = {}
        """No-op views each program's recording had and its direct code does not call (``runtime.fold``)."""
        self.buckets_moved = 0
        self.buckets_written = 0
        """Gradients the backward computes into their bucket's buffer (``runtime.buckets.write_into_buckets``)."""
        """Buckets the recorded backward issues right after their last gradient (``issue_when_ready``)."""
        self._split_backward(g)

    def _split_backward(self, g: OpGraph) -> None:
        """The backward as ``I`` (the nodes the gradients sent to the previous stage need) and ``W`` (the rest:
        weight gradients), and what ``I`` hands ``W`` (values it made or received that ``W`` reads)."""
        cone = OpGraph.input_cone({n.name: n for n in self.bwd_nodes}, (t.node for t in self.send_bwd))
        self.i_nodes = [n for n in self.bwd_nodes if n.name in cone]
        self.w_nodes = [n for n in self.bwd_nodes if n.name not in cone]
        by_i = cone | set(self.late) | set(self.zero_fill)
        handoff: dict[tuple[str, int], None] = {}
        for n in self.w_nodes:
            for src, i in n.inputs:
                if src in by_i:
                    handoff.setdefault((src, i), None)
        grads = [g.grads[f] for f in self.trainable if g.grads.get(f) is not None]
        for gr in grads:
            if gr[0] in by_i:
                handoff.setdefault(gr, None)
        self.handoff = list(handoff)
        self.handoff_specs: list[Any] = []
        keep_i = {s for s, _ in self.handoff} | {t.node for t in self.send_bwd}
        self._last_use_i = _last_uses(self.i_nodes, keep=keep_i)
        self._last_use_w = _last_uses(self.w_nodes, keep={gr[0] for gr in grads})

    # ------------------------------------------------------------------ recording
    def _run(self, name: str, body, args: list, kind: ActionKind | None = None) -> Any:
        """Program `name` on `args`: recorded from `body` on the first call (``runtime.record``) — reordered for
        the schedule's early-issued collectives where `kind` has them, and compiled when asked — then called."""
        if _INTERPRET:
            return body(args)
        fn = getattr(self, f"_{name}_fn")
        boxed = name == "backward" and not self.compile
        if fn is not None:
            return fn(args) if boxed else fn(*args)
        regroup = kind is not None and self._groups_of(kind)
        rng = _rng_states()
        with unrecorded() if regroup else contextlib.nullcontext():
            gm, result = record(lambda *flat: body(flat), *args)
        setattr(self, f"{name}_gm", gm)
        self.untransposed[name] = gather_untransposed(gm)  # first: the issue points and groups move its gathers
        if kind is not None:
            self._issue_early(gm, kind)
            self._prefetch(gm, kind)
        if name == "backward" and self.buckets_in_backward:
            self.buckets_moved = issue_when_ready(gm, ISSUE)
            if not self.compile:  # an out= write into a view of a buffer: for the direct code only
                self.buckets_written = write_into_buckets(gm)
        if not self.compile:  # torch.compile folds its own; fold's detach rule holds below autograd only
            self.folded[name] = fold_views(gm)
        if boxed:
            _boxed(gm)
        fn = _maybe_compile(gm, self.compile)
        setattr(self, f"_{name}_fn", fn)
        if regroup:  # the recording gathered per edge: this step runs the grouped program, as the plan counts
            _set_rng_states(rng)  # the same dropout masks as the recording drew (CPU and every GPU)
            return fn(list(args)) if boxed else fn(*args)
        return result

    def _groups_of(self, kind: ActionKind) -> bool:
        """Whether `kind`'s program runs gather groups (``_prefetch``)."""
        if self.schedule is None or self.schedule.name not in PREFETCHED or kind not in (FWD, BWD):
            return False
        phase = "fwd" if kind == FWD else "bwd"
        return any(g.phase.value == phase for g in active_gathers(self.interp.plan))

    def _issue_early(self, gm: torch.fx.GraphModule, kind: ActionKind) -> None:
        """Reorder a phase's program so the schedule's early-issued collectives overlap compute."""
        if self.schedule is None or self.schedule.name == DUPLEX:  # duplex orders its own (forward_pair)
            return
        import torch.distributed as dist

        points = issue_points(self.schedule, self.interp.plan, kind, dist.get_rank())
        self.issued_early[kind] = issue_early(gm, points)

    def _prefetch(self, gm: torch.fx.GraphModule, kind: ActionKind) -> None:
        """Reorder a phase's program so each layer's sharded parameters are gathered while the layer before it
        computes (``planner.prefetch``), under the schedules it is priced for (``PREFETCHED``): not where the
        schedule issues collectives early itself, nor in a pipeline's stage (no schedule here: the pipeline's
        simulation does not price a prefetch)."""
        if self.schedule is None or self.schedule.name not in PREFETCHED:
            return
        plan = self.interp.plan
        phase = "fwd" if kind == FWD else "bwd"
        index = {n.name: i for i, n in enumerate(plan.nodes)}
        groups = [
            ([(index[n], a) for n, a in g.edges], index[g.issue_at] if g.issue_at else None)
            for g in active_gathers(plan)
            if g.phase.value == phase
        ]
        grouped = {e for edges, _ in groups for e in edges}
        points = {e: at for e, at in prefetch_points(plan, self.graph, phase).items() if e not in grouped}
        self.prefetched[kind] = prefetch(gm, points)
        self.gather_groups[kind] = group_gathers(gm, groups)

    # ------------------------------------------------------------------ values crossing stages
    def _received(self, t, local: torch.Tensor) -> DTensor:
        """A received value (this rank's rows in the wire layout) in the layout this stage planned for it."""
        wire, planned = self.wires[t.k]
        meta = torch.empty(t.info.shape, dtype=dtype_from_name(t.info.dtype), device="meta")
        return redistribute(wrap_local(local, self.interp.mesh, wire, meta), planned)

    def _outgoing(self, t, env: dict) -> torch.Tensor:
        wire, _ = self.wires[t.k]
        v = env[t.node][t.index]
        return redistribute(v, wire).to_local().contiguous()

    # ------------------------------------------------------------------ forward
    def forward(self, params: list, buffers: list, inputs: list, received: Sequence = ()) -> tuple:
        """(loss or None, buffer updates, saved, values to send forward) as local tensors."""
        self.num_model_inputs = len(inputs)
        result = list(self._run("forward", self._forward_body, [*params, *buffers, *inputs, *received], FWD))
        loss = result.pop(0) if self.graph.loss is not None else None
        n_up, n_saved = len(self.graph.buffer_updates), len(self.saved)
        return loss, result[:n_up], result[n_up : n_up + n_saved], result[n_up + n_saved :]

    def _forward_body(self, flat) -> tuple:
        g, interp = self.graph, self.interp
        n_p, n_b, n_i = len(g.param_names), len(g.buffer_names), self.num_model_inputs
        params = dict(zip(g.param_names, flat[:n_p]))
        buffers = dict(zip(g.buffer_names, flat[n_p : n_p + n_b]))
        inputs = flat[n_p + n_b : n_p + n_b + n_i]
        received = flat[n_p + n_b + n_i :]
        env: dict[str, tuple] = {}
        with torch.no_grad(), compat.no_transform_optimization():
            for leaf in self.leaves:
                with tagged((leaf.index, -1)):
                    env[leaf.name] = (self._leaf(leaf, params, buffers, inputs, received),)
            interp.run(self.fwd_nodes, env, self._last_use)
            out = []
            if g.loss is not None:
                ln, li = g.loss
                out.append(redistribute(env[ln][li], replicated(interp.mesh.ndim)).to_local())
            out += [
                redistribute(env[s][i], replicated(interp.mesh.ndim)).to_local() for s, i in g.buffer_updates.values()
            ]
            saved = [env[s][i] for s, i in self.saved]
            self.saved_specs = [v._spec if isinstance(v, DTensor) else None for v in saved]
            out += [v._local_tensor if isinstance(v, DTensor) else v for v in saved]
            out += [self._outgoing(t, env) for t in self.send_fwd]
        return tuple(out)

    def _leaf(self, leaf, params: dict, buffers: dict, inputs, received) -> Any:
        interp, g = self.interp, self.graph
        if leaf.kind == NodeKind.PARAM:
            # the layout the readers read: the stored one, or a ZeRO-2 weight's full copy (``runtime.spmd``)
            return wrap_local(params[leaf.fqn], interp.mesh, interp.plan.node(leaf.name).out_placements(0), _val(leaf))
        if leaf.kind == NodeKind.BUFFER:
            return interp.leaf(leaf, buffers[leaf.fqn])
        if leaf.kind == NodeKind.CONST:
            return interp.leaf(leaf, g.consts[leaf.name])
        j = self.early.get(leaf.name)
        if j is not None:
            return self._received(self.recv_fwd[j], received[j])
        if leaf.name.startswith(BOUNDARY + ":"):  # a model input or constant another stage reads first
            src = self.whole[leaf.name[len(BOUNDARY) + 1 :].rpartition(":")[0]]
            value = inputs[int(src.fqn.split(":")[1])] if src.kind == NodeKind.INPUT else self.whole.consts[src.name]
            return interp.leaf(leaf, value)
        return interp.leaf(leaf, inputs[int(leaf.fqn.split(":")[1])])

    # ------------------------------------------------------------------ backward
    def backward(self, saved: list, received: Sequence = ()) -> tuple[list, list]:
        """(this rank's piece of each trainable parameter's gradient, in the layout the backward produced it —
        partial sums unreduced: :meth:`grad_sync` does that once per step — or None; values to send backward)."""
        args = [*saved, *received]
        if isinstance(saved, list):  # the caller's last reference (``StepRun`` pops it): freed as the program goes
            saved.clear()
        it = iter(self._run("backward", self._backward_body, args, BWD))
        return self._grads_of(it), list(it)

    def _grads_of(self, it) -> list:
        return [next(it) if self.graph.grads.get(fqn) is not None else None for fqn in self.trainable]

    def _backward_env(self, flat) -> dict[str, tuple]:
        """The backward's starting values: what the forward kept, then the gradients received (``B`` and ``I``)."""
        n_saved = len(self.saved)
        env = self._env(self.saved, self.saved_specs, flat[:n_saved])
        for t, local in zip(self.recv_bwd, flat[n_saved:]):
            env.setdefault(t.boundary, {})[0] = self._received(t, local)
        for name in self.zero_fill:
            leaf = self.graph[name]
            zeros = torch.zeros(leaf.out.shape, dtype=dtype_from_name(leaf.out.dtype), device=self.interp.device)
            env[name] = {0: self.interp.leaf(leaf, zeros)}
        return {k: _as_tuple(v) for k, v in env.items()}

    def _grads_out(self, env: dict) -> list:
        """This rank's part of each trainable parameter's gradient the stage computes (local tensors)."""
        out = []
        for fqn in self.trainable:
            gr = self.graph.grads.get(fqn)
            if gr is not None:
                v = env[gr[0]][gr[1]]
                out.append(v._local_tensor if isinstance(v, DTensor) else v)
        return out

    def _backward_body(self, flat) -> tuple:
        with torch.no_grad(), compat.no_transform_optimization():
            env = self._backward_env(flat)
            self.interp.run(self.bwd_nodes, env, self._last_use)
            grads = self._grads_out(env)
            if self.buckets_in_backward:
                grads = self._bucketed(grads)
            return tuple(grads + [self._outgoing(t, env) for t in self.send_bwd])

    def _bucketed(self, grads: list) -> list:
        """The backward's local gradients (the present ones, in `trainable` order) with every bucket's
        synchronised into its parameters' layouts (``runtime.buckets``)."""
        present = [f for f in self.trainable if self.graph.grads.get(f) is not None]
        synced = self.buckets.run(dict(zip(present, grads)))
        return [synced.get(f, x) for f, x in zip(present, grads)]

    # ------------------------------------------------------------------ backward split: I then W (zero bubble)
    @staticmethod
    def _env(pairs, specs, locals_) -> dict[str, Any]:
        env: dict[str, Any] = {}
        for (s, i), spec, local in zip(pairs, specs, locals_):
            env.setdefault(s, {})[i] = DTensor(local, spec, requires_grad=False) if spec is not None else local
        return env

    def backward_input(self, saved: list, received: Sequence) -> tuple[list, list]:
        """``I``: (values to send backward, what ``W`` reads of this microbatch) as local tensors."""
        result = list(self._run("input", self._input_body, [*saved, *received]))
        n_out = len(self.send_bwd)
        return result[:n_out], result[n_out:]

    def _input_body(self, flat) -> tuple:
        with torch.no_grad(), compat.no_transform_optimization():
            env = self._backward_env(flat)
            self.interp.run(self.i_nodes, env, self._last_use_i)
            out = [self._outgoing(t, env) for t in self.send_bwd]
            kept = [env[s][i] for s, i in self.handoff]
            self.handoff_specs = [v._spec if isinstance(v, DTensor) else None for v in kept]
            out += [v._local_tensor if isinstance(v, DTensor) else v for v in kept]
        return tuple(out)

    def backward_weight(self, saved: list, handed: list) -> list:
        """``W``: this rank's part of each trainable parameter's gradient (None: no gradient)."""
        return self._grads_of(iter(self._run("weight", self._weight_body, [*saved, *handed])))

    def _weight_body(self, flat) -> tuple:
        n_saved = len(self.saved)
        with torch.no_grad(), compat.no_transform_optimization():
            env = self._env(self.saved, self.saved_specs, flat[:n_saved])
            for k, v in self._env(self.handoff, self.handoff_specs, flat[n_saved:]).items():
                env.setdefault(k, {}).update(v)
            env = {k: _as_tuple(v) for k, v in env.items()}
            self.interp.run(self.w_nodes, env, self._last_use_w)
            return tuple(self._grads_out(env))

    # ------------------------------------------------------------------ duplex: two microbatches in one program
    def has_pair(self, kind: ActionKind) -> bool:
        """Whether phase `kind` is recorded, so its two-microbatch program can be built (the first step runs
        the microbatches one after the other)."""
        return not _INTERPRET and (self.forward_gm if kind == FWD else self.backward_gm) is not None

    def _starts(self, kind: ActionKind) -> list[int]:
        import torch.distributed as dist

        return stage_starts(self.schedule.actions(dist.get_rank()), kind) if self.schedule is not None else []

    def forward_pair(self, params: list, buffers: list, inputs0: list, inputs1: list):
        """:meth:`forward` of two microbatches as one interleaved program (``meshpilot.runtime.duplex``);
        microbatch 1 reads the buffers microbatch 0 updated. Returns both microbatches' results."""
        if self._forward_pair_fn is None:
            n_p, n_b = len(params), len(buffers)
            names = self.graph.buffer_names
            chain = {n_p + names.index(fqn): 1 + k for k, fqn in enumerate(self.graph.buffer_updates)}
            leaves = {leaf.index for leaf in self.leaves}
            self.forward_pair_gm = interleave(self.forward_gm, self._starts(FWD), leaves, shared=n_p + n_b, chain=chain)
            self._forward_pair_fn = _maybe_compile(self.forward_pair_gm, self.compile)
        result = self._forward_pair_fn(*params, *buffers, *inputs0, *inputs1)
        half = len(result) // 2
        n_up = len(self.graph.buffer_updates)
        return [(r[0], list(r[1 : 1 + n_up]), list(r[1 + n_up :])) for r in (result[:half], result[half:])]

    def backward_pair(self, saved0: list, saved1: list) -> tuple[list, list]:
        """:meth:`backward` of two microbatches as one interleaved program: both microbatches' gradients."""
        if self._backward_pair_fn is None:
            leaves = {leaf.index for leaf in self.leaves}
            self.backward_pair_gm = interleave(self.backward_gm, self._starts(BWD), leaves)
            self._backward_pair_fn = _maybe_compile(self.backward_pair_gm, self.compile)
        result = self._backward_pair_fn(*saved0, *saved1)
        half = len(result) // 2
        return self._grads_of(iter(result[:half])), self._grads_of(iter(result[half:]))

    # ------------------------------------------------------------------ gradient synchronisation
    def grad_sync(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each gradient (as the backward left it, summed over microbatches) resharded into its parameter's
        layout: the plan's ``grad:`` collectives, once per step."""
        it = iter(self._run("grad_sync", self._grad_sync_body, [x for x in grads if x is not None]))
        return [next(it) if x is not None else None for x in grads]

    def _grad_sync_body(self, flat) -> tuple:
        done = self.buckets.params if self.buckets_in_backward else frozenset()
        return synced_grads(self.graph, self.interp, self.trainable, flat, buckets=self.buckets, done=done)


FWD, BWD = ActionKind.FORWARD, ActionKind.BACKWARD


def split_phases(
    graph: OpGraph,
    trainable: list[str],
    *,
    late: set[str] = frozenset(),
    also_saved: Iterable[tuple[str, int]] = (),
) -> tuple[list, list, list, list[tuple[str, int]]]:
    """A step's forward nodes, backward nodes, leaves (less the `late` ones: a pipeline stage's gradients
    received for its backward) and, in order, the forward values the backward reads: its operands made in
    the forward or by a leaf, then those of `also_saved` made there (a stage's values only the backward
    sends), then a trainable parameter's gradient the forward already holds (a parameter used as-is). One
    split for the SPMD step's program and a pipeline stage's."""
    fwd = [n for n in graph.nodes if n.kind not in LEAF_KINDS and n.phase == Phase.FWD]
    bwd = [n for n in graph.nodes if n.kind not in LEAF_KINDS and n.phase == Phase.BWD]
    leaves = [n for n in graph.nodes if n.kind in LEAF_KINDS and n.name not in late]
    fwd_names = {n.name for n in fwd} | {n.name for n in leaves}
    saved: dict[tuple[str, int], None] = {}
    for n in bwd:
        for src, i in n.inputs:
            if src in fwd_names:
                saved.setdefault((src, i), None)
    for src, i in also_saved:
        if src in fwd_names:
            saved.setdefault((src, i), None)
    for fqn in trainable:
        g = graph.grads.get(fqn)
        if g is not None and g[0] in fwd_names:
            saved.setdefault(g, None)
    return fwd, bwd, leaves, list(saved)


def synced_grads(
    graph: OpGraph,
    interp: Interpreter,
    trainable,
    flat,
    *,
    buckets: BucketSync | None = None,
    done: Collection[str] = frozenset(),
) -> tuple:
    """The gradients `flat` (the present ones of `trainable`'s, as the backward left them) resharded into
    their parameters' layouts: the body of a gradient-synchronisation program (this module's and a
    pipeline stage's). Those of `done` are already (the backward synchronised their buckets); those of
    `buckets` otherwise go by bucket (``runtime.buckets``), the rest one by one."""
    plan = interp.plan
    present = [f for f in trainable if graph.grads.get(f) is not None]
    local = dict(zip(present, flat))
    with torch.no_grad(), compat.no_transform_optimization():
        by_bucket = buckets.run(local) if buckets and not set(buckets.params) <= set(done) else {}
        out = []
        for fqn in present:
            if fqn in done or fqn in by_bucket:
                out.append(local[fqn] if fqn in done else by_bucket[fqn])
                continue
            g = graph.grads[fqn]
            held = plan.node(g[0]).out_placements(g[1])
            value = wrap_local(local[fqn], interp.mesh, held, graph[g[0]].fx_node.meta["val"])
            out.append(redistribute(value, plan.param_layout(fqn)).to_local())
    return tuple(out)


def _val(node) -> torch.Tensor:
    return node.fx_node.meta["val"]


def _as_tuple(outputs: dict[int, Any]) -> tuple:
    """A node's saved outputs by index as the tuple the interpreter reads (unsaved outputs: None)."""
    return tuple(outputs.get(i) for i in range(max(outputs) + 1))


def _last_uses(nodes, keep: set[str]) -> dict[str, int]:
    last: dict[str, int] = {}
    for n in nodes:
        for s, _ in n.inputs:
            last[s] = max(last.get(s, -1), n.index)
    big = 1 << 62
    for k in keep:
        last[k] = big
    return last


def _boxed(gm: torch.fx.GraphModule) -> None:
    """Make `gm` take its inputs as one list that it empties (torch.fx's boxed calling convention): each
    saved activation is then freed after its last use in the backward, as the plan's accounting has it, instead
    of living until the program returns."""
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()


def _rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The CPU generator's state and, where CUDA is in use, every GPU's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def _set_rng_states(states: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    """Put back what :func:`_rng_states` read."""
    cpu, cuda = states
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


_OP_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
"""A call of an op by its dotted path, as torch.fx's code generator writes one (``torch.ops.aten.mm.default(``)."""


def direct_ops(gm: torch.fx.GraphModule) -> Callable:
    """`gm`'s generated code with each operator called through its C++ entry (``OpOverload._op``, bound once as a
    global of the code), bound to `gm` (its constants): what ``gm(...)`` computes, op for op.

    torch.fx writes every op as ``torch.ops.<namespace>.<op>.<overload>(…)``: four attribute look-ups, then
    ``OpOverload.__call__``'s Python frame, whose whole body is ``self._op(*args, **kwargs)``. That is 2.6 µs of
    the call where the bound entry takes 2.0 (one process, a small ``view``), and a recorded step makes one call
    per op — 480 for a small GPT's forward and backward on one device, 930 for a Llama's. Anything not an
    ``OpOverload`` at that path (a higher-order operator) is left as written.

    The code runs below autograd (``torch._C._AutoDispatchBelowAutograd``): a program is recorded under
    ``no_grad`` and its caller (``runtime.spmd._Step``, a pipeline's actions) is autograd's node for it, so no op in
    it builds a graph, and the autograd layer of each call is skipped — for aten ops a check, for custom ops
    (``meshpilot::sdpa``) and functional collectives torch.library's Python ``autograd_impl`` (17–22 µs a call
    here: docs/benchmarks.md, dp30e). Its ``detach`` calls are no-ops there (``runtime.fold``)."""
    code = gm.code  # first: a lazy graph module generates its code here
    fn = gm.forward
    scope = dict(fn.__globals__)
    bound: dict[str, str] = {}

    def bind(m: re.Match) -> str:
        path = m.group(0)
        if path not in bound:
            op = getattr(getattr(getattr(torch.ops, m.group(1)), m.group(2)), m.group(3), None)
            if not isinstance(op, torch._ops.OpOverload):
                bound[path] = path
            else:
                bound[path] = f"_op_{len(scope)}("
                scope[bound[path][:-1]] = op._op
        return bound[path]

    src = _OP_CALL.sub(bind, code)
    exec(compile(src, f"<meshpilot program {fn.__code__.co_filename}>", "exec"), scope)  # noqa: S102 - fx's own code
    forward = types.MethodType(scope["forward"], gm)
    below = torch._C._AutoDispatchBelowAutograd

    def run(*args):
        with below():
            return forward(*args)

    return run


def _maybe_compile(gm: torch.fx.GraphModule, compile: bool | str):
    """`gm`, or `gm` through ``torch.compile`` with the backend `compile` names (``True``: inductor;
    ``"cudagraphs"``: the same kernels replayed as CUDA graphs, no Python between them)."""
    if not compile:
        return direct_ops(gm)
    try:
        return torch.compile(gm, dynamic=False, backend=compile if isinstance(compile, str) else "inductor")
    except Exception as e:  # noqa: BLE001 - compile is an option: say why it is off
        raise UserError(f"compile=True: torch.compile could not take the program ({type(e).__name__}: {e})") from None
