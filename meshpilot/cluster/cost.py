"""The one cost model every planner calls: collectives on mesh axes, and compute by roofline.

Collectives (Thakur, Rabenseifner & Gropp 2005; alpha = latency of the axis, B' = its per-rank bus
bandwidth from Eq. 3, n = devices per group, M = bytes). Each collective takes the fastest algorithm:

  all-reduce      ring          2(n-1)/n * M/B' + 2(n-1) * alpha
                  Rabenseifner  2(n-1)/n * M/B' + 2*ceil(log2 n) * alpha      (reduce-scatter + all-gather)
                  rec. doubling ceil(log2 n) * (alpha + M/B')                 (small messages)
  all-gather      ring / rec. doubling  (n-1)/n * M/B' + min(n-1, ceil(log2 n)) * alpha   (M = output bytes)
  reduce-scatter  the same, M = input bytes
  all-to-all      pairwise      max((n-1)/n * M/B', M * X) + (n-1) * alpha     (M = bytes each rank holds)
                  X = max over layers j and units u crossed of  sum_g k_g(u) (n - k_g(u)) / n / GroupBW_j(u)
                  (k_g(u): members of group g inside u; every member sends M/n to each peer, so all of u's
                  members' traffic to the outside leaves through u's uplink at once: on 2 nodes x 4, an
                  axis of all 8 ranks puts 2M through each node's link, where a ring puts (7/8)M;
                  :func:`meshpilot.cluster.mesh.exchange_seconds_per_byte`)
  broadcast       binomial tree ceil(log2 n) * (alpha + M/B'),  or scatter + all-gather
                                2(n-1)/n * M/B' + (ceil(log2 n) + n - 1) * alpha
  send/recv       alpha + M / P2P(src, dst)

Ignoring alpha, all-reduce's M / T is Eq. 4's algorithm bandwidth B = n / (2(n-1)) * B'.

Measured curves. Where the cluster file holds an all-reduce curve for the axis' groups (``[[calibration]]``
``curve1`` / ``curve2``: ``meshpilot probe`` times every group of the axis at once at several message sizes),
the three ring collectives take their time from it instead (:func:`on_curve`; points (M_i, t_i), t made
non-decreasing):

  all-reduce      t(M) = t_i + (M - M_i) * (t_{i+1} - t_i) / (M_{i+1} - M_i)   for M_i <= M <= M_{i+1}
                  t(M) = t_0 below the first point; the last segment's slope beyond the last;
                  t made non-decreasing by least squares first (pool adjacent violators)
  all-gather      t(M) / 2     (a ring all-reduce is a reduce-scatter and an all-gather of the same M:
  reduce-scatter  t(M) / 2      each half of both the bandwidth and the latency terms above)

On a CPU device (gloo) a reduce-scatter is an all-reduce of the whole buffer, curve or not: gloo has no
reduce-scatter algorithm and ProcessGroupGloo all-reduces, then keeps its chunk.

Contention with compute (CPU devices only). On a CPU device the backend's threads (gloo's) share the cores
with the ranks' compute, so a collective in flight while its rank computes takes longer than alone. Where the
cluster file holds the axis' all-reduce curve measured while every rank computes (``busy1`` / ``busy2``,
``Calibration.busy_curve``; ``meshpilot probe`` phase 6) as well as the curve alone:

  busy factor     f(M) = max(1, busy(M) / curve(M))    both by :func:`on_curve`; M = the bytes the
                                                        collective issues, whatever its kind

and f = 1 on other devices (a GPU's collectives run on their own stream and engines) or without both curves
(:meth:`CostModel.busy_factor`, the one home of this rule). The simulator slows a transfer by f while its
rank computes (``meshpilot.sim``, *Contention*); the serial step (accounting) never overlaps, so it never
applies f.

Host cost per collective. Every collective above (all-reduce, all-gather, reduce-scatter, all-to-all,
broadcast; not the point-to-point sends) costs the rank that issues it a fixed amount of host CPU beyond its
bytes, ``h = DeviceProfile.collective_overhead`` (the Python and dispatch of the call, the backend's per-call
work; ``meshpilot probe`` measures it, 0 where not measured, as in every built-in profile):

  collective      t + h     where t is its time above (alpha-beta or the measured curve), n > 1 and M > 0

one rule (:meth:`CostModel._host`), so the accounting, the overlap pricing of the gradient buckets, the
simulator (which splits ``t + h`` into latency and bandwidth parts: ``h`` lands in the latency) and the bucket
size rule (``planner.buckets``) all see it alike. Where it runs (:meth:`CostModel.compute_host_s`):

  on a CPU device  h is taken from the compute cores (gloo's threads and the call run where the ranks
                   compute): the overlap pricing of the buckets and gather groups and the simulator put it
                   on the rank's compute stream when the collective is issued, and only ``t`` on its link
                   (``planner.buckets.collective_parts``); it never hides behind the backward
  elsewhere        h stays in the collective's latency (a GPU's collectives run on their own stream; NCCL's
                   launch is microseconds, 0 in every built-in profile)

The serial step (accounting) counts ``t + h`` either way. What it leaves out: a measured curve's wall times
already contain the part of ``h`` the calling thread spent while the collective ran alone, which ``t + h``
counts again; and the bytes' own CPU on a CPU device (gloo's copies and sums, about 1 ms per MiB on 4 ranks
sharing 2 cores) stays on the link.

Coalesced collectives (what the ILP prices a gradient's reduction at). The runtime does not issue every
gradient's reduction on its own: it flattens gradients into buckets (``planner.buckets``), so a reduction of
``M`` bytes pays the fixed per-call part (latency, ``h``, a measured curve's constant) once per bucket, not
once per gradient. On a CPU device the ILP (``planner.ilp.Pricer``) prices it as its share of a collective of
the bucket size ``S`` (``planner.buckets.bucket_bytes`` of the axis, the latency rule's;
:meth:`CostModel.coalesced`):

  coalesced       t'(max(M, S)) * M / max(M, S)      t' the kind's time above, ``t + h`` included

exact for a gradient of ``S`` bytes or more (its own bucket), a per-byte share of an ``S``-byte bucket below.
Priced one by one, 53 gradient reduce-scatters on a probed curve whose every call costs 3.6 ms or more made the
GPT's forced ZeRO-3 plan dearer than gathering activations: 71 all-gathers a step issued, where the ZeRO-3
layouts with their buckets and gather groups issue 14 (docs/benchmarks.md, issue 30).

Alpha and B' cannot describe what the probe sees on a slow TCP link: a 16 KiB all-reduce of 8 gloo ranks
costs 3 to 9 times a 4-byte one (measured at different loads) and a 1 MiB one about twice its bandwidth
term (docs/cluster.md, "Measured curves").

Compute (roofline): t = max(FLOPs / rate, bytes / (membw * eff_m)), where rate is, for a GEMM
[m, k] @ [k, n], the rate measured at the nearest shape of its dtype (``DeviceProfile.matmul_flops``; a
probed profile's table), and otherwise peak(dtype) * eff_c. A probed profile has eff_c = eff_m = 1: its
peak is the best matmul rate the probe measured, membw its measured copy bandwidth (read + write).
A Float8 linear's product (``OpNode.float8``, ``config_plan``'s ``float8=linears``) is priced at the profile's
Float8 rate for its shape plus its operands' casts, memory-bound kernels of their own (:meth:`CostModel.float8_gemm`).
The accounting adds the device's fixed cost per operator (``DeviceProfile.op_overhead``) to each
operator's roofline and prices the optimizer's update from ``membw`` (``planner.accounting``).

Attention, where the profile holds a fused kernel's measured rates (``DeviceProfile.attention``: R_f, R_b
non-causal, C_f, C_b causal, all on ``attention_flops``' count F of the whole ``t × s`` square; R = R_f or
R_b, C = C_f or C_b by direction; :meth:`CostModel.attention`), a device's share F_d = F / split runs

  non-causal                      F_d / R
  causal, query rows whole        F_d / C                                   (the kernel skips the hidden half)
  causal, query rows split n ways (n − 1)/n · F_d / R  +  1/n · F_d / C      (``ops.causal_rows``, contiguous)
  the same, balanced (zig-zag)   (2n − 1)/(4n) · F_d / R  +  1/(2n) · F_d / C   (two chunks a rank, n ≥ 2)

The third is the slowest rank of the all-gather method with contiguous rows: rank n − 1's rows see every
earlier key block whole (the rectangle, non-causal) and their own square causally; every rank is priced as it
(the step waits for it). The fourth is every rank's with Llama 3's layout (``planner.sequence_order``'s zig-zag
order, ``OpNode.zigzag``): the sequence in 2n chunks of m = t / 2n rows, rank r holding chunks r and 2n − 1 − r,
so its rows see (r + 2n − 1 − r) · m² = (2n − 1) · m² earlier keys whole and two causal m × m squares. Of the
whole square's t² = 4n² · m² pairs a rank's share F_d counts 4n · m²: (2n − 1)/(4n) of it at the non-causal rate,
2 · m², 1/(2n) of it, at the causal one (C is on the whole square's count, so each square is priced at its full
m² / C). The rows of every rank together make the whole call's causal work, the contiguous split's average.
Without measured rates an attention call is priced as any op (F_d at peak · eff_c: the math path computes
every pair).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from meshpilot.cluster.devices import FLOAT8
from meshpilot.cluster.mesh import LogicalMesh

Axes = int | Sequence[int]


def on_curve(curve: Sequence[tuple[int, float]], nbytes: float) -> float:
    """Seconds of an all-reduce of `nbytes` on a measured curve of (bytes, seconds) points, bytes ascending:
    linear between points, the first point's time below it, the last segment's slope beyond the last
    point (the per-byte cost of the largest messages measured; proportional to the last point when there is
    one). Times are made non-decreasing first (:func:`monotone`): a larger message is never cheaper, so a
    measured dip is probe noise."""
    xs = [float(b) for b, _ in curve]
    ys = monotone([t for _, t in curve])
    if nbytes <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if nbytes <= xs[i]:
            return ys[i - 1] + (nbytes - xs[i - 1]) * (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
    if slope <= 0.0:
        slope = ys[-1] / xs[-1]
    return ys[-1] + (nbytes - xs[-1]) * slope


def monotone(ys: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `ys` in least squares (pool adjacent violators): a run of points
    that dips is replaced by its mean, so one noisy point neither lifts its neighbours (a running maximum
    would) nor is dropped."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([float(y), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


def _log2(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _key(axes: Axes) -> tuple[int, ...]:
    """`axes` as the tuple the per-axis caches of :class:`CostModel` key on."""
    return (axes,) if isinstance(axes, int) else tuple(axes)


class CostModel:
    """Seconds for collectives over the axes of one logical mesh, and for compute on its devices."""

    def __init__(self, mesh: LogicalMesh):
        self.mesh = mesh
        self.device = mesh.cluster.device
        self._axis_cache: dict[tuple[int, ...], tuple[int, float, float]] = {}
        self._curve_cache: dict[tuple[int, ...], tuple[tuple[int, float], ...] | None] = {}
        self._busy_cache: dict[tuple[int, ...], tuple[tuple[int, float], ...] | None] = {}
        self._exchange_cache: dict[tuple[int, ...], float] = {}

    def _axis(self, axes: Axes) -> tuple[int, float, float]:
        """(n, B', alpha) for `axes`, cached: Eq. 3 is the expensive part."""
        key = _key(axes)
        if key not in self._axis_cache:
            n = self.mesh.axis_size(key)
            bw = self.mesh.bus_bandwidth(key) if n > 1 else math.inf
            alpha = self.mesh.latency(key) if n > 1 else 0.0
            self._axis_cache[key] = (n, bw, alpha)
        return self._axis_cache[key]

    def _curve(self, axes: Axes) -> tuple[tuple[int, float], ...] | None:
        """The axis' measured all-reduce curve (module docstring), cached; None when not measured."""
        key = _key(axes)
        if key not in self._curve_cache:
            self._curve_cache[key] = self.mesh.allreduce_curve(key) if self.mesh.axis_size(key) > 1 else None
        return self._curve_cache[key]

    def busy_factor(self, nbytes: float, axes: Axes) -> float:
        """How many times longer a collective issuing `nbytes` on `axes` takes while its rank computes (module
        docstring, *Contention with compute*): 1.0 unless the device is a CPU and the axis has both measured
        curves."""
        if not self.device.is_cpu or nbytes <= 0:
            return 1.0
        key = _key(axes)
        if key not in self._busy_cache:
            busy = self.mesh.allreduce_busy_curve(key) if self.mesh.axis_size(key) > 1 else None
            self._busy_cache[key] = busy
        busy, alone = self._busy_cache[key], self._curve(axes)
        if busy is None or alone is None:
            return 1.0
        return max(1.0, on_curve(busy, nbytes) / on_curve(alone, nbytes))

    def _host(self, seconds: float) -> float:
        """A collective that runs (`seconds` > 0) costs its host overhead beyond its bytes (module docstring,
        *Host cost per collective*)."""
        return seconds + self.device.collective_overhead if seconds > 0 else 0.0

    @property
    def host_on_compute(self) -> bool:
        """Whether issuing a collective takes a host cost from the rank's compute stream: a CPU device with a
        positive ``collective_overhead`` (module docstring, *Host cost per collective*)."""
        return self.device.is_cpu and self.device.collective_overhead > 0

    def compute_host_s(self, seconds: float) -> float:
        """Of a collective priced `seconds` (``t + h``), the part its rank's compute stream pays when it is
        issued: ``h`` where :attr:`host_on_compute`, else 0 (module docstring, *Host cost per collective*)."""
        return self.device.collective_overhead if self.host_on_compute and seconds > 0 else 0.0

    def coalesced(self, kind: str, nbytes: float, axes: Axes, size: float) -> float:
        """Seconds of `nbytes` of a collective of `kind` (a ``CollectiveKind`` value) the runtime coalesces into
        one of about `size` bytes (a gradient bucket): its share of that collective (module docstring,
        *Coalesced collectives*)."""
        if nbytes <= 0:
            return 0.0
        whole = max(float(nbytes), float(size))
        return getattr(self, kind)(whole, axes) * nbytes / whole

    def all_reduce(self, nbytes: float, axes: Axes) -> float:
        """All-reduce of `nbytes` (each rank's buffer) over `axes`."""
        n, bw, a = self._axis(axes)
        if n == 1 or nbytes == 0:
            return 0.0
        curve = self._curve(axes)
        if curve is not None:
            return self._host(on_curve(curve, nbytes))
        ring = 2 * (n - 1) / n * nbytes / bw
        return self._host(min(ring + 2 * (n - 1) * a, ring + 2 * _log2(n) * a, _log2(n) * (a + nbytes / bw)))

    def all_gather(self, nbytes: float, axes: Axes) -> float:
        """All-gather producing `nbytes` on every rank (each contributes nbytes / n)."""
        n, bw, a = self._axis(axes)
        if n == 1 or nbytes == 0:
            return 0.0
        curve = self._curve(axes)
        if curve is not None:
            return self._host(on_curve(curve, nbytes) / 2)
        return self._host((n - 1) / n * nbytes / bw + min(n - 1, _log2(n)) * a)

    def reduce_scatter(self, nbytes: float, axes: Axes) -> float:
        """Reduce-scatter of an `nbytes` buffer per rank (each keeps nbytes / n). On a CPU device (gloo, which
        has no reduce-scatter algorithm: ProcessGroupGloo all-reduces the whole buffer and keeps its chunk)
        it costs an all-reduce; measured on 8 emulated ranks at 2 MiB: 83.3 ms against 83.4 ms."""
        if self.device.is_cpu:
            return self.all_reduce(nbytes, axes)
        return self.all_gather(nbytes, axes)

    def all_to_all(self, nbytes: float, axes: Axes) -> float:
        """All-to-all where every rank holds `nbytes` and keeps 1/n of it."""
        n, bw, a = self._axis(axes)
        if n == 1 or nbytes == 0:
            return 0.0
        key = _key(axes)
        if key not in self._exchange_cache:
            self._exchange_cache[key] = self.mesh.exchange_seconds_per_byte(key)
        return self._host(max((n - 1) / n * nbytes / bw, nbytes * self._exchange_cache[key]) + (n - 1) * a)

    def broadcast(self, nbytes: float, axes: Axes) -> float:
        """Broadcast of `nbytes` from one rank of each group to the others."""
        n, bw, a = self._axis(axes)
        if n == 1 or nbytes == 0:
            return 0.0
        tree = _log2(n) * (a + nbytes / bw)
        scatter_gather = 2 * (n - 1) / n * nbytes / bw + (_log2(n) + n - 1) * a
        return self._host(min(tree, scatter_gather))

    def send_recv(self, nbytes: float, axes: Axes) -> float:
        """Point-to-point transfer of `nbytes` between neighbours along `axes`."""
        n, bw, a = self._axis(axes)
        if n == 1 or nbytes == 0:
            return 0.0
        return a + nbytes / bw

    def send_recv_ranks(self, nbytes: float, src: int, dst: int) -> float:
        """Point-to-point transfer of `nbytes` between two physical ranks (pipeline stages)."""
        if src == dst or nbytes == 0:
            return 0.0
        cluster = self.mesh.cluster
        return cluster.p2p_latency(src, dst) + nbytes / cluster.p2p_bandwidth(src, dst)

    def compute(
        self, flops: float, nbytes: float, dtype: str = "float32", gemm: tuple[int, int, int] | None = None
    ) -> float:
        """Roofline time of a kernel doing `flops` and moving `nbytes` to and from device memory; `gemm`
        (m, n, k) prices a matmul at the rate measured for its shape (module docstring)."""
        d = self.device
        if not flops:
            t_flops = 0.0
        elif gemm is not None:
            t_flops = flops / d.matmul_flops(*gemm, dtype)
        else:
            t_flops = flops / (d.flops_for(dtype) * d.compute_efficiency)
        t_bytes = nbytes / (d.memory_bandwidth * d.memory_efficiency) if nbytes else 0.0
        return max(t_flops, t_bytes)

    def attention(
        self, flops: float, nbytes: float, causal: bool, rows_split: int, backward: bool, balanced: bool = False
    ) -> float | None:
        """Seconds of a device's share `flops` of an attention call at the profile's measured rates (module
        docstring); `rows_split` the ways its query rows are split (causal calls only), `balanced` each rank
        holding two zig-zag chunks rather than one contiguous run; None without rates."""
        rates = self.device.attention
        if rates is None:
            return None
        full = rates.backward if backward else rates.forward
        if not causal:
            t_flops = flops / full
        else:
            diag = rates.causal_backward if backward else rates.causal_forward
            n = max(rows_split, 1)
            if balanced and n > 1:
                t_flops = (2 * n - 1) / (4 * n) * flops / full + flops / (2 * n) / diag
            else:
                t_flops = (n - 1) / n * flops / full + flops / n / diag
        t_bytes = nbytes / (self.device.memory_bandwidth * self.device.memory_efficiency) if nbytes else 0.0
        return max(t_flops, t_bytes)

    def float8_gemm(self, flops: float, nbytes: float, gemm: tuple[int, int, int]) -> float:
        """Seconds of a tensorwise Float8 product ``[m, k] @ [k, n]`` (`gemm`): its roofline at the Float8 rate
        measured for the nearest shape (``devices.FLOAT8``), plus the casts of its two operands from bf16
        (``DeviceProfile.float8_cast_seconds``), separate memory-bound kernels before it."""
        return self.compute(flops, nbytes, FLOAT8, gemm) + self.device.float8_cast_seconds(*gemm)
