"""Activation recomputation as a planned choice: which repeated blocks re-run their forward in the backward.

A block recomputed (Megatron's *full* recompute, ``torch.utils.checkpoint`` around one transformer block) keeps
only its inputs from the forward; when the backward reaches it, the block's forward runs again from those inputs
and the backward reads the recomputed values. meshpilot writes this into the captured graph itself
(:func:`apply`), so the strategy search, the accounting of time and memory and the runtime's programs all see
it as they see any graph — one code path, no second runtime.

Regions (:func:`regions`)
-------------------------
A region is one numbered block of the model (``blocks.3``, ``model.layers.3``: ``stage.layer_keys``, the
layers the stage DP cuts at) — its forward side ``F_R``: the ops and getitems its modules made before the
backward begins (:func:`backward_start`, the node after the last forward one). ``F_R`` includes what the joint
graph computes during the forward for the backward only (a weight's transpose, a ``detach`` of an attention
output, a norm's mean and rstd): capture gives those ``Phase.BWD``, but they run with the forward. A value of
``F_R`` that a node outside ``F_R`` reads before the backward begins is one of the block's *outputs* (the
residual stream to the next block): the next block keeps it anyway, so it is never recomputed. Every other value
of ``F_R`` that the backward reads is *interior*. The nodes recomputed are the interior values and their
ancestors inside ``F_R``, stopping at outputs (``Region.recomputed``).

The transform (:func:`apply`)
-----------------------------
For every chosen region each recomputed node ``v`` gets a copy ``v'`` (named ``v`` + :data:`SUFFIX`):

* ``v'`` is a backward node (``Phase.BWD``) reading the copies of its operands that were copied and the
  originals of the rest (the block's saved inputs: the previous block's output, parameters, masks);
* every node of the backward that read ``v`` reads ``v'``; an original made for the backward only is dropped;
* the copies of a region run together, just before the first backward node that reads one of them;
* ``v'`` is in ``v``'s class of identical nodes (``OpGraph.canonical``), so the ILP gives it ``v``'s strategy:
  a tensor-parallel block re-issues its forward collectives in the backward, as Megatron's does, and the plan's
  collectives count them.

Then ``saved_for_backward`` is what the backward reads of the forward: a recomputed block's inputs, no longer
its interior. The copies share their original's FX node (the runtime's template of the call); the plan keeps the
fingerprint of the graph as captured, and the runtime applies the plan's regions to its own capture
(:func:`for_plan`), which gives the same graph.

Random draws: a region whose recomputed nodes draw random numbers (dropout) would draw other numbers the second
time; it is refused (:class:`RecomputeError` under ``full``, left out under ``auto``), never run differently.

Selective recomputation (``selective:<block>``)
-----------------------------------------------
Megatron-LM's *selective* recompute re-runs the part of a block that holds much memory for little compute;
torchtitan's op-level policy draws the line by op: keep what matrix products and attention produce, re-run the
rest. A block's selective region is its region (above) with the cone stopped at the ops of
:data:`KEPT_TARGETS` (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolution, grouped ``mm``, attention) and
the items of their tuples (:func:`is_kept`): those stay saved for the backward, and the copies read them. A
stop the backward reads only through one reader in the cone moves down to that reader where its output is no
larger (:func:`_selective`): a row-parallel product's output is a whole partial sum under TP, the residual add
after it a reduced value (and a sequence shard under sequence parallelism). What
is recomputed is the memory-bound rest — norms and their float32 copies, activations (SiLU, GeLU, the gated
product), rotary embeddings, grouped-query attention's repeated keys and values, residual adds, casts and
views — whose second run costs bytes, not FLOPs. ``Region.saved_bytes`` is the interior recomputed less the
kept values the copies read that the backward did not read already (now kept: e.g. an MLP's gate and up
products, which SiLU's and the product's backward read only through the recomputed values).

A block named both ways (``blocks.3`` and ``selective:blocks.3``) is recomputed whole: whole blocks are applied
first, and a region whose nodes an earlier one copies is left out (:func:`apply`). ``--recompute selective``
recomputes every block's selective region; ``auto`` orders every selective region before every whole block
(:func:`ordered`), so the counts it plans take selective regions first, then whole blocks on top. The runtime
applies the regions the plan names (:func:`for_plan`), selective ones as whole ones: a graph transform.

Re-gathered values (:func:`gather_region`)
-----------------------------------------
Megatron-LM's sequence parallelism all-gathers the sequence-sharded norm output before the column linears and,
in the backward, all-gathers the saved shard again rather than keep the gathered copy. A region named
``regather:<node>`` (:data:`REGATHER`) is that one value: the node (the op whose output the plan gathers: its
strategy reads the shard resharded whole) and the views and casts of it made before the backward begins,
recomputed as a block's are but copied as ``<node>`` + :data:`REGATHERED`. The copy joins its original's class
of identical nodes, but the pin is the original's, so the ILP chooses where the copy's shard becomes whole
again: into the copy, or into its readers (the column linears' weight gradients). Either way it is an
all-gather in the backward, which the plan counts and prices. The backward keeps the copy's inputs (the shard,
which the norm's own backward reads anyway) instead of the gathered value. Which nodes:
``forced.sequence_gathers`` (the norm outputs ``megatron_tp(..., sequence_parallel=True)`` pins whole on TP);
``auto.plan`` and ``config_plan`` re-gather every one of them.
A block that is recomputed already re-gathers its own (its copies read the copied norm): a re-gather region
overlapping a recomputed block is left out (:func:`apply`).

The choice (:func:`choose`)
---------------------------
``recompute="none"`` plans the graph as captured, ``"full"`` recomputes every region, ``"selective"`` every
region's selective part, and ``"auto"`` (the default) recomputes only when the plan without it does not fit the
memory cap:

1. plan the captured graph; if its predicted peak ``M_0`` fits the capacity ``C``, that is the plan;
2. order the regions, the selective ones first, then the whole blocks, each kind by ``saved_R / extra_R``,
   the bytes the region stops keeping per second of forward it adds (``Region.saved_bytes``, and
   :func:`forward_seconds`, its forward on one device by the cost model's roofline), largest first (identical
   blocks tie: forward order);
3. the fewest regions ``k₀`` whose graph fits ``C`` under the first plan's strategies (copies taking their
   original's; :func:`accounting.memory_use`, exact for those strategies) is where the counts start (1 when
   step 1 found no plan at all): fewer cannot fit with those strategies;
4. plan the graph with the first ``k`` regions recomputed for every ``k`` of :func:`counts` (every count
   from ``k₀`` to all regions, or, past :data:`MAX_COUNTS` of them, the first three and the rest spaced
   evenly up to all) and take the fastest plan that fits (``StagePlan.time.total_s``; the fewer regions on
   a tie). More regions is not always slower: each one recomputed adds its forward but frees memory the
   ILP would otherwise buy by sharding more (the 1,024-token Llama of ``bench_cp``: 2 blocks at 0.612 ms,
   4 at 0.571 ms under one cap).

The plan records the regions, why, and the predicted peak before and after (:class:`RecomputeChoice`), and
prices the copies' compute and collectives in its step time like any node's. ``auto`` chooses for one-stage
plans; a pipeline's stages recompute their blocks whole where the stage table costed them so
(``StageCost.recompute``, ``Plan.with_intra``), and ``config_plan`` recomputes as a configuration states.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from meshpilot.errors import UserError
from meshpilot.graph.capture import NodeKind, OpGraph, OpNode, Phase
from meshpilot.graph.views import aliases_input
from meshpilot.io import fmt_size
from meshpilot.planner.accounting import kernel_fixed_seconds, storage_base
from meshpilot.planner.forced import _CAST
from meshpilot.planner.plan import RecomputeChoice, StagePlan

SUFFIX = "_recomputed"
"""What a recomputed block's copy's name adds to its original's."""

REGATHERED = "_regathered"
"""What a re-gathered value's copy's name adds to its original's (module docstring, *Re-gathered values*)."""

REGATHER = "regather:"
"""Prefix of a re-gather region's name: ``regather:<node>``."""

SELECTIVE = "selective:"
"""Prefix of a selective region's name: ``selective:<block>`` (module docstring, *Selective recomputation*)."""

KEPT_TARGETS = frozenset(
    {
        "aten.mm.default",
        "aten.addmm.default",
        "aten.bmm.default",
        "aten.baddbmm.default",
        "aten.convolution.default",
        "aten._grouped_mm.default",
        "meshpilot.sdpa.default",
    }
)
"""The ops whose outputs a selective region keeps from the forward: the compute-bound ones (matrix products,
convolutions, attention), whose second run would cost what their first did."""


class Recompute(StrEnum):
    """Activation recomputation as papers name it: what a configuration states (``config_plan``) and what a
    pipeline stage was costed with (``stage.StageCost.recompute``)."""

    NONE = "none"
    SELECTIVE = "selective"
    """Every repeated block's selective region (module docstring, *Selective recomputation*)."""
    FULL = "full"
    """Every repeated block whole."""


class RecomputeMode(StrEnum):
    """Which regions a plan recomputes (``--recompute``)."""

    AUTO = "auto"
    """Only when the plan without recomputation does not fit the memory cap: the fastest plan that fits."""
    NONE = "none"
    """None: every activation the backward reads is kept from the forward."""
    SELECTIVE = "selective"
    """Every repeated block's memory-bound ops (norms, activations, rotary, casts, copies); its matrix
    products' and attention's outputs kept."""
    FULL = "full"
    """Every repeated block."""

    @classmethod
    def parse(cls, value: str | RecomputeMode) -> RecomputeMode:
        try:
            return cls(value)
        except ValueError:
            raise UserError(
                f"recompute={value!r}: choose one of {', '.join(m.value for m in cls)} (auto: only when the plan "
                "does not fit in memory; selective: a block's matrix products and attention kept, the rest "
                "recomputed)"
            ) from None


class RecomputeError(UserError):
    """A region that cannot be recomputed exactly, or one the graph does not have."""


@dataclass(frozen=True)
class Region:
    """One numbered block of the model, as recomputation sees it (module docstring, *Regions*)."""

    name: str
    """The block's module path (``model.layers.3``)."""
    recomputed: tuple[str, ...]
    """Nodes copied into the backward, in graph order."""
    saved_bytes: float
    """Bytes (whole tensors, one microbatch) of the interior values the backward stops keeping."""
    flops: float
    """FLOPs of the recomputed nodes: the forward run again."""
    random: str | None = None
    """The first recomputed node that draws random numbers, where the model made it (None: none does)."""


def _is_random(node: OpNode) -> bool:
    target = node.fx_node.target if node.fx_node is not None else None
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def backward_start(graph: OpGraph) -> int:
    """Index of the first node after the last forward one: where the step's backward begins. Before it, the
    joint graph also holds nodes only the backward reads, made while the forward ran (a weight's transpose, a
    ``detach`` of an attention output, a norm's mean): they are the forward's side of a block."""
    return 1 + max((n.index for n in graph.nodes if n.phase == Phase.FWD), default=-1)


def is_kept(node: OpNode) -> bool:
    """Whether `node` is one of the ops whose outputs a selective region keeps from the forward
    (:data:`KEPT_TARGETS`; the items of their tuples are kept with them)."""
    return node.target in KEPT_TARGETS


def regions(graph: OpGraph, selective: bool = False) -> list[Region]:
    """Every numbered block of `graph` with something to recompute, in forward order (module docstring); with
    `selective`, each block's selective region (``selective:<block>``: *Selective recomputation*)."""
    from meshpilot.planner.stage import layer_keys

    key = layer_keys(graph)
    start = backward_start(graph)
    members: dict[str, set[str]] = {}
    for n in graph.nodes[:start]:
        if n.kind not in (NodeKind.OP, NodeKind.GETITEM):
            continue
        k = key(n.module)
        if k is not None and any(part.isdigit() for part in k.split(".")):
            members.setdefault(k, set()).add(n.name)
    out = []
    for name, inside in members.items():
        region = _selective(graph, name, inside, start) if selective else _region(graph, name, inside, start)
        if region.recomputed:
            out.append(region)
    return out


def _kept(graph: OpGraph, name: str) -> bool:
    """Whether node `name` is kept by a selective region: a kept op, or an item of one's tuple."""
    n = graph[name]
    return is_kept(n) or (n.kind == NodeKind.GETITEM and bool(n.inputs) and is_kept(graph[n.inputs[0][0]]))


def _selective(graph: OpGraph, name: str, inside: set[str], start: int) -> Region:
    """Block `name`'s selective region (module docstring, *Selective recomputation*): the cone stopped at the
    kept ops, then each stop moved down to its one reader in the cone where the backward reads the stop only
    through that reader's copy and the reader's output is no larger — a row-parallel product's partial sum kept
    whole is the residual add's input, whose output is reduced (and, under sequence parallelism, a shard)."""
    stop = {x for x in inside if _kept(graph, x)}
    read_after = {s for n in graph.nodes[start:] for s, _ in n.inputs}
    while True:
        region = _region(graph, SELECTIVE + name, inside - stop, start, inside)
        cone = set(region.recomputed)
        moved = set()
        for k in stop - read_after:
            readers = [u for u in graph.users[k] if u in cone]
            if len(readers) == 1 and _nbytes_of(graph, readers[0]) <= _nbytes_of(graph, k):
                moved.add(readers[0])
        if not moved:
            return region
        stop |= moved


def _nbytes_of(graph: OpGraph, name: str) -> float:
    """Bytes of node `name`'s outputs (whole tensors)."""
    return sum(o.nbytes for o in graph[name].outputs if o is not None)


def _region(graph: OpGraph, name: str, inside: set[str], start: int, block: set[str] | None = None) -> Region:
    """The region `name` recomputing what it can of `inside` (forward-side nodes of the block whose nodes are
    `block`, `inside` itself when None); the backward begins at `start`. The saved bytes are the interior
    values recomputed, less those of the block's values the copies read that the backward did not keep."""
    block = inside if block is None else block
    before, after = graph.nodes[:start], graph.nodes[start:]
    outputs = {s for n in before if n.name not in block for s, _ in n.inputs} & block
    interior = {(s, i) for n in after for s, i in n.inputs if s in block and s not in outputs}
    cone: set[str] = set()
    stack = [s for s, _ in interior]
    while stack:
        x = stack.pop()
        if x in cone or x not in inside or x in outputs:
            continue
        cone.add(x)
        stack += [s for s, _ in graph[x].inputs]
    nodes = [n for n in before if n.name in cone]
    bases = {storage_base(graph, s, i) for s, i in interior}
    newly = {
        storage_base(graph, s, i) for n in nodes for s, i in n.inputs if s in block and s not in cone | outputs
    } - bases
    saved = _nbytes(graph, {b for b in bases if b[0] in cone}) - _nbytes(graph, newly)
    random = next((f"{n.target} in {n.where()}" for n in nodes if _is_random(n)), None)
    return Region(name, tuple(n.name for n in nodes), saved, sum(n.flops for n in nodes), random)


def _nbytes(graph: OpGraph, values: set[tuple[str, int]]) -> float:
    """Bytes of the storages `values` (``(node, output)`` pairs; outputs without a tensor count 0)."""
    return sum(graph[b].outputs[i].nbytes for b, i in values if graph[b].outputs[i] is not None)


def gather_region(graph: OpGraph, node: str) -> Region | None:
    """The region ``regather:<node>`` (module docstring, *Re-gathered values*): forward op `node` and its views
    and casts made before the backward begins, as far as the backward reads them; None when `graph` has no such
    forward op."""
    start = backward_start(graph)
    n = graph.by_name.get(node)
    if n is None or n.kind != NodeKind.OP or n.index >= start:
        return None
    inside = {node}
    for m in graph.nodes[n.index + 1 : start]:
        if m.inputs and m.inputs[0][0] in inside and (aliases_input(m) or m.target == _CAST):
            inside.add(m.name)
    cone: set[str] = set()
    stack = [s for m in graph.nodes[start:] for s, _ in m.inputs if s in inside]
    while stack:
        x = stack.pop()
        if x not in cone and x in inside:
            cone.add(x)
            if x != node:
                stack.append(graph[x].inputs[0][0])  # back along the view / cast to `node`
    nodes = [m for m in graph.nodes[:start] if m.name in cone]
    out = n.out
    saved = out.nbytes if cone and out is not None else 0.0
    random = f"{n.target} in {n.where()}" if _is_random(n) else None
    return Region(REGATHER + node, tuple(m.name for m in nodes), saved, sum(m.flops for m in nodes), random)


def _check(graph: OpGraph, names: Sequence[str]) -> list[Region]:
    """The regions `names`, each one `graph` has and recomputes exactly; one line for the first that is not."""
    blocks = [x for x in names if not x.startswith(REGATHER)]
    by_name = {r.name: r for r in regions(graph)} if blocks else {}
    if any(x.startswith(SELECTIVE) for x in blocks):
        by_name.update((r.name, r) for r in regions(graph, selective=True))
    out = []
    for name in names:
        r = by_name.get(name) if name in blocks else gather_region(graph, name.removeprefix(REGATHER))
        if r is None and name.startswith(REGATHER):
            raise RecomputeError(
                f"recompute: the model has no forward op {name.removeprefix(REGATHER)!r} to gather again; plan "
                "again for this model"
            )
        if r is None:
            known = ", ".join(list(by_name)[:4]) + (" …" if len(by_name) > 4 else "") or "none"
            raise RecomputeError(
                f"recompute: the model has no block {name!r} to recompute (its blocks: {known}); plan again for "
                "this model"
            )
        if r.random is not None:
            raise RecomputeError(
                f"recompute: block {name} draws random numbers ({r.random}), which a second forward would draw "
                "differently; set the model's dropout to 0 or plan with --recompute none (recompute='none')"
            )
        out.append(r)
    return out


def apply(graph: OpGraph, names: Sequence[str]) -> OpGraph:
    """`graph` with the blocks `names` recomputed in the backward (module docstring, *The transform*) and the
    values ``regather:<node>`` of `names` gathered again (*Re-gathered values*: after the blocks, and left out
    where a recomputed block holds them); `graph` itself when `names` is empty. Pure: `graph` is not changed."""
    if not names:
        return graph
    start = backward_start(graph)
    copy_of: dict[str, str] = {}
    before: dict[int, list[OpNode]] = {}
    for region in sorted(_check(graph, names), key=_applied_order):
        suffix = REGATHERED if region.name.startswith(REGATHER) else SUFFIX
        if not region.recomputed or any(x in copy_of for x in region.recomputed):
            continue  # nothing the backward reads, or a recomputed block's own
        made = {x: x + suffix for x in region.recomputed}
        first = min(graph[u].index for x in made for u in graph.users[x] if graph[u].index >= start)
        for x in region.recomputed:
            n = graph[x]
            ins = tuple((made.get(s, s), i) for s, i in n.inputs)
            before.setdefault(first, []).append(dataclasses.replace(n, name=made[x], phase=Phase.BWD, inputs=ins))
        copy_of.update(made)
    nodes: list[OpNode] = []
    for n in graph.nodes:
        nodes += before.get(n.index, [])
        if n.phase == Phase.BWD and n.name in copy_of:  # made in the forward for the backward: the copy serves
            continue
        ins = tuple((copy_of.get(s, s), i) for s, i in n.inputs) if n.index >= start else n.inputs
        nodes.append(dataclasses.replace(n, inputs=ins))
    return _renumbered(graph, nodes, copy_of)


def _applied_order(region: Region) -> int:
    """Whole blocks first, then selective regions, then re-gathered values: a region whose nodes an earlier
    one already copies is left out (a block recomputed whole re-runs its selective part and its gathers)."""
    return 2 if region.name.startswith(REGATHER) else 1 if region.name.startswith(SELECTIVE) else 0


def _renumbered(graph: OpGraph, nodes: list[OpNode], copy_of: dict[str, str]) -> OpGraph:
    """`graph` with `nodes` (copies made, readers redirected) renumbered, the forward values the backward reads
    marked saved, and each copy in its original's class of identical nodes."""
    by_name = {n.name: n for n in nodes}
    for i, n in enumerate(nodes):
        n.index = i
        n.saved_for_backward = False
    for n in nodes:
        missing = next((s for s, _ in n.inputs if s not in by_name), None)
        if missing is not None:  # a bug here would run wrong or fail far away: stop where it is seen
            raise RuntimeError(f"meshpilot internal error: recomputation left {n.name} reading {missing}, now gone")
        if n.phase == Phase.BWD:
            for s, _ in n.inputs:
                if by_name[s].phase == Phase.FWD:
                    by_name[s].saved_for_backward = True
    canonical = dict(graph.canonical)
    for orig, copy in copy_of.items():
        canonical[copy] = canonical.get(orig, orig)
    return dataclasses.replace(graph, nodes=nodes, canonical=canonical)


def for_plan(graph: OpGraph, plan: StagePlan) -> OpGraph:
    """The graph `plan` was made for, from the model's capture `graph`: its recomputed blocks applied."""
    return apply(graph, plan.recompute.regions) if plan.recompute is not None else graph


def is_copy(name: str) -> bool:
    """Whether node `name` is a recomputed copy (of a block's node or of a re-gathered value)."""
    return name.endswith(SUFFIX) or name.endswith(REGATHERED)


def original(name: str) -> str:
    """The node a copy `name` copies (`name` itself when it is not a copy)."""
    return name.removesuffix(SUFFIX).removesuffix(REGATHERED)


# ------------------------------------------------------------------------------------------ the choice


def forward_seconds(region: Region, graph: OpGraph, cluster: Any) -> float:
    """Seconds of `region`'s recomputed forward on one device of `cluster` (each node's roofline, as the cost
    model prices compute, plus the device's cost per operator)."""
    from meshpilot.cluster import CostModel, LogicalMesh, mapped_ranks
    from meshpilot.cluster.mesh import MeshMapping

    one = CostModel(LogicalMesh(cluster, (1, 1), mapped_ranks((1, 1), MeshMapping.ROW)))
    total = 0.0
    for x in region.recomputed:
        n = graph[x]
        if n.kind != NodeKind.OP or n.is_view:
            continue
        dtype = n.out.dtype if n.out is not None else "float32"
        total += one.compute(n.flops, n.bytes_read + n.bytes_written, dtype) + kernel_fixed_seconds(one.device)
    return total


def ordered(graph: OpGraph, cluster: Any) -> list[Region]:
    """The regions that can be recomputed exactly: every selective region, then every whole block (which
    re-runs its products too), each kind most bytes saved per second of forward added first."""
    selective = [r for r in regions(graph, selective=True) if r.random is None and r.saved_bytes > 0]
    whole = [r for r in regions(graph) if r.random is None]
    return _by_rate(selective, graph, cluster) + _by_rate(whole, graph, cluster)


def _by_rate(usable: list[Region], graph: OpGraph, cluster: Any) -> list[Region]:
    """`usable`, most bytes saved per second of forward added first."""
    rate = {r.name: r.saved_bytes / max(forward_seconds(r, graph, cluster), 1e-12) for r in usable}
    return sorted(usable, key=lambda r: -rate[r.name])  # sorted is stable: ties keep forward order


def fitting_count(
    graph: OpGraph, order: Sequence[Region], plan: StagePlan, capacity: float, gathers: Sequence[str] = ()
) -> int:
    """The fewest of `order`'s regions whose recomputation makes `plan`'s strategies fit `capacity` (copies
    taking their original's strategy; the re-gather regions `gathers` applied throughout): the first guess of
    :func:`choose` (``len(order)`` when none fits)."""
    from meshpilot.planner.accounting import memory_use, plan_strategies

    chosen, m = plan_strategies(plan, graph), plan.step_schedule().microbatches
    for k in range(1, len(order) + 1):
        g = apply(graph, [*(r.name for r in order[:k]), *gathers])
        strategies = {n.name: chosen[original(n.name)] for n in g.nodes}
        if memory_use(g, strategies, plan.mesh_shape, microbatches=m).total <= capacity:
            return k
    return len(order)


PlanFn = Callable[[OpGraph], StagePlan]
"""Plans one graph (``auto.plan`` with everything but the graph fixed); raises ``PlanError`` when none fits."""

REGATHER_WHY = "sequence parallelism: the gathered norm outputs gathered again in the backward, as Megatron-LM's"
"""The reason a plan records for re-gather regions alone."""


def choose(
    graph: OpGraph,
    mode: RecomputeMode,
    capacity: float,
    cluster: Any,
    plan_fn: PlanFn,
    regather: Sequence[str] = (),
) -> StagePlan:
    """The plan of `graph` under `mode` on `cluster` with `capacity` bytes a device (module docstring, *The
    choice*); the forward ops `regather` are gathered again in the backward in every graph planned (*Re-gathered
    values*)."""
    from meshpilot.planner.ilp import PlanError

    gathers = [REGATHER + x for x in regather]

    def with_gathers(names: Sequence[str]) -> list[str]:
        return [*names, *gathers]

    def as_planned(p: StagePlan) -> StagePlan:  # a plan of the re-gathering graph, recorded as the capture's
        return _recorded(p, graph, gathers, mode, REGATHER_WHY, None) if gathers else p

    if mode is RecomputeMode.NONE:
        return as_planned(plan_fn(apply(graph, gathers)))
    if mode in (RecomputeMode.FULL, RecomputeMode.SELECTIVE):
        names = [r.name for r in regions(graph, selective=mode is RecomputeMode.SELECTIVE)]
        if not names:
            raise RecomputeError(
                f"recompute={mode.value}: the model has no numbered blocks to recompute; plan with recompute auto "
                "or none"
            )
        _check(graph, names)
        names = with_gathers(names)
        why = f"asked for (--recompute {mode.value})"
        return _recorded(plan_fn(apply(graph, names)), graph, names, mode, why, None)
    first: StagePlan | None = None
    error: PlanError | None = None
    try:
        first = plan_fn(apply(graph, gathers))
    except PlanError as e:
        if e.need_bytes is None:
            raise
        error = e
    fits = first is not None and first.memory.total <= capacity * (1 + 1e-9)
    order = ordered(graph, cluster) if not fits else []  # a plan that fits costs no look at the blocks
    if not order:
        if first is not None:
            return as_planned(first)
        raise error
    before = first.memory.total if first is not None else error.need_bytes
    start = fitting_count(graph, order, first, capacity, gathers) if first is not None else 1
    best: tuple[StagePlan, list[str]] | None = None
    last: StagePlan | None = None
    for k in counts(start, len(order)):
        names = with_gathers([r.name for r in order[:k]])
        try:
            last, last_names = plan_fn(apply(graph, names)), names
        except PlanError as e:
            error, last = e, None
            continue
        fits = last.memory.total <= capacity * (1 + 1e-9)
        if fits and (best is None or last.time.total_s < best[0].time.total_s):
            best = (last, names)
    if best is not None:
        why = f"the plan without it needs {fmt_size(before)} per device, over the {fmt_size(capacity)} cap"
        return _recorded(best[0], graph, best[1], mode, why, before)
    if last is not None:  # every block recomputed and still over: the plan says so in its warnings
        why = f"still over the {fmt_size(capacity)} cap with every block recomputed"
        return _recorded(last, graph, last_names, mode, why, before)
    raise error


MAX_COUNTS = 6
"""Counts of regions ``auto`` plans at most (:func:`counts`)."""


def counts(start: int, n: int) -> list[int]:
    """The numbers of regions ``auto`` plans, from `start` to all `n` (module docstring, step 4): every one
    when there are at most :data:`MAX_COUNTS`, else ``start`` … ``start + 2`` and the rest spaced evenly up
    to ``n``."""
    if n - start + 1 <= MAX_COUNTS:
        return list(range(start, n + 1))
    head = [start, start + 1, start + 2]
    rest = MAX_COUNTS - len(head)
    tail = [start + 2 + round((n - start - 2) * (i + 1) / rest) for i in range(rest)]
    return sorted(set(head + tail))


def _recorded(
    plan: StagePlan, graph: OpGraph, names: Sequence[str], mode: RecomputeMode, why: str, before: float | None
) -> StagePlan:
    """`plan` (made on the recomputing graph) as the plan of the captured `graph`: its fingerprint and FLOPs
    (the model's, not counting the copies: MFU counts model FLOPs), with the choice recorded."""
    copies = {n.name for n in plan.nodes if is_copy(n.name)}
    m = plan.step_schedule().microbatches
    extra = m * sum(n.seconds for n in plan.nodes if n.name in copies)
    extra += sum(c.seconds * m for c in plan.collectives if c.dst in copies)  # what a copy reads: new
    choice = RecomputeChoice(
        mode=mode.value,
        regions=tuple(names),
        reason=why,
        memory_before=float(before) if before is not None else 0.0,
        memory_after=plan.memory.total,
        extra_s=extra,
    )
    flops = m * sum(n.flops for n in graph.nodes if n.kind == NodeKind.OP)
    return dataclasses.replace(plan, fingerprint=graph.fingerprint(), step_flops=flops, recompute=choice)


__all__ = [
    "REGATHER",
    "REGATHERED",
    "SUFFIX",
    "RecomputeError",
    "RecomputeMode",
    "Region",
    "apply",
    "choose",
    "counts",
    "for_plan",
    "gather_region",
    "is_copy",
    "original",
    "ordered",
    "regions",
]
