"""Running a subcommand under ``torch.distributed.run`` so that the user sees one line per mistake, not N tracebacks.

``meshpilot train --nproc-per-node N ...`` validates everything first (in :mod:`meshpilot.cli.train`), then
calls :func:`launch`: ``python -m torch.distributed.run --standalone --nproc-per-node N -m meshpilot.cli.main
train ...`` with the same arguments. Each rank prints its own user error once (rank 0 for the checks every rank
makes alike); the launcher passes the ranks' output through, drops torchrun's own failure report (a
``ChildFailedError`` traceback and tables) when a rank has already said what went wrong, prints each distinct
error line once, and merges the ranks' collective-timeout lines into one that names the ranks that reported
the timeout and those that went silent.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

ERROR_PREFIX = "meshpilot train: error: "
TIMEOUT_RE = re.compile(r"rank (\d+): a collective timed out after ([\d.]+) s")
"""What a rank prints when its collective timed out (see ``meshpilot.cli.train``)."""
TIMEOUT_EXIT = 124


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
    seen: set[str] = set()
    timeouts: dict[int, str] = {}
    failed = False
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith(prefix):
            failed = True
            m = TIMEOUT_RE.search(line)
            if m:
                timeouts[int(m.group(1))] = m.group(2)
            elif line not in seen:
                seen.add(line)
                sys.stderr.write(line)
                sys.stderr.flush()
        elif not failed and not _torchrun_noise(line):
            sys.stderr.write(line)
            sys.stderr.flush()
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
    return rc


def _torchrun_noise(line: str) -> bool:
    """torchrun's own log lines (``W0612 10:00:00.123 …``) and its banner of asterisks."""
    return bool(re.match(r"^[WIEF]\d{4} \d\d:\d\d:\d\d", line)) or line.startswith("*****")


__all__ = ["launch"]
