"""Built-in clusters from the three papers, each with its source.

Bandwidths are in GB/s as the papers quote them. ATP's matrices use aggregate NVLink/PCIe numbers
(an A100 has 12 NVLink-v3 links of 50 GB/s: group bandwidth 600 GB/s; PCIe 4.0 x16: 64 GB/s, §2.1)
and network links per direction (200 Gbps HDR = 25 GB/s, Fig. 7a). Presets with a free size take it
after a colon: ``atp-ic5:64`` (devices), ``atp-ic6:4`` (q of a q x q torus), ``dgx-h100:16`` (nodes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshpilot.cluster.devices import FLOAT8
from meshpilot.cluster.loader import cluster_from_dict
from meshpilot.cluster.topology import Cluster
from meshpilot.errors import UserError


def _layer(name: str, ranks: int, p2p: Any, group: Any, latency_us: float) -> dict[str, Any]:
    return {"name": name, "ranks": ranks, "p2p_GBps": p2p, "group_GBps": group, "latency_us": latency_us}


def _cluster(name: str, device: str, layers: list[dict[str, Any]], calibration: list | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "device": device, "layers": layers}
    if calibration:
        out["calibration"] = calibration
    return out


def _ic1(name: str, calibrated: bool) -> dict[str, Any]:
    # ATP §5.1/§5.3, IC1: Machine A (8 x A100 80GB, 2 CPU sockets) with NVLink off (NCCL_P2P_DISABLE=1), so
    # every transfer is staged through host memory. The paper gives no matrix; these effective numbers are
    # chosen so that the matrix reproduces the paper's calibrated DeviceMesh(2,4) bandwidths (B1 = 1.20,
    # B2 = 4.95 GB/s). §5.3: the matrix cannot predict the measured DeviceMesh(8,1) B1 = 0.97 GB/s.
    layers = [_layer("socket", 2, 4.8, 4.8, 10.0), _layer("gpu", 4, 3.0, 7.4, 5.0)]
    cal = None
    if calibrated:
        # ATP §5.3: "For DeviceMesh(2,4), B1 is calibrated to 1.20 GB/s and B2 to 4.95 GB/s. For
        # DeviceMesh(8,1), B1 is calibrated to 0.97 GB/s."
        cal = [{"mesh": [2, 4], "B1_GBps": 1.20, "B2_GBps": 4.95}, {"mesh": [8, 1], "B1_GBps": 0.97}]
    return _cluster(name, "a100-80gb", layers, cal)


def _ic2() -> dict[str, Any]:
    # ATP §5.3, IC2: Machine B, 8 x A100 80GB in NVLink pairs (Fig. 2b); "the first layer is 4 dual-GPUs
    # interconnected by PCIe and the second layer consists of 2 GPUs connected by NVLink". PCIe 4.0 x16 =
    # 64 GB/s (§2.1); a pair's NVLink bridge counted as 4 NVLink-v3 links = 200 GB/s (Fig. 7a's convention).
    return _cluster("atp-ic2", "a100-80gb", [_layer("pair", 4, 64.0, 64.0, 5.0), _layer("gpu", 2, 200.0, 200.0, 2.0)])


def _ic3() -> dict[str, Any]:
    # ATP §5.1, IC3: Machine A with NVSwitch: one layer, every A100 at 600 GB/s NVLink-v3 (Fig. 2a).
    return _cluster("atp-ic3", "a100-80gb", [_layer("gpu", 8, 600.0, 600.0, 2.0)])


def _ic4() -> dict[str, Any]:
    # ATP §5.1, IC4: Cluster C, 2 nodes of 8 A100 (NVSwitch inside) with 200 Gbps InfiniBand between nodes.
    return _cluster("atp-ic4", "a100-80gb", [_layer("node", 2, 25.0, 25.0, 5.0), _layer("gpu", 8, 600.0, 600.0, 2.0)])


def _ic5(n: int) -> dict[str, Any]:
    # ATP §5.4, IC5: every GPU on an NVLink-Network switch (Ishii & Wells, Hot Chips 34, 2022): one layer,
    # 900 GB/s NVLink-4 per H100, non-blocking, so B1' = B2' = GroupBW.
    return _cluster(f"atp-ic5:{n}", "h100", [_layer("gpu", n, 900.0, 900.0, 2.0)])


def _ic6(q: int) -> dict[str, Any]:
    # ATP §5.4 and Fig. 7b, IC6: q x q 2D torus of 25 GB/s links. Lower layer: a ring of q devices, P2P 25 to
    # each neighbour, group bandwidth 50 (both directions). Upper layer: q rings, each joined to its two
    # neighbouring rings by q links (P2P = 25 q), group bandwidth twice that.
    def ring(r: int, bw: float) -> list[list[float]]:
        m = [[0.0] * r for _ in range(r)]
        for i in range(r):
            for j in ((i + 1) % r, (i - 1) % r):  # q = 2: both neighbours are the same device, two links
                if j != i:
                    m[i][j] += bw
        return m

    if q < 2:
        raise UserError(f"atp-ic6:{q}: a torus needs q >= 2; e.g. atp-ic6:4 for 4 x 4 devices")
    group_ring, group_top = 2 * 25.0, 2 * 25.0 * q  # q = 2: the wrap-around doubles the single neighbour link
    return _cluster(
        f"atp-ic6:{q}",
        "a100-80gb",
        [
            _layer("ring", q, ring(q, 25.0 * q), group_top, 2.0),
            _layer("device", q, ring(q, 25.0), group_ring, 1.0),
        ],
    )


def _fig7a() -> dict[str, Any]:
    # ATP Fig. 7a: 4 nodes on 200 Gbps HDR (25 GB/s); 4 A100 per node, each pair joined by 4 NVLinks of
    # 50 GB/s (P2P 200 GB/s), each GPU's group bandwidth 600 GB/s.
    return _cluster("atp-fig7a", "a100-80gb", [_layer("node", 4, 25.0, 25.0, 5.0), _layer("gpu", 4, 200.0, 600.0, 2.0)])


def _p3x8() -> dict[str, Any]:
    # Alpa §8: 8 AWS p3.16xlarge instances, each 8 V100 16GB in the DGX-1 hybrid cube-mesh NVLink topology
    # (6 NVLink-2 links of 50 GB/s per GPU, 300 GB/s group bandwidth), 25 Gbps (3.125 GB/s) between nodes.
    # Pairs without an NVLink talk over PCIe 3.0 x16 (32 GB/s).
    double = {(0, 3), (1, 2), (4, 7), (5, 6), (0, 4), (1, 5), (2, 6), (3, 7)}
    single = {(0, 1), (0, 2), (1, 3), (2, 3), (4, 5), (4, 6), (5, 7), (6, 7)}
    m = [[0.0] * 8 for _ in range(8)]
    for i in range(8):
        for j in range(8):
            if i != j:
                pair = (min(i, j), max(i, j))
                m[i][j] = 100.0 if pair in double else 50.0 if pair in single else 32.0
    return _cluster("alpa-p3x8", "v100-16gb", [_layer("node", 8, 3.125, 3.125, 20.0), _layer("gpu", 8, m, 300.0, 2.0)])


def _hidup(name: str, nodes: int, gpus: int, gbps: float) -> dict[str, Any]:
    # HiDup §6: V100 machines "connected by NVLinks of 200 Gbps uni-directional pairwise bandwidth" (25 GB/s);
    # the inter-machine link as the paper gives it (9.71 Gbps measured with iperf3 on the 8 x 8 cloud cluster;
    # 100/30/10 Gbps set with tc on the 2 x 4 on-premise cluster).
    return _cluster(
        name,
        "v100-32gb",
        [_layer("node", nodes, gbps / 8, gbps / 8, 20.0), _layer("gpu", gpus, 25.0, 25.0 * (gpus - 1), 2.0)],
    )


def _dgx_h100(nodes: int) -> dict[str, Any]:
    # NVIDIA DGX H100: 8 H100 per node on NVSwitch (NVLink-4, 900 GB/s per GPU), 8 x 400 Gbps InfiniBand NICs
    # per node (one per GPU: 400 GB/s per node).
    return _cluster(
        f"dgx-h100:{nodes}",
        "h100",
        [_layer("node", nodes, 400.0, 400.0, 5.0), _layer("gpu", 8, 900.0, 900.0, 2.0)],
    )


# H100 SXM at BF16, measured on one H100 80GB (../shared/gpu/h100-gpt-steps.json, `meshpilot probe --backend
# nccl`, torch 2.11.0+cu130, 2026-11): bf16 matmul 756.7 TFLOP/s of the datasheet's 989.5 dense (0.765), fp32
# 51.2 of 67, device copy 2,950 GB/s of 3,350 (0.88). The datasheet peaks are the `h100` device's.
H100_BF16_MEASURED_TFLOPS = 756.7
H100_COPY_MEASURED_GBPS = 2950.0


LLAMA3_405B_TP8_GEMMS = (
    (8192, 2048, 16384, 818.0), (8192, 128, 16384, 311.9), (8192, 16384, 2048, 750.1), (8192, 6656, 16384, 781.5),
    (8192, 16384, 6656, 681.0), (16384, 6656, 8192, 691.7), (2048, 16384, 8192, 738.7), (6656, 16384, 8192, 753.4),
    (16384, 2048, 8192, 728.1), (8192, 8192, 8192, 719.5),
)  # fmt: skip
"""bf16 GEMMs ``(m, n, k, TFLOP/s)`` measured on one H100 80GB HBM3 (700 W, torch 2.11.0+cu130, random data, the
mean of 20 after 3 warm-ups; 2026-11-26, docs/frontier/h100_llama405b_shapes.json): Llama 3 405B's block under TP 8
at one 8,192-token sequence (q, k / v, o, gate / up, down; their input- and weight-gradient shapes). The cost model
prices each GEMM at the nearest of them (``DeviceProfile.matmul_flops``), other FLOPs at the efficiency above."""


LLAMA3_405B_TP8_FP8_GEMMS = (
    (8192, 2048, 16384, 1417.9), (8192, 128, 16384, 629.4), (8192, 16384, 2048, 1305.6),
    (8192, 6656, 16384, 1408.2), (8192, 16384, 6656, 1377.2), (16384, 6656, 8192, 1318.7),
    (2048, 16384, 8192, 1264.8), (6656, 16384, 8192, 1361.6), (16384, 2048, 8192, 1302.8), (8192, 8192, 8192, 1430.9),
)  # fmt: skip
"""Float8 GEMMs ``(m, n, k, TFLOP/s)`` at the same shapes as :data:`LLAMA3_405B_TP8_GEMMS`: ``torch._scaled_mm`` of
``float8_e4m3fn`` operands (one scale per tensor, bf16 out), measured on one H100 80GB HBM3 (700 W, torch
2.11.0+cu130, random data, the mean of 20 after 3 warm-ups; 2026-11-27, ``benchmarks/gpu_frontier_rates.py --fp8
--compile``, docs/data/h100-fp8-rates-compiled-casts-2026-11-27.json). A lent H200 measured them first
(docs/data/h200-fp8-rates-compiled-casts-2026-11-27.json): within 6 % of these but for the thin k / v product (846
there, 629 here: memory-bound, and the H200's memory is faster). Not measured: torchtitan's 500 W HBM2e H100s,
whose cap may throttle the Float8 products more than bf16 ones."""

FLOAT8_CAST_BYTES = 5.0
"""The memory traffic of casting a Float8 product's operands, bytes per operand element at the device's effective
bandwidth (``DeviceProfile.float8_cast_bytes``): tensorwise dynamic scaling reads the bf16 operand for its amax
(2 bytes) and again to scale and cast it (2), and writes the float8 copy in the layout the product reads (1). Each
of a linear's three products pays it for both its operands (the input, weight and output gradient each cast
twice, once per layout). Being memory traffic it is priced through each device's own bandwidth: on torchtitan's
HBM2e H100s (2,400 GB/s) twice as long as on the H200 (4,800) the GEMM table was measured on.

Measured beside it, and not what this prices: ``gpu_frontier_rates.py --fp8 --compile`` timed a whole tensorwise
Float8 linear, forward + backward (three casts, each compiled on its own; three products; the transposed copies
eager), at 1.6–3.3 ms beyond its three products on the H100 above: 14.5–18.4 bytes per element of the products'
operands at 3,350 GB/s, about 15 at this profile's efficiency, 3 times this traffic (17.4–21.8 at 4,800 GB/s on the
H200). Those casts are unfused stand-alone kernels; torchtitan compiles the whole block (the casts fused into their
neighbours, its weights cast on their FSDP shard before a float8 all-gather), so the traffic is the nearer price for
its rows, and the stand-alone one their pessimistic bound (docs/frontier.md, *Float8*: the rows at both)."""


H100_ATTENTION_TFLOPS = (680.8, 563.7, 1129.6, 1000.6)
"""Fused attention (``F.scaled_dot_product_attention``, bf16, the flash kernel) measured on the same H100 80GB
HBM3 at one TP 8 rank's share of a Llama 3 405B call (1 sequence, 16 heads, 8,192 tokens, head 128; the mean of
20 after 3 warm-ups; docs/frontier/h100_llama405b_shapes.json's ``attn``): TFLOP/s on ``attention_flops``' count
of the whole square, non-causal forward (0.808 ms) and backward (fwd + bwd 3.246 ms less the forward), causal
forward (0.487 ms) and backward (1.860 ms less 0.487): ``DeviceProfile.attention``. A causal call runs 0.57 of a
non-causal one's time, not 0.5: the diagonal blocks. Not measured: other lengths (CP's 8,192 query rows against
131,072 keys), other GPUs."""


def _h100_measured(kind: str, memory_gib: float, memory_gbps: float) -> dict[str, Any]:
    """An H100 SXM device profile at the measured efficiencies and GEMM rates above (bf16 and Float8, the casts'
    bytes); `memory_gib` and `memory_gbps`
    the machine's HBM (80 GiB HBM3 at 3,350 GB/s on Llama 3's servers, 96 GiB HBM2e at 2,400 on torchtitan's)."""
    gemms = [{"m": m, "n": n, "k": k, "dtype": "bfloat16", "tflops": t} for m, n, k, t in LLAMA3_405B_TP8_GEMMS]
    gemms += [{"m": m, "n": n, "k": k, "dtype": FLOAT8, "tflops": t} for m, n, k, t in LLAMA3_405B_TP8_FP8_GEMMS]
    return {
        "matmul": gemms,
        "kind": kind,
        "peak_tflops_fp32": 67.0,
        "peak_tflops_bf16": 989.5,
        "memory_GBps": memory_gbps,
        "memory_GiB": memory_gib,
        "compute_efficiency": round(H100_BF16_MEASURED_TFLOPS / 989.5, 4),
        "memory_efficiency": round(H100_COPY_MEASURED_GBPS / 3350.0, 4),
        "float8_cast_bytes": FLOAT8_CAST_BYTES,
        "attention_tflops": list(H100_ATTENTION_TFLOPS),
    }


ROCE_GPU_GBPS = 50.0
"""One 400 Gbps RoCE / InfiniBand NIC per GPU: 50 GB/s each way."""
NCCL_NVLINK_BUSBW_GBPS = 331.0
"""What NCCL's ring reaches over an H100 server's NVLink / NVSwitch, whose line rate is 450 GB/s each way (NVLink-4:
18 links of 25 GB/s; NVIDIA's "900 GB/s" counts both directions): the bus bandwidth ``busbw`` of nccl-tests (for
an all-gather or reduce-scatter of M bytes on n GPUs, ``(n − 1)/n · M / time``: the cost model's B'), measured
for ``reduce_scatter_perf`` on 8 H100 80GB HBM3 with NCCL's ring at 256 MiB: 330.9 GB/s (311 at 128 MiB, 349 at
1 GiB, 362 at 8 GiB; NVIDIA/nccl issue #1047). The frontier rows' TP collectives are that size: a microbatch's
``[8,192, 16,384]`` bf16 norm output gathered, a row product's partial sum scattered, 268 MB. NCCL's maintainer:
"450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of
370GB/s", seen as busbw of the non-all-reduce collectives (NVIDIA/nccl-tests issue #212); NVLink SHARP (NVLS)
speeds only the all-reduce, and is slower than the ring for reduce-scatter and all-gather (NVIDIA/nccl issue
#1083). The frontier presets give every link per direction, the NICs' 50 GB/s too, since a ring's or
Rabenseifner's all-reduce sends and receives at once: its bandwidth term is the per-direction rate (``dgx-h100``
and ATP's presets keep the papers' two-direction NVLink numbers)."""
LLAMA3_POD_GPUS = 3072
"""Llama 3 §3.3.1: 192 racks of 16 GPUs (two servers) under cluster switches, a pod of 3,072 GPUs with full
bisection bandwidth."""
LLAMA3_OVERSUBSCRIPTION = 7
"""Llama 3 §3.3.1: the aggregation layer joining the pods is oversubscribed 1:7."""


def _llama3_h100(pods: int) -> dict[str, Any]:
    # The Llama 3 Herd of Models §3.3.1 (Meta's 24K-GPU RoCE cluster): Grand Teton servers of 8 H100 SXM (80 GB HBM3,
    # 700 W) on NVLink / NVSwitch (NVLink-4, 450 GB/s each way per GPU), one 400 Gbps RoCE NIC per GPU (8 x 50 GB/s =
    # 400 GB/s a server); a three-layer Clos: 16 GPUs a rack under one ToR, 192 racks a pod of 3,072 GPUs with no
    # oversubscription (so the pod is one flat layer of 384 servers), 8 pods joined by aggregation switches at 1:7, so a
    # pod's bandwidth to the rest is its GPUs' NIC bandwidth / 7. Latencies are not published: 2 us on NVLink, 5 us
    # through the ToR and cluster switches (as `dgx-h100`), 10 us through the aggregation layer.
    servers = LLAMA3_POD_GPUS // 8
    pod_out = LLAMA3_POD_GPUS * ROCE_GPU_GBPS / LLAMA3_OVERSUBSCRIPTION
    node = 8 * ROCE_GPU_GBPS
    layers = [
        _layer("pod", pods, pod_out, pod_out, 10.0),
        _layer("node", servers, node, node, 5.0),
        _layer("gpu", 8, NCCL_NVLINK_BUSBW_GBPS, NCCL_NVLINK_BUSBW_GBPS, 2.0),
    ]
    out = {"name": f"llama3-h100:{pods}", "device_profile": _h100_measured("h100-sxm-80gb", 80.0, 3350.0)}
    out["layers"] = layers
    return out


def _torchtitan_h100(nodes: int) -> dict[str, Any]:
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md: Grand Teton hosts of 8 H100 "fully connected with
    # NVLink", each GPU with 96 GB HBM2e at 2.4 TB/s, "backend RDMA network with 400 Gb/s per GPU", the default
    # 500 W power limit (the file: its peak is "between SXM and NVL" and not known, so the SXM peak and the
    # measured efficiency above are an upper bound on its rate). No oversubscription is given for 512 GPUs:
    # the hosts sit on one non-blocking layer.
    node = 8 * ROCE_GPU_GBPS
    layers = [
        _layer("node", nodes, node, node, 5.0),
        _layer("gpu", 8, NCCL_NVLINK_BUSBW_GBPS, NCCL_NVLINK_BUSBW_GBPS, 2.0),
    ]
    out = {"name": f"torchtitan-h100:{nodes}", "device_profile": _h100_measured("h100-hbm2e-96gb", 96.0, 2400.0)}
    out["layers"] = layers
    return out


@dataclass(frozen=True)
class Preset:
    """A named cluster; `size` says what the number after the colon means, if it takes one."""

    name: str
    summary: str
    build: Callable[..., dict[str, Any]]
    size: str | None = None
    default_size: int | None = None
    devices_per_size: int = 1
    """Devices per unit of the size: 8 for ``dgx-h100:NODES``."""
    squared: bool = False
    """The size is a side q of q x q devices (``atp-ic6:q``)."""

    def devices(self, n: int) -> int:
        """How many devices the preset has at size `n`."""
        return (n * n if self.squared else n) * self.devices_per_size


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("atp-ic1", "8 x A100 over PCIe, NVLink off (ATP IC1)", lambda: _ic1("atp-ic1", False)),
        Preset(
            "atp-ic1-calibrated",
            "IC1 plus ATP §5.3's measured B1/B2 for meshes (2,4) and (8,1)",
            lambda: _ic1("atp-ic1-calibrated", True),
        ),
        Preset("atp-ic2", "8 x A100, NVLink pairs over PCIe (ATP IC2)", _ic2),
        Preset("atp-ic3", "8 x A100 on NVSwitch (ATP IC3)", _ic3),
        Preset("atp-ic4", "2 nodes x 8 A100, 200 Gbps InfiniBand (ATP IC4)", _ic4),
        Preset("atp-ic5", "N GPUs on an NVLink-Network switch (ATP IC5)", _ic5, "devices", 64),
        Preset("atp-ic6", "q x q 2D torus of 25 GB/s links (ATP IC6)", _ic6, "q (torus side)", 4, squared=True),
        Preset("atp-fig7a", "4 nodes x 4 A100, 4 NVLinks of 50 GB/s, 200 Gbps HDR (ATP Fig. 7a)", _fig7a),
        Preset("alpa-p3x8", "8 x p3.16xlarge: 8 V100-16GB NVLink per node, 25 Gbps (Alpa §8)", _p3x8),
        Preset(
            "hidup-v100x64",
            "8 x 8 V100 NVLink, 9.71 Gbps between machines (HiDup §6)",
            lambda: _hidup("hidup-v100x64", 8, 8, 9.71),
        ),
        Preset(
            "hidup-2x4-100g",
            "2 x 4 V100 NVLink, 100 Gbps (HiDup §6)",
            lambda: _hidup("hidup-2x4-100g", 2, 4, 100.0),
        ),
        Preset(
            "hidup-2x4-30g",
            "2 x 4 V100 NVLink, 30 Gbps (HiDup §6)",
            lambda: _hidup("hidup-2x4-30g", 2, 4, 30.0),
        ),
        Preset(
            "hidup-2x4-10g",
            "2 x 4 V100 NVLink, 10 Gbps (HiDup §6)",
            lambda: _hidup("hidup-2x4-10g", 2, 4, 10.0),
        ),
        Preset("dgx-h100", "N nodes of 8 H100, NVSwitch, 8 x 400 Gbps IB", _dgx_h100, "nodes", 2, devices_per_size=8),
        Preset(
            "llama3-h100",
            "Llama 3's RoCE cluster: pods of 3,072 H100 (384 servers of 8, NVSwitch, 400 Gbps a GPU), 1:7 between pods",
            _llama3_h100,
            "pods",
            8,
            devices_per_size=LLAMA3_POD_GPUS,
        ),
        Preset(
            "torchtitan-h100",
            "torchtitan's Grand Teton H100 (96 GB HBM2e, 500 W): N hosts of 8, NVLink, 400 Gbps RDMA a GPU",
            _torchtitan_h100,
            "nodes",
            64,
            devices_per_size=8,
        ),
    ]
}


def parse_preset(spec: str) -> tuple[Preset, int | None]:
    """The preset `spec` names and its size (None for a fixed-size preset): ``"atp-ic5:64"`` -> (IC5, 64),
    ``"atp-ic5"`` -> (IC5, its default size). Every mistake in the spec is a UserError naming it."""
    name, colon, size = spec.partition(":")
    preset = PRESETS.get(name)
    if preset is None:
        raise UserError(f"cluster {spec!r}: unknown preset and no such file; run `meshpilot presets` for the names")
    if preset.size is None:
        if colon:
            raise UserError(f"cluster {spec!r}: preset {name!r} has a fixed size; write just {name!r}")
        return preset, None
    example = f"e.g. {name}:{preset.default_size}"
    if colon and not size:
        raise UserError(
            f"cluster {spec!r}: nothing after ':'; give the {preset.size}, {example}, or write just {name!r}"
        )
    if size and not (size.isascii() and size.isdigit()):
        raise UserError(f"cluster {spec!r}: the size after ':' must be a whole number of {preset.size}; {example}")
    n = int(size) if size else preset.default_size
    if n < 1:
        raise UserError(f"cluster {spec!r}: the size must be at least 1; {example}")
    from meshpilot.cluster.loader import MAX_DEVICES

    if preset.devices(n) > MAX_DEVICES:
        raise UserError(
            f"cluster {spec!r}: {preset.devices(n):,} devices, more than meshpilot plans for ({MAX_DEVICES:,}); "
            f"give a smaller {preset.size} after ':'"
        )
    return preset, n


def preset_cluster(spec: str) -> Cluster:
    """The preset named `spec` ("atp-ic3", "atp-ic5:64", ...)."""
    preset, n = parse_preset(spec)
    data = preset.build() if n is None else preset.build(n)
    return cluster_from_dict(data, source=f"preset {spec}")


def load_cluster(spec: str | Cluster) -> Cluster:
    """A cluster from a preset name (`atp-ic5:64`), a TOML file path, or a Cluster (returned as is)."""
    from pathlib import Path

    from meshpilot.cluster.loader import load_cluster_file

    if isinstance(spec, Cluster):
        return spec
    if spec.endswith(".toml") or Path(spec).is_file():
        return load_cluster_file(spec)
    return preset_cluster(spec)
