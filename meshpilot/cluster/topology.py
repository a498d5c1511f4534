"""A cluster as ATP's hierarchical communication matrix (ATP §3.4).

The devices of a cluster are the leaves of a tree of *layers*, listed top-down: e.g. nodes, then the
GPUs of a node. Layer j has R_j ranks; every unit of layer j-1 holds R_j units of layer j, so the
cluster has prod(R_j) devices. A device's rank is its mixed-radix number (c_1, ..., c_l), the last
layer varying fastest: devices of one node are contiguous ranks.

Each layer carries, for its R_j sibling units:
  - ``p2p[a, b]``: the bandwidth between sibling units a and b (bytes/s; for an upper layer it is the
    aggregate bandwidth between two groups of devices, e.g. two nodes);
  - ``group_bw[a]``: the *group bandwidth* of unit a, the aggregate bandwidth of that unit to the
    outside world (ATP Fig. 7: 600 GB/s for an A100 with 12 NVLinks, while P2P to one peer is 200 GB/s);
  - ``latency``: the start-up time of one message crossing this layer (seconds).

Bandwidths are stored in bytes per second; files and tables speak GB/s (1 GB = 1e9 bytes).
Measured all-reduce bandwidths (ATP §5.3's calibration of IC1) live in :class:`Calibration` and override
the bandwidths derived from the matrix for the mesh shapes they name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from meshpilot.cluster.devices import DeviceProfile

GB = 1e9


@dataclass(frozen=True, eq=False)
class Layer:
    """One level of the hierarchy: R sibling units, their P2P matrix, group bandwidths and latency."""

    name: str
    """What a unit of this layer is ("node", "socket", "gpu")."""
    ranks: int
    """R_j: how many units of this layer each unit of the layer above holds."""
    p2p: np.ndarray
    """R_j x R_j bandwidth between sibling units, bytes/s (diagonal unused)."""
    group_bw: np.ndarray
    """R_j aggregate bandwidth of each unit to everything outside it, bytes/s."""
    latency: float
    """Seconds for a message to cross this layer (the alpha of the cost model)."""

    @cached_property
    def reach(self) -> np.ndarray:
        """Widest-path bandwidth between sibling units: traffic may relay through other units of the layer
        (a torus ring sends 0 -> 2 through 1). Max-min closure of `p2p` (Floyd-Warshall on bottlenecks)."""
        w = self.p2p.copy()
        off = w[~np.eye(self.ranks, dtype=bool)]
        if off.size == 0 or np.all(off == off[0]):
            return w  # complete and uniform: no relay beats the direct link
        for k in range(self.ranks):
            w = np.maximum(w, np.minimum(w[:, k : k + 1], w[k : k + 1, :]))
        np.fill_diagonal(w, 0.0)
        return w

    @property
    def uniform(self) -> bool:
        """True when every off-diagonal P2P entry and every group bandwidth is the same."""
        off = self.p2p[~np.eye(self.ranks, dtype=bool)]
        return bool((off.size == 0 or np.all(off == off[0])) and np.all(self.group_bw == self.group_bw[0]))


@dataclass(frozen=True)
class Calibration:
    """Measured all-reduce algorithm bandwidths for one mesh shape; they override Eq. 3-4."""

    mesh: tuple[int, ...]
    """The mesh shape (d1, d2) the measurement was taken on."""
    algbw: tuple[float | None, ...]
    """Per mesh axis, the measured algorithm bandwidth B_i in bytes/s, or None where not measured."""
    latency: tuple[float | None, ...] = ()
    """Per mesh axis, the measured alpha in seconds (None or absent: the layers' latency): a 4-byte all-reduce
    of every group of the axis at once took ``ceil(log2 d) * alpha``, the cost model's small-message time. On
    CPU ranks it holds gloo's per-collective work (``meshpilot.cluster.probe``, phase 5)."""
    curve: tuple[tuple[tuple[int, float], ...] | None, ...] = ()
    """Per mesh axis, measured all-reduce times ``(bytes, seconds)`` at several message sizes, bytes ascending
    (None or absent: not measured), every group of the axis at once. Where present the cost model prices
    all-reduce, all-gather and reduce-scatter on that axis from it (``meshpilot.cluster.cost``,
    :func:`~meshpilot.cluster.cost.on_curve`) instead of alpha and B: a collective's fixed cost grows with its
    message well past a single latency (TCP, protocol and chunking), which two numbers cannot describe."""
    busy_curve: tuple[tuple[tuple[int, float], ...] | None, ...] = ()
    """Per mesh axis, the same all-reduce timed while every rank computes (``meshpilot.cluster.probe``, phase
    6; None or absent: not measured): on CPU ranks gloo's threads share the cores with the compute, so a
    collective in flight beside compute takes longer than alone. The cost model's
    :meth:`~meshpilot.cluster.cost.CostModel.busy_factor` divides it by ``curve``; the simulator slows a
    transfer by that factor while its rank computes (``meshpilot.sim``, *Contention*)."""


@dataclass(frozen=True, eq=False)
class Cluster:
    """A cluster: its hierarchy of layers, its device profile and optional calibration entries."""

    name: str
    """Preset name or file stem, shown in tables."""
    layers: tuple[Layer, ...]
    """Layers top-down; the last one's units are single devices."""
    device: DeviceProfile
    """What every device of the cluster is."""
    calibration: tuple[Calibration, ...] = field(default_factory=tuple)
    """Measured bandwidths that override the derived ones for the mesh shapes they name."""
    source: str = ""
    """Where the description came from (a file path, or the preset's citation)."""

    @property
    def num_devices(self) -> int:
        """prod(R_j): how many devices the cluster has."""
        return math.prod(layer.ranks for layer in self.layers)

    @property
    def radices(self) -> tuple[int, ...]:
        """(R_1, ..., R_l)."""
        return tuple(layer.ranks for layer in self.layers)

    def coords(self, ranks: np.ndarray) -> np.ndarray:
        """Mixed-radix coordinates of physical ranks: shape [len(ranks), num_layers]."""
        ranks = np.asarray(ranks)
        out = np.empty((ranks.size, len(self.layers)), dtype=np.int64)
        rest = ranks.reshape(-1).astype(np.int64)
        for j in range(len(self.layers) - 1, -1, -1):
            out[:, j] = rest % self.layers[j].ranks
            rest = rest // self.layers[j].ranks
        return out

    def calibrated(self, shape: tuple[int, ...]) -> Calibration | None:
        """The calibration entry for mesh `shape`, if one was given."""
        for entry in self.calibration:
            if entry.mesh == tuple(shape):
                return entry
        return None

    def p2p_bandwidth(self, a: int, b: int) -> float:
        """Bandwidth between two devices: the P2P entry of the highest layer where they differ."""
        ca, cb = self.coords(np.array([a, b]))
        for j, layer in enumerate(self.layers):
            if ca[j] != cb[j]:
                return float(min(layer.p2p[ca[j], cb[j]], layer.group_bw[ca[j]], layer.group_bw[cb[j]]))
        return math.inf

    def p2p_latency(self, a: int, b: int) -> float:
        """Latency between two devices: the latency of the highest layer where they differ."""
        ca, cb = self.coords(np.array([a, b]))
        for j, layer in enumerate(self.layers):
            if ca[j] != cb[j]:
                return layer.latency
        return 0.0
