"""The one recorder of the collectives meshpilot's runtimes issue, and its one record type.

Both runtimes feed it:

- the ATP runtime (:mod:`meshpilot.runtime.atp.comm`) calls :func:`record` right before every collective it
  issues on a group of more than one rank, naming the mesh axis (``atp0``, ``atp1``, ``dp``);
- the DTensor runtime (:mod:`meshpilot.runtime.spmd`) lets DTensor issue functional collectives
  (``_c10d_functional`` ops); ``record_collectives(mesh)`` intercepts them with a ``TorchDispatchMode`` and
  names each by the axis of `mesh` whose process group it runs on (on a mesh from ``mesh_for_plan``: the
  plan's ``mesh_axes``; on a mesh without names: ``axis0``, ``axis1``, ...).

Nothing is stored unless a recorder is open::

    with record_collectives(pm.mesh) as log:     # record_collectives() when only the ATP runtime runs
        loss = pm(*inputs)
        loss.backward()
    print(log.format())
    assert log.counts() == plan.collective_counts(backend="gloo")

Each entry is a :class:`CollectiveRecord`: the ``CollectiveKind``, the mesh axis's name, the group size, the
bytes (counted as ``CollectiveKind``'s docstring says for every kind: the cost model's ``M``) and the
``Phase`` (``FWD`` or ``BWD``). The phase is the innermost :func:`phase_scope`'s (the DTensor runtime scopes
every action of its schedule, ATP's data-parallel gradient sync scopes itself), else ``BWD`` while autograd
runs a backward pass and ``FWD`` otherwise.

Recorders are global to the process (not thread-local) and guarded by a lock, so entries made by autograd's
worker threads are caught too. They nest: every open recorder gets every entry; DTensor's collectives are
seen while at least one recorder given a mesh is open (the innermost such one names them).
``torch.distributed.tensor.debug.CommDebugMode`` also sees the ATP runtime's collectives (plain ``c10d``
ops); it counts calls only (no axis, bytes or phase).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from meshpilot import compat
from meshpilot.cluster.mesh import default_axis_names
from meshpilot.graph.capture import Phase
from meshpilot.sharding.reshard import CollectiveKind

__all__ = [
    "UNKNOWN_AXIS",
    "CollectiveLog",
    "CollectiveRecord",
    "CollectiveStat",
    "current_phase",
    "phase_scope",
    "record",
    "record_collectives",
    "unrecorded",
]

UNKNOWN_AXIS = "unknown"
"""The axis of a functional collective on a process group that is no axis of the recorder's mesh."""


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as issued by one rank."""

    kind: CollectiveKind
    axis: str
    """The name of the mesh axis the group spans."""
    group_size: int
    """Ranks in the group."""
    nbytes: int
    """The full buffer, as ``CollectiveKind`` counts it (all-gather: the gathered output, ...)."""
    phase: Phase
    """``Phase.FWD`` or ``Phase.BWD``."""

    def ring_bytes(self) -> float:
        """Bytes one rank sends under the ring algorithms (0 for a group of one): ``2(n-1)/n * M`` for an
        all-reduce, ``(n-1)/n * M`` for an all-gather, reduce-scatter or all-to-all, ``M`` otherwise; so
        ``sum(ring_bytes) / link bandwidth`` is the bandwidth term of the communication time."""
        n = self.group_size
        if n <= 1:
            return 0.0
        if self.kind == CollectiveKind.ALL_REDUCE:
            return 2.0 * (n - 1) / n * self.nbytes
        if self.kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
            return (n - 1) / n * self.nbytes
        return float(self.nbytes)


@dataclass(frozen=True)
class CollectiveStat:
    """Records added up: how many, and their bytes summed."""

    count: int
    nbytes: int


class CollectiveLog:
    """The entries recorded while a :func:`record_collectives` block was open."""

    def __init__(self) -> None:
        self.entries: list[CollectiveRecord] = []

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[CollectiveRecord]:
        return iter(list(self.entries))

    def filter(
        self, kind: CollectiveKind | None = None, axis: str | None = None, phase: Phase | None = None
    ) -> list[CollectiveRecord]:
        """Entries matching every given field."""
        return [
            e
            for e in self.entries
            if (kind is None or e.kind == kind)
            and (axis is None or e.axis == axis)
            and (phase is None or e.phase == phase)
        ]

    def counts(self, phase: Phase | None = None) -> Counter[tuple[CollectiveKind, str, int]]:
        """How often each (kind, axis, nbytes) was issued, optionally in one phase: the keys of
        ``Plan.collective_counts()``, so a run compares with its plan."""
        return Counter((e.kind, e.axis, e.nbytes) for e in self.filter(phase=phase))

    def summary(self) -> dict[tuple[CollectiveKind, str, Phase], CollectiveStat]:
        """Count and summed bytes per (kind, axis, phase), in first-seen order."""
        out: dict[tuple[CollectiveKind, str, Phase], CollectiveStat] = {}
        for e in self.entries:
            key = (e.kind, e.axis, e.phase)
            st = out.get(key, CollectiveStat(0, 0))
            out[key] = CollectiveStat(st.count + 1, st.nbytes + e.nbytes)
        return out

    def format(self) -> str:
        """:meth:`summary` as a small fixed-width table."""
        lines = [f"{'kind':<15}{'axis':<10}{'phase':<7}{'count':>7}{'bytes':>14}"]
        for (kind, axis, phase), st in self.summary().items():
            lines.append(f"{kind:<15}{axis:<10}{phase:<7}{st.count:>7}{st.nbytes:>14}")
        return "\n".join(lines)


_lock = threading.Lock()
_active: list[CollectiveLog] = []
_forced_phase: list[Phase] = []
_paused = [0]


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Collectives issued inside the block are not recorded: a recorded program's trial run that the step
    runs again as the program (``runtime.program``: a program whose gathers a pass regrouped)."""
    _paused[0] += 1
    try:
        yield
    finally:
        _paused[0] -= 1


def current_phase() -> Phase:
    """The innermost :func:`phase_scope`'s phase; else ``BWD`` inside an autograd backward pass, ``FWD`` outside."""
    if _forced_phase:
        return _forced_phase[-1]
    return Phase.BWD if torch._C._current_graph_task_id() != -1 else Phase.FWD


@contextlib.contextmanager
def phase_scope(phase: Phase | str) -> Iterator[None]:
    """Tag the collectives recorded inside the block with `phase` (``fwd`` or ``bwd``)."""
    phase = Phase(phase)
    if phase not in (Phase.FWD, Phase.BWD):
        raise ValueError(f"phase={phase!r}: a collective runs in the forward ('fwd') or the backward ('bwd')")
    _forced_phase.append(phase)
    try:
        yield
    finally:
        _forced_phase.pop()


def record(
    kind: CollectiveKind | str, axis: str, group_size: int, nbytes: int, phase: Phase | str | None = None
) -> None:
    """Report one collective to every open recorder (a cheap no-op when none is open)."""
    if not _active or _paused[0]:
        return
    entry = CollectiveRecord(
        CollectiveKind(kind), axis, int(group_size), int(nbytes), Phase(phase) if phase else current_phase()
    )
    with _lock:
        for log in _active:
            log.entries.append(entry)


# The functional collectives DTensor issues, by op name (``_c10d_functional.<name>.default``).
_FUNCTIONAL_KINDS = {
    "all_reduce": CollectiveKind.ALL_REDUCE,
    "all_reduce_": CollectiveKind.ALL_REDUCE,  # in place (runtime.buckets)
    "all_gather_into_tensor": CollectiveKind.ALL_GATHER,
    "reduce_scatter_tensor": CollectiveKind.REDUCE_SCATTER,
    "all_to_all_single": CollectiveKind.ALL_TO_ALL,
    "broadcast": CollectiveKind.BROADCAST,
    "all_reduce_coalesced": CollectiveKind.ALL_REDUCE,
    "all_gather_into_tensor_coalesced": CollectiveKind.ALL_GATHER,
    "reduce_scatter_tensor_coalesced": CollectiveKind.REDUCE_SCATTER,
}

# Set while a recorder's dispatch mode runs a collective it recorded: the modes of outer recorders, which the
# collective reaches next, leave it alone (it is recorded once, into every open log).
_handling = threading.local()


class _FunctionalCollectives(TorchDispatchMode):
    """Reports every functional collective to :func:`record`, named by the axis of `mesh` it runs over."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        names = mesh.mesh_dim_names or default_axis_names(mesh.ndim)
        self._by_group: dict[str, tuple[str, int]] = {}
        self._by_ranks: dict[frozenset[int], tuple[str, int]] = {}
        for a in range(mesh.ndim):
            group = mesh.get_group(a)
            self._by_group[group.group_name] = (names[a], mesh.size(a))
            self._by_ranks[frozenset(dist.get_process_group_ranks(group))] = (names[a], mesh.size(a))

    def _axis(self, group_name: str) -> tuple[str, int]:
        """(name, size) of the axis whose process group is `group_name`."""
        axis = self._by_group.get(group_name)
        if axis is None:
            # DTensor's sharding cache hashes meshes by shape, ranks and names, so a value may carry an equal mesh
            # built earlier with other process groups: an axis is also recognised by its ranks
            try:
                ranks = frozenset(dist.get_process_group_ranks(compat.resolve_process_group()(group_name)))
            except Exception:  # noqa: BLE001 - a group torch cannot resolve: an unknown axis
                ranks = frozenset()
            axis = self._by_group[group_name] = self._by_ranks.get(ranks, (UNKNOWN_AXIS, len(ranks) or 1))
        return axis

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        functional = getattr(func, "namespace", "") == "_c10d_functional"
        kind = _FUNCTIONAL_KINDS.get(getattr(func, "__name__", "").split(".")[0]) if functional else None
        if kind is None or getattr(_handling, "active", False):
            return func(*args, **kwargs)
        group = args[-1] if isinstance(args[-1], str) else kwargs["group_name"]
        axis, size = self._axis(group)
        for t in args[0] if isinstance(args[0], list | tuple) else [args[0]]:  # the coalesced ops take a list
            nbytes = t.numel() * t.element_size()
            record(kind, axis, size, nbytes * size if kind == CollectiveKind.ALL_GATHER else nbytes)
        _handling.active = True
        try:
            return func(*args, **kwargs)
        finally:
            _handling.active = False


@contextlib.contextmanager
def record_collectives(mesh: DeviceMesh | None = None) -> Iterator[CollectiveLog]:
    """Record every collective reported to :func:`record` while the block runs; with `mesh`, also every
    functional collective DTensor issues (module docstring)."""
    log = CollectiveLog()
    with _lock:
        _active.append(log)
    try:
        with _FunctionalCollectives(mesh) if mesh is not None else contextlib.nullcontext():
            yield log
    finally:
        with _lock:
            _active.remove(log)
