"""ATP: adaptive tensor parallelism with row-/column-first 2D tensor-parallel layers.

Public API::

    mesh = init_mesh((d1, d2))                       # DeviceMesh(d1, d2), dims ("atp0", "atp1")
    meshes = init_meshes((d1, d2))                   # .tp and .dp (when world > d1 * d2)
    layer = ATPLinear(in_f, out_f, mesh, first="column", chunks=2)
    model = ATPGPT.from_gpt(gpt, mesh, chunks=2)     # exact copy of a single-device GPT
    loss = model(idx, targets); loss.backward(); model.sync_gradients()

See :mod:`meshpilot.runtime.atp.layers` for placements and the communication accounting.
"""

from meshpilot.runtime.atp.comm import MeshAxis, Pending
from meshpilot.runtime.atp.gpt import ATPGPT, ATPMLP, ATPAttention, ATPBlock, run_stages
from meshpilot.runtime.atp.layers import (
    COLUMN_FIRST,
    ROW_FIRST,
    ATPLinear,
    ShardedEmbedding,
    ShardedLayerNorm,
)
from meshpilot.runtime.atp.mesh import ATPMeshes, dp_mesh_of, init_mesh, init_meshes

__all__ = [
    "ATPGPT",
    "COLUMN_FIRST",
    "ROW_FIRST",
    "ATPAttention",
    "ATPBlock",
    "ATPLinear",
    "ATPMLP",
    "ATPMeshes",
    "MeshAxis",
    "Pending",
    "ShardedEmbedding",
    "ShardedLayerNorm",
    "dp_mesh_of",
    "init_mesh",
    "init_meshes",
    "run_stages",
]
