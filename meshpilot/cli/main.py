"""The `meshpilot` command: one subcommand per module in this package, each with `--help`.

Only the command given is imported (its module's ``register`` adds its options): `plan`, `train` and `atp`
import torch (≈3.5 s of CPU), which `meshpilot --help`, `presets`, `topology`, `simulate` and the launchers do not
need. The other commands are listed by name and :data:`COMMANDS`' one line.

User mistakes (:class:`~meshpilot.errors.UserError`) print one line to stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from meshpilot.errors import UserError

COMMANDS = {
    "presets": "list built-in clusters, device kinds and models",
    "topology": "show a cluster's communication hierarchy and the bandwidth of every 2D mesh",
    "atp": "choose the 2D tensor-parallel mesh with the least all-reduce time (ATP)",
    "plan": "plan a model's sharding and stages (per-operator ILP, stage DP) and show or save it",
    "simulate": "simulate a saved plan's step (overlap, shared links, stragglers) and show its time split",
    "train": "train a few steps: any model with a saved --plan, or a built-in GPT with ATP on --mesh",
    "probe": "measure the live cluster (run under torchrun) and write a cluster TOML",
    "emulate": "run CMD's ranks as a multi-node cluster on this machine (network namespaces shaped by tc)",
    "demo": "the tour: topology, ATP's mesh choice, a plan for a GPT, real 4-process training with it",
}
"""Each command's module (``meshpilot.cli.<name>``) and its one line in `meshpilot --help`. The module defines
``register(subparsers)``, adding its parser (``help=COMMANDS[name]``) with ``func`` set to its entry point."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line on stderr (what is wrong, then where the help is), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `argv`'s command (the first word that is not an option) with all its options; every other
    command listed by name and one line (module docstring). Without `argv`: every command's options."""
    chosen = set(COMMANDS) if argv is None else {next((a for a in argv if not a.startswith("-")), "")}
    parser = OneLineParser(
        prog="meshpilot",
        description=(
            "Plan and run distributed training of PyTorch models: choose, for every operator, how to split it "
            "over a cluster's devices, knowing the cluster's interconnect."
        ),
        epilog="Run `meshpilot <command> --help` for each command's options. Start with `meshpilot demo`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, line in COMMANDS.items():
        if name in chosen:
            importlib.import_module(f"meshpilot.cli.{name}").register(sub)
        else:
            sub.add_parser(name, help=line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # what a launcher passes on to its ranks
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
