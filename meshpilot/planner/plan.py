"""The :class:`Plan`: an immutable, JSON-serialisable record of how to run one training step.

It holds the mesh (shape, axis names and the physical rank of every coordinate), every node's chosen strategy (layouts
of its operands and outputs, printable as ``linear_3: S(0)R × RS(1) → S(0)S(1)``), each parameter's layout,
the collectives the run will issue (kind, mesh axis, bytes, forward or backward), the predicted step time
split into compute / communication (reductions of partial sums) / resharding (all-gathers, all-to-alls),
memory per device, the parameters the ZeRO-like post-pass sharded (``zero``; their layouts in ``params``
are the sharded ones and ``collectives`` holds their reduce-scatters and all-gathers), the solver's report
and warnings. ``str(plan)`` is the readable form: the summary (mesh, step-time split, memory, collectives,
ZeRO, solver gap and time, mesh candidates, warnings), every parameter's layout, then one line per
operator (``linear_3: S(0)R × RS(1) → S(0)S(1)``) with the collectives that feed it.
``Plan.save(path)`` / ``Plan.load(path)`` round-trip through JSON; ``meshpilot.parallelize(model, plan)``
runs it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from meshpilot.cluster.mesh import default_axis_names
from meshpilot.errors import UserError
from meshpilot.planner.schedule import Schedule, trivial
from meshpilot.sharding.placements import Placements, from_json
from meshpilot.sharding.reshard import CollectiveKind, as_issued

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
    seconds: float = 0.0
    """Predicted compute time of this node's shard of the work (the roofline of the cost model)."""

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
    """``all_reduce``, ``reduce_scatter``, ``all_gather`` or ``all_to_all`` (a ``CollectiveKind`` value)."""
    axis: int
    """Index of the mesh axis it runs over (its name: ``Plan.mesh_axes[axis]``)."""
    nbytes: int
    """The convention of ``CollectiveKind`` (all-gather output, reduce-scatter input, ...)."""
    phase: str
    """``fwd``, ``bwd`` (including the gradients' final resharding)."""
    src: str
    dst: str
    seconds: float
    operand: int = -1
    """Which operand of ``dst`` it reshards (-1: a collective the op issues itself, or a loss / gradient /
    buffer edge)."""

    @property
    def issued_by_op(self) -> bool:
        """True for a collective the op issues itself (``Strategy.colls``: src = dst, no operand), False for
        a resharding DTensor issues between ops."""
        return self.src == self.dst and self.operand == -1


@dataclass(frozen=True)
class Fallback:
    """A node no sharding strategy covers: it runs on full replicas of its operands."""

    node: str
    target: str
    where: str
    """Module path and source line of the model code that made it (``layers.0.attn (model.py:42)``)."""
    reason: str

    def line(self) -> str:
        return f"{self.node} = {self.target} in {self.where}: replicated ({self.reason})"


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one training step (no overlap assumed)."""

    compute_s: float
    """Operators of the forward and backward, every microbatch (roofline + fixed cost per operator)."""
    communication_s: float
    resharding_s: float
    optimizer_s: float = 0.0
    """The AdamW update of this device's parameter shards, once a step (``accounting.optimizer_seconds``);
    0 in plans written before it was modelled."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s + self.resharding_s + self.optimizer_s


@dataclass(frozen=True)
class MemoryUse:
    """Predicted bytes per device at the step's peak, split into what is live there
    (``meshpilot.planner.accounting`` computes it; the parts add up to :attr:`total`)."""

    params: float
    grads: float
    """Gradients live at the peak (all of them when the peak is the optimizer step)."""
    optimizer: float
    """AdamW's ``exp_avg`` and ``exp_avg_sq``, in the parameters' dtype."""
    activations: float
    """Values the backward reads that are live at the peak."""
    inputs: float
    capacity: float
    temporaries: float = 0.0
    """Everything else live at the peak: logits, the loss' upcast and gradient, redistributed copies, the
    optimizer update's temporary. 0 in plans written before the liveness accounting."""
    row: float = 0.0
    """The ILP's linear memory bound for this plan (the larger of its two rows; ``ilp`` docstring)."""
    peak_at: str = ""
    """The node at which the peak occurs, or ``optimizer step``."""

    @property
    def total(self) -> float:
        """The predicted peak (plans written before the liveness accounting: their summed estimate)."""
        return self.params + self.grads + self.optimizer + self.activations + self.inputs + self.temporaries


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh shape and device mapping the search tried."""

    shape: tuple[int, ...]
    mapping: str
    objective_s: float | None
    note: str = ""
    need_bytes: float | None = None
    """When no plan fits on this mesh: the smallest per-device memory one was found to need."""


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
    post_s: float = 0.0
    """Seconds in the ZeRO post-pass (over all candidates)."""
    memory_row: str = "plain"
    """The ILP's memory row: ``plain``, or ``zero`` (what the plan needs once the post-pass shards updates)."""
    ilps_solved: int = 1
    """HiGHS runs over all mesh candidates (a candidate may be solved on both memory rows)."""
    searcher: str = "ilp"
    """Which searcher chose the strategies (``meshpilot.planner.search.SEARCHERS``)."""


@dataclass(frozen=True)
class ZeroSwitch:
    """One parameter the ZeRO-like post-pass moved from replicated to sharded on some mesh axes: its gradient
    is reduce-scattered instead of all-reduced, AdamW updates the shard, the weight is all-gathered where
    it is read (``meshpilot.planner.zero`` docstring)."""

    param: str
    axes: tuple[int, ...]
    before: Layout
    after: Layout
    reason: str
    """``cheaper`` (faster, or as fast and smaller), ``memory`` (needed to fit) or ``all`` (``zero="all"``)."""
    delta_s: float
    """Change of the predicted step time (seconds; negative = faster)."""
    saved_bytes: float
    """Bytes per device saved (weights, gradients and AdamW states, less any gathered copy kept)."""


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
    zero: tuple[ZeroSwitch, ...] = ()
    """Parameters the ZeRO-like post-pass sharded (their layouts in ``params`` are already the new ones)."""
    fallbacks: tuple[Fallback, ...] = ()
    """Nodes with no strategy but the replicated one, each with where the model made it."""
    schedule: Schedule | None = None
    """The step's actions per rank (``meshpilot.planner.schedule``); None: the trivial ``F0 B0 G``."""
    precision: str = ""
    """``fp32``, ``bf16`` or ``bf16-mixed`` (``meshpilot.graph.capture.Precision``: autocast over fp32
    parameters); empty in older plans."""
    mesh_axes: tuple[str, ...] = ()
    """One name per mesh axis, the runtime's ``mesh_dim_names``: the cluster layer the axis crosses
    (``LogicalMesh.axis_names``, e.g. ``("node", "gpu")``). Plans saved before axes had names, and plans built
    without them, get positional names (``axis0``, ``axis1``: ``cluster.mesh.default_axis_names``)."""
    step_flops: float = 0.0
    """FLOPs of one training step of the whole model (every device's share, every microbatch): the captured
    graph's operator FLOPs; 0 in older plans. ``meshpilot train`` divides it by the step time for MFU."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device of the planned cluster at the plan's compute dtype (bfloat16 for the bf16
    precisions, else float32): MFU's denominator, per device; 0 in older plans."""
    _index: dict = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {n.name: n for n in self.nodes})
        if not self.mesh_axes:
            object.__setattr__(self, "mesh_axes", default_axis_names(len(self.mesh_shape)))

    # ---------------------------------------------------------------- access
    def node(self, name: str) -> NodeChoice:
        return self._index[name]

    def step_schedule(self) -> Schedule:
        """The plan's schedule, or the trivial one (``F0 B0 G`` on every rank)."""
        if self.schedule is not None:
            return self.schedule
        n = 1
        for d in self.mesh_shape:
            n *= d
        return trivial(n)

    def run_digest(self) -> str:
        """SHA-256 of what running the plan depends on — mesh, rank order, every node's strategy, the parameter
        and input layouts, the schedule — and not of how it was found (solver times, predictions): two plans
        with one digest run identically."""
        import hashlib

        d = self.to_dict()
        keys = ("mesh_shape", "mesh_ranks", "nodes", "params", "inputs", "schedule")
        return hashlib.sha256(json.dumps([d[k] for k in keys]).encode()).hexdigest()

    def param_layout(self, fqn: str) -> Placements:
        for name, layout in self.params:
            if name == fqn:
                return from_json(layout)  # type: ignore[return-value]
        raise KeyError(fqn)

    def axis_name(self, axis: int) -> str:
        """The name of mesh axis `axis` (:attr:`mesh_axes`)."""
        return self.mesh_axes[axis]

    def collective_counts(self, phase: str | None = None, backend: str = "nccl") -> Counter:
        """Counter of (kind, axis name, nbytes) over the collectives one step issues, optionally of one phase:
        each microbatch's once per microbatch of the schedule, the gradients' (``grad:``) once. The keys are
        those of ``CollectiveLog.counts()`` (``meshpilot.runtime.collective_log``), which records a run.

        With ``backend="gloo"`` an all-to-all is counted as DTensor issues it on CPU process groups
        (which lack all-to-all): an all-gather of the shards, ``n`` times the bytes each rank holds. An op's own
        all-to-all (``src == dst``: expert parallelism's dispatch and combine, :mod:`meshpilot.ops.moe`) is
        issued as ``all_to_all_single``, which gloo carries, and stays an all-to-all.
        """
        per_step = self.step_schedule().microbatches
        out: Counter = Counter()
        for c in self.collectives:
            if phase is not None and c.phase != phase:
                continue
            times = 1 if c.dst.startswith("grad:") else per_step
            on_gloo = backend == "gloo" and not c.issued_by_op
            kind, nbytes = as_issued(c.kind, c.nbytes, self.mesh_shape[c.axis], on_gloo)
            out[(kind, self.axis_name(c.axis), nbytes)] += times
        return out

    # ---------------------------------------------------------------- printing
    def strategy_lines(self, ops_only: bool = True) -> list[str]:
        keep = ("op",) if ops_only else ("op", "getitem", "param", "buffer", "input")
        return [n.short() for n in self.nodes if n.kind in keep]

    def summary(self) -> str:
        """The plan in a few lines: mesh, step-time split, memory, collectives, ZeRO, solver, warnings."""
        t, m, sv = self.time, self.memory, self.solver
        gib, ms = 2**30, 1e3
        tot = t.total_s or 1.0
        n = 1
        for d in self.mesh_shape:
            n *= d
        contiguous = {"row": self.mesh_axes[-1], "col": self.mesh_axes[0]}.get(self.mapping, self.mapping)
        by_kind = Counter(c.kind for c in self.collectives)
        by_phase = Counter(c.phase for c in self.collectives)
        kinds = ", ".join(f"{k} ×{v}" for k, v in sorted(by_kind.items())) or "none"
        status = re.search(r"HiGHS Status \d+: ([^)]*)", sv.status)
        lines = [
            f"Plan on {self.cluster}: mesh {self.mesh_shape} over axes ({', '.join(self.mesh_axes)}) ({n} devices; "
            f"{contiguous} on contiguous ranks, "
            f"{self.mapping} mapping)" + (f", {self.precision}" if self.precision else ""),
            f"  step time    {t.total_s * ms:.3f} ms = compute {t.compute_s * ms:.3f} ({t.compute_s / tot:.0%})"
            f" + communication {t.communication_s * ms:.3f} ({t.communication_s / tot:.0%})"
            f" + resharding {t.resharding_s * ms:.3f} ({t.resharding_s / tot:.0%})"
            f" + optimizer {t.optimizer_s * ms:.3f} ({t.optimizer_s / tot:.0%})",
            f"  memory       {m.total / gib:.3f} GiB per device of {m.capacity / gib:.1f} GiB"
            f" ({m.total / m.capacity if m.capacity else 0:.0%}): params {m.params / gib:.3f},"
            f" grads {m.grads / gib:.3f}, AdamW {m.optimizer / gib:.3f},"
            f" activations {m.activations / gib:.3f}, temporaries {m.temporaries / gib:.3f},"
            f" inputs {m.inputs / gib:.3f}" + (f"; peak at {m.peak_at}" if m.peak_at else ""),
            f"  collectives  {len(self.collectives)} per step (fwd {by_phase.get('fwd', 0)},"
            f" bwd {by_phase.get('bwd', 0)}): {kinds}",
        ]
        if self.zero:
            reasons = Counter(z.reason for z in self.zero)
            saved = sum(z.saved_bytes for z in self.zero)
            dt = sum(z.delta_s for z in self.zero)
            lines.append(
                f"  ZeRO         {len(self.zero)} parameters sharded on the axes their gradients were all-reduced over "
                f"(reduce-scatter + all-gather instead of all-reduce; "
                + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items()))
                + f"): saves {saved / gib:.3f} GiB per device, step {dt * ms:+.3f} ms"
            )
        lines += [
            f"  solver       HiGHS {status.group(1) if status else sv.status}; gap {sv.gap:.2%}; {sv.num_vars} vars,"
            f" {sv.num_constraints} constraints, {sv.num_groups} groups; memory row {sv.memory_row}",
            f"  planning     {sv.total_s:.2f} s = capture {sv.capture_s:.2f} + build {sv.build_s:.2f}"
            f" + solve {sv.solve_s:.2f} + post-pass {sv.post_s:.2f} (+ other)",
        ]
        if len(sv.candidates) > 1:
            ok = sorted((c for c in sv.candidates if c.objective_s is not None), key=lambda c: c.objective_s)
            skipped = sum(c.note.startswith("skipped") for c in sv.candidates)
            shown = ", ".join(f"{c.shape} {c.mapping} {c.objective_s * ms:.1f} ms" for c in ok[:4])
            lines.append(
                f"  candidates   {len(sv.candidates)} meshes: {len(ok)} solved ({sv.ilps_solved} ILPs),"
                f" {skipped} skipped by the compute lower bound,"
                f" {len(sv.candidates) - len(ok) - skipped} do not fit; best {shown}" + (" …" if len(ok) > 4 else "")
            )
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        """Summary, parameter layouts, then one line per operator with the collectives feeding it."""
        into: dict[str, list[str]] = {}
        for c in self.collectives:
            label = f"{_SHORT.get(c.kind, c.kind)}@{self.axis_name(c.axis)} {_bytes(c.nbytes)}"
            into.setdefault(c.dst, []).append(label)
        switched = {z.param: z for z in self.zero}
        out = [self.summary(), "parameters (stored layout):"]
        for fqn, layout in self.params:
            z = switched.get(fqn)
            extra = f"   ZeRO: was {_fmt(z.before)} ({z.reason})" if z else ""
            grad = into.get(f"grad:{fqn}")
            extra += f"   grad ← {', '.join(grad)}" if grad else ""
            out.append(f"  {fqn}: {_fmt(layout)}{extra}")
        for phase, title in (("fwd", "forward"), ("bwd", "backward")):
            lines = [n for n in self.nodes if n.kind == "op" and n.phase == phase]
            if not lines:
                continue
            out.append(f"{title} ({len(lines)} ops):")
            for n in lines:
                feed = into.get(n.name)
                out.append("  " + n.short() + (f"   ← {', '.join(feed)}" if feed else ""))
        loss = into.get("loss")
        if loss:
            out.append(f"loss ← {', '.join(loss)}")
        return "\n".join(out)

    # ---------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        out = json.loads(json.dumps(d, default=_default))
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> Plan:
        """The plan `d` (``to_dict``'s form); a one-line UserError naming `source` and the key when it is not one."""
        from meshpilot.planner.validate import check_version

        where = f"{source}: " if source else ""
        fix = "give a plan saved by `meshpilot plan --out FILE` or Plan.save"
        if not isinstance(d, dict):
            raise UserError(f"{where}not a meshpilot plan (the JSON is a {type(d).__name__}, not an object); {fix}")
        missing = [k for k in ("mesh_shape", "mesh_ranks", "nodes", "params", "solver", "fingerprint") if k not in d]
        if missing:
            raise UserError(f"{where}{missing[0]}: missing, so this is not a meshpilot plan; {fix}")
        check_version(d.get("version", 1), where)
        try:
            return cls._from_dict(d)
        except KeyError as e:
            raise UserError(f"{where}{e.args[0]}: missing from the plan (hand-edited or damaged?); {fix}") from None
        except (TypeError, ValueError, IndexError, AttributeError) as e:
            raise UserError(f"{where}malformed plan ({type(e).__name__}: {e}); {fix}") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> Plan:
        def tup(x):
            return tuple(tup(v) for v in x) if isinstance(x, list) else x

        solver = d["solver"]
        return cls(
            cluster=d["cluster"],
            mesh_shape=tuple(d["mesh_shape"]),
            mesh_ranks=tuple(d["mesh_ranks"]),
            mapping=d["mapping"],
            nodes=tuple(
                NodeChoice(
                    n["name"],
                    n["target"],
                    n["kind"],
                    tup(n["ins"]),
                    tup(n["outs"]),
                    n["source"],
                    n["phase"],
                    n.get("seconds", 0.0),
                )
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
                    MeshCandidate(tuple(c["shape"]), c["mapping"], c["objective_s"], c["note"], c.get("need_bytes"))
                    for c in solver["candidates"]
                ),
            ),
            fingerprint=d["fingerprint"],
            version=d.get("version", 1),
            precision=d.get("precision", ""),
            mesh_axes=tuple(d.get("mesh_axes", ())),
            step_flops=float(d.get("step_flops", 0.0)),
            peak_flops=float(d.get("peak_flops", 0.0)),
            zero=tuple(
                ZeroSwitch(
                    z["param"],
                    tuple(z["axes"]),
                    tup(z["before"]),
                    tup(z["after"]),
                    z["reason"],
                    z["delta_s"],
                    z["saved_bytes"],
                )
                for z in d.get("zero", ())
            ),
            fallbacks=tuple(Fallback(**f) for f in d.get("fallbacks", ())),
            schedule=Schedule.from_dict(d["schedule"]) if d.get("schedule") else None,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, source: str | None = None) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            where = f"{source}: " if source else ""
            raise UserError(
                f"{where}not JSON ({e}); give a plan saved by `meshpilot plan --out FILE` or Plan.save"
            ) from None
        return cls.from_dict(data, source=source)

    def save(self, path: str | Path) -> None:
        """Write the JSON atomically (temp file + rename), mode 0666 less the umask."""
        from meshpilot.io import atomic_write

        atomic_write(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a saved plan; a one-line UserError naming the file (and key) when it is not one."""
        path = Path(path)
        if path.is_dir():
            raise UserError(f"{path}: is a folder, not a plan file; give the JSON file `meshpilot plan --out` wrote")
        if not path.is_file():
            raise UserError(f"{path}: no such plan file; write one with `meshpilot plan ... --out {path}`")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise UserError(f"{path}: not a text file; give a plan JSON saved by `meshpilot plan --out`") from None
        except OSError as e:
            raise UserError(f"{path}: cannot be read ({e.strerror}); check its permissions") from None
        return cls.from_json(text, source=str(path))


_SHORT = {
    CollectiveKind.ALL_REDUCE: "AR",
    CollectiveKind.REDUCE_SCATTER: "RS",
    CollectiveKind.ALL_GATHER: "AG",
    CollectiveKind.ALL_TO_ALL: "A2A",
}


def _bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


def _default(o: Any) -> Any:
    if isinstance(o, Schedule):
        return o.to_dict()
    if hasattr(o, "__dataclass_fields__"):
        return {k: v for k, v in asdict(o).items() if not k.startswith("_")}
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
