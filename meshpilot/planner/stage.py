"""Planning a pipeline stage: a range of layers on a logical mesh of a subset of ranks, its cost cached.

Alpa's stage dynamic program (§5, Eq. 2–5) asks, thousands of times, for ``t_intra(layers i..j, submesh,
logical mesh shape)``: the step time of a range of layers under the best intra-operator plan on that mesh,
and its memory. This module is that question's one entry point, :func:`plan_stage`, over the graph the
whole model was captured into once.

Layers (:func:`layers`)
-----------------------
A *layer* is the work of one child of the model's root module — or, for a container of numbered children
(``blocks.0``, ``blocks.1``; a ``ModuleList`` / ``Sequential``), of one numbered child — in forward order.
Containers may sit deeper, as in Hugging Face's models (``model.layers.3`` in a Llama, ``model.transformer.h.3``
in a GPT-2 under ``HFLoss``): then a module on the way to a container is split into its children in the same
way (``model.transformer.wte``, ``model.transformer.h.0`` … , ``model.transformer.ln_f``, ``model.lm_head``)
and its own ops count as the root's (:func:`layer_keys`).
A node belongs to the layer its ``OpNode.module`` path names; the backward of a layer belongs to it too
(capture records the forward module of backward nodes). Nodes no module made (the root's own ops: the loss,
an addition in the root's forward) join the layer of their first operand that has one, else the first
layer (forward) or the last (backward); leaves (parameters, buffers, inputs, constants) join the layer of
their first reader. A stage is a contiguous range of layers ``[start, stop)``. What the planner costs and the
pipeline runtime runs are :func:`runnable_layers`: the same layers with the nodes no module made placed where a
pipeline can run them (forward values flow to later stages, gradients to earlier ones).

The slice (:func:`slice_graph`)
-------------------------------
The stage's nodes, renumbered in graph order, as an :class:`~meshpilot.graph.capture.OpGraph` that the
strategy builder, the searcher and the accounting take like any captured graph:

* a value a stage node reads but another stage makes — the previous stage's activation in the forward, the
  next stage's gradient in the backward — becomes an input leaf (``boundary:<node>:<output>``) whose layout
  the search chooses like any input's. Moving it between stages is cross-mesh resharding, which the stage
  DP prices on the boundary (Alpa §5.2), not here;
* values the stage makes for other stages are read by nothing inside it;
* the loss (and its replication edge) is the last stage's only; a parameter's gradient edge is kept when
  the stage computes the gradient (a tied weight used by two stages gets its gradient in the stage that
  sums it); buffer updates made in the stage are kept.
* repeated-layer sharing (``OpGraph.canonical``) is kept inside the slice: each class of identical nodes
  shares the strategies of its first member in the slice (``_slice_canonical``).

The slice's ``gm`` is the whole model's (not runnable on its own); planning reads only the nodes.

Tied parameters (:func:`tied_params`)
-------------------------------------
A parameter that nodes of several layers read — GPT-2's token embedding, read again by its LM head; T5's
shared embedding, read by its encoder, its decoder and its head — is not a value crossing stages but a
*copy* in every stage that reads it (Megatron-LM's embedding group): the slice holds the parameter node
itself, with its own layout, memory and update priced by the stage's search. Autograd sums the readers'
contributions to its gradient with additions (:func:`gradient_sums`: the gradient's node and, through every
``aten.add.Tensor``, their operands); a stage that does not hold that sum takes, as its copy's gradient, its
own part — the one value of the sums it makes that another stage reads — and a stage that reads another
stage's part keeps it as a boundary input, which the runtime feeds zeros (``runtime.pipeline_stages``: each
part stays in its stage, and the copies' gradients are summed across the stages after the step). So no part
crosses stages, and neither the copies nor the parts constrain where the cuts go.

Cost and cache (:func:`plan_stage`)
-----------------------------------
For every device mapping of the asked shape, the slice is searched (``meshpilot.planner.search``, through
the one mesh search the single-stage planner uses too: ``meshsearch.search_mesh``) on the logical mesh of the
given ranks (``LogicalMesh`` of the cluster with those physical ranks at its
coordinates), and the fastest is a :class:`StageCost`: the stage's time over its microbatches (compute,
communication, resharding; ``accounting.account``), the peak bytes per device for one microbatch in flight
(``accounting.memory_use``) and each phase's peak with one microbatch's activations
(``accounting.phase_peaks``). How many microbatches a schedule keeps in flight — and so whether the
stage fits — is the stage DP's question; `capacity` only bounds the search. Results are cached per
(graph, layer range, ranks, shape, microbatches, capacity, zero mode, searcher): the DP asks for the same
stage on the same submesh many times, and slices and strategy tables are built once per (graph, range) and
(range, shape).

Identical stages (:func:`range_keys`)
-------------------------------------
In a stack of identical layers, layers 2..5 and 3..6 of a GPT slice into the same problem up to node names:
the same operators in the same order, the same edges, boundary leaves of the same shapes in the same places,
the same sharing. The cache's key for the range is therefore not ``(start, stop)`` but an id of that problem
(its layers' name-free block signatures in graph order), so a uniform GPT of K layers needs O(K) distinct
searches per submesh shape — one per range length and per embedding / head inclusion — instead of O(K²).
The cost found for one range is returned for an identical one with its own ``layers``; the numbers are the
same as searching it (``StagePlanner(share_identical=False)`` does, for the tests).

Identical meshes (``StagePlanner._mesh_key``)
---------------------------------------------
The search reads the ranks of a stage only through the cost model of its logical mesh under each device
mapping it tries (``cluster.cost.CostModel``): per set of mesh axes, the group size, the bus bandwidth (Eq. 3
or a calibration), the latency and a measured all-reduce curve; compute is the cluster's one device's. Two
rank sets with the same shape and the same values of all of these get the same plan, so the cache keys the
mesh by those values: the stage DP costs every submesh on ranks ``0..d−1`` and re-costs the chosen stages
on the ranks ``pipeline.place`` gives them, which on a cluster of identical nodes (``alpa-p3x8``,
``dgx-h100``) are the same problem (the cost found is returned with the asked ranks). One ``Resharder`` is
kept per logical mesh and device mapping, so a stage searched under several memory caps prices each mapping's
ILP once (``ilp.priced``); and a mapping whose values are those of a mapping already tried on the shape (column
and row on a square block of one node's uniform links) is the same ILP, so it is not solved again (the first
mapping's plan is kept, as the strict comparison of the two would keep it).

Floors (``StagePlanner.floor``)
-------------------------------
Lower bounds of every plan of a stage on one logical mesh, whatever its memory cap, read off the ILP's
structure (``ilp.build_structure``) without a search:

    time_s    = Σ_terms min_k cost_term[k]            (``auto.compute_lower_bound``: compute of each class
                                                      of nodes × its count × B, and each parameter's update,
                                                      at the cheapest strategy)
    update    = Σ_terms min_k min(std, zero)[update, k]      (``auto.min_memory`` takes the larger row of
    backward  = Σ_terms min_k min(std, zero)[backward, k]     one kind; these keep the rows apart)
    saved     = Σ_(saved terms) min_k std[backward, k]

``accounting.account`` prices a plan as each node's compute under its chosen strategy (× B) plus each
parameter's update plus communication and resharding (≥ 0); the chosen strategy is one of the node's own
(the ZeRO post-pass re-lays parameters among theirs), so ``time.total_s ≥ time_s``. The plan's
``static + grads + update_temp`` and ``static + saved`` are the ILP's two rows (``accounting._parts``) at the
chosen strategies, each term at least its least over every strategy. ``stack.StackTable`` uses the floors
to skip meshes that cannot change its table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from meshpilot.cluster.mesh import MeshMapping, mapped_ranks
from meshpilot.errors import UserError
from meshpilot.graph.capture import NodeKind, OpGraph, OpNode, Phase
from meshpilot.planner.accounting import (
    MEMORY_ROWS,
    ComputeCost,
    PhasePeaks,
    _parts,
    account,
    accumulated_bytes,
    liveness,
    step_edges,
    weights_read_back,
)
from meshpilot.planner.auto import compute_lower_bound
from meshpilot.planner.ilp import TIME_LIMIT_S, PlanError, Structure, build_structure
from meshpilot.planner.meshsearch import mappings_of, search_mesh
from meshpilot.planner.plan import MemoryUse, StepTime, ZeroStage
from meshpilot.planner.recompute import Recompute
from meshpilot.planner.search import get_searcher
from meshpilot.planner.zero import ParamEdges, ZeroMode
from meshpilot.sharding.reshard import Resharder
from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

BOUNDARY = "boundary"
"""Name prefix of a slice's input leaves for values made by another stage."""


@dataclass(frozen=True)
class Layer:
    """One layer of the model (module docstring): its module path and its nodes' names in graph order."""

    name: str
    nodes: tuple[str, ...]
    flops: float


def layer_keys(graph: OpGraph) -> Callable[[str | None], str | None]:
    """The function naming the layer of a module path (module docstring, *Layers*): the path cut after its
    first numbered part (``blocks.3.attn.q`` -> ``blocks.3``, ``model.layers.3.mlp`` -> ``model.layers.3``),
    or, for a path with no numbered part, cut at the first module that holds no container of numbered
    children (``lm_head`` -> ``lm_head``; ``model.transformer.wte`` -> ``model.transformer.wte`` when
    ``model.transformer.h`` holds the blocks). The root, and a module that holds such a container (the
    ops of ``LlamaModel.forward`` itself), name no layer: None."""
    holders: set[tuple[str, ...]] = {()}
    for n in graph.nodes:
        parts = tuple(n.module.split(".")) if n.module else ()
        i = next((i for i, x in enumerate(parts) if x.isdigit()), None)
        if i is not None:
            holders.update(parts[:j] for j in range(i + 1))

    def key(module: str | None) -> str | None:
        parts = module.split(".") if module else []
        for i, x in enumerate(parts):
            if x.isdigit() or tuple(parts[: i + 1]) not in holders:
                return ".".join(parts[: i + 1])
        return None

    return key


def layers(graph: OpGraph, layer_key: Callable[[str | None], str | None] | None = None) -> list[Layer]:
    """The model's layers in forward order (module docstring); `layer_key` is ``layer_keys(graph)`` when
    already made."""
    layer_key = layer_key or layer_keys(graph)
    key: dict[str, str | None] = {}
    order: list[str] = []
    for n in graph.nodes:
        if n.kind != NodeKind.OP and n.kind != NodeKind.GETITEM:
            continue
        k = layer_key(n.module)
        if k is None:
            k = next((key[s] for s, _ in n.inputs if key.get(s) is not None), None)
        key[n.name] = k
        if k is not None and n.phase == Phase.FWD and k not in order:
            order.append(k)
    if not order:
        raise UserError("the model has no layers to split into stages: no operator was made by a child module")
    for n in graph.nodes:
        if n.kind in (NodeKind.OP, NodeKind.GETITEM) and key[n.name] is None:
            key[n.name] = order[0] if n.phase == Phase.FWD else order[-1]
    for n in graph.nodes:  # leaves: the layer of their first reader
        if n.name not in key:
            key[n.name] = next((key[u] for u in graph.users[n.name] if key.get(u) is not None), order[0])
    members: dict[str, list[str]] = {k: [] for k in order}
    for n in graph.nodes:
        members[key[n.name]].append(n.name)
    return [Layer(k, tuple(members[k]), sum(graph[x].flops for x in members[k])) for k in order]


def runnable_layers(graph: OpGraph) -> list[Layer]:
    """``stage.layers(graph)`` with every node the model's own modules did not make (the root's ops: the loss,
    the backward's sums of a residual stream's gradients) placed where a pipeline can run it.

    The layers, their names and order are ``stage.layers``'; a node a module made stays in that module's
    layer. A node no module made goes, in the forward, to the latest layer among its operands' (it runs once
    they exist), or when it reads leaves only (a view of the targets) to the earliest layer among its
    readers'; in the backward, to the earliest layer among its backward operands' (a gradient flows from
    later layers to earlier ones), or when it reads none to the latest among its forward operands' (the
    loss's seed gradient), else to the latest among its readers'. ``stage.layers`` gives such nodes their
    first operand's layer, which the planner's costs tolerate but a pipeline cannot run: the backward's
    running sum of the residual gradient would make the first stage wait for the last stage's backward and
    the last stage for the first's. Leaves join the layer of their first reader, as there. Pure."""
    from meshpilot.graph.capture import LEAF_KINDS

    layer_key = layer_keys(graph)
    base = layers(graph, layer_key)
    order = {layer.name: j for j, layer in enumerate(base)}
    where: dict[str, int] = {}
    deferred: list[OpNode] = []
    for n in graph.nodes:
        if n.kind in LEAF_KINDS:
            continue
        key = layer_key(n.module)
        if key is not None and key in order:
            where[n.name] = order[key]
            continue
        made = [(where[s], graph[s].phase) for s, _ in n.inputs if s in where]
        if n.phase == Phase.BWD:
            back = [j for j, ph in made if ph == Phase.BWD]
            if back:
                where[n.name] = min(back)
            elif made:
                where[n.name] = max(j for j, _ in made)
            else:
                deferred.append(n)
        elif made:
            where[n.name] = max(j for j, _ in made)
        else:
            deferred.append(n)
    for n in reversed(deferred):
        readers = [where[u] for u in graph.users[n.name] if u in where]
        if not readers:
            where[n.name] = 0 if n.phase != Phase.BWD else len(base) - 1
        else:
            where[n.name] = max(readers) if n.phase == Phase.BWD else min(readers)
    for n in graph.nodes:
        if n.kind in LEAF_KINDS:
            where[n.name] = next((where[u] for u in graph.users[n.name] if u in where), 0)
    members: list[list[str]] = [[] for _ in base]
    for n in graph.nodes:
        members[where[n.name]].append(n.name)
    return [Layer(b.name, tuple(m), sum(graph[x].flops for x in m)) for b, m in zip(base, members)]


def tied_params(graph: OpGraph, all_layers: Sequence[Layer]) -> frozenset[str]:
    """The parameters (by name) that nodes of more than one layer read: a tied embedding and LM head (module
    docstring, *Tied parameters*)."""
    where = {name: j for j, layer in enumerate(all_layers) for name in layer.nodes}
    out = set()
    for n in graph.nodes:
        if n.kind == NodeKind.PARAM and len({where[u] for u in graph.users[n.name] if u in where}) > 1:
            out.add(n.fqn)
    return frozenset(out)


GRAD_ADD = "aten.add.Tensor"
"""The op autograd sums a parameter's gradient contributions with."""


def gradient_sums(graph: OpGraph, fqns) -> dict[str, str]:
    """Node name -> parameter name, for the nodes whose values add up into the gradient of each parameter of
    `fqns`: its gradient's node and, through every :data:`GRAD_ADD` among them, their operands (each reader's
    contribution, and partial sums)."""
    out: dict[str, str] = {}
    for fqn in fqns:
        g = graph.grads.get(fqn)
        todo = [g[0]] if g is not None else []
        while todo:
            name = todo.pop()
            if name in out:
                continue
            out[name] = fqn
            if graph[name].target == GRAD_ADD:
                todo += [src for src, _ in graph[name].inputs]
    return out


def stays_in_stage(graph: OpGraph, all_layers: Sequence[Layer]) -> Callable[[str, str], bool]:
    """``(src, dst) -> bool``: whether the edge from node `src` to node `dst` needs no transfer wherever the
    stages are cut — `src` a tied parameter (every stage that reads it holds a copy) or both ends parts of a
    tied parameter's gradient (each stage keeps its own part): module docstring, *Tied parameters*."""
    tied = tied_params(graph, all_layers)
    sums = gradient_sums(graph, tied)

    def stays(src: str, dst: str) -> bool:
        m = graph[src]
        return (m.kind == NodeKind.PARAM and m.fqn in tied) or (src in sums and dst in sums)

    return stays


def slice_graph(graph: OpGraph, start: int, stop: int, all_layers: Sequence[Layer] | None = None) -> OpGraph:
    """The nodes of layers ``[start, stop)`` as a graph of their own (module docstring)."""
    all_layers = list(all_layers) if all_layers is not None else layers(graph)
    if not 0 <= start < stop <= len(all_layers):
        raise UserError(f"layers [{start}, {stop}): the model has {len(all_layers)} layers; give 0 <= start < stop")
    inside = {x for layer in all_layers[start:stop] for x in layer.nodes}
    tied = tied_params(graph, all_layers)
    nodes: list[OpNode] = []
    boundary: dict[tuple[str, int], str] = {}
    copies: set[str] = set()

    def copy(src: str) -> str:  # a tied parameter another layer's stage holds: this stage's own copy
        if src not in copies:
            copies.add(src)
            nodes.append(graph[src])
        return src

    def bound(src: str, i: int) -> str:
        name = boundary.get((src, i))
        if name is None:
            name = boundary[(src, i)] = f"{BOUNDARY}:{src}:{i}"
            info = graph[src].outputs[i]
            phase = graph[src].phase
            nodes.append(OpNode(name, NodeKind.INPUT, "placeholder", (), (info,), fqn=name, phase=phase))
        return name

    for n in graph.nodes:
        if n.name not in inside:
            continue
        ins = tuple(
            (s, i) if s in inside else (copy(s), i) if graph[s].kind == NodeKind.PARAM and graph[s].fqn in tied
            else (bound(s, i), 0)
            for s, i in n.inputs
        )  # fmt: skip
        nodes.append(dataclasses.replace(n, inputs=ins))
    # graph order with boundary leaves before their first reader, renumbered
    nodes = [dataclasses.replace(n, index=k) for k, n in enumerate(nodes)]
    names = {n.name for n in nodes}
    held = {(n.kind, n.fqn) for n in nodes if n.kind in (NodeKind.PARAM, NodeKind.BUFFER)}  # one pass, not one a name
    params = [p for p in graph.param_names if (NodeKind.PARAM, p) in held]
    buffers = [b for b in graph.buffer_names if (NodeKind.BUFFER, b) in held]
    kept = set(params)
    grads = {p: g for p, g in graph.grads.items() if p in kept and g is not None and g[0] in names}
    sums = gradient_sums(graph, [p for p in params if p in tied and p not in grads])
    for p in sorted(set(sums.values())):  # a stage without the sum of a tied weight's gradient: its part
        out = [x for x in names if sums.get(x) == p and any(u not in inside for u in graph.users[x])]
        if len(out) > 1:
            raise UserError(
                f"layers [{start}, {stop}) add into the gradient of the tied weight {p} in {len(out)} places that "
                "other stages sum; cut the stages elsewhere"
            )
        if out:
            grads[p] = (out[0], 0)
    sub = OpGraph(
        nodes=nodes,
        gm=graph.gm,
        param_names=params,
        buffer_names=buffers,
        num_inputs=sum(n.kind == NodeKind.INPUT for n in nodes),
        loss=graph.loss if graph.loss is not None and graph.loss[0] in names else None,
        grads=grads,
        input_infos=[n.out for n in nodes if n.kind == NodeKind.INPUT],
        buffer_updates={b: v for b, v in graph.buffer_updates.items() if b in buffers and v[0] in names},
        consts={k: v for k, v in graph.consts.items() if k in names},
        precision=graph.precision,
        canonical=_slice_canonical(graph, nodes),
    )
    return sub


def received_row_leaves(sub: OpGraph, rows: int) -> list[tuple[str, OpNode]]:
    """The values a stage receives (`sub`'s ``boundary:`` leaves, :func:`slice_graph`) whose dim 0 is `rows` (the
    microbatch's rows), each with its name: the leaves a stage's plan pins batch-sharded so that each replica
    receives its own rows (``planner.plan.received_rows_pins``, ``planner.config_plan.boundary_pins``)."""
    out = []
    for n in sub.nodes:
        name = n.fqn or n.name
        if name.startswith(f"{BOUNDARY}:") and n.out is not None and tuple(n.out.shape[:1]) == (rows,):
            out.append((name, n))
    return out


def _slice_canonical(graph: OpGraph, nodes: Sequence[OpNode]) -> dict[str, str]:
    """Repeated-layer sharing inside a slice: every node of a class of identical nodes (``graph.canonical``)
    maps to the class's first member *in the slice*, so a slice of ``blocks.2..3`` shares as ``blocks.0..1``
    does (their slices are then the same problem, which the stage cost cache relies on)."""
    first: dict[str, str] = {}
    out: dict[str, str] = {}
    for n in nodes:
        c = graph.canonical.get(n.name)
        if c is None:
            continue
        rep = first.setdefault(c, n.name)
        if rep != n.name:
            out[n.name] = rep
    return out


def _where(all_layers: Sequence[Layer]) -> dict[str, tuple[int, int]]:
    """Node -> (its layer, its position among the layer's nodes)."""
    return {x: (j, q) for j, layer in enumerate(all_layers) for q, x in enumerate(layer.nodes)}


def _depth_pattern(graph: OpGraph, n: OpNode) -> tuple:
    """How the operands' depths compare (ranks with ties, and which are 0): all the ILP's merge reads."""
    ds = [graph[s].depth for s, _ in n.inputs]
    order = sorted(set(ds))
    return tuple((order.index(d), d == 0) for d in ds)


def range_keys(graph: OpGraph, all_layers: Sequence[Layer]) -> Callable[[int, int], bytes]:
    """A function giving layers ``[start, stop)`` a key such that two ranges with the same key slice into
    the same problem up to names (module docstring, *Identical stages*).

    The graph in order is a sequence of *blocks*: maximal runs of nodes of one layer. Each block gets a
    name-free signature of its nodes: kind, op, outputs, FLOPs and bytes, phase, flags, how its operands'
    depths compare, the class of identical nodes it is in (``graph.canonical``; a constant's by its value),
    whether it is the loss;
    an operand in the same layer as (its position there, output), one in another layer as its tensor and
    phase only (what a boundary leaf would be). What crosses layers is listed apart as *links* (reader's
    layer and position, operand; source's layer, position, output; a parameter's gradient and a buffer's
    update are links too). A range's key is its blocks in graph order as (layer − start, signature) and its
    links: to a layer inside as (offsets and positions), to one outside as which distinct outside value
    (numbered in order of first reading) — one boundary leaf each.
    """
    where = _where(all_layers)
    ids: dict[tuple, int] = {}
    links: list[tuple[int, int, int, int, int, int]] = []

    def operand(j: int, q: int, k: int, src: str, i: int) -> tuple:
        sj, sq = where[src]
        if sj == j:
            return (sq, i)
        links.append((j, q, k, sj, sq, i))
        return (graph[src].outputs[i], graph[src].phase.value)

    def node_sig(n: OpNode) -> tuple:
        j, q = where[n.name]
        ins = tuple(operand(j, q, k, s, i) for k, (s, i) in enumerate(n.inputs))
        if n.kind == NodeKind.PARAM and graph.grads.get(n.fqn) is not None:
            operand(j, q, -1, *graph.grads[n.fqn])
        if n.kind == NodeKind.BUFFER and n.fqn in graph.buffer_updates:
            operand(j, q, -2, *graph.buffer_updates[n.fqn])
        loss = graph.loss[1] if graph.loss is not None and graph.loss[0] == n.name else None
        return (
            n.kind.value, n.target, n.outputs, n.flops, n.bytes_read, n.bytes_written, n.is_param, n.phase.value,
            n.is_view, n.saved_for_backward, ins, _depth_pattern(graph, n), node_class(n), loss,
        )  # fmt: skip

    def node_class(n: OpNode) -> object:
        """The class of identical nodes `n` is in: its representative's name — but a constant is a class of
        its own (``detect_repeats`` ties no constants), named by its value, so two blocks' constants (a Hugging
        Face attention's ``_tensor_constant`` per layer) key alike."""
        if n.kind == NodeKind.CONST and n.name in graph.consts:
            value = graph.consts[n.name].detach().cpu().contiguous()
            raw = value.reshape(-1).view(torch.uint8).numpy().tobytes()
            return ("const", str(value.dtype), tuple(value.shape), hashlib.blake2b(raw).digest())
        return graph.canonical.get(n.name, n.name)

    block_layer: list[int] = []
    block_sig: list[int] = []
    run: list[tuple] = []
    for n in graph.nodes:
        j = where[n.name][0]
        if run and block_layer[-1] != j:
            block_sig.append(ids.setdefault(tuple(run), len(ids)))
            run = []
        if not run:
            block_layer.append(j)
        run.append(node_sig(n))
    block_sig.append(ids.setdefault(tuple(run), len(ids)))
    bl = np.asarray(block_layer, dtype=np.int64)
    bs = np.asarray(block_sig, dtype=np.int64)
    # the links: reader's layer, position, operand; source's layer, position, output
    X = np.asarray(links, dtype=np.int64).reshape(-1, 6)

    def key(start: int, stop: int) -> bytes:
        m = (bl >= start) & (bl < stop)
        parts = [np.stack([bl[m] - start, bs[m]]).tobytes()]
        sub = X[(X[:, 0] >= start) & (X[:, 0] < stop)]
        inside = (sub[:, 3] >= start) & (sub[:, 3] < stop)
        rows = sub.copy()
        rows[:, 0] -= start
        rows[inside, 3] -= start
        out = np.flatnonzero(~inside)
        if len(out):  # an outside value: which one, by first reading (one boundary leaf per value)
            _, first, inverse = np.unique(sub[out][:, 3:], axis=0, return_index=True, return_inverse=True)
            rank = np.argsort(np.argsort(first))
            rows[out, 3] = -1 - rank[inverse.reshape(-1)]
            rows[out, 4:] = 0
        parts.append(rows.tobytes())
        # a digest, not a number given in order of asking: the same in every process (``planner.parallel``
        # merges the stage costs that forked workers keyed)
        return hashlib.blake2b(b"|".join(parts), digest_size=16).digest()

    return key


@dataclass(frozen=True)
class StageCost:
    """The best intra-operator plan of one stage on one logical mesh (module docstring)."""

    layers: tuple[int, int]
    ranks: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    mapping: MeshMapping
    time: StepTime
    """The stage's step over the ``microbatches`` it was planned for: each microbatch's forward and backward,
    the gradients' synchronisation once (``accounting.account``); divide by the microbatches for one."""
    memory: MemoryUse
    """Peak bytes per device with one microbatch in flight."""
    peaks: PhasePeaks
    """The forward + backward and optimizer peaks and one microbatch's activations (a schedule keeping ``f``
    microbatches in flight holds ``max(update, forward_backward + (f − 1) · activations)``)."""
    forward_s: float
    """Of ``time``: the forwards' compute and the collectives they issue."""
    search_s: float
    recompute: Recompute = Recompute.NONE
    """The stage's blocks recomputed in the backward, selective regions or whole (``planner.recompute``): costed
    on that recomputing graph (``stack.StackTable.recomputed``); ``Plan.with_intra`` plans its slice so and the
    runtime runs it so."""
    zero: str | None = None
    """The ZeRO mode forced on the stage's blocks (``zero.ZeroMode`` value, e.g. "3": the variant table's ZeRO
    candidates); ``Plan.with_intra`` plans its slice with it. None: the search's own."""
    sync_s: float = 0.0
    """Of ``time``'s communication and resharding: the gradients' synchronisation, once a step (every ``grad:``
    collective, ``accounting.EdgeKind.GRAD``: over DP, and CP or TP where a gradient is partial there). What a
    pipeline plan that overlaps it (``Plan.sync_overlap``) issues after the stage's last backward; 0 in costs
    made before it was kept."""
    zero_fallback: str | None = None
    """Where :attr:`zero` is None but the table priced the stage's memory with a ZeRO mode (the estimated table,
    ``planner.stack`` module docstring, 5): that mode, which ``Plan.with_intra`` plans the slice with when the
    search's own choice does not hold the stage's microbatches in flight."""


@dataclass(frozen=True)
class StageMemory:
    """The parts of a stage plan's memory per device that :class:`~meshpilot.planner.accounting.PhasePeaks`
    is made of, kept so that plans of consecutive pieces can be composed (``planner.stack``):
    ``forward_backward = static + live_held`` (``static + live_peak`` for one microbatch), ``update = static +
    grads + update_temp``, ``activations = saved``; a stage composed of pieces adds their :attr:`live_peak` and
    :attr:`accumulated` (``planner.stack``)."""

    static: float
    """Weights, optimizer state and input leaves (``W + O + I``)."""
    grads: float
    """Every parameter gradient (held at the optimizer step)."""
    update_temp: float
    """The optimizer update's temporaries."""
    saved: float
    """One microbatch's saved-for-backward values."""
    live_peak: float
    """``max_i live(i)``: the forward + backward's peak of values, persistent state not included."""
    accumulated: float = 0.0
    """The gradients summed over the microbatches, held from the second microbatch on in the layout the
    backward produces them (``accounting.accumulated_bytes``: a replicated or ZeRO parameter's, whole); 0 for
    one microbatch."""
    live_held: float = 0.0
    """The forward + backward's peak of values over the microbatches, :attr:`accumulated` held beside every
    node but the last (``accounting.liveness``, as ``accounting.memory_use`` counts it); 0: one microbatch."""
    read_back: float = 0.0
    """Of the weights, those the backward reads through a view the forward saved (``accounting.weights_read_back``):
    what a ZeRO-3 replica of the piece keeps gathered from its forward to its backward (``planner.stack``)."""
    saved_held: float = 0.0
    """What the piece holds from its forward to its backward beyond :attr:`saved` (a ZeRO-3 replica's gathered
    weights read back, ``stack._replicated``); 0 for a searched piece: the copies its own plan keeps depend on
    the plan (module docstring of ``planner.stack``, 2)."""
    grads_held: float = 0.0
    """One microbatch's gradients as the backward produces them (``accounting.Liveness.produced``: a replicated
    or ZeRO parameter's partial sum whole), live from the piece's backward to the end of the whole backward
    (``accounting.liveness``: a gradient's last use is the end); more than :attr:`grads` where the stored layout
    shards what the backward produces whole (ZeRO). 0: not known (:attr:`carry` reads :attr:`grads`)."""

    @property
    def carry(self) -> float:
        """What the piece holds while another piece of its stage peaks (``planner.stack`` module docstring, 2):
        its saved values before its backward, its gradients as produced after it, to the end."""
        return max(self.saved + self.saved_held, self.grads, self.grads_held)

    @property
    def peaks(self) -> PhasePeaks:
        """The forward + backward peak over the microbatches (``static + live_held``, as ``auto.plan`` — and so
        ``Plan.with_intra`` — holds it to the device; ``static + live_peak`` for one), the optimizer step's, one
        microbatch's saved values, and what the stage holds while another computes (its state, gradients and
        their sum over the microbatches: ``PhasePeaks.resident``)."""
        fb = self.static + (self.live_held if self.accumulated else self.live_peak)
        upd = self.static + self.grads + self.update_temp
        return PhasePeaks(fb, upd, self.saved, self.static + self.grads + self.accumulated)


@dataclass(frozen=True)
class StageFloor:
    """Lower bounds, over every plan of a stage on one logical mesh under any memory cap, of its time and its
    memory rows per device (``StagePlanner.floor``; module docstring, *Floors*)."""

    time_s: float
    """Of ``StageCost.time.total_s``: every node's compute and every parameter's update at their cheapest."""
    update: float
    """Of ``static + grads + update_temp`` (``StageMemory``): the optimizer step's row."""
    backward: float
    """Of ``static + saved``: the row at the start of the backward."""
    saved: float
    """Of ``saved``: one microbatch's values the backward reads."""


class StagePlanner:
    """:func:`plan_stage` with its caches, for one captured graph and cluster."""

    def __init__(self, graph: OpGraph, cluster, *, share_identical: bool = True):
        """`share_identical`: cost a range of layers once for every range that slices into the same problem
        (:func:`range_keys`); False costs every range on its own (the same numbers, more searches)."""
        from meshpilot.cluster import load_cluster

        self.graph = graph
        self.cluster = load_cluster(cluster)
        self.layers = runnable_layers(graph)
        self.share_identical = share_identical
        self._range_key = range_keys(graph, self.layers) if share_identical else None
        self._where: dict[str, tuple[int, int]] | None = None
        self._slices: dict[tuple[int, int], tuple[OpGraph, list, ParamEdges]] = {}
        self._structs: dict[tuple, tuple[Structure, StrategyBuilder]] = {}
        self._costs: dict[tuple, StageCost | PlanError] = {}
        self._memory: dict[tuple, StageMemory] = {}
        self._collectives: dict[tuple, tuple] = {}
        self._mesh_keys: dict[tuple, tuple] = {}
        self._mapping_keys: dict[tuple, tuple] = {}
        self._resharders: dict[tuple, Resharder] = {}
        self.hits = 0
        self.misses = 0

    def mark(self) -> tuple[int, int, int]:
        """Where the caches stand now, for :meth:`exported` (``planner.parallel``)."""
        return len(self._costs), self.hits, self.misses

    def exported(self, mark: tuple[int, int, int]) -> tuple[list, list, int, int]:
        """The stage costs searched since `mark` (entries are only ever added, in order) and the hits and
        misses since, for :meth:`merge` in another process."""
        n, hits, misses = mark
        costs = list(self._costs.items())[n:]
        memory = [(k, self._memory[k]) for k, _ in costs if k in self._memory]
        return costs, memory, self.hits - hits, self.misses - misses

    def merge(self, searched: tuple[list, list, int, int]) -> None:
        """Add what a worker's :meth:`exported` returned: its searches count as this planner's."""
        costs, memory, hits, misses = searched
        for k, v in costs:
            self._costs.setdefault(k, v)
        for k, v in memory:
            self._memory.setdefault(k, v)
        self.hits += hits
        self.misses += misses

    def _slice(self, start: int, stop: int):
        hit = self._slices.get((start, stop))
        if hit is None:
            sub = slice_graph(self.graph, start, stop, self.layers)
            edges = step_edges(sub)
            hit = self._slices[(start, stop)] = (sub, edges, ParamEdges.of(sub, edges))
        return hit

    def plan(
        self,
        start: int,
        stop: int,
        ranks: Sequence[int],
        mesh_shape: Sequence[int],
        *,
        microbatches: int = 1,
        capacity: float | None = None,
        zero: ZeroMode | str = ZeroMode.AUTO,
        searcher: str = "ilp",
        time_limit: float = TIME_LIMIT_S,
        force: Mapping[str, str] | None = None,
        mip_gap: float | None = None,
        mappings: Sequence[MeshMapping] | None = None,
        relaxed: bool = False,
    ) -> StageCost:
        """The best plan of layers ``[start, stop)`` on `ranks` arranged as `mesh_shape` (cached). `force` pins
        leaves' layouts as ``meshpilot.plan(force=)`` does (``planner.forced``: a Megatron stage); patterns
        naming nothing in the stage are ignored. `mip_gap`: the relative MIP gap HiGHS stops at (None: the
        searcher's, ``search.SearchTask.mip_gap``; the estimated stage table prices its capped blocks at a looser
        one, ``stack.PRICING_GAP``). `mappings`: the device mappings searched (None: every one of the shape,
        ``meshsearch.mappings_of``; the estimated stage table's catalogue searches a recomputing block across
        servers on the one its captured block chose, ``stack`` module docstring, 5). `relaxed`: each ILP solved from
        its LP relaxation (``ilp.solve(relaxed=)``, an estimate within the gap it reports; the estimated stage table
        prices its pre and post pieces so, ``stack.RELAXED_PRICING``)."""
        ranks = tuple(int(r) for r in ranks)
        shape = tuple(int(d) for d in mesh_shape)
        if math.prod(shape) != len(ranks) or len(set(ranks)) != len(ranks):
            raise UserError(f"mesh {shape} needs {math.prod(shape)} distinct ranks; got {list(ranks)}")
        if not all(0 <= r < self.cluster.num_devices for r in ranks):
            last = self.cluster.num_devices - 1
            raise UserError(f"ranks {list(ranks)}: cluster {self.cluster.name!r} has ranks 0..{last}; pick ranks of it")
        cap = float(capacity if capacity is not None else self.cluster.device.memory_bytes)
        if not 0 <= start < stop <= len(self.layers):
            K = len(self.layers)
            raise UserError(f"layers [{start}, {stop}): the model has {K} layers; give 0 <= start < stop")
        rkey = self._range_key(start, stop) if self._range_key is not None else (start, stop)
        pinned = self._pins(start, stop, force)
        mkey = self._mesh_key(ranks, shape) if self.share_identical else ranks
        key = (rkey, mkey, shape, microbatches, cap, str(zero), searcher, pinned, mip_gap)
        key += ("relaxed",) if relaxed else ()  # an estimate: its own entry (an exact plan keeps its key)
        maps = mappings_of(shape, mappings) if mappings else None
        key += (tuple(maps),) if mappings else ()  # restricted: its own entry (a plan of every mapping keeps its key)
        self._last_key = key
        found = self._costs.get(key)
        if found is not None:
            self.hits += 1
            if isinstance(found, PlanError):
                raise found
            if found.layers != (start, stop):  # an identical range's cost: the same numbers, this range's names
                found = self._renamed(found, start, stop)
            if found.ranks != ranks:  # ranks whose mesh prices every collective alike: the same plan there
                found = dataclasses.replace(found, ranks=ranks)
            return found
        self.misses += 1
        if ZeroMode(zero).forced == ZeroStage.GATHER_ONCE:
            raise PlanError("zero='2': a pipeline stage gathers ZeRO weights where they are read; use zero='3'")
        try:
            args = (start, stop, ranks, shape, microbatches, cap, ZeroMode(zero), searcher, time_limit, pinned)
            cost, mem = self._search(*args, mip_gap, maps, relaxed)
        except PlanError as e:
            self._costs[key] = e
            raise
        self._costs[key] = cost
        self._memory[key] = mem
        self._collectives[key] = self._searched_collectives
        return cost

    def last_collectives(self) -> tuple:
        """The collectives (``accounting``'s ``PlannedCollective``: kind, mesh axis, bytes, phase) one microbatch of
        the last plan :meth:`plan` returned issues, as it priced them; () where that plan came from elsewhere."""
        return self._collectives.get(self._last_key, ())

    def _mesh_key(self, ranks: tuple[int, ...], shape: tuple[int, ...]) -> tuple:
        """What the search reads of `ranks` as `shape` (module docstring, *Identical meshes*): per device
        mapping the search tries, each axis set's group size, bus bandwidth, latency and measured curve."""
        key = (ranks, shape)
        hit = self._mesh_keys.get(key)
        if hit is None:
            hit = self._mesh_keys[key] = ("mesh", tuple(self._priced_as(ranks, shape, m) for m in mappings_of(shape)))
        return hit

    def _priced_as(self, ranks: tuple[int, ...], shape: tuple[int, ...], mapping: MeshMapping) -> tuple:
        """What the search reads of `ranks` as `shape` under one device mapping: each axis set's group size,
        bus bandwidth, latency and measured curve (two mappings with the same are the same ILP)."""
        key = (ranks, shape, mapping)
        hit = self._mapping_keys.get(key)
        if hit is None:
            from meshpilot.cluster import LogicalMesh

            axes = [(a,) for a in range(len(shape))] + list(itertools.permutations(range(len(shape)), 2))
            mesh = LogicalMesh(self.cluster, shape, np.asarray(ranks)[mapped_ranks(shape, mapping)])
            parts = []
            for ax in axes:
                n = mesh.axis_size(ax)
                if n > 1:
                    parts.append((ax, n, mesh.bus_bandwidth(ax), mesh.latency(ax), mesh.allreduce_curve(ax)))
            hit = self._mapping_keys[key] = tuple(parts)
        return hit

    def plan_with_memory(self, start: int, stop: int, ranks: Sequence[int], mesh_shape: Sequence[int], **kw):
        """:meth:`plan` and the :class:`StageMemory` its peaks are made of (for composing stages from pieces:
        ``planner.stack``)."""
        cost = self.plan(start, stop, ranks, mesh_shape, **kw)
        return cost, self._memory[self._last_key]

    def _renamed(self, cost: StageCost, start: int, stop: int) -> StageCost:
        """`cost` of an identical range, told in this range's layers and node names (``MemoryUse.peak_at``: the
        node at the same position of the corresponding layer)."""
        if self._where is None:
            self._where = _where(self.layers)
        memory = cost.memory
        at = self._where.get(memory.peak_at or "")
        if at is not None:
            j = at[0] - cost.layers[0] + start
            memory = dataclasses.replace(memory, peak_at=self.layers[j].nodes[at[1]])
        return dataclasses.replace(cost, layers=(start, stop), memory=memory)

    def _pins(self, start: int, stop: int, force: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
        """The `force` patterns that name a leaf of the stage or one of its operators (exactly, as
        ``planner.forced`` pins Megatron's products and sequence-parallel adds), sorted (hashable: part of the
        cache key). Pins name parameters, inputs and nodes, which identical ranges do not share, so pinned
        stages are keyed by their own layers (the range key covers pins only through the names)."""
        if not force:
            return ()
        import fnmatch

        from meshpilot.planner.force import literal

        sub = self._slice(start, stop)[0]
        names = [n.fqn or n.name for n in sub.nodes if n.kind in (NodeKind.PARAM, NodeKind.BUFFER, NodeKind.INPUT)]
        ops = {n.name for n in sub.nodes if n.kind == NodeKind.OP}  # an operator is pinned by its exact name
        return tuple(sorted((k, v) for k, v in force.items() if fnmatch.filter(names, k) or literal(k) in ops))

    def _resharder(self, dmesh, shape: tuple[int, ...], physical: np.ndarray) -> Resharder:
        """One resharder per logical mesh (`shape` over the row-major ranks `physical`): its prices are kept
        (``ilp.priced``) across the stage searches on it."""
        from meshpilot.cluster import CostModel, LogicalMesh

        rkey = (shape, physical.tobytes())
        hit = self._resharders.get(rkey)
        if hit is None:
            hit = self._resharders[rkey] = Resharder(dmesh, CostModel(LogicalMesh(self.cluster, shape, physical)))
        return hit

    def _structure(self, start, stop, ranks, shape, microbatches, pinned=()) -> Structure:
        """The ILP's structure of layers ``[start, stop)`` on `shape` (``ilp.build_structure``), built once per
        (range, shape, microbatches, pins): it reads the ranks only for compute, the cluster's one device's."""
        from meshpilot.cluster import CostModel, LogicalMesh

        skey = (start, stop, shape, microbatches, pinned)
        hit = self._structs.get(skey)
        if hit is None:
            sub = self._slice(start, stop)[0]
            dmesh = fake_device_mesh(shape)
            builder = StrategyBuilder(sub, dmesh)
            cm0 = CostModel(LogicalMesh(self.cluster, shape, np.asarray(ranks).reshape(shape)))
            struct = build_structure(
                sub,
                builder,
                Resharder(dmesh, cm0),
                cm0,
                microbatches=microbatches,
                force=dict(pinned) or None,  # over m > 1 microbatches the backward row holds the summed
                # gradients, as ``auto.plan``'s (and so ``Plan.with_intra``'s) does: a capped search trades them too
            )
            hit = self._structs[skey] = (struct, builder)
        return hit[0]

    def floor(
        self,
        start: int,
        stop: int,
        ranks: Sequence[int],
        mesh_shape: Sequence[int],
        *,
        microbatches: int = 1,
        force: Mapping[str, str] | None = None,
    ) -> StageFloor:
        """Lower bounds of every plan of layers ``[start, stop)`` on `mesh_shape` — its time and memory rows,
        whatever its memory cap (module docstring, *Floors*): no search, the ILP's structure only (built once,
        as the search builds it)."""
        ranks = tuple(int(r) for r in ranks)
        shape = tuple(int(d) for d in mesh_shape)
        struct = self._structure(start, stop, ranks, shape, microbatches, self._pins(start, stop, force))
        seconds = compute_lower_bound(struct)
        update = backward = saved = 0.0
        up, back = MEMORY_ROWS.index("update"), MEMORY_ROWS.index("backward")
        for _, std, zero in struct.mem_terms:  # [rows, strategies]: each term at its least over every strategy
            least = np.minimum(std, zero).min(axis=1)
            update += float(least[up])
            backward += float(least[back])
            if not std[up].any():  # a value the backward reads (on the backward row only)
                saved += float(least[back])
        return StageFloor(seconds, update, backward, saved)

    def _search(
        self,
        start,
        stop,
        ranks,
        shape,
        microbatches,
        cap,
        zero,
        searcher,
        time_limit,
        pinned=(),
        mip_gap=None,
        maps=None,
        relaxed=False,
    ) -> tuple[StageCost, StageMemory]:

        t0 = time.perf_counter()
        sub, edges, pe = self._slice(start, stop)
        dmesh = fake_device_mesh(shape)
        struct = self._structure(start, stop, ranks, shape, microbatches, pinned)
        found = search_mesh(
            sub, struct, pe, get_searcher(searcher), ranks, maps or mappings_of(shape),
            lambda _, physical: self._resharder(dmesh, shape, physical),
            capacity=cap, zero=zero, microbatches=microbatches, time_limit=time_limit, gather_once=False,
            same=lambda m: self._priced_as(ranks, shape, m), mip_gap=mip_gap, relaxed=relaxed,
        )  # fmt: skip
        top = found.best
        if top is None:
            raise found.errors[0]
        cand, resharder = top.candidate, top.resharder
        acct = account(sub, cand.chosen, resharder, ComputeCost(resharder.cost_model, shape, sub), microbatches, edges)
        self._searched_collectives = tuple(acct.collectives)
        fwd = sum(acct.node_seconds[n.name] for n in sub.nodes if n.phase == Phase.FWD) * microbatches
        fwd += sum(c.seconds for c in acct.collectives if c.phase == Phase.FWD.value) * microbatches
        p = _parts(sub, cand.chosen, shape)
        acc = held = 0.0
        if microbatches > 1:  # the summed gradients beside every node but the last (accounting: A)
            acc = accumulated_bytes(sub, cand.chosen, shape)
            held = liveness(sub, cand.chosen, shape, microbatches).peak
        static = p.params + p.optimizer + p.inputs
        back = weights_read_back(sub, cand.chosen, shape)
        mem = StageMemory(static, p.grads, p.update_temp, p.saved, p.live.peak, acc, held, back,
                          grads_held=p.live.produced)  # fmt: skip
        sync = sum(c.seconds for c in acct.collectives if c.dst.startswith("grad:"))
        cost = StageCost(
            (start, stop), ranks, shape, cand.mapping, acct.time, cand.usage, mem.peaks, fwd, time.perf_counter() - t0,
            sync_s=sync,
        )  # fmt: skip
        return cost, mem


def plan_stage(
    graph: OpGraph,
    cluster,
    start: int,
    stop: int,
    ranks: Sequence[int],
    mesh_shape: Sequence[int],
    **kw,
) -> StageCost:
    """The best plan of layers ``[start, stop)`` of `graph` on `ranks` of `cluster` as `mesh_shape` (module
    docstring). One-off calls; a stage DP keeps a :class:`StagePlanner` so its caches live across calls."""
    return StagePlanner(graph, cluster).plan(start, stop, ranks, mesh_shape, **kw)
