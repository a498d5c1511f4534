"""Pipeline stages that are the same computation, planned once (``Plan.with_intra``).

A pipeline of a repeated stack cuts it into many stages of the same blocks on the same logical mesh: GPT-39B on
``alpa-p3x8`` is twelve stages, nine of them three middle blocks on 4x1 (docs/benchmarks.md, issue 29). Each
stage's own search (``planner.auto.plan`` of its slice) is the same problem up to names — the stage table already
keys such ranges alike (``stage.range_keys``, which the exact table shares its searches by) — yet each was searched
again on its own nodes: the solver's memo answers only identical solves, and the names differ.

Here the stages whose ranges have the same ``range_keys`` key and whose searches are asked the same (mesh shape,
mapping, recomputation, ZeRO modes, no pins) form a group; one member's slice is searched and its plan is told in
each other member's names (:class:`StageNames`: node, parameter and module names by their position in the
stage's layers, as ``StagePlanner`` renames an identical range's cost). What differs between members is the
microbatches each keeps in flight (1F1B: Eq. 5's f(s)), which ``plan._in_flight_fit`` checks member by member on
the searched slice; its searches are shared where they are asked the same capacity (the first, at the device's),
so each member's plan is exactly the one its own search would give (the tests and the GPT-39B command compare
the two).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Sequence
from enum import Enum
from typing import Any

from meshpilot.graph.capture import OpGraph
from meshpilot.planner.recompute import SUFFIX
from meshpilot.planner.stage import BOUNDARY, Layer, range_keys

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]|[A-Za-z_]")
"""A name inside a longer text (a warning, a collective's ``grad:<fqn>``): a node, a parameter, a module path."""

_KEPT = frozenset({"Schedule", "SolverReport", "StepTime"})
"""Parts of a stage plan that name nothing of the graph (the schedule's actions, the solver's report, times)."""

_LAYOUTS = frozenset({"ins", "outs", "target", "phase", "kind", "source"})
"""Fields of a node's choice that are layouts or an operator's, phase's, kind's or strategy's name: kept."""


def identical_stages(
    graph: OpGraph, run_layers: Sequence[Layer], stages: Sequence[Any], force: Sequence[Any]
) -> list[tuple[int, ...]]:
    """The stages (``Plan.stages``) as groups whose searches are the same problem up to names, each in stage
    order, the groups in order of their first stage: same range key (``stage.range_keys``), mesh shape and the
    search options the stage's cost fixes; a pinned stage (``force[j]``) or one with no cost is a group of its own
    (pins name its own leaves)."""
    key_of = range_keys(graph, run_layers)
    groups: dict[Any, list[int]] = {}
    for j, st in enumerate(stages):
        c = st.cost
        if force[j] is not None or c is None:
            key: Any = ("own", j)
        else:
            key = (key_of(*st.layers), tuple(st.mesh_shape), c.mapping, c.recompute, c.zero, c.zero_fallback)
        groups.setdefault(key, []).append(j)
    return sorted((tuple(g) for g in groups.values()), key=lambda g: g[0])


@dataclasses.dataclass
class StageNames:
    """The names of one stage's slice (`rep`: layers of ``run_layers``) mapped onto another identical one's
    (`other`), by position: each layer's nodes in order, the values the slice receives by the operand that reads
    them (``stage.slice_graph``'s ``boundary:<src>:<i>`` leaves and tied parameters' copies)."""

    names: dict[str, str]
    """Node names, parameter and buffer names, boundary leaves."""
    layers: dict[str, str]
    """Layer (module path) names: what a recompute region or a parameter's prefix names."""

    @classmethod
    def of(
        cls, graph: OpGraph, run_layers: Sequence[Layer], sub: OpGraph, rep: tuple[int, int], other: tuple[int, int]
    ) -> StageNames | None:
        """The map from layers `rep` (sliced as `sub`) to layers `other` of `graph`; None where the two do not
        line up node for node (then the stage is searched on its own)."""
        if rep[1] - rep[0] != other[1] - other[0]:
            return None
        names: dict[str, str] = {}
        layers: dict[str, str] = {}
        for a, b in zip(run_layers[rep[0] : rep[1]], run_layers[other[0] : other[1]]):
            if len(a.nodes) != len(b.nodes):
                return None
            layers[a.name] = b.name
            for x, y in zip(a.nodes, b.nodes):
                nx, ny = graph[x], graph[y]
                if nx.kind != ny.kind or nx.target != ny.target or len(nx.inputs) != len(ny.inputs):
                    return None
                names[x] = y
                if nx.fqn is not None and ny.fqn is not None:
                    names[nx.fqn] = ny.fqn
        inside = {x for a in run_layers[rep[0] : rep[1]] for x in a.nodes}
        for n in sub.nodes:  # what the slice reads from outside: through the operand that reads it
            if n.name not in inside:
                continue
            for (s, _), (s0, _), (t0, j0) in zip(n.inputs, graph[n.name].inputs, graph[names[n.name]].inputs):
                if s in inside:
                    continue
                if s.startswith(f"{BOUNDARY}:"):
                    pairs = [(s, f"{BOUNDARY}:{t0}:{j0}"), (s0, t0)]
                else:  # a tied parameter's copy: the other stage's copy, its parameter name too
                    pairs = [(s, t0)] + ([(graph[s].fqn, graph[t0].fqn)] if graph[s].fqn and graph[t0].fqn else [])
                for u, v in pairs:
                    if names.setdefault(u, v) != v:
                        return None
        return cls(names, layers)

    def text(self, s: str) -> str:
        """`s` in the other stage's names: a name itself, or every name inside it (a recomputed copy's
        ``<node>_recomputed``, a module path's prefix)."""
        hit = self.names.get(s)
        if hit is not None:
            return hit
        return _TOKEN.sub(lambda m: self._token(m.group(0)), s)

    def _token(self, t: str) -> str:
        hit = self.names.get(t)
        if hit is not None:
            return hit
        if t.endswith(SUFFIX) and t[: -len(SUFFIX)] in self.names:
            return self.names[t[: -len(SUFFIX)]] + SUFFIX
        parts = t.split(".")
        for k in range(len(parts) - 1, 0, -1):  # the longest layer prefix: ``blocks.5.attn`` → ``blocks.8.attn``
            head = ".".join(parts[:k])
            if head in self.layers:
                return self.layers[head] + t[len(head) :]
        return self.layers.get(t, t)

    def plan(self, p: Any, sub: OpGraph) -> Any:
        """The stage plan `p` of the searched slice `sub` told in the other stage's names, with the fingerprint
        of the other stage's slice (``OpGraph.fingerprint`` of the nodes renamed, as its own slice would hash)."""
        return dataclasses.replace(self._walk(p), fingerprint=self.fingerprint(sub))

    def fingerprint(self, sub: OpGraph) -> str:
        """``OpGraph.fingerprint`` of the other stage's slice, from `sub`'s nodes renamed."""
        h = hashlib.sha256()
        for n in sub.nodes:
            ins = tuple((self.names[s], i) for s, i in n.inputs)
            h.update(repr((self.names[n.name], n.target, ins, n.outputs)).encode())
        return h.hexdigest()[:16]

    def _walk(self, x: Any) -> Any:
        if isinstance(x, Enum):
            return x
        if isinstance(x, str):
            return self.text(x)
        if isinstance(x, tuple):
            return tuple(self._walk(v) for v in x)
        if isinstance(x, list):
            return [self._walk(v) for v in x]
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x).__name__ not in _KEPT:
            changed = {
                f.name: self._walk(getattr(x, f.name))
                for f in dataclasses.fields(x)
                if f.init and not f.name.startswith("_") and f.name not in _LAYOUTS
            }
            return dataclasses.replace(x, **changed)
        return x
