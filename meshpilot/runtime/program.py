"""Each rank's step as generated code: the planned graph lowered to local tensors and collectives, per phase.

The :class:`~meshpilot.runtime.interpret.Interpreter` walks the plan's nodes on DTensors, which costs
Python and DTensor dispatch for every node of every step (≈ 18 µs a node on an H100 host: the step of a
small model on one GPU). Instead, the first time a phase runs, it runs under a recorder
(:func:`meshpilot.runtime.record.record`): DTensor runs every op as usual, and the recorder writes down the
local op it runs and every functional collective its redistributions issue, with this rank's shapes,
slices and process groups as constants. The recording is an ``fx.GraphModule`` — Python code
(``program.forward_gm.code`` shows it) that later steps call directly: one op per line, no interpretation,
no DTensor. The first call's own outputs are used, so no step is spent on recording.

A step is three programs, one per kind of schedule action (``meshpilot.planner.schedule``):

* **forward** (``F``) ``(*parameter locals, *buffer locals, *inputs) -> (loss, *buffer updates, *saved)`` runs
  the forward nodes of one microbatch; ``saved`` are the local tensors the backward reads (activations,
  inputs, parameters);
* **backward** (``B``) ``(*saved) -> (*gradients)`` runs the backward nodes and returns each gradient as it
  was produced (partial sums unreduced), so microbatches' gradients add up locally;
* **gradient synchronisation** (``G``) ``(*gradients) -> (*gradients)`` reshards each into its parameter's
  layout (the plan's ``grad:`` collectives), once per step.

Programs are specialised to the plan, the rank and the input shapes (the caller checks the shapes).
``compile=True`` hands both programs to ``torch.compile`` (``compile="cudagraphs"``: its CUDA-graph backend,
the recorded kernels replayed without Python between them). ``MESHPILOT_INTERPRET=1`` interprets every step
instead (for debugging the runtime: the same ops, without the recording).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshpilot import compat
from meshpilot.errors import UserError
from meshpilot.graph.capture import LEAF_KINDS, NodeKind, OpGraph, Phase
from meshpilot.planner.schedule import DUPLEX, ActionKind, Schedule, stage_starts
from meshpilot.runtime.duplex import interleave
from meshpilot.runtime.interpret import Interpreter, redistribute, wrap_local
from meshpilot.runtime.overlap import issue_early, issue_points
from meshpilot.runtime.record import record, tagged
from meshpilot.sharding.placements import replicated

_INTERPRET = os.environ.get("MESHPILOT_INTERPRET") == "1"


@dataclass(frozen=True)
class Saved:
    """One value the backward reads: the producing node's output and the layout it is held in."""

    node: str
    index: int


class StepProgram:
    """The forward and backward programs of one plan on one rank (module docstring)."""

    def __init__(
        self,
        interp: Interpreter,
        trainable: list[str],
        *,
        compile: bool | str = False,
        schedule: Schedule | None = None,
    ) -> None:
        self.interp = interp
        self.schedule = schedule
        self.graph: OpGraph = interp.graph
        self.trainable = trainable
        self.compile = compile
        self.fwd_nodes, self.bwd_nodes, self.leaves, saved = split_phases(self.graph, trainable)
        self.saved = [Saved(s, i) for s, i in saved]
        self.saved_specs: list[Any] = []
        self._last_use = _last_uses(self.fwd_nodes + self.bwd_nodes, keep=self._kept())
        self.forward_gm: torch.fx.GraphModule | None = None
        self.backward_gm: torch.fx.GraphModule | None = None
        self.grad_sync_gm: torch.fx.GraphModule | None = None
        self._forward_fn = None
        self._backward_fn = None
        self._grad_sync_fn = None
        self.forward_pair_gm: torch.fx.GraphModule | None = None
        self.backward_pair_gm: torch.fx.GraphModule | None = None
        self._forward_pair_fn = None
        self._backward_pair_fn = None
        self.issued_early: dict[ActionKind, int] = {}
        """Collectives each phase's program issues ahead of their consumer (the schedule's ``+c`` actions)."""

    def _issue_early(self, gm: torch.fx.GraphModule, kind: ActionKind) -> None:
        """Reorder a phase's program so the schedule's early-issued collectives overlap compute."""
        if self.schedule is None or self.schedule.name == DUPLEX:  # duplex orders its own (forward_pair)
            return
        import torch.distributed as dist

        points = issue_points(self.schedule, self.interp.plan, kind, dist.get_rank())
        self.issued_early[kind] = issue_early(gm, points)

    def _kept(self) -> set[str]:
        g = self.graph
        keep = {g.loss[0]} | {s for s, _ in g.buffer_updates.values()} | {s.node for s in self.saved}
        keep |= {v[0] for v in g.grads.values() if v is not None}
        return keep

    # ------------------------------------------------------------------ forward
    def forward(self, params: list[torch.Tensor], buffers: list[torch.Tensor], inputs: list[torch.Tensor]):
        """(loss, buffer updates, saved) as local tensors; records the program on the first call."""
        args = [*params, *buffers, *inputs]
        if _INTERPRET:
            result = self._forward_body(args)
        elif self._forward_fn is None:
            self.forward_gm, result = record(lambda *flat: self._forward_body(flat), *args)
            self._issue_early(self.forward_gm, ActionKind.FORWARD)
            self._forward_fn = _maybe_compile(self.forward_gm, self.compile)
        else:
            result = self._forward_fn(*args)
        n_up = len(self.graph.buffer_updates)
        return result[0], list(result[1 : 1 + n_up]), list(result[1 + n_up :])

    def _forward_body(self, flat) -> tuple:
        graph, interp = self.graph, self.interp
        n_p = len(graph.param_names)
        n_b = len(graph.buffer_names)
        params = dict(zip(graph.param_names, flat[:n_p]))
        buffers = dict(zip(graph.buffer_names, flat[n_p : n_p + n_b]))
        inputs = flat[n_p + n_b :]
        env: dict[str, tuple] = {}
        with torch.no_grad(), compat.no_transform_optimization():
            for leaf in self.leaves:
                with tagged((leaf.index, -1)):
                    env[leaf.name] = (self._leaf_value(leaf, params, buffers, inputs),)
            interp.run(self.fwd_nodes, env, self._last_use)

            ln, li = graph.loss
            loss = redistribute(env[ln][li], replicated(interp.mesh.ndim)).to_local()
            updates = [
                redistribute(env[s][i], replicated(interp.mesh.ndim)).to_local()
                for s, i in graph.buffer_updates.values()
            ]
            saved = [env[s.node][s.index] for s in self.saved]
            self.saved_specs = [v._spec if isinstance(v, DTensor) else None for v in saved]
            locals_ = [v._local_tensor if isinstance(v, DTensor) else v for v in saved]
        return (loss, *updates, *locals_)

    def _leaf_value(self, leaf, params: dict, buffers: dict, inputs) -> Any:
        interp = self.interp
        if leaf.kind == NodeKind.PARAM:
            return wrap_local(params[leaf.fqn], interp.mesh, self._param_layout(leaf.fqn), _val(leaf))
        if leaf.kind == NodeKind.BUFFER:
            return interp.leaf(leaf, buffers[leaf.fqn])
        if leaf.kind == NodeKind.INPUT:
            return interp.leaf(leaf, inputs[int(leaf.fqn.split(":")[1])])
        return interp.leaf(leaf, self.graph.consts[leaf.name])

    # ------------------------------------------------------------------ backward
    def backward(self, saved: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's piece of each trainable parameter's gradient, in the layout the backward produced it
        (partial sums not yet reduced: :meth:`grad_sync` does that, once per step); None: no gradient."""
        if _INTERPRET:
            result = self._backward_body(saved)
        elif self._backward_fn is None:
            self.backward_gm, result = record(lambda *flat: self._backward_body(flat), *saved)
            self._issue_early(self.backward_gm, ActionKind.BACKWARD)
            self._backward_fn = _maybe_compile(self.backward_gm, self.compile)
        else:
            result = self._backward_fn(*saved)
        it = iter(result)
        return [next(it) if self.graph.grads.get(fqn) is not None else None for fqn in self.trainable]

    def _backward_body(self, flat) -> tuple:
        graph, interp = self.graph, self.interp
        env: dict[str, tuple] = {}
        with torch.no_grad(), compat.no_transform_optimization():
            for s, spec, local in zip(self.saved, self.saved_specs, flat):
                value = DTensor(local, spec, requires_grad=False) if spec is not None else local
                env.setdefault(s.node, {})[s.index] = value  # type: ignore[index]
            env = {k: _as_tuple(v) for k, v in env.items()}
            interp.run(self.bwd_nodes, env, self._last_use)
            grads = []
            for fqn in self.trainable:
                g = graph.grads.get(fqn)
                if g is not None:
                    value = env[g[0]][g[1]]
                    grads.append(value._local_tensor if isinstance(value, DTensor) else value)
        return tuple(grads)

    # ------------------------------------------------------------------ duplex: two microbatches in one program
    def has_pair(self, kind: ActionKind) -> bool:
        """Whether phase `kind` is recorded, so its two-microbatch program can be built (the first step runs
        the microbatches one after the other)."""
        return not _INTERPRET and (self.forward_gm if kind == ActionKind.FORWARD else self.backward_gm) is not None

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
            self.forward_pair_gm = interleave(
                self.forward_gm, self._starts(ActionKind.FORWARD), leaves, shared=n_p + n_b, chain=chain
            )
            self._forward_pair_fn = _maybe_compile(self.forward_pair_gm, self.compile)
        result = self._forward_pair_fn(*params, *buffers, *inputs0, *inputs1)
        half = len(result) // 2
        n_up = len(self.graph.buffer_updates)
        return [(r[0], list(r[1 : 1 + n_up]), list(r[1 + n_up :])) for r in (result[:half], result[half:])]

    def backward_pair(self, saved0: list, saved1: list) -> tuple[list, list]:
        """:meth:`backward` of two microbatches as one interleaved program: both microbatches' gradients."""
        if self._backward_pair_fn is None:
            leaves = {leaf.index for leaf in self.leaves}
            self.backward_pair_gm = interleave(self.backward_gm, self._starts(ActionKind.BACKWARD), leaves)
            self._backward_pair_fn = _maybe_compile(self.backward_pair_gm, self.compile)
        result = self._backward_pair_fn(*saved0, *saved1)
        half = len(result) // 2
        out = []
        for r in (result[:half], result[half:]):
            it = iter(r)
            out.append([next(it) if self.graph.grads.get(fqn) is not None else None for fqn in self.trainable])
        return out[0], out[1]

    # ------------------------------------------------------------------ gradient synchronisation
    def grad_sync(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each gradient (as :meth:`backward` left it, summed over microbatches) resharded into its
        parameter's layout: the plan's ``grad:`` collectives, once per step."""
        present = [g for g in grads if g is not None]
        if _INTERPRET:
            result = self._grad_sync_body(present)
        elif self._grad_sync_fn is None:
            self.grad_sync_gm, result = record(lambda *flat: self._grad_sync_body(flat), *present)
            self._grad_sync_fn = _maybe_compile(self.grad_sync_gm, self.compile)
        else:
            result = self._grad_sync_fn(*present)
        it = iter(result)
        return [next(it) if g is not None else None for g in grads]

    def _grad_sync_body(self, flat) -> tuple:
        return synced_grads(self.graph, self.interp, self.trainable, flat)

    def _param_layout(self, fqn: str):
        return self.interp.plan.param_layout(fqn)


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


def synced_grads(graph: OpGraph, interp: Interpreter, trainable, flat) -> tuple:
    """The gradients `flat` (the present ones of `trainable`'s, as the backward left them) resharded into
    their parameters' layouts: the body of a gradient-synchronisation program (this module's and a
    pipeline stage's)."""
    plan = interp.plan
    out = []
    with torch.no_grad(), compat.no_transform_optimization():
        it = iter(flat)
        for fqn in trainable:
            g = graph.grads.get(fqn)
            if g is None:
                continue
            held = plan.node(g[0]).out_placements(g[1])
            value = wrap_local(next(it), interp.mesh, held, graph[g[0]].fx_node.meta["val"])
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


def _maybe_compile(gm: torch.fx.GraphModule, compile: bool | str):
    """`gm`, or `gm` through ``torch.compile`` with the backend `compile` names (``True``: inductor;
    ``"cudagraphs"``: the same kernels replayed as CUDA graphs, no Python between them)."""
    if not compile:
        return gm
    try:
        return torch.compile(gm, dynamic=False, backend=compile if isinstance(compile, str) else "inductor")
    except Exception as e:  # noqa: BLE001 - compile is an option: say why it is off
        raise UserError(f"compile=True: torch.compile could not take the program ({type(e).__name__}: {e})") from None
