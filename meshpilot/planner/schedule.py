"""The step as data: which piece of work runs when, on which ranks, for which microbatch, waiting on what.

A :class:`Schedule` holds, for each group of ranks that do the same work (a *rank class*: every rank of an SPMD
plan; one pipeline stage's ranks), the ordered :class:`Action` list of one training step. The runtime
executes it (``meshpilot.runtime``), the simulator times it (``meshpilot.sim``), the plan stores it (JSON).

Actions, and how they print (``str``) and parse (:func:`parse_action`) — the form torch.distributed.pipelining
uses for its actions (``2F0``), extended by node ranges and collectives:

=========================  =============================================================================
``F3``, ``F3[0:120]``      compute the forward of microbatch 3 (all forward nodes, or nodes ``0 <= i < 120``
                           of ``Plan.nodes``)
``B3``, ``I3``, ``W3``     its backward: whole, for the inputs only, for the weights only (zero-bubble
                           schedules split them)
``G``                      gradient synchronisation, once per step: every gradient resharded into its
                           parameter's layout (the plan's ``grad:`` collectives), after the last backward
``+7.3``, ``-7.3``         issue / wait collective ``Plan.collectives[7]`` of microbatch 3; compute between an
                           issue and its wait overlaps the collective
``S3>5``, ``R3<1``         send to rank 5 / receive from rank 1 the boundary values of microbatch 3 (stages)
``2F3``, ``2S3>5/3``       the same, of virtual stage 2 when a rank class holds several (Interleaved1F1B):
                           the prefix names the stage doing it (as torch's ``2F0``), a send or receive also
                           the other end's stage after ``/`` (2 and 3 may sit on the same two rank classes
                           both ways, so the stages say which boundary and which direction)
=========================  =============================================================================

A schedule prints as one line per rank class, ``ranks 0-3: F0 B0 G`` (the trivial step), and
:func:`parse_schedule` reads that text back: ``parse_schedule(str(s)) == s``.

Builders: :func:`trivial` (one microbatch, collectives where the plan puts them), :func:`accumulate`
(``F0 B0 F1 B1 … G``: gradient accumulation over microbatches, the gradients reduced once),
:func:`overlapped` (each collective issued right after its producing node and waited right before its
first consumer, so communication runs beside the compute in between) and :func:`duplex` (HiDup §3: two
microbatches interleaved stage by stage, one's collectives running while the other computes); for pipelines
:func:`pipeline` (GPipe, 1F1B, and through it :func:`interleaved_1f1b`, v stages per rank class, and
:func:`zero_bubble`, ZB-H1: each a :class:`PipelineKind`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from meshpilot.errors import UserError


class ActionKind(StrEnum):
    """What an action does (its letter in the printed form)."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    GRAD_SYNC = "G"
    ISSUE = "+"
    WAIT = "-"
    SEND = "S"
    RECV = "R"

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE


_COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule (module docstring)."""

    kind: ActionKind
    microbatch: int = 0
    nodes: tuple[int, int] | None = None
    """``[start, stop)`` indices into ``Plan.nodes`` for a compute action; None: the whole phase."""
    collective: int | None = None
    """Index into ``Plan.collectives`` (issue / wait)."""
    peer: int | None = None
    """The other rank of a send / receive."""
    stage: int | None = None
    """The (virtual) pipeline stage whose work this is, when a rank class holds several; None: its only one."""
    peer_stage: int | None = None
    """The stage at the other end of a send / receive of a :attr:`stage` (set with it)."""

    def __str__(self) -> str:
        k = self.kind
        if k == ActionKind.GRAD_SYNC:
            return "G"
        if k in (ActionKind.ISSUE, ActionKind.WAIT):
            return f"{k.value}{self.collective}.{self.microbatch}"
        pre = "" if self.stage is None else str(self.stage)
        post = "" if self.peer_stage is None else f"/{self.peer_stage}"
        if k == ActionKind.SEND:
            return f"{pre}S{self.microbatch}>{self.peer}{post}"
        if k == ActionKind.RECV:
            return f"{pre}R{self.microbatch}<{self.peer}{post}"
        span = f"[{self.nodes[0]}:{self.nodes[1]}]" if self.nodes is not None else ""
        return f"{pre}{k.value}{self.microbatch}{span}"

    @property
    def forward(self) -> bool | None:
        """For a send / receive between stages given by :attr:`stage`: whether it carries the forward's values
        (to a later stage); None without stages (the runtime tells by the peer's position)."""
        if self.stage is None or self.peer_stage is None:
            return None
        return (self.peer_stage > self.stage) == (self.kind == ActionKind.SEND)

    @property
    def boundary(self) -> tuple[int, int, int | None, int | None]:
        """What a send and its receive share: (microbatch, forward?, sending stage, receiving stage); the stages
        are None without them."""
        if self.stage is None:
            return (self.microbatch, -1, None, None)
        src, dst = (self.stage, self.peer_stage) if self.kind == ActionKind.SEND else (self.peer_stage, self.stage)
        return (self.microbatch, int(bool(self.forward)), src, dst)


_ACTION = re.compile(
    r"^(?:(?P<stage>\d+)?(?:(?P<compute>[FBIW])(?P<mb>\d+)(?:\[(?P<start>\d+):(?P<stop>\d+)\])?"
    r"|S(?P<smb>\d+)>(?P<speer>\d+)(?:/(?P<sps>\d+))?"
    r"|R(?P<rmb>\d+)<(?P<rpeer>\d+)(?:/(?P<rps>\d+))?)"
    r"|(?P<grad>G)"
    r"|(?P<coll>[+-])(?P<c>\d+)\.(?P<cmb>\d+))$"
)


def parse_action(text: str) -> Action:
    """The :class:`Action` printed as `text` (one line naming the problem otherwise)."""
    m = _ACTION.match(text.strip())
    peer_stage = None if m is None else m["sps"] or m["rps"]
    if m is None or (m["stage"] is None) != (peer_stage is None) and not m["compute"]:
        raise UserError(
            f"schedule action {text!r}: write F3, B3, I3, W3 (optionally F3[start:stop]), G, +7.3 / -7.3 "
            "(issue / wait collective 7 of microbatch 3), S3>5 or R3<1; of virtual stage 2: 2F3, 2S3>5/3 "
            "(to rank 5, its stage 3)"
        )
    stage = int(m["stage"]) if m["stage"] is not None else None
    if m["compute"]:
        nodes = (int(m["start"]), int(m["stop"])) if m["start"] is not None else None
        return Action(ActionKind(m["compute"]), int(m["mb"]), nodes=nodes, stage=stage)
    if m["grad"]:
        return Action(ActionKind.GRAD_SYNC)
    if m["coll"]:
        return Action(ActionKind(m["coll"]), int(m["cmb"]), collective=int(m["c"]))
    ps = int(peer_stage) if peer_stage is not None else None
    if m["smb"] is not None:
        return Action(ActionKind.SEND, int(m["smb"]), peer=int(m["speer"]), stage=stage, peer_stage=ps)
    return Action(ActionKind.RECV, int(m["rmb"]), peer=int(m["rpeer"]), stage=stage, peer_stage=ps)


@dataclass(frozen=True)
class RankClass:
    """Ranks that run the same actions (SPMD: all of them; a pipeline: one stage's)."""

    ranks: tuple[int, ...]
    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return f"ranks {_ranges(self.ranks)}: " + " ".join(str(a) for a in self.actions)


@dataclass(frozen=True)
class Schedule:
    """One training step of every rank (module docstring)."""

    classes: tuple[RankClass, ...]
    microbatches: int = 1
    name: str = "trivial"
    """How it was built (``trivial``, ``accumulate``, ``overlapped``, a pipeline schedule's name)."""
    _by_rank: dict = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_rank", {r: c for c in self.classes for r in c.ranks})

    def actions(self, rank: int) -> tuple[Action, ...]:
        """The actions `rank` runs."""
        return self._by_rank[rank].actions

    def __str__(self) -> str:
        head = f"schedule {self.name}, {self.microbatches} microbatch{'es' if self.microbatches != 1 else ''}"
        return "\n".join([head, *(str(c) for c in self.classes)])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "microbatches": self.microbatches, "text": [str(c) for c in self.classes]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        return cls(tuple(_parse_class(line) for line in d["text"]), int(d["microbatches"]), d["name"])


def parse_schedule(text: str) -> Schedule:
    """The schedule printed as `text` (``str(schedule)``)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    m = re.match(r"^schedule (\S+), (\d+) microbatch(?:es)?$", lines[0].strip()) if lines else None
    if m is None:
        raise UserError("schedule text: the first line must read 'schedule NAME, N microbatches'")
    return Schedule(tuple(_parse_class(line) for line in lines[1:]), int(m[2]), m[1])


def _parse_class(line: str) -> RankClass:
    m = re.match(r"^\s*ranks ([0-9,\- ]+):(.*)$", line)
    if m is None:
        raise UserError(f"schedule line {line!r}: write 'ranks 0-3: F0 B0 G'")
    return RankClass(_parse_ranges(m[1]), tuple(parse_action(t) for t in m[2].split()))


def _ranges(ranks: tuple[int, ...]) -> str:
    """``0-3,8,10-11``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r != start else f"{r}")
            start = None
    return ",".join(out)


def _parse_ranges(text: str) -> tuple[int, ...]:
    ranks: list[int] = []
    for part in text.replace(" ", "").split(","):
        lo, _, hi = part.partition("-")
        ranks += range(int(lo), int(hi or lo) + 1)
    return tuple(ranks)


# ---------------------------------------------------------------------------------------------- builders


def trivial(world: int) -> Schedule:
    """``F0 B0 G`` on every rank: one microbatch, every collective waited where the plan places it."""
    return accumulate(world, 1)


def accumulate(world: int, microbatches: int) -> Schedule:
    """``F0 B0 F1 B1 … G``: gradients accumulated over `microbatches`, synchronised once at the end."""
    if microbatches < 1:
        raise UserError(f"microbatches {microbatches}: give at least 1")
    acts: list[Action] = []
    for m in range(microbatches):
        acts += [Action(ActionKind.FORWARD, m), Action(ActionKind.BACKWARD, m)]
    acts.append(Action(ActionKind.GRAD_SYNC))
    name = "trivial" if microbatches == 1 else "accumulate"
    return Schedule((RankClass(tuple(range(world)), tuple(acts)),), microbatches, name)


def overlapped(plan: Any, microbatches: int = 1) -> Schedule:
    """Every resharding edge's first collective issued right after its producing node and waited right
    before its consumer, so the compute in between overlaps it (later collectives of a multi-axis reshard,
    the collectives an op issues itself, the loss's and the gradients' stay where the plan puts them)."""
    spans, edges = _phase_edges(plan)
    hoisted = {ph: [(src + 1, dst, c) for src, dst, c in e if src + 1 < dst] for ph, e in edges.items()}
    acts: list[Action] = []
    for m in range(microbatches):
        for ph, kind in _PHASES.items():
            acts += _split_phase(kind, m, spans[ph], hoisted[ph])
    acts.append(Action(ActionKind.GRAD_SYNC))
    return Schedule((RankClass(tuple(range(_world(plan))), tuple(acts)),), microbatches, "overlapped")


def duplex(plan: Any) -> Schedule:
    """HiDup's duplex (§3): two microbatches interleaved stage by stage, so one's communication runs while
    the other computes.

    Each phase's nodes are cut into stages right before every node that consumes a resharding edge's
    collective (its first one; the cut points of :func:`overlapped`'s waits). Per stage ``k`` of a phase::

        -c.0 … F0[s_k:s_k+1] +c'.0 …   -c.1 … F1[s_k:s_k+1] +c'.1 …

    where ``c`` are the collectives consumed at ``s_k`` and ``c'`` those consumed at ``s_k+1``: microbatch 0's
    collectives at the end of stage ``k`` run while microbatch 1 computes stage ``k``, and microbatch 1's
    while microbatch 0 computes stage ``k+1``. An own op that issues collectives before its computation
    (``meshpilot.ops.OwnOp.leading``: the expert-parallel MoE's counts and dispatch) is cut around the same
    way: its leading collectives are consumed at the op (issued at the end of the stage before), the rest
    (the combine) at the node after it. The backward does the same over the backward nodes (after
    both forwards); gradients of the two microbatches are accumulated and synchronised once (``G``).
    Semantics are gradient accumulation over 2 microbatches (:func:`accumulate`): an op that depends on
    its batch (BatchNorm's statistics, an MoE's capacity) sees each microbatch on its own."""
    spans, edges = _phase_edges(plan)
    steps = _op_steps(plan)
    acts: list[Action] = []
    for ph, kind in _PHASES.items():
        nodes = spans[ph]
        if not nodes:
            continue
        lo, hi = nodes[0], nodes[-1] + 1
        at: dict[int, list[int]] = {}
        for _, dst, c in edges[ph] + steps[ph]:
            if lo < dst < hi:
                at.setdefault(dst, []).append(c)
        cuts = [lo, *sorted(at), hi]
        for a, b in zip(cuts, cuts[1:]):
            for m in (0, 1):
                acts += [Action(ActionKind.WAIT, m, collective=c) for c in at.get(a, ())]
                acts.append(Action(kind, m, nodes=(a, b)))
                acts += [Action(ActionKind.ISSUE, m, collective=c) for c in at.get(b, ())]
    acts.append(Action(ActionKind.GRAD_SYNC))
    return Schedule((RankClass(tuple(range(_world(plan))), tuple(acts)),), 2, DUPLEX)


DUPLEX = "duplex"
"""The name :func:`duplex` gives its schedules (the runtime runs a phase of them as one interleaved program)."""

_PHASES = {"fwd": ActionKind.FORWARD, "bwd": ActionKind.BACKWARD}


def _world(plan: Any) -> int:
    world = 1
    for d in plan.mesh_shape:
        world *= d
    return world


def _phase_edges(plan: Any) -> tuple[dict[str, list[int]], dict[str, list[tuple[int, int, int]]]]:
    """Per phase: its compute nodes' indices, and ``(producer index, consumer index, collective)`` of every
    resharding edge's first collective (producer -1: a leaf such as a parameter)."""
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    spans = {
        ph: [i for i, n in enumerate(plan.nodes) if n.phase == ph and n.kind in ("op", "getitem")] for ph in _PHASES
    }
    edges: dict[str, list[tuple[int, int, int]]] = {ph: [] for ph in _PHASES}
    seen: set[tuple[str, int]] = set()
    for c, col in enumerate(plan.collectives):
        if col.operand < 0 or col.src == col.dst or col.dst not in index or (col.dst, col.operand) in seen:
            continue
        seen.add((col.dst, col.operand))
        if col.phase in edges:
            edges[col.phase].append((index.get(col.src, -1), index[col.dst], c))
    return spans, edges


def _op_steps(plan: Any) -> dict[str, list[tuple[int, int, int]]]:
    """Per phase, ``(producer index, consumer index, collective)`` of the collectives of own ops that run in
    steps (``meshpilot.ops.OwnOp.leading`` > 0): an op ``i``'s leading ones ``(i - 1, i, c)``, the rest
    ``(i, i + 1, c)`` — the cut points duplex gives them."""
    from meshpilot.ops import leading_collectives

    index = {n.name: i for i, n in enumerate(plan.nodes)}
    out: dict[str, list[tuple[int, int, int]]] = {ph: [] for ph in _PHASES}
    seen: dict[int, int] = {}
    for c, col in enumerate(plan.collectives):
        if not (col.src == col.dst and col.operand < 0 and col.dst in index and col.phase in out):
            continue
        i = index[col.dst]
        lead = leading_collectives(plan.nodes[i].target)
        if lead <= 0:
            continue
        k = seen[i] = seen.get(i, -1) + 1
        out[col.phase].append((i - 1, i, c) if k < lead else (i, i + 1, c))
    return out


def interleaved(actions: tuple[Action, ...] | list[Action], kind: ActionKind) -> bool:
    """Whether the compute actions of phase `kind` alternate between microbatches (a duplex phase): more runs
    of one microbatch's consecutive actions than microbatches."""
    mbs = [a.microbatch for a in actions if a.kind == kind]
    runs = sum(1 for k, m in enumerate(mbs) if k == 0 or mbs[k - 1] != m)
    return runs > len(set(mbs))


def stage_starts(actions: tuple[Action, ...] | list[Action], kind: ActionKind) -> list[int]:
    """The first node of every stage of phase `kind` (the starts of its node ranges), ascending."""
    return sorted({a.nodes[0] for a in actions if a.kind == kind and a.nodes is not None})


def _split_phase(kind: ActionKind, m: int, nodes: list[int], hoisted: list[tuple[int, int, int]]) -> list[Action]:
    """A phase's nodes as compute ranges, cut where a collective is issued (before node ``issue``) or waited
    (before node ``wait``)."""
    if not nodes:
        return []
    lo, hi = nodes[0], nodes[-1] + 1
    events: dict[int, list[Action]] = {}
    for issue, wait, c in hoisted:
        issue = max(issue, lo)
        events.setdefault(issue, []).append(Action(ActionKind.ISSUE, m, collective=c))
        events.setdefault(wait, []).append(Action(ActionKind.WAIT, m, collective=c))
    out: list[Action] = []
    start = lo
    for at in sorted(p for p in events if lo <= p <= hi):
        if at > start:
            out.append(Action(kind, m, nodes=(start, at)))
            start = at
        waits = [a for a in events[at] if a.kind == ActionKind.WAIT]
        out += waits + [a for a in events[at] if a.kind == ActionKind.ISSUE]
    if start < hi:
        out.append(Action(kind, m, nodes=(start, hi)))
    return out


# ---------------------------------------------------------------------------------------------- pipelines


class PipelineKind(StrEnum):
    """The pipeline schedules :func:`pipeline` builds (the orders of ``torch.distributed.pipelining``)."""

    GPIPE = "gpipe"
    """Every forward, then every backward (``ScheduleGPipe``): all microbatches' activations in flight."""
    ONE_F_ONE_B = "1f1b"
    """Stage s of S runs min(B, S − s) forwards, then alternates one backward, one forward, then drains the
    backwards (``Schedule1F1B``): the same bubble as GPipe, at most S − s microbatches in flight."""
    INTERLEAVED_1F1B = "interleaved-1f1b"
    """Each of P rank classes holds v > 1 model chunks (virtual stages c·P + p), run 1F1B-like, depth first
    (``ScheduleInterleaved1F1B``): the bubble shrinks about v-fold, for v times the sends (:func:`interleaved_1f1b`)."""
    ZERO_BUBBLE = "zb-h1"
    """1F1B with each backward split into the input gradients ``I`` (what the previous stage waits for) and the
    weight gradients ``W``, the early stages' ``W`` delayed into 1F1B's drain (ZB-H1, :func:`zero_bubble`): a
    bubble of about (S − 1)·(F + I − W) instead of (S − 1)·(F + I + W), the forward's saved values held until
    ``W`` (:func:`held_until_weight`)."""


def pipeline(
    stage_ranks: Sequence[Sequence[int]], microbatches: int, kind: PipelineKind | str, chunks: int = 2
) -> Schedule:
    """One rank class per stage (``stage_ranks[s]``: its ranks), running `kind`'s order of forwards and
    backwards over `microbatches`, with the boundary sends and receives around them and the gradient sync
    last.

    A forward of microbatch m on stage s > 0 first receives ``R m<p`` from stage s − 1 and a stage s < S − 1
    sends ``S m>q`` its output after; a backward receives from stage s + 1 and sends to stage s − 1. The
    peer of a send / receive is the *first* rank of the other stage: the runtime
    (``meshpilot.runtime.pipeline``) sends each rank of it the batch rows both hold; the simulator takes
    peers literally, so simulate one rank per stage (``Plan.simulate`` does). Sends do not block
    (the simulator and the runtime start them and go on); receives wait. Interleaved1F1B: `stage_ranks` are
    the rank classes, each holding `chunks` stages (:func:`interleaved_1f1b`)."""
    kind = PipelineKind(kind)
    if kind == PipelineKind.INTERLEAVED_1F1B:
        return interleaved_1f1b(stage_ranks, microbatches, chunks)
    if kind == PipelineKind.ZERO_BUBBLE:
        return zero_bubble(stage_ranks, microbatches)
    S, B = len(stage_ranks), microbatches
    if S < 1 or any(len(r) == 0 for r in stage_ranks):
        raise UserError("pipeline schedule: give at least one stage, each with at least one rank")
    if isinstance(B, bool) or not isinstance(B, int) or B < 1:
        raise UserError(f"microbatches={B!r}: give a whole number of microbatches, at least 1")
    classes = []
    for s, ranks in enumerate(stage_ranks):
        prev = stage_ranks[s - 1][0] if s > 0 else None
        nxt = stage_ranks[s + 1][0] if s + 1 < S else None
        acts: list[Action] = []
        for k, m in _stage_order(kind, s, S, B):
            if k == ActionKind.FORWARD:
                acts += [Action(ActionKind.RECV, m, peer=prev)] if prev is not None else []
                acts.append(Action(k, m))
                acts += [Action(ActionKind.SEND, m, peer=nxt)] if nxt is not None else []
            else:
                acts += [Action(ActionKind.RECV, m, peer=nxt)] if nxt is not None else []
                acts.append(Action(k, m))
                acts += [Action(ActionKind.SEND, m, peer=prev)] if prev is not None else []
        acts.append(Action(ActionKind.GRAD_SYNC))
        classes.append(RankClass(tuple(int(r) for r in ranks), tuple(acts)))
    return Schedule(tuple(classes), B, kind.value)


ZERO_BUBBLE = PipelineKind.ZERO_BUBBLE.value
"""The name of :func:`zero_bubble`'s schedules."""


def zero_bubble(stage_ranks: Sequence[Sequence[int]], microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., 2024, §3.1; torch's ``ScheduleZBVZeroBubble`` family): 1F1B's order with every backward
    split into ``I m`` (the gradient of the stage's input, which the previous stage waits for: received before,
    sent after) and ``W m`` (the weight gradients, which nobody waits for). Stage s of S runs ``W m`` after
    ``I (m + s)`` (the first stage at once, the last S − 1 backwards late, the rest after its last ``I``): the
    input gradients of the drain then pass every stage without waiting behind weight work, and the later
    stages' postponed ``W`` fill what would be their idle time in it.

    On S uniform stages with B ≥ S microbatches and free links the step is
    B·(F + I + W) + (S − 1)·max(F, I, F + I − W), against 1F1B's (B + S − 1)·(F + I + W): the bubble
    (S − 1)·(F + I − W) of the paper where W ≤ F, I — a third of 1F1B's when F = I = W
    (``tests/test_pipeline_plan.py`` checks it in the simulator).

    Microbatches whose ``I`` has not run are 1F1B's (:func:`in_flight`); the stage runtime keeps a microbatch's
    saved forward values until its ``W`` (``W`` reads the layers' inputs), and counted up to ``W``
    (:func:`held_until_weight`) every stage holds min(B, S) — 1F1B's first stage's count, on every stage."""
    base = pipeline(stage_ranks, microbatches, PipelineKind.ONE_F_ONE_B)
    B = microbatches
    classes = []
    for s, rc in enumerate(base.classes):
        lag = min(s, B)
        acts: list[Action] = []
        done = 0
        due = False  # a W to place once the I just placed has sent its gradient on
        for a in rc.actions:
            if due and not (a.kind == ActionKind.SEND and acts and acts[-1].kind == ActionKind.BACKWARD_INPUT):
                acts.append(Action(ActionKind.BACKWARD_WEIGHT, done))
                done, due = done + 1, False
            if a.kind == ActionKind.GRAD_SYNC:
                acts += [Action(ActionKind.BACKWARD_WEIGHT, m) for m in range(done, B)]
                acts.append(a)
            elif a.kind == ActionKind.BACKWARD:
                acts.append(Action(ActionKind.BACKWARD_INPUT, a.microbatch))
                due = a.microbatch - lag >= done
            else:
                acts.append(a)
        classes.append(RankClass(rc.ranks, tuple(acts)))
    return Schedule(tuple(classes), B, ZERO_BUBBLE)


def interleaved_1f1b(groups: Sequence[Sequence[int]], microbatches: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., 2021, §2.2; torch's ``ScheduleInterleaved1F1B``): the model cut into
    V = v·P stages, stage j on rank class j mod P (`groups`: the P classes, v = `chunks`), so each class holds v
    non-contiguous chunks; one rank class per group, its actions prefixed by the stage (``2F3``).

    With B microbatches in rounds of P (B a multiple of P), a class runs its forwards *depth first*: round r's
    P microbatches through chunk 0, then chunk 1, …, then round r + 1; its backwards the same way from chunk
    v − 1 down. Class p runs the first w_p = min(v·B, (v − 1)·P + 2·(P − 1 − p)) forwards (warm-up; the last
    class starts its first backward as soon as its last chunk holds a forward), then alternates one forward,
    one backward, then drains the backwards. Each microbatch crosses every class v times: V − 1 sends each
    way instead of P − 1, and the bubble, (P − 1) stage-steps of a v-times shorter stage, about v times
    smaller than 1F1B's. In flight per class: up to w_p + 1 chunk-microbatches (:func:`in_flight`), each a
    v-th of the class's layers."""
    P, B, v = len(groups), microbatches, chunks
    if P < 2 or any(len(r) == 0 for r in groups):
        raise UserError("interleaved 1F1B: give at least 2 rank classes, each with at least one rank")
    if isinstance(v, bool) or not isinstance(v, int) or v < 2:
        raise UserError(f"chunks={v!r}: interleaved 1F1B holds at least 2 stages per rank class; give 2 or more")
    if isinstance(B, bool) or not isinstance(B, int) or B < 1 or B % P:
        raise UserError(
            f"microbatches={B!r}: interleaved 1F1B runs microbatches in rounds of the {P} rank classes; give a "
            f"multiple of {P}"
        )
    V = v * P
    first = [int(r[0]) for r in groups]
    fwd = [(c, m) for r in range(0, B, P) for c in range(v) for m in range(r, r + P)]
    bwd = [(c, m) for r in range(0, B, P) for c in reversed(range(v)) for m in range(r, r + P)]
    classes = []
    for p, ranks in enumerate(groups):
        warm = min(v * B, (v - 1) * P + 2 * (P - 1 - p))
        order = [(ActionKind.FORWARD, x) for x in fwd[:warm]]
        f, b = warm, 0
        while b < len(bwd):
            if f < len(fwd):
                order.append((ActionKind.FORWARD, fwd[f]))
                f += 1
            order.append((ActionKind.BACKWARD, bwd[b]))
            b += 1
        acts: list[Action] = []
        for k, (c, m) in order:
            j = c * P + p
            before, after = (j - 1, j + 1) if k == ActionKind.FORWARD else (j + 1, j - 1)
            if 0 <= before < V:
                acts.append(Action(ActionKind.RECV, m, peer=first[before % P], stage=j, peer_stage=before))
            acts.append(Action(k, m, stage=j))
            if 0 <= after < V:
                acts.append(Action(ActionKind.SEND, m, peer=first[after % P], stage=j, peer_stage=after))
        acts.append(Action(ActionKind.GRAD_SYNC))
        classes.append(RankClass(tuple(int(r) for r in ranks), tuple(acts)))
    return Schedule(tuple(classes), B, PipelineKind.INTERLEAVED_1F1B.value)


def _stage_order(kind: PipelineKind, s: int, S: int, B: int) -> list[tuple[ActionKind, int]]:
    F, BW = ActionKind.FORWARD, ActionKind.BACKWARD
    if kind == PipelineKind.GPIPE:
        return [(F, m) for m in range(B)] + [(BW, m) for m in range(B)]
    warmup = min(B, S - s)
    order = [(F, m) for m in range(warmup)]
    f, b = warmup, 0
    while b < B:
        order.append((BW, b))
        b += 1
        if f < B:
            order.append((F, f))
            f += 1
    return order


def in_flight(schedule: Schedule) -> dict[tuple[int, ...], int]:
    """Per rank class: the most microbatches whose forward ran and whose backward (``B`` or ``I``) did not
    yet — how many microbatches' activations the class holds at once (under Interleaved1F1B: (stage,
    microbatch) pairs, each a chunk's activations)."""
    return {c.ranks: max(_held(c.actions).values(), default=0) for c in schedule.classes}


def stage_in_flight_of(schedule: Schedule) -> dict[int | None, int]:
    """Per stage (an action's ``stage``; None where a class holds one): the most microbatches whose activations
    it holds at once."""
    out: dict[int | None, int] = {}
    for c in schedule.classes:
        for st, n in _held(c.actions, by_stage=True).items():
            out[st] = max(out.get(st, 0), n)
    return out


def held_until_weight(schedule: Schedule) -> dict[tuple[int, ...], int]:
    """Per rank class: the most microbatches whose forward ran and whose weight gradients (``B`` or ``W``) did
    not yet — the saved forward values held at once where ``W`` reads them (the zero-bubble schedules'
    memory rule; equal to :func:`in_flight` where backwards are not split)."""
    return {c.ranks: max(_held(c.actions, until=_ENDS_WEIGHT).values(), default=0) for c in schedule.classes}


_ENDS_INPUT = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT})
_ENDS_WEIGHT = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT})


def _held(actions: Sequence[Action], by_stage: bool = False, until: frozenset = _ENDS_INPUT) -> dict:
    """The peak count of microbatches forwarded and not yet backwarded (by an action of `until`), over all (or
    per stage)."""
    live: dict = {}
    peak: dict = {}
    for a in actions:
        key = a.stage if by_stage else 0
        if a.kind == ActionKind.FORWARD:
            live.setdefault(key, set()).add((a.stage, a.microbatch))
        elif a.kind in until:
            live.setdefault(key, set()).discard((a.stage, a.microbatch))
        else:
            continue
        peak[key] = max(peak.get(key, 0), len(live[key]))
    return peak
