"""The `meshpilot` command: one subcommand per module in this package, each with `--help`.

User mistakes (:class:`~meshpilot.errors.UserError`) print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from meshpilot.errors import UserError

# Each module defines `register(subparsers)`, adding its parser with `func` set to its entry point.
COMMANDS = ["presets", "topology", "atp", "plan", "simulate", "train", "probe", "emulate", "demo"]


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line on stderr (what is wrong, then where the help is), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="meshpilot",
        description=(
            "Plan and run distributed training of PyTorch models: choose, for every operator, how to split it "
            "over a cluster's devices, knowing the cluster's interconnect."
        ),
        epilog="Run `meshpilot <command> --help` for each command's options. Start with `meshpilot demo`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"meshpilot.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"meshpilot.cli.{name}":
                continue  # command not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a launcher passes on to its ranks
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        one_line = " ".join(str(e).split())  # a message quoting a library's multi-line error stays one line
        print(f"meshpilot {args.command}: error: {one_line}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(f"meshpilot {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
