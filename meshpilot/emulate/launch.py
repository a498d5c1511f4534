"""Launch a command as a multi-node torchrun job over an emulated network (see :mod:`.netns`).

One torchrun agent per node runs inside that node's namespace, all meeting at a c10d rendezvous hosted by
node 0's agent on ``<node 0 address>:<port>``. Each agent starts ``P`` ranks (P = devices per node); node
i's ranks are ``i*P .. i*P+P-1`` (the rendezvous orders agents by their ``--local-addr``, which
:mod:`.netns` numbers in node order). Ranks see, besides torchrun's usual variables:

* ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``: the node's veth, so gloo binds its address there;
* ``MESHPILOT_EMULATE_NODE``, ``MESHPILOT_EMULATE_NODES``, ``MESHPILOT_EMULATE_ADDR``,
  ``MESHPILOT_EMULATE_NETNS``: which emulated node they run on.

Each rank's output reaches the console whole-line and labelled ``[node i] [rank r]``: torchrun
redirects every rank to its own file (``--redirects 3 --log-dir``, in a directory the launcher owns and
removes) and the launcher follows those files (:class:`_RankLogs`), forwarding a line only once its newline
has arrived. Neither a shared pipe nor torchrun's own ``--tee`` is whole-line: ``print`` under
``PYTHONUNBUFFERED`` writes text and newline in two calls, and a reader at the file's end (torchrun's tee is
one) takes the text alone, so a neighbour's line lands between it and its newline.

The result is 0 when every agent exits 0; when one fails (a rank crashed), the others get `grace` seconds
to finish, are then stopped, and the result is the first failing agent's exit code (a signal N counts as
128 + N). Ctrl-C, SIGTERM and SIGHUP stop the agents, remove the network and the ranks' log files, and
raise :class:`Interrupted`.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from meshpilot.cluster import Cluster, load_cluster
from meshpilot.emulate.netns import (
    NetworkPlan,
    NodeNet,
    check_privileges,
    emulated_network,
    plan_network,
    probe_kernel,
)
from meshpilot.emulate.sched import flat_scheduler
from meshpilot.errors import UserError

DEFAULT_PORT = 29400


class Interrupted(KeyboardInterrupt):
    """The launcher got SIGINT, SIGTERM or SIGHUP; agents were stopped and the network removed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def devices_per_node(cluster: Cluster) -> int:
    """Ranks per emulated node: the product of the ranks of every layer below layer 0 (1 for one layer)."""
    return math.prod(layer.ranks for layer in cluster.layers[1:])


def torchrun_target(cmd: Sequence[str]) -> list[str]:
    """torchrun's arguments for the user's command: a script, ``-m module``, or any other executable.

    ``python script.py ...`` and ``python -m mod ...`` drop the interpreter (torchrun runs its own).
    """
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UserError("no command to run; put it after `--`, e.g. -- python train.py")
    head = Path(cmd[0]).name
    if head.startswith("python") or cmd[0] == sys.executable:
        cmd = cmd[1:]
        while cmd and cmd[0] in ("-u", "-B"):
            cmd = cmd[1:]
        if not cmd or cmd[0] == "-c":
            raise UserError("emulate runs a script or a module: `-- python train.py ...` or `-- python -m pkg.mod`")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise UserError("`-m` needs a module name, e.g. -- python -m pkg.train")
        return ["-m", *cmd[1:]]
    if cmd[0].endswith(".py"):
        return cmd
    return ["--no-python", *cmd]


def agent_env(plan: NetworkPlan, node: NodeNet, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of node `node`'s torchrun agent (inherited by its ranks)."""
    env = dict(os.environ if base is None else base)
    env.update(
        GLOO_SOCKET_IFNAME=node.ifname,
        NCCL_SOCKET_IFNAME=node.ifname,
        MESHPILOT_EMULATE_NODE=str(node.index),
        MESHPILOT_EMULATE_NODES=str(len(plan.nodes)),
        MESHPILOT_EMULATE_ADDR=node.addr,
        MESHPILOT_EMULATE_NETNS=node.netns,
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    return env


def agent_command(
    plan: NetworkPlan,
    node: NodeNet,
    target: Sequence[str],
    nproc_per_node: int,
    *,
    port: int = DEFAULT_PORT,
    run_id: str = "meshpilot",
    python: str = sys.executable,
    log_dir: str | None = None,
) -> list[str]:
    """``ip netns exec <node's namespace> python -m torch.distributed.run ...`` for one node.

    With `log_dir`, torchrun writes each rank's output to a file under ``<log_dir>/node<i>`` for the
    launcher to forward (see the module doc).
    """
    logs = ["--redirects", "3", "--log-dir", f"{log_dir}/node{node.index}"] if log_dir else []
    master = plan.nodes[0].addr
    return [
        "ip", "netns", "exec", node.netns,
        python, "-m", "torch.distributed.run",
        "--nnodes", str(len(plan.nodes)),
        "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{master}:{port}",
        "--rdzv-id", run_id,
        "--rdzv-conf", f"is_host={int(node.index == 0)},join_timeout=120",
        "--local-addr", node.addr,
        "--max-restarts", "0",
        "--monitor-interval", "0.2",
        *logs,
        *target,
    ]  # fmt: skip


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Turn SIGINT/SIGTERM/SIGHUP into :class:`Interrupted` (main thread only) and restore the handlers after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _forward(stream: IO[bytes], sink: Callable[[], IO[str]], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            out = sink()
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


class _RankLogs:
    """Follows the rank output files torchrun writes under one node's log directory
    (``<run>/attempt_<k>/<local rank>/std{out,err}.log``) and forwards each complete line as
    ``[node i] [rank r] line``; a line's text waits for its newline (the last, unended line of a file is
    forwarded by the final :meth:`poll`). Rank r = node x ranks-per-node + local rank, the order the
    rendezvous gives (module doc)."""

    def __init__(
        self, root: str, node: int, nproc: int, sinks: tuple[Callable[[], IO[str]], ...], lock: threading.Lock
    ):
        self.root, self.node, self.nproc, self.sinks, self.lock = Path(root), node, nproc, sinks, lock
        self.read: dict[Path, tuple[int, bytes]] = {}  # file -> (bytes read, unended tail)

    def poll(self, final: bool = False) -> None:
        for path in sorted(self.root.glob("*/attempt_*/*/std*.log")):
            offset, tail = self.read.get(path, (0, b""))
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            *lines, tail = (tail + data).split(b"\n")
            if final and tail:
                lines, tail = [*lines, tail], b""
            self.read[path] = (offset + len(data), tail)
            if lines:
                rank = self.node * self.nproc + int(path.parent.name)
                sink = self.sinks[0 if path.name == "stdout.log" else 1]
                text = "".join(f"[node {self.node}] [rank {rank}] {x.decode(errors='replace')}\n" for x in lines)
                with self.lock:
                    out = sink()
                    out.write(text)
                    out.flush()

    def follow(self, stop: threading.Event, interval: float = 0.1) -> None:
        """Poll every `interval` seconds until `stop` is set, then once more with the unended tails."""
        while not stop.wait(interval):
            self.poll()
        self.poll(final=True)


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM each agent's process group, then SIGKILL what is left after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        with suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
    for p in procs:
        if p.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_emulated(
    cluster: Cluster | str,
    cmd: Sequence[str],
    *,
    nproc_per_node: int | None = None,
    bw_scale: float = 1.0,
    port: int = DEFAULT_PORT,
    timeout: float | None = None,
    grace: float = 5.0,
    dry_run: bool = False,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    quiet: bool = False,
    keep_autogroup: bool = False,
) -> int:
    """Run `cmd` as a torchrun job on `cluster`'s nodes, each in its own shaped network namespace.

    `cluster` is a :class:`Cluster`, a preset name or a TOML path. `cmd` is ``["train.py", ...]``,
    ``["python", "train.py", ...]``, ``["-m", "pkg.mod", ...]`` or any executable. `nproc_per_node`
    defaults to :func:`devices_per_node`; `bw_scale` multiplies every bandwidth (presets quote GB/s that a
    CPU box cannot carry: 0.002 turns 25 GB/s into 50 MB/s). `timeout` (seconds) stops the job and
    returns 124. Unless `keep_autogroup`, the kernel's autogroup is off for the run (:mod:`.sched`: each rank
    its own scheduling group makes its collectives wait behind other ranks' compute). `stdout`/`stderr`
    receive the prefixed agent output (default: ``sys.stdout``/``sys.stderr`` at the time of writing).
    Returns the job's exit code (see the module doc); raises :class:`~meshpilot.errors.UserError` when
    emulation cannot run here and :class:`Interrupted` after a signal, in both cases with nothing left
    behind.
    """
    if isinstance(cluster, str):
        cluster = load_cluster(cluster)
    target = torchrun_target(cmd)
    nproc = devices_per_node(cluster) if nproc_per_node is None else nproc_per_node
    netem = _check_emulation(nproc, port, dry_run)
    plan = plan_network(cluster, bw_scale=bw_scale, netem=netem)
    out = (lambda: stdout) if stdout is not None else (lambda: sys.stdout)
    err = (lambda: stderr) if stderr is not None else (lambda: sys.stderr)
    run_id = f"{plan.prefix}-{time.time_ns() // 1000000}"

    def commands(log_dir: str) -> list[list[str]]:
        return [
            agent_command(plan, n, target, nproc, port=port, run_id=run_id, python=python, log_dir=log_dir)
            for n in plan.nodes
        ]

    def note(msg: str) -> None:
        print(f"meshpilot emulate: {msg}", file=err(), flush=True)

    if dry_run:
        _print_dry_run(plan, commands("<rank logs>"), out, keep_autogroup)
        return 0
    if not quiet:
        note(
            f"{cluster.name}: {len(plan.nodes)} nodes x {nproc} ranks in namespaces {plan.prefix}n*, "
            f"{plan.subnet}.0/24, bandwidths x {bw_scale:g}"
        )
        for line in plan.describe().splitlines():
            note(line)
    forwarders: list[threading.Thread] = []
    # the ranks' log files (torchrun's --tee copies) live only as long as the run
    with _signals_raise(), tempfile.TemporaryDirectory(prefix=f"{plan.prefix}-logs-") as log_dir:
        with flat_scheduler(keep=keep_autogroup) as flat, emulated_network(plan):
            if flat and not quiet:
                note("kernel autogroup off for this run (restored at the end; --keep-autogroup leaves it)")
            rc = _run_agents(
                plan,
                commands(log_dir),
                env,
                (out, err),
                forwarders,
                rank_logs=(log_dir, nproc),
                timeout=timeout,
                grace=grace,
                note=note,
            )
        # The namespaces are gone with every process that held the pipes: the forwarders drain and end.
        for t in forwarders:
            t.join(timeout=5)
    return rc


def _check_emulation(nproc: int, port: int, dry_run: bool) -> bool:
    """The arguments checked and, unless `dry_run`, this machine's right and kernel support to emulate; whether
    netem (delays) is available. Raises :class:`UserError` in one line."""
    if nproc < 1:
        raise UserError(f"--nproc-per-node {nproc}: must be at least 1")
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port}: must be 1..65535")
    if dry_run:
        return True
    check_privileges()
    support = probe_kernel()
    if support.reason:
        raise UserError(f"cannot emulate a cluster here: {support.reason}")
    return support.netem


def _print_dry_run(plan: NetworkPlan, commands: list[list[str]], out: Callable[[], IO[str]], keep: bool) -> None:
    """What a run would do, printed instead of done: the scheduler and network commands, then each node's
    agent command with its environment."""

    def echo(line: str) -> None:
        print(line, file=out(), flush=True)

    with flat_scheduler(keep=keep, dry_run=True, echo=echo), emulated_network(plan, dry_run=True, echo=echo):
        for n, argv in zip(plan.nodes, commands):
            extra = agent_env(plan, n, base={})
            envs = " ".join(f"{k}={v}" for k, v in extra.items())
            print(f"{' '.join(argv[:4])} env {envs} {' '.join(argv[4:])}", file=out(), flush=True)


def _run_agents(
    plan: NetworkPlan,
    commands: list[list[str]],
    env: dict[str, str] | None,
    sinks: tuple[Callable[[], IO[str]], Callable[[], IO[str]]],
    forwarders: list[threading.Thread],
    *,
    rank_logs: tuple[str, int],
    timeout: float | None,
    grace: float,
    note: Callable,
) -> int:
    """Start each node's torchrun agent in its namespace, its stdout and stderr forwarded to `sinks` prefixed by
    the node (the threads appended to `forwarders`, for the caller to join once the namespaces are gone) and
    its ranks' files under ``rank_logs = (log directory, ranks per node)`` followed (:class:`_RankLogs`), wait
    for the job (:func:`_monitor`) and stop whatever is left; the job's exit code."""
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    stop = threading.Event()
    followers = [
        threading.Thread(target=_RankLogs(f"{rank_logs[0]}/node{n.index}", n.index, rank_logs[1], sinks, lock).follow,
                         args=(stop,), daemon=True)
        for n in plan.nodes
    ]  # fmt: skip
    for t in followers:
        t.start()
    try:
        for n, argv in zip(plan.nodes, commands):
            p = subprocess.Popen(
                argv,
                env=agent_env(plan, n, env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(p)
            for stream, sink in zip((p.stdout, p.stderr), sinks):
                t = threading.Thread(target=_forward, args=(stream, sink, f"[node {n.index}] ", lock), daemon=True)
                t.start()
                forwarders.append(t)
        return _monitor(procs, timeout=timeout, grace=grace, note=note)
    finally:
        _stop(procs, grace=3.0)
        stop.set()  # every rank has exited: the followers read what is left and end
        for t in followers:
            t.join(timeout=10)


def _monitor(procs: list[subprocess.Popen], *, timeout: float | None, grace: float, note: Callable) -> int:
    start = time.monotonic()
    first: tuple[int, int] | None = None
    failed_at = 0.0
    while True:
        codes = [p.poll() for p in procs]
        if first is None:
            for i, c in enumerate(codes):
                if c not in (None, 0):
                    first, failed_at = (i, _exit_code(c)), time.monotonic()
                    rest = f"; stopping the others in {grace:g} s" if any(x is None for x in codes) else ""
                    note(f"node {i}'s agent exited with {_exit_code(c)}{rest}")
                    break
        if all(c is not None for c in codes):
            break
        if first is not None and time.monotonic() - failed_at > grace:
            break
        if timeout is not None and time.monotonic() - start > timeout:
            note(f"timed out after {timeout:g} s; stopping every node")
            return 124
        time.sleep(0.1)
    if first is not None:
        return first[1]
    return max(_exit_code(c) for c in codes)
