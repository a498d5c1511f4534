"""ATP's mesh search (ATP §3.3-3.5): pick the 2D DeviceMesh whose tensor-parallel all-reduces cost least.

On DeviceMesh(d1, d2), row- and column-first tensor parallelism all-reduce, per transformer layer and
per token, 3h/d1 (QKV) and 4h/d1 (MLP up) elements over mesh axis 1, and h/d2 twice (attention output,
MLP down) over mesh axis 0, forward and backward (ATP Eq. 2):

    T_comm = 2 L b s e * ( 7h / (d1 * B2)  +  2h / (d2 * B1) )          [seconds]

with e the element size in bytes (the paper leaves it out; ratios do not change). B1, B2 are the
all-reduce algorithm bandwidths of the two axes: Eq. 4 on the matrix's B' (``LogicalMesh.
algorithm_bandwidth``), or a calibration entry of the cluster. An axis of size 1 communicates nothing:
its term is 0. DeviceMesh(N, 1) is Megatron-LM's 1D tensor parallelism, the baseline.

On a one-layer matrix with B1' = B2' = GroupBW (IC5, or a torus mesh aligned with its rings) this is
ATP §5.4's closed form  T_comm / Delta = (14 d2 + 4 d1 - 18) / (d1 d2),  Delta = 2 L b s h e / GroupBW
(:func:`closed_form`), which the sweep draws as Fig. 12.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from meshpilot.cluster import Cluster, LogicalMesh, mesh_shapes_2d
from meshpilot.errors import UserError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class TransformerShape(Protocol):
    """What the search needs of a GPT-like model (GPTConfig has these fields)."""

    layers: int
    hidden: int
    heads: int
    batch: int
    seq: int


@dataclass(frozen=True)
class MeshCost:
    """One candidate mesh: its Eq. 2 communication time and the bandwidths that produced it."""

    mesh: tuple[int, int]
    t_comm_s: float
    B1: float
    B2: float
    calibrated: bool


@dataclass(frozen=True)
class ATPResult:
    """The search's answer: candidates sorted by T_comm, the chosen mesh and the 1D baseline."""

    cluster: str
    devices: int
    candidates: tuple[MeshCost, ...]

    @property
    def chosen(self) -> MeshCost:
        return self.candidates[0]

    @property
    def baseline(self) -> MeshCost:
        """Megatron-LM 1D tensor parallelism: DeviceMesh(N, 1)."""
        return next(c for c in self.candidates if c.mesh == (self.devices, 1))

    @property
    def speedup(self) -> float:
        """Predicted T_comm(N, 1) / T_comm(chosen)."""
        return self.baseline.t_comm_s / self.chosen.t_comm_s if self.chosen.t_comm_s > 0 else math.inf


def t_comm(mesh: LogicalMesh, model: TransformerShape, dtype_bytes: int = 2) -> float:
    """Eq. 2 on `mesh` for `model`, in seconds."""
    d1, d2 = mesh.shape
    h = model.hidden
    b1, b2 = mesh.algorithm_bandwidth(0), mesh.algorithm_bandwidth(1)
    term2 = 0.0 if d2 == 1 else 7 * h / (d1 * b2)  # QKV (3h) + MLP up (4h) over axis 1
    term1 = 0.0 if d1 == 1 else 2 * h / (d2 * b1)  # attention out (h) + MLP down (h) over axis 0
    return 2 * model.layers * model.batch * model.seq * dtype_bytes * (term2 + term1)


def closed_form(d1: int, d2: int) -> float:
    """ATP §5.4: T_comm / Delta on a matrix where B1' = B2' = GroupBW."""
    return (14 * d2 + 4 * d1 - 18) / (d1 * d2)


def search(cluster: Cluster, devices: int, model: TransformerShape, dtype_bytes: int = 2) -> ATPResult:
    """Every DeviceMesh(d1, d2) with d1 * d2 = devices, costed by Eq. 2, cheapest first."""
    if not 1 <= devices <= cluster.num_devices:
        raise UserError(
            f"--devices {devices}: cluster {cluster.name!r} has {cluster.num_devices} devices; choose 1..that"
        )
    out = []
    for shape in mesh_shapes_2d(devices):
        m = LogicalMesh(cluster, shape)
        out.append(
            MeshCost(
                mesh=shape,
                t_comm_s=t_comm(m, model, dtype_bytes),
                B1=m.algorithm_bandwidth(0),
                B2=m.algorithm_bandwidth(1),
                calibrated=cluster.calibrated(shape) is not None,
            )
        )
    # cheapest first; ties go to the mesh closer to Megatron (larger d1), the simpler layout
    out.sort(key=lambda c: (round(c.t_comm_s, 15), -c.mesh[0]))
    return ATPResult(cluster=cluster.name, devices=devices, candidates=tuple(out))


@dataclass(frozen=True)
class SweepRow:
    """One N of the Fig. 12 sweep: T_comm / Delta of ATP-i = DeviceMesh(N/i, i) and of the optimum."""

    devices: int
    atp: dict[int, float]
    opt: float
    opt_mesh: tuple[int, int]


def sweep(cluster_at, ns: list[int], ways: tuple[int, ...] = (1, 2, 4, 8)) -> list[SweepRow]:
    """Fig. 12: for each N, T_comm / Delta for ATP-1/2/4/8 and ATP-OPT on `cluster_at(N)`.

    Delta = 2 L b s h e / GroupBW with GroupBW the device-level group bandwidth, so the model cancels out.
    """

    class _Unit:
        layers = batch = seq = hidden = heads = 1

    rows = []
    for n in ns:
        cluster = cluster_at(n)
        group_bw = float(cluster.layers[-1].group_bw.min())
        delta = 2 * 1 * 1 * 1 * 1 * 1 / group_bw
        res = search(cluster, n, _Unit(), 1)
        by_mesh = {c.mesh: c.t_comm_s / delta for c in res.candidates}
        atp = {i: by_mesh[(n // i, i)] for i in ways if n % i == 0}
        rows.append(SweepRow(n, atp, res.chosen.t_comm_s / delta, res.chosen.mesh))
    return rows
