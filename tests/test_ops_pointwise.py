"""The untagged elementwise ops ``meshpilot.ops.pointwise`` gives DTensor's pointwise strategy are elementwise, and
``index_add`` (``meshpilot.ops.index_add``) and ``unfold`` (``meshpilot.ops.unfold``) plan sharded off their
indexed dim.
Their planning is checked on the families that use them (``tests/test_hf_families.py``: Llama-4's
``floor_divide``), their 4-rank runs in the family sweep (``benchmarks/bench_hf_families.py --run``)."""

from __future__ import annotations

import pytest
import torch

from meshpilot.ops import pointwise


@pytest.mark.parametrize("op", pointwise.OPS, ids=str)
def test_each_listed_op_is_elementwise(op):
    """The pointwise strategy's assumption, checked on the op itself: computing it on a block of its
    operands gives that block of its output."""
    torch.manual_seed(0)
    x, g = torch.randn(4, 6), torch.randn(4, 6)
    name = str(op)
    if "masked_fill" in name:
        args = (x, x > 0, torch.tensor(2.0))
    elif "polar" in name:
        args = (x.abs(), g)
    elif "floor_divide.Scalar" in name:
        args = (x, 0.7)
    elif "floor_divide" in name:
        args = (x, g.abs() + 0.5)
    elif name == "aten.elu_backward.default":
        args = (g, 1.0, 1.0, 1.0, False, x)  # (grad_output, alpha, scale, input_scale, is_result, self)
    elif "log_sigmoid_backward" in name:
        args = (g, x, torch.ops.aten.log_sigmoid_forward(x)[1])
    elif "backward" in name:
        extra = {"softplus": (1.0, 20.0), "softshrink": (0.5,), "hardshrink": (0.5,)}
        extra |= {"leaky_relu": (0.01, False), "hardtanh": (-1.0, 1.0)}
        key = name.split(".")[1].removesuffix("_backward")
        args = (g, x, *extra.get(key, ()))
    else:
        args = (x,)
    block = tuple(slice(1, 3) for _ in range(2))
    whole = op(*args)
    part = op(*[a[block] if isinstance(a, torch.Tensor) and a.dim() == 2 else a for a in args])
    for w, p in zip(whole if isinstance(whole, tuple) else (whole,), part if isinstance(part, tuple) else (part,)):
        assert torch.equal(w[block], p)


class _Select(torch.nn.Module):
    """``index_select`` along the last dim (XLNet's relative shift): its backward is ``index_add``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)  # [b, s, 8]
        return torch.index_select(y, 2, torch.arange(6, device=y.device)).square().mean()


def test_index_add_plans_sharded_off_its_indexed_dim():
    """``index_add`` had no strategy (a replicated fallback); ``meshpilot.ops.index_add`` shards it on the
    other dims."""
    from meshpilot.planner.auto import plan

    p = plan(_Select(), (torch.randn(8, 4, 8),), "dgx-h100", mesh_shape=(2, 2), mappings=("row",))
    adds = [n for n in p.nodes if "index_add" in n.target]
    assert adds and not p.fallbacks, [f.line() for f in p.fallbacks]
    assert all("S(2)" not in pl for n in adds for pl in n.outs[0]), [n.outs for n in adds]


class _Unfold(torch.nn.Module):
    """``unfold`` (``im2col``) and a 2-D average pooling of a sequence (ConvBERT's, Funnel's): the pooling's
    backward is ``avg_pool2d_backward``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).unsqueeze(1)  # [b, 1, s, 8]
        cols = torch.nn.functional.unfold(y, kernel_size=(3, 1), padding=(1, 0))  # [b, 3, s * 8]
        pooled = torch.nn.functional.avg_pool2d(y, (2, 1), stride=(2, 1))
        return cols.square().mean() + pooled.square().mean()


def test_per_sample_kernels_plan_without_fallback():
    """``im2col`` and ``avg_pool2d_backward`` had no strategy; ``meshpilot.ops.batched`` shards them on the
    batch."""
    from meshpilot.planner.auto import plan

    p = plan(_Unfold(), (torch.randn(8, 4, 8),), "dgx-h100", mesh_shape=(2, 2), mappings=("row",))
    assert {"im2col", "avg_pool2d_backward"} <= {n.target.split(".")[1] for n in p.nodes if n.kind == "op"}
    assert not p.fallbacks, [f.line() for f in p.fallbacks]


class _Windows(torch.nn.Module):
    """Sliding windows along the sequence (``Tensor.unfold``, Inkling2's short convolution): its backward is
    ``unfold_backward``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).transpose(1, 2)  # [b, 8, s]
        windows = y.unfold(-1, 3, 1)  # [b, 8, s - 2, 3]
        return (windows * torch.arange(3.0)).sum(-1).square().mean()


def test_unfold_plans_sharded_off_its_unfolded_dim():
    """``unfold`` and ``unfold_backward`` had no strategy; ``meshpilot.ops.unfold`` shards them on the other dims,
    and the backward run on a block (with the block's sizes) is that block of the whole backward."""
    from meshpilot.ops.unfold import _local_sizes
    from meshpilot.planner.auto import plan

    p = plan(_Windows(), (torch.randn(8, 6, 8),), "dgx-h100", mesh_shape=(2, 2), mappings=("row",))
    assert {"unfold", "unfold_backward"} <= {n.target.split(".")[1] for n in p.nodes if n.kind == "op"}
    assert not p.fallbacks, [f.line() for f in p.fallbacks]
    unfolds = [n for n in p.nodes if n.target.startswith("aten.unfold")]
    assert all("S(2)" not in pl for n in unfolds for pl in n.outs[0]), [n.outs for n in unfolds]
    g = torch.randn(4, 6, 5, 3)
    whole = torch.ops.aten.unfold_backward(g, [4, 6, 7], 2, 3, 1)
    part = torch.ops.aten.unfold_backward(g[1:3, 2:5], _local_sizes(g[1:3, 2:5], [4, 6, 7], 2), 2, 3, 1)
    assert torch.equal(whole[1:3, 2:5], part)
