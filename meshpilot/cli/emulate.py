"""`meshpilot emulate`: run a torch.distributed command as a multi-node cluster on this one machine.

Each node of the cluster's top layer gets a Linux network namespace, a veth on a private bridge with an
address in 10.213.7.0/24, and tc shaping to the file's inter-node bandwidth (and latency, where the
kernel has sch_netem); one torchrun agent per node meets the others at a c10d rendezvous. Needs root.
"""

from __future__ import annotations

import argparse
import sys

from meshpilot.cli.common import add_cluster_arg, get_cluster, positive_float, positive_int
from meshpilot.cli.main import COMMANDS
from meshpilot.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "emulate",
        help=COMMANDS["emulate"],
        description=__doc__,
        usage="meshpilot emulate --cluster C [options] -- CMD ...\n       meshpilot emulate --cleanup [--force]",
        epilog=(
            "CMD is a script (train.py ...), `python train.py ...`, `python -m pkg.mod ...` or any executable. "
            "Example: meshpilot emulate -c examples/clusters/emulated-2x4-slow.toml -- python train.py. "
            "Exit code: 0 when every node succeeds, else the first failing node's; 2 when emulation cannot "
            "run here (not root, no netns). See docs/emulate.md."
        ),
    )
    add_cluster_arg(p, required=False)
    p.add_argument(
        "--nproc-per-node",
        type=positive_int,
        metavar="P",
        help="ranks per node (default: the cluster's devices per node, the product of its lower layers)",
    )
    p.add_argument(
        "--bw-scale",
        type=positive_float,
        default=1.0,
        metavar="F",
        help="multiply every bandwidth by F (e.g. 0.002 turns a preset's 25 GB/s into 50 MB/s); default 1",
    )
    p.add_argument("--port", type=int, default=29400, help="rendezvous port on node 0 (default 29400)")
    p.add_argument("--timeout", type=positive_float, metavar="S", help="stop every node after S seconds (exit 124)")
    p.add_argument(
        "--grace",
        type=positive_float,
        default=5.0,
        metavar="S",
        help="after one node fails, seconds the others get before they are stopped (default 5)",
    )
    p.add_argument(
        "--keep-autogroup",
        action="store_true",
        help="leave the kernel's autogroup as it is (by default it is off for the run: with it each rank is one "
        "scheduling group and its collectives wait behind other ranks' compute; docs/emulate.md)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the ip/tc/torchrun commands, run nothing")
    p.add_argument("--quiet", "-q", action="store_true", help="do not print the network plan")
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="remove namespaces and links left by earlier runs whose process is gone, then exit",
    )
    p.add_argument("--force", action="store_true", help="with --cleanup: also remove those of live runs")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after `--`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshpilot.emulate import Interrupted, cleanup_stale, run_emulated

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if args.cleanup:
        if cmd or args.cluster:
            raise UserError("--cleanup takes no --cluster and no command; run it on its own")
        removed = cleanup_stale(force=args.force)
        for item in removed:
            print(f"removed {item}")
        if not removed:
            print("nothing to clean up")
        return 0
    if args.force:
        raise UserError("--force: only goes with --cleanup; add --cleanup or drop --force")
    if not args.cluster:
        raise UserError("--cluster is missing; give a preset name or a cluster TOML file")
    if not cmd:
        raise UserError("no command to run; put it after `--`, e.g. meshpilot emulate -c C -- python train.py")
    if not args.dry_run:
        _check_command(cmd)
    cluster = get_cluster(args)
    try:
        return run_emulated(
            cluster,
            cmd,
            nproc_per_node=args.nproc_per_node,
            bw_scale=args.bw_scale,
            port=args.port,
            timeout=args.timeout,
            grace=args.grace,
            dry_run=args.dry_run,
            quiet=args.quiet,
            keep_autogroup=args.keep_autogroup,
        )
    except Interrupted as e:
        print(f"meshpilot emulate: interrupted by {e}; nodes stopped and network removed", file=sys.stderr)
        return 128 + e.signum


def _check_command(cmd: list[str]) -> None:
    """The program to run exists and is executable (found before any namespace or link is made)."""
    import os
    import shutil

    prog = cmd[0]
    if os.sep in prog:
        if os.path.isdir(prog):
            raise UserError(f"command {prog!r}: is a folder; give a program after `--`")
        if not os.path.isfile(prog):
            raise UserError(f"command {prog!r}: no such file; give an existing program after `--`")
        if not os.access(prog, os.X_OK):
            raise UserError(f"command {prog!r}: not executable; chmod +x it or run it with its interpreter")
    elif shutil.which(prog) is None:
        raise UserError(f"command {prog!r}: not found on PATH; give its full path or install it")
