"""Stacked capture (``graph.replicate``): a model of more than four identical blocks traced with three (or,
where its last block is not a middle one, four) and the rest copied is the whole trace node for node — names,
ops, arguments, fake values, places, FLOPs, phases, repeats — so the same plans, and the plan of the copied
graph runs equal to one device on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from dist_utils import lockstep_adamw, run_distributed
from test_graph_capture import Tiny
from torch import nn

from meshpilot.graph import replicate
from meshpilot.graph.capture import OpGraph, capture
from meshpilot.models.zoo import PlanBenchTransformer


def _tiny(layers: int = 6):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
    return Tiny(layers=layers, h=32, heads=4, vocab=64), inputs


def _described(g: OpGraph) -> tuple:
    """Everything the planner and runtime read of a graph, as comparable values."""

    def val(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.stride(), v.dtype
        return tuple(val(x) for x in v) if isinstance(v, (tuple, list)) else repr(v)

    nodes = []
    for n in g.nodes:
        fx = n.fx_node
        nodes.append(
            (n.name, n.kind, n.target, n.inputs, n.outputs, n.flops, n.bytes_read, n.bytes_written, n.fqn, n.phase)
            + (n.is_view, n.saved_for_backward, n.depth, n.module, n.source, val(fx.meta.get("val")))
            + (repr((fx.args, fx.kwargs)),)
        )
    return nodes, g.param_names, g.buffer_names, g.loss, g.grads, g.buffer_updates, g.canonical, g.repeats


def _stacked(model, inputs) -> tuple[OpGraph, bool]:
    """The stacked capture and whether it copied blocks (rather than tracing them all)."""
    graph, used = _cuts(model, inputs)
    return graph, used[-1:] == [True]


def _cuts(model, inputs, tries=None) -> tuple[OpGraph, list[bool]]:
    """The stacked capture with the cuts `tries` (default :data:`replicate.TRIES`) and, per cut traced, whether
    it passed the checks (``replicate.extend``)."""
    used = []
    orig, default = replicate.extend, replicate.TRIES

    def spy(*a, **k):
        out = orig(*a, **k)
        used.append(out is not None)
        return out

    replicate.extend, replicate.TRIES = spy, tries or default
    try:
        return capture(model, inputs), used
    finally:
        replicate.extend, replicate.TRIES = orig, default


@pytest.mark.parametrize("layers", [5, 7])
def test_stacked_capture_is_the_whole_trace(layers):
    model, inputs = _tiny(layers)
    fast, copied = _stacked(model, inputs)
    assert copied
    assert _described(fast) == _described(capture(model, inputs, stacked=False))
    assert fast.fingerprint() == capture(model, inputs, stacked=False).fingerprint()


def test_stacked_capture_of_the_planning_benchmark_on_meta():
    with torch.device("meta"):
        model = PlanBenchTransformer(6, 64, 4)
    x = torch.empty(2, 16, 64, device="meta")
    fast, copied = _stacked(model, (x,))
    assert copied and [c for _, _, c in fast.repeats] == [5, 5, 2]
    assert _described(fast) == _described(capture(model, (x,), stacked=False))


def _three_and_four(model, inputs) -> None:
    """Three traced blocks pass and give the four-block path's graph node for node, and the whole trace's."""
    three, used3 = _cuts(model, inputs)
    four, used4 = _cuts(model, inputs, (replicate.KEEP,))
    assert replicate.TRIES[0] == replicate.THREE and used3 == [True] and used4 == [True]
    assert _described(three) == _described(four) == _described(capture(model, inputs, stacked=False))
    assert three.fingerprint() == four.fingerprint()


@pytest.mark.parametrize("layers", [5, 7])
def test_three_traced_blocks_are_the_four_block_graph(layers):
    _three_and_four(*_tiny(layers))


def test_three_traced_blocks_of_the_planning_benchmark_are_the_four_block_graph():
    with torch.device("meta"):
        model = PlanBenchTransformer(6, 64, 4)
    _three_and_four(model, (torch.empty(2, 16, 64, device="meta"),))


class _Scaled(nn.Module):
    """A block whose output is scaled by a factor its caller passes."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, scale: float):
        return self.block(x) * scale


class _LastScaled(nn.Module):
    """Tiny with its last block's output halved: the last block is not a middle one by its ops alone (no
    attribute says so), so three traced blocks fail the checks and four pass."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        tiny, self.inputs = _tiny(layers)
        self.emb, self.head = tiny.emb, tiny.head
        self.blocks = nn.ModuleList(_Scaled(b) for b in tiny.blocks)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for j, b in enumerate(self.blocks):
            x = b(x, 0.5 if j == len(self.blocks) - 1 else 1.0)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def test_a_last_block_unlike_the_middle_ones_falls_back_to_four_traced_blocks():
    model = _LastScaled(6)
    fast, used = _cuts(model, model.inputs)
    assert used == [False, True]  # three traced: refused; four: copied
    assert _described(fast) == _described(capture(model, model.inputs, stacked=False))


def test_unlike_blocks_and_short_stacks_are_traced_whole():
    model, inputs = _tiny(4)  # four blocks: nothing to copy
    assert replicate.find_container(model) is None
    model, inputs = _tiny(6)
    model.blocks[3].o = nn.Linear(32, 32, bias=True)  # one block unlike the others
    assert replicate.find_container(model) is None
    assert len(capture(model, inputs).param_names) == len(list(model.parameters()))
    model, inputs = _tiny(6)
    for j, block in enumerate(model.blocks):  # a flag set apart every fifth block, a counter in every block
        block.windowed, block.layer_idx = j % 5 == 4, j
    assert replicate.find_container(model) is None
    for block in model.blocks:
        block.windowed = False
    assert replicate.find_container(model).blocks == 6  # the flag alike in every block; the counter is one


HF = {
    "hf:bert": ["num_hidden_layers=6", "hidden_size=32", "intermediate_size=64", "num_attention_heads=4"],
    # a traced constant in every layer (the attention's scale): each copy gets its own
    "hf:gpt2": ["n_layer=6", "n_embd=64", "n_head=4", "n_positions=64"],
    "hf:llama": ["num_hidden_layers=6", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4"]
    + ["num_key_value_heads=2"],
}


@pytest.mark.parametrize("name", sorted(HF))
def test_hf_stack_is_the_whole_trace(name):
    pytest.importorskip("transformers")
    from meshpilot.models.sources import build_model

    built = build_model(name, hf_config=[*HF[name], "vocab_size=128"], batch=2, seq=16, device="meta")
    fast, copied = _stacked(built.model, built.inputs)
    assert copied
    whole = capture(built.model, built.inputs, stacked=False)
    assert _described(fast) == _described(whole)
    assert {k: (v.dtype, v.shape, v.tolist()) for k, v in fast.consts.items()} == {
        k: (v.dtype, v.shape, v.tolist()) for k, v in whole.consts.items()
    }


def test_plans_of_the_stacked_graph_are_the_whole_graphs():
    from meshpilot.planner.auto import plan

    model, inputs = _tiny(6)
    for shape in [(2, 2), (4, 1)]:
        a = plan(model, inputs, "atp-ic3", mesh_shape=shape, graph=capture(model, inputs))
        b = plan(model, inputs, "atp-ic3", mesh_shape=shape, graph=capture(model, inputs, stacked=False))
        assert a.strategy_lines() == b.strategy_lines() and a.time == b.time and a.memory == b.memory


def _worker(plan_json: str, graph) -> dict:
    """The plan run on `graph` (the stacked capture of ``_tiny(6)``, made once in the parent by the call each rank
    made) beside the single device."""
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.spmd import parallelize

    ref, inputs = _tiny(6)
    model, _ = _tiny(6)
    pm = parallelize(model, StagePlan.from_json(plan_json), graph=graph)
    r = lockstep_adamw(ref, pm, inputs, steps=2)
    return {"loss": max(r["loss"]), "grad": max(r["grad"]), "param": r["param"]}


@pytest.mark.dist
def test_plan_of_copied_blocks_runs_equal_to_one_device():
    from meshpilot.planner.auto import plan

    model, inputs = _tiny(6)
    p = plan(model, inputs, "atp-ic3", mesh_shape=(2, 2))
    for r in run_distributed(_worker, 4, p.to_json(), capture(model, inputs)):
        assert r["loss"] <= 1e-5 and r["grad"] <= 1e-5 and r["param"] <= 1e-5, r
