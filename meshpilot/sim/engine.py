"""The event loop of the simulator; the model and its terms are in the package docstring (``meshpilot.sim``)."""

from __future__ import annotations

import functools
import heapq
import json
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshpilot.errors import UserError
from meshpilot.io import atomic_path, atomic_write
from meshpilot.ops import leading_collectives
from meshpilot.planner.buckets import GradBucket, backward_issues_buckets, collective_parts, grad_producers
from meshpilot.planner.prefetch import active_gathers, grouped_edges
from meshpilot.planner.schedule import Action, ActionKind, RankClass, Schedule

# program ops (tuples, for speed): (_COMPUTE, seconds, label) | (_ISSUE, key, label, axis) | (_WAIT, key, label)
# | (_SEND, key, label, peer) | (_RECV, key, label)
_COMPUTE, _ISSUE, _WAIT, _SEND, _RECV = range(5)


@dataclass(frozen=True)
class _Bucket:
    """Gradient bucket `k` of the plan (``StagePlan.grad_buckets``) where a key names a collective."""

    k: int


@dataclass(frozen=True)
class _Gather:
    """Gather group `k` of the plan (``StagePlan.param_gathers``) where a key names a collective."""

    k: int


@dataclass(frozen=True)
class _Sync:
    """Stage `k`'s gradient synchronisation issued after its last backward (``simulate``'s `grad_syncs`) where a
    key names a collective."""

    k: int


_SYNC_AXIS = -1
"""The pseudo mesh axis of the stage syncs: each rank's own queue (one DP stream), no members to wait for."""
SYNC_LABEL = "DP sync: stage "
"""How the trace names a stage's overlapped gradient sync (``SimResult.exposed_s`` finds them by it)."""


@dataclass(frozen=True)
class TraceEvent:
    """One span of the timeline: `stream` 0 is compute, 1 + j the link of cluster layer j."""

    rank: int
    """The class's representative rank."""
    stream: int
    name: str
    start_s: float
    dur_s: float
    cat: str
    """``compute``, ``comm`` or ``wait`` (the compute stream blocked on a transfer or a peer)."""


@dataclass(frozen=True)
class ClassTime:
    """The step of one simulated class of identical ranks, split (package docstring, *Split*)."""

    ranks: tuple[int, ...]
    schedule_class: int
    """Index into ``Schedule.classes`` of the rank class these ranks belong to."""
    compute_s: float
    exposed_comm_s: float
    hidden_comm_s: float
    idle_s: float
    end_s: float
    """When this class's last op (or transfer) ended."""

    @property
    def label(self) -> str:
        return f"ranks {_ranges(self.ranks)}"

    @property
    def comm_s(self) -> float:
        """Time some collective of these ranks is in flight (exposed + hidden)."""
        return self.exposed_comm_s + self.hidden_comm_s

    @property
    def overlap_ratio(self) -> float:
        """HiDup's overlap ratio (Table 4): time computation and communication overlap ÷ the smaller of the
        two (0 when either is none)."""
        return overlap_ratio(self.compute_s, self.comm_s, self.hidden_comm_s)


def overlap_ratio(compute_s: float, comm_s: float, overlapped_s: float) -> float:
    """HiDup's Table 4 overlap ratio: `overlapped_s` ÷ min(`compute_s`, `comm_s`); 0 when the minimum is 0."""
    low = min(compute_s, comm_s)
    return overlapped_s / low if low > 0 else 0.0


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts for one step."""

    step_s: float
    classes: tuple[ClassTime, ...]
    events: tuple[TraceEvent, ...] = field(repr=False)
    world: int = 0
    layers: tuple[str, ...] = ()
    """Names of the cluster's layers (stream 1 + j is layer j's link)."""
    schedule: str = ""
    wall_s: float = 0.0
    """Seconds the simulation took (lowering + event loop; not the trace or PNG)."""
    num_events: int = 0
    """Events the loop processed."""

    @property
    def sim_ranks(self) -> int:
        """How many representatives were simulated (one per class)."""
        return len(self.classes)

    def chrome_trace(self) -> dict[str, Any]:
        """``{"traceEvents": [...]}``: ph "X" spans in µs, pid = representative rank, tid = stream (Perfetto,
        chrome://tracing)."""
        ev: list[dict[str, Any]] = []
        streams = ["compute", *(f"comm: {name}" for name in self.layers)]
        for c in self.classes:
            pid = c.ranks[0]
            ev.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{c.label} ({len(c.ranks)})"}})
            ev.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
            for tid, name in enumerate(streams):
                ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        for e in self.events:
            ev.append(
                {
                    "ph": "X",
                    "name": e.name,
                    "cat": e.cat,
                    "pid": e.rank,
                    "tid": e.stream,
                    "ts": e.start_s * 1e6,
                    "dur": e.dur_s * 1e6,
                }
            )
        return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": {"step_s": self.step_s}}

    def exposed_s(self, rank: int, prefix: str = SYNC_LABEL) -> tuple[float, float]:
        """(exposed, hidden) seconds of representative `rank`'s transfers named ``prefix…`` (default: the stage
        syncs of ``simulate``'s `grad_syncs`): exposed, the time its compute stream waited for them (``wait
        prefix…``: what they add to its step); hidden, the rest of their time on the link (beside its compute,
        or its idle time in the drain)."""
        wait = "wait " + prefix
        exposed = sum(e.dur_s for e in self.events if e.rank == rank and e.cat == "wait" and e.name.startswith(wait))
        total = sum(e.dur_s for e in self.events if e.rank == rank and e.cat == "comm" and e.name.startswith(prefix))
        return exposed, max(0.0, total - exposed)

    def write_trace(self, path: str | Path) -> None:
        """The Chrome trace as JSON, written atomically."""
        atomic_write(path, json.dumps(self.chrome_trace()))

    def write_png(self, path: str | Path, max_classes: int = 16) -> None:
        """A timeline (one row per stream of each class, at most `max_classes` classes), written atomically."""
        write_timelines([self], path, max_classes)

    def _rows(self, max_classes: int) -> list[tuple[int, int]]:
        classes = self.classes[:max_classes]
        return sorted({(e.rank, e.stream) for e in self.events if e.rank in {c.ranks[0] for c in classes}})

    def _draw(self, ax: Any, max_classes: int) -> None:
        used = self._rows(max_classes)
        rows = {key: i for i, key in enumerate(used)}
        colors = {"compute": "tab:blue", "comm": "tab:orange", "wait": "lightgray"}
        spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for e in self.events:
            if (e.rank, e.stream) in rows:
                spans.setdefault((rows[(e.rank, e.stream)], e.cat), []).append((e.start_s * 1e3, e.dur_s * 1e3))
        for (row, cat), xs in spans.items():
            ax.broken_barh(xs, (row - 0.4, 0.8), facecolors=colors.get(cat, "tab:green"), linewidth=0)
        names = ["compute", *self.layers]
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"r{r} {names[s] if s < len(names) else s}" for r, s in used], fontsize=7)
        ax.invert_yaxis()
        ratio = max((c.overlap_ratio for c in self.classes), default=0.0)
        ax.set_title(
            f"simulated step {self.step_s * 1e3:.3f} ms ({self.schedule}; overlap ratio {ratio:.0%}; "
            "blue compute, orange comm)",
            fontsize=9,
        )


def write_timelines(results: list[SimResult], path: str | Path, max_classes: int = 16) -> None:
    """The timelines of several simulated steps stacked on one time axis (e.g. duplex and without), as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [max(len(r._rows(max_classes)), 2) for r in results]
    fig, axes = plt.subplots(
        len(results),
        1,
        sharex=True,
        squeeze=False,
        figsize=(12, 0.45 * sum(heights) + 1.2 * len(results)),
        gridspec_kw={"height_ratios": heights},
    )
    for r, ax in zip(results, axes[:, 0]):
        r._draw(ax, max_classes)
    axes[-1, 0].set_xlabel("ms")
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
    finally:
        plt.close(fig)


# ------------------------------------------------------------------------------------------------ input


def parse_straggler(items: Iterable[str]) -> dict[int, float]:
    """``["3:50", ...]`` → ``{3: 50.0}`` (rank 3 computes 50% slower); a UserError naming a bad item."""
    out: dict[int, float] = {}
    for item in items:
        rank, sep, pct = item.partition(":")
        try:
            r, p = int(rank), float(pct)
        except ValueError:
            r, p = -1, math.nan
        if not sep or r < 0 or not math.isfinite(p) or p <= -100:
            raise UserError(f"--straggler {item!r}: write RANK:PCT, e.g. 3:50 (rank 3 computes 50% slower)")
        out[r] = p
    return out


# ------------------------------------------------------------------------------------------------ classes


def rank_classes(
    schedule: Schedule, mesh_shape: tuple[int, ...], axes: Iterable[int], straggler: dict[int, float] | None = None
) -> list[tuple[int, ...]]:
    """Ranks that behave identically, by colour refinement (package docstring, *Rank classes*); each class
    sorted, classes ordered by their first rank."""
    world = math.prod(mesh_shape)
    straggler = straggler or {}
    grid = np.arange(world).reshape(mesh_shape)
    groups = {a: _axis_groups(grid, a) for a in sorted(set(axes)) if mesh_shape[a] > 1}
    p2p = {
        r
        for c in schedule.classes
        if any(a.kind in (ActionKind.SEND, ActionKind.RECV) for a in c.actions)
        for r in c.ranks
    }
    sched_class = {r: i for i, c in enumerate(schedule.classes) for r in c.ranks}
    color = _renumber([(sched_class[r], straggler.get(r, 0.0), r if r in p2p else -1) for r in range(world)])
    while True:
        sig = [[color[r]] for r in range(world)]
        for g in groups.values():
            for members in g.tolist():
                key = tuple(sorted(color[m] for m in members))
                for m in members:
                    sig[m].append(key)
        new = _renumber([tuple(s) for s in sig])
        if max(new) == max(color):
            break
        color = new
    out: dict[int, list[int]] = {}
    for r in range(world):
        out.setdefault(color[r], []).append(r)
    return sorted((tuple(v) for v in out.values()), key=lambda t: t[0])


def _renumber(keys: list) -> list[int]:
    ids: dict = {}
    return [ids.setdefault(k, len(ids)) for k in keys]


def _axis_groups(grid: np.ndarray, axis: int) -> np.ndarray:
    rest = [a for a in range(grid.ndim) if a != axis]
    return np.transpose(grid, rest + [axis]).reshape(-1, grid.shape[axis])


# ------------------------------------------------------------------------------------------------ lowering


@functools.lru_cache(maxsize=8)
def _cost_model(cluster: Any, shape: tuple[int, ...], ranks: tuple[int, ...]) -> Any:
    """The cost model of a mesh, kept for the next simulation of it: Eq. 3 on a 4,096-device mesh takes
    seconds, and every schedule / straggler of one plan asks for the same axes."""
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh

    return CostModel(LogicalMesh(cluster, shape, np.asarray(ranks, dtype=np.int64).reshape(shape)))


class _Lowering:
    """Durations, links and programs for one plan on one cluster."""

    def __init__(
        self,
        plan: Any,
        cluster: Any,
        schedule: Schedule,
        prefetch: Mapping[int, list[int]] | None = None,
        grad_syncs: Mapping[int, tuple[float, float]] | None = None,
        sync_layer: int = 0,
    ):
        self.plan = plan
        self.syncs = dict(grad_syncs or {})
        """Stage -> (its gradient sync's seconds, its update's seconds): the sync issued after the stage's last
        backward, waited for at ``G`` before the updates (``simulate``'s `grad_syncs`)."""
        self.sync_layer = sync_layer
        self.prefetch_at = dict(prefetch or {})
        """Node index -> gathers issued before its compute, waited at their consumers (``planner.prefetch``)."""
        self.prefetched = {c for cs in self.prefetch_at.values() for c in cs}
        self.cluster = cluster
        self.cm = _cost_model(cluster, tuple(plan.mesh_shape), tuple(plan.mesh_ranks))
        self.lm = self.cm.mesh
        self._dur: dict[tuple, tuple[float, float]] = {}
        self._layer: dict[int, int] = {}
        nodes = plan.nodes
        self.index = {n.name: i for i, n in enumerate(nodes)}
        self.bwd = [n.phase == "bwd" for n in nodes]
        self.seconds = [float(n.seconds) for n in nodes]
        self.pre: dict[int, list[int]] = {}
        self.post: dict[int, list[int]] = {}
        self.tail: dict[bool, list[int]] = {False: [], True: []}  # loss / buffers / unknown, per phase (bwd?)
        self.grads: list[int] = []
        self.gathers: list[int] = []
        """ZeRO-2 weights' all-gathers from their updated shards (``gather:``): once a step, after the update."""
        own: dict[int, int] = {}
        self.buckets: tuple[GradBucket, ...] = tuple(getattr(plan, "grad_buckets", ()))
        bucketed = {f"grad:{p}" for b in self.buckets for p in b.params}
        grouped = grouped_edges(plan)
        for c, col in enumerate(plan.collectives):
            if col.dst in bucketed or (col.phase, col.dst, col.operand) in grouped:
                continue  # synchronised by its bucket, gathered by its group
            if col.dst.startswith("grad:"):
                self.grads.append(c)
            elif col.dst.startswith("gather:"):
                self.gathers.append(c)
            elif col.src == col.dst and col.dst in self.index:  # an op's own: its leading ones before it
                i = self.index[col.dst]
                k = own[i] = own.get(i, -1) + 1
                (self.pre if k < leading_collectives(nodes[i].target) else self.post).setdefault(i, []).append(c)
            elif col.dst in self.index:
                self.pre.setdefault(self.index[col.dst], []).append(c)
            else:
                self.tail[col.phase == "bwd"].append(c)
        fwd_ops = [i for i, n in enumerate(nodes) if n.phase == "fwd"]
        bwd_ops = [i for i, n in enumerate(nodes) if n.phase == "bwd"]
        self.last = {False: fwd_ops[-1] if fwd_ops else -1, True: bwd_ops[-1] if bwd_ops else -1}
        self.in_backward = bool(self.buckets) and backward_issues_buckets(schedule)
        """The backward issues each bucket after its last gradient and waits at its end (else ``G`` does)."""
        self.gather_groups = active_gathers(plan)
        self.group_issue: dict[int, list[int]] = {}
        """Node index -> gather groups issued before its compute, one layer ahead (``GatherGroup.issue_at``)."""
        self.group_wait: dict[int, list[int]] = {}
        """Node index -> gather groups its compute waits for (their first consumer)."""
        for k, g in enumerate(self.gather_groups):
            first = min(self.index[n] for n, _ in g.edges)
            self.group_wait.setdefault(first, []).append(k)
            if g.issue_at:
                self.group_issue.setdefault(self.index[g.issue_at], []).append(k)
        self.bucket_at: dict[int, list[int]] = {}
        if self.in_backward:
            producer = grad_producers(plan)
            for k, b in enumerate(self.buckets):
                i = self.index.get(producer.get(b.params[-1], ""), -1)
                at = i if i >= 0 and self.bwd[i] else (bwd_ops[0] if bwd_ops else -1)
                self.bucket_at.setdefault(at, []).append(k)

    def duration(self, c: int | _Bucket | _Gather) -> tuple[float, float, float]:
        """(latency L, bandwidth part W, busy factor f) of collective `c` (or gradient bucket) from the cost
        model (package docstring, *Durations* and *Contention*)."""
        lat, work, busy, _ = self._parts(c)
        return lat, work, busy

    def _sync_parts(self, c: _Sync) -> tuple[float, float, float, float]:
        """A stage sync: its planned seconds, all on the link (no latency split, busy factor 1, no host cost)."""
        return 0.0, self.syncs[c.k][0], 1.0, 0.0

    def host(self, c: int | _Bucket | _Gather) -> float:
        """Seconds collective `c` takes from its rank's compute stream when issued (``Parts.host_s``: a CPU
        device's host cost per collective; package docstring, *Durations*)."""
        return self._parts(c)[3]

    def _parts(self, c: int | _Bucket | _Gather | _Sync) -> tuple[float, float, float, float]:
        if isinstance(c, _Sync):
            return self._sync_parts(c)
        if isinstance(c, (_Bucket, _Gather)):
            b = self.buckets[c.k] if isinstance(c, _Bucket) else self.gather_groups[c.k]
            kind, axis, nbytes, by_op, seconds = b.kind, b.axis, b.nbytes, False, b.seconds
        else:
            col = self.plan.collectives[c]
            kind, axis, nbytes, by_op, seconds = col.kind, col.axis, col.nbytes, col.issued_by_op, col.seconds
        key = (kind, axis, nbytes, by_op)
        if key not in self._dur:
            parts = collective_parts(self.cm, kind, nbytes, axis, by_op=by_op, seconds=seconds)
            self._dur[key] = (parts.latency_s, parts.work_s, parts.busy, parts.host_s)
        return self._dur[key]

    def issue(self, ops: list[tuple], key: tuple, label: str, axis: int) -> None:
        """Issue collective `key` (collective, microbatch) on mesh `axis`: its host cost first on the compute
        stream (:meth:`host`), then the issue."""
        host = self.host(key[0])
        if host > 0:
            ops.append((_COMPUTE, host, f"host: {label}"))
        ops.append((_ISSUE, key, label, axis))

    def p2p(self, nbytes: float, src: int, dst: int) -> tuple[float, float, int]:
        """(L, W, layer) of a send between mesh ranks `src` and `dst`."""
        a, b = int(self.plan.mesh_ranks[src]), int(self.plan.mesh_ranks[dst])
        if a == b:
            return 0.0, 0.0, len(self.cluster.layers) - 1
        lat = self.cluster.p2p_latency(a, b)
        t = self.cm.send_recv_ranks(nbytes, a, b)
        ca, cb = self.cluster.coords(np.array([a, b]))
        layer = next(j for j in range(len(ca)) if ca[j] != cb[j])
        return lat, t - lat, layer

    def layer_of(self, axis: int) -> int:
        """Outermost cluster layer the groups of mesh `axis` cross (their bottleneck link)."""
        if axis == _SYNC_AXIS:
            return self.sync_layer
        if axis not in self._layer:
            groups = self.lm.groups(axis)
            nl = len(self.cluster.layers)
            coords = self.cluster.coords(groups.reshape(-1)).reshape(*groups.shape, nl)
            varies = (coords.max(axis=1) != coords.min(axis=1)).any(axis=0)
            self._layer[axis] = int(np.argmax(varies)) if varies.any() else nl - 1
        return self._layer[axis]

    def program(self, rc: RankClass) -> list[tuple]:
        """The ops of one rank class (package docstring, *Streams*)."""
        explicit = {(a.collective, a.microbatch) for a in rc.actions if a.kind == ActionKind.ISSUE}
        ops: list[tuple] = []
        last = self._last_gradients(rc)
        for i, a in enumerate(rc.actions):
            k = a.kind
            if k.is_compute:
                self._compute(a, explicit, ops)
                if i in last:  # the stage's gradients are complete: its sync goes on its stream now
                    st = last[i]
                    self.issue(ops, (_Sync(st), 0), f"{SYNC_LABEL}{st}", _SYNC_AXIS)
            elif k == ActionKind.GRAD_SYNC:
                for st in last.values():  # the stages' own syncs, issued after their last backwards
                    ops.append((_WAIT, (_Sync(st), 0), f"wait {SYNC_LABEL}{st}"))
                if not self.in_backward:  # every bucket issued, then every one waited for (BucketSync.run)
                    self._buckets(range(len(self.buckets)), 0, ops, issue=True)
                    self._buckets(range(len(self.buckets)), 0, ops, issue=False)
                for c in self.grads:
                    self._blocking(c, 0, ops)
                update = float(getattr(self.plan.time, "optimizer_s", 0.0))
                update += sum(self.syncs[st][1] for st in last.values())
                if update > 0:  # the optimizer's update, once the gradients are in
                    ops.append((_COMPUTE, update, "optimizer"))
                for c in self.gathers:  # the updated ZeRO-2 shards into the copies the next step reads
                    self._blocking(c, 0, ops)
            elif k == ActionKind.ISSUE:
                key = (a.collective, a.microbatch)
                self.issue(ops, key, self._label(*key), self.plan.collectives[a.collective].axis)
            elif k == ActionKind.WAIT:
                ops.append((_WAIT, (a.collective, a.microbatch), f"wait {a}"))
            elif k == ActionKind.SEND:  # a send and its receive meet on (peer ranks, Action.boundary)
                ops.append((_SEND, a.boundary, str(a), a.peer))
            else:
                ops.append((_RECV, a.boundary, str(a), a.peer))
        return ops

    def _last_gradients(self, rc: RankClass) -> dict[int, int]:
        """Action index -> stage, for each stage of `grad_syncs` that `rc` runs: its last action that completes
        weight gradients (``B``, or ``W`` where the backward is split). A stage is the action's ``stage``, or,
        where a rank class holds one stage and its actions name none, the class's first rank (``Plan.simulate``
        numbers the stand-in's ranks by stage)."""
        if not self.syncs:
            return {}
        at: dict[int, int] = {}
        for i, a in enumerate(rc.actions):
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                st = a.stage if a.stage is not None else rc.ranks[0]
                if st in self.syncs:
                    at[st] = i
        return {i: st for st, i in sorted(at.items(), key=lambda x: x[1])}

    def _label(self, c: int, m: int) -> str:
        col = self.plan.collectives[c]
        return f"{col.kind}@{self.plan.axis_name(col.axis)} #{c}.{m}"

    def _buckets(self, ks: Iterable[int], m: int, ops: list[tuple], issue: bool) -> None:
        """Issue (`issue`) or wait for the gradient buckets `ks` of microbatch `m`."""
        for k in ks:
            b = self.buckets[k]
            label = f"bucket {k}: {b.kind}@{self.plan.axis_name(b.axis)} ({len(b.params)} gradients)"
            if issue:
                self.issue(ops, (_Bucket(k), m), label, b.axis)
            else:
                ops.append((_WAIT, (_Bucket(k), m), f"wait {label}"))

    def _groups(self, ks: Iterable[int], m: int, ops: list[tuple], wait: bool) -> None:
        """Issue (not `wait`) the gather groups `ks` of microbatch `m`, or wait for them, issuing first those
        issued at their own first consumer (``GatherGroup.issue_at`` empty)."""
        for k in ks:
            g = self.gather_groups[k]
            label = f"gather group {k}: {g.layer} ({len(g.edges)} gathers)@{self.plan.axis_name(g.axis)}"
            if not wait or not g.issue_at:
                self.issue(ops, (_Gather(k), m), label, g.axis)
            if wait:
                ops.append((_WAIT, (_Gather(k), m), f"wait {label}"))

    def _blocking(self, c: int, m: int, ops: list[tuple]) -> None:
        label = self._label(c, m)
        self.issue(ops, (c, m), label, self.plan.collectives[c].axis)
        ops.append((_WAIT, (c, m), f"wait {label}"))

    def _compute(self, a: Action, explicit: set, ops: list[tuple]) -> None:
        bwd = a.kind != ActionKind.FORWARD
        m = a.microbatch
        if a.nodes is None and a.kind in (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT):
            raise UserError(
                f"simulate: {a} is a part of a backward; give the nodes it runs ({a.kind.value}{m}[start:stop]), as "
                "Plan.simulate does, or a whole B"
            )
        lo, hi = a.nodes if a.nodes is not None else (0, len(self.seconds))
        run, start = 0.0, None

        def flush(stop: int) -> None:
            nonlocal run, start
            if start is not None:
                ops.append((_COMPUTE, run, f"{a.kind.value}{m}[{start}:{stop}]"))
            run, start = 0.0, None

        def colls(cs: list[int]) -> None:
            todo = [c for c in cs if (c, m) not in explicit]
            if todo:
                flush(i)
                for c in todo:
                    if c in self.prefetched:  # issued a layer earlier: only its wait is here
                        ops.append((_WAIT, (c, m), f"wait {self._label(c, m)}"))
                    else:
                        self._blocking(c, m, ops)

        for i in range(lo, min(hi, len(self.seconds))):
            if self.bwd[i] != bwd:
                continue
            if i in self.group_wait:
                flush(i)
                self._groups(self.group_wait[i], m, ops, wait=True)
            colls(self.pre.get(i, ()))
            if i in self.prefetch_at or i in self.group_issue:  # the next layer's gathers, issued before it computes
                flush(i)
                for c in self.prefetch_at.get(i, ()):
                    self.issue(ops, (c, m), self._label(c, m), self.plan.collectives[c].axis)
                self._groups(self.group_issue.get(i, ()), m, ops, wait=False)
            if start is None:
                start = i
            run += self.seconds[i]
            if i in self.post:
                flush(i + 1)
                colls(self.post[i])
            if bwd and i in self.bucket_at:  # a bucket's last gradient: the backward issues it now
                flush(i + 1)
                self._buckets(self.bucket_at[i], m, ops, issue=True)
            if i == self.last[bwd]:
                flush(i + 1)
                colls(self.tail[bwd])
                if bwd and self.in_backward:  # the backward program ends waiting for its buckets
                    self._buckets(range(len(self.buckets)), m, ops, issue=False)
        flush(min(hi, len(self.seconds)))


# ------------------------------------------------------------------------------------------------ event loop


class _Link:
    """One rank's link of one cluster layer: processor sharing among its active transfers, each slowed by its
    busy factor while the rank computes (package docstring, *Contention*)."""

    __slots__ = ("active", "last", "slow", "version")

    def __init__(self) -> None:
        self.active: dict[int, float] = {}
        self.slow: dict[int, float] = {}  # busy factors above 1 of the active transfers
        self.last = 0.0
        self.version = 0

    def advance(self, now: float, busy: bool) -> None:
        k = len(self.active)
        if k and now > self.last:
            dt = (now - self.last) / k
            for t in self.active:
                self.active[t] -= dt / self.slow.get(t, 1.0) if busy else dt
        self.last = now

    def eta(self, t: int, busy: bool) -> float:
        """Seconds transfer `t` needs at the current rates, were it alone on the link."""
        return self.active[t] * self.slow.get(t, 1.0) if busy else self.active[t]

    def next_finish(self, busy: bool) -> float:
        return self.last + len(self.active) * min(self.eta(t, busy) for t in self.active)


@dataclass
class _Transfer:
    sim: int
    done_key: tuple
    layer: int
    ready: float
    work: float
    label: str
    slow: float = 1.0
    """Busy factor: how many times slower it progresses while its rank computes."""
    lat_left: float = 0.0
    """Latency still to run (at rate 1, or 1 / slow while the rank computes), as of `lat_last`."""
    lat_last: float = 0.0
    version: int = 0
    """Bumped when the end of its latency is rescheduled."""
    joined: bool = False
    """On its link (latency over)."""
    group: tuple[int, int] | None = None
    """(sim rank, mesh axis) of a collective: its process group, which runs one collective at a time."""


class _Sim:
    def __init__(
        self,
        programs: list[list[tuple]],
        scale: list[float],
        members: list[dict[int, tuple[int, ...]]],
        reps: list[int],
        low: _Lowering,
        p2p_bytes: float | Mapping[tuple[int, int], float],
    ):
        self.programs, self.scale, self.members, self.reps = programs, scale, members, reps
        self.low, self.p2p_bytes = low, p2p_bytes
        n = len(programs)
        self.pc = [0] * n
        self.end = [0.0] * n
        self.finished = [False] * n
        self.blocked: list[tuple | None] = [None] * n
        self.block_start = [0.0] * n
        self.compute: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.comm: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        self.events: list[TraceEvent] = []
        self.heap: list[tuple] = []
        self.seq = 0
        self.issued: dict[tuple, dict[int, float]] = {}
        self.pending: dict[tuple, list[int]] = {}
        self.done: dict[tuple, float] = {}
        self.waiter: dict[tuple, int] = {}
        self.links: dict[tuple[int, int], _Link] = {}
        self.transfers: list[_Transfer] = []
        self.busy = [False] * n  # the compute stream is running
        self.group_busy: set[tuple[int, int]] = set()  # (sim rank, mesh axis) groups running a collective
        self.group_queue: dict[tuple[int, int], deque] = {}  # and what waits behind it, in issue order
        self.slowed: list[set[int]] = [set() for _ in range(n)]  # unfinished transfers with a busy factor > 1
        self.count = 0

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, payload))

    def run(self) -> None:
        for s in range(len(self.programs)):
            self.step(s, 0.0)
        while self.heap:
            now, _, kind, payload = heapq.heappop(self.heap)
            self.count += 1
            if kind == 0:  # compute done
                self._set_busy(payload, False, now)
                self.pc[payload] += 1
                self.step(payload, now)
            elif kind == 1:  # latency over: join the link
                tid, version = payload
                tr = self.transfers[tid]
                if version != tr.version:
                    continue
                tr.joined = True
                link = self._link(tr.sim, tr.layer)
                link.advance(now, self.busy[tr.sim])
                if tr.work <= 0:
                    self._complete(tid, now)
                else:
                    link.active[tid] = tr.work
                    if tr.slow > 1.0:
                        link.slow[tid] = tr.slow
                    self._reschedule(tr.sim, tr.layer, link)
            else:  # a link's earliest transfer may be done
                (sim, layer), version = payload
                link = self.links[(sim, layer)]
                if version != link.version:
                    continue
                busy = self.busy[sim]
                link.advance(now, busy)
                # the transfer this event was scheduled for ends now, whatever rounding left of its work
                first = min(link.active, key=lambda t: link.eta(t, busy))
                done = [t for t, rem in link.active.items() if t == first or rem <= 1e-9 * self.transfers[t].work]
                for t in done:
                    del link.active[t]
                    link.slow.pop(t, None)
                self._reschedule(sim, layer, link)
                for t in done:
                    self._complete(t, now)
        stuck = [s for s in range(len(self.programs)) if not self.finished[s]]
        if stuck:
            s = stuck[0]
            op = self.programs[s][self.pc[s]]
            raise UserError(
                f"the schedule deadlocks: rank {self.reps[s]} waits forever at {op[2]!r} (a collective some member "
                "of its group never issues, or a receive without its send); fix the schedule"
            )

    def _link(self, sim: int, layer: int) -> _Link:
        link = self.links.get((sim, layer))
        if link is None:
            link = self.links[(sim, layer)] = _Link()
        return link

    def _reschedule(self, sim: int, layer: int, link: _Link) -> None:
        link.version += 1
        if link.active:
            self.push(link.next_finish(self.busy[sim]), 2, ((sim, layer), link.version))

    def _start(
        self,
        sim: int,
        done_key: tuple,
        lat: float,
        work: float,
        layer: int,
        label: str,
        now: float,
        slow: float = 1.0,
        group: tuple[int, int] | None = None,
    ) -> None:
        tid = len(self.transfers)
        tr = _Transfer(sim, done_key, layer, now, work, label, slow, lat, now, group=group)
        self.transfers.append(tr)
        if lat <= 0 and work <= 0:
            self._complete(tid, now)
        else:
            if slow > 1.0:
                self.slowed[sim].add(tid)
            self.push(now + lat * (slow if self.busy[sim] else 1.0), 1, (tid, tr.version))

    def _set_busy(self, s: int, busy: bool, now: float) -> None:
        """Rank `s`'s compute stream starts (`busy`) or stops: its slowed transfers change rate from here
        (package docstring, *Contention*): the rest of a latency is rescheduled, the links advanced at the old
        rates and their next completion rescheduled at the new."""
        if self.busy[s] == busy:
            return
        if not self.slowed[s]:
            self.busy[s] = busy
            return
        layers = set()
        for tid in self.slowed[s]:
            tr = self.transfers[tid]
            if tr.joined:
                layers.add(tr.layer)
                continue
            tr.lat_left = max(0.0, tr.lat_left - (now - tr.lat_last) / (tr.slow if self.busy[s] else 1.0))
            tr.lat_last = now
            tr.version += 1
            self.push(now + tr.lat_left * (tr.slow if busy else 1.0), 1, (tid, tr.version))
        for layer in layers:
            self.links[(s, layer)].advance(now, self.busy[s])
        self.busy[s] = busy
        for layer in layers:
            self._reschedule(s, layer, self.links[(s, layer)])

    def _in_group(self, sim: int, axis: int, start: tuple, ready: float) -> None:
        """Start a collective of rank `sim`'s group on mesh `axis` (`start`: ``_start``'s arguments but ``now``,
        its busy factor last) at `ready`, or queue it behind the group's running one (package docstring,
        *Groups*)."""
        g = (sim, axis)
        if g in self.group_busy:
            self.group_queue.setdefault(g, deque()).append(start)
            return
        self.group_busy.add(g)
        self._start(*start[:6], ready, start[6], group=g)

    def _complete(self, tid: int, now: float) -> None:
        tr = self.transfers[tid]
        self.slowed[tr.sim].discard(tid)
        if tr.group is not None:  # the group's next collective starts now
            queue = self.group_queue.get(tr.group)
            if queue:
                start = queue.popleft()
                self._start(*start[:6], now, start[6], group=tr.group)
            else:
                self.group_busy.discard(tr.group)
        if now > tr.ready:
            self.comm[tr.sim].append((tr.ready, now))
            self.events.append(TraceEvent(self.reps[tr.sim], 1 + tr.layer, tr.label, tr.ready, now - tr.ready, "comm"))
        self.end[tr.sim] = max(self.end[tr.sim], now)
        self.done[tr.done_key] = now
        s = self.waiter.pop(tr.done_key, None)
        if s is not None:
            self._unblock(s, now)

    def _unblock(self, s: int, now: float) -> None:
        op = self.programs[s][self.pc[s]]
        if now > self.block_start[s]:
            self.events.append(
                TraceEvent(self.reps[s], 0, op[2], self.block_start[s], now - self.block_start[s], "wait")
            )
        self.blocked[s] = None
        self.pc[s] += 1
        self.step(s, now)

    def step(self, s: int, now: float) -> None:
        """Run rank `s`'s program from its pc until it computes, blocks or ends."""
        prog = self.programs[s]
        while self.pc[s] < len(prog):
            op = prog[self.pc[s]]
            kind = op[0]
            if kind == _COMPUTE:
                dur = op[1] * self.scale[s]
                if dur > 0:
                    self.compute[s].append((now, now + dur))
                    self.events.append(TraceEvent(self.reps[s], 0, op[2], now, dur, "compute"))
                    self.push(now + dur, 0, s)
                    self._set_busy(s, True, now)
                    return
            elif kind == _ISSUE:
                self._issue(s, op, now)
            elif kind == _SEND:
                peer = op[3]
                rank = self.reps[s]
                lat, work, layer = self.low.p2p(self._send_bytes(op[1], rank, peer), rank, peer)
                self._start(s, ("p2p", op[1], rank, peer), lat, work, layer, op[2], now)
            else:  # wait / receive
                key = (s, op[1]) if kind == _WAIT else ("p2p", op[1], op[3], self.reps[s])
                if key not in self.done:
                    self.blocked[s] = key
                    self.block_start[s] = now
                    self.waiter[key] = s
                    return
            self.pc[s] += 1
        self.finished[s] = True
        self.end[s] = max(self.end[s], now)

    def _send_bytes(self, boundary: tuple, rank: int, peer: int) -> float:
        """Bytes of one send: `p2p_bytes` itself, or its entry for (sending stage, receiving stage) — the
        action's stages (``Action.boundary``) where it names them, else the two mesh ranks (one per stage, as
        ``Plan.simulate`` lays a pipeline out); 0 for a pair it lacks."""
        if not isinstance(self.p2p_bytes, Mapping):
            return float(self.p2p_bytes)
        src, dst = (boundary[2], boundary[3]) if boundary[2] is not None else (rank, peer)
        return float(self.p2p_bytes.get((src, dst), 0.0))

    def _issue(self, s: int, op: tuple, now: float) -> None:
        key, label, axis = op[1], op[2], op[3]
        got = self.issued.setdefault(key, {})
        got[s] = now
        waiting = self.pending.setdefault(key, [])
        waiting.append(s)
        still = []
        for j in waiting:
            need = self.members[j].get(axis, (j,))
            if all(m in got for m in need):
                ready = max(got[m] for m in need)
                lat, work, slow = self.low.duration(key[0])
                self._in_group(j, axis, (j, (j, key), lat, work, self.low.layer_of(axis), label, slow), ready)
            else:
                still.append(j)
        self.pending[key] = still


# ------------------------------------------------------------------------------------------------ simulate


def simulate(
    plan: Any,
    *,
    cluster: Any = None,
    schedule: Schedule | None = None,
    straggler: dict[int, float] | None = None,
    symmetric: bool = True,
    p2p_bytes: float | Mapping[tuple[int, int], float] = 0.0,
    prefetch: Mapping[int, list[int]] | None = None,
    grad_syncs: Mapping[int, tuple[float, float]] | None = None,
    sync_layer: int = 0,
) -> SimResult:
    """Simulate one step of `plan` (its ``step_schedule()`` unless `schedule` is given) on `cluster` (default:
    ``load_cluster(plan.cluster)``). `straggler` maps a rank (its row-major mesh position, as the schedule
    numbers ranks) to how many percent slower it computes. `symmetric=False` simulates every rank on its
    own (the same answer, slower; for checking). `p2p_bytes`: bytes of each pipeline send, or per (sending stage,
    receiving stage) (``Plan.simulate``: each boundary's ``StageTransfer``). `prefetch`: the sharded parameters'
    gathers the runtime issues a layer ahead (``meshpilot.planner.prefetch.prefetch_issues``). `grad_syncs`:
    per pipeline stage, (the seconds of its gradient sync, of its update): the sync issued on the rank's own DP
    stream (one at a time, in issue order) on cluster layer `sync_layer` when the stage's last backward ends,
    every one waited for at ``G``, then the updates (package docstring, *Overlapped stage syncs*;
    ``Plan.simulate`` with ``Plan.sync_overlap``)."""
    t0 = time.perf_counter()
    if cluster is None:
        from meshpilot.cluster import load_cluster

        try:
            cluster = load_cluster(plan.cluster)
        except UserError as e:
            raise UserError(f"the plan's cluster {plan.cluster!r} cannot be loaded ({e}); pass the cluster") from None
    elif isinstance(cluster, str):
        from meshpilot.cluster import load_cluster

        cluster = load_cluster(cluster)
    schedule = schedule or plan.step_schedule()
    world = math.prod(plan.mesh_shape)
    straggler = dict(straggler or {})
    for r, pct in straggler.items():
        if not 0 <= r < world:
            raise UserError(f"--straggler {r}:{pct:g}: rank {r} is not in the plan's mesh; give 0..{world - 1}")
    covered = sorted(r for c in schedule.classes for r in c.ranks)
    if covered != list(range(world)):
        raise UserError(f"schedule {schedule.name!r} does not name every rank 0..{world - 1} exactly once")
    low = _Lowering(plan, cluster, schedule, prefetch, grad_syncs, sync_layer)
    axes = sorted({c.axis for c in plan.collectives})
    if symmetric:
        classes = rank_classes(schedule, tuple(plan.mesh_shape), axes, straggler)
    else:
        classes = [(r,) for r in range(world)]
    color = {r: i for i, cls in enumerate(classes) for r in cls}
    reps = [cls[0] for cls in classes]
    grid = np.arange(world).reshape(tuple(plan.mesh_shape))
    coords = [np.unravel_index(r, grid.shape) for r in reps]
    members: list[dict[int, tuple[int, ...]]] = []
    for s in range(len(reps)):
        mine: dict[int, tuple[int, ...]] = {}
        for a in axes:
            idx = list(coords[s])
            idx[a] = slice(None)
            mine[a] = tuple(sorted({color[int(r)] for r in grid[tuple(idx)].reshape(-1)}))
        members.append(mine)
    sched_index = {r: i for i, c in enumerate(schedule.classes) for r in c.ranks}
    progs: dict[int, list[tuple]] = {}
    programs = []
    for rep in reps:
        k = sched_index[rep]
        if k not in progs:
            progs[k] = low.program(schedule.classes[k])
        programs.append(progs[k])
    scale = [1 + straggler.get(rep, 0.0) / 100 for rep in reps]
    sim = _Sim(programs, scale, members, reps, low, p2p_bytes)
    sim.run()
    step = max(sim.end) if sim.end else 0.0
    out = []
    for s, cls in enumerate(classes):
        comp, exposed, hidden = _split(sim.compute[s], sim.comm[s])
        out.append(ClassTime(cls, sched_index[cls[0]], comp, exposed, hidden, step - comp - exposed, sim.end[s]))
    return SimResult(
        step_s=step,
        classes=tuple(out),
        events=tuple(sim.events),
        world=world,
        layers=tuple(layer.name for layer in cluster.layers),
        schedule=schedule.name,
        wall_s=time.perf_counter() - t0,
        num_events=sim.count,
    )


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _split(compute: list[tuple[float, float]], comm: list[tuple[float, float]]) -> tuple[float, float, float]:
    """(compute, exposed, hidden) seconds of one rank (package docstring, *Split*)."""
    comp = sum(b - a for a, b in compute)
    cu = _union(comm)
    cp = _union(compute)
    hidden, i = 0.0, 0
    for a, b in cu:
        while i < len(cp) and cp[i][1] <= a:
            i += 1
        j = i
        while j < len(cp) and cp[j][0] < b:
            hidden += max(0.0, min(b, cp[j][1]) - max(a, cp[j][0]))
            j += 1
    total = sum(b - a for a, b in cu)
    return comp, total - hidden, hidden


def _ranges(ranks: tuple[int, ...]) -> str:
    from meshpilot.planner.schedule import _ranges as fmt

    return fmt(tuple(sorted(ranks)))
