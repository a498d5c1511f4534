"""The matrix multiplications of a captured graph, as GEMM shapes ``[m, k] @ [k, n]``.

The compute model prices a GEMM at the rate a probe measured for the nearest shape
(``DeviceProfile.matmul_flops``), and ``meshpilot probe --matmul-shapes-from MODEL`` measures exactly the
shapes :func:`graph_gemms` lists for a model: every ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` of its forward
and backward, batched ones folded into ``m`` (``[b, m, k] @ [b, k, n]`` -> ``(b·m, n, k)``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from meshpilot.graph.capture import OpGraph, OpNode

GEMM_OPERANDS: dict[str, tuple[int, int]] = {
    "aten.mm.default": (0, 1),
    "aten.addmm.default": (1, 2),
    "aten.bmm.default": (0, 1),
    "aten.baddbmm.default": (1, 2),
}
"""ATen matmul -> positions of its two matrix operands among the node's tensor inputs."""


@dataclass(frozen=True)
class Gemm:
    """One GEMM shape of a graph and how often it runs in a step."""

    m: int
    n: int
    k: int
    dtype: str
    count: int = 1


def gemm_dims(target: str, shapes: Sequence[Sequence[int]]) -> tuple[int, int, int] | None:
    """``(m, n, k)`` of a matmul node from its tensor operands' shapes; None when `target` is no GEMM."""
    pos = GEMM_OPERANDS.get(target)
    if pos is None or len(shapes) <= max(pos):
        return None
    a, b = shapes[pos[0]], shapes[pos[1]]
    if len(a) == 2 and len(b) == 2:
        return int(a[0]), int(b[1]), int(a[1])
    if len(a) == 3 and len(b) == 3:
        return int(a[0] * a[1]), int(b[2]), int(a[2])
    return None


def node_gemm(graph: OpGraph, node: OpNode) -> tuple[int, int, int] | None:
    """``(m, n, k)`` of `node` on one device (whole operands), or None."""
    if node.target not in GEMM_OPERANDS:
        return None
    shapes = []
    for src, i in node.inputs:
        info = graph[src].outputs[i]
        shapes.append(info.shape if info is not None else ())
    return gemm_dims(node.target, shapes)


def graph_gemms(graph: OpGraph) -> list[Gemm]:
    """Every distinct GEMM shape and dtype of the step, most frequent first."""
    seen: Counter = Counter()
    for node in graph.nodes:
        dims = node_gemm(graph, node) if node.kind == "op" else None
        if dims is not None and node.out is not None:
            seen[(*dims, node.out.dtype)] += 1
    return [Gemm(m, n, k, dt, c) for (m, n, k, dt), c in seen.most_common()]
