"""An emulated cluster network on one machine: a Linux network namespace per node, a bridge, veths, tc.

Layout for a cluster whose layer 0 has R nodes (prefix ``mpe<pid>``, subnet ``10.213.7.0/24``)::

    root namespace:   bridge mpe<pid>br  (no IP address: the host takes no part in the /24)
                        |-- mpe<pid>h0 ==veth== mpe<pid>v0  in namespace mpe<pid>n0, 10.213.7.100/24, lo up
                        |-- mpe<pid>h1 ==veth== mpe<pid>v1  in namespace mpe<pid>n1, 10.213.7.101/24, lo up
                        ...

Node i's address is ``<subnet>.(100 + i)``: three-digit last octets sort as text in node order, which is
how torchrun's c10d rendezvous orders its agents (so node i gets the global ranks i*P .. i*P+P-1).

Shaping (tc, HTB; netem for latency when the kernel has it):

* egress of ``v_i`` (what node i sends): an HTB tree whose root class is node i's *group bandwidth*
  G_i, with one leaf per peer j capped at ``min(reach[i, j], G_i, G_j)`` and picked by a u32 filter on
  the destination address. ``reach`` is layer 0's widest-path P2P matrix (a star cannot relay, so a
  pair without a direct link gets the bandwidth the best relay path would give). One pair alone thus
  gets exactly :meth:`Cluster.p2p_bandwidth`; several flows out of one node share its G_i, as the
  node's NIC would.
* egress of ``h_i`` (what node i receives): one HTB class at G_i.
* one-way latency: a netem ``delay`` of layer 0's latency under each peer leaf of ``v_i``. Kernels
  without ``sch_netem`` get rate shaping only; :attr:`NetworkPlan.latency_emulated` says so.

Ranks of one node talk through their namespace's local route (the kernel's loopback path), which is
not shaped. :func:`emulated_network` is a context manager that always tears everything down, and
:func:`cleanup_stale` removes what a killed run left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

import numpy as np

from meshpilot.cluster import Cluster
from meshpilot.errors import UserError

SUBNET = "10.213.7"
"""The private /24 of the emulated hosts; only ever assigned inside namespaces created here."""
FIRST_HOST = 100
"""Node i gets ``<subnet>.(FIRST_HOST + i)``."""
MAX_NODES = 254 - FIRST_HOST
PREFIX = "mpe"
"""Every namespace and link this module creates is named ``mpe<pid>...``; see :func:`cleanup_stale`."""

_NETNS_RE = re.compile(rf"^{PREFIX}(\d+)(?:n\d+|probe)$")
_LINK_RE = re.compile(rf"^{PREFIX}(\d+)(?:br|h\d+)$")
ETC_NETNS = "/etc/netns"
"""Where ``ip netns exec`` finds per-namespace files to mount over /etc (see :meth:`NetworkPlan.etc_files`)."""
_HTB_QUANTUM = 60000  # bytes; above the MTU, below HTB's 200000 warning threshold
_ACTIVE = threading.Lock()  # one emulated network per process at a time (names derive from the pid)


class EmulationError(UserError):
    """The emulated network cannot be set up here (no root, no netns, a failing ip/tc command)."""


def is_root() -> bool:
    """Whether this process may create namespaces (tests monkeypatch this)."""
    return os.geteuid() == 0


def check_privileges() -> None:
    """Raise :class:`EmulationError` with one line unless this process can create namespaces and links."""
    if not is_root():
        raise EmulationError(
            "needs root to create network namespaces, veth links and tc qdiscs; run it as root (e.g. sudo)"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise EmulationError(f"`{tool}` not found; install iproute2")


@dataclass(frozen=True)
class KernelSupport:
    """What a probe namespace showed the kernel can do."""

    netns: bool
    htb: bool
    netem: bool
    reason: str | None
    """Why emulation cannot run here, or None."""


def probe_kernel() -> KernelSupport:
    """Create a throw-away namespace and try HTB and netem on its loopback; never raises."""
    if not is_root():
        return KernelSupport(False, False, False, "not root: network namespaces need root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return KernelSupport(False, False, False, f"`{tool}` not found (install iproute2)")
    ns = f"{PREFIX}{os.getpid()}probe"
    add = _run(["ip", "netns", "add", ns], check=False)
    if add.returncode != 0:
        return KernelSupport(False, False, False, f"`ip netns add` failed: {_one_line(add.stderr)}")
    try:
        htb = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb"], check=False)
        _run(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], check=False)
        netem = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    if htb.returncode != 0:
        return KernelSupport(True, False, False, f"tc cannot add an HTB qdisc: {_one_line(htb.stderr)}")
    return KernelSupport(True, True, netem.returncode == 0, None)


def netns_unavailable_reason() -> str | None:
    """None when emulation can run on this machine, else why not (for pytest skips)."""
    return probe_kernel().reason


@dataclass(frozen=True)
class NodeNet:
    """One emulated node's network identity."""

    index: int
    netns: str
    ifname: str
    """The veth end inside the namespace (set GLOO_SOCKET_IFNAME to it)."""
    host_ifname: str
    """Its peer, a port of the bridge in the root namespace."""
    addr: str


@dataclass
class NetworkPlan:
    """Everything :func:`emulated_network` will create, as data and as ip/tc commands."""

    prefix: str
    bridge: str
    subnet: str
    nodes: list[NodeNet]
    group_bps: np.ndarray
    """Per node, bytes/s it may send (and receive) in all."""
    pair_bps: np.ndarray
    """[i, j]: bytes/s of the i -> j leaf (diagonal unused)."""
    latency_s: float
    """One-way delay added to every inter-node packet (when netem is available)."""
    netem: bool = True
    """Whether the latency commands are included (False when the kernel lacks sch_netem)."""
    commands: list[list[str]] = field(default_factory=list)

    @property
    def latency_emulated(self) -> bool:
        return self.netem and self.latency_s > 0

    def etc_files(self, node: NodeNet) -> dict[str, str]:
        """Files for ``/etc/netns/<namespace>/``, which ``ip netns exec`` mounts over ``/etc``.

        ``hosts`` names every node (``node<i>``, and this machine's hostname as the node's own address) so
        that name lookups in a namespace never wait on DNS; ``resolv.conf`` points DNS at the namespace's
        own loopback, where nothing answers, so a stray lookup fails at once and sends nothing anywhere.
        """
        hostname = socket.gethostname()
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost"]
        for n in self.nodes:
            names = f"node{n.index} {n.netns}" + (f" {hostname}" if n.index == node.index else "")
            lines.append(f"{n.addr} {names}")
            lines.append(f"::ffff:{n.addr} {names}")  # how a dual-stack listener (TCPStore) sees its peers
        return {"hosts": "\n".join(lines) + "\n", "resolv.conf": "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"}

    def describe(self) -> str:
        """A few lines: nodes, addresses, rates and whether latency is emulated."""
        lines = []
        for n in self.nodes:
            peers = ", ".join(
                f"->{j} {self.pair_bps[n.index, j] / 1e9:g}" for j in range(len(self.nodes)) if j != n.index
            )
            lines.append(
                f"node {n.index}: netns {n.netns}, {n.ifname} {n.addr}; group {self.group_bps[n.index] / 1e9:g} "
                f"GB/s" + (f"; per peer GB/s {peers}" if peers else "")
            )
        if self.latency_s > 0:
            lat = f"{self.latency_s * 1e6:g} µs one-way"
            lines.append(f"latency: {lat}" + ("" if self.netem else " NOT emulated (kernel lacks sch_netem)"))
        fastest = float(self.group_bps.max(initial=0.0))
        if fastest > 2e9:
            lines.append(
                f"note: {fastest / 1e9:g} GB/s is more than veths carry on most machines, so the shaping will not "
                "bind; scale the bandwidths down (--bw-scale)"
            )
        return "\n".join(lines)


def _rate(bps: float) -> str:
    return f"{max(int(round(bps * 8)), 8)}bit"


def _burst(bps: float) -> str:
    # About 1 ms of traffic, at least a few full-size frames: HTB's default (rate/HZ + MTU) starves fast
    # classes on coarse timers, and a burst much larger than this would let short transfers run unshaped.
    return str(max(int(bps * 1e-3), 4 * 1514))


def plan_network(
    cluster: Cluster,
    *,
    bw_scale: float = 1.0,
    prefix: str | None = None,
    subnet: str = SUBNET,
    netem: bool = True,
) -> NetworkPlan:
    """The namespaces, links and tc rules that emulate `cluster`'s layer 0 (nodes), bandwidths times `bw_scale`.

    A cluster with one layer emulates each of its devices as a node of one rank.
    """
    if not (bw_scale > 0 and np.isfinite(bw_scale)):
        raise UserError(f"--bw-scale {bw_scale}: must be a positive number, e.g. 0.01")
    if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet):
        raise UserError(f"subnet {subnet!r}: give the first three octets of a private /24, e.g. 10.213.7")
    layer = cluster.layers[0]
    r = layer.ranks
    if r > MAX_NODES:
        raise UserError(f"cluster {cluster.name!r} has {r} nodes; emulation supports at most {MAX_NODES}")
    prefix = prefix or f"{PREFIX}{os.getpid()}"
    if len(prefix) + 4 > 15:  # Linux interface names hold 15 characters: prefix + "h" + up to 3 digits
        raise UserError(f"prefix {prefix!r} too long for Linux interface names; use at most 11 characters")
    group = layer.group_bw.astype(float) * bw_scale
    reach = layer.reach.astype(float) * bw_scale
    pair = np.zeros((r, r))
    for i in range(r):
        for j in range(r):
            if i != j:
                pair[i, j] = min(reach[i, j], group[i], group[j])
    nodes = [
        NodeNet(i, f"{prefix}n{i}", f"{prefix}v{i}", f"{prefix}h{i}", f"{subnet}.{FIRST_HOST + i}") for i in range(r)
    ]
    plan = NetworkPlan(prefix, f"{prefix}br", subnet, nodes, group, pair, float(layer.latency), netem)
    plan.commands = _setup_commands(plan)
    return plan


def _setup_commands(plan: NetworkPlan) -> list[list[str]]:
    cmds: list[list[str]] = [["ip", "netns", "add", n.netns] for n in plan.nodes]
    br = plan.bridge
    cmds += [
        ["ip", "link", "add", br, "type", "bridge", "forward_delay", "0"],
        ["ip", "link", "set", br, "addrgenmode", "none"],
        ["ip", "link", "set", br, "up"],
    ]
    for n in plan.nodes:
        ns = ["ip", "-n", n.netns]
        cmds += [
            ["ip", "link", "add", n.host_ifname, "type", "veth", "peer", "name", n.ifname, "netns", n.netns],
            ["ip", "link", "set", n.host_ifname, "addrgenmode", "none"],
            ["ip", "link", "set", n.host_ifname, "master", br, "up"],
            [*ns, "link", "set", "lo", "up"],
            [*ns, "link", "set", n.ifname, "addrgenmode", "none"],
            [*ns, "addr", "add", f"{n.addr}/24", "dev", n.ifname],
            [*ns, "link", "set", n.ifname, "up"],
        ]
    r = len(plan.nodes)
    for n in plan.nodes:
        i, g = n.index, plan.group_bps[n.index]
        # What node i receives: its group bandwidth, on the bridge port that feeds it.
        host = ["tc", "qdisc", "add", "dev", n.host_ifname]
        cmds += [
            [*host, "root", "handle", "1:", "htb", "default", "1"],
            _class(["tc"], n.host_ifname, "1:", "1:1", g, g),
        ]
        # What node i sends: group bandwidth at the root, one leaf per peer, a default leaf for ARP; the r
        # leaves are guaranteed g/r each and may borrow up to their ceilings.
        tcn = ["tc", "-n", n.netns]
        cmds += [
            [*tcn, "qdisc", "add", "dev", n.ifname, "root", "handle", "1:", "htb", "default", "2"],
            _class(tcn, n.ifname, "1:", "1:1", g, g),
            _class(tcn, n.ifname, "1:1", "1:2", g / r, g),
        ]
        for peer in plan.nodes:
            j = peer.index
            if j == i:
                continue
            leaf = f"1:{16 + j:x}"
            ceil = plan.pair_bps[i, j]
            cmds.append(_class(tcn, n.ifname, "1:1", leaf, min(ceil, g / r), ceil))
            if plan.latency_emulated:
                cmds.append(
                    [*tcn, "qdisc", "add", "dev", n.ifname, "parent", leaf, "handle", f"{256 + j:x}:", "netem",
                     "delay", f"{plan.latency_s * 1e6:.3f}us", "limit", "100000"]
                )  # fmt: skip
            cmds.append(
                [*tcn, "filter", "add", "dev", n.ifname, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                 "match", "ip", "dst", f"{peer.addr}/32", "flowid", leaf]
            )  # fmt: skip
    return cmds


def _class(tc: list[str], dev: str, parent: str, classid: str, rate: float, ceil: float) -> list[str]:
    return [
        *tc, "class", "add", "dev", dev, "parent", parent, "classid", classid, "htb",
        "rate", _rate(rate), "ceil", _rate(ceil), "burst", _burst(rate), "cburst", _burst(ceil),
        "quantum", str(_HTB_QUANTUM),
    ]  # fmt: skip


def teardown_commands(plan: NetworkPlan) -> list[list[str]]:
    """What teardown runs (after killing the namespaces' processes); each may fail harmlessly."""
    cmds = [["ip", "link", "del", n.host_ifname] for n in plan.nodes]  # takes the peer in the namespace along
    cmds.append(["ip", "link", "del", plan.bridge])
    cmds += [["ip", "netns", "del", n.netns] for n in plan.nodes]
    return cmds


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(no message)"


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise EmulationError(f"`{cmd[0]}` not found; install iproute2") from None
    if check and proc.returncode != 0:
        raise EmulationError(f"`{' '.join(cmd)}` failed: {_one_line(proc.stderr)}")
    return proc


def namespace_pids(netns: str) -> list[int]:
    """Processes living in namespace `netns` (all of them started by this module's launcher)."""
    proc = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()] if proc.returncode == 0 else []


def kill_namespace_processes(netns: str) -> None:
    """SIGKILL every process still inside `netns`, by pid (agents and ranks this run started)."""
    for _ in range(20):
        pids = namespace_pids(netns)
        if not pids:
            return
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # Reap our own children among them so they do not linger as zombies in `ip netns pids`.
        for pid in pids:
            with suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        threading.Event().wait(0.05)


def teardown(plan: NetworkPlan) -> list[str]:
    """Kill what runs in the namespaces, delete veths, bridge, namespaces and their /etc/netns files.

    Returns the errors that mattered (a link or namespace that is already gone is no error).
    """
    for n in plan.nodes:
        kill_namespace_processes(n.netns)
    errors = []
    for cmd in teardown_commands(plan):
        proc = _run(cmd, check=False)
        if proc.returncode != 0 and not _gone(proc.stderr):
            errors.append(f"`{' '.join(cmd)}`: {_one_line(proc.stderr)}")
    for n in plan.nodes:
        _remove_etc(n.netns)
    return errors


def _write_etc(netns: str, files: dict[str, str]) -> None:
    d = os.path.join(ETC_NETNS, netns)
    os.makedirs(d, exist_ok=True)
    for name, text in files.items():
        with open(os.path.join(d, name), "w") as fh:
            fh.write(text)


def _remove_etc(netns: str) -> None:
    shutil.rmtree(os.path.join(ETC_NETNS, netns), ignore_errors=True)
    with suppress(OSError):
        os.rmdir(ETC_NETNS)  # only if empty: it may hold other tools' (or other runs') files


def _gone(stderr: str) -> bool:
    s = stderr.lower()
    return "cannot find device" in s or "no such file" in s or "does not exist" in s or "not found" in s


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM/SIGHUP while tearing down, so a second Ctrl-C cannot leave half a network."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextmanager
def emulated_network(plan: NetworkPlan, *, dry_run: bool = False, echo=None) -> Iterator[NetworkPlan]:
    """Create `plan`'s namespaces, bridge, veths and tc rules; always remove them on exit.

    With `dry_run` nothing runs: each command is passed to `echo` (default: printed to stdout). The body
    runs either way, so a dry run can print the commands it would launch too.
    """
    if dry_run:
        out = echo or (lambda line: print(line, flush=True))
        for cmd in plan.commands:
            out(" ".join(cmd))
        for n in plan.nodes:
            for name, text in plan.etc_files(n).items():
                out(f"# write {ETC_NETNS}/{n.netns}/{name}: " + "; ".join(text.strip().splitlines()))
        yield plan
        for cmd in teardown_commands(plan):
            out(" ".join(cmd))
        return
    check_privileges()
    if not _ACTIVE.acquire(blocking=False):
        raise EmulationError("another emulated network is active in this process; run one at a time")
    try:
        try:
            for n in plan.nodes:
                _write_etc(n.netns, plan.etc_files(n))
            for cmd in plan.commands:
                _run(cmd)
            yield plan
        finally:
            with _signals_ignored():
                errors = teardown(plan)
            for e in errors:
                print(f"meshpilot emulate: cleanup: {e}", file=sys.stderr)
    finally:
        _ACTIVE.release()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def leftovers(owner: int | None = None) -> dict[str, list[str]]:
    """Namespaces and root-namespace links named like ours (``mpe<pid>...``), optionally only of pid `owner`."""
    out: dict[str, list[str]] = {"netns": [], "links": []}
    proc = _run(["ip", "-j", "netns", "list"], check=False)
    for entry in _json_list(proc.stdout):
        m = _NETNS_RE.match(entry.get("name", ""))
        if m and (owner is None or int(m.group(1)) == owner):
            out["netns"].append(entry["name"])
    proc = _run(["ip", "-j", "link", "show"], check=False)
    for entry in _json_list(proc.stdout):
        m = _LINK_RE.match(entry.get("ifname", ""))
        if m and (owner is None or int(m.group(1)) == owner):
            out["links"].append(entry["ifname"])
    return out


def _json_list(text: str) -> list[dict]:
    try:
        data = json.loads(text or "[]")
    except json.JSONDecodeError:
        return []
    return data if isinstance(data, list) else []


def cleanup_stale(force: bool = False) -> list[str]:
    """Remove namespaces and links that earlier runs left behind; return what was removed.

    A leftover belongs to the run whose pid its name carries; one whose run is still alive is kept unless
    `force`. Processes still inside a removed namespace (a killed run's ranks) are killed first.
    """
    check_privileges()
    found = leftovers()
    removed = []
    me = os.getpid()
    for ns in found["netns"]:
        owner = int(_NETNS_RE.match(ns).group(1))
        if owner == me or (_pid_alive(owner) and not force):
            continue
        kill_namespace_processes(ns)
    for name in found["links"]:
        owner = int(_LINK_RE.match(name).group(1))
        if owner == me or (_pid_alive(owner) and not force):
            continue
        if _run(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(f"link {name}")
    for ns in found["netns"]:
        owner = int(_NETNS_RE.match(ns).group(1))
        if owner == me or (_pid_alive(owner) and not force):
            continue
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(f"netns {ns}")
        _remove_etc(ns)
    if os.path.isdir(ETC_NETNS):
        for name in os.listdir(ETC_NETNS):
            m = _NETNS_RE.match(name)
            if m and int(m.group(1)) != me and (force or not _pid_alive(int(m.group(1)))):
                _remove_etc(name)
                removed.append(f"{ETC_NETNS}/{name}")
    return removed
