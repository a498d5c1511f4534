"""Pipeline planning: slicing the model into stages and the cluster into submeshes (Alpa §5, Eq. 2–6).

The single-stage planner (``meshpilot.planner.auto``) shards every operator over one mesh. Here the model's layers
(``stage.runnable_layers``: the ones the runtime runs) are cut into S contiguous *stages*, the devices into S
*submeshes*, and each stage runs its own intra-operator plan on its submesh (``stage.StagePlanner.plan``, cached),
the stages passing activations forward and gradients backward under a synchronous schedule of B microbatches (1F1B
by default, GPipe, Interleaved1F1B or zero bubble ZB-H1: ``schedule.PipelineKind``). The graph given is the step
of **one microbatch**; :func:`plan_pipeline` finds the stages, submeshes and logical mesh shapes that minimise the
predicted step. The result, :class:`Plan`, saves as JSON (``to_json`` / ``from_json``), gives its step as a
``Schedule`` (``step_schedule``: what the simulator times and ``meshpilot.runtime.pipeline`` runs) and the module
names the runtime cuts the model at (``split_points``).

1. Layer clustering (Alpa Eq. 6) — :func:`cluster_layers`
---------------------------------------------------------
The K layers ``ℓ_0..ℓ_{K-1}`` (embedding and head included, each with its own FLOPs: forward + backward)
are grouped into L contiguous *clusters*, the units the stage DP cuts between. With

    FLOP(i..k)  = Σ_{j=i..k} flops(ℓ_j)                                           → ``flops`` prefix sums
    C(i, k)     = bytes of the values that layers i..k read but a layer outside  → :func:`received_bytes`
                  i..k makes (forward activations from before, gradients from
                  after, shared weights): what the cluster receives per microbatch
    allowed(i,k) = FLOP(i..k) ≤ (1 + δ) · FLOP(0..K-1) / L   or   i = k         → ``ok`` (a layer never splits)

Alpa's recurrence minimises the largest C of any cluster:

    G(k, r) = min_{i ≤ k, allowed(i,k)} max(G(i−1, r−1), C(i, k)),   G(−1, 0) = 0

We take G(K−1, L) exactly and, among the clusterings that reach it, the one with the fewest bytes received
in all: for a threshold c, ``H_c(k, r) = min_{i, allowed(i,k), C(i,k) ≤ c} H_c(i−1, r−1) + C(i,k)`` is
finite iff some clustering keeps every cluster at or under c, so the smallest such c over the sorted
distinct values of C (a binary search) is G(K−1, L), and H at it is the total (``_min_sum``). When no
clustering satisfies the FLOP bound, δ doubles until one does (``Clustering.delta`` says which was used).
With K ≤ L every layer is a cluster.

2. Submeshes (Alpa §5.2, Theorem 1) — :func:`submesh_sizes`, :func:`place`
-------------------------------------------------------------------------
The n used devices are N nodes of M (M = the ranks of the cluster's innermost layer; n ≤ M: one node of
n). A stage gets a submesh of shape (1, 2^m) with 2^m dividing M, or (q, M) for q = 1..N. Any list of these
whose sizes add up to n covers the devices: place the largest first, each on the next contiguous ranks
(``place``); every block then starts at a multiple of its size, so a (1, 2^m) block stays inside one node
and a (q, M) block is q whole nodes. Stage costs are measured on the canonical ranks ``0..size−1``
(``StagePlanner.plan(…, range(size), …)``, as Alpa profiles one submesh of each shape); the chosen stages
are then re-costed on the ranks :func:`place` gave them (the same numbers on clusters whose aligned blocks
are alike: ``alpa-p3x8``, ``atp-ic*``). Placement is larger submeshes first, stage order among equals —
not yet "neighbouring stages closest", which Alpa also does.

Large clusters. On N = 512 nodes of 8 there are 515 submesh sizes and a (q, 8) submesh has as many logical
shapes as 8q has divisors, each a block search; the DP's tables are dense over sizes. ``plan_pipeline``'s
``submeshes`` keeps only some of Theorem 1's sizes (e.g. 2^j whole nodes: any sum of them that equals n
still covers the devices, the same placement) and ``shapes`` only some logical shapes
(:class:`LogicalShapes`: ``IN_NODE`` keeps (d/b, b) with b dividing M, tensor parallelism inside a node);
the plan is then the best over those. With every size a multiple of u (8 for whole nodes) the DP counts
devices in units of u: F(s, k, d) is only reachable at multiples of u, so the same recurrence on d/u.

3. Stage costs and the memory check (Alpa Eq. 5) — ``_StageTable``
-----------------------------------------------------------------
For clusters k..i, submesh size d and logical shape (a, b) with a·b = d (``mesh_shapes_2d``):
``c = StagePlanner.plan(layers of k..i, range(d), (a, b), microbatches=B)`` — for every range but those the
stage runtime refuses, where a value made before k is read after i and would cross the stage whole
(:func:`refused_ranges`: GPT's ``wpe`` alone, between the embedding and the first block). Its ``time`` is the whole
step of the stage over B microbatches (``accounting.account``: B forwards and backwards, the gradients'
synchronisation once), so the per-microbatch latency with the synchronisation amortised is

    t = c.time.total_s / B                                                         → ``t``

A stage with s stages from it to the end (itself included) keeps up to f(s) microbatches' activations in
flight — min(B, s) under 1F1B, B under GPipe, min(B, S) under ZB-H1 (a microbatch's saved values are held
until its ``W``, which the later stages delay), counted on the schedule itself (``stage_in_flight``) — so it
fits when

    max(P.update, P.forward_backward + (f(s) − 1) · P.activations) ≤ capacity        → ``stage_memory``

with ``P = c.peaks`` (``accounting.phase_peaks``: the optimizer step's peak, the forward + backward peak with
one microbatch in flight, and one microbatch's saved activations — counted even where the optimizer step
is the single-microbatch peak). ``t_intra(k..i, d, s)`` is the least t over the logical
shapes that fit; none fitting (or the stage planner finding no plan) is ∞. The searches of one size d share
nothing with another size's, so the table is filled a column per size in ``workers`` forked processes
(``planner.parallel``), their stage costs merged back: the same table as one process fills.

4. The stage DP (Alpa Eq. 2–4) — :func:`_dp`
--------------------------------------------
For a bound t_max on every stage's t, F(s, k, d) is the least Σ t of clusters k..L−1 cut into s stages on d
devices:

    F(s, k, d) = min_{k ≤ i < L, size z ≤ d, t_intra(k..i, z, s) ≤ t_max}  t_intra(k..i, z, s) + F(s−1, i+1, d−z)
    F(0, L, 0) = 0,  F(0, k, d) = ∞ otherwise                                       → ``F[s][k, d]``

and the pipeline's step (Eq. 2), for the devices n:

    T*(t_max) = min_s F(s, 0, n) + (B − 1) · t_max,     T* = min_{t_max} T*(t_max)

``F`` is a numpy array over d, filled for all i and z at once per (s, k). The t_max tried are the distinct
t_intra values, ascending (Alpa's early pruning): every plan whose slowest stage is at least t_max takes
at least t_max + (B−1)·t_max, so the enumeration stops once B·t_max ≥ the best T* found; and values within
a factor (1 + ε) of the first untried one are tried together, at the largest of them. A plan found at t_max
is scored by its own slowest stage, Σ t_i + (B−1)·max t_i. So with ε = 0 the DP is exact (the tests check
it against brute force), and with ε > 0 the plan found is within (B−1)·ε·t_max ≤ ε·T* of the optimum
(the optimum's slowest stage shares a group with some tried t_max ≤ (1 + ε) times it).

Most groups have no plan at all: t_max under the slowest stage that any feasible pipeline must have
(on gpt3-39b, B = 64, 334 of 336 groups; the DP ran on each). Feasibility is monotone in t_max — a larger
t_max only adds entries to T — so the first feasible group is found by a binary search (⌈log₂ groups⌉ DPs)
and the ascending enumeration starts there (``_search_t_max``): the groups skipped are exactly those whose
DP finds nothing, so the plan is the same.

Alpa's ε is absolute (10⁻⁶ s, for stages of tens of milliseconds and more); ours is relative, so the
bound is a fraction of the step whatever the model's size (a tiny model's stages take microseconds).

Repeated stacks (``planner.stack``): when the model is L ≥ 4 identical blocks between special layers (or
the graph is a ``stack.Stack``: a few of its blocks captured), the table above is filled by
``stack.StackTable`` instead — each stage composed from one middle block's plan (k times) and its special
layers' plans, planned once per logical mesh and memory cap — and the same DP runs on it;
``Plan.costing`` and the printout say which path was taken (``fast=False`` forces the exact one).

5. What the runtime runs — :func:`runnable_layers`, :meth:`Plan.with_intra`, :func:`fixed_pipeline`
----------------------------------------------------------------------------------------------------------
The DP keeps each stage's cost, not its strategies. ``with_intra`` searches every chosen stage once more —
its slice over :func:`runnable_layers` (``stage.layers`` with the nodes no module made placed by their
dependencies, so that forward values flow to later stages and gradients to earlier ones; the same layers the
stage DP costs: ``StagePlanner.layers``) on the stage's
logical mesh and mapping, over the plan's microbatches — and keeps the resulting ``StagePlan`` per stage in
``PlanStage.plan``, which the JSON carries and ``meshpilot.runtime.pipeline`` runs. ``fixed_pipeline``
builds a plan from stages given by hand (layers, ranks, logical mesh), costed as the DP costs its own.

6. Interleaved1F1B — :func:`_plan_interleaved`, :func:`_interleaved_dp`
----------------------------------------------------------------------
P groups of devices each hold v chunks: the clusters are cut into V = v·P contiguous chunks, chunk j on group
j mod P (whose submesh size z_g every chunk of the group shares; each chunk its own logical shape). With
T_g = Σ t_j over group g's chunks, the closed form of the step (Narayanan et al. §2.2; Eq. 2 for v = 1: the
fill and drain run chunks a v-th of a group's work) is

    B · max_g T_g + (Σ_j t_j − max_g T_g) / v                                        → ``Plan.step_s``

and Eq. 5 per group adds its chunks' ``stage_memory``, each with its own in-flight count read off the schedule
(``schedule.stage_in_flight_of``): an upper bound, the chunks' peaks need not coincide. The search, for each P
(B a multiple of P, V ≤ L) and each tuple of group sizes (z_0..z_{P−1}) adding up to n:

    D(j, k) = the Pareto front of (T_0..T_{P−1}, M_0..M_{P−1}) over chunks 0..j−1 covering clusters 0..k−1
    D(j+1, i+1) ∋ D(j, k) + (t, mem) of chunk j over clusters k..i in one logical shape, on group j mod P,
                  kept while M_{j mod P} ≤ capacity                                  → ``_interleaved_dp``

The closed form rises with every T_g and with Σ t = Σ T_g, so a (T, M) matched or beaten in every group by
another cannot lead to a better plan: the front at (V, L) holds the optimum (the tests check it against
brute force). For the same reason a partial split whose closed form already exceeds a step some split reaches
(a first pass keeping 8 entries per front gives one) is dropped. A front is cut at ``INTERLEAVED_FRONT``
entries (then ``plan_pipeline`` warns).

The closed form is the simulator's step only for chunks of equal time: a skewed split (a heavy chunk followed
by a light one on the other group) keeps groups waiting inside each round of P microbatches, which the closed
form does not see (a 4-block GPT on 2 groups of ``alpa-p3x8``: closed form 0.96 ms, simulated 1.20 ms). So,
as Alpa bounds every stage by t_max, the DP is run for bounds on every chunk's t — the largest first, then
each time below the last optimum's slowest chunk, until nothing fits — and of these optima
(``_Interleaved``, each exact under its bound) the one with the shortest simulated step
(:meth:`Plan.simulate`) is the plan. A chunk that a value would cross whole (made before it, read
after it: :func:`bypassed`; on the GPTs the position embeddings alone, which the token embeddings' gradient
from the first block skips) is not an option: the stage runtime passes values to the next stage only.
``plan_pipeline(schedule="auto")`` plans every kind (``AUTO_ORDER``: 1F1B, ZB-H1, GPipe, Interleaved1F1B — the
last only where the others' stage costs are exact: on a repeated stack they are composed from one block's plan,
which this search does not use, and searching every range would undo that path's speed) and keeps the
shortest simulated step (the simulator also counts each boundary's send, which Eq. 2 leaves out;
ZB-H1's I and W are priced apart: :func:`input_grad_share`).

7. Zero bubble — ``schedule.zero_bubble``, :func:`input_grad_share`
------------------------------------------------------------------
ZB-H1's stages are the DP's (Eq. 2 with ZB-H1's memory rule above: the DP does not see its smaller bubble;
``auto`` and the printout's simulated step do). The simulator splits each stage's backward per microbatch,
t − forward, into ``I`` and ``W`` by FLOPs: ``I`` takes the share of the stage's backward FLOPs in the nodes
the gradients sent to the previous stage depend on (the split the stage runtime makes), ``W`` the rest.
Collectives and memory traffic are split in the same ratio, which the FLOPs need not reflect.

8. Transfers between stages — :func:`stage_transfers`, :class:`StageTransfer`
----------------------------------------------------------------------------
At the boundary between stages j and j + 1 (the model's layers cut at c), the values crossing each
microbatch are read off the whole graph, as the stage runtime reads them off the stages' slices
(``runtime.pipeline_stages.find_transfers``: the tests hold the two to the same values): every value made in
a layer before c and read in one at or after it (the forward's activations, sent j → j + 1), and every value
made at or after c and read before it (the backward's gradients, j + 1 → j); the model's inputs, constants,
parameters and buffers are every stage's own, and a tied weight's copies and gradient parts cross nothing
(``stage.stays_in_stage``). A stage runtime refuses a value that skips a stage (:func:`bypassed`), so what
crosses cut c is exactly what moves between j and j + 1. Per direction:

    bytes(j → j ± 1) = Σ_values numel · itemsize                                       → ``nbytes``
    seconds          = latency(a, b) + bytes / p2p_bandwidth(a, b)                     → ``seconds``

with a, b the stages' first ranks and the cluster's latency and P2P bandwidth of the highest layer where they
differ (``CostModel.send_recv_ranks``, what the simulator charges a send). Each value crosses once: the
runtime's row tiles with Alpa's local all-gather (``runtime.crossmesh``); without it a value replicated on the
receiver crosses once per replica, which this does not price. On a repeated stack (``planner.stack``) a cut
between the model's layers reads as the captured graph's cut with the same layers after it
(``Stack.graph_range``: two blocks apart are two kept blocks apart), so a 52-layer model's boundaries cost what
its 4-block capture shows. ``plan_pipeline`` stores them in ``Plan.transfers``; ``simulate`` sends each
boundary's bytes in both directions, so ``schedule="auto"`` ranks the kinds with the sends priced (Eq. 2 and
the DP still leave them out: the stage table has no boundary yet when it costs a stage).

Not modelled yet: the sends in the DP's objective (Eq. 2 leaves them out; the simulator and ``auto`` price
them, section 8), the schedule's own timeline in the
DP (it uses Eq. 2 and the closed form above; the simulator times a ``step_schedule`` with each stage's
forward, input- and weight-gradient times), the interleaved search on a ``Stack`` of fewer captured blocks
(it costs every range on its own: ``PlanError``), and a stage table entry searched for the memory that f(s)
microbatches in flight leave it (the ILP is given the whole device; a plan that then fails Eq. 5 is dropped,
not re-searched: only ``Plan.with_intra`` searches the chosen stages again under a lower capacity until
their Eq. 5 fits), and activation rematerialization (Alpa recomputes activations, §9): the first of S stages
holds f(S) microbatches' saved values of all its layers, which on GPT-39B (64 V100s, B = 64) leaves its blocks
only the tightest cap levels' plans, 4–9× slower a microbatch than the other stages (docs/benchmarks.md).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from meshpilot.cluster.mesh import mesh_shapes_2d
from meshpilot.errors import UserError
from meshpilot.graph.capture import LEAF_KINDS, NodeKind, OpGraph, Phase
from meshpilot.planner.heap import spared_from_collection
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.parallel import map_columns, plan_workers
from meshpilot.planner.plan import Plan, PlanStage, StageTransfer
from meshpilot.planner.recompute import Recompute, RecomputeMode
from meshpilot.planner.schedule import (
    PipelineKind,
    held_until_weight,
    pipeline,
    stage_in_flight_of,
)
from meshpilot.planner.stack import MIN_BLOCKS, Stack, StackTable, StageCosting, TableCosting, find_stack
from meshpilot.planner.stage import Layer, StageCost, StagePlanner, runnable_layers, stays_in_stage

DEFAULT_DELTA = 0.1
"""Clusters may exceed the average FLOPs by this fraction (Eq. 6's δ)."""


DEFAULT_EPSILON = 1e-3
"""t_max values within this fraction of each other are tried together; the step found is within this
fraction of the optimum (module docstring, section 4; Alpa §5.2 uses an absolute 10⁻⁶ s)."""


# ---------------------------------------------------------------- 1. layer clustering


def received_bytes(graph: OpGraph, all_layers: Sequence[Layer]) -> np.ndarray:
    """``C[i, k]`` (i ≤ k): bytes of the values layers i..k read that a layer outside i..k makes (a tied
    parameter and its gradient's parts are not read across: each stage has its copy and keeps its part,
    ``stage.slice_graph``)."""
    where = {name: j for j, layer in enumerate(all_layers) for name in layer.nodes}
    stays = stays_in_stage(graph, all_layers)
    readers: dict[tuple[str, int], set[int]] = {}
    for n in graph.nodes:
        for src, idx in n.inputs:
            if stays(src, n.name):
                continue
            readers.setdefault((src, idx), set()).add(where[n.name])
    K = len(all_layers)
    C = np.zeros((K, K))
    idx = np.arange(K)
    for (src, i), users in readers.items():
        p = where[src]
        users = users - {p}
        info = graph[src].outputs[i]
        if not users or info is None:
            continue
        # next_user[a] = the first reading layer ≥ a (K when none): range [a, b] reads it iff next_user[a] ≤ b
        sorted_users = sorted(users)
        next_user = np.array([next((u for u in sorted_users if u >= a), K) for a in range(K)])
        reads = next_user[:, None] <= idx[None, :]
        makes = (idx[:, None] <= p) & (p <= idx[None, :])
        C += np.where(reads & ~makes, float(info.nbytes), 0.0)
    return np.triu(C)


@dataclass(frozen=True)
class Clustering:
    """Layers grouped into contiguous clusters (module docstring, section 1)."""

    bounds: tuple[tuple[int, int], ...]
    """Each cluster's layers ``[start, stop)``."""
    flops: tuple[float, ...]
    recv_bytes: tuple[float, ...]
    """C of each cluster: bytes it reads from other clusters' layers per microbatch."""
    delta: float
    """The δ the FLOP bound used (larger than asked when no clustering met the asked one)."""

    @property
    def max_recv_bytes(self) -> float:
        return max(self.recv_bytes)


def _min_sum(C: np.ndarray, ok: np.ndarray, L: int, cap: float) -> tuple[float, list[int]] | None:
    """The least Σ C over clusterings into L allowed clusters with every C ≤ cap, and the clusters' starts."""
    K = len(C)
    inf = math.inf
    H = [[inf] * (L + 1) for _ in range(K + 1)]  # H[k][r]: layers 0..k-1 in r clusters
    arg = [[-1] * (L + 1) for _ in range(K + 1)]
    H[0][0] = 0.0
    for k in range(1, K + 1):
        for r in range(1, min(k, L) + 1):
            best, where = inf, -1
            for i in range(r - 1, k):  # the last cluster is layers i..k-1
                c = C[i, k - 1]
                if not ok[i, k - 1] or c > cap or H[i][r - 1] == inf:
                    continue
                if H[i][r - 1] + c < best:
                    best, where = H[i][r - 1] + c, i
            H[k][r], arg[k][r] = best, where
    if H[K][L] == inf:
        return None
    starts, k = [], K
    for r in range(L, 0, -1):
        k = arg[k][r]
        starts.append(k)
    return H[K][L], starts[::-1]


def cluster_layers(
    graph: OpGraph,
    num_clusters: int,
    *,
    delta: float = DEFAULT_DELTA,
    all_layers: Sequence[Layer] | None = None,
    received: np.ndarray | None = None,
) -> Clustering:
    """Alpa's operator clustering (Eq. 6) over the model's layers (module docstring, section 1). `received`
    is :func:`received_bytes` of the layers, when already computed."""
    all_layers = list(all_layers) if all_layers is not None else runnable_layers(graph)
    K = len(all_layers)
    if isinstance(num_clusters, bool) or not isinstance(num_clusters, int) or num_clusters < 1:
        raise UserError(f"num_clusters={num_clusters!r}: give a whole number of clusters, at least 1")
    if delta < 0:
        raise UserError(f"delta={delta}: the FLOP slack must be at least 0, e.g. 0.1")
    L = min(num_clusters, K)
    C = received if received is not None else received_bytes(graph, all_layers)
    fl = np.array([x.flops for x in all_layers], dtype=float)
    pre = np.concatenate([[0.0], np.cumsum(fl)])
    span = pre[None, 1:] - pre[:-1, None]  # span[i, k] = FLOP(i..k)
    single = np.eye(K, dtype=bool)
    d = float(delta)
    while True:
        ok = np.triu(span <= (1 + d) * pre[-1] / L * (1 + 1e-12)) | single
        values = np.unique(np.concatenate([[0.0], C[ok]]))
        lo, hi = 0, len(values) - 1
        if _min_sum(C, ok, L, values[hi]) is not None:
            while lo < hi:  # the least cap that some clustering meets: G(K-1, L)
                mid = (lo + hi) // 2
                if _min_sum(C, ok, L, values[mid]) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            found = _min_sum(C, ok, L, values[lo])
            assert found is not None
            starts = found[1]
            break
        d = 2 * d + 0.1
    bounds = tuple(zip(starts, starts[1:] + [K]))
    return Clustering(
        bounds,
        tuple(float(pre[b] - pre[a]) for a, b in bounds),
        tuple(float(C[a, b - 1]) for a, b in bounds),
        d,
    )


# ---------------------------------------------------------------- 2. submeshes


def devices_per_node(cluster, num_devices: int) -> tuple[int, int]:
    """(N nodes, M devices each) of the first `num_devices` devices of `cluster` (module docstring, 2)."""
    M = cluster.layers[-1].ranks
    if num_devices <= M:
        return 1, num_devices
    if num_devices % M:
        raise UserError(
            f"num_devices={num_devices}: cluster {cluster.name!r} has {M} devices per node and a pipeline uses whole "
            f"nodes beyond one; give a multiple of {M} (or at most {M})"
        )
    return num_devices // M, M


def submesh_sizes(nodes: int, per_node: int) -> tuple[int, ...]:
    """Device counts of the allowed submeshes: (1, 2^m) with 2^m dividing M, and (q, M) for q = 1..N."""
    one = {1 << m for m in range(per_node.bit_length()) if per_node % (1 << m) == 0}
    return tuple(sorted(one | {q * per_node for q in range(1, nodes + 1)}))


def place(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Ranks of each stage's submesh: larger submeshes first on contiguous ranks, stage order among equals
    (Theorem 1's construction: every block aligned to its size)."""
    order = sorted(range(len(sizes)), key=lambda j: (-sizes[j], j))
    out: list[tuple[int, ...]] = [()] * len(sizes)
    at = 0
    for j in order:
        out[j] = tuple(range(at, at + sizes[j]))
        at += sizes[j]
    return out


class LogicalShapes(StrEnum):
    """Which logical mesh shapes (a, b), a · b = d, a stage of d devices is costed on."""

    ALL = "all"
    """Every one (``mesh_shapes_2d``): Alpa's enumeration."""
    IN_NODE = "in-node"
    """Those whose second axis b divides the devices of a node (b ≤ M, row mapping keeps it inside a node):
    tensor parallelism within a node, the rest over the first axis. For large clusters (module docstring,
    section 2): (q, M) has as many shapes as 8q has divisors."""


def logical_shapes(d: int, per_node: int, which: LogicalShapes = LogicalShapes.ALL) -> list[tuple[int, int]]:
    """The logical shapes of a submesh of `d` devices (`per_node` to a node) that the stage table costs."""
    every = mesh_shapes_2d(d)
    if LogicalShapes(which) == LogicalShapes.ALL:
        return every
    return [(a, b) for a, b in every if per_node % b == 0]


# ---------------------------------------------------------------- 3. stage costs


@functools.cache
def stage_in_flight(kind: PipelineKind, stages_left: int, microbatches: int, stages: int | None = None) -> int:
    """Microbatches whose activations a stage with `stages_left` stages from it to the end (itself included)
    holds at most under `kind` in a pipeline of `stages` stages (default: `stages_left`, the stage first) —
    GPipe: all B; 1F1B: min(B, stages_left); ZB-H1: min(B, stages), every stage alike, since a microbatch's
    saved values stay until its ``W``, which the later stages delay (``schedule.held_until_weight``) — read
    off the schedule itself."""
    S = stages_left if stages is None else stages
    return held_one_chunk(kind, S, microbatches)[S - stages_left]


@functools.lru_cache(maxsize=256)
def held_one_chunk(kind: PipelineKind, stages: int, microbatches: int) -> tuple[int, ...]:
    """Per stage of a `stages`-stage pipeline of one chunk a rank group under `kind`: the most microbatches
    whose saved values it holds at once (``schedule.held_until_weight``), read off the one schedule and kept:
    the stage DP, the plan's stages and the configuration search's ranking ask for every stage of the same
    pipeline again (one schedule per stage took 17 s at 256 stages, per candidate of that ranking). Under 1F1B
    stage r holds ``min(B, stages − r)`` (its warm-up forwards, then one forward per backward), which is what its
    schedule reads (``tests/test_pipeline_plan.py`` holds the two equal): the stage table asks for every stage
    count up to the layers', and building those schedules cost GPT-39B's 52 stage counts 1.6 CPU s."""
    if PipelineKind(kind) == PipelineKind.ONE_F_ONE_B:
        return tuple(min(microbatches, stages - r) for r in range(stages))
    return held_read_off(kind, stages, microbatches)


def held_read_off(kind: PipelineKind, stages: int, microbatches: int) -> tuple[int, ...]:
    """:func:`held_one_chunk` read off the schedule itself (``schedule.held_until_weight``), whatever `kind`."""
    held = held_until_weight(pipeline([[r] for r in range(stages)], microbatches, kind))
    return tuple(held[(r,)] for r in range(stages))


def _fits(cost: StageCost, in_flight: int, capacity: float) -> bool:
    """Alpa Eq. 5: one microbatch's peak plus the activations of the others in flight."""
    return stage_memory(cost, in_flight) <= capacity


def stage_memory(cost: StageCost, in_flight: int) -> float:
    """Bytes per device of a stage with `in_flight` microbatches' activations held (Eq. 5's left side): the
    optimizer step's peak, or the forward + backward peak plus the further microbatches' activations."""
    p = cost.peaks
    return max(p.update, p.forward_backward + (in_flight - 1) * p.activations)


def input_grad_share(graph: OpGraph, layers: Sequence[Layer], start: int, stop: int) -> float:
    """Of the backward FLOPs of `layers` ``[start, stop)`` of `graph`, the share a zero-bubble schedule runs as
    ``I``: the backward nodes the gradients sent to the previous stage depend on — the cone, within the stage,
    of its backward values that an earlier layer's backward reads, the split the stage runtime makes
    (``runtime.pipeline_stages``) — the rest being ``W`` (the weight gradients). 0 for the first stage
    (nothing is sent back: its whole backward is ``W``) and for a backward without FLOPs."""
    if start == 0:
        return 0.0
    where = {name: j for j, layer in enumerate(layers) for name in layer.nodes}
    mine = {n.name: n for n in graph.nodes if n.phase == "bwd" and start <= where.get(n.name, -1) < stop}
    seeds = [
        src
        for n in graph.nodes
        if n.phase == "bwd" and where.get(n.name, stop) < start
        for src, _ in n.inputs
        if src in mine
    ]
    cone = OpGraph.input_cone(mine, seeds)
    total = sum(n.flops for n in mine.values())
    return sum(mine[x].flops for x in cone) / total if total > 0 else 0.0


@dataclass
class _StageTable:
    """Every (cluster range, submesh size, logical shape) costed; t_intra per stage count (docstring, 3)."""

    planner: StagePlanner
    clusters: Clustering
    sizes: tuple[int, ...]
    microbatches: int
    capacity: float
    max_stages: int
    devices: int
    stages: int | None
    kind: PipelineKind = PipelineKind.ONE_F_ONE_B
    kw: dict = field(default_factory=dict)
    costs: dict[tuple[int, int, int], list[StageCost]] = field(default_factory=dict)
    shapes: object = mesh_shapes_2d
    """``d -> [(a, b), ...]``: the logical shapes costed per submesh size (:func:`logical_shapes`)."""
    refused: np.ndarray | None = None
    """``[k, i]``: clusters k..i would be a stage that a value crosses whole (:func:`refused_ranges`)."""
    workers: int = 1
    """Processes the columns are searched in (``planner.parallel``)."""

    def useful(self, k: int, i: int, d: int) -> bool:
        """Whether clusters k..i on d devices can be a stage of a plan covering every cluster and device
        with `stages` (or up to ``max_stages``) stages: the stage runtime can run it (no value crosses it
        whole), the others need a stage per side that has clusters, at most one per cluster and per device,
        and no devices left over."""
        if self.refused is not None and self.refused[k, i]:
            return False
        L = len(self.clusters.bounds)
        other = self.devices - d
        least = (k > 0) + (i < L - 1)
        most = min(k + (L - 1 - i), other)
        if other < 0 or (other == 0) != (least == 0) or least > most:
            return False
        return self.stages is None and least + 1 <= self.max_stages or self.stages in range(least + 1, most + 2)

    def fill(self) -> None:
        """Every useful (range, size) searched on each logical shape: a column per size, in :attr:`workers`
        processes (``planner.parallel``: the same costs as one after the other)."""
        for column in map_columns(self._column, self.sizes, self.planner, self.workers):
            self.costs.update(column)

    def _column(self, d: int) -> dict[tuple[int, int, int], list[StageCost]]:
        L, B = len(self.clusters.bounds), self.microbatches
        out = {}
        for k in range(L):
            for i in range(k, L):
                if not self.useful(k, i, d):
                    continue
                start, stop = self.clusters.bounds[k][0], self.clusters.bounds[i][1]
                found = []
                for shape in self.shapes(d):
                    try:
                        c = self.planner.plan(start, stop, range(d), shape, microbatches=B, **self.kw)
                    except PlanError:
                        continue
                    found.append(c)
                out[(k, i, d)] = found
        return out

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``t[s, k, i, z]``: t_intra of clusters k..i on size z with s stages from it to the end (∞: none
        fits); ``arg[s, k, i, z]``: which cost of ``costs[(k, i, size)]`` it is."""
        L, Z, S, B = len(self.clusters.bounds), len(self.sizes), self.max_stages, self.microbatches
        t = np.full((S + 1, L, L, Z), math.inf)
        arg = np.full((S + 1, L, L, Z), -1, dtype=np.int64)
        for (k, i, d), found in self.costs.items():
            z = self.sizes.index(d)
            for s in range(1, S + 1):
                for j, c in enumerate(found):
                    fl = stage_in_flight(self.kind, s, B, self.stages)
                    if _fits(c, fl, self.capacity) and c.time.total_s / B < t[s, k, i, z]:
                        t[s, k, i, z], arg[s, k, i, z] = c.time.total_s / B, j
        return t, arg


# ---------------------------------------------------------------- 4. the DP


def _dp(
    t: np.ndarray, sizes: Sequence[int], n: int, t_max: float, stages: int | None = None
) -> tuple[float, list[tuple[int, int, int]]] | None:
    """min_s F(s, 0, n) under `t_max` (s = `stages` when given) and its stages ``(k, i, z)`` (module
    docstring, section 4).

    Per stage count s only the finite entries ``(k, i, z)`` of ``t[s]`` under `t_max` are candidates (a few
    percent of the table: most ranges fit no submesh), so each s costs one gather over them, not a loop over
    every first layer and size: for entry e, ``cand_e(x) = t[s, k, i, z] + F(s − 1, i + 1, x − d_z)`` (∞ for
    x < d_z), and ``F(s, k, x)`` is the least ``cand_e(x)`` over the entries of first layer k, the first in
    (z, i) order on a tie (the same sums and the same choice as trying every (z, i) of k in that order)."""
    S, L, Z = t.shape[0] - 1, t.shape[1], t.shape[3]
    F = [np.full((L + 1, n + 1), math.inf)]
    F[0][L, 0] = 0.0
    choice: list[np.ndarray] = [np.zeros(0)]
    d_of = np.array(sizes, dtype=np.int64)
    for s in range(1, S + 1):
        prev = F[s - 1]
        ok = (t[s] <= t_max) & (d_of <= n)[None, None, :]  # [k, i, z]; ∞ is never <= t_max
        if not ok.any() or not np.isfinite(prev).any():
            break  # F(s) is ∞ everywhere, and so is every F(s' > s) built on it
        k, i, z = np.nonzero(ok.transpose(0, 2, 1))  # sorted by (k, z, i): the tie order
        z, i = i, z  # nonzero of [k, z, i] gave (k, z, i)
        shifted = np.full((Z, L, n + 1), math.inf)  # F(s − 1, i + 1, x − d_z)
        for zz, d in enumerate(sizes):
            if d <= n:
                shifted[zz, :, d:] = prev[1:, : n + 1 - d]
        cand = t[s, k, i, z][:, None] + shifted[z, i]
        Fs, e = _least_per_group(cand, k, L)
        first = np.arange(L)[:, None]
        ch = np.where(e >= 0, z[e] * (L - first) + i[e] - first, -1)  # z · width + (i − k), as the backtrack reads
        F.append(Fs)
        choice.append(ch)
    tops = [F[s][0, n] if stages is None or s == stages else math.inf for s in range(1, len(F))]
    if not tops:
        return None
    s = int(np.argmin(tops)) + 1
    if tops[s - 1] == math.inf:
        return None
    chosen, k, d = [], 0, n
    for r in range(s, 0, -1):
        c = int(choice[r][k, d])
        z, i = divmod(c, L - k)
        i += k
        chosen.append((k, i, z))
        k, d = i + 1, d - sizes[z]
    return float(tops[s - 1]), chosen


def _least_per_group(cand: np.ndarray, group: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group g < L (rows of `cand` with ``group == g``, ascending, consecutive) and column x: the least
    ``cand[e, x]`` and the first row e reaching it (``(L + 1, X)`` least, ∞ for no row; ``(L, X)`` row, −1)."""
    X = cand.shape[1]
    least = np.full((L + 1, X), math.inf)
    first = np.full((L, X), -1, dtype=np.int64)
    if not len(group):
        return least, first
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    keys = group[starts]
    mins = np.minimum.reduceat(cand, starts, axis=0)
    at = np.where(cand == mins[np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(group)]))],
                  np.arange(len(group))[:, None], len(group))  # fmt: skip
    rows = np.minimum.reduceat(at, starts, axis=0)
    least[keys] = mins
    first[keys] = np.where(np.isfinite(mins), rows, -1)
    return least, first


def _t_max_groups(t: np.ndarray, epsilon: float) -> list[tuple[float, float]]:
    """The t_max tried, as (smallest, largest) of each group of distinct t_intra values within a factor
    (1 + ε) of the group's smallest, ascending (module docstring, section 4); the DP runs at the largest."""
    cands = np.unique(t[np.isfinite(t)])
    groups = []
    j = 0
    while j < len(cands):
        nxt = bisect.bisect_right(cands, cands[j] * (1 + epsilon), lo=j + 1)
        groups.append((float(cands[j]), float(cands[nxt - 1])))
        j = nxt
    return groups


def _search_t_max(
    t: np.ndarray, sizes: Sequence[int], n: int, B: int, epsilon: float, stages: int | None
) -> tuple[tuple[float, list[tuple[int, int, int]]] | None, int]:
    """The best (score, stages) over the t_max groups and how many DPs ran (module docstring, section 4).

    The groups below the first one with any plan are skipped by a binary search on feasibility — exact, since
    raising t_max only adds stage options, so a DP with no plan at some t_max has none at any smaller one —
    and from there on they are tried in ascending order until B · t_max reaches the best step found. The DP
    counts devices in units of the sizes' greatest common divisor (whole nodes when only (q, M) submeshes
    are allowed: the same sums, M times fewer columns)."""
    groups = _t_max_groups(t, epsilon)
    runs: dict[int, tuple[float, list[tuple[int, int, int]]] | None] = {}
    unit = math.gcd(n, *sizes)  # devices counted in units every size is a multiple of (whole nodes: 8)
    sizes, n = [d // unit for d in sizes], n // unit

    def run(g: int):
        if g not in runs:
            runs[g] = _dp(t, sizes, n, groups[g][1], stages)
        return runs[g]

    lo, hi = 0, len(groups)  # the first feasible group is in [lo, hi]; hi = len: none
    while lo < hi:
        mid = (lo + hi) // 2
        if run(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    best: tuple[float, list[tuple[int, int, int]]] | None = None
    for g in range(lo, len(groups)):
        if best is not None and B * groups[g][0] >= best[0]:
            break
        found = run(g)
        if found is None:
            continue
        chosen = found[1]
        ts = [t[len(chosen) - r, k, i, z] for r, (k, i, z) in enumerate(chosen)]
        score = sum(ts) + (B - 1) * max(ts)
        if best is None or score < best[0]:
            best = (score, chosen)
    return best, len(runs)


# ---------------------------------------------------------------- 8. transfers between stages


@dataclass(frozen=True)
class Crossing:
    """One read of a value in another layer than the one making it (:func:`crossings`)."""

    src: str
    """The node making the value."""
    output: int
    """Which of `src`'s outputs."""
    dst: str
    """The node reading it."""
    made_in: int
    """The layer of `src`."""
    read_in: int
    """The layer of `dst` (≠ `made_in`)."""


def crossings(graph: OpGraph, layers: Sequence[Layer]) -> Iterator[Crossing]:
    """Every read of a value in another layer than the one making it, in graph order: the one scan behind
    :func:`stage_transfers` (what crosses a cut), :func:`bypassed` (what would skip a stage) and
    :func:`against_spans` (what would flow backwards). Leaves are included (each caller filters them); an edge
    that needs no transfer wherever the stages are cut (a tied weight's copies and gradient parts,
    ``stage.stays_in_stage``) is not."""
    where = {name: j for j, layer in enumerate(layers) for name in layer.nodes}
    stays = stays_in_stage(graph, layers)
    for n in graph.nodes:
        q = where.get(n.name)
        if q is None:
            continue
        for src, i in n.inputs:
            p = where.get(src)
            if p is not None and p != q and not stays(src, n.name):
                yield Crossing(src, i, n.name, p, q)


def _crossing_edges(graph: OpGraph, layers: Sequence[Layer]) -> list[tuple[int, int, bool, str, int]]:
    """``(lo, hi, forward, node, output)`` of every value read in another layer than the one making it: it
    crosses every cut ``c`` with ``lo < c ≤ hi`` (leaves — the model's inputs, constants, parameters, buffers —
    and a tied weight's copies and gradient parts cross none: ``stage.stays_in_stage``)."""
    out = set()
    for x in crossings(graph, layers):
        if graph[x.src].kind not in LEAF_KINDS and graph[x.src].outputs[x.output] is not None:
            p, q = x.made_in, x.read_in
            out.add((min(p, q), max(p, q), p < q, x.src, x.output))
    return sorted(out)


def stage_transfers(
    graph: OpGraph,
    layers: Sequence[Layer],
    stage_layers: Sequence[tuple[int, int]],
    ranks: Sequence[Sequence[int]],
    cluster,
    stack: Stack | None = None,
    *,
    edges: list[tuple[int, int, bool, str, int]] | None = None,
) -> tuple[StageTransfer, ...]:
    """Every boundary's transfers, both directions, of stages over model layers `stage_layers` on `ranks`
    (module docstring, section 8). `graph` and `layers` are the captured graph's (a :class:`Stack`'s: a cut
    between the model's layers reads as the graph cut with the same layers after it, ``Stack.graph_range``);
    `edges` is :func:`_crossing_edges` of them, when already made."""
    edges = edges if edges is not None else _crossing_edges(graph, layers)
    K = stage_layers[-1][1]
    out = []
    for j in range(len(stage_layers) - 1):
        c = stage_layers[j + 1][0]
        gc = stack.graph_range(c, K)[0] if stack is not None else c
        a, b = int(ranks[j][0]), int(ranks[j + 1][0])
        for forward in (True, False):
            vals = sorted({(src, i) for lo, hi, fwd, src, i in edges if fwd == forward and lo < gc <= hi})
            infos = [graph[src].outputs[i] for src, i in vals]
            nbytes = float(sum(x.nbytes for x in infos))
            seconds = cluster.p2p_latency(a, b) + nbytes / cluster.p2p_bandwidth(a, b) if nbytes and a != b else 0.0
            src, dst = (j, j + 1) if forward else (j + 1, j)
            names = tuple(f"{s}:{i}" for s, i in vals)
            out.append(StageTransfer(src, dst, forward, names, tuple(tuple(x.shape) for x in infos), nbytes, seconds))
    return tuple(out)


# ---------------------------------------------------------------- the result


AUTO = "auto"
"""``plan_pipeline(schedule=AUTO)``: the schedule kind whose simulated step is shortest."""

AUTO_ORDER = (PipelineKind.ONE_F_ONE_B, PipelineKind.ZERO_BUBBLE, PipelineKind.GPIPE, PipelineKind.INTERLEAVED_1F1B)
"""The kinds ``AUTO`` plans, in the order that breaks ties of the simulated step: fewest microbatches in flight
first (1F1B's S − s, zero bubble's min(B, S), GPipe's B), then Interleaved1F1B's v-fold sends."""


def _size(b: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= f:
            return f"{b / f:.1f} {unit}"
    return f"{b:.0f} B"


# ---------------------------------------------------------------- entry point


def plan_pipeline(
    graph: OpGraph,
    cluster,
    *,
    microbatches: int,
    num_devices: int | None = None,
    num_clusters: int | None = None,
    num_stages: int | None = None,
    delta: float = DEFAULT_DELTA,
    epsilon: float = DEFAULT_EPSILON,
    memory_bytes: float | None = None,
    planner: StagePlanner | None = None,
    schedule: PipelineKind | str = PipelineKind.ONE_F_ONE_B,
    fast: bool | None = None,
    chunks: int = 2,
    submeshes: Sequence[int] | None = None,
    shapes: LogicalShapes | str = LogicalShapes.ALL,
    workers: int | None = None,
    costing: TableCosting | str = TableCosting.EXACT,
    accumulated: bool = True,
    recompute: RecomputeMode | str = RecomputeMode.AUTO,
    **stage_kw,
) -> Plan:
    """Stages, submeshes and logical meshes minimising the pipelined step of `graph` (one microbatch's step) over
    `microbatches` microbatches on the first `num_devices` devices of `cluster` (module docstring).

    `num_clusters` (default: every layer) is Eq. 6's L; `num_stages` fixes S (default: the DP chooses);
    `planner` reuses a :class:`StagePlanner`'s caches; `memory_bytes` overrides the device's capacity (in the
    stage searches and in Eq. 5); `stage_kw` goes to ``StagePlanner.plan`` (``zero``, ``searcher``,
    ``time_limit``). `schedule` is the pipeline schedule, or ``"auto"``: the DP is run for each kind (the
    stage costs are cached, so the second run only re-checks Eq. 5 and re-runs the DP) and the plan whose
    simulated step (:meth:`Plan.simulate`, each boundary's transfer sent) is shortest wins, 1F1B on a tie
    (fewer microbatches in flight).

    `graph` may be a :class:`~meshpilot.planner.stack.Stack` (``stack.capture_stack``: a few blocks captured for
    a model of many). `fast`: stage costs composed from one block's plan (``planner.stack``; the plan's
    ``costing`` says which path was taken) — None (default) when the model is a repeated stack, True to
    require it, False for every range searched on its own (the exact path; a :class:`Stack` of fewer captured
    blocks than the model's has no exact path).

    For large clusters (module docstring, section 2): `submeshes` restricts the stage sizes to these of
    Theorem 1's (e.g. whole nodes in powers of two), `shapes` the logical shapes per size
    (:class:`LogicalShapes`); both narrow the search (the plan is the best among them).

    `costing` (a repeated stack's table, ``stack.TableCosting``): ``"exact"`` (default) composes it from the
    block planned under every cap level; ``"approximate"`` from each logical mesh's block plan at the device's
    capacity, ZeRO-sharded and recomputed, then capped only for ranges none of those fits where the first pass'
    plan may be beaten — real plans only (``stack`` module docstring, 4); ``"estimated"`` searches only a few base
    meshes and prices every other as replicas of a base's plan; only the chosen stages are composed from their
    own mesh's plans (``stack`` module docstring, 5).

    `accumulated` (a repeated stack's table): count the gradients summed over the microbatches in each stage's
    forward + backward peak (``stage.StageMemory.accumulated``), as ``auto.plan`` — and so ``Plan.with_intra``
    — does (default); False leaves them out of the composed stages (the tables before they were counted, for
    comparisons). The exact path's stage costs always count them (``StageMemory.peaks``).

    `recompute` (a repeated stack's table): which recomputation a stage may be costed with, chosen per stage
    where it pays (``stack`` module docstring, 2 and 4): ``"auto"`` (default) the blocks' selective regions or
    the blocks whole, ``"selective"`` / ``"full"`` that one only, ``"none"`` no stage recomputes. The exact path
    (every range searched) recomputes nothing.

    `workers`: processes the stage table's columns are searched in (``planner.parallel``; default
    ``$MESHPILOT_PLAN_WORKERS`` or the usable CPUs): the same plan as with one."""
    with spared_from_collection():  # the process's objects kept out of full collections (planner.heap)
        t0 = time.perf_counter()
        workers = plan_workers(workers)
        stack: Stack | None = graph if isinstance(graph, Stack) else None
        if stack is not None:
            if fast is False and stack.kept != stack.blocks:
                raise UserError(
                    f"fast=False: the graph has {stack.kept} of the model's {stack.blocks} blocks; capture the whole "
                    "model (graph.capture.capture) for the exact path"
                )
            graph = stack.graph
        call = dict(microbatches=microbatches, num_devices=num_devices, num_clusters=num_clusters,
                    num_stages=num_stages, delta=delta, epsilon=epsilon, memory_bytes=memory_bytes, planner=planner,
                    fast=fast, submeshes=submeshes, shapes=shapes, workers=workers, chunks=chunks,
                    costing=_costing(costing), accumulated=accumulated, recompute=RecomputeMode.parse(recompute),
                    **stage_kw)  # fmt: skip
        if schedule == AUTO:
            return _plan_auto(stack or graph, graph, cluster, call, t0)
        try:
            kind = PipelineKind(schedule)
        except ValueError:
            choices = ", ".join([*(k.value for k in PipelineKind), AUTO])
            raise UserError(f"schedule={schedule!r}: give one of {choices}") from None
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise UserError(f"microbatches={microbatches!r}: give a whole number of microbatches, at least 1")
        if epsilon < 0:
            raise UserError(f"epsilon={epsilon}: the relative t_max step must be at least 0, e.g. 1e-3")
        setup = _prepare(graph, stack, cluster, call, stage_kw, t0)
        if kind == PipelineKind.ZERO_BUBBLE and num_stages is None:  # its memory rule depends on the depth: a DP each
            return _zero_bubble_depths(stack or graph, cluster, setup, call)
        if kind == PipelineKind.INTERLEAVED_1F1B:
            return _interleaved_plan(setup, kind, call)
        return _dp_plan(setup, kind, call)


def _costing(costing: TableCosting | str) -> TableCosting:
    try:
        return TableCosting(costing)
    except ValueError:
        raise UserError(f"costing={costing!r}: give one of {', '.join(c.value for c in TableCosting)}") from None


@dataclass
class _Setup:
    """What :func:`plan_pipeline`'s planning of one schedule works on (its checks done): the graph and its
    stack, the stage planner, the devices, the model's layers and clusters, the sizes and shapes costed."""

    graph: OpGraph
    stack: Stack | None
    sp: StagePlanner
    n: int
    model_layers: list[Layer]
    C: np.ndarray
    """:func:`received_bytes` over the model's layers."""
    clusters: Clustering
    sizes: tuple[int, ...]
    shapes_of: Callable[[int], list[tuple[int, int]]]
    capacity: float
    S: int
    """The most stages."""
    stage_kw: dict
    t0: float
    misses: int
    """``sp.misses`` when the call began (``Plan.stage_plans`` counts from it)."""
    edges: list | None = None
    """:func:`_crossing_edges` of the graph, made on first use."""

    def transfers(self, stage_layers: Sequence[tuple[int, int]], ranks: Sequence[Sequence[int]]):
        """:func:`stage_transfers` of stages over these model layers on these ranks."""
        if self.edges is None:
            self.edges = _crossing_edges(self.graph, self.sp.layers)
        return stage_transfers(self.graph, self.sp.layers, stage_layers, ranks, self.sp.cluster, self.stack,
                               edges=self.edges)  # fmt: skip


def _plan_auto(graph, captured: OpGraph, cluster, call: dict, t0: float) -> Plan:
    """``schedule="auto"``: every kind of :data:`AUTO_ORDER` planned, the shortest simulated step kept (its
    sends priced by the plan's transfers), the order breaking ties."""
    call = dict(call)
    sp = call["planner"] = call["planner"] if call["planner"] is not None else StagePlanner(captured, cluster)
    found: list[tuple[float, int, Plan]] = []
    errors = []
    for rank, k in enumerate(AUTO_ORDER):
        composed = (StageCosting.STACK, StageCosting.STACK_APPROX, StageCosting.STACK_ESTIMATED)
        if k == PipelineKind.INTERLEAVED_1F1B and any(p.costing in composed for _, _, p in found):
            continue  # its search costs every range on its own: not where the others composed a block's costs
        try:
            p = plan_pipeline(graph, cluster, schedule=k, **call)
        except PlanError as e:
            errors.append(e)
            continue
        found.append((p.simulate(sp.cluster).step_s, rank, p))
    if not found:
        raise errors[0]
    best = min(found, key=lambda x: (x[0], x[1]))[2]
    return dataclasses.replace(best, planning_s=time.perf_counter() - t0)


def _prepare(graph: OpGraph, stack: Stack | None, cluster, call: dict, stage_kw: dict, t0: float) -> _Setup:
    """The checks of :func:`plan_pipeline`'s arguments and what every schedule's planning shares (:class:`_Setup`):
    the stack found, the clusters (Eq. 6), Theorem 1's sizes (or `submeshes`) and the logical shapes."""
    planner, fast, num_stages = call["planner"], call["fast"], call["num_stages"]
    sp = planner if planner is not None else StagePlanner(graph, cluster)
    if planner is not None and planner.graph is not graph:
        raise UserError("planner= was made for another graph; pass the StagePlanner of this graph")
    cl = sp.cluster
    n = cl.num_devices if call["num_devices"] is None else call["num_devices"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= cl.num_devices:
        raise UserError(f"num_devices={call['num_devices']!r}: cluster {cl.name!r} has {cl.num_devices}; give 1..that")
    if stack is None and fast is not False:
        stack = find_stack(graph, sp.layers, sp._range_key)
        if stack is None and fast:
            raise UserError(
                f"fast=True: the model is not a repeated stack of at least {MIN_BLOCKS} identical blocks in one "
                "ModuleList; plan it with fast=None or False"
            )
    if stack is not None and fast is False:
        stack = None
    model_layers = list(stack.layers) if stack is not None else sp.layers
    K = len(model_layers)
    if num_stages is not None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise UserError(f"num_stages={num_stages!r}: give a whole number of stages, at least 1")
        if num_stages > K:
            raise UserError(f"num_stages={num_stages}: the model has only {K} layers to split; give at most {K} stages")
        if num_stages > n:
            raise UserError(f"num_stages={num_stages}: only {n} devices, one per stage at least; give at most {n}")
    C = received_bytes(graph, sp.layers)
    if stack is not None:
        C = stack.received(C)
    L_asked = call["num_clusters"] if call["num_clusters"] is not None else K
    clusters = cluster_layers(graph, L_asked, delta=call["delta"], all_layers=model_layers, received=C)
    L = len(clusters.bounds)
    if num_stages is not None and num_stages > L:
        raise UserError(
            f"num_stages={num_stages}: only {L} layer clusters; raise num_clusters to at least {num_stages}"
        )
    sizes, shapes_of = _sizes_and_shapes(cl, n, call["submeshes"], call["shapes"])
    memory_bytes = call["memory_bytes"]
    capacity = float(memory_bytes if memory_bytes is not None else cl.device.memory_bytes)
    stage_kw = dict(stage_kw)
    if memory_bytes is not None:  # the stage searches get the same device
        stage_kw.setdefault("capacity", capacity)
    S = num_stages if num_stages is not None else min(L, n)
    return _Setup(graph, stack, sp, n, model_layers, C, clusters, sizes, shapes_of, capacity, S, stage_kw, t0,
                  sp.misses)  # fmt: skip


def _sizes_and_shapes(cl, n: int, submeshes, shapes) -> tuple[tuple[int, ...], Callable]:
    """Theorem 1's submesh sizes for `n` devices (or those of `submeshes`, checked) and the logical shapes
    costed per size (:class:`LogicalShapes`)."""
    nodes, per_node = devices_per_node(cl, n)
    sizes = submesh_sizes(nodes, per_node)
    if submeshes is not None:
        asked = tuple(sorted({int(x) for x in submeshes}))
        if not asked or any(x not in sizes for x in asked):
            raise UserError(
                f"submeshes={list(submeshes)}: stage sizes must be among Theorem 1's for {n} devices "
                f"({', '.join(map(str, sizes[:12]))}{', …' if len(sizes) > 12 else ''})"
            )
        sizes = asked
    try:
        which = LogicalShapes(shapes)
    except ValueError:
        raise UserError(f"shapes={shapes!r}: give one of {', '.join(k.value for k in LogicalShapes)}") from None
    return sizes, functools.partial(logical_shapes, per_node=per_node, which=which)


def _no_fit(setup: _Setup, kind: PipelineKind, stages) -> PlanError:
    K = len(setup.model_layers)
    return PlanError(
        f"no pipeline fits: no split of {K} layers into {stages} stages on {setup.n} devices keeps every "
        f"stage within {_size(setup.capacity)} per device with {kind.value}'s microbatches in flight; use more "
        "devices, fewer microbatches or a smaller model"
    )


def _zero_bubble_depths(graph, cluster, setup: _Setup, call: dict) -> Plan:
    """ZB-H1 without a fixed depth: its memory rule depends on the depth, so a DP per depth S, the least Eq. 2
    kept."""
    call = dict(call, planner=setup.sp, num_devices=setup.n)
    best: Plan | None = None
    tried = 0
    for depth in range(1, setup.S + 1):
        try:
            p = plan_pipeline(graph, cluster, schedule=PipelineKind.ZERO_BUBBLE, **dict(call, num_stages=depth))
        except PlanError:
            continue
        tried += p.t_max_tried
        if best is None or p.dp_step_s < best.dp_step_s:
            best = p
    if best is None:
        raise _no_fit(setup, PipelineKind.ZERO_BUBBLE, f"up to {setup.S}")
    return dataclasses.replace(
        best, planning_s=time.perf_counter() - setup.t0, stage_plans=setup.sp.misses - setup.misses, t_max_tried=tried
    )


def _interleaved_plan(setup: _Setup, kind: PipelineKind, call: dict) -> Plan:
    """Interleaved1F1B (module docstring, section 6): :func:`_plan_interleaved`'s optima, the one with the
    shortest simulated step built on its placed ranks."""
    sp, stack, clusters, B, chunks = setup.sp, setup.stack, setup.clusters, call["microbatches"], call["chunks"]
    num_stages, L, n = call["num_stages"], len(setup.clusters.bounds), setup.n
    if stack is not None and stack.kept != stack.blocks:
        raise PlanError(
            "interleaved 1F1B searches every layer range on its own: capture the whole model (not capture_stack)"
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
        raise UserError(f"chunks={chunks!r}: interleaved 1F1B holds at least 2 chunks per group; give 2 or more")
    found, tried, capped = _plan_interleaved(
        sp, clusters, setup.sizes, n, B, chunks, num_stages, setup.capacity, call["epsilon"], setup.stage_kw
    )
    if not found:
        raise PlanError(
            f"no interleaved 1F1B plan fits: {L} layer clusters into {chunks} chunks on each of "
            f"{num_stages or 'P ≥ 2'} device groups of {n} devices with {B} microbatches (a multiple "
            f"of P), each group's chunks within {_size(setup.capacity)} per device; use more layers or devices, or "
            "another schedule"
        )
    if capped:
        warnings.warn(
            f"interleaved 1F1B: a search front passed {INTERLEAVED_FRONT} entries and was cut; the plan may not "
            "be the optimum",
            stacklevel=3,
        )

    def build(x: _Interleaved, recost: bool) -> Plan:
        ranks = place(list(x.group_sizes))
        P = len(x.group_sizes)
        held = _held_per_stage(kind, ranks, len(x.chunks), B)
        stages = []
        for j, ch in enumerate(x.chunks):
            rk, c = ranks[j % P], ch.cost
            start, stop = clusters.bounds[ch.k][0], clusters.bounds[ch.i][1]
            if recost and rk != c.ranks:
                c = sp.plan(start, stop, rk, c.mesh_shape, microbatches=B, **setup.stage_kw)
            share = input_grad_share(setup.graph, sp.layers, start, stop) if recost else None
            stages.append(PlanStage.costed(setup.model_layers, start, stop, rk, c, B, held[j], setup.C, share))
        bounds = tuple(st.layers for st in stages)
        fl_sum = tuple(sum(y.flops for y in setup.model_layers[a:b]) for a, b in bounds)
        chunked = Clustering(bounds, fl_sum, tuple(float(setup.C[a, b - 1]) for a, b in bounds), clusters.delta)
        return Plan(
            tuple(stages), B, n, chunked, setup.capacity, x.step_s, time.perf_counter() - setup.t0,
            sp.misses - setup.misses, tried, kind, StageCosting.EXACT,
            transfers=setup.transfers(bounds, [st.ranks for st in stages]), cluster=sp.cluster.name,
        )  # fmt: skip

    best = min(found, key=lambda x: (build(x, False).simulate(sp.cluster).step_s, x.step_s))
    return build(best, True)


def _dp_plan(setup: _Setup, kind: PipelineKind, call: dict) -> Plan:
    """1F1B, GPipe or ZB-H1 of a given depth: the stage table (exact, or composed from a repeated block's plan),
    the t_max search over Alpa's DP, and the chosen stages costed on their placed ranks."""
    sp, stack, clusters, B = setup.sp, setup.stack, setup.clusters, call["microbatches"]
    num_stages, S, n = call["num_stages"], setup.S, setup.n
    refused = refused_ranges(setup.graph, sp.layers, clusters, stack)
    _check_splittable(refused, [num_stages] if num_stages else range(1, S + 1), setup.graph, sp.layers, clusters)
    table = _StageTable(
        sp, clusters, setup.sizes, B, setup.capacity, S, n, num_stages, kind, dict(setup.stage_kw),
        shapes=setup.shapes_of, refused=refused, workers=call["workers"],
    )  # fmt: skip
    if stack is None:
        table.fill()
        t, arg = table.arrays()
    else:
        fast_table = StackTable(
            sp, stack, clusters.bounds, setup.sizes, B, setup.capacity, S, table.useful,
            lambda s: stage_in_flight(kind, s, B, num_stages), dict(setup.stage_kw), shapes=setup.shapes_of,
            workers=call["workers"], costing=call["costing"], accumulated=call["accumulated"],
            recomputed=_recomputed(sp, stack, call["recompute"]),
        )  # fmt: skip
        t, arg = fast_table.arrays()
        if call["costing"] == TableCosting.APPROXIMATE:  # capped blocks where they may beat the first pass' plan
            first, _ = _search_t_max(t, setup.sizes, n, B, call["epsilon"], num_stages)
            t, arg = fast_table.refine(first[0] / B if first is not None else math.inf)
    stage_cost = functools.partial(_chosen_cost, setup, B, table, fast_table if stack is not None else None, arg)
    return _chosen_plan(setup, kind, call, t, stage_cost, frozenset())


def _chosen_cost(setup: _Setup, B: int, table, fast_table, arg: np.ndarray, s_left: int, k: int, i: int, z: int, rk):
    """The stage of clusters ``k..i`` on submesh size ``z`` with ``s_left`` stages from it to the end, costed on
    its placed ranks `rk`, from the table that chose it."""
    start, stop = setup.clusters.bounds[k][0], setup.clusters.bounds[i][1]
    if fast_table is not None:
        return fast_table.stage_cost(start, stop, rk, int(arg[s_left, k, i, z]))
    c = table.costs[(k, i, setup.sizes[z])][arg[s_left, k, i, z]]
    if rk != c.ranks:
        c = setup.sp.plan(start, stop, rk, c.mesh_shape, microbatches=B, **setup.stage_kw)
    return c


def _chosen_plan(
    setup: _Setup, kind: PipelineKind, call: dict, t: np.ndarray, stage_cost: Callable, ruled_out: frozenset
) -> Plan:
    """The DP's best plan over table `t` with the entries `ruled_out` (``(stages left, k, i, z)``) removed, its
    stages costed on their placed ranks; it keeps how to rule out one of its stages (``Plan.without_stage``:
    a stage whose own search does not fit where its table entry did)."""
    sp, stack, clusters, B = setup.sp, setup.stack, setup.clusters, call["microbatches"]
    num_stages, S, n = call["num_stages"], setup.S, setup.n
    masked = t.copy() if ruled_out else t  # `t` itself stays whole: each next best masks its own set
    for entry in ruled_out:
        masked[entry] = math.inf
    best, tried = _search_t_max(masked, setup.sizes, n, B, call["epsilon"], num_stages)
    if best is None:
        raise _no_fit(setup, kind, num_stages or f"up to {S}")
    score, chosen = best
    ranks = place([setup.sizes[z] for _, _, z in chosen])
    stages = []
    entries = []
    for r, ((k, i, z), rk) in enumerate(zip(chosen, ranks)):
        s_left = len(chosen) - r
        entries.append((s_left, k, i, z))
        start, stop = clusters.bounds[k][0], clusters.bounds[i][1]
        fl = stage_in_flight(kind, s_left, B, len(chosen))
        estimated = call["costing"] == TableCosting.ESTIMATED
        try:
            c = stage_cost(s_left, k, i, z, rk)
        except PlanError:
            if not estimated:
                raise
            c = None
        if estimated and (c is None or not _fits(c, fl, setup.capacity)):
            # an estimated entry whose stage, composed from its own mesh's plans, does not fit: the next best
            return _chosen_plan(setup, kind, call, t, stage_cost, ruled_out | {entries[-1]})
        share = input_grad_share(setup.graph, sp.layers, *(stack.graph_range(start, stop) if stack else (start, stop)))
        stages.append(PlanStage.costed(setup.model_layers, start, stop, rk, c, B, fl, setup.C, share))
    costing = StageCosting.EXACT
    if stack is not None:
        costing = call["costing"].stage_costing

    def without_stage(j: int) -> Plan:
        return _chosen_plan(setup, kind, call, t, stage_cost, ruled_out | {entries[j]})

    return Plan(
        tuple(stages), B, n, clusters, setup.capacity, score, time.perf_counter() - setup.t0,
        sp.misses - setup.misses, tried, kind, costing,
        transfers=setup.transfers([st.layers for st in stages], ranks), cluster=sp.cluster.name,
        without_stage=without_stage,
    )  # fmt: skip


def _recomputed(sp: StagePlanner, stack: Stack, mode: RecomputeMode) -> dict[Recompute, tuple[StagePlanner, Stack]]:
    """Per recomputation `mode` allows (auto: selective and full), the planner and stack of `stack` with every
    captured block recomputed so (``config_plan.recomputed_stack``), for the stage tables' recomputing levels;
    a kind whose blocks cannot be recomputed exactly (dropout) is left out."""
    from meshpilot.planner.config_plan import recomputed_stack

    kinds = {
        RecomputeMode.AUTO: (Recompute.SELECTIVE, Recompute.FULL),
        RecomputeMode.NONE: (),
        RecomputeMode.SELECTIVE: (Recompute.SELECTIVE,),
        RecomputeMode.FULL: (Recompute.FULL,),
    }
    made = _RECOMPUTED.setdefault(sp, {})  # one planner per graph: its searches cached across the schedules
    out = {}
    for kind in kinds[mode]:
        if kind not in made or made[kind][0] is not stack:
            try:
                rc = recomputed_stack(stack, kind)
            except UserError:
                rc = None
            made[kind] = (stack, None if rc is None else (StagePlanner(rc.graph, sp.cluster), rc))
        if made[kind][1] is not None:
            out[kind] = made[kind][1]
    return out


_RECOMPUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per stage planner, by kind, the stack :func:`_recomputed` last recomputed and its recomputing planner and stack
(None: its blocks cannot be recomputed so)."""


def fixed_pipeline(
    graph: OpGraph,
    cluster,
    stages: Sequence[tuple[tuple[int, int], Sequence[int], Sequence[int]]],
    *,
    microbatches: int,
    schedule: PipelineKind | str = PipelineKind.ONE_F_ONE_B,
    planner: StagePlanner | None = None,
    **stage_kw,
) -> Plan:
    """A :class:`Plan` of stages given by hand — ``(layers [start, stop), ranks, logical mesh shape)``
    each — costed as :func:`plan_pipeline` costs its own (``StagePlanner.plan`` on the stage's ranks, Eq. 2's
    step, Eq. 5's memory under `schedule`); nothing is searched but each stage's intra-operator plan. For a
    split chosen by the user, and for tests that need particular stages and meshes. Pure."""
    t0 = time.perf_counter()
    kind = PipelineKind(schedule)
    sp = planner if planner is not None else StagePlanner(graph, cluster)
    K = len(sp.layers)
    bounds = [tuple(int(x) for x in layers_) for layers_, _, _ in stages]
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != K or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        raise UserError(f"stages cover layers {bounds}; give contiguous ranges [start, stop) from 0 to {K}")
    ranks = [tuple(int(r) for r in rk) for _, rk, _ in stages]
    groups = _groups(ranks, kind)
    n = sum(len(r) for r in groups)
    if sorted(r for rk in groups for r in rk) != list(range(n)):
        raise UserError(f"stages on ranks {ranks}; give every rank 0..{n - 1} to exactly one stage")
    C = received_bytes(graph, sp.layers)
    capacity = float(stage_kw.get("capacity", sp.cluster.device.memory_bytes))
    misses = sp.misses
    held = _held_per_stage(kind, groups, len(stages), microbatches)
    out = []
    for j, ((start, stop), rk, (_, _, shape)) in enumerate(zip(bounds, ranks, stages)):
        c = sp.plan(start, stop, rk, tuple(shape), microbatches=microbatches, **stage_kw)
        share = input_grad_share(graph, sp.layers, start, stop)
        out.append(PlanStage.costed(sp.layers, start, stop, rk, c, microbatches, held[j], C, share))
    fl_sum = tuple(sum(x.flops for x in sp.layers[a:b]) for a, b in bounds)
    clustering = Clustering(tuple(bounds), fl_sum, tuple(float(C[a, b - 1]) for a, b in bounds), 0.0)
    plan = Plan(
        tuple(out), microbatches, n, clustering, capacity, 0.0, time.perf_counter() - t0, sp.misses - misses, 0, kind,
        transfers=stage_transfers(graph, sp.layers, bounds, ranks, sp.cluster), cluster=sp.cluster.name,
    )  # fmt: skip
    return dataclasses.replace(plan, dp_step_s=plan.step_s)


def _groups(ranks: Sequence[tuple[int, ...]], kind: PipelineKind) -> list[tuple[int, ...]]:
    """The rank classes of stages on `ranks`: one per stage, or under Interleaved1F1B the P distinct ones,
    stage j on class j mod P (one line otherwise)."""
    if kind != PipelineKind.INTERLEAVED_1F1B:
        return list(ranks)
    groups: list[tuple[int, ...]] = []
    for rk in ranks:
        if rk not in groups:
            groups.append(rk)
    P = len(groups)
    if P < 2 or len(ranks) % P or any(rk != groups[j % P] for j, rk in enumerate(ranks)) or len(ranks) == P:
        raise UserError(
            f"interleaved 1F1B stages on ranks {ranks}: give v ≥ 2 rounds of the same P ≥ 2 rank groups, stage j "
            "on group j mod P (e.g. [0,1], [2,3], [0,1], [2,3])"
        )
    return groups


def _held_per_stage(kind: PipelineKind, groups: Sequence[tuple[int, ...]], stages: int, B: int) -> list[int]:
    """Microbatches whose activations each stage holds at most under `kind` (read off the schedule)."""
    if kind != PipelineKind.INTERLEAVED_1F1B:
        return list(held_one_chunk(kind, stages, B))
    held = stage_in_flight_of(pipeline([[p] for p in range(len(groups))], B, kind, stages // len(groups)))
    return [held[j] for j in range(stages)]


def bypassed(graph: OpGraph, layers: Sequence[Layer]) -> np.ndarray:
    """``X[s, e]`` (s ≤ e): whether a value made in a layer before s is read in one after e, or the other way
    round — a stage of layers s..e between two cuts would have it cross more than one boundary, which the
    stage runtime refuses (``runtime.pipeline_stages``: one line, "choose other split points"). A tied
    parameter and its gradient's parts do not cross: each stage holding a reader keeps a copy and its own part
    (``stage.slice_graph``, *Tied parameters*)."""
    K = len(layers)
    X = np.zeros((K, K), dtype=bool)
    for x in crossings(graph, layers):
        a, b = sorted((x.made_in, x.read_in))
        if b - a >= 2:
            X[a + 1 : b, a + 1 : b] |= np.triu(np.ones((b - a - 1, b - a - 1), dtype=bool))
    return X


def unsplittable(graph: OpGraph, layers: Sequence[Layer]) -> np.ndarray:
    """``X[s, e]`` (s ≤ e): whether a stage of layers s..e would hold some but not all of the layers that
    read one buffer — the stage runtime gives a buffer to one stage and refuses a plan that splits its readers
    (``runtime.pipeline_stages``: one line) — or one end but not the other of a value flowing against the
    pipeline (:func:`against_spans`). Each such span ``[a, b]`` must lie inside the stage or outside it. (A tied
    parameter is copied into each stage that reads it: ``stage.slice_graph``.)"""
    K = len(layers)
    X = np.zeros((K, K), dtype=bool)
    s, e = np.meshgrid(np.arange(K), np.arange(K), indexing="ij")
    spans = [(w.first, w.last) for w in shared_buffers(graph, layers)] + against_spans(graph, layers)
    for a, b in spans:
        X |= (s <= e) & (s <= b) & (e >= a) & ~((s <= a) & (e >= b))
    return X


def against_spans(graph: OpGraph, layers: Sequence[Layer]) -> list[tuple[int, int]]:
    """``(a, b)`` (a < b) of each value that would cross stages against the pipeline's direction if a cut
    fell between layers a and b: a forward value made in a later layer and read in an earlier one (a module
    called twice, as T5's decoder calls its dropout after the embedding and again after the final norm), or
    a gradient made in an earlier layer's backward and read in a later one's (the runtime passes forward values
    to later stages and gradients to earlier ones; a tied parameter's gradient parts stay where they are)."""
    out = set()
    for x in crossings(graph, layers):
        if graph[x.src].kind in LEAF_KINDS:
            continue
        p, q, made = x.made_in, x.read_in, graph[x.src].phase
        if (
            (p > q and made == Phase.FWD)
            or (p < q and made == Phase.BWD)
            or (p > q and graph[x.dst].phase != Phase.BWD)
        ):
            out.add((min(p, q), max(p, q)))
    return sorted(out)


@dataclass(frozen=True)
class SharedBuffer:
    """A buffer read in more than one layer (:func:`shared_buffers`)."""

    name: str
    readers: tuple[int, ...]
    """The layers reading it (its own layer included), ascending."""

    @property
    def first(self) -> int:
        return self.readers[0]

    @property
    def last(self) -> int:
        return self.readers[-1]


def shared_buffers(graph: OpGraph, layers: Sequence[Layer]) -> list[SharedBuffer]:
    """Each buffer read in more than one layer, with the layers that read it."""
    where = {name: j for j, layer in enumerate(layers) for name in layer.nodes}
    out = []
    for n in graph.nodes:
        if n.kind != NodeKind.BUFFER or n.name not in where:
            continue
        readers = sorted({where[u] for u in graph.users[n.name] if u in where} | {where[n.name]})
        if len(readers) > 1:
            out.append(SharedBuffer(n.fqn or n.name, tuple(readers)))
    return out


def _check_splittable(
    refused: np.ndarray, counts: Sequence[int], graph: OpGraph, layers: Sequence[Layer], clusters: Clustering
) -> None:
    """A one-line PlanError when the clusters split into none of `counts` stages that the stage runtime can
    run (each stage a range :func:`refused_ranges` leaves in), whatever their devices and memory."""
    L = len(clusters.bounds)
    most = max(counts)
    can = np.zeros((most + 1, L + 1), dtype=bool)  # can[s, i]: clusters 0..i-1 in s runnable stages
    can[0, 0] = True
    for n_st in range(1, most + 1):
        for i in range(1, L + 1):
            can[n_st, i] = any(can[n_st - 1, k] and not refused[k, i - 1] for k in range(i))
    if any(can[c, L] for c in counts):
        return
    shared = shared_buffers(graph, layers)
    if shared:
        w = max(shared, key=lambda t: t.last - t.first)
        names = [layers[j].name for j in w.readers]
        readers = " and ".join(names) if len(names) == 2 else ", ".join(names[:-1]) + " and " + names[-1]
        why = f"the buffer {w.name} is read by layers {readers}, which must share a stage"
    else:
        why = "values made in one layer are read several layers later, so no cut between them can run"
    stages = f"{counts[0]} stages" if len(counts) == 1 else f"up to {most} stages"
    raise PlanError(f"no split of {len(layers)} layers into {stages} can run: {why}; plan fewer stages (--stages)")


def refused_ranges(graph: OpGraph, layers: Sequence[Layer], clusters: Clustering, stack=None) -> np.ndarray:
    """``R[k, i]``: a stage of clusters k..i would have a value cross it whole (:func:`bypassed` of its first
    and last layer) or split a span that must share a stage (:func:`unsplittable`: a buffer's readers, a value
    flowing against the pipeline), so the stage DP leaves it out. With
    a :class:`~meshpilot.planner.stack.Stack`, `graph` and `layers` are its captured graph's and each range of
    the model's layers reads as the captured range it maps to (``Stack.received``: the blocks repeat, so do
    the values crossing them)."""
    X = (bypassed(graph, layers) | unsplittable(graph, layers)).astype(float)
    if stack is not None:
        X = stack.received(X)
    L = len(clusters.bounds)
    R = np.zeros((L, L), dtype=bool)
    for k in range(L):
        for i in range(k, L):
            R[k, i] = X[clusters.bounds[k][0], clusters.bounds[i][1] - 1] > 0
    return R


def _size_tuples(sizes: Sequence[int], parts: int, total: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of `parts` allowed submesh sizes adding up to `total` (groups' device counts)."""
    if parts == 0:
        return [()] if total == 0 else []
    return [(d, *rest) for d in sizes if d <= total for rest in _size_tuples(sizes, parts - 1, total - d)]


INTERLEAVED_FRONT = 256
"""Most (T, M) vectors :func:`_interleaved_dp` keeps per (chunk, clusters used); beyond it those with the least
slowest group and Σ t are kept, and the search is no longer exact (``plan_pipeline`` warns)."""


@dataclass
class _Chunk:
    """One option for a virtual stage: clusters ``k..i`` on its group's submesh, one logical shape."""

    k: int
    i: int
    cost: StageCost
    t: float
    memory: float


def _interleaved_dp(
    options: dict[tuple[int, int, int], list[_Chunk]],
    L: int,
    P: int,
    v: int,
    B: int,
    capacity: float,
    *,
    front_cap: int = INTERLEAVED_FRONT,
    bound: float = math.inf,
) -> tuple[float, list[_Chunk], bool] | None:
    """The least interleaved step over the splits of L clusters into V = v·P chunks, chunk j on group j mod P
    (module docstring, section 6): a DP over (chunk j, clusters used k) keeping the Pareto front of (T_g, M_g)
    per group; `options[(j, k, i)]`: chunk j over clusters k..i, one per logical shape. A partial split whose
    closed form already exceeds `bound` (a step some split reaches) is dropped: more chunks only add to it.
    Returns (step, the chunks, whether a front was cut at `front_cap`) or None when nothing fits."""
    V = v * P
    front: dict[int, list[tuple[tuple[float, ...], tuple[float, ...], float, tuple]]] = {
        0: [((0.0,) * P, (0.0,) * P, 0.0, ())]
    }  # k -> [(T per group, M per group, Σ t, chosen chunks as a linked tuple)]
    capped = False
    limit = bound * (1 + 1e-12)
    for j in range(V):
        g = j % P
        nxt: dict[int, list] = {}
        for k, entries in front.items():
            for i in range(k, L - (V - 1 - j)):
                for opt in options.get((j, k, i), ()):
                    for T, M, tot, chain in entries:
                        m = M[g] + opt.memory
                        if m > capacity:
                            continue
                        T2 = T[:g] + (T[g] + opt.t,) + T[g + 1 :]
                        if B * max(T2) + (tot + opt.t - max(T2)) / v > limit:
                            continue
                        M2 = M[:g] + (m,) + M[g + 1 :]
                        nxt.setdefault(i + 1, []).append((T2, M2, tot + opt.t, (chain, opt)))
        front = {}
        for k, entries in nxt.items():
            entries.sort(key=lambda e: (max(e[0]), e[2], e[1]))
            kept: list = []
            for e in entries:  # drop what another entry matches or beats in every group's time and memory
                if not any(all(a <= b for a, b in zip(o[0] + o[1], e[0] + e[1])) for o in kept):
                    kept.append(e)
            if len(kept) > front_cap:
                capped, kept = True, kept[:front_cap]
            front[k] = kept
    best = None
    for T, _, tot, chain in front.get(L, ()):
        step = B * max(T) + (tot - max(T)) / v
        if best is None or step < best[0]:
            best = (step, chain)
    if best is None:
        return None
    chunks: list[_Chunk] = []
    chain = best[1]
    while chain:
        chain, opt = chain
        chunks.append(opt)
    return best[0], chunks[::-1], capped


@dataclass(frozen=True)
class _Interleaved:
    """One optimum of the interleaved DP: under a bound on every chunk's t, for one P and group sizes."""

    step_s: float
    """The closed form (module docstring, section 6) the DP minimised."""
    t_max: float
    group_sizes: tuple[int, ...]
    chunks: tuple[_Chunk, ...]


def _plan_interleaved(
    sp: StagePlanner,
    clusters: Clustering,
    sizes: Sequence[int],
    n: int,
    B: int,
    v: int,
    num_stages: int | None,
    capacity: float,
    epsilon: float,
    stage_kw: dict,
) -> tuple[list[_Interleaved], int, bool]:
    """Interleaved1F1B's search (module docstring, section 6): over the group counts P (`num_stages`, or every
    one with B a multiple of P and v·P ≤ the clusters), the groups' submesh sizes and a bound t_max on every
    chunk's t (the distinct chunk times, those within (1 + `epsilon`) tried together), :func:`_interleaved_dp`
    on the stage planner's costs. Returns every distinct optimum found, the bounds tried (over every P and
    group sizes: ``Plan.t_max_tried``) and whether a front was capped."""
    L = len(clusters.bounds)
    Ps = [num_stages] if num_stages is not None else range(2, min(n, L // v) + 1)
    costs: dict[tuple[int, int, int], list[StageCost]] = {}
    refused = refused_ranges(sp.graph, sp.layers, clusters)

    def cost(k: int, i: int, d: int) -> list[StageCost]:
        if (k, i, d) not in costs:
            start, stop = clusters.bounds[k][0], clusters.bounds[i][1]
            found = []
            for shape in mesh_shapes_2d(d):
                try:
                    found.append(sp.plan(start, stop, range(d), shape, microbatches=B, **stage_kw))
                except PlanError:
                    continue
            costs[(k, i, d)] = found
        return costs[(k, i, d)]

    out: dict[tuple, _Interleaved] = {}
    tried, capped = 0, False
    for P in Ps:
        V = v * P
        if P < 2 or B % P or V > L:
            continue
        held = stage_in_flight_of(pipeline([[p] for p in range(P)], B, PipelineKind.INTERLEAVED_1F1B, v))
        for group_sizes in _size_tuples(sizes, P, n):
            options: dict[tuple[int, int, int], list[_Chunk]] = {}
            for j in range(V):
                d = group_sizes[j % P]
                for k in range(j, L - (V - 1 - j)):
                    for i in range(k, L - (V - 1 - j)):
                        if refused[k, i]:
                            continue  # a value would cross it: the runtime cannot run this chunk between two cuts
                        options[(j, k, i)] = [
                            _Chunk(k, i, c, c.time.total_s / B, stage_memory(c, held[j])) for c in cost(k, i, d)
                        ]
            cands = sorted({o.t for opts in options.values() for o in opts}, reverse=True)
            j = 0
            while j < len(cands):  # t_max from the largest down, each below the last optimum's slowest chunk
                t_max = cands[j]
                while j < len(cands) and cands[j] * (1 + epsilon) >= t_max:
                    j += 1
                bounded = {key: [o for o in opts if o.t <= t_max] for key, opts in options.items()}
                tried += 1
                quick = _interleaved_dp(bounded, L, P, v, B, capacity, front_cap=8)  # a step some split reaches
                if quick is None:
                    found = _interleaved_dp(bounded, L, P, v, B, capacity)
                else:
                    found = _interleaved_dp(bounded, L, P, v, B, capacity, bound=quick[0]) or quick
                if found is None:
                    break
                capped |= found[2]
                key = (group_sizes, tuple((o.k, o.i, o.cost.mesh_shape) for o in found[1]))
                out.setdefault(key, _Interleaved(found[0], t_max, group_sizes, tuple(found[1])))
                slowest = max(o.t for o in found[1])  # the next bound excludes this optimum's slowest chunk
                while j < len(cands) and cands[j] >= slowest:
                    j += 1
    return list(out.values()), tried, capped
