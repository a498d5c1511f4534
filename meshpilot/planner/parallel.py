"""The pipeline planner's stage searches spread over forked worker processes, one submesh size at a time.

The stage table (``pipeline._StageTable``, ``stack.StackTable``) is a column per submesh size d: every search
of a column runs on d devices' logical shapes, so no search of one column reads what another column's found
(the stage planner's caches are keyed by mesh shape, and the ILP problems they keep by structure and
mapping). The columns are therefore computed in any order, and here in worker processes, with the same
results as one after the other — what Alpa does with its stage profiling across a Ray cluster, on one
machine's cores. HiGHS solves one problem on one core, so this is where planning gets more than one.

How: the workers are forked (Linux; elsewhere, and with one worker, the columns run here), so they start
with the planner as it is — its caches, the captured graph — and nothing is pickled going out. Each task
is one column; it returns its result and the stage costs it searched (``StagePlanner.exported``), which
this process merges (``StagePlanner.merge``): the chosen stages are then read from the cache, exactly as
the serial run would read them. A worker keeps its caches across the columns it takes.

One task may also start alone (:func:`start_task`): a forked process of its own, begun before other work that
this process then does (and maps over the remaining workers), its result and searches merged when it is read —
the estimated stage table's server column's cap levels, its longest serial piece, beside the catalogue and the
other columns (``stack`` module docstring, 5).

While this process waits for a started task (:meth:`Started.result`) it first runs the jobs given to
:func:`while_waiting` — work the caller needs after the planning that does not depend on it (``meshpilot plan``
captures the whole model for ``Plan.with_intra`` there: GPT-39B's table waits ~2.5 s for the server column's cap
levels after its catalogue and columns, on a core otherwise idle; docs/benchmarks.md, issue 29 item 6, fast29).
A job runs at most once, and not at all where nothing is started (one worker, no fork): the caller then does
the work itself, as before.

How many: ``workers`` (``plan_pipeline(workers=...)``, ``meshpilot plan --pipeline --workers``), else the environment's
``MESHPILOT_PLAN_WORKERS``, else the CPUs this process may run on, at most :data:`MAX_WORKERS`.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from meshpilot.errors import UserError
from meshpilot.planner.heap import freeze_more

_IDLE: list[Callable[[], None]] = []
"""Jobs :meth:`Started.result` runs before it blocks (:func:`while_waiting`)."""

MAX_WORKERS = 8
"""Most worker processes by default (each holds a copy of the planner's caches as they grow)."""

ENV = "MESHPILOT_PLAN_WORKERS"

_JOB: tuple[Callable[[Any], Any], Any] | None = None
"""The column function and the planner, set before the fork (the workers inherit them)."""


def plan_workers(workers: int | None = None) -> int:
    """The worker processes to use: `workers`, else ``$MESHPILOT_PLAN_WORKERS``, else the usable CPUs (at most
    :data:`MAX_WORKERS`); a bad value is one :class:`UserError` line."""
    if workers is None:
        raw = os.environ.get(ENV)
        if raw is None:
            usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            return max(1, min(MAX_WORKERS, usable))
        try:
            workers = int(raw)
        except ValueError:
            raise UserError(f"{ENV}={raw!r}: give a whole number of planning processes, at least 1") from None
        where = ENV
    else:
        where = "workers"
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise UserError(f"{where}={workers!r}: give a whole number of planning processes, at least 1")
    return workers


def can_fork() -> bool:
    """Whether columns may run in forked workers: Linux's fork (macOS' is unsafe with system libraries,
    Windows has none), and not from a daemon process (a ``multiprocessing.Pool``'s worker may have none)."""
    return (
        sys.platform.startswith("linux")
        and "fork" in multiprocessing.get_all_start_methods()
        and not multiprocessing.current_process().daemon
    )


def map_columns(fn: Callable[[Any], Any], items: Sequence[Any], planner, workers: int) -> list[Any]:
    """``[fn(x) for x in items]``, with ``fn`` run in up to `workers` forked processes when there are several
    items, and the stage costs they searched merged into `planner` — a stage planner, or a sequence of them
    whose searches ``fn`` may all run (module docstring). The results come back in `items`' order."""
    global _JOB
    n = min(workers, len(items))
    if n <= 1 or not can_fork():
        return [fn(x) for x in items]
    planners = tuple(planner) if isinstance(planner, (list, tuple)) else (planner,)
    _JOB = (fn, planners)
    freeze_more()  # the planner and its caches as they are: no worker's full collection walks them (planner.heap)
    try:
        with multiprocessing.get_context("fork").Pool(n) as pool:
            outs = pool.map(_column, items, chunksize=1)
    finally:
        _JOB = None
    results = []
    for res, searched in outs:
        for sp, got in zip(planners, searched):
            sp.merge(got)
        results.append(res)
    return results


class Started:
    """One task running in a forked process of its own (:func:`start_task`); :meth:`result` waits for it."""

    def __init__(self, pool, pending, planners: tuple) -> None:
        self._pool, self._pending, self._planners = pool, pending, planners

    def result(self) -> Any:
        """The task's result, the stage costs it searched merged into its planners (as :func:`map_columns`); the
        :func:`while_waiting` jobs run first, while the task's process works."""
        try:
            while _IDLE:
                _IDLE.pop(0)()
            res, searched = self._pending.get()
        finally:
            self._pool.close()
            self._pool.join()
        for sp, got in zip(self._planners, searched):
            sp.merge(got)
        return res

    def abandon(self) -> None:
        """Stop the task unread (the caller failed before it needed the result)."""
        self._pool.terminate()
        self._pool.join()


@contextlib.contextmanager
def while_waiting(job: Callable[[], None]) -> Iterator[None]:
    """Within the block, `job` runs once in this process when it first waits for a started task
    (:meth:`Started.result`; module docstring); dropped unrun at the block's end if nothing waited."""
    _IDLE.append(job)
    try:
        yield
    finally:
        if job in _IDLE:
            _IDLE.remove(job)


def start_task(fn: Callable[[Any], Any], item: Any, planner) -> Started | None:
    """``fn(item)`` started in a forked process of its own, with the planner as it is now (module docstring);
    None where this process cannot fork (the caller then runs it itself)."""
    global _JOB
    if not can_fork():
        return None
    planners = tuple(planner) if isinstance(planner, (list, tuple)) else (planner,)
    _JOB = (fn, planners)
    freeze_more()
    try:
        pool = multiprocessing.get_context("fork").Pool(1)  # forks here: the worker holds this _JOB
    finally:
        _JOB = None
    return Started(pool, pool.apply_async(_column, (item,)), planners)


def _column(item: Any) -> tuple[Any, list[Any]]:
    """In a worker: one column and the stage costs it searched, per planner."""
    assert _JOB is not None
    fn, planners = _JOB
    marks = [sp.mark() for sp in planners]
    return fn(item), [sp.exported(m) for sp, m in zip(planners, marks)]
