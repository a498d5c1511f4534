"""The ZeRO-3 prefetch rule (``meshpilot.planner.prefetch``): which gathers form a layer's group, where each
is issued, which run as one flat all-gather (``GatherGroup``), and how the simulator and the closed form
price them. The runtime's order (issued before the previous layer's compute, waited right before use, one
collective per group, equal to the single device) is checked on 4 gloo ranks in ``tests/test_grad_buckets.py``."""

from __future__ import annotations

import torch

from meshpilot.graph.capture import capture
from meshpilot.models.gpt import GPT, GPTConfig
from meshpilot.planner import forced
from meshpilot.planner.auto import plan
from meshpilot.planner.prefetch import layer_of, param_root, prefetch_groups, prefetch_points, prefetch_window_bytes

CFG = GPTConfig(vocab=64, seq=16, layers=3, hidden=32, heads=4, batch=8)


def _plan(kind):
    with torch.device("meta"):
        model = GPT(CFG)
    tok = torch.zeros(CFG.batch, CFG.seq, dtype=torch.long)
    inputs = (tok, tok)
    graph = capture(model, inputs)
    force = (forced.zero3 if kind == "zero3" else forced.data_parallel)(model, inputs, (4,))
    return plan(model, inputs, "atp-ic3", mesh_shape=(4,), force=force, graph=graph), graph


def test_layer_of():
    assert layer_of("blocks.2.attn.qkv.weight") == "blocks.2"
    assert layer_of("model.layers.10.mlp.up_proj.weight") == "model.layers.10"
    assert layer_of("wte.weight") == "wte"
    assert layer_of("bias") == "bias"


def test_zero3_groups_follow_the_layers_forward_and_back():
    p, graph = _plan("zero3")
    fwd = [g.layer for g in prefetch_groups(p, graph, "fwd")]
    bwd = [g.layer for g in prefetch_groups(p, graph, "bwd")]
    blocks = [f"blocks.{i}" for i in range(CFG.layers)]
    assert [x for x in fwd if x.startswith("blocks.")] == blocks
    assert [x for x in bwd if x.startswith("blocks.")] == blocks[::-1]
    index = {n.name: i for i, n in enumerate(p.nodes)}
    source = {(index[c.dst], c.operand): c.src for c in reversed(p.collectives) if c.dst in index}
    grouped = {e: g.layer for ph in ("fwd", "bwd") for g in prefetch_groups(p, graph, ph) for e in g.edges}
    for edge, layer in grouped.items():  # each a gather of one of its layer's parameters (or of a view of one)
        assert layer_of(param_root(graph, source[edge])) == layer
    gathers = {(index[c.dst], c.operand) for c in p.collectives if c.kind == "all_gather" and c.dst in index}
    activations = {e for e in gathers if param_root(graph, source[e]) is None}
    assert activations and not activations & set(grouped)  # this plan also gathers activations: never prefetched


def test_each_group_is_issued_at_the_previous_groups_first_consumer():
    p, graph = _plan("zero3")
    for phase in ("fwd", "bwd"):
        groups = prefetch_groups(p, graph, phase)
        points = prefetch_points(p, graph, phase)
        assert set(points) == {e for g in groups[1:] for e in g.edges}
        for prev, nxt in zip(groups, groups[1:]):
            assert prev.first < nxt.first
            assert all(points[e] == prev.first for e in nxt.edges)
        assert prefetch_window_bytes(p, graph, phase) == max(g.nbytes for g in groups[1:])


def test_data_parallel_has_nothing_to_prefetch():
    p, graph = _plan("dp")
    for phase in ("fwd", "bwd"):
        assert prefetch_groups(p, graph, phase) == []
        assert prefetch_points(p, graph, phase) == {}
        assert prefetch_window_bytes(p, graph, phase) == 0


def test_the_simulator_prices_the_prefetch_as_the_runtime_issues_it():
    """Simulated with the rule's issues (``prefetch_issues``), the ZeRO-3 step hides gathers behind compute it
    did not hide before and is no slower: prefetched gathers run on the link while the rank computes,
    where without prefetch none does; a data-parallel plan has nothing to prefetch."""
    import dataclasses

    from meshpilot.planner.prefetch import prefetch_issues
    from meshpilot.sim import simulate

    p, graph = _plan("zero3")
    assert prefetch_issues(p, graph) == {}  # every prefetched gather of this plan runs in a group
    p = dataclasses.replace(p, param_gathers=())  # one gather per edge, prefetched one layer ahead
    issues = prefetch_issues(p, graph)
    assert sum(len(cs) for cs in issues.values()) == len(prefetch_points(p, graph, "fwd")) + len(
        prefetch_points(p, graph, "bwd")
    )
    before, after = simulate(p), simulate(p, prefetch=issues)
    assert after.step_s <= before.step_s
    assert after.classes[0].hidden_comm_s > before.classes[0].hidden_comm_s
    prefetched = [c for cs in issues.values() for c in cs]
    assert overlapping(before, prefetched) == 0  # a blocking gather never runs beside compute
    assert overlapping(after, prefetched) > 0
    dp, dgraph = _plan("dp")
    assert prefetch_issues(dp, dgraph) == {}


def overlapping(result, collectives) -> int:
    """How many of `collectives` (indices into the plan's) run on the link of the first class' rank while it
    computes, in a simulated step (microbatch 0)."""
    rank = result.classes[0].ranks[0]
    mine = [e for e in result.events if e.rank == rank]
    compute = [(e.start_s, e.start_s + e.dur_s) for e in mine if e.cat == "compute"]
    n = 0
    for c in collectives:
        for e in mine:
            if e.cat == "comm" and e.name.endswith(f"#{c}.0"):
                a, b = e.start_s, e.start_s + e.dur_s
                n += any(min(b, y) - max(a, x) > 1e-12 for x, y in compute)
    return n


def _slow_cluster():
    from meshpilot.cluster.loader import cluster_from_dict

    layer = {"name": "rank", "ranks": 4, "p2p_GBps": 0.25, "group_GBps": 0.25, "latency_us": 125.0}
    device = {"kind": "local-cpu", "peak_tflops_fp32": 0.001, "memory_GBps": 10.0, "memory_GiB": 16.0}
    return cluster_from_dict({"name": "slow", "device_profile": device, "layers": [layer]}, source="test")


def test_closed_form_equals_the_simulator_without_buckets():
    """``gather_hidden_s`` walks each phase as the simulator runs it: on a plan without gradient buckets (whose
    reduce-scatters would share the backward's queue, which the closed form leaves out) it equals the simulated
    step's difference between one blocking gather per edge and the plan's groups issued a layer ahead (and, the
    groups removed, the per-edge prefetch), on a slow CPU cluster where the gathers take real time."""
    import dataclasses

    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.planner.prefetch import gather_hidden_s, prefetch_issues
    from meshpilot.sim import simulate

    cluster = _slow_cluster()
    p, graph = _plan("zero3")
    bare = dataclasses.replace(p, grad_buckets=())
    ungrouped = dataclasses.replace(bare, param_gathers=())
    serial = simulate(ungrouped, cluster=cluster).step_s
    cost = CostModel(LogicalMesh(cluster, (4,)))
    for q in (bare, ungrouped):
        saved = serial - simulate(q, cluster=cluster, prefetch=prefetch_issues(q, graph)).step_s
        closed = gather_hidden_s(q, graph, cost)
        assert saved > 0
        assert abs(closed - saved) <= 1e-9 + 1e-6 * saved, (closed, saved)
    # grouped, each layer pays one latency instead of one per parameter
    assert gather_hidden_s(bare, graph, cost) > gather_hidden_s(ungrouped, graph, cost)


def test_gather_groups_follow_the_prefetch_layers():
    """A ZeRO-3 plan's gather groups (``StagePlan.param_gathers``) are the prefetch rule's layer groups, each
    edge a single all-gather of one of the layer's parameters on one axis: the group's bytes their sum, its
    seconds one all-gather of them, its ``issue_at`` the previous layer group's first consumer (none for a
    phase's first); it survives the plan file, and the plan counts one collective per group instead of its
    edges' own."""
    from collections import Counter

    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.cluster.presets import load_cluster
    from meshpilot.planner.plan import Plan
    from meshpilot.planner.prefetch import active_gathers

    p, graph = _plan("zero3")
    groups = active_gathers(p)
    assert groups == p.param_gathers and len(groups) >= 4
    cost = CostModel(LogicalMesh(load_cluster("atp-ic3"), (4,)))
    for phase in ("fwd", "bwd"):
        layers = prefetch_groups(p, graph, phase)
        mine = [g for g in groups if g.phase.value == phase]
        assert [g.layer for g in mine] == [g.layer for g in layers]  # one axis, one dtype: one group per layer
        for k, (g, layer) in enumerate(zip(mine, layers)):
            assert g.issue_at == (p.nodes[layers[k - 1].first].name if k else "")
            assert [(p.nodes[d].name, a) for d, a in layer.edges] == list(g.edges)
            assert all(layer_of(q) == g.layer for q in g.params)
            cols = [c for c in p.collectives if c.phase == phase and (c.dst, c.operand) in set(g.edges)]
            assert len(cols) == len(g.edges) and {c.kind for c in cols} == {"all_gather"}
            assert g.nbytes == sum(c.nbytes for c in cols)
            assert g.seconds == cost.all_gather(g.nbytes, g.axis)
    again = Plan.from_json(Plan.single(p).to_json()).only
    assert again.param_gathers == p.param_gathers
    counts = p.collective_counts()
    gathers = sum(v for (kind, _, _), v in counts.items() if kind == "all_gather")
    members = sum(len(g.edges) for g in groups)
    assert gathers == sum(1 for c in p.collectives if c.kind == "all_gather") - members + len(groups)
    assert Counter(str(g.phase) for g in groups) == Counter({"fwd": len(groups) // 2, "bwd": len(groups) // 2})
    assert "ZeRO-3 gathers: " in p.summary() and "one flat all-gather each" in p.summary()


def test_old_plan_files_load_without_gather_groups():
    """A plan file from before the groups loads with none: one gather per edge, as it ran then."""
    import dataclasses

    from meshpilot.planner.plan import Plan

    p, _ = _plan("zero3")
    d = Plan.single(p).to_dict()
    st = d["stages"][0]["plan"] if "stages" in d else d
    st.pop("param_gathers")
    old = Plan.from_dict(d).only
    assert old.param_gathers == ()
    assert old.collective_counts() == dataclasses.replace(p, param_gathers=()).collective_counts()


def test_gather_groups_only_under_the_prefetched_schedules():
    """Where a schedule orders its collectives itself (``overlapped``), the planner makes no groups and a plan
    given one anyway does not count them: the runtime runs one gather per edge there."""
    import dataclasses

    from meshpilot.planner.prefetch import active_gathers
    from meshpilot.planner.schedule import overlapped

    p, _ = _plan("zero3")
    q = dataclasses.replace(p, schedule=overlapped(p, 1))
    assert q.param_gathers and not active_gathers(q)
    members = sum(len(g.edges) for g in p.param_gathers)
    assert sum(q.collective_counts().values()) == sum(p.collective_counts().values()) + members - len(p.param_gathers)


def test_the_simulator_runs_one_collective_per_group_beside_compute():
    """Simulated, a ZeRO-3 plan's step runs one collective per gather group (none of its members' own), and the
    groups issued a layer ahead run on the link while the rank computes."""
    from meshpilot.planner.prefetch import prefetch_issues
    from meshpilot.sim import simulate

    p, graph = _plan("zero3")
    result = simulate(p, cluster=_slow_cluster(), prefetch=prefetch_issues(p, graph))
    rank = result.classes[0].ranks[0]
    mine = [e for e in result.events if e.rank == rank]
    groups = [e for e in mine if e.cat == "comm" and e.name.startswith("gather group")]
    assert len(groups) == len(p.param_gathers)
    compute = [(e.start_s, e.start_s + e.dur_s) for e in mine if e.cat == "compute"]
    beside = sum(any(min(e.start_s + e.dur_s, y) - max(e.start_s, x) > 1e-12 for x, y in compute) for e in groups)
    assert beside >= len(p.param_gathers) // 2, beside
    members = {(g.phase.value, n, a) for g in p.param_gathers for n, a in g.edges}
    for c, col in enumerate(p.collectives):
        if (col.phase, col.dst, col.operand) in members:
            assert not any(e.name.endswith(f"#{c}.0") for e in mine), col
