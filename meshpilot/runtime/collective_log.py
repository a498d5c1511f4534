"""A process-local recorder of the collectives that meshpilot's runtimes issue.

Every meshpilot collective wrapper calls :func:`record` right before it issues a collective on
a group of more than one rank. Nothing is stored unless a recorder is open::

    with record_collectives() as log:
        loss = model(idx, targets)
        loss.backward()
    for (op, axis, phase), stat in log.summary().items():
        print(op, axis, phase, stat.count, stat.nbytes)

Each entry is a :class:`CollectiveRecord` ``(op, mesh_axis, group_size, nbytes, phase)``:

- ``op``: one of :data:`OPS`.
- ``mesh_axis``: the name of the mesh dimension the group spans (e.g. ``"atp0"``, ``"dp"``).
- ``group_size``: ranks in the group.
- ``nbytes``: the size of the *full* buffer of the collective, the ``M`` of the usual cost
  models: the reduced buffer for ``all_reduce``; the gathered output for ``all_gather``; the
  un-reduced input for ``reduce_scatter``; the input for ``all_to_all``; the broadcast buffer;
  the message for ``send``/``recv``.
- ``phase``: ``"forward"`` or ``"backward"``. Wrappers may pass it; if they don't it is
  ``"backward"`` while the autograd engine runs a backward pass and ``"forward"`` otherwise.
  :func:`phase_scope` forces it for work outside autograd (e.g. data-parallel gradient sync).

:func:`ring_bytes` turns an entry into the bytes one rank sends under the ring algorithms
(``2(n-1)/n * M`` for all-reduce, ``(n-1)/n * M`` for all-gather, reduce-scatter and
all-to-all, ``M`` for broadcast/send/recv), so ``sum(ring_bytes) / link bandwidth`` is the
bandwidth term of the communication time.

The recorder is global to the process (not thread-local) and guarded by a lock, so entries made
by autograd's worker threads are caught too. Recorders nest: every open recorder gets every
entry. ``torch.distributed.tensor.debug.CommDebugMode`` also sees the collectives of meshpilot's
ATP runtime, since they are issued as ``c10d`` ops; it counts calls only (no axis, bytes or phase).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import NamedTuple

import torch

from meshpilot.sharding.reshard import CollectiveKind

__all__ = [
    "OPS",
    "PHASES",
    "CollectiveLog",
    "CollectiveRecord",
    "CollectiveStat",
    "current_phase",
    "phase_scope",
    "record",
    "record_collectives",
    "ring_bytes",
]

OPS = tuple(CollectiveKind)
PHASES = ("forward", "backward")


class CollectiveRecord(NamedTuple):
    """One collective as issued by one rank."""

    op: str
    """One of :data:`OPS`."""
    mesh_axis: str
    """Name of the mesh dimension (or group) the collective runs over."""
    group_size: int
    """Number of ranks in the group."""
    nbytes: int
    """Bytes of the full buffer (see the module docstring for each op)."""
    phase: str
    """``"forward"`` or ``"backward"``."""


class CollectiveStat(NamedTuple):
    """Aggregate of records: how many and how many bytes (``nbytes`` summed)."""

    count: int
    nbytes: int


def ring_bytes(entry: CollectiveRecord) -> float:
    """Bytes one rank sends for ``entry`` under ring algorithms (0 for a group of one)."""
    n = entry.group_size
    if n <= 1:
        return 0.0
    if entry.op == CollectiveKind.ALL_REDUCE:
        return 2.0 * (n - 1) / n * entry.nbytes
    if entry.op in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        return (n - 1) / n * entry.nbytes
    return float(entry.nbytes)


class CollectiveLog:
    """The entries recorded while a :func:`record_collectives` block was open."""

    def __init__(self) -> None:
        self.entries: list[CollectiveRecord] = []

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[CollectiveRecord]:
        return iter(list(self.entries))

    def filter(
        self,
        op: str | None = None,
        mesh_axis: str | None = None,
        phase: str | None = None,
    ) -> list[CollectiveRecord]:
        """Entries matching every given field."""
        return [
            e
            for e in self.entries
            if (op is None or e.op == op)
            and (mesh_axis is None or e.mesh_axis == mesh_axis)
            and (phase is None or e.phase == phase)
        ]

    def summary(self) -> dict[tuple[str, str, str], CollectiveStat]:
        """Count and summed ``nbytes`` per ``(op, mesh_axis, phase)``, in first-seen order."""
        out: dict[tuple[str, str, str], CollectiveStat] = {}
        for e in self.entries:
            key = (e.op, e.mesh_axis, e.phase)
            c, b = out.get(key, (0, 0))
            out[key] = CollectiveStat(c + 1, b + e.nbytes)
        return out

    def axes(self) -> set[str]:
        """Mesh axes that saw at least one collective."""
        return {e.mesh_axis for e in self.entries}

    def format(self) -> str:
        """A small fixed-width table of :meth:`summary`."""
        lines = [f"{'op':<15}{'axis':<10}{'phase':<10}{'count':>7}{'bytes':>14}"]
        for (op, axis, phase), st in self.summary().items():
            lines.append(f"{op:<15}{axis:<10}{phase:<10}{st.count:>7}{st.nbytes:>14}")
        return "\n".join(lines)


_lock = threading.Lock()
_active: list[CollectiveLog] = []
_forced_phase: list[str] = []


def current_phase() -> str:
    """``"backward"`` inside an autograd backward pass (or a forced scope), else ``"forward"``."""
    if _forced_phase:
        return _forced_phase[-1]
    return "backward" if torch._C._current_graph_task_id() != -1 else "forward"


@contextlib.contextmanager
def phase_scope(phase: str) -> Iterator[None]:
    """Tag collectives recorded inside the block with ``phase`` (one of :data:`PHASES`)."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r} is not one of {PHASES}")
    _forced_phase.append(phase)
    try:
        yield
    finally:
        _forced_phase.pop()


def record(op: str, mesh_axis: str, group_size: int, nbytes: int, phase: str | None = None) -> None:
    """Report one collective to every open recorder (cheap no-op when none is open)."""
    if not _active:
        return
    if op not in OPS:
        raise ValueError(f"op={op!r} is not one of {OPS}")
    entry = CollectiveRecord(op, mesh_axis, int(group_size), int(nbytes), phase or current_phase())
    with _lock:
        for log in _active:
            log.entries.append(entry)


@contextlib.contextmanager
def record_collectives() -> Iterator[CollectiveLog]:
    """Record every collective reported through :func:`record` while the block runs."""
    log = CollectiveLog()
    with _lock:
        _active.append(log)
    try:
        yield log
    finally:
        with _lock:
            _active.remove(log)
