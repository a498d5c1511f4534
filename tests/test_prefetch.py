"""The ZeRO-3 prefetch rule (``meshpilot.planner.prefetch``): which gathers form a layer's group and where each
is issued. The runtime's order (issued before the previous layer's compute, waited right before use, equal to
the single device) is checked on 4 gloo ranks in ``tests/test_grad_buckets.py``."""

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
    from meshpilot.planner.prefetch import prefetch_issues
    from meshpilot.sim import simulate

    p, graph = _plan("zero3")
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


def test_closed_form_equals_the_simulator_without_buckets():
    """``prefetch_hidden_s`` walks each phase as the simulator runs it: on a plan without gradient buckets (whose
    reduce-scatters would share the backward's queue, which the closed form leaves out) it equals the simulated
    step's difference with and without prefetch, on a slow CPU cluster where the gathers take real time."""
    import dataclasses

    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.loader import cluster_from_dict
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.planner.prefetch import prefetch_hidden_s, prefetch_issues
    from meshpilot.sim import simulate

    layer = {"name": "rank", "ranks": 4, "p2p_GBps": 0.25, "group_GBps": 0.25, "latency_us": 125.0}
    device = {"kind": "local-cpu", "peak_tflops_fp32": 0.001, "memory_GBps": 10.0, "memory_GiB": 16.0}
    cluster = cluster_from_dict({"name": "slow", "device_profile": device, "layers": [layer]}, source="test")
    p, graph = _plan("zero3")
    bare = dataclasses.replace(p, grad_buckets=())
    issues = prefetch_issues(bare, graph)
    saved = simulate(bare, cluster=cluster).step_s - simulate(bare, cluster=cluster, prefetch=issues).step_s
    closed = prefetch_hidden_s(bare, graph, CostModel(LogicalMesh(cluster, (4,))))
    assert saved > 0
    assert abs(closed - saved) <= 1e-9 + 1e-6 * saved, (closed, saved)
