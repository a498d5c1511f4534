"""ATP in one import: the mesh search (planner) and the row-/column-first layers (runtime), as in ATP Fig. 9.

from meshpilot import atp
result = atp.search(load_cluster("atp-ic1-calibrated"), 8, gpt_config("atp-m2"))   # DeviceMesh(2, 4)
mesh = atp.init_mesh(result.chosen.mesh)                                           # under torchrun
layer = atp.ATPLinear(1024, 4096, mesh, first="column")
"""

from meshpilot.planner.atp import ATPResult, MeshCost, closed_form, search, sweep, t_comm
from meshpilot.runtime.atp import (
    ATPGPT,
    ATPBlock,
    ATPLinear,
    ATPMeshes,
    ShardedEmbedding,
    ShardedLayerNorm,
    init_mesh,
    init_meshes,
)

__all__ = [
    "ATPGPT",
    "ATPBlock",
    "ATPLinear",
    "ATPMeshes",
    "ATPResult",
    "MeshCost",
    "ShardedEmbedding",
    "ShardedLayerNorm",
    "closed_form",
    "init_mesh",
    "init_meshes",
    "search",
    "sweep",
    "t_comm",
]
