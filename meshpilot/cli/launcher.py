"""Running a subcommand under ``torch.distributed.run`` so that the user sees one line per mistake, not N tracebacks.

``meshpilot train --nproc-per-node N ...`` validates everything first (in :mod:`meshpilot.cli.train`), then
calls :func:`launch`: ``python -m torch.distributed.run --standalone --nproc-per-node N -m meshpilot.cli.main
train ...`` with the same arguments. Each rank prints its own user error once (rank 0 for the checks every rank
makes alike); the launcher passes the ranks' output through, drops torchrun's own failure report (a
``ChildFailedError`` traceback and tables) when a rank has already said what went wrong, prints each distinct
error line once, and merges the ranks' collective-timeout lines into one that names the ranks that reported
the timeout and those that went silent. SIGTERM sent to the launcher is passed on to torchrun (which passes it
to the ranks: ``train --checkpoint-dir`` saves, prints one ``stopped:`` line and exits 143).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

ERROR_PREFIX = "meshpilot train: error: "
TIMEOUT_RE = re.compile(r"rank (\d+): a collective timed out after ([\d.]+) s")
"""What a rank prints when its collective timed out (see ``meshpilot.cli.train``)."""
TIMEOUT_EXIT = 124
STOPPED_EXIT = 143


def launch(argv: list[str], nproc: int, command: str = "train") -> int:
    """Run ``meshpilot <argv>`` on `nproc` local processes; returns the exit code (2 for a user error)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "meshpilot.cli.main",
        *argv,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", MESHPILOT_LAUNCHED="1")  # cli.train.LAUNCHED_ENV
    env.setdefault("OMP_NUM_THREADS", "1")
    prefix = f"meshpilot {command}: error: "
    stopped_prefix = f"meshpilot {command}: stopped: "
    seen: set[str] = set()
    timeouts: dict[int, str] = {}
    failed = stopped = False
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stderr is not None
    with _forward_sigterm(proc):
        for line in proc.stderr:
            if line.startswith(stopped_prefix):
                stopped = True
                if line not in seen:
                    seen.add(line)
                    sys.stderr.write(line)
                    sys.stderr.flush()
                continue
            failed = _pass_line(line, prefix, failed or stopped, seen, timeouts) or failed
        rc = proc.wait()
    if timeouts:
        reported = sorted(timeouts)
        silent = [r for r in range(nproc) if r not in timeouts]
        after = next(iter(timeouts.values()))
        who = f"; rank(s) {', '.join(map(str, silent))} went silent" if silent else ""
        sys.stderr.write(
            f"{prefix}a collective timed out after {after} s on rank(s) {', '.join(map(str, reported))}{who}; "
            "look at what the silent rank was doing (a hang, a crash, a slow step) or raise --timeout\n"
        )
        return TIMEOUT_EXIT
    if failed:
        return 2
    if stopped:
        return STOPPED_EXIT
    return rc


def _pass_line(line: str, prefix: str, quiet: bool, seen: set[str], timeouts: dict[int, str]) -> bool:
    """Show one line of the ranks' stderr (errors once each, timeouts kept for the merged line; other lines
    unless `quiet`: a rank has said what ended the run); returns whether it is an error line."""
    if line.startswith(prefix):
        m = TIMEOUT_RE.search(line)
        if m:
            timeouts[int(m.group(1))] = m.group(2)
        elif line not in seen:
            seen.add(line)
            sys.stderr.write(line)
            sys.stderr.flush()
        return True
    if not quiet and not _torchrun_noise(line):
        sys.stderr.write(line)
        sys.stderr.flush()
    return False


@contextlib.contextmanager
def _forward_sigterm(proc: subprocess.Popen):
    """While torchrun runs, SIGTERM to this process is sent on to it (it stops the ranks its own way)."""
    try:
        old = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _torchrun_noise(line: str) -> bool:
    """torchrun's own log lines (``W0612 10:00:00.123 …``), its banner of asterisks, and c10d's warnings that
    a rendezvous store's socket poll timed out (``[rank0]:[W1125 …] socket.cpp:469] … likely a timeout``: a
    rank waiting at a new process group for a silent one; the timeout line that follows says so)."""
    return (
        bool(re.match(r"^[WIEF]\d{4} \d\d:\d\d:\d\d", line))
        or line.startswith("*****")
        or bool(re.match(r"^(\[rank\d+\]:)?\[W\d{4} [\d:.]+ socket\.cpp:\d+\]", line))
    )


__all__ = ["launch"]
