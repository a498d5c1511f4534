"""The :class:`Plan`: an immutable, JSON-serialisable record of how to run one training step.

It holds the mesh (shape and the physical rank of every coordinate), every node's chosen strategy (layouts
of its operands and outputs, printable as ``linear_3: S(0)R × RS(1) → S(0)S(1)``), each parameter's layout,
the collectives the run will issue (kind, mesh axis, bytes, forward or backward), the predicted step time
split into compute / communication (reductions of partial sums) / resharding (all-gathers, all-to-alls),
memory per device, the solver's report and warnings. ``Plan.save(path)`` / ``Plan.load(path)`` round-trip
through JSON; ``meshpilot.parallelize(model, plan)`` runs it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from meshpilot.sharding.placements import Placements, from_json

Layout = tuple[str, ...]
"""A tensor layout in JSON form: one placement string per mesh axis (``("S(0)", "R")``)."""


def _fmt(layout: Layout | None) -> str:
    return "-" if layout is None else "".join(layout)


@dataclass(frozen=True)
class NodeChoice:
    """The strategy chosen for one node of the captured graph."""

    name: str
    target: str
    kind: str
    ins: tuple[Layout, ...]
    outs: tuple[Layout | None, ...]
    source: str
    phase: str

    def short(self) -> str:
        """``mm_3: S(0)R × RS(1) → S(0)S(1)``."""
        lhs = " × ".join(_fmt(p) for p in self.ins) if self.ins else "∅"
        return f"{self.name}: {lhs} → {', '.join(_fmt(p) for p in self.outs)}"

    def in_placements(self, a: int) -> Placements:
        return from_json(self.ins[a])  # type: ignore[return-value]

    def out_placements(self, i: int) -> Placements | None:
        return from_json(self.outs[i])


@dataclass(frozen=True)
class PlannedCollective:
    """One collective the run issues: where, what, how big."""

    kind: str
    """``all_reduce``, ``reduce_scatter``, ``all_gather`` or ``all_to_all``."""
    axis: int
    nbytes: int
    """Cost-model convention: all-gather output, reduce-scatter input, all-reduce buffer, all-to-all per rank."""
    phase: str
    """``fwd``, ``bwd`` (including the gradients' final resharding)."""
    src: str
    dst: str
    seconds: float


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step (no overlap assumed)."""

    compute_s: float
    communication_s: float
    resharding_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s + self.resharding_s


@dataclass(frozen=True)
class MemoryUse:
    """Predicted bytes per device."""

    params: float
    grads: float
    optimizer: float
    activations: float
    inputs: float
    capacity: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.inputs


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh shape and device mapping the search tried."""

    shape: tuple[int, ...]
    mapping: str
    objective_s: float | None
    note: str = ""


@dataclass(frozen=True)
class SolverReport:
    status: str
    objective_s: float
    gap: float
    """HiGHS' relative MIP gap at the end (0 = proven optimal)."""
    num_vars: int
    num_constraints: int
    num_groups: int
    capture_s: float
    build_s: float
    solve_s: float
    total_s: float
    candidates: tuple[MeshCandidate, ...] = ()


@dataclass(frozen=True)
class Plan:
    """How to run one training step of a model on a mesh (see the module docstring)."""

    cluster: str
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]
    """Physical rank of every mesh coordinate, row-major."""
    mapping: str
    nodes: tuple[NodeChoice, ...]
    params: tuple[tuple[str, Layout], ...]
    """(parameter name, layout it is stored and updated in)."""
    inputs: tuple[Layout, ...]
    input_shapes: tuple[tuple[tuple[int, ...], str], ...]
    time: StepTime
    memory: MemoryUse
    collectives: tuple[PlannedCollective, ...]
    warnings: tuple[str, ...]
    solver: SolverReport
    fingerprint: str
    version: int = 1
    _index: dict = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {n.name: n for n in self.nodes})

    # ---------------------------------------------------------------- access
    def node(self, name: str) -> NodeChoice:
        return self._index[name]

    def param_layout(self, fqn: str) -> Placements:
        for name, layout in self.params:
            if name == fqn:
                return from_json(layout)  # type: ignore[return-value]
        raise KeyError(fqn)

    def collective_counts(self, phase: str | None = None, backend: str = "nccl") -> Counter:
        """Counter of (kind, axis, nbytes) over the planned collectives, optionally of one phase.

        With ``backend="gloo"`` an all-to-all is counted as DTensor issues it on CPU process groups
        (which lack all-to-all): an all-gather of the shards, ``n`` times the bytes each rank holds.
        """
        out: Counter = Counter()
        for c in self.collectives:
            if phase is not None and c.phase != phase:
                continue
            if backend == "gloo" and c.kind == "all_to_all":
                out[("all_gather", c.axis, c.nbytes * self.mesh_shape[c.axis])] += 1
            else:
                out[(c.kind, c.axis, c.nbytes)] += 1
        return out

    # ---------------------------------------------------------------- printing
    def strategy_lines(self, ops_only: bool = True) -> list[str]:
        keep = ("op",) if ops_only else ("op", "getitem", "param", "buffer", "input")
        return [n.short() for n in self.nodes if n.kind in keep]

    def summary(self) -> str:
        t, m = self.time, self.memory
        gib = 2**30
        lines = [
            f"Plan on {self.cluster}: mesh {self.mesh_shape} ({self.mapping} mapping)",
            f"  step {t.total_s * 1e3:.3f} ms = compute {t.compute_s * 1e3:.3f} + communication "
            f"{t.communication_s * 1e3:.3f} + resharding {t.resharding_s * 1e3:.3f}",
            f"  memory/device {m.total / gib:.3f} GiB of {m.capacity / gib:.1f} (params {m.params / gib:.3f}, "
            f"grads {m.grads / gib:.3f}, AdamW {m.optimizer / gib:.3f}, activations {m.activations / gib:.3f})",
            f"  solver: {self.solver.status}; gap {self.solver.gap:.2%}; {self.solver.num_vars} vars; "
            f"{self.solver.total_s:.2f} s (capture {self.solver.capture_s:.2f}, build {self.solver.build_s:.2f}, "
            f"solve {self.solver.solve_s:.2f})",
            f"  {len(self.collectives)} collectives per step",
        ]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary() + "\n" + "\n".join("  " + s for s in self.strategy_lines())

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out = json.loads(json.dumps(d, default=_default))
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        def tup(x):
            return tuple(tup(v) for v in x) if isinstance(x, list) else x

        solver = d["solver"]
        return cls(
            cluster=d["cluster"],
            mesh_shape=tuple(d["mesh_shape"]),
            mesh_ranks=tuple(d["mesh_ranks"]),
            mapping=d["mapping"],
            nodes=tuple(
                NodeChoice(n["name"], n["target"], n["kind"], tup(n["ins"]), tup(n["outs"]), n["source"], n["phase"])
                for n in d["nodes"]
            ),
            params=tuple((p[0], tup(p[1])) for p in d["params"]),
            inputs=tup(d["inputs"]),
            input_shapes=tuple((tuple(s), dt) for s, dt in d["input_shapes"]),
            time=StepTime(**d["time"]),
            memory=MemoryUse(**d["memory"]),
            collectives=tuple(PlannedCollective(**c) for c in d["collectives"]),
            warnings=tuple(d["warnings"]),
            solver=SolverReport(
                **{k: v for k, v in solver.items() if k != "candidates"},
                candidates=tuple(
                    MeshCandidate(tuple(c["shape"]), c["mapping"], c["objective_s"], c["note"])
                    for c in solver["candidates"]
                ),
            ),
            fingerprint=d["fingerprint"],
            version=d.get("version", 1),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        return cls.from_json(Path(path).read_text())


def _default(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return {k: v for k, v in asdict(o).items() if not k.startswith("_")}
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
