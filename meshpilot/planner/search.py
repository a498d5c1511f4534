"""Searchers: what chooses one strategy per node for one mesh candidate.

The mesh search (``meshpilot.planner.auto.plan``) builds, per mesh shape, every node's strategies and the
mapping-independent terms (``ilp.Structure``), and per device mapping the prices of its collectives
(``Resharder`` on that mapping's ``CostModel``). It then hands a :class:`SearchTask` to a :class:`Searcher`
and gets a :class:`Candidate` back: the chosen strategies, the predicted step time (``accounting``'s, the
one every searcher is judged by), the memory peak and what the search did. Everything after — the mesh
comparison, the plan's assembly, its schedule — is the same whichever searcher chose.

Searchers (:data:`SEARCHERS`, chosen by name with ``plan(..., searcher=)``):

* ``ilp`` (:class:`ILPSearcher`): Alpa's intra-operator ILP (``meshpilot.planner.ilp``), solved by HiGHS,
  then the ZeRO-like post-pass (``meshpilot.planner.zero``); re-solved while the liveness peak exceeds the
  device (at most :data:`REFITS` times), and on the plain memory rows when the ZeRO rows' plan does not fit
  or fitting cost time.

* ``pareto`` (:class:`~meshpilot.planner.pareto.ParetoSearcher`): HiDup's duplex-aware Pareto dynamic
  program over graph cuts (``meshpilot.planner.pareto``; its docstring maps Eq. 4–5, dominance and Fig. 4 to
  the code), beam-bounded; minimises the duplex step (one microbatch's communication behind the other's
  compute), its candidate priced by the accounting like the ILP's, the duplex time in ``objective_s``.
* ``best`` (:class:`~meshpilot.planner.pareto.BestSearcher`): both, the faster by the accounting.

A pipeline's stage planner calls a searcher through ``meshpilot.planner.stage``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from meshpilot.cluster.mesh import MeshMapping
from meshpilot.graph.capture import OpGraph
from meshpilot.io import fmt_size
from meshpilot.planner.accounting import Births, births, memory_use
from meshpilot.planner.ilp import TIME_LIMIT_S, PlanError, Structure, priced, solve
from meshpilot.planner.plan import MemoryUse, ZeroSwitch
from meshpilot.planner.zero import ParamEdges, ZeroMode, zero_pass
from meshpilot.sharding.reshard import Resharder
from meshpilot.sharding.strategies import Strategy

REFITS = 4
"""Re-solves of one candidate whose liveness peak exceeds the capacity its linear rows were held to."""
EPS = 1e-9


@dataclass(frozen=True)
class SearchTask:
    """One mesh candidate to choose strategies for."""

    graph: OpGraph
    struct: Structure
    """Every node's strategies on the mesh shape and the ILP's mapping-independent terms."""
    resharder: Resharder
    """Collectives between layouts, priced on this candidate's device mapping."""
    param_edges: ParamEdges
    mapping: MeshMapping
    capacity: float = math.inf
    zero: ZeroMode = ZeroMode.AUTO
    microbatches: int = 1
    time_limit: float = TIME_LIMIT_S
    mip_gap: float = 1e-3
    relaxed: bool = False
    """Solve the ILP from its LP relaxation (``ilp.solve(relaxed=)``): an estimate, for a stage table's pricing."""
    gather_once: bool = True
    """Whether the ZeRO post-pass may choose stage 2 (``zero.zero_pass``; pipeline stages run stage 3 only)."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.struct.mesh_shape)


@dataclass
class Candidate:
    """A searcher's answer for one mesh candidate."""

    shape: tuple[int, ...]
    mapping: MeshMapping
    chosen: dict[str, Strategy]
    time_s: float
    """Predicted step seconds (``accounting``'s step time of `chosen`)."""
    usage: MemoryUse
    """Predicted peak bytes per device and its split."""
    switches: list[ZeroSwitch] = field(default_factory=list)
    note: str = ""
    status: str = "optimal"
    objective_s: float = 0.0
    """The searcher's own objective before any post-pass."""
    gap: float = 0.0
    """Relative optimality gap the searcher proved (0: optimal)."""
    num_vars: int = 0
    num_constraints: int = 0
    num_groups: int = 0
    memory_row: str = "plain"
    build_s: float = 0.0
    solve_s: float = 0.0
    post_s: float = 0.0
    solves: int = 0
    births: Births | None = field(default=None, repr=False, compare=False)
    """Its liveness' first pass (``accounting.births``), which the bucketed plan's memory reuses."""

    @property
    def memory(self) -> float:
        return self.usage.total


class Searcher(Protocol):
    """Chooses strategies for one mesh candidate (module docstring)."""

    name: str

    def search(self, task: SearchTask) -> Candidate:
        """The fastest plan of `task` that fits its capacity; :class:`~meshpilot.planner.ilp.PlanError` (with
        ``mesh_shape``, ``need_bytes``, ``capacity_bytes``) when none does."""
        ...


class ILPSearcher:
    """Alpa's ILP with the ZeRO-like post-pass (module docstring)."""

    name = "ilp"

    def search(self, task: SearchTask) -> Candidate:
        run = _ILPRun(task)
        capacity, shape = task.capacity, task.shape
        if task.zero == ZeroMode.OFF or not math.isfinite(capacity):
            only = run.fitted("plain")
            if not run.fits(only):
                raise PlanError(
                    f"no sharding plan fits in {fmt_size(capacity)} per device on mesh {shape}: the best found "
                    f"peaks at {fmt_size(only.memory)} (at {only.usage.peak_at})",
                    mesh_shape=shape,
                    need_bytes=only.memory,
                    capacity_bytes=capacity,
                )
            return run.done(only)
        first = run.fitted("zero")
        costly = any(s.reason == "memory" and s.delta_s > EPS * first.time_s for s in first.switches)
        if run.fits(first) and not costly:
            return run.done(first)
        try:
            second = run.fitted("plain")
        except PlanError:
            second = None
        options = [c for c in (first, second) if c is not None and run.fits(c)]
        if not options:
            raise PlanError(
                f"no sharding plan fits in {fmt_size(capacity)} per device on mesh {shape} even with the "
                f"ZeRO post-pass (its predicted peak is {fmt_size(first.memory)})",
                mesh_shape=shape,
                need_bytes=first.memory,
                capacity_bytes=capacity,
            )
        return run.done(min(options, key=lambda c: c.time_s))


class _ILPRun:
    """One :meth:`ILPSearcher.search`: the task's priced problem, its solves and their timings."""

    def __init__(self, task: SearchTask):
        self.task = task
        t0 = time.perf_counter()
        self.prob = priced(task.struct, task.resharder, task.capacity)
        self.build_s = time.perf_counter() - t0
        self.solves = 0
        self.solve_s = self.post_s = 0.0

    def fits(self, c: Candidate) -> bool:
        return c.memory <= self.task.capacity * (1 + EPS)

    def attempt(self, row: str, cap: float) -> Candidate:
        """The ILP with memory row `row` held to `cap`, then the ZeRO post-pass and the plan's memory."""
        task, prob = self.task, self.prob
        self.solves += 1
        limits = dict(time_limit=task.time_limit, mip_rel_gap=task.mip_gap, relaxed=task.relaxed)
        sol = solve(prob, memory=row, capacity=cap, **limits)
        self.solve_s += sol.solve_s
        t = time.perf_counter()
        chosen = {name: prob.strategies[name][j] for name, j in sol.choice.items()}
        switches, d_t, _ = zero_pass(
            task.graph,
            prob.strategies,
            prob.forced,
            chosen,
            task.param_edges,
            task.resharder,
            sol.rows,
            cap,
            task.zero,
            task.microbatches,
            task.gather_once,
        )
        held = task.microbatches if task.struct.accumulating else 1  # summed gradients (accounting: A)
        on_cpu = task.resharder.cost_model.device.is_cpu  # gloo: DTensor's all-to-all is a gather
        first = births(task.graph, chosen, prob.mesh_shape, on_cpu)
        usage = memory_use(task.graph, chosen, prob.mesh_shape, task.capacity, held, on_cpu, first=first)
        self.post_s += time.perf_counter() - t
        return Candidate(
            task.shape,
            task.mapping,
            chosen,
            sol.objective + d_t,
            usage,
            switches,
            status=sol.status,
            objective_s=sol.objective,
            gap=sol.gap,
            num_vars=sol.num_vars,
            num_constraints=sol.num_constraints,
            num_groups=len(prob.groups),
            memory_row=sol.row,
            births=first,
        )

    def fitted(self, row: str) -> Candidate:
        """:meth:`attempt`; while the plan's liveness peak exceeds the capacity, re-solved (at most `REFITS`
        times) with the linear rows held to the capacity less the plan's own peak − rows gap (what lives
        at the peak beyond the rows: ``accounting`` docstring). The plan's rows exceed that bound, so each
        re-solve picks another plan. That gap can overshoot (a plan with less sharded activations has
        less beyond its rows too): a bound no plan meets is raised half way back to the last bound whose
        plan did not fit, so a fitting plan between the two is still found (a 2,048-token Llama under
        3.82 MiB, fitting 3.47 MiB: ``docs/benchmarks.md``, "Every lever")."""
        capacity = self.task.capacity
        cand = latest = self.attempt(row, capacity)
        above, below = capacity, 0.0  # a bound whose plan peaks over the capacity; one no plan meets
        for _ in range(REFITS):
            if self.fits(cand) or not math.isfinite(capacity):
                break
            bound = capacity - (latest.memory - latest.usage.row)
            if not below < bound < above:
                bound = (below + above) / 2
            try:
                latest = self.attempt(row, bound)
            except PlanError:
                below = bound
                continue
            above = bound
            cand = latest if self.fits(latest) or latest.memory < cand.memory else cand
        return cand

    def done(self, c: Candidate) -> Candidate:
        """`c` with its note and this run's timings."""
        c.note = _note(c)
        c.build_s, c.solve_s, c.post_s, c.solves = self.build_s, self.solve_s, self.post_s, self.solves
        return c


def _note(c: Candidate) -> str:
    if not c.switches:
        return ""
    why = sorted({s.reason for s in c.switches})
    return f"ZeRO: {len(c.switches)} parameters ({', '.join(why)})"


from meshpilot.planner.pareto import BestSearcher, ParetoSearcher  # noqa: E402  (they import this module's types)

SEARCHERS: dict[str, Searcher] = {s.name: s for s in (ILPSearcher(), ParetoSearcher(), BestSearcher())}
"""Every searcher by name."""


def get_searcher(name: str | Searcher) -> Searcher:
    """The searcher called `name` (or `name` itself when it is one); a UserError listing the names if none is."""
    if not isinstance(name, str):
        return name
    found = SEARCHERS.get(name)
    if found is None:
        raise PlanError(f"searcher={name!r}: expected one of {', '.join(SEARCHERS)}")
    return found
