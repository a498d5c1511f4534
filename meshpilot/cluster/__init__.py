"""Clusters: the hierarchical communication matrix, device profiles, presets, meshes and the cost model."""

from meshpilot.cluster.cost import CostModel
from meshpilot.cluster.devices import DEVICES, DeviceProfile
from meshpilot.cluster.loader import cluster_from_dict, cluster_to_toml, load_cluster_file
from meshpilot.cluster.mesh import (
    LogicalMesh,
    MeshMapping,
    default_axis_names,
    effective_bandwidth,
    mapped_ranks,
    mesh_shapes_2d,
    mesh_shapes_3d,
)
from meshpilot.cluster.presets import PRESETS, load_cluster, preset_cluster
from meshpilot.cluster.topology import GB, Calibration, Cluster, Layer

__all__ = [
    "DEVICES",
    "GB",
    "PRESETS",
    "Calibration",
    "Cluster",
    "CostModel",
    "DeviceProfile",
    "Layer",
    "LogicalMesh",
    "MeshMapping",
    "cluster_from_dict",
    "cluster_to_toml",
    "default_axis_names",
    "effective_bandwidth",
    "load_cluster",
    "load_cluster_file",
    "mapped_ranks",
    "mesh_shapes_2d",
    "mesh_shapes_3d",
    "preset_cluster",
]
