"""Planning with the objects it keeps out of CPython's full collections: :func:`spared_from_collection`.

CPython's cyclic collector walks every object a collection covers. A full (generation 2) collection covers
every tracked object of the process, and one runs whenever the objects that survived the younger generations
since the last one reach a quarter of the long-lived ones. Planning makes ~10⁵ objects (the trace, the graph,
DTensor's strategies), so it triggers a few of them, and each walks the ~2.4·10⁵ objects of the imported
modules (torch, meshpilot) and the model, which planning never frees, and then the capture's graph, which
lives to the end of the plan. On ``benchmarks/bench_capture_speed.py``'s model (32 blocks, h 4096) the three
full collections of one ``plan()`` cost ~0.5 s CPU on a quiet machine, a sixth of it, and found ~9,000 objects
to free (``docs/benchmarks.md``, issue 33 item 4).

``gc.freeze()`` moves every tracked object into the permanent generation, which no collection walks;
``gc.unfreeze()`` puts them back into the oldest generation. :func:`spared_from_collection` freezes what exists
when planning starts, hands the caller a function that freezes again (``plan`` freezes again once the graph is
captured, on leaving :func:`kept`) and unfreezes everything on leaving, error or not. Objects made after the
last freeze are collected as always. A cycle among frozen objects that becomes garbage meanwhile (the four
traced blocks' graph, once copied) is freed at the first full collection after planning: memory held a little
longer, never a different plan (the collector frees unreachable objects only). A process that froze objects
itself, or runs with the collector disabled, is left as it is: nothing is frozen and nothing unfrozen.

Young collections: a generation-0 collection runs every :data:`YOUNG` (CPython: 700) allocations net of
frees and walks the young objects; those that survive (most of planning's: the graph lives to the end) move to
generation 1 and are walked again there, and the survivors of 10 of those count towards the next full one.
Inside the block the threshold is :data:`YOUNG` (restored on leaving): on the benchmark's cold ``plan()``
(imports inside it) the collector's CPU went from 0.43–0.53 s (500 young, 44 middle and 3 full collections)
to 0.22–0.30 s (54, 3, none), measured with ``gc.callbacks`` (``docs/benchmarks.md``, issue 33 item 4, cap33f).

The capture: ``plan`` captures the model inside :func:`kept`, where no young collection runs at all, and
freezes what survived right after it. Of a cold ``plan()``'s ~50 young collections on the benchmark ~40 ran
inside the capture (imports, the trace, the graph), walking objects that nearly all survive it — the imported
modules, the graph — and are frozen after it anyway: 0.06–0.10 s of CPU, now none (issue 33 item 4, cap33g).
What the capture leaves as unreachable cycles is frozen with the rest and freed at the first full collection
after planning, as the traced blocks' graph already was (+8 MB peak RSS on the benchmark, 396 MB against 388).

Where: ``auto.plan`` (one mesh's plan) and ``pipeline.plan_pipeline`` (the stage tables; the CLI's pipeline
path goes through it). A block inside an open one (``plan`` run inside ``plan_pipeline``) freezes and
unfreezes nothing on its own, and its :func:`freeze_more` freezes for the outer block.

Forked workers (``planner.parallel``): a child starts with its parent's objects and the collector's counters,
so a parent close to its next full collection hands one to every worker it forks, and each walked the
3.8–4.6·10⁵ objects it shares with the parent (0.16–0.24 s CPU each, on ``bench_alpa_table --tables`` at
GPT-3 1.3B/2.6B; every page holding an object it touched is then copied, the fork's sharing lost).
``map_columns`` calls :func:`freeze_more` just before it forks — CPython's own advice for ``gc.freeze`` —
so a worker starts with everything its parent held frozen and its collections walk only what it makes; it
never unfreezes (it ends with the pool). Measured, the workers' full collections: 0.84 s of the rows' 9.7 CPU s
(parent and workers) before, 0.05 s after; on the exact tables 2.06 s of 35 s before, 0.18 s after
(``docs/benchmarks.md``, issue 29 item 6).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

YOUNG = 7000
"""Generation 0's collection threshold inside a :func:`spared_from_collection` block (module docstring)."""

CAPTURE = 1_000_000_000
"""Generation 0's collection threshold inside :func:`kept`: no young collection (module docstring)."""

_OWNED = False
"""Whether a :func:`spared_from_collection` block that froze the objects is open in this process."""


def freeze_more() -> None:
    """Freeze the objects made since the last freeze, inside a :func:`spared_from_collection` block that froze
    them on entry; a no-op elsewhere (the process' own freeze, or a collector disabled, left alone)."""
    if _OWNED:
        gc.freeze()


@contextlib.contextmanager
def spared_from_collection() -> Iterator[Callable[[], None]]:
    """Freeze the process's objects for the block and collect the young ones every :data:`YOUNG` allocations
    (module docstring); yields :func:`freeze_more`. A block inside another (``plan_pipeline`` planning a stage
    with ``plan``) freezes and unfreezes nothing."""
    global _OWNED
    own = gc.isenabled() and gc.get_freeze_count() == 0 and not _OWNED
    if not own:
        yield freeze_more
        return
    gc.freeze()
    threshold = gc.get_threshold()
    gc.set_threshold(max(threshold[0], YOUNG), *threshold[1:])
    _OWNED = True
    try:
        yield freeze_more
    finally:
        _OWNED = False
        gc.set_threshold(*threshold)
        gc.unfreeze()


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Inside a :func:`spared_from_collection` block that froze the objects on entry: no young collection while
    this block runs, and what exists when it ends frozen (:func:`freeze_more`), error or not (module docstring,
    "The capture"); a plain block elsewhere."""
    if not _OWNED:
        yield
        return
    threshold = gc.get_threshold()
    gc.set_threshold(CAPTURE, *threshold[1:])
    try:
        yield
    finally:
        gc.freeze()  # first: it empties generation 0, which the restored threshold would collect at once
        gc.set_threshold(*threshold)
