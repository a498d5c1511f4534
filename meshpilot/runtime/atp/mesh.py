"""ATP device meshes: DeviceMesh(d1, d2) for tensor parallelism, plus an outer data-parallel axis.

Mesh axis 0 ("atp0") has size d1 and axis 1 ("atp1") size d2. ``init_device_mesh`` lays the
last axis on contiguous ranks, so the TP coordinate of a rank is ``(i0, i1)`` with
``rank = i0 * d2 + i1`` (inside each data-parallel replica). When the world is larger than
``d1 * d2`` the mesh is 3D ``("dp", "atp0", "atp1")`` of shape ``(world / (d1*d2), d1, d2)``:
TP groups are contiguous blocks of ``d1 * d2`` ranks and the data-parallel axis is outermost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ATP_AXIS_NAMES", "DP_AXIS_NAME", "ATPMeshes", "dp_mesh_of", "init_mesh", "init_meshes"]

ATP_AXIS_NAMES = ("atp0", "atp1")
DP_AXIS_NAME = "dp"


@dataclass(frozen=True)
class ATPMeshes:
    """The 2D tensor-parallel mesh and, when the world is larger, the data-parallel mesh."""

    tp: DeviceMesh
    """DeviceMesh(d1, d2) with dims ("atp0", "atp1")."""
    dp: DeviceMesh | None
    """1D mesh over the replicas ("dp"), or None when there is a single replica."""

    @property
    def d1(self) -> int:
        return self.tp.size(0)

    @property
    def d2(self) -> int:
        return self.tp.size(1)

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else self.dp.size()


def _check_shape(shape: tuple[int, int]) -> tuple[int, int]:
    if len(shape) != 2 or any(not isinstance(d, int) or d < 1 for d in shape):
        raise ValueError(f"mesh shape={shape!r} must be two positive integers (d1, d2), e.g. (2, 2)")
    return shape[0], shape[1]


def init_meshes(shape: tuple[int, int], device_type: str = "cpu") -> ATPMeshes:
    """Build DeviceMesh(d1, d2) on the default process group (initialised by torch if needed).

    With ``world_size == d1 * d2`` returns ``ATPMeshes(tp, None)``. With ``world_size = dp * d1 * d2``
    builds the 3D mesh ``(dp, d1, d2)`` named ``("dp", "atp0", "atp1")`` and returns its
    ``("atp0", "atp1")`` and ``("dp",)`` sub-meshes. Every rank must call it (it creates groups).
    """
    d1, d2 = _check_shape(shape)
    if not dist.is_initialized():
        # From the environment (torchrun): torch picks gloo for CPU and NCCL for CUDA.
        dist.init_process_group()
    world = dist.get_world_size()
    if world % (d1 * d2) != 0:
        raise ValueError(
            f"world size {world} is not a multiple of d1*d2={d1 * d2} for mesh shape {(d1, d2)}; "
            f"pick (d1, d2) whose product divides {world}"
        )
    dp = world // (d1 * d2)
    if dp == 1:
        return ATPMeshes(init_device_mesh(device_type, (d1, d2), mesh_dim_names=ATP_AXIS_NAMES), None)
    mesh3 = init_device_mesh(device_type, (dp, d1, d2), mesh_dim_names=(DP_AXIS_NAME, *ATP_AXIS_NAMES))
    return ATPMeshes(mesh3[ATP_AXIS_NAMES], mesh3[DP_AXIS_NAME])


def init_mesh(shape: tuple[int, int], device_type: str = "cpu") -> DeviceMesh:
    """ATP's ``init_mesh`` (Fig. 9): the DeviceMesh(d1, d2) of this rank.

    If the world holds several replicas the data-parallel mesh is reachable with
    :func:`dp_mesh_of` (and ``ATPGPT.from_gpt`` finds it on its own).
    """
    return init_meshes(shape, device_type).tp


def dp_mesh_of(tp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The "dp" sibling of a TP mesh made by :func:`init_meshes`, or None if there is none."""
    root = tp_mesh._get_root_mesh()
    if root is tp_mesh or root is None:
        return None
    names = root.mesh_dim_names or ()
    if DP_AXIS_NAME not in names:
        return None
    return root[DP_AXIS_NAME]
