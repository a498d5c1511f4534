"""Each rank's step as generated code: the planned graph lowered to local tensors and collectives, per phase.

The :class:`~meshpilot.runtime.interpret.Interpreter` walks the plan's nodes on DTensors, which costs
Python and DTensor dispatch for every node of every step (≈ 18 µs a node on an H100 host: the step of a
small model on one GPU). Instead, the first time a phase runs, it runs under a recorder
(:func:`meshpilot.runtime.record.record`): DTensor runs every op as usual, and the recorder writes down the
local op it runs and every functional collective its redistributions issue, with this rank's shapes,
slices and process groups as constants. The recording is an ``fx.GraphModule`` — Python code
(``program.forward_gm.code`` shows it) that later steps call directly: one op per line, no interpretation,
no DTensor. The first call's own outputs are used, so no step is spent on recording.

A step is two programs:

* **forward** ``(*parameter locals, *buffer locals, *inputs) -> (loss, *buffer updates, *saved)`` runs the
  forward nodes; ``saved`` are the local tensors the backward reads (activations, inputs, parameters);
* **backward** ``(*saved) -> (*gradients)`` runs the backward nodes and reshards each gradient into its
  parameter's layout.

Programs are specialised to the plan, the rank and the input shapes (the caller checks the shapes).
``compile=True`` hands both programs to ``torch.compile``. ``MESHPILOT_INTERPRET=1`` interprets every step
instead (for debugging the runtime: the same ops, without the recording).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshpilot import compat
from meshpilot.errors import UserError
from meshpilot.graph.capture import LEAF_KINDS, NodeKind, OpGraph, Phase
from meshpilot.runtime.interpret import Interpreter, redistribute, wrap_local
from meshpilot.runtime.record import record
from meshpilot.sharding.placements import replicated

_INTERPRET = os.environ.get("MESHPILOT_INTERPRET") == "1"


@dataclass(frozen=True)
class Saved:
    """One value the backward reads: the producing node's output and the layout it is held in."""

    node: str
    index: int


class StepProgram:
    """The forward and backward programs of one plan on one rank (module docstring)."""

    def __init__(self, interp: Interpreter, trainable: list[str], *, compile: bool = False) -> None:
        self.interp = interp
        self.graph: OpGraph = interp.graph
        self.trainable = trainable
        self.compile = compile
        graph = self.graph
        self.fwd_nodes = [n for n in graph.nodes if n.kind not in LEAF_KINDS and n.phase == Phase.FWD]
        self.bwd_nodes = [n for n in graph.nodes if n.kind not in LEAF_KINDS and n.phase == Phase.BWD]
        self.leaves = [n for n in graph.nodes if n.kind in LEAF_KINDS]
        fwd_names = {n.name for n in self.fwd_nodes} | {n.name for n in self.leaves}
        saved: dict[tuple[str, int], None] = {}
        for n in self.bwd_nodes:
            for src, i in n.inputs:
                if src in fwd_names:
                    saved.setdefault((src, i), None)
        for fqn in trainable:  # a gradient the forward already holds (e.g. a parameter used as-is)
            g = graph.grads.get(fqn)
            if g is not None and g[0] in fwd_names:
                saved.setdefault(g, None)
        self.saved = [Saved(s, i) for s, i in saved]
        self.saved_specs: list[Any] = []
        self._last_use = _last_uses(self.fwd_nodes + self.bwd_nodes, keep=self._kept())
        self.forward_gm: torch.fx.GraphModule | None = None
        self.backward_gm: torch.fx.GraphModule | None = None
        self._forward_fn = None
        self._backward_fn = None

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
                if leaf.kind == NodeKind.PARAM:
                    value = wrap_local(params[leaf.fqn], interp.mesh, self._param_layout(leaf.fqn), _val(leaf))
                elif leaf.kind == NodeKind.BUFFER:
                    value = interp.leaf(leaf, buffers[leaf.fqn])
                elif leaf.kind == NodeKind.INPUT:
                    value = interp.leaf(leaf, inputs[int(leaf.fqn.split(":")[1])])
                else:
                    value = interp.leaf(leaf, graph.consts[leaf.name])
                env[leaf.name] = (value,)
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

    # ------------------------------------------------------------------ backward
    def backward(self, saved: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Local gradients of the trainable parameters in their layouts (None: no gradient)."""
        if _INTERPRET:
            result = self._backward_body(saved)
        elif self._backward_fn is None:
            self.backward_gm, result = record(lambda *flat: self._backward_body(flat), *saved)
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
                    grads.append(redistribute(env[g[0]][g[1]], self._param_layout(fqn)).to_local())
        return tuple(grads)

    def _param_layout(self, fqn: str):
        return self.interp.plan.param_layout(fqn)


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


def _maybe_compile(gm: torch.fx.GraphModule, compile: bool):
    if not compile:
        return gm
    try:
        return torch.compile(gm, dynamic=False)
    except Exception as e:  # noqa: BLE001 - compile is an option: say why it is off
        raise UserError(f"compile=True: torch.compile could not take the program ({type(e).__name__}: {e})") from None
