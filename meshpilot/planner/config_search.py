"""meshpilot's own configuration for a model, a cluster and a global batch: TP / PP / DP, schedule, microbatches,
recomputation and split searched, the best few planned and simulated as ``config_plan`` plans a published one.

``config_plan`` plans a configuration as stated; this module chooses one. Every candidate it reports is a
:class:`~meshpilot.planner.config_plan.ParallelConfig` whose plan is the one ``meshpilot plan --config`` would
build for it, and the configuration kept is the one whose *simulated* step is the shortest among those planned.

1. Enumeration (:func:`enumerate_configs`)
------------------------------------------
For N devices and a global batch of G sequences: TP t divides the server (t ≤ its GPUs: Megatron's pairs stay
on NVLink), PP p divides N / t, DP d = N / (t · p); micro-batch size m and microbatches B with d · B · m = G;
schedules 1F1B and ZB-H1 (v = 1) and interleaved 1F1B (v ≥ 2 chunks a group, B a multiple of p); the chunks
p · v cut by ``config_plan.stage_bounds`` (``split=even`` or ``ends``); recomputation none, selective or full.
GPipe is
left out: 1F1B has its bubble with fewer microbatches in flight. p = 1 is a single stage (1F1B of one stage:
gradient accumulation over B). Context parallelism (:func:`tp_cp`): for sequences of at least
:data:`CONTEXT_FROM` tokens, TP is a whole server's and CP c (1, 2, 4, … while each CP rank keeps at least
:data:`CONTEXT_SHARD` tokens) divides N / t too, d = N / (t · c · p), with one sequence a microbatch (m = 1).
ZeRO 1 (``config_plan``, *ZeRO*: AdamW's states and update sharded over DP · CP) wherever d · c > 1: it is not a
choice to search, since in the model it never costs time (the update shrinks, the reduce-scatter and all-gather
are the all-reduce's bytes) and never adds memory; the pieces' states and update are cut so (:func:`_sharded`).

2. Pieces, priced once per (TP, recomputation) (:class:`Pieces`)
----------------------------------------------------------------
The model captured once with one sequence (``stack.capture_stack``; with every block recomputed, whole for
``recompute=full`` or its selective region for ``selective``: ``config_plan.recomputed_stack``); its three pieces —
the pre layers, one middle block, the post layers — planned on a ``(1, t)`` mesh of one server's ranks (``(1, c,
t)`` with CP: ``config_plan``'s pins and views, the sequence on the CP axis; the gradients' reduction over CP
taken out of the per-microbatch time, since the step's sync prices it) under
Megatron's pins with sequence parallelism, its norm outputs gathered again in the backward, and the boundary pins
(``config_plan.stage_setup``, what ``plan_config`` plans at ``sp=1``, its default):
per microbatch of one sequence each piece's time ``τ_x`` (compute, TP collectives,
resharding: no DP axis, so no gradient sync), its optimizer step ``o_x`` and its memory parts
(``stage.StageMemory``). A replica's microbatch of m sequences is priced at m times one (compute-bound pieces at
this size; saved and live activations m-fold, weights and states once).

3. The estimate of a candidate (:func:`estimate`)
-------------------------------------------------
Chunk j of layers ``[a, b)`` is pieces P, k blocks, Q (``Stack.parts``): ``t_j = m · (τ_P + k · τ_blk + τ_Q)``.
Group g (chunks j ≡ g mod p) works ``w_g = Σ_j t_j`` a microbatch; with the busiest group's ``w``:

    step ≈ (B + β) · w + X_g + Σ_j o_j

β the pipeline's fill and drain in microbatches of a group: ``p − 1`` for 1F1B, ``(p − 1) / v`` interleaved,
``(p − 1) / 3`` for ZB-H1 (its bubble ``(p − 1)(F + I − W)`` with F, I, W about equal), 0 for one stage.
``X_g`` is the group's gradient sync left exposed after the overlap its plan simulates (``config_plan.
exposed_sync``, the module docstring's *The gradients' synchronisation, overlapped*): chunk j's sync ``AR_DP(grads_j)``,
the gradient all-reduce over the group's DP axis by the cost model (``cluster.CostModel`` on the group's ``(DP,
TP)`` mesh, the ranks ``config_plan.stage_ranks`` gives it; with CP over its ``DP · CP`` ranks), issued when the
chunk's last backward ends, with its forward and backward ``m · Σ`` of its pieces' (``Piece.forward_s``): under
interleaved 1F1B all but the last-finishing chunk's sync hides behind the drain's backwards; one chunk a group
leaves it all exposed.
The sends between stages are left
out of the estimate (the simulation has them).

Memory bound (Eq. 5 per group, ``config_plan.group_bound``): chunk j composed from its pieces
(``stack._compose_one``: the forward + backward peak ``fb_j``, the update's ``upd_j``, the saved activations
``act_j``), and group g's chunk-microbatches in flight at once walked over its schedule's actions
(``config_plan.in_flight_peaks``; one chunk a group: ``h_j``, 1F1B ``min(B, p − j)``, ZB-H1 ``min(B, p)``):

    M_g = max( Σ_{j≡g} upd_j,  min(A_g, R_g) + max_t Σ_{j≡g} n_j(t) · act_j )  ≤  capacity  for every g,

``A_g = Σ_{j≡g} (fb_j − act_j)`` every chunk at its own peak, ``R_g = Σ_{j≡g} r_j + max_{j≡g} (fb_j − r_j)``
one chunk computing while the others hold their resident bytes ``r_j`` (weights, states, inputs, gradients).

This is the bound ``plan_config``'s plan reports (``config_plan.group_memory`` over its chunks' costs), at one
sequence's pieces scaled m-fold.

4. Exact plans (:func:`search_configs`)
---------------------------------------
Candidates within the memory bound, by estimate, best first; the first ``top`` of at most :data:`MAX_PLANNED`
chunk-microbatches are planned with
``plan_config`` (the model captured at their own microbatch, d · m sequences) and simulated with
``simulate_config``; a plan whose own Eq. 5 exceeds the capacity is reported and not kept. The answer is the
planned candidate with the shortest simulated step. Planning stops early once the next candidate's estimate
exceeds the best simulated step so far by more than :data:`ESTIMATE_MARGIN` (the candidates come by estimate,
so every later one does too): on the frontier rows the estimates were within 1.2 % of their plans' simulated
steps, so a candidate estimated 5 % slower than a plan already made cannot be the answer unless the estimate
erred four times as far. Each exact plan costs about 30 CPU s on the CP16 row (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
from meshpilot.errors import UserError
from meshpilot.models.sources import pre_shifted_labels, unpacked_sequences
from meshpilot.planner.config_plan import (
    ConfigPlan,
    Float8,
    ParallelConfig,
    Recompute,
    Split,
    context_views,
    exposed_sync,
    group_bound,
    group_memory,
    plan_config,
    recompute_of,
    recomputed_stack,
    simulate_config,
    stage_bounds,
    stage_mesh,
    stage_ranks,
    stage_setup,
    state_cut,
    update_cut_seconds,
)
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.schedule import PipelineKind
from meshpilot.planner.stack import Stack, _compose_one, capture_stack
from meshpilot.planner.stage import StageMemory, StagePlanner
from meshpilot.planner.zero import ZeroMode

if TYPE_CHECKING:
    from meshpilot.cluster.topology import Cluster

Build = Callable[[int], tuple[torch.nn.Module, Sequence[Any]]]
"""A model and its inputs for a microbatch of the whole step of so many sequences (DP · micro-batch size)."""

MICRO_BATCHES = (1, 2, 4)
"""Micro-batch sizes the search tries."""
SCHEDULES = (PipelineKind.ONE_F_ONE_B, PipelineKind.ZERO_BUBBLE, PipelineKind.INTERLEAVED_1F1B)
"""The schedules it tries (module docstring, 1)."""
MAX_PLANNED = 4096
"""Candidates whose step runs more chunk-microbatches (p · v · B) than this are estimated, not planned: the
simulation of one grows with them (Llama 3's 16,384-GPU configuration runs 2,048 in 0.8 s; a ZB-H1 pipeline of 128
stages and 128 microbatches took minutes)."""
RECOMPUTES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
"""Recomputation choices it tries: none, every block's selective region, or every block whole."""
CONTEXT_FROM = 32768
"""Sequences at least this long are offered context parallelism (module docstring, 1); shorter ones plan CP 1,
as Llama 3 did below its 128K stage."""
CONTEXT_SHARD = 8192
"""The fewest tokens a CP rank keeps of a sequence: Llama 3's CP16 at 131,072 tokens leaves each CP rank 8,192, the
sequence of its short-context stages (higher degrees would thin every GEMM's rows)."""


@dataclass(frozen=True)
class Piece:
    """One piece planned on a ``(1, t)`` mesh for a one-sequence microbatch (module docstring, 2)."""

    per_mb_s: float
    """Forward and backward, TP collectives and resharding included, one microbatch."""
    optimizer_s: float
    memory: StageMemory
    forward_s: float = 0.0
    """Of ``per_mb_s``: the forward (its compute and collectives)."""


@dataclass(frozen=True)
class Pieces:
    """The pre layers, one block and the post layers at one (TP, CP, recomputation)."""

    tp: int
    recompute: Recompute
    pre: Piece
    block: Piece
    post: Piece


@dataclass(frozen=True)
class Candidate:
    """One configuration: its estimate, its memory bound and, once planned, its simulated step."""

    config: ParallelConfig
    estimate_s: float
    memory_bytes: float
    """The estimate's Eq. 5 per GPU, the fullest group (module docstring, 3)."""
    simulated_s: float | None = None
    plan_memory_bytes: float | None = None
    """The plan's own Eq. 5 per GPU (its stages' ``memory_bytes`` summed per group), once planned."""
    plan_s: float | None = None
    """Seconds to capture, plan and simulate it."""
    fits: bool = True
    """Within the capacity by the estimate's bound, and by the plan's own once planned."""


@dataclass(frozen=True)
class SearchResult:
    """:func:`search_configs`' answer."""

    best: ConfigPlan
    """The kept configuration's plan (``plan_config``'s)."""
    best_step_s: float
    """Its simulated step."""
    planned: tuple[Candidate, ...]
    """The candidates planned and simulated, by estimate."""
    leading: tuple[Candidate, ...]
    """The best estimates within the memory bound (the planned ones among them)."""
    enumerated: int
    over_memory: int
    """Candidates of the first estimates checked that the memory bound ruled out."""
    capacity: float
    planning_s: float
    """Wall seconds of the whole search."""
    cpu_s: float
    """CPU seconds of this process for it."""


def config_string(cfg: ParallelConfig) -> str:
    """`cfg` as ``--config`` reads it (``config_plan.parse_config``)."""
    parts = [f"tp={cfg.tp}", *([f"cp={cfg.cp}"] if cfg.cp > 1 else []), f"pp={cfg.pp}", f"dp={cfg.dp}"]
    parts.append(f"schedule={cfg.schedule.value}")
    if cfg.virtual > 1:
        parts.append(f"virtual={cfg.virtual}")
    parts += [f"microbatches={cfg.microbatches}", f"micro_batch={cfg.micro_batch}"]
    parts += [f"recompute={cfg.recompute.value}", f"split={cfg.split.value}", f"precision={cfg.precision}"]
    if cfg.zero:
        parts.append(f"zero={cfg.zero}")
    if cfg.tp > 1 and not cfg.sequence_parallel:
        parts.append("sp=0")
    if cfg.float8 is not Float8.NONE:
        parts.append(f"float8={cfg.float8.value}")
    return ",".join(parts)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _server(cluster: Cluster) -> int:
    """GPUs a server holds: the innermost layer's units."""
    return cluster.layers[-1].ranks if cluster.layers else 1


def enumerate_configs(
    stack: Stack, cluster: Cluster, devices: int, global_batch: int, precision: str, seq: int = 0
) -> list[ParallelConfig]:
    """Every configuration of module docstring 1 whose chunks cut `stack`'s blocks (CP offered for a sequence of
    `seq` tokens: :func:`tp_cp`)."""
    out = []
    for t, c in tp_cp(cluster, devices, seq):
        for p in _divisors(devices // (t * c)):
            d = devices // (t * c * p)
            for m in (x for x in MICRO_BATCHES if global_batch % (d * x) == 0 and (c == 1 or x == 1)):
                B = global_batch // (d * m)
                for kind, v, split in _schedules(stack, p, B):
                    for rc in RECOMPUTES:
                        out.append(ParallelConfig(tp=t, cp=c, pp=p, dp=d, schedule=kind, virtual=v, microbatches=B,
                                                  micro_batch=m, recompute=rc, precision=precision,
                                                  split=split, zero=_zero(d, c)))  # fmt: skip
    return out


def _zero(dp: int, cp: int) -> int:
    """The ZeRO stage of a candidate (module docstring, 1): 1 wherever there are ranks to shard over."""
    return 1 if dp * cp > 1 else 0


def tp_cp(cluster: Cluster, devices: int, seq: int) -> list[tuple[int, int]]:
    """The (TP, CP) degrees offered: TP every divisor of a server's GPUs with CP 1; for a sequence of at least
    :data:`CONTEXT_FROM` tokens, TP of a whole server with CP 1, 2, 4, … (dividing the devices and the sequence
    into cp · tp even shares, one sequence a replica's microbatch, each CP rank at least :data:`CONTEXT_SHARD`
    tokens), Llama 3's layout (TP inside a server, CP across servers): a narrower TP holds a whole sequence's
    activations on fewer GPUs, which is what CP is for."""
    server = _server(cluster)
    out = [(t, 1) for t in _divisors(server) if devices % t == 0]
    if seq < CONTEXT_FROM or devices % server:
        return out
    out = [(server, 1)]
    c = 2
    while devices % (server * c) == 0 and seq % (server * c) == 0 and seq // c >= CONTEXT_SHARD:
        out.append((server, c))
        c *= 2
    return out


def _schedules(stack: Stack, p: int, B: int) -> list[tuple[PipelineKind, int, Split]]:
    """(schedule, v, split) of p groups and B microbatches whose chunks cut the stack."""
    if p == 1:
        return [(PipelineKind.ONE_F_ONE_B, 1, Split.EVEN)]
    options = [(k, 1) for k in SCHEDULES if k != PipelineKind.INTERLEAVED_1F1B]
    if B % p == 0:
        most = (stack.blocks + 2) // p
        options += [(PipelineKind.INTERLEAVED_1F1B, v) for v in range(2, most + 1)]
    out = []
    for kind, v in options:
        for split in Split:
            if _cuts(stack, p * v, split):
                out.append((kind, v, split))
    return out


def _cuts(stack: Stack, chunks: int, split: Split) -> bool:
    try:
        stage_bounds(stack.pre, stack.blocks, stack.post, chunks, split)
    except UserError:
        return False
    return True


def plan_pieces(
    model: torch.nn.Module, inputs: Sequence[Any], stack: Stack, sp: StagePlanner, tp: int, cp: int = 1
) -> Pieces | None:
    """:class:`Pieces` at TP `tp` and CP `cp` (module docstring, 2) of `stack`, the one-sequence capture of
    `model` on `inputs` (recomputed or not), planned by `sp` on ``(1, tp)`` or, with CP, on ``(cp, tp)``: the pins of
    ``(1, cp, tp)`` without their DP axis of one device (the same plans; DTensor's expansion of each op's
    strategies over three axes was most of the search's time); None when a piece has no plan (e.g. heads that TP
    does not divide)."""
    recompute = recompute_of(stack)
    cfg = ParallelConfig(tp=tp, cp=cp)
    mesh = stage_mesh(cfg)
    try:  # the pins and re-gathered stack plan_config plans with (the stack already recomputed or not)
        stack, sp, force = stage_setup(model, inputs, stack, sp.cluster, cfg, sp, mesh)
    except UserError:
        return None
    if cp > 1:
        mesh, force = mesh[1:], {k: _without_first_axis(v) for k, v in force.items()}
    ranks = stage_ranks(cfg)[0]
    end = len(sp.layers)
    ranges = [(0, stack.pre), (stack.middle, stack.middle + 1), (end - stack.post, end)]
    got = []
    for a, b in ranges:
        try:
            with context_views(cfg):
                cost, mem = sp.plan_with_memory(a, b, ranks, mesh, microbatches=1, zero=ZeroMode.OFF, force=force)
        except PlanError:  # a piece with no plan at this TP (heads it does not divide): the TP is not offered
            return None
        t = cost.time
        # the gradients' reduction over CP happens once a step: the estimate's sync over DP · CP prices it
        once = (
            sum(x.seconds for x in sp.last_collectives() if x.axis == 0 and x.dst.startswith("grad:")) if cp > 1 else 0
        )
        got.append(Piece(t.compute_s + t.communication_s + t.resharding_s - once, t.optimizer_s, mem, cost.forward_s))
    return Pieces(tp, recompute, *got)


def _without_first_axis(layout: str) -> str:
    """A layout string (``S(0)S(1)R``, ``P(sum)RR``) without its first axis' placement."""
    first = re.match(r"S\(\d+\)|P\(\w+\)|P|R", layout)
    return layout[first.end() :] if first else layout


def _scaled(m: StageMemory, mb: int) -> StageMemory:
    return replace(m, saved=m.saved * mb, live_peak=m.live_peak * mb)


def _sharded(m: StageMemory, shards: int) -> StageMemory:
    """A piece's memory with AdamW's states and the update's temporary sharded over `shards` ranks
    (``config_plan.sharded_states`` on the pieces: ``config_plan.state_cut``)."""
    if shards == 1:
        return m
    held, update = state_cut(m.update_temp, shards)
    return replace(m, static=m.static - held, update_temp=m.update_temp - (update - held))


def _sharded_update(x: Piece, shards: int, device: Any) -> float:
    """A piece's update seconds with its streams over a 1/`shards` shard (``config_plan.sharded_states``)."""
    return x.optimizer_s - update_cut_seconds(x.memory.update_temp, shards, device)


def _bubble(cfg: ParallelConfig) -> float:
    p = cfg.pp
    if p == 1:
        return 0.0
    if cfg.schedule == PipelineKind.INTERLEAVED_1F1B:
        return (p - 1) / cfg.virtual
    if cfg.schedule == PipelineKind.ZERO_BUBBLE:
        return (p - 1) / 3
    return float(p - 1)


@dataclass(frozen=True)
class _Chunk:
    """One chunk of a candidate, from its pieces."""

    per_mb_s: float
    optimizer_s: float
    pieces: tuple[tuple[StageMemory, int], ...]
    """Each piece's memory (m-fold activations) and how many times the chunk holds it."""
    forward_s: float = 0.0
    """Of ``per_mb_s``: the forward."""


@dataclass
class _Estimator:
    """Prices candidates from :class:`Pieces` (module docstring, 3)."""

    stack: Stack
    cluster: Cluster
    pieces: dict[tuple[int, int, Recompute], Pieces]
    """(TP, CP, recomputation) → its pieces."""
    _meshes: dict[tuple[int, int, int, int], CostModel] = field(default_factory=dict)

    def chunks(self, cfg: ParallelConfig) -> list[_Chunk]:
        """`cfg`'s chunks from the pieces at its TP and recomputation."""
        pc = self.pieces[(cfg.tp, cfg.cp, cfg.recompute)]
        st = self.stack
        out = []
        for a, b in stage_bounds(st.pre, st.blocks, st.post, cfg.pp * cfg.virtual, cfg.split):
            pre, k, post = st.parts(a, b)
            used = [(x, w) for x, w in ((pc.pre, pre is not None), (pc.block, k), (pc.post, post is not None)) if w]
            shards = cfg.dp * cfg.cp if cfg.zero else 1
            out.append(_Chunk(
                cfg.micro_batch * sum(x.per_mb_s * w for x, w in used),
                sum(_sharded_update(x, shards, self.cluster.device) * w for x, w in used),
                tuple((_sharded(_scaled(x.memory, cfg.micro_batch), shards), int(w)) for x, w in used),
                cfg.micro_batch * sum(x.forward_s * w for x, w in used),
            ))  # fmt: skip
        return out

    def time(self, cfg: ParallelConfig, chunks: Sequence[_Chunk]) -> float:
        """The estimated step (module docstring, 3)."""
        p = cfg.pp
        work = [sum(c.per_mb_s for c in chunks[g::p]) for g in range(p)]
        g = int(np.argmax(work))
        sync = [0.0] * len(chunks)
        if cfg.dp * cfg.cp > 1:
            cost = self._cost(cfg)
            for j in range(g, len(chunks), p):
                sync[j] = cost.all_reduce(sum(m.grads * w for m, w in chunks[j].pieces), 0)
        fwd = [c.forward_s for c in chunks]
        bwd = [c.per_mb_s - c.forward_s for c in chunks]
        exposed = exposed_sync(cfg.schedule, p, cfg.virtual, cfg.microbatches, g, fwd, bwd, sync)
        opt = sum(c.optimizer_s for c in chunks[g::p])
        return (cfg.microbatches + _bubble(cfg)) * work[g] + exposed + opt

    def memory(self, cfg: ParallelConfig, chunks: Sequence[_Chunk]) -> float:
        """The Eq. 5 bound per GPU of the fullest group (module docstring, 3)."""
        fb, upd, act, _, resident = zip(*(_compose_one(c.pieces) for c in chunks))
        return group_bound(cfg.schedule, cfg.pp, cfg.virtual, cfg.microbatches, fb, upd, act, resident)

    def _cost(self, cfg: ParallelConfig) -> CostModel:
        """The cost model of the group's ``(DP · CP, TP)`` ranks: the gradients are reduced over DP and CP."""
        key = (cfg.dp, cfg.cp, cfg.tp, cfg.pp)
        if key not in self._meshes:
            shape = (cfg.dp * cfg.cp, cfg.tp)
            ranks = np.array(stage_ranks(cfg)[0]).reshape(shape)
            self._meshes[key] = CostModel(LogicalMesh(self.cluster, shape, ranks))
        return self._meshes[key]


def estimate(est: _Estimator, cfg: ParallelConfig) -> float:
    """The estimated step of `cfg` (module docstring, 3)."""
    return est.time(cfg, est.chunks(cfg))


@dataclass
class _Captures:
    """One capture per microbatch of the whole step (sequences), shared by the plans of that size, and its
    recomputed stack; each with its planner (the plans of one graph share its cache)."""

    build: Build
    precision: str
    cluster: Cluster
    seq: int = 0
    """The sequence length of the inputs (dim 1 of the token ids), known after the first capture. Every capture
    is made under ``models.sources.unpacked_sequences`` (attention ``is_causal``, no ``[b, 1, t, t]`` mask
    tensor), as eager training on whole sequences runs it, and as ``plan --config`` and the frontier bench
    capture: a profile with flash attention's rates prices the causal call at its causal rate. From
    :data:`CONTEXT_FROM` tokens (CP offered) a Hugging Face decoder's labels are given pre-shifted
    (``models.sources.pre_shifted_labels``), so that a CP plan can hold the sequence in Llama 3's balanced
    order (``config_plan``, *Balanced CP*)."""
    _got: dict[tuple[int, Recompute], tuple[Any, Any, Stack, StagePlanner]] = field(default_factory=dict)

    def __call__(self, rows: int, rc: Recompute = Recompute.NONE) -> tuple[Any, Any, Stack, StagePlanner]:
        if (rows, Recompute.NONE) not in self._got:
            model, inputs = self.build(rows)
            first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
            self.seq = int(first.shape[1]) if first is not None and first.dim() >= 2 else 0
            if self.seq >= CONTEXT_FROM:
                model, inputs = pre_shifted_labels(model, tuple(inputs))
            with unpacked_sequences():
                stack = capture_stack(model, inputs, precision=self.precision)
            if not isinstance(stack, Stack):
                raise UserError("config search: the model is not a stack of at least 5 identical blocks")
            self._got[(rows, Recompute.NONE)] = (model, inputs, stack, StagePlanner(stack.graph, self.cluster))
        if (rows, rc) not in self._got:
            model, inputs, stack, _ = self._got[(rows, Recompute.NONE)]
            stack = recomputed_stack(stack, rc)
            self._got[(rows, rc)] = (model, inputs, stack, StagePlanner(stack.graph, self.cluster))
        return self._got[(rows, rc)]


def search_configs(
    build: Build,
    cluster: Cluster | str,
    devices: int,
    global_batch: int,
    *,
    precision: str = "bf16",
    capacity: float | None = None,
    top: int = 3,
    shown: int = 10,
) -> SearchResult:
    """meshpilot's own configuration for `build`'s model on `devices` of `cluster` at `global_batch` sequences
    a step (module docstring): enumerated, estimated from pieces, bounded by Eq. 5 at `capacity` (default: the
    device's memory), the `top` best estimates planned and simulated, the fastest simulated kept. Raises a
    UserError when no candidate fits or none can be planned."""
    t0, c0 = time.perf_counter(), os.times()
    cl = load_cluster(cluster)
    if devices > cl.num_devices or devices < 1:
        raise UserError(f"config search: {devices:,} devices on {cl.name!r} of {cl.num_devices:,}; give 1..that")
    cap = float(capacity if capacity is not None else cl.device.memory_bytes)
    captures = _Captures(build, precision, cl)
    one = captures(1)[2]
    seq = captures.seq
    pieces = {}
    for t, c in tp_cp(cl, devices, seq):
        for rc in RECOMPUTES:
            got = plan_pieces(*captures(1, rc), t, c)
            if got is not None:
                pieces[(t, c, rc)] = got
    est = _Estimator(one, cl, pieces)
    configs = [
        c
        for c in enumerate_configs(one, cl, devices, global_batch, precision, seq)
        if (c.tp, c.cp, c.recompute) in pieces
    ]
    if not configs:
        raise UserError(
            f"config search: no TP / PP / DP of {devices:,} devices gives {global_batch} sequences a step; "
            "give a batch that a DP degree divides"
        )
    ranked = sorted(((estimate(est, c), c) for c in configs), key=lambda x: x[0])
    leading, over = _within_memory(est, ranked, cap, top, shown)
    if not leading:
        raise UserError(f"config search: no configuration of the {len(ranked)} fits {cap / 2**30:.1f} GiB a GPU")
    planned, best = _plan_best(captures, cl, [c for c in leading if _plannable(c.config)][:top], cap)
    if best is None:
        raise UserError("config search: none of the best estimates fits once planned; give more memory")
    planned_by = {c.config: c for c in planned}
    leading = [planned_by.get(c.config, c) for c in leading]
    cpu = sum(os.times()[:2]) - sum(c0[:2])
    return SearchResult(best[0], best[1], tuple(planned), tuple(leading), len(configs), over, cap,
                        time.perf_counter() - t0, cpu)  # fmt: skip


ESTIMATE_MARGIN = 0.05
"""How far over the best simulated step so far a candidate's estimate may be and still be planned (module
docstring, 4)."""


def _plannable(cfg: ParallelConfig) -> bool:
    return cfg.pp * cfg.virtual * cfg.microbatches <= MAX_PLANNED


def _within_memory(est: _Estimator, ranked, cap: float, top: int, shown: int) -> tuple[list[Candidate], int]:
    """The first candidates of `ranked` (estimate, config) within the memory bound — at least `shown`, and
    enough to hold `top` plannable ones — and how many before the last of them the bound ruled out."""
    out, over, plannable = [], 0, 0
    for s, cfg in ranked:
        mem = est.memory(cfg, est.chunks(cfg))
        if mem > cap:
            over += 1
            continue
        out.append(Candidate(cfg, s, mem))
        plannable += _plannable(cfg)
        if len(out) >= shown and plannable >= top:
            break
    return out, over


def _plan_best(captures: _Captures, cl: Cluster, chosen: Sequence[Candidate], cap: float):
    """Plan and simulate `chosen` (module docstring, 4): the candidates as planned, and (plan, step) of the
    fastest that fits."""
    planned, best = [], None
    for c in chosen:
        if best is not None and c.estimate_s > best[1] * (1 + ESTIMATE_MARGIN):
            break  # this one and every later (slower) estimate: module docstring, 4
        t0 = time.perf_counter()
        model, inputs, stack, sp = captures(c.config.graph_batch, c.config.recompute)
        cp = plan_config(model, inputs, stack, cl, c.config, planner=sp)
        step = simulate_config(cp).step_s
        mem = group_memory(cp)
        got = replace(c, simulated_s=step, plan_memory_bytes=mem, plan_s=time.perf_counter() - t0, fits=mem <= cap)
        planned.append(got)
        if got.fits and (best is None or step < best[1]):
            best = (cp, step)
    return planned, best


__all__ = [
    "Build",
    "Candidate",
    "Piece",
    "Pieces",
    "SearchResult",
    "config_string",
    "enumerate_configs",
    "estimate",
    "plan_pieces",
    "search_configs",
]
