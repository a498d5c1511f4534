"""User-facing errors.

A :class:`UserError` is a mistake in what the user gave us (a cluster file, a model name, a mesh shape).
The CLI prints its one-line message and exits with code 2, never a traceback. Library callers catch it
like any other exception.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in user input: the message says what is wrong, where, and how to fix it."""

    exit_code = 2


class ClusterFileError(UserError):
    """A cluster file or preset that does not describe a valid cluster."""

    def __init__(self, source: str, key: str, problem: str, fix: str):
        self.source, self.key, self.problem, self.fix = source, key, problem, fix
        super().__init__(f"{source}: {key}: {problem}; {fix}")


def first_line(e: BaseException, default: str = "") -> str:
    """The first line of `e`'s message (`default` when it has none): an error of someone else's code, told in
    one line."""
    text = str(e).strip()
    return text.splitlines()[0] if text else default
