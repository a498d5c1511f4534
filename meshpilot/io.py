"""Writing the files meshpilot produces (plans, sweeps, cluster files, loss logs): checked up front, atomic.

:func:`check_writable` is called before any expensive work for every output path a command takes
(``--out``, ``--json-out``, ``--plan-out``): a missing or read-only folder, or a path that is a folder,
is a one-line :class:`~meshpilot.errors.UserError` naming the flag, not a traceback after minutes of planning.
:func:`atomic_write` / :func:`atomic_path` write through a temporary file beside the target and a rename
(a reader never sees half a file), and give the file the mode a plain ``open(path, "w")`` would: 0666 less the
umask (``tempfile.mkstemp`` alone leaves 0600).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshpilot.errors import UserError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(path: str | Path, flag: str = "--out") -> Path:
    """The folder `path` will be written in; a UserError naming `flag` if it cannot be written there."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file name inside it, such as {path / path.name}.out")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.exists():
        raise UserError(f"{flag} {path}: folder {parent} does not exist; create it (mkdir -p) or write elsewhere")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: {parent} is not a folder; give a path inside an existing folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: folder {parent} is not writable; write elsewhere or fix its permissions")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"{flag} {path}: the file exists and is read-only; remove it or write elsewhere")
    return parent


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write (e.g. matplotlib's ``savefig``); renamed onto `path` on success,
    removed on failure. The file gets mode 0666 less the umask."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: str | bytes, *, newline: str | None = None) -> Path:
    """Write `data` to `path` atomically (temp file + fsync + rename), mode 0666 less the umask."""
    path = Path(path)
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            with open(tmp, "w", newline=newline) as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    return path


def fmt_size(b: float) -> str:
    """Bytes readably at any scale: 1.5 GiB, 3.2 MiB, 1.07 KiB, 512 B (tiny sizes never print as 0.00 GiB)."""
    b = float(b)
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= div:
            return f"{b / div:.3g} {unit}"
    return f"{b:.0f} B"


__all__ = ["fmt_size", "atomic_path", "atomic_write", "check_writable"]
