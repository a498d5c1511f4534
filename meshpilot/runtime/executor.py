"""One loop over a schedule's actions, for every plan: the SPMD step and every pipeline stage.

As torch's ``_PipelineScheduleRuntime._step_microbatches`` does, :class:`StepRun` runs this rank's actions of a
:class:`~meshpilot.planner.schedule.Schedule` in order, dispatching on each action's kind, whatever the
schedule (trivial, accumulate, overlapped, duplex, GPipe, 1F1B, ZB-H1, Interleaved1F1B) and whatever the
plan (one stage or a pipeline). It talks to a stage only through its
:class:`~meshpilot.runtime.program.StageProgram` — ``forward``, ``backward``, ``backward_input``,
``backward_weight``, ``grad_sync`` and the duplex pairs — and to the other stages through one `exchange`
callable (``S`` / ``R``: the pipeline's tiles, ``runtime.pipeline_stages``); a one-stage plan has none.

``F m``   stage s's forward on microbatch m of the global batch (dim 0 cut into M) and the values received for
          it; its buffer updates written back, its loss kept, what the backward reads kept, what it sends
          handed to the next ``S``
``B m``   the backward on what the forward kept and the gradients received; the gradients, scaled by 1/M,
          added to the stage's; ``I m`` / ``W m`` its two halves (zero bubble: ``I`` hands ``W`` its values)
``S`` / ``R``  `exchange` (sends are waited at the step's end: :meth:`StepRun.wait`)
``G``     every stage's gradients resharded into their parameters' layouts (:attr:`StepRun.synced`)

Issue and wait actions (``+c`` / ``-c``) are not run: they place collectives inside the recorded programs
(``runtime.overlap``), and a phase cut into node ranges is one program run. A phase whose ranges alternate
between two microbatches (``duplex``) runs as one program holding both (``runtime.duplex``); the first step
records the one-microbatch programs, running the microbatches one after the other.

The loss is the mean of the microbatches' losses and each microbatch's gradients are scaled by 1/M, so with
equal microbatches and a loss that averages over its batch the step equals the full-batch step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshpilot.errors import UserError
from meshpilot.graph.capture import Phase
from meshpilot.planner.schedule import Action, ActionKind, Schedule, interleaved
from meshpilot.runtime.collective_log import phase_scope
from meshpilot.runtime.program import StageProgram

_SKIPPED = frozenset({ActionKind.ISSUE, ActionKind.WAIT})


def executed_actions(schedule: Schedule, rank: int) -> tuple[list[Action], frozenset[ActionKind]]:
    """This rank's actions as the executor runs them — issue / wait left out, a phase's consecutive node ranges
    one action, a duplex phase one action of microbatch 0 — and the kinds that run paired (duplex)."""
    mine = schedule.actions(rank)
    ranged = [a for a in mine if a.nodes is not None]  # duplex phases are cut into node ranges; pipelines' are not
    paired = frozenset(k for k in (ActionKind.FORWARD, ActionKind.BACKWARD) if interleaved(ranged, k))
    if paired and schedule.microbatches != 2:
        raise UserError(
            f"schedule {schedule.name!r} interleaves {schedule.microbatches} microbatches within a phase; the runtime "
            "interleaves exactly 2 (meshpilot.planner.schedule.duplex)"
        )
    out: list[Action] = []
    for a in mine:
        if a.kind in _SKIPPED:
            continue
        if a.kind in paired:
            if not any(b.kind == a.kind for b in out):
                out.append(Action(a.kind, 0))
        elif not (out and a.nodes is not None and _key(a) == _key(out[-1])):
            out.append(a)
    return out, paired


def _key(a: Action) -> tuple:
    return (a.kind, a.microbatch, a.stage)


class StepRun:
    """One step of this rank's actions (module docstring): `programs` and `params` (parameter locals) by stage,
    `buffers` the model's buffers by name, `inputs` the global batch; `stage` the stage of actions that name
    none; `exchange(action, stage, outgoing, received, sends)` runs ``S`` / ``R``."""

    def __init__(
        self,
        actions: list[Action],
        paired: frozenset[ActionKind],
        programs: dict[int, StageProgram],
        params: dict[int, list[torch.Tensor]],
        buffers: dict[str, torch.Tensor],
        inputs: Sequence[torch.Tensor],
        microbatches: int,
        *,
        stage: int = 0,
        exchange: Callable[..., None] | None = None,
    ) -> None:
        self.actions, self.paired = actions, paired
        self.programs, self.params, self.buffers = programs, params, buffers
        self.M = microbatches
        self.chunks = [x.chunk(self.M) if self.M > 1 else (x,) for x in inputs]
        self.stage = stage
        self.exchange = exchange
        self.received: dict[tuple[int, int, bool], list] = {}
        self.outgoing: dict[tuple[int, int, bool], list] = {}
        self.saved: dict[tuple[int, int], list] = {}
        self.handed: dict[tuple[int, int], list] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.grads: dict[int, list | None] = {s: None for s in programs}
        self.synced: dict[int, list] = {}
        """Each stage's gradients in their parameters' layouts after ``G`` (local tensors; None: no gradient)."""
        self.sends: list = []
        self.next = 0

    # ------------------------------------------------------------------ the loop
    def run(self, stop: int | None = None) -> None:
        """The actions up to index `stop` (all by default), from where the last call stopped."""
        stop = len(self.actions) if stop is None else stop
        while self.next < stop:
            a = self.actions[self.next]
            self.next += 1
            s = a.stage if a.stage is not None else self.stage
            with phase_scope(Phase.FWD if a.kind == ActionKind.FORWARD else Phase.BWD):
                _HANDLERS[a.kind](self, a, s)

    def until_loss(self) -> None:
        """The actions up to the last forward: the loss exists after them."""
        self.run(max(i for i, a in enumerate(self.actions) if a.kind == ActionKind.FORWARD) + 1)

    def loss(self) -> torch.Tensor | None:
        """The mean of the microbatches' losses (None on a rank without the last stage)."""
        if not self.losses:
            return None
        losses = [self.losses[m] for m in sorted(self.losses)]
        return losses[0] if len(losses) == 1 else torch.stack(losses).mean()

    def wait(self) -> None:
        for w in self.sends:
            w.wait()
        self.sends = []

    # ------------------------------------------------------------------ the handlers, by action kind
    def _forward(self, a: Action, s: int) -> None:
        if a.kind in self.paired:
            return self._forward_pair(s)
        prog, m = self.programs[s], a.microbatch
        buffers = [self.buffers[n] for n in prog.graph.buffer_names]
        mb = [c[m] for c in self.chunks]
        loss, updates, kept, out = prog.forward(self.params[s], buffers, mb, self.received.pop((s, m, True), []))
        self._write_buffers(prog, updates)
        if loss is not None:
            self.losses[m] = loss.detach()
        self.saved[(s, m)] = kept
        self.outgoing[(s, m, True)] = out

    def _backward(self, a: Action, s: int) -> None:
        if a.kind in self.paired:
            return self._backward_pair(s)
        prog, m = self.programs[s], a.microbatch
        if a.kind == ActionKind.BACKWARD:
            got = self.received.pop((s, m, False), [])
            gs, self.outgoing[(s, m, False)] = prog.backward(self.saved.pop((s, m)), got)
        else:  # W: the weight half, from what I handed it
            gs = prog.backward_weight(self.saved.pop((s, m)), self.handed.pop((s, m)))
        self._accumulate(s, gs)

    def _backward_input(self, a: Action, s: int) -> None:
        prog, m = self.programs[s], a.microbatch
        got = self.received.pop((s, m, False), [])
        self.outgoing[(s, m, False)], self.handed[(s, m)] = prog.backward_input(self.saved[(s, m)], got)

    def _exchange(self, a: Action, s: int) -> None:
        if self.exchange is None:
            raise UserError(f"action {a} sends or receives, but this plan has one stage; give a pipeline plan")
        self.exchange(a, s, self.outgoing, self.received, self.sends)

    def _grad_sync(self, a: Action, s: int) -> None:
        for st, prog in self.programs.items():
            self.synced[st] = prog.grad_sync(self.grads[st] or [None] * len(prog.trainable))

    # ------------------------------------------------------------------ helpers
    def _accumulate(self, s: int, gs: list) -> None:
        """Add one microbatch's gradients `gs` (scaled by 1/M) into stage `s`'s sum, in place.

        Each gradient leaves `gs` (the caller's list: its last reference) as it is added, so at the end of a
        later microbatch's backward the step holds the sum and that microbatch's gradients — not a scaled copy
        of every gradient and a new sum besides (4 gradient sets where 2 suffice, ``docs/benchmarks.md``). A
        later microbatch's gradient is added scaled in one kernel (``add_(g, alpha=1/M)``), with no ``g / M``
        copy: that copy of the largest gradient (a vocabulary's embedding) was the one allocation the plan's
        accounting does not hold at the end of the backward. The sum's tensors are the step's own (``g / M``
        of the first microbatch), so adding into them changes nothing the programs hold."""
        acc = self.grads[s] = self.grads[s] or [None] * len(gs)
        for i, g in enumerate(gs):
            gs[i] = None
            if g is None:
                continue
            if self.M == 1:  # one microbatch: its gradients are the step's, unscaled (not added into in place)
                acc[i] = g if acc[i] is None else acc[i] + g
                continue
            if acc[i] is None:
                acc[i] = g / self.M  # the step's own tensor
            else:
                acc[i].add_(g, alpha=1.0 / self.M)
            del g

    def _write_buffers(self, prog: StageProgram, updates: list) -> None:
        with torch.no_grad():
            for fqn, value in zip(prog.graph.buffer_updates, updates):
                self.buffers[fqn].copy_(value)

    def forward_only(self) -> None:
        """Every microbatch's forward and nothing after (a forward under ``torch.no_grad``)."""
        self.paired = frozenset()
        for m in range(self.M):
            self._forward(Action(ActionKind.FORWARD, m), self.stage)
        self.saved.clear()

    def _one_by_one(self, handler: Callable[[StepRun, Action, int], Any], kind: ActionKind, s: int) -> None:
        """A duplex phase before its programs are recorded: the two microbatches one after the other."""
        paired, self.paired = self.paired, frozenset()
        try:
            for m in (0, 1):
                handler(self, Action(kind, m), s)
        finally:
            self.paired = paired

    def _forward_pair(self, s: int) -> None:
        """Both microbatches of a duplex forward as one interleaved program (module docstring)."""
        prog = self.programs[s]
        if not prog.has_pair(ActionKind.FORWARD):
            return self._one_by_one(StepRun._forward, ActionKind.FORWARD, s)
        buffers = [self.buffers[n] for n in prog.graph.buffer_names]
        results = prog.forward_pair(self.params[s], buffers, [c[0] for c in self.chunks], [c[1] for c in self.chunks])
        self._write_buffers(prog, results[1][1])
        for m, (loss, _, saved) in enumerate(results):
            self.losses[m], self.saved[(s, m)] = loss.detach(), saved

    def _backward_pair(self, s: int) -> None:
        """Both microbatches of a duplex backward as one interleaved program."""
        prog = self.programs[s]
        if not prog.has_pair(ActionKind.BACKWARD):
            return self._one_by_one(StepRun._backward, ActionKind.BACKWARD, s)
        for gs in prog.backward_pair(self.saved.pop((s, 0)), self.saved.pop((s, 1))):
            self._accumulate(s, gs)


_HANDLERS: dict[ActionKind, Callable[[StepRun, Action, int], Any]] = {
    ActionKind.FORWARD: StepRun._forward,
    ActionKind.BACKWARD: StepRun._backward,
    ActionKind.BACKWARD_WEIGHT: StepRun._backward,
    ActionKind.BACKWARD_INPUT: StepRun._backward_input,
    ActionKind.SEND: StepRun._exchange,
    ActionKind.RECV: StepRun._exchange,
    ActionKind.GRAD_SYNC: StepRun._grad_sync,
}
"""The one dispatch: each action kind's handler."""


__all__ = ["StepRun", "executed_actions"]
