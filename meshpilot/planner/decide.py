"""One stage or a pipeline: what ``meshpilot plan`` weighs before it plans (issue 29).

``meshpilot plan`` without ``--stages`` plans the model both ways — one stage, every operator sharded over all n
devices (``planner.auto``: today's SPMD plan of the whole batch), and Alpa's stage DP (``planner.pipeline``: B
microbatches through stages on submeshes) — and keeps the shorter step. Two numbers let it skip work that cannot
succeed, both read off one captured microbatch's graph (:func:`model_bytes`) without a search.

1. Whether one stage can fit at all — :func:`one_stage_floor`
-------------------------------------------------------------
The one-stage plan runs the whole global batch at once (B microbatches' worth of rows). At the start of its
backward every device holds its share of the weights W, the AdamW states O, the inputs I and every saved
activation A (``accounting``'s backward row: ``W + O + I + saved``). However the plan shards them, each byte is
on at least one device, so the most loaded device holds at least the average:

    floor_1(B) = (W + O + B · (I + A)) / n                                          → ``one_stage_floor``

with W, O of every parameter (``accounting.state_bytes``: O = 2 W for a trainable one), I the microbatch's input
leaves and A its saved values (``accounting.saved_values``), per microbatch. Above the device's capacity, no
one-stage plan fits: the search (78 s on GPT-39B over its mesh shapes) is not run, and the printout says why.
Where the one-stage search may recompute (``--recompute auto`` or ``full``: ``planner.recompute``), A is what
the backward keeps with every block that can be recomputed exactly recomputed — A less each such block's
interior (``Region.saved_bytes``) — so the floor stays a lower bound of every plan the search could return.

2. How many microbatches by default — :func:`default_microbatches`
-----------------------------------------------------------------
A pipeline of B microbatches holds, on all devices together, the weights once and at least one microbatch's
saved values: ``floor_P(B) = (W + O + I + A_B) / n`` with A_B the activations of a microbatch of batch/B rows
(its graph's A scaled by the rows). 1F1B's first stage holds S microbatches of its layers and the live peaks
come on top, so the default takes the fewest microbatches (a power of two, at least 4, dividing the batch) whose
floor is at most half the capacity — the larger B, the smaller the bubble too — and ``meshpilot plan`` doubles B
while the stage DP finds no pipeline that fits. A stack of repeated blocks (``planner.stack``) counts its
middle block once per block of the model.

3. The choice — :class:`Choice`
-------------------------------
The one-stage plan's predicted step (``Plan.time.overlapped_s``) against the pipeline's simulated step
(``Plan.simulate``: Eq. 2's stages under the schedule, each boundary's transfer sent): the smaller
wins; :class:`Weighed` keeps both and why, and the CLI prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from meshpilot.graph.capture import NodeKind, OpGraph
from meshpilot.planner.accounting import saved_values, state_bytes
from meshpilot.planner.stack import Stack
from meshpilot.planner.stage import runnable_layers

FLOOR_SHARE = 0.5
"""The share of the device a pipeline's floor may take for :func:`default_microbatches` (module docstring, 2)."""

LEAST_MICROBATCHES = 4
"""The fewest microbatches :func:`default_microbatches` offers."""


class Choice(StrEnum):
    """What ``meshpilot plan`` chose."""

    ONE_STAGE = "one stage"
    PIPELINE = "pipeline"


@dataclass(frozen=True)
class ModelBytes:
    """A model's bytes per microbatch, read off one microbatch's graph (module docstring)."""

    state: float
    """W + O: every parameter's weight and AdamW states (``accounting.state_bytes``)."""
    per_microbatch: float
    """I + A: the microbatch's input leaves and saved values."""
    rows: int
    """Rows (the batch dimension) of the microbatch the graph was captured with."""


def model_bytes(graph: OpGraph | Stack, recompute: bool = False) -> ModelBytes:
    """:class:`ModelBytes` of a captured microbatch's graph, or of a :class:`Stack`'s model (its middle block
    counted once per block of the model). `recompute`: the saved values less the interior of every block
    recomputation can take (those that draw no random numbers; module docstring, 1)."""
    stack = graph if isinstance(graph, Stack) else None
    g = stack.graph if stack is not None else graph
    layers = runnable_layers(g)
    where = {name: j for j, layer in enumerate(layers) for name in layer.nodes}
    state = [0.0] * len(layers)
    per_mb = [0.0] * len(layers)
    rows = 1
    for n in g.nodes:
        j = where.get(n.name)
        if j is None or n.out is None:
            continue
        if n.kind == NodeKind.PARAM:
            s = state_bytes(n.out, g.grads.get(n.fqn) is not None)
            state[j] += s.param + s.optimizer
        elif n.kind == NodeKind.INPUT:
            per_mb[j] += float(n.out.nbytes)
            rows = max(rows, n.out.shape[0] if n.out.shape else 1)
    for src, i in saved_values(g):
        if src in where:
            per_mb[where[src]] += float(g[src].outputs[i].nbytes)
    if recompute:
        from meshpilot.planner.recompute import regions

        for r in regions(g):
            j = where.get(r.recomputed[0])
            if r.random is None and j is not None:
                per_mb[j] = max(0.0, per_mb[j] - r.saved_bytes)
    weights = [1.0] * len(layers)
    if stack is not None and stack.kept != stack.blocks:  # the kept blocks stand for the model's
        pre, post = stack.pre, stack.kept + stack.pre
        for j in range(pre, post):
            weights[j] = 1.0 if j in (pre, post - 1) else (stack.blocks - 2) / (stack.kept - 2)
    return ModelBytes(
        sum(w * x for w, x in zip(weights, state)), sum(w * x for w, x in zip(weights, per_mb)), int(rows)
    )


def one_stage_floor(mb: ModelBytes, n: int, microbatches: int) -> float:
    """Bytes the most loaded device holds at least, one stage of the whole batch (B microbatches' rows at once)
    on `n` devices (module docstring, 1)."""
    return (mb.state + microbatches * mb.per_microbatch) / n


def default_microbatches(mb: ModelBytes, n: int, batch: int, capacity: float) -> int:
    """The fewest microbatches (a power of two ≥ :data:`LEAST_MICROBATCHES` dividing `batch`, else `batch`'s
    largest such) whose pipeline floor is within :data:`FLOOR_SHARE` of `capacity` (module docstring, 2); `mb`
    is of a microbatch of ``mb.rows`` rows."""
    per_row = mb.per_microbatch / mb.rows
    options = [b for b in (1 << j for j in range(batch.bit_length())) if b >= LEAST_MICROBATCHES and batch % b == 0]
    if not options:
        return 1
    for b in options:
        if (mb.state + per_row * batch / b) / n <= FLOOR_SHARE * capacity:
            return b
    return options[-1]


@dataclass(frozen=True)
class Weighed:
    """Both sides ``meshpilot plan`` weighed (module docstring, 3)."""

    choice: Choice
    one_stage_s: float | None
    """The one-stage plan's predicted step; None where none fits."""
    pipeline_s: float | None
    """The pipeline's simulated step; None where none fits."""
    why: str
    """One line: what was compared, or why a side had no plan."""


def weigh(one_stage_s: float | None, pipeline_s: float | None, one_stage: str, pipeline: str) -> Weighed:
    """The shorter step of the two (one stage on a tie: no bubble, no sends), with a line saying what was
    compared; `one_stage` and `pipeline` describe each side (its step, or why it has none)."""
    if one_stage_s is None and pipeline_s is None:
        raise ValueError("weigh: neither side has a plan")
    if pipeline_s is None or one_stage_s is not None and one_stage_s <= pipeline_s:
        return Weighed(Choice.ONE_STAGE, one_stage_s, pipeline_s, f"chose {one_stage}; weighed against {pipeline}")
    return Weighed(Choice.PIPELINE, one_stage_s, pipeline_s, f"chose {pipeline}; {one_stage}")
