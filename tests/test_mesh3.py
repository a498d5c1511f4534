"""3-axis meshes in the single-stage search (issue 31, item 4): which shapes (``cluster.mesh.mesh_shapes_3d``),
the strategy space cut to a data-parallel outer axis (``planner.axes``), and ``auto.plan`` trying them beside
the 2D shapes. The searched plan's run on 8 gloo ranks is in ``tests/test_models_parallel.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_models_parallel import build
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mesh_shapes_3d
from meshpilot.graph.capture import NodeKind, capture
from meshpilot.planner.auto import plan
from meshpilot.planner.axes import OUTER, OuterDataParallel, axis_uses
from meshpilot.planner.ilp import build_structure, priced, solve
from meshpilot.sharding.reshard import Resharder
from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

SLOW = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "emulated-2x4-slow.toml"
"""2 nodes x 4 ranks, 0.05 GB/s between the nodes and 2 GB/s inside one: the search picks (2, 2, 2) there."""


@pytest.mark.parametrize(
    ("cluster", "n", "want"),
    [
        ("dgx-h100:2", 16, [(2, 2, 4)]),  # 2 nodes of 8: the outer axis over the network
        ("alpa-p3x8", 64, [(8, 2, 4)]),
        ("atp-ic5:64", 64, []),  # one switch
        ("hidup-2x4-10g", 8, [(2, 2, 2)]),
        ("dgx-h100:2", 8, []),  # inside one node: nothing a 2D shape lacks
        ("dgx-h100:2", 12, []),  # not whole nodes
        ("atp-ic3", 8, []),  # one layer
        ("atp-ic2", 8, []),  # pairs of 2 GPUs: a prime unit
        (str(SLOW), 8, [(2, 2, 2)]),
    ],
)
def test_three_axis_shapes_follow_the_hierarchy(cluster, n, want):
    assert mesh_shapes_3d(load_cluster(cluster), n) == want


def test_no_three_axis_shapes_where_the_top_level_is_not_slower(tmp_path):
    fast = tmp_path / "fast.toml"
    fast.write_text(
        SLOW.read_text().replace("p2p_GBps = 0.05", "p2p_GBps = 2.0").replace("group_GBps = 0.05", "group_GBps = 2.0")
    )
    assert mesh_shapes_3d(load_cluster(str(fast)), 8) == []


@pytest.fixture(scope="module")
def gpt():
    model, inputs = build("gpt")
    return model, inputs, capture(model, inputs)


def _structure(graph, shape, builder_cls):
    dmesh = fake_device_mesh(shape)
    builder = builder_cls(graph, dmesh)
    cm = CostModel(LogicalMesh(load_cluster(str(SLOW)), shape))
    struct = build_structure(graph, builder, Resharder(dmesh, cm), cm)
    return builder, struct, priced(struct, Resharder(dmesh, cm))


def _on0(pls):
    return tuple(None if p is None else p[OUTER] for p in pls)


def test_outer_axis_is_cut_to_data_parallel_strategies(gpt):
    """Parameters whole on axis 0, inputs batch-split or whole; every operator either reads its operands'
    data-parallel placements on axis 0 or is replicated there; every node keeps a strategy; the ILP is
    a few times a 2D one's size (the uncut (2, 2, 2) had ~10x the variables of (2, 4): docs/benchmarks.md).
    The loss and the whole backward are data-parallel on axis 0 (2.6x the 2D ILP's variables): while the loss
    was DTensor's ``P(avg)`` its backward found no data-parallel strategy and the cut kept it whole (2.0x)."""
    _, _, graph = gpt
    builder, struct, prob = _structure(graph, (2, 2, 2), OuterDataParallel)
    assert 0 < builder.kept < builder.offered
    for node in graph.nodes:
        sts = struct.strategies[node.name]
        assert sts, node.name
        if node.kind == NodeKind.PARAM:
            assert all(_on0(s.outs) == (Replicate(),) for s in sts), node.name
        elif node.kind == NodeKind.INPUT:
            assert {_on0(s.outs) for s in sts} == {(Shard(0),), (Replicate(),)}, node.name
        elif node.inputs:
            want = tuple(builder.dp_of(src, i) for src, i in node.inputs)
            for s in sts:
                whole = all(p is None or isinstance(p, Replicate) for p in _on0(s.ins) + _on0(s.outs))
                assert _on0(s.ins) == want or whole, (node.name, s.short())
    # the weight gradients are partial over axis 0 under data parallelism (all-reduced into the replicas)
    assert any(isinstance(builder.dp_of(n.name, 0), Partial) for n in graph.nodes if n.kind == NodeKind.OP)
    _, _, prob2 = _structure(graph, (2, 4), StrategyBuilder)
    for name in ("nll_loss_backward", "_log_softmax_backward_data"):
        assert builder.dp_of(name, 0) == Shard(0), name
    cut, flat = solve(prob).num_vars, solve(prob2).num_vars
    assert cut <= 3 * flat, (cut, flat)


def test_restricted_enumeration_equals_the_cut_of_the_full_one(gpt, monkeypatch):
    """DTensor asked for axis-0 rules that read the data-parallel placements only (``axes._outer_rules``) gives
    every node exactly the strategies, in order, that cutting its full enumeration gives."""
    import contextlib

    from meshpilot.planner import axes

    _, _, graph = gpt
    monkeypatch.setattr(axes, "_OUTER_CACHE", {})
    _, fast, _ = _structure(graph, (2, 2, 2), OuterDataParallel)
    monkeypatch.setattr(axes, "_OUTER_CACHE", {})
    monkeypatch.setattr(axes, "_outer_rules", lambda *a: contextlib.nullcontext())
    _, slow, _ = _structure(graph, (2, 2, 2), OuterDataParallel)
    for node in graph.nodes:
        got = [(s.outs, s.ins, s.source) for s in fast.strategies[node.name]]
        assert got == [(s.outs, s.ins, s.source) for s in slow.strategies[node.name]], node.name


def test_search_picks_a_three_axis_mesh_on_a_slow_link(gpt):
    """On 2 nodes joined by a slow link the search tries (2, 2, 2) beside the 2D shapes (the row mapping only:
    axis 0 over the nodes) and keeps the least step of every candidate; the cut (2, 2, 2) is priced no lower
    than the same mesh searched whole (a subset of its plans: until the loss's fix its backward, cut whole, was
    priced at a tenth of that and chosen); a (2, 2, 2) plan's axes are named by the level they cross and their
    use is read off the plan."""
    model, inputs, graph = gpt
    p = plan(model, inputs, str(SLOW), graph=graph)
    tried = {(tuple(c.shape), c.mapping): c for c in p.solver.candidates}
    assert ((2, 2, 2), "row") in tried and ((2, 2, 2), "col") not in tried
    assert {s for s, _ in tried} >= {(8, 1), (4, 2), (2, 4), (1, 8)}
    best = min(c.objective_s for c in p.solver.candidates if c.objective_s is not None)
    assert p.time.overlapped_s == pytest.approx(best)
    whole = plan(model, inputs, str(SLOW), graph=graph, mesh_shape=(2, 2, 2), mappings=("row",))
    assert tried[(2, 2, 2), "row"].objective_s >= whole.time.overlapped_s * (1 - 1e-6)
    assert whole.mesh_axes[0] == "node" and whole.mesh_axes[1:] == ("rank.1", "rank.2")
    assert len(axis_uses(whole)) == 3


def test_given_shape_or_forced_layouts_search_no_three_axis_shape(gpt):
    model, inputs, graph = gpt
    p = plan(model, inputs, str(SLOW), graph=graph, force={"*": "RR"})
    assert all(len(c.shape) == 2 for c in p.solver.candidates)
    p = plan(model, inputs, str(SLOW), graph=graph, mappings=("col",))
    assert all(len(c.shape) == 2 for c in p.solver.candidates)
