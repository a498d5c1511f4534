"""The CPU scheduler as the emulated ranks see it: one run queue for every rank, not one group per rank.

torchrun starts each rank in its own session (``start_new_session``), and with the kernel's *autogroup*
(``kernel.sched_autogroup_enabled = 1``, the default on desktop and VM kernels) every session is one
scheduling entity: the CPU is shared fairly between *ranks*, and inside a rank between its threads. A
rank whose main thread computes is then always runnable, so when one of its gloo threads wakes for the
next step of a collective (a packet arrived) it waits until its rank's turn comes round — with 8 ranks on
2 cores, tens of milliseconds per wake, a dozen wakes per all-reduce. Measured here (2 vCPUs, kernel
6.18, 8 ranks, torchrun without namespaces; docs/benchmarks.md, *The contention was the scheduler's*): a
64 KiB all-reduce issued asynchronously while every rank runs matmuls took 275 ms with autogroup on, 60
ms with it off, against 20 ms with the ranks idle; busy processes *outside* the ranks did not slow it at
all, and lowering the computing thread's priority (nice 10, even ``SCHED_IDLE``) changed nothing with
autogroup on, since the group, not the thread, waits for the CPU.

On a real cluster a rank's communication does not queue behind other ranks' compute (each has its own
cores, its own GPU streams), so :func:`flat_scheduler` turns autogroup off for the length of an emulated
run and puts back the value it found. It is a machine-wide setting: other programs running meanwhile are
scheduled without autogroup too (their fairness per session is what is lost), and two overlapping runs
restore in the order they end. ``meshpilot emulate --keep-autogroup`` leaves it alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


@contextmanager
def flat_scheduler(
    *, keep: bool = False, dry_run: bool = False, echo: Callable[[str], None] | None = None, path: Path = AUTOGROUP
) -> Iterator[bool]:
    """Turn the kernel's autogroup off while the body runs and restore the value found; yields whether it
    changed anything. A kernel without autogroup (no `path`), `keep`, or a value already 0 change nothing.
    With `dry_run` the write is only passed to `echo`."""
    if keep or not path.exists():
        yield False
        return
    found = path.read_text().strip()
    if found == "0":
        yield False
        return
    if dry_run:
        if echo is not None:
            echo(f"echo 0 > {path}   # restored to {found} at the end (see meshpilot.emulate.sched)")
        yield False
        return
    path.write_text("0\n")
    try:
        yield True
    finally:
        path.write_text(found + "\n")
