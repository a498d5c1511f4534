"""``runtime.untranspose.gather_untransposed``: a weight's all-gather taken of the weight as stored and transposed
after, instead of DTensor's gather of its transpose (clone, all-gather, split, ``cat`` along dim 1).

One process: the program is written by hand as DTensor records it (``runtime.record``'s layouts on every
node), and its all-gather is run by a stand-in that stacks `n` different rank pieces along dim 0, as
``all_gather_into_tensor`` returns them. The 4-rank runs (ZeRO-3 equal to the single device, the collectives
the plan's) are in ``tests/test_grad_buckets.py``."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from meshpilot.runtime import untranspose
from meshpilot.runtime.record import LAYOUT
from meshpilot.runtime.untranspose import gather_untransposed

_aten = torch.ops.aten
_funcol = torch.ops._c10d_functional
N = 4


def _laid(node: torch.fx.Node, t: torch.Tensor) -> torch.fx.Node:
    node.meta[LAYOUT] = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)
    return node


def _program(a: int, b: int, reader: str, unpad: bool = False) -> torch.fx.GraphModule:
    """``reader(x_in, cat(split(all_gather(clone(t(w))), b), 1))`` on a ``[a, b]`` shard `w`, as recorded."""
    g = torch.fx.Graph()
    w, x = torch.zeros(a, b), torch.zeros(3, b)
    wn, xn = _laid(g.placeholder("w"), w), _laid(g.placeholder("x"), x)
    bias = _laid(g.placeholder("bias"), torch.zeros(N * a))
    t = _laid(g.call_function(_aten.t.default, (wn,)), w.t())
    clone = _laid(g.call_function(_aten.clone.default, (t,), {"memory_format": torch.contiguous_format}), w.t())
    coll = g.call_function(_funcol.all_gather_into_tensor.default, (clone, N, "0"))
    coll.meta["meshpilot_tag"] = (7, 1)
    wait = g.call_function(_funcol.wait_tensor.default, (coll,))
    split = g.call_function(_aten.split.Tensor, (wait, b))
    pieces = [g.call_function(operator.getitem, (split, i)) for i in range(N)]
    cat = g.call_function(_aten.cat.default, (pieces, 1))
    read = g.call_function(_aten.slice.Tensor, (cat, 1, 0, N * a)) if unpad else cat
    if reader == "addmm":
        out = g.call_function(_aten.addmm.default, (bias, xn, read))
    elif reader == "mm":
        out = g.call_function(_aten.mm.default, (xn, read))
    else:  # a view: needs the gathered matrix contiguous
        out = g.call_function(_aten.view.default, (read, [-1]))
    g.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _gathered(x: torch.Tensor, n: int, group: str) -> torch.Tensor:
    """What `n` ranks' all-gather returns when rank r holds ``x + 100 r``: the pieces stacked on dim 0."""
    return torch.cat([x + 100.0 * r for r in range(n)])


def _run(gm: torch.fx.GraphModule, *args: torch.Tensor) -> torch.Tensor:
    for n in gm.graph.nodes:
        if n.target is _funcol.all_gather_into_tensor.default:
            n.target = _gathered
        elif n.target is _funcol.wait_tensor.default:
            n.target = torch.Tensor.clone
    gm.recompile()
    return gm(*args)[0]


@pytest.mark.parametrize("reader,unpad", [("mm", False), ("addmm", False), ("addmm", True)])
def test_the_gathered_weight_is_the_same_matrix_without_the_copies(reader, unpad):
    a, b = 3, 5
    w = torch.randn(a, b)
    eye = torch.eye(b)  # mm(I, B) is B exactly: every product is by 1 or 0, every sum adds zeros
    before, after = _program(a, b, reader, unpad), _program(a, b, reader, unpad)
    assert gather_untransposed(after) == 1
    targets = [n.target for n in after.graph.nodes if n.op == "call_function"]
    assert _aten.clone.default not in targets and _aten.cat.default not in targets
    assert _aten.split.Tensor not in targets and _aten.slice.Tensor not in targets
    coll = next(n for n in after.graph.nodes if n.target is _funcol.all_gather_into_tensor.default)
    assert coll.args[0].name == "w" and coll.meta["meshpilot_tag"] == (7, 1)  # the stored shard, the same edge
    zero = torch.zeros(N * a)
    assert torch.equal(_run(before, w, eye, zero), _run(after, w, eye, zero))


def test_a_reader_that_needs_the_copy_keeps_it():
    gm = _program(3, 5, "view")
    assert gather_untransposed(gm) == 0
    assert any(n.target is _aten.cat.default for n in gm.graph.nodes)


def test_a_strided_shard_is_gathered_as_recorded():
    gm = _program(3, 5, "mm")
    w = next(n for n in gm.graph.nodes if n.name == "w")
    w.meta[LAYOUT] = ((3, 5), (1, 3), 0, torch.float32)  # a transposed view: not an all-gather input as it is
    assert not untranspose._row_major(w.meta[LAYOUT])
    assert gather_untransposed(gm) == 0
