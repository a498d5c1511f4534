"""The stage-planning entry point a pipeline DP calls: layers, graph slices, cached stage costs."""

import warnings

import pytest

from meshpilot.errors import UserError
from meshpilot.graph.capture import NodeKind, Phase, capture
from meshpilot.models import builtin_models
from meshpilot.planner.auto import plan
from meshpilot.planner.stage import BOUNDARY, StagePlanner, layers, slice_graph


@pytest.fixture(scope="module")
def gpt():
    model, inputs = builtin_models()["gpt-tiny"].build("meta", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, inputs)
    return model, inputs, graph


@pytest.fixture(scope="module")
def planner(gpt):
    return StagePlanner(gpt[2], "atp-ic3")


def test_layers_partition_the_graph_in_forward_order(gpt):
    graph = gpt[2]
    found = layers(graph)
    assert [x.name for x in found] == ["wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head"]
    names = [n for x in found for n in x.nodes]
    assert sorted(names) == sorted(n.name for n in graph.nodes)  # every node in exactly one layer
    blocks = [x for x in found if x.name.startswith("blocks.")]
    assert blocks[0].flops == blocks[1].flops > 0 and len(blocks[0].nodes) == len(blocks[1].nodes)
    # a block's backward is in the block: both phases present
    assert {graph[n].phase for n in blocks[0].nodes if graph[n].kind == NodeKind.OP} == {Phase.FWD, Phase.BWD}


def test_slices_have_boundaries_and_the_loss_only_at_the_end(gpt):
    graph = gpt[2]
    first, last = slice_graph(graph, 0, 3), slice_graph(graph, 3, 6)
    assert first.loss is None and last.loss == graph.loss
    for sub in (first, last):
        bounds = [n for n in sub.nodes if n.name.startswith(BOUNDARY)]
        assert bounds and all(n.kind == NodeKind.INPUT and sub.users[n.name] != [] for n in bounds)
        assert [n.index for n in sub.nodes] == list(range(len(sub.nodes)))
        inside = {n.name for n in sub.nodes}
        assert all(src in inside for n in sub.nodes for src, _ in n.inputs)
    # every op is in exactly one of the two stages
    ops = lambda g: {n.name for n in g.nodes if n.kind == NodeKind.OP}  # noqa: E731
    assert ops(first) | ops(last) == ops(graph) and not ops(first) & ops(last)
    with pytest.raises(UserError, match=r"layers \[4, 9\): the model has 6 layers"):
        slice_graph(graph, 4, 9)


def test_whole_model_stage_equals_the_plan_on_that_mesh(gpt, planner):
    model, inputs, graph = gpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = plan(model, inputs, "atp-ic3", mesh_shape=(2, 2), graph=graph)
    stage = planner.plan(0, 6, range(4), (2, 2))
    assert stage.time.total_s == pytest.approx(whole.time.total_s, rel=1e-12)
    assert stage.memory.total == pytest.approx(whole.memory.total, rel=1e-12)
    assert stage.mapping == whole.mapping and 0 < stage.forward_s < stage.time.total_s
    # the phase peaks: the larger one is the step's peak; activations are what the backward reads
    peaks = stage.peaks
    assert max(peaks.update, peaks.forward_backward) == pytest.approx(stage.memory.total, rel=1e-12)
    assert 0 < peaks.activations < peaks.forward_backward


def test_stage_costs_are_cached_and_add_up(gpt, planner):
    a = planner.plan(0, 3, (0, 1), (2, 1))
    b = planner.plan(3, 6, (2, 3), (2, 1))
    misses = planner.misses
    assert planner.plan(0, 3, (0, 1), (2, 1)) is a and planner.misses == misses and planner.hits >= 1
    assert max(a.time.total_s, b.time.total_s) < planner.plan(0, 6, (0, 1), (2, 1)).time.total_s
    # on one device no choice changes the work: compute splits exactly between the stages
    one = [planner.plan(x, y, (0,), (1, 1)).time for x, y in ((0, 3), (3, 6), (0, 6))]
    assert one[0].compute_s + one[1].compute_s == pytest.approx(one[2].compute_s, rel=1e-12)
    assert one[2].communication_s == one[2].resharding_s == 0


def test_bad_stage_requests_are_one_line(planner):
    with pytest.raises(UserError, match=r"mesh \(2, 2\) needs 4 distinct ranks; got \[0, 1\]"):
        planner.plan(0, 2, (0, 1), (2, 2))
    with pytest.raises(UserError, match=r"ranks \[0, 100000\]: cluster 'atp-ic3' has ranks 0\.\."):
        planner.plan(0, 2, (0, 100_000), (2, 1))


def test_a_mapping_priced_like_one_tried_is_not_solved_again(gpt, monkeypatch):
    """On a 2x2 block of one ``alpa-p3x8`` node (uniform links) the column mapping reads the same axis sizes,
    bandwidths and latencies as the row mapping: the search solves the row mapping's ILP only and keeps its
    plan, the one searching both gives (the strict comparison keeps the first of equals). On 2x4 the two differ
    (an axis of 2 over 2 or 4 apart) and both are searched."""
    from meshpilot.cluster.mesh import MeshMapping
    from meshpilot.planner import stage as stage_mod

    calls = []
    real = stage_mod.get_searcher

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def search(self, task):
            calls.append(task.mapping)
            return self.inner.search(task)

    monkeypatch.setattr(stage_mod, "get_searcher", lambda name: Counting(real(name)))
    sp = StagePlanner(gpt[2], "alpa-p3x8")
    square = sp.plan(0, 3, range(4), (2, 2))
    assert calls == [MeshMapping.ROW] and square.mapping == MeshMapping.ROW
    task_col = sp._priced_as(tuple(range(4)), (2, 2), MeshMapping.COL)
    assert task_col == sp._priced_as(tuple(range(4)), (2, 2), MeshMapping.ROW)
    calls.clear()
    both = sp.plan(0, 3, range(8), (2, 4))
    assert calls == [MeshMapping.ROW, MeshMapping.COL]
    # `mappings=`: only those searched (the estimated stage table's catalogue, ``stack`` module docstring, 5), a
    # cache entry of its own; the mapping the search of both chose gives that search's plan
    calls.clear()
    one = sp.plan(0, 3, range(8), (2, 4), mappings=(both.mapping,))
    assert calls == [both.mapping] and one.time == both.time and one.mapping == both.mapping
    calls.clear()
    assert sp.plan(0, 3, range(8), (2, 4)) is both and sp.plan(0, 3, range(8), (2, 4), mappings=(both.mapping,)) is one
    assert calls == []


def test_a_stage_keeps_a_pin_that_names_an_operator(gpt, planner):
    """A ``force`` pattern naming an operator exactly (as ``planner.forced`` pins Megatron's row products and
    sequence-parallel adds) holds in a stage's plan as in the whole model's: stage planning once kept only the
    pins naming leaves (parameters, inputs) and silently planned every stage without its operator pins."""
    model, inputs, graph = gpt
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = plan(model, inputs, "atp-ic3", mesh_shape=(2, 2), graph=graph)
        # the first forward matmul of a block the free plan shards, pinned whole on every device instead
        op = next(
            n.name
            for n in graph.nodes
            if n.kind == NodeKind.OP
            and n.phase == Phase.FWD
            and n.target in ("aten.mm.default", "aten.addmm.default")
            and "".join(free.node(n.name).outs[0]) != "RR"
        )
        force = {op: "RR"}
        whole = plan(model, inputs, "atp-ic3", mesh_shape=(2, 2), graph=graph, force=force)
    assert "".join(whole.node(op).outs[0]) == "RR"
    assert whole.time.total_s > free.time.total_s  # the pin costs something: dropping it would show
    stage = planner.plan(0, 6, range(4), (2, 2), force=force)
    assert stage.time.total_s == pytest.approx(whole.time.total_s, rel=1e-12)
    assert stage.memory.total == pytest.approx(whole.memory.total, rel=1e-12)
    assert planner.plan(0, 6, range(4), (2, 2)).time.total_s == pytest.approx(free.time.total_s, rel=1e-12)
