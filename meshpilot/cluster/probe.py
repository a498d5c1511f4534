"""Measure a live ``torch.distributed`` group and describe it as a :class:`Cluster` (`meshpilot probe`).

Every rank of the group runs :func:`probe`; rank 0 gets the :class:`Measurements` back and
:func:`build_cluster` turns them into the hierarchical communication matrix. Works on gloo (CPU tensors)
and NCCL (CUDA tensors; each rank on ``cuda:LOCAL_RANK``).

What is measured (bandwidths in bytes/s, times in seconds; every "best" is the fastest of the repeats,
after warm-up repeats that are not counted):

1. **Device.** Every rank at once and in lockstep (a barrier before each timed repeat), and the *median*
   of the repeats, not the best: the rate a rank gets while every rank of its host computes, as in a
   training step (8 ranks sharing 2 cores get about a quarter of a core each; a rank's best repeat is
   one where the others happened to wait). float32 matmul FLOP/s, the best size of a few
   (bfloat16 too on CUDA); memory bandwidth of a large tensor copy (2 x bytes per copy: read + write);
   memory capacity (CUDA: the device's total memory; CPU: physical memory divided by the ranks on the
   host). The cluster's profile takes the median over ranks of the rates and the smallest capacity.
   With ``ProbeOptions.matmul_shapes`` (``meshpilot probe --matmul-shapes-from MODEL``: a model's own
   GEMMs, ``meshpilot.graph.gemms``) each GEMM ``[m, k] @ [k, n]`` is also timed as training runs it:
   back to back, ``inner`` calls between two synchronisations (enough for ~10 ms on a GPU, ~100 ms on a
   CPU: :func:`gemm_timing_s`), median of the repeats; ``2 m n k · inner / time`` is its rate, the
   profile's ``matmul`` table (median over ranks). The
   shapes come from a built-in model (``--matmul-shapes-from``) or from a file of any captured model's
   GEMMs (``--matmul-shapes FILE``, e.g. every plan's local shards: ``accounting.plan_gemms``).
   Fixed costs (:func:`op_overheads`, lockstep and median as above): one tiny operator (100 one-element
   ``add``s back to back, per op) — ``DeviceProfile.op_overhead``, the cost of a kernel beyond its roofline —
   and one ``torch._foreach_add_`` over 100 one-element tensors, per tensor — ``foreach_overhead``. And
   the host CPU of one collective as a training step pays it (:meth:`_Runner.collective_cpu`): every rank,
   in lockstep, runs the same compute (:data:`STEP_GEMMS` float32 matmuls of :data:`INFLIGHT_GEMM`, a stand-in
   for a backward) cut into ``k`` equal runs, and after each run issues one asynchronous all-reduce of the
   next ``1/k`` of one buffer of ``M`` bytes (``nbytes``) on the world group, as the backward issues its
   gradient buckets; it waits for all ``k`` at the end. The process CPU time (``time.process_time``: all
   threads, the backend's too) of one such repeat is

       c(k) = k * h + B(M) + C      (h: per collective; B(M): the bytes' CPU; C: the compute's)

   so two counts ``k1 > k2`` (:data:`COLLECTIVE_COUNTS`) over the same bytes and compute give

       h = (c(k1) - c(k2)) / (k1 - k2)

   from each pair of repeats (the two counts run back to back, so they share the load); the median over the
   pairs, then over the ranks — ``collective_overhead``, what a collective costs its rank beyond its bytes.
   (An isolated synchronous one-element all-reduce measures only its call: about a quarter of this on 4
   gloo ranks sharing 2 cores, docs/benchmarks.md.)
2. **Point to point.** Every pair of ranks, in rounds (circle method: each rank in at most one pair per
   round, all pairs of a round at once). Per pair: latency = half the median round trip of a 4-byte
   ping-pong; bandwidth a -> b = bytes / (time for a to send the large buffer and get a 4-byte ack,
   less one latency), both directions. Rounds stop early once ``budget_s`` has passed (rank 0 decides,
   at least one round always runs); unmeasured pairs are filled in by :func:`build_cluster`.
3. **Fan-out.** In rounds, one rank of each node sends the large buffer to every other rank of its node
   at once: its aggregate bandwidth (peers x bytes / time) is its group bandwidth.
4. **Node pairs** (more than one node, same ranks per node). Nodes paired in rounds; for a pair (A, B)
   local rank i of A sends to local rank i of B, all i at once: the aggregate bandwidth between A and B.
5. **All-reduce.** For every 2D mesh shape (d1, d2) of the world (:func:`mesh_shapes_2d`, mesh axis 1
   over contiguous ranks), on each axis of size > 1: every group of the axis all-reduces the large
   buffer at once (one ``new_group`` per axis group). Per repeat the time is the slowest rank's;
   algorithm bandwidth B = bytes / best time, Eq. 4's B (``meshpilot.cluster.mesh``). Then a 4-byte
   all-reduce the same way: its median time t gives the axis' alpha = t / ceil(log2 d), the latency with
   which the cost model's small all-reduce (recursive doubling, ``meshpilot.cluster.cost``) takes t — on
   CPU ranks mostly gloo's own work per collective, which the pairwise ping-pong of phase 2 misses.
   Then the sizes between (:func:`curve_sizes`: 64 B to 1 MiB for 4 MiB messages): with the 4-byte
   and the large measurement they make the axis' curve (:func:`_curve`: per repeat the slowest rank, median
   over repeats), which the cost model interpolates (``Calibration.curve``).
6. **All-reduce beside compute** (gloo only: on CPU ranks the backend's threads share the cores with the
   compute). The same groups all-reduce at :func:`busy_sizes` while every rank runs float32 matmuls
   (:data:`INFLIGHT_GEMM`) until it sees its all-reduce complete (:meth:`_Runner.inflight`: issued
   asynchronously after a barrier, ``Work.is_completed`` polled between matmuls; one warm-up repeat, the
   previous phase having warmed the groups). Per repeat the slowest rank, median over repeats: the axis'
   busy curve (``Calibration.busy_curve``). Its ratio to the curve alone is how much longer a collective in
   flight beside compute takes (``CostModel.busy_factor``; on the emulated 100 Mbit/s link, 8 ranks on 2
   cores: 1.5x at 2 MiB, 4x at 512 KiB, docs/benchmarks.md).

How :func:`build_cluster` makes the hierarchy:

* Ranks are grouped into nodes by hostname. With more than one node, every node holding the same number
  L > 1 of ranks and each node's ranks contiguous (torchrun's layout): two layers, ``node`` (R = nodes)
  and ``device`` (R = L). Otherwise one layer of every rank (``device``; ``node`` when each node has one
  rank), whose P2P matrix still shows any node boundary.
* A P2P entry is the mean of the two directions measured. The device layer is the same in every node:
  entry (i, j) is the median over nodes of the bandwidth between local ranks i and j; its group bandwidth
  the median fan-out of local rank i; its latency the median latency of pairs inside a node.
* Node layer: P2P(A, B) is the measured node-pair aggregate; where that was not measured, the median
  bandwidth of single rank pairs between A and B (as if the nodes' ranks shared one link: conservative).
  A node's group bandwidth is its largest P2P entry (the most it was seen to move); its latency the
  median latency of pairs across nodes.
* A missing entry takes the median of the measured entries of its layer (of all measured pairs if the
  layer has none); a missing group bandwidth the unit's largest P2P entry; a missing latency 0.
  A one-device world gets one layer of one rank whose (unused) bandwidth is the device's memory bandwidth.
* Every measured mesh becomes a calibration entry (B1, B2, alpha1, alpha2, the curves and the busy
  curves), so the planner uses the measured numbers.
* Numbers are rounded to 4 significant digits (the run-to-run noise is larger). The device profile
  carries the measured rates with compute and memory efficiency 1.0: they are what kernels reach.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import socket
import statistics
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from meshpilot.cluster.devices import DeviceProfile, MatmulRate
from meshpilot.cluster.loader import cluster_from_dict, cluster_to_toml
from meshpilot.cluster.mesh import mesh_shapes_2d
from meshpilot.cluster.topology import Calibration, Cluster, Layer
from meshpilot.io import atomic_write

MiB = 1 << 20


@dataclass(frozen=True)
class ProbeOptions:
    """Sizes and repeat counts of one probe."""

    nbytes: int = 4 * MiB
    """Large message for P2P, fan-out, node pairs and all-reduce (bytes, a multiple of 4)."""
    repeats: int = 5
    """Timed repeats of each bandwidth measurement; the best counts."""
    warmup: int = 2
    """Untimed repeats before them (NCCL builds communicators on first use)."""
    latency_repeats: int = 20
    """Ping-pongs per pair for the latency."""
    matmul_sizes: tuple[int, ...] = (256, 512, 1024)
    """Square matmul sizes n (2 n^3 FLOPs each)."""
    copy_bytes: int = 64 * MiB
    """Tensor size for the memory bandwidth copy."""
    budget_s: float = 120.0
    """Seconds after which the P2P rounds stop (remaining pairs are estimated)."""
    matmul_shapes: tuple[tuple[int, int, int, str], ...] = ()
    """GEMMs (m, n, k, dtype) to time at their own shape: the device profile's ``matmul`` table."""

    @classmethod
    def for_device(
        cls, cuda: bool, quick: bool = False, nbytes: int | None = None, repeats: int | None = None
    ) -> ProbeOptions:
        """Defaults for a CPU or CUDA device; `quick` for tests (small sizes, few repeats)."""
        if quick:
            opts = cls(1 * MiB, 2, 1, 5, (64, 128), 4 * MiB, 30.0)
        elif cuda:
            opts = cls(32 * MiB, 10, 3, 50, (2048, 4096, 8192), 1024 * MiB, 120.0)
        else:
            opts = cls()
        changes: dict[str, Any] = {}
        if nbytes is not None:
            changes["nbytes"] = max(4, (nbytes + 3) // 4 * 4)
        if repeats is not None:
            changes["repeats"] = max(1, repeats)
        return dataclasses.replace(opts, **changes)


Curve = tuple[tuple[int, float], ...]
"""Measured (bytes, seconds) points of one all-reduce, bytes ascending (``Calibration.curve``)."""


@dataclass
class Measurements:
    """What one probe measured, reduced to numbers (see the module docstring for each)."""

    backend: str
    hosts: list[str]
    """Hostname of every rank."""
    nbytes: int
    p2p_bw: np.ndarray
    """[W, W] bandwidth a -> b, bytes/s; NaN on the diagonal and for pairs not measured."""
    p2p_latency: np.ndarray
    """[W, W] one-way latency, seconds; NaN where not measured."""
    fanout_bw: np.ndarray
    """[W] aggregate bandwidth of each rank sending to every other rank of its node at once; NaN: not measured."""
    node_bw: np.ndarray | None
    """[N, N] aggregate bandwidth node A -> node B with all local ranks sending at once; None if not measured."""
    allreduce: dict[tuple[int, int], tuple[float | None, float | None]]
    """Per 2D mesh shape, the measured all-reduce algorithm bandwidth of each axis (None: axis of size 1)."""
    device: DeviceProfile
    """The cluster's device profile (median rates over ranks, smallest capacity)."""
    per_rank: list[dict[str, float]] = field(default_factory=list)
    """Each rank's device numbers: fp32/bf16 FLOP/s, memory bytes/s, memory bytes."""
    skipped_pairs: int = 0
    """Rank pairs not measured because the P2P budget ran out."""
    allreduce_latency: dict[tuple[int, int], tuple[float | None, float | None]] = field(default_factory=dict)
    """Per 2D mesh shape, each axis' alpha from the 4-byte all-reduce (module docstring, 5.; None: size 1)."""
    allreduce_curve: dict[tuple[int, int], tuple[Curve | None, ...]] = field(default_factory=dict)
    """Per 2D mesh shape, each axis' all-reduce (bytes, seconds) points (:func:`curve_sizes`; None: size 1)."""
    allreduce_busy: dict[tuple[int, int], tuple[Curve | None, ...]] = field(default_factory=dict)
    """Per 2D mesh shape, each axis' all-reduce points while every rank computes (phase 6; None: not measured)."""
    seconds: float = 0.0
    """Wall time of the probe."""


# ----------------------------------------------------------------------------------------------------
# Pure parts: schedules, node layout, hierarchy.


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs (a < b) covering every pair of range(n) once (circle method)."""
    if n < 2:
        return []
    m = n + (n % 2)  # odd n: a bye (index n) sits out each round
    order = list(range(m))
    rounds = []
    for _ in range(m - 1):
        pairs = [(order[i], order[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a < n and b < n])
        order = [order[0], order[-1], *order[1:-1]]
    return rounds


def node_layout(hosts: list[str]) -> list[list[int]]:
    """The ranks of every host, hosts in order of first appearance."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    return list(nodes.values())


def two_layer(nodes: list[list[int]]) -> bool:
    """True when the nodes make a (node, device) hierarchy: several nodes, equal sizes > 1, contiguous ranks."""
    if len(nodes) < 2:
        return False
    size = len(nodes[0])
    return size > 1 and all(node == list(range(k * size, (k + 1) * size)) for k, node in enumerate(nodes))


def _sym(m: np.ndarray) -> np.ndarray:
    """Mean of m and m.T, ignoring NaN (one measured direction stands for both)."""
    with np.errstate(invalid="ignore"):
        s = np.where(np.isnan(m), m.T, np.where(np.isnan(m.T), m, (m + m.T) / 2))
    return s


def _median(values: Any) -> float:
    arr = np.asarray(values, dtype=float).reshape(-1)
    arr = arr[np.isfinite(arr)]
    return float(np.median(arr)) if arr.size else math.nan


def _round(x: float, digits: int = 4) -> float:
    if not math.isfinite(x) or x == 0:
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def _seconds(us: float) -> float:
    """Microseconds to seconds, choosing among the nearest floats one that prints back as `us` (tidy files)."""
    x = us * 1e-6
    for cand in (x, math.nextafter(x, math.inf), math.nextafter(x, 0.0)):
        if cand * 1e6 == us:
            return cand
    return x


def _fill(matrix: np.ndarray, fallback: float) -> np.ndarray:
    """Off-diagonal NaN -> fallback; diagonal 0; values rounded."""
    out = np.where(np.isnan(matrix), fallback, matrix)
    np.fill_diagonal(out, 0.0)
    return np.vectorize(_round, otypes=[float])(out) if out.size else out


def _layer(name: str, p2p: np.ndarray, fanout: np.ndarray, latency: float, fallback: float) -> Layer:
    r = p2p.shape[0]
    fill = _median(p2p[~np.eye(r, dtype=bool)])
    p2p = _fill(p2p, fallback if math.isnan(fill) else fill)
    best = p2p.max(axis=1)
    group = np.array([_round(g) if math.isfinite(g) and g > 0 else best[i] for i, g in enumerate(fanout)])
    lat = _seconds(_round(latency * 1e6)) if math.isfinite(latency) else 0.0
    return Layer(name=name, ranks=r, p2p=p2p, group_bw=group, latency=lat)


def build_layers(m: Measurements) -> tuple[Layer, ...]:
    """The hierarchy of the probed group (rules in the module docstring)."""
    world = len(m.hosts)
    if world == 1:
        bw = _round(m.device.memory_bandwidth)
        return (Layer("device", 1, np.zeros((1, 1)), np.array([bw]), 0.0),)
    nodes = node_layout(m.hosts)
    bw, lat = _sym(m.p2p_bw), _sym(m.p2p_latency)
    anywhere = _median(bw[~np.eye(world, dtype=bool)])  # for a kind of entry the budget left unmeasured
    if not two_layer(nodes):
        name = "node" if len(nodes) == world else "device"
        off = ~np.eye(world, dtype=bool)
        return (_layer(name, bw, m.fanout_bw, _median(lat[off]), anywhere),)
    n, size = len(nodes), len(nodes[0])
    blocks = np.arange(world).reshape(n, size)
    intra = np.stack([bw[np.ix_(b, b)] for b in blocks])  # [n, L, L]
    intra_lat = np.stack([lat[np.ix_(b, b)] for b in blocks])
    off = ~np.eye(size, dtype=bool)
    dev_p2p = np.array([[_median(intra[:, i, j]) for j in range(size)] for i in range(size)])
    dev_fan = np.array([_median(m.fanout_bw[blocks[:, i]]) for i in range(size)])
    device = _layer("device", dev_p2p, dev_fan, _median(intra_lat[:, off]), anywhere)
    pair = np.full((n, n), math.nan)
    inter_lat = []
    node_bw = _sym(m.node_bw) if m.node_bw is not None else None
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            inter_lat.append(lat[np.ix_(blocks[a], blocks[b])])
            if node_bw is not None and math.isfinite(node_bw[a, b]):
                pair[a, b] = node_bw[a, b]
            else:
                pair[a, b] = _median(bw[np.ix_(blocks[a], blocks[b])])
    node = _layer("node", pair, np.full(n, math.nan), _median(inter_lat), anywhere)
    return (node, device)


def calibration_entries(
    allreduce: dict[tuple[int, int], tuple[float | None, float | None]],
    latency: dict[tuple[int, int], tuple[float | None, float | None]] | None = None,
    curves: dict[tuple[int, int], tuple[Curve | None, ...]] | None = None,
    busy: dict[tuple[int, int], tuple[Curve | None, ...]] | None = None,
) -> tuple:
    """One :class:`Calibration` per measured mesh shape (axes of size 1 carry None)."""

    def valid(xs: tuple[float | None, ...]) -> tuple[float | None, ...]:
        return tuple(None if x is None or not math.isfinite(x) or x <= 0 else _round(x) for x in xs)

    out = []
    for shape, algbw in allreduce.items():
        vals = valid(algbw)
        alphas = valid((latency or {}).get(shape, ()))
        curve = (curves or {}).get(shape, ())
        loaded = tuple(b if j < len(curve) and curve[j] else None for j, b in enumerate((busy or {}).get(shape, ())))
        if any(v is not None for v in vals + alphas) or any(curve):
            entry = Calibration(
                mesh=(shape[0], shape[1]),
                algbw=vals,
                latency=alphas if any(alphas) else (),
                curve=curve if any(curve) else (),
                busy_curve=loaded if any(loaded) else (),
            )
            out.append(entry)
    return tuple(out)


def build_cluster(m: Measurements, name: str = "probed", calibrate: bool = True, source: str = "") -> Cluster:
    """The probed cluster; `calibrate=False` leaves out the measured all-reduce bandwidths (Eq. 3/4 only)."""
    calibration = (
        calibration_entries(m.allreduce, m.allreduce_latency, m.allreduce_curve, m.allreduce_busy) if calibrate else ()
    )
    return Cluster(
        name=name,
        layers=build_layers(m),
        device=m.device,
        calibration=calibration,
        source=source or f"meshpilot probe ({m.backend}, {len(m.hosts)} ranks)",
    )


def write_cluster_toml(cluster: Cluster, path: str | Path, comment: str = "") -> Path:
    """Write `cluster` as TOML atomically: validate the text, write a temp file beside `path`, rename."""
    path = Path(path)
    text = cluster_to_toml(cluster, comment)
    cluster_from_dict(tomllib.loads(text), source=str(path))  # never write a file that does not load
    return atomic_write(path, text)


def summarize(
    records: list[dict[str, Any]], hosts: list[str], backend: str, opts: ProbeOptions, kind: str
) -> Measurements:
    """Reduce every rank's raw timings (from :func:`probe`) to :class:`Measurements`."""
    world = len(hosts)
    nbytes = opts.nbytes
    lat = np.full((world, world), math.nan)
    for rec in records:
        for (a, b), rtts in rec["lat"].items():
            lat[a, b] = lat[b, a] = statistics.median(rtts) / 2
    p2p = np.full((world, world), math.nan)
    for rec in records:
        for (a, b), times in rec["p2p"].items():
            p2p[a, b] = nbytes / _net(min(times), lat[a, b])
    fanout = np.full(world, math.nan)
    for rec in records:
        for a, (peers, times) in rec["fan"].items():
            fanout[a] = peers * nbytes / _net(min(times), _median([lat[a, p] for p in range(world) if p != a]))
    node_bw = None
    node_times: dict[tuple[int, int], list[list[float]]] = {}
    for rec in records:
        for (na, nb, _i), times in rec["node"].items():
            node_times.setdefault((na, nb), []).append(times)
    if node_times:
        nodes = node_layout(hosts)
        node_bw = np.full((len(nodes), len(nodes)), math.nan)
        for (na, nb), per_rank in node_times.items():
            worst = np.max(np.array(per_rank), axis=0)  # per repeat, the slowest sender
            alpha = _median([lat[a, b] for a in nodes[na] for b in nodes[nb]])
            node_bw[na, nb] = len(per_rank) * nbytes / _net(float(worst.min()), alpha)
    allreduce, alphas, curves, busy = allreduce_by_mesh(records, world, nbytes)
    devs = [rec["device"] for rec in records]
    device = device_profile(devs, hosts, opts, kind)
    skipped = sum(rec["skipped"] for rec in records[:1])
    m = Measurements(backend, hosts, nbytes, p2p, lat, fanout, node_bw, allreduce, device, devs, skipped, alphas)
    m.allreduce_curve = curves
    m.allreduce_busy = busy
    return m


def device_profile(devs: list[dict[str, Any]], hosts: list[str], opts: ProbeOptions, kind: str) -> DeviceProfile:
    """The cluster's device profile from every rank's :func:`measure_device` numbers (`devs`, in rank order;
    each may also carry ``collective_overhead``, seconds): the median over ranks of each rate and fixed cost,
    the smallest memory capacity (a host's memory divided among its ranks). What :func:`summarize` gives
    ``Measurements.device``."""
    on_host = {h: hosts.count(h) for h in hosts}
    for dev, host in zip(devs, hosts):
        if dev.pop("host_memory", False):
            dev["memory_bytes"] = dev["memory_bytes"] / on_host[host]
    flops = {"float32": _round(_median([d["float32"] for d in devs]))}
    bf16 = [d["bfloat16"] for d in devs if d.get("bfloat16")]
    if bf16:
        flops["bfloat16"] = _round(_median(bf16))
    rates = tuple(
        MatmulRate(m, n, k, dtype, _round(_median([d["matmul"][j] for d in devs])))
        for j, (m, n, k, dtype) in enumerate(opts.matmul_shapes)
    )
    keys = ("op_overhead", "foreach_overhead", "collective_overhead", "call_overhead", "adamw_overhead")
    overheads = [_median([d.get(key, math.nan) for d in devs]) for key in keys]
    op_s, each_s, coll_s, call_s, adamw_s = (_seconds(_round(x * 1e6)) if math.isfinite(x) else 0.0 for x in overheads)
    adamw_bw = _median([d.get("adamw_bandwidth", math.nan) for d in devs])
    return DeviceProfile(
        kind,
        flops,
        _round(_median([d["memory_bandwidth"] for d in devs])),
        int(min(d["memory_bytes"] for d in devs)),
        1.0,
        1.0,
        rates,
        op_s,
        each_s,
        coll_s,
        call_overhead=call_s,
        adamw_bandwidth=_round(adamw_bw) if math.isfinite(adamw_bw) else 0.0,
        adamw_overhead=adamw_s if math.isfinite(adamw_bw) else 0.0,
    )


def allreduce_by_mesh(records: list[dict[str, Any]], world: int, nbytes: int) -> tuple[dict, dict, dict, dict]:
    """Every 2D mesh shape's all-reduce, per axis, from the ranks' raw timings (:func:`summarize`; also
    ``benchmarks/bench_vs_torch.py``'s loopback measurement): the bandwidth (`nbytes` over the slowest rank's best
    repeat), the latency (the 4-byte median of the slowest rank over ``ceil(log2 d)`` ring steps), the curve
    (:func:`_curve`) and the busy curve (:func:`_busy_curve`); None where an axis was not measured."""
    allreduce: dict[tuple[int, int], tuple[float | None, float | None]] = {}
    alphas: dict[tuple[int, int], tuple[float | None, float | None]] = {}
    curves: dict[tuple[int, int], tuple[Curve | None, ...]] = {}
    busy: dict[tuple[int, int], tuple[Curve | None, ...]] = {}
    for shape in mesh_shapes_2d(world):
        out: list[float | None] = []
        small: list[float | None] = []
        for axis in (0, 1):
            key = (shape, axis)
            per_rank = [rec["ar"][key] for rec in records if key in rec["ar"]]
            tiny = [rec["ar_small"][key] for rec in records if key in rec.get("ar_small", {})]
            if not per_rank:
                out.append(None)
            else:
                out.append(nbytes / float(np.max(np.array(per_rank), axis=0).min()))  # per repeat the slowest
            if not tiny:
                small.append(None)
            else:
                t = float(np.median(np.max(np.array(tiny), axis=0)))
                small.append(t / max(1, math.ceil(math.log2(shape[axis]))))
        allreduce[shape] = (out[0], out[1])
        alphas[shape] = (small[0], small[1])
        curves[shape] = tuple(_curve(records, shape, axis, nbytes) for axis in (0, 1))
        busy[shape] = tuple(_busy_curve(records, shape, axis, nbytes) for axis in (0, 1))
    return allreduce, alphas, curves, busy


def curve_sizes(nbytes: int) -> tuple[int, ...]:
    """Message sizes of the all-reduce curve between the 4-byte and the `nbytes` measurements: 64 B, 1 KiB,
    then 16 KiB and every 8x, all below `nbytes` (64 B, 1 KiB, 16 KiB, 128 KiB, 1 MiB at the CPU default of
    4 MiB). The small ones matter: over gloo on a TCP link every message past a few bytes paid a floor of
    about 20 ms on the emulated slow link, where 4 bytes took 3-4 ms (docs/cluster.md)."""
    out = [size for size in (64, 1024) if size < nbytes]
    size = 16 * 1024
    while size < nbytes:
        out.append(size)
        size *= 8
    return tuple(out)


def _curve(records: list[dict[str, Any]], shape: tuple[int, int], axis: int, nbytes: int) -> Curve | None:
    """The (bytes, seconds) all-reduce points of one mesh axis: 4 bytes, :func:`curve_sizes`, `nbytes`; each
    the median over repeats of the slowest rank (what a training step waits for)."""
    points = []
    for size, key, table in (
        (4, (shape, axis), "ar_small"),
        *((s, (shape, axis, s), "ar_curve") for s in curve_sizes(nbytes)),
        (nbytes, (shape, axis), "ar"),
    ):
        per_rank = [rec[table][key] for rec in records if key in rec.get(table, {})]
        if per_rank and all(per_rank):
            t = float(np.median(np.max(np.array(per_rank), axis=0)))
            if math.isfinite(t) and t > 0:
                points.append((size, _round(t)))
    return tuple(points) if len(points) >= 2 else None


def busy_sizes(nbytes: int) -> tuple[int, ...]:
    """Message sizes of the busy curve (phase 6): those of :func:`curve_sizes` from 1 KiB up, and `nbytes`
    (1 KiB, 16 KiB, 128 KiB, 1 MiB, 4 MiB at the CPU default); below 1 KiB the curve's first point holds."""
    return (*(s for s in curve_sizes(nbytes) if s >= 1024), nbytes)


def _busy_curve(records: list[dict[str, Any]], shape: tuple[int, int], axis: int, nbytes: int) -> Curve | None:
    """The (bytes, seconds) points of one mesh axis' all-reduce beside compute (phase 6): per size the median
    over repeats of the slowest rank."""
    points = []
    for size in busy_sizes(nbytes):
        key = (shape, axis, size)
        per_rank = [rec["ar_busy"][key] for rec in records if key in rec.get("ar_busy", {})]
        if per_rank and all(per_rank):
            t = float(np.median(np.max(np.array(per_rank), axis=0)))
            if math.isfinite(t) and t > 0:
                points.append((size, _round(t)))
    return tuple(points) if points else None


def _net(t: float, alpha: float) -> float:
    """Transfer time less the latency of its ack, never below half the time measured."""
    if not math.isfinite(alpha):
        return t
    return max(t - alpha, t / 2)


# ----------------------------------------------------------------------------------------------------
# Live parts: every rank of the group runs these.


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_device(device: Any, opts: ProbeOptions, barrier: Callable[[], Any] | None = None) -> dict[str, Any]:
    """This rank's matmul FLOP/s (float32; bfloat16 on CUDA), copy bandwidth and memory capacity; every timed
    repeat starts at `barrier` (all ranks at once) and the median repeat counts (module docstring, 1.)."""
    import torch

    def timed(action: Callable[[], Any], target_s: float = 0.02) -> float:
        """Median seconds of one `action` call over the repeats, each repeat started in lockstep with the
        other ranks and long enough (``calls`` back to back, about `target_s`) to span the scheduler's time
        slices when ranks share cores."""
        for _ in range(max(1, opts.warmup)):
            _sync(device)
            t0 = time.perf_counter()
            action()
            _sync(device)
            one = time.perf_counter() - t0
        calls = max(1, min(1000, math.ceil(target_s / max(one, 1e-9))))
        times = []
        for _ in range(opts.repeats):
            if barrier is not None:
                barrier()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                action()
            _sync(device)
            times.append((time.perf_counter() - t0) / calls)
        return max(_median(times), 1e-12)

    def best_matmul(dtype: torch.dtype) -> float:
        best = 0.0
        for n in opts.matmul_sizes:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            c = torch.empty(n, n, device=device, dtype=dtype)
            best = max(best, 2 * n**3 / timed(functools.partial(torch.mm, a, b, out=c)))  # the fastest size
        return best

    out: dict[str, Any] = {"float32": best_matmul(torch.float32), "bfloat16": None}
    if device.type == "cuda":
        out["bfloat16"] = best_matmul(torch.bfloat16)
    out["matmul"] = [gemm_rate(device, m, n, k, dtype, opts, barrier=barrier) for m, n, k, dtype in opts.matmul_shapes]
    out["op_overhead"], out["foreach_overhead"] = op_overheads(device, timed)
    out["call_overhead"] = call_overhead(device, timed)
    out["adamw_bandwidth"], out["adamw_overhead"] = adamw_rates(device, timed, opts.copy_bytes)
    src = torch.ones(max(1, opts.copy_bytes // 4), device=device)
    dst = torch.empty_like(src)
    out["memory_bandwidth"] = 2 * src.numel() * 4 / timed(functools.partial(dst.copy_, src))
    del src, dst
    if device.type == "cuda":
        out["memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
        out["host_memory"] = False
    else:
        out["memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        out["host_memory"] = True  # shared by the ranks of the host: summarize() divides
    return out


OVERHEAD_OPS = 100
"""Tiny operators per timed call of :func:`op_overheads` (and tensors in its foreach list)."""


def op_overheads(device: Any, timed: Callable[[Callable[[], Any]], float]) -> tuple[float, float]:
    """Seconds of one tiny operator, and per tensor of one foreach operator, on `device` (module docstring,
    1.): :data:`OVERHEAD_OPS` one-element ``add``s back to back (an output buffer reused, as a training step's
    allocator does), and one ``torch._foreach_add_`` over that many one-element tensors; `timed` runs each
    call (lockstep, median) and the time per operator / per tensor is the call's over the count."""
    import torch

    x = torch.ones(1, device=device)
    y = torch.ones(1, device=device)
    z = torch.empty(1, device=device)
    many = [torch.ones(1, device=device) for _ in range(OVERHEAD_OPS)]

    def tiny() -> None:
        for _ in range(OVERHEAD_OPS):
            torch.add(x, y, out=z)

    op = timed(tiny) / OVERHEAD_OPS
    each = timed(functools.partial(torch._foreach_add_, many, 1.0)) / OVERHEAD_OPS
    return op, each


CALL_PROGRAM = (4, 8)
"""(rows, width) of :func:`call_overhead`'s tiny model: every kernel a few hundred bytes, so its time is the calls'."""


def tiny_joint_program() -> tuple[Any, tuple[Any, ...]]:
    """A recorded forward + backward as the runtime runs one (an ``fx.GraphModule`` of ATen calls, one a line,
    views and the backward's ops included) of a tiny model: embedding, layer norm, linear, GELU, linear,
    log-softmax and NLL loss, as a transformer's block and head run them; and its example arguments (float32, on
    the CPU: :func:`call_overhead` moves them)."""
    import torch
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    rows, width = CALL_PROGRAM

    def step(tokens, emb, w1, b1, w2, b2, ln_w, ln_b):
        x = F.embedding(tokens, emb)
        h = F.layer_norm(x, (width,), ln_w, ln_b)
        h = F.gelu(F.linear(h, w1, b1)).view(rows, 2, width // 2).transpose(1, 2).reshape(rows, width)
        logits = F.linear(h + x, w2, b2)
        loss = F.cross_entropy(logits, tokens)
        return (loss, *torch.autograd.grad(loss, (emb, w1, b1, w2, b2, ln_w, ln_b)))

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, width, (rows,), generator=g)
    params = [torch.randn(width, width, generator=g, requires_grad=True) for _ in range(3)]
    vecs = [torch.randn(width, generator=g, requires_grad=True) for _ in range(4)]
    args = (tokens, params[0], params[1], vecs[0], params[2], vecs[1], vecs[2], vecs[3])
    return make_fx(step)(*args), args


def program_calls(gm: Any) -> int:
    """Calls one run of the recorded program `gm` makes: its ``call_function`` lines but ``getitem`` (a
    Python tuple index, no ATen call)."""
    import operator

    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)


def call_overhead(device: Any, timed: Callable[[Callable[[], Any]], float]) -> float:
    """Seconds of host time per call of a recorded forward + backward (``DeviceProfile.call_overhead``): one run of
    :func:`tiny_joint_program` (lockstep, median, as `timed` runs it) over :func:`program_calls`. Its kernels
    move a few hundred bytes each, so the run's time is its calls': the generated code's lines, the ATen dispatch
    and what each op calls inside, the allocator — what the runtime pays per op of a step, which the roofline
    does not price."""
    import torch

    gm, args = tiny_joint_program()
    live = tuple(a.detach().to(device) for a in args)
    with torch.no_grad():
        return timed(functools.partial(gm, *live)) / program_calls(gm)


ADAMW_TENSORS = 16
"""Parameter tensors of :func:`adamw_rates`' large step (``copy_bytes`` of parameters split among them)."""


def adamw_rates(device: Any, timed: Callable[[Callable[[], Any]], float], nbytes: int) -> tuple[float, float]:
    """The foreach AdamW step's rates on `device` (``DeviceProfile.adamw_bandwidth``, ``adamw_overhead``): a step
    over :data:`OVERHEAD_OPS` one-element parameters gives the seconds per tensor ``a``; a step over
    :data:`ADAMW_TENSORS` parameters of `nbytes` in all, ``t``, the parameter bytes per second
    ``nbytes / (t − ADAMW_TENSORS · a)``. `timed` runs each step (lockstep, median), every parameter with a
    gradient, as a training step's ``opt.step()`` runs (``runtime.train.adamw``: ``foreach=True``)."""
    import torch

    def step_seconds(sizes: list[int]) -> float:
        params = [torch.zeros(n, device=device, requires_grad=True) for n in sizes]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        return timed(opt.step)

    each = step_seconds([1] * OVERHEAD_OPS) / OVERHEAD_OPS
    numel = max(1, nbytes // 4 // ADAMW_TENSORS)
    big = step_seconds([numel] * ADAMW_TENSORS)
    return 4 * numel * ADAMW_TENSORS / max(big - ADAMW_TENSORS * each, 1e-3 * big), each


GEMM_TIMING_CPU_S = 0.1
"""Seconds one timing of :func:`gemm_rate` spans on a CPU device: many scheduler time slices (its docstring)."""


def gemm_timing_s(device: Any) -> float:
    """Seconds one timing of :func:`gemm_rate` spans by default on `device`: :data:`GEMM_TIMING_CPU_S` on a CPU,
    10 ms elsewhere (a GPU's kernels queue back to back; nothing shares its time slices)."""
    return GEMM_TIMING_CPU_S if getattr(device, "type", str(device)) == "cpu" else 0.01


def gemm_rate(
    device: Any,
    m: int,
    n: int,
    k: int,
    dtype: str,
    opts: ProbeOptions,
    target_s: float | None = None,
    barrier: Callable[[], Any] | None = None,
) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in `dtype` on `device`, run back to back as in training (module
    docstring): ``inner`` calls per timing, ``inner`` chosen so one timing takes about `target_s`; each timing
    starts at `barrier` (every rank at once), the median timing counts.

    `target_s` defaults to :data:`GEMM_TIMING_CPU_S` on a CPU device and 10 ms elsewhere. CPU ranks share
    cores with each other and with other work, and a 10 ms timing fits inside one scheduler time slice: it
    measures a rank that held a whole core or one that waited. On 4 gloo ranks of a 2-core box at load ~10
    the 36 GEMMs of the bench's plans (one idle thread: 0.087-0.094 TFLOP/s each) timed at 10 ms came out at
    0.014-0.080 TFLOP/s, one shape 0.26-2.42x between two runs back to back; at 100 ms 0.012-0.036, 0.41-1.48x
    (docs/benchmarks.md, issue 30: the GPT's forward under emulate priced at 56 ms on such a table, its CPU
    time, against 213-255 ms measured)."""
    import torch

    if target_s is None:
        target_s = gemm_timing_s(device)

    dt = getattr(torch, dtype)
    a = torch.randn(m, k, device=device).to(dt)
    b = torch.randn(k, n, device=device).to(dt)
    c = torch.empty(m, n, device=device, dtype=dt)

    def run(calls: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b, out=c)
        _sync(device)
        return time.perf_counter() - t0

    for _ in range(max(1, opts.warmup)):
        one = run(1)
    inner = max(1, min(1000, math.ceil(target_s / max(one, 1e-9))))
    times = []
    for _ in range(max(1, opts.repeats)):
        if barrier is not None:
            barrier()
        times.append(run(inner))
    return 2.0 * m * n * k * inner / max(_median(times), 1e-12)


COLLECTIVE_COUNTS = (16, 4)
"""``k1, k2``: the two counts of collectives over the same bytes whose CPU difference :meth:`_Runner.collective_cpu`
divides by ``k1 - k2``."""
STEP_GEMMS = 32
"""Matmuls of :data:`INFLIGHT_GEMM` per repeat of :meth:`_Runner.collective_cpu` (divisible by both counts)."""


INFLIGHT_GEMM = 256
"""Side n of the square float32 matmul the in-flight all-reduce runs beside (:meth:`_Runner.inflight`): a few
milliseconds per call when 8 ranks share 2 cores, the granularity of the completion poll."""


class _Runner:
    """The collective measuring loops of one rank."""

    def __init__(self, opts: ProbeOptions, comm_device: Any):
        import torch
        import torch.distributed as dist

        self.dist = dist
        self.opts = opts
        self.dev = comm_device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.flag = torch.zeros(1, device=comm_device)
        numel = opts.nbytes // 4
        self.big = torch.ones(numel, device=comm_device)
        self.sink = torch.empty(numel, device=comm_device)
        self.tiny = torch.ones(1, device=comm_device)
        self.tiny_in = torch.empty(1, device=comm_device)

    def barrier(self, stop: bool = False) -> bool:
        """All ranks meet; True if any rank asked to stop."""
        self.flag.fill_(1.0 if stop else 0.0)
        self.dist.all_reduce(self.flag, op=self.dist.ReduceOp.MAX)
        return bool(self.flag.item() > 0)

    def timed(self, action: Callable[[], bool]) -> list[float]:
        """Warm-up + repeats of `action` (True when this rank's time counts), a barrier before each."""
        times = []
        for rep in range(self.opts.warmup + self.opts.repeats):
            self.barrier()
            t0 = time.perf_counter()
            counts = action()
            _sync(self.dev)
            if counts and rep >= self.opts.warmup:
                times.append(time.perf_counter() - t0)
        return times

    def collective_cpu(self) -> float:
        """Seconds of process CPU time (all threads) one collective costs this rank beyond its bytes, as a
        backward pays it (module docstring, 1.): per repeat, each count ``k`` of :data:`COLLECTIVE_COUNTS` in
        turn over the same :data:`STEP_GEMMS` matmuls and the same ``nbytes``; ``h`` from the pair's CPU
        difference, the median over the repeats. On CUDA the device is synchronised after the CPU clock is
        read: a spinning synchronise would count as the calls' CPU."""
        import torch

        n = INFLIGHT_GEMM
        a, b, c = (torch.randn(n, n, device=self.dev) for _ in range(3))
        flat = torch.ones(max(max(COLLECTIVE_COUNTS), self.opts.nbytes // 4), device=self.dev)
        k1, k2 = COLLECTIVE_COUNTS
        per = []
        for rep in range(self.opts.warmup + self.opts.repeats):
            took = {k: self._step_cpu(k, flat, a, b, c) for k in COLLECTIVE_COUNTS}
            if rep >= self.opts.warmup:
                per.append((took[k1] - took[k2]) / (k1 - k2))
        return max(0.0, _median(per))

    def _step_cpu(self, k: int, flat: Any, a: Any, b: Any, c: Any) -> float:
        """Process CPU seconds of one repeat of :meth:`collective_cpu` with `k` collectives: after a barrier,
        :data:`STEP_GEMMS` matmuls in `k` runs, an asynchronous all-reduce of the next ``1/k`` of `flat` after
        each, then every one waited for."""
        import torch

        pieces = flat.tensor_split(k)
        self.barrier()
        _sync(self.dev)
        t0 = time.process_time()
        works = []
        for piece in pieces:
            for _ in range(STEP_GEMMS // k):
                torch.mm(a, b, out=c)
            works.append(self.dist.all_reduce(piece, async_op=True))
        for w in works:
            w.wait()
        took = time.process_time() - t0
        _sync(self.dev)
        return took

    def send_with_ack(self, dst: int) -> bool:
        self.dist.send(self.big, dst)
        self.dist.recv(self.tiny_in, dst)
        return True

    def recv_and_ack(self, src: int) -> bool:
        self.dist.recv(self.sink, src)
        self.dist.send(self.tiny, src)
        return False

    def pingpong(self, peer: int, first: bool) -> list[float]:
        rtts = []
        for rep in range(2 + self.opts.latency_repeats):
            t0 = time.perf_counter()
            if first:
                self.dist.send(self.tiny, peer)
                self.dist.recv(self.tiny_in, peer)
                _sync(self.dev)
            else:
                self.dist.recv(self.tiny_in, peer)
                self.dist.send(self.tiny, peer)
            if rep >= 2:
                rtts.append(time.perf_counter() - t0)
        return rtts

    def p2p(self, rec: dict[str, Any]) -> None:
        """Phase 2: latency and bandwidth of every pair, in rounds, within the budget."""
        rounds = round_robin(self.world)
        deadline = time.monotonic() + self.opts.budget_s
        for k, pairs in enumerate(rounds):
            if self.barrier(stop=k > 0 and self.rank == 0 and time.monotonic() > deadline):
                rec["skipped"] = sum(len(p) for p in rounds[k:])
                return
            pair = next((p for p in pairs if self.rank in p), None)
            if pair is None:  # a bye: keep step with the barriers of the two directions
                self.timed(lambda: False)
                self.timed(lambda: False)
                continue
            a, b = pair
            rtts = self.pingpong(b if self.rank == a else a, first=self.rank == a)
            if self.rank == a:
                rec["lat"][pair] = rtts
            for sender, receiver in ((a, b), (b, a)):
                if self.rank == sender:
                    rec["p2p"][(sender, receiver)] = self.timed(lambda r=receiver: self.send_with_ack(r))
                else:
                    self.timed(lambda s=sender: self.recv_and_ack(s))

    def fanout(self, rec: dict[str, Any], nodes: list[list[int]]) -> None:
        """Phase 3: in round i, local rank i of every node sends to all its node's other ranks at once."""
        for i in range(max(len(node) for node in nodes)):
            mine = next(node for node in nodes if self.rank in node)
            sender = mine[i] if i < len(mine) else None
            peers = [r for r in mine if r != sender]
            if sender is None or not peers:
                self.timed(lambda: False)
            elif self.rank == sender:
                rec["fan"][sender] = (len(peers), self.timed(lambda p=peers: self._send_all(p)))
            else:
                self.timed(lambda s=sender: self.recv_and_ack(s))

    def _send_all(self, peers: list[int]) -> bool:
        import torch

        acks = [torch.empty(1, device=self.dev) for _ in peers]
        works = [self.dist.isend(self.big, p) for p in peers]
        works += [self.dist.irecv(buf, p) for buf, p in zip(acks, peers)]
        for w in works:
            w.wait()
        return True

    def node_pairs(self, rec: dict[str, Any], nodes: list[list[int]]) -> None:
        """Phase 4: for each node pair (A, B), all local ranks of A send to their twins in B at once."""
        size = len(nodes[0])
        me, local = divmod(self.rank, size)
        for pairs in round_robin(len(nodes)):
            pair = next((p for p in pairs if me in p), None)
            if pair is None:  # this node sits the round out
                self.timed(lambda: False)
                self.timed(lambda: False)
                continue
            for src, dst in (pair, pair[::-1]):
                if me == src:
                    peer = dst * size + local
                    rec["node"][(src, dst, local)] = self.timed(lambda p=peer: self.send_with_ack(p))
                else:
                    peer = src * size + local
                    self.timed(lambda p=peer: self.recv_and_ack(p))

    def allreduce(self, rec: dict[str, Any], progress: Callable[[str], None]) -> None:
        """Phase 5: every axis of every 2D mesh shape, all groups of the axis at once."""
        cache: dict[tuple[int, ...], Any] = {}
        for shape in mesh_shapes_2d(self.world):
            mesh = np.arange(self.world).reshape(shape)
            for axis in (0, 1):
                if shape[axis] == 1:
                    continue
                groups = [tuple(int(r) for r in g) for g in (mesh.T if axis == 0 else mesh)]
                mine = None
                for g in groups:  # every rank creates every group, in the same order
                    if g not in cache:
                        cache[g] = None if len(g) == self.world else self.dist.new_group(list(g))
                    if self.rank in g:
                        mine = cache[g]
                progress(f"all-reduce DeviceMesh{shape} axis {axis}: {len(groups)} groups of {shape[axis]}")
                rec["ar"][(shape, axis)] = self.timed(lambda g=mine: self._allreduce(g))
                rec["ar_small"][(shape, axis)] = self.timed(lambda g=mine: self._allreduce(g, self.tiny_in))
                for size in curve_sizes(self.opts.nbytes):
                    buf = self.sink[: size // 4]
                    rec["ar_curve"][(shape, axis, size)] = self.timed(lambda g=mine, b=buf: self._allreduce(g, b))
                if self.dev.type != "cpu":
                    continue
                for size in busy_sizes(self.opts.nbytes):
                    rec["ar_busy"][(shape, axis, size)] = self.inflight(mine, self.sink[: size // 4])

    def _allreduce(self, group: Any, buf: Any = None) -> bool:
        self.dist.all_reduce(self.sink if buf is None else buf, group=group)
        return True

    def inflight(self, group: Any, buf: Any = None) -> list[float]:
        """Seconds of one all-reduce of `buf` (default the large buffer) while this rank computes (module
        docstring, 6.): per repeat, a barrier, then the all-reduce issued asynchronously and matmuls of
        :data:`INFLIGHT_GEMM` run back to back until this rank sees it complete (``Work.is_completed`` polled
        between two matmuls); the time from issue to the first poll that saw it done."""
        import torch

        n = INFLIGHT_GEMM
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
        target = self.sink if buf is None else buf
        times = []
        for rep in range(1 + self.opts.repeats):
            self.barrier()
            t0 = time.perf_counter()
            work = self.dist.all_reduce(target, group=group, async_op=True)
            while not work.is_completed():
                torch.mm(a, b, out=c)
            took = time.perf_counter() - t0
            work.wait()
            if rep >= 1:
                times.append(took)
        return times


def probe(
    opts: ProbeOptions,
    host: str | None = None,
    kind: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> Measurements | None:
    """Measure the initialised default process group; every rank calls it. Rank 0 gets the Measurements,
    the others None. `host` overrides this rank's hostname (node identity); `kind` the device profile's name."""
    import torch
    import torch.distributed as dist

    start = time.monotonic()
    rank = dist.get_rank()

    def say(msg: str) -> None:
        if progress is not None and rank == 0:
            progress(msg)

    backend = str(dist.get_backend())
    cuda = torch.cuda.is_available()
    comm_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    compute_device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host or socket.gethostname())
    nodes = node_layout(hosts)
    say(f"{len(hosts)} ranks on {len(nodes)} node(s), {backend}; messages of {opts.nbytes / MiB:g} MiB")
    run = _Runner(opts, comm_device)
    rec: dict[str, Any] = {
        "lat": {},
        "p2p": {},
        "fan": {},
        "node": {},
        "ar": {},
        "ar_small": {},
        "ar_curve": {},
        "ar_busy": {},
        "skipped": 0,
    }
    say(f"device: matmul {', '.join(str(n) for n in opts.matmul_sizes)}; copy {opts.copy_bytes / MiB:g} MiB")
    if opts.matmul_shapes:
        say(f"device: {len(opts.matmul_shapes)} GEMMs at their own shapes")
    run.barrier()
    rec["device"] = measure_device(compute_device, opts, barrier=run.barrier)
    say(f"host CPU of a collective: {COLLECTIVE_COUNTS} all-reduces of {opts.nbytes / MiB:g} MiB beside compute")
    rec["device"]["collective_overhead"] = run.collective_cpu()
    say(f"point to point: {len(round_robin(len(hosts)))} rounds (budget {opts.budget_s:g} s)")
    run.p2p(rec)
    if len(hosts) > 1:
        say("fan-out: each rank to the other ranks of its node at once")
        run.fanout(rec, nodes if two_layer(nodes) else [list(range(len(hosts)))])
    if two_layer(nodes):
        say(f"node pairs: {len(round_robin(len(nodes)))} rounds")
        run.node_pairs(rec, nodes)
    run.allreduce(rec, say)
    gathered: list[Any] | None = [None] * len(hosts) if rank == 0 else None
    dist.gather_object(rec, gathered, dst=0)
    if rank != 0:
        return None
    assert gathered is not None
    if kind is None:
        kind = "probed-" + (_slug(torch.cuda.get_device_name(compute_device)) if cuda else "cpu")
    m = summarize(gathered, hosts, backend, opts, kind)
    m.seconds = time.monotonic() - start
    return m


def _slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split()) or "gpu"
