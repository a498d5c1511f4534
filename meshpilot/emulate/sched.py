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
run and puts back the value it found. It is a machine-wide setting (other programs running meanwhile are
scheduled without autogroup too), so runs that overlap share it: a state file next to the knob's owner
(:data:`STATE`, guarded by ``flock``) holds the value first found and the runs holding it; the last run to
end (or the first to start after every holder died) restores it. ``meshpilot emulate --keep-autogroup``
leaves it alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")
STATE = Path("/run/meshpilot-autogroup.json")
"""``{"found": <value before the first run>, "holders": ["<pid>:<token>", ...]}`` while some run holds it."""


def _alive(holder: str) -> bool:
    """Whether the process of a ``"<pid>:<token>"`` holder still runs (one of another user's counts)."""
    try:
        os.kill(int(holder.split(":")[0]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@contextmanager
def _locked(state: Path) -> Iterator[dict]:
    """The state (empty when none, or every holder is gone) under an exclusive lock; written back on exit,
    removed when it has no holders."""
    state.parent.mkdir(parents=True, exist_ok=True)
    with open(state.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(state.read_text()) if state.exists() else {}
        data["holders"] = [h for h in data.get("holders", []) if _alive(h)]
        yield data
        if data.get("holders"):
            state.write_text(json.dumps(data))
        else:
            state.unlink(missing_ok=True)


@contextmanager
def flat_scheduler(
    *,
    keep: bool = False,
    dry_run: bool = False,
    echo: Callable[[str], None] | None = None,
    path: Path = AUTOGROUP,
    state: Path = STATE,
) -> Iterator[bool]:
    """Turn the kernel's autogroup off while the body runs and restore the value found when the last
    overlapping run ends; yields whether autogroup is off because of a run (this one or another). A kernel
    without autogroup (no `path`), `keep`, or a 0 that no run set change nothing. With `dry_run` the write is
    only passed to `echo`."""
    if keep or not path.exists():
        yield False
        return
    if dry_run:
        found = path.read_text().strip()
        if echo is not None and found != "0":
            echo(f"echo 0 > {path}   # restored to {found} at the end (see meshpilot.emulate.sched)")
        yield False
        return
    me = f"{os.getpid()}:{uuid.uuid4().hex[:8]}"
    with _locked(state) as data:
        # the first run reads the knob; the others (and a run after holders that died) keep what it found
        data.setdefault("found", path.read_text().strip())
        held = data["found"] != "0"
        if held:
            data["holders"].append(me)
            path.write_text("0\n")
    if not held:
        yield False
        return
    try:
        yield True
    finally:
        with _locked(state) as data:
            data["holders"] = [h for h in data["holders"] if h != me]
            if not data["holders"]:
                path.write_text(data["found"] + "\n")
