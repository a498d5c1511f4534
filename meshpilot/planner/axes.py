"""Roles of mesh axes, and the strategy space of a mesh whose outer axis is data-parallel only.

A searched mesh of three axes (``cluster.mesh.mesh_shapes_3d``: the slow top level of the cluster times two axes
inside one of its units) would multiply every operator's strategies by the third axis' choices: the ILP of
gpt-tiny on (2, 2, 2) had ~10x the variables of (2, 4) (docs/benchmarks.md, "A mesh of three axes, given").
Real runs use such an outer axis one way only, as data parallelism (HSDP, Megatron's DP x TP across nodes):
the batch is split over it, parameters are replicated over it (the ZeRO post-pass may still shard their
update there, ``planner.zero``), and its one collective is the gradients' all-reduce. :class:`OuterDataParallel`
cuts each operator's strategies to exactly that before the ILP is built.

The rule, on the outer axis ``o`` (axis 0) of a strategy ``s`` with operands ``x_k`` and outputs ``y_j``
(``s[o]`` is the placement each of them has on axis ``o``):

* parameters: ``R`` on ``o``;  inputs: ``S(0)`` (the batch split) or ``R`` on ``o``;
* every other node: its *data-parallel* placements ``dp(v)`` are propagated from the leaves in graph order:
  ``dp(x_k)`` is the operand's producer's, and the node keeps

      { s : s.ins[o] = dp(x) }   (the strategies that run it data-parallel: their outputs define dp(y),
                                  e.g. a linear's S(0) x R -> S(0), the weight gradient's S(1) x S(0) -> P)
    ∪ { s : s.ins[o] and s.outs[o] all R }   (replicated over o: each unit does all of it)

  A node none of whose strategies reads ``dp(x)`` keeps the replicated ones, and its ``dp`` becomes ``R``;
  a node left with nothing keeps every strategy (never an empty group).

Every kept strategy is one of the full space's, so a plan on the cut space runs as any plan does; the ILP only
loses plans that shard a tensor's features over the slow axis, which are the ones the cut is for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from enum import StrEnum

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from meshpilot.graph.capture import NodeKind, OpNode
from meshpilot.sharding.placements import Placements
from meshpilot.sharding.strategies import Strategy, StrategyBuilder

OUTER = 0
"""The data-parallel axis of a searched 3-axis mesh: axis 0, the one over the cluster's slow top level."""


class AxisUse(StrEnum):
    """What a plan does on one mesh axis, read off its parameters' and inputs' layouts (:func:`axis_uses`)."""

    DATA = "data-parallel"
    """Inputs split on their batch dim, every parameter whole."""
    TENSOR = "tensor-parallel"
    """Some parameter split, inputs whole."""
    BOTH = "data+tensor"
    """Inputs batch-split and some parameter split (each operator as the plan chose)."""
    WHOLE = "replicated"
    """Inputs and parameters whole: each group of the axis runs the same step (its operators may still split
    what they compute by slicing, and the loss is reduced over it)."""
    SINGLE = "one device"


def axis_uses(plan) -> tuple[AxisUse, ...]:
    """Per mesh axis of `plan` (a ``StagePlan``), what it is used for: parameters split on it (stored layouts),
    inputs split on their dim 0. The CLI prints it beside a 3-axis mesh, whose outer axis the search keeps
    data-parallel only (module docstring)."""
    out = []
    for a, size in enumerate(plan.mesh_shape):
        if size == 1:
            out.append(AxisUse.SINGLE)
            continue
        split = any(layout[a].startswith("S(") for _, layout in plan.params)
        batch = any(layout[a] == "S(0)" for layout in plan.inputs if layout)
        out.append(
            AxisUse.BOTH if split and batch else AxisUse.TENSOR if split else AxisUse.DATA if batch else AxisUse.WHOLE
        )
    return tuple(out)


def _on(pls: Sequence[Placements | None], axis: int) -> tuple[Placement | None, ...]:
    return tuple(None if p is None else p[axis] for p in pls)


def _replicated(pls: tuple[Placement | None, ...]) -> bool:
    return all(p is None or isinstance(p, Replicate) for p in pls)


class OuterDataParallel(StrategyBuilder):
    """A :class:`StrategyBuilder` whose strategies are data-parallel on axis 0 (module docstring).

    ``build_structure`` asks :meth:`for_node` in graph order, so every operand's data-parallel placement is
    known when its reader is asked. A node of a repeated layer the structure takes from its canonical twin
    without asking reads the twin's."""

    def __init__(self, graph, dmesh) -> None:
        super().__init__(graph, dmesh)
        self._want: tuple[Placement | None, ...] = ()
        # its own cache: what DTensor enumerates here depends on the operands' data-parallel placements too
        self._cache = _WantKeyed(self, _OUTER_CACHE.setdefault(self.mesh_shape, {}))
        self._dp: dict[str, tuple[Placement | None, ...]] = {}
        self.offered = 0
        """Strategies the full space had for the nodes asked."""
        self.kept = 0
        """Strategies the cut kept."""

    def for_node(self, node: OpNode, operand_candidates: list[list[Placements]]) -> list[Strategy]:
        self._want = tuple(self.dp_of(src, i) for src, i in node.inputs) if node.inputs else ()
        with _outer_rules(self._want, len(node.outputs)):
            full = super().for_node(node, operand_candidates)
        kept, dp = self._cut(node, full, self._want)
        self._dp[node.name] = dp
        self.offered += len(full)
        self.kept += len(kept)
        return kept

    def dp_of(self, name: str, index: int) -> Placement | None:
        """The data-parallel placement on axis 0 of output `index` of node `name` (R where unknown)."""
        dp = self._dp.get(name) or self._dp.get(self.graph.canonical.get(name, name))
        return dp[index] if dp is not None and index < len(dp) else Replicate()

    def _cut(
        self, node: OpNode, full: list[Strategy], want: tuple[Placement | None, ...]
    ) -> tuple[list[Strategy], tuple[Placement | None, ...]]:
        """The strategies kept for `node` and its outputs' data-parallel placements on axis 0; `want`: its
        operands' data-parallel placements."""
        if not full:
            return full, ()
        if node.kind == NodeKind.PARAM:
            kept = [s for s in full if _replicated(_on(s.outs, OUTER))]
            return kept or full, (Replicate(),)
        if node.kind == NodeKind.INPUT:
            batch = [s for s in full if _on(s.outs, OUTER) == (Shard(0),)]
            kept = batch + [s for s in full if _replicated(_on(s.outs, OUTER))]
            return kept or full, (Shard(0),) if batch else (Replicate(),)
        if not node.inputs:  # buffers, constants, factories: replicated already
            return full, _on(full[0].outs, OUTER)
        data = [s for s in full if _on(s.ins, OUTER) == want]
        whole = [s for s in full if _replicated(_on(s.ins, OUTER)) and _replicated(_on(s.outs, OUTER))]
        seen = {id(s) for s in data}
        kept = data + [s for s in whole if id(s) not in seen]
        if not kept:
            return full, _on(full[0].outs, OUTER)
        return kept, _on((data or whole)[0].outs, OUTER)


_OUTER_CACHE: dict[tuple[int, ...], dict] = {}
"""Per mesh shape: (node key, operand layouts, operands' data-parallel placements) -> strategies and fallback."""


class _WantKeyed:
    """The strategy cache of :class:`OuterDataParallel`: ``StrategyBuilder``'s key plus the data-parallel
    placements of the node's operands (``_want``), which decide what :func:`_outer_rules` lets DTensor
    enumerate."""

    def __init__(self, owner: OuterDataParallel, store: dict) -> None:
        self.owner, self.store = owner, store

    def get(self, key: tuple, default=None):
        return self.store.get((key, self.owner._want), default)

    def __setitem__(self, key: tuple, value) -> None:
        self.store[(key, self.owner._want)] = value


@contextlib.contextmanager
def _outer_rules(want: tuple[Placement | None, ...], n_out: int) -> Iterator[None]:
    """While enumerating one node: DTensor's expansion of one-mesh-dim rules to every mesh axis
    (``expand_to_full_mesh_op_strategy``: the product of the rule list over the axes, 80 % of a 3-axis
    structure's build) takes on axis 0 only the rules whose operands are placed as `want` or all replicated.

    Exact for what :meth:`OuterDataParallel._cut` keeps: every strategy whose operands' placements on axis 0
    are `want` or all ``R`` is still enumerated, in DTensor's order, beside the same strategies on the other
    axes, so DTensor's selection (one strategy per operand layout, ``strategies._selected``) picks the same
    one; the others are the ones the cut drops. A rule list whose rules are not ``outputs + operands`` long
    (tensor arguments the node does not list) is expanded whole."""
    from torch.distributed.tensor._ops import utils

    real = utils.itertools

    def keep(rule) -> bool:
        ins = tuple(rule[n_out:])
        return all(p is None or w is None or p == w for p, w in zip(ins, want)) or all(
            p is None or isinstance(p, Replicate) for p in ins
        )

    class _Product:
        def __getattr__(self, name: str):
            return getattr(real, name)

        @staticmethod
        def product(*lists, **kw):
            first = list(lists[0]) if lists else []
            if kw or not first or any(len(r) != n_out + len(want) for r in first):
                return real.product(*lists, **kw)
            return real.product([r for r in first if keep(r)] or first, *lists[1:])

    utils.itertools = _Product()
    try:
        yield
    finally:
        utils.itertools = real
