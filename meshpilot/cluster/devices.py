"""Device profiles: what one accelerator can compute, move and hold.

Peak FLOP/s are the vendors' dense (no sparsity) datasheet numbers; the cost model scales them by an
efficiency factor, since no kernel reaches the peak. Sources: NVIDIA V100, A100, H100 and H200 datasheets.

A probed profile (``meshpilot probe``; a cluster file's ``[device_profile]``) carries measured rates instead,
with efficiency 1.0, and optionally a table of matmul rates measured at given shapes
(:class:`MatmulRate`; ``meshpilot probe --matmul-shapes-from MODEL`` measures a model's own GEMMs).
:meth:`DeviceProfile.matmul_flops` prices a GEMM ``[m, k] @ [k, n]`` at the rate measured for the nearest
shape of its dtype (distance ``Σ (log x − log x')²`` over m, n, k), and at ``peak × compute_efficiency``
when the table has no entry of that dtype.

Three fixed costs complete a probed profile (``meshpilot probe`` measures them; 0 = not modelled, the
default of every built-in profile, whose vendors publish no such number):

* ``op_overhead`` — seconds of one tiny operator run back to back with others (one-element ``add``): what
  every kernel costs beyond its FLOPs and bytes. On a CPU it is the framework's dispatch (the kernel runs
  in the calling thread); on a GPU the launch and dispatch cost of a kernel. The roofline adds it once per
  operator (``accounting.ComputeCost``).
* ``foreach_overhead`` — seconds per tensor of one ``torch._foreach_*`` operator over a list of tiny
  tensors: a CPU loops over the list (about one dispatch per tensor), a GPU fuses the list into a few
  launches (a fraction of ``op_overhead`` per tensor). The optimizer step pays it per parameter shard
  and foreach operator (``accounting.optimizer_seconds``).
* ``collective_overhead`` — seconds of host CPU one collective costs the issuing rank beyond its bytes: the
  Python and dispatch of the call and the backend's own per-call work (gloo's threads on a CPU; a few launches
  on a GPU). The probe fits it from the process CPU time (all threads) of the same compute and bytes with two
  counts of asynchronous all-reduces, issued as a backward issues its buckets (``meshpilot.cluster.probe``).
  The cost model adds it to every collective's time (``meshpilot.cluster.cost``).
* ``call_overhead`` — seconds of host time one call of the runtime's recorded program costs (one line of its
  generated code: the Python line, the ATen dispatch and the calls that op makes inside, the allocator), measured
  by the probe over a tiny recorded forward + backward (``probe.call_overhead``): the seconds of one run over its
  calls. The accounting prices ``accounting.runtime_calls`` of them per step (``ComputeCost``); where it is
  measured it replaces ``op_overhead`` as the operators' fixed cost (the tiny ``add`` is the dispatch floor of a
  call, not a step's).

The optimizer's update at the rate the foreach AdamW step runs (``meshpilot probe`` measures both, 0 = not
measured: the update priced as 21 parameter-sized streams at ``memory_bandwidth``, ``accounting.optimizer_seconds``):

* ``adamw_bandwidth`` — bytes of parameters per second one ``torch.optim.AdamW(foreach=True)`` step updates (the
  step over large tensors, their bytes over its seconds less the per-tensor cost);
* ``adamw_overhead`` — seconds per parameter tensor of that step (the step over many one-element tensors, per
  tensor).

Attention (:class:`AttentionRates`; only the frontier presets' measured H100s carry them): a fused attention
kernel's measured FLOP/s on ``ops.attention.attention_flops``' count (the whole ``t × s`` score square, 2 matmuls
forward, 5 backward with the scores recomputed), non-causal and causal, forward and backward. Flash attention skips
the key blocks a causal mask hides, so a causal call runs at about twice the non-causal rate on that count
(``CostModel.attention``). Without them an attention call is priced as any op: its whole count at the peak times
``compute_efficiency`` (the math path, which computes every pair, as a CPU does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TFLOPS = 1e12
GB = 1e9
GiB = 1024**3
FLOAT8 = "float8_e4m3fn"
"""The dtype of a Float8 product's rates in a profile's matmul table: ``torch._scaled_mm`` of e4m3 operands, one
scale per tensor, bf16 out (``config_plan``'s ``float8=linears``)."""


@dataclass(frozen=True)
class MatmulRate:
    """One measured GEMM: ``[m, k] @ [k, n]`` in `dtype` ran at `flops` FLOP/s (``2 m n k`` / best time)."""

    m: int
    n: int
    k: int
    dtype: str
    flops: float

    def distance(self, m: int, n: int, k: int) -> float:
        """Squared distance in log space to the GEMM ``(m, n, k)``."""
        return sum(math.log(max(a, 1) / max(b, 1)) ** 2 for a, b in ((self.m, m), (self.n, n), (self.k, k)))


@dataclass(frozen=True)
class AttentionRates:
    """A fused attention kernel's FLOP/s on ``attention_flops``' count (the whole ``t × s`` square, causal or
    not), measured at one shape: a causal call's rate counts the pairs it skips, as its time is what it is."""

    forward: float
    backward: float
    causal_forward: float
    causal_backward: float


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator's compute, memory bandwidth and capacity."""

    kind: str
    """Name used in cluster files (`device = "a100-80gb"`)."""
    peak_flops: dict[str, float] = field(default_factory=dict)
    """Peak dense FLOP/s per dtype name ("float32", "bfloat16", ...)."""
    memory_bandwidth: float = 0.0
    """Bytes per second between device memory and the compute units."""
    memory_bytes: int = 0
    """Device memory capacity in bytes."""
    compute_efficiency: float = 0.6
    """Fraction of peak FLOP/s that large matmuls reach; the roofline uses it."""
    memory_efficiency: float = 0.8
    """Fraction of peak memory bandwidth that streaming kernels reach."""
    matmul: tuple[MatmulRate, ...] = ()
    """Matmul rates measured at given shapes (a probed profile); empty: every GEMM at the peak rate."""
    op_overhead: float = 0.0
    """Seconds one operator costs beyond its roofline (module docstring); 0: not modelled."""
    foreach_overhead: float = 0.0
    """Seconds per tensor of one ``torch._foreach_*`` operator (module docstring); 0: not modelled."""
    collective_overhead: float = 0.0
    """Seconds of host CPU one collective costs beyond its bytes (module docstring); 0: not modelled."""
    float8_cast_bytes: float = 0.0
    """Bytes of memory traffic that each element of a Float8 product's two operands costs to cast (amax, scale,
    cast to float8 in the layout the product reads: :meth:`float8_cast_seconds`); 0: not priced."""
    attention: AttentionRates | None = None
    """A fused attention kernel's measured rates (module docstring); None: attention priced as any op."""
    call_overhead: float = 0.0
    """Seconds of host time one call of the runtime's program costs (module docstring); 0: not modelled."""
    adamw_bandwidth: float = 0.0
    """Bytes of parameters per second the foreach AdamW step updates (module docstring); 0: not measured."""
    adamw_overhead: float = 0.0
    """Seconds per parameter tensor of the foreach AdamW step (module docstring); meaningful with
    :attr:`adamw_bandwidth`."""

    @property
    def has_float8(self) -> bool:
        """Whether the profile holds measured Float8 GEMM rates (``FLOAT8`` entries of :attr:`matmul`)."""
        return any(r.dtype == FLOAT8 for r in self.matmul)

    def float8_cast_seconds(self, m: int, n: int, k: int) -> float:
        """Seconds of casting the operands ``[m, k]`` and ``[k, n]`` of one Float8 product from bf16:
        :attr:`float8_cast_bytes` per element at ``memory_bandwidth · memory_efficiency``."""
        return self.float8_cast_bytes * (m * k + k * n) / (self.memory_bandwidth * self.memory_efficiency)

    @property
    def is_cpu(self) -> bool:
        """A CPU device: its kind has the word ``cpu`` (``-``-separated): the ``cpu`` preset, ``probed-cpu``
        (what ``meshpilot probe`` names CPU ranks), ``local-cpu`` (the benchmarks' loopback cluster). Its meshes
        run on gloo, where DTensor lacks all-to-all (``meshpilot.sharding.reshard.as_issued``) and a
        collective's host cost runs on the compute cores (``CostModel.compute_host_s``)."""
        return "cpu" in self.kind.split("-")

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for `dtype`, falling back to float32 for dtypes without a faster path."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops["float32"]

    def matmul_flops(self, m: int, n: int, k: int, dtype: str) -> float:
        """FLOP/s a GEMM ``[m, k] @ [k, n]`` reaches: the nearest measured shape of its dtype, else the
        peak times `compute_efficiency` (module docstring)."""
        same = [r for r in self.matmul if r.dtype == dtype]
        if not same:
            return self.flops_for(dtype) * self.compute_efficiency
        return min(same, key=lambda r: r.distance(m, n, k)).flops


def _gpu(kind: str, fp32: float, tf32: float, half: float, membw_gbps: float, mem_gib: float) -> DeviceProfile:
    flops = {"float32": fp32 * TFLOPS, "tf32": tf32 * TFLOPS}
    flops.update({"float16": half * TFLOPS, "bfloat16": half * TFLOPS})
    return DeviceProfile(kind, flops, membw_gbps * GB, int(mem_gib * GiB))


DEVICES: dict[str, DeviceProfile] = {
    # V100 SXM2: 15.7 TFLOP/s fp32, 125 TFLOP/s fp16 tensor cores, 900 GB/s HBM2 (no bf16: fp16 numbers).
    "v100-16gb": _gpu("v100-16gb", 15.7, 15.7, 125, 900, 16),
    "v100-32gb": _gpu("v100-32gb", 15.7, 15.7, 125, 900, 32),
    # A100 SXM: 19.5 fp32, 156 tf32, 312 fp16/bf16 TFLOP/s; 1555 GB/s (40GB) or 2039 GB/s (80GB).
    "a100-40gb": _gpu("a100-40gb", 19.5, 156, 312, 1555, 40),
    "a100-80gb": _gpu("a100-80gb", 19.5, 156, 312, 2039, 80),
    # H100 SXM: 67 fp32, 494.5 tf32, 989.5 bf16 TFLOP/s dense; 3350 GB/s HBM3, 80 GB.
    "h100": _gpu("h100", 67, 494.5, 989.5, 3350, 80),
    # H200 SXM: H100's compute with 4800 GB/s HBM3e and 141 GB.
    "h200": _gpu("h200", 67, 494.5, 989.5, 4800, 141),
    # A generic server CPU socket: ~1 TFLOP/s fp32 AVX-512, ~100 GB/s DDR, 256 GiB.
    "cpu": DeviceProfile("cpu", {"float32": 1.0 * TFLOPS}, 100 * GB, 256 * GiB, 0.5, 0.6),
}


def device_profile(kind: str) -> DeviceProfile:
    """The profile named `kind`; raises KeyError with the known names otherwise."""
    try:
        return DEVICES[kind]
    except KeyError:
        raise KeyError(kind) from None
