"""Megatron sequence parallelism as a layout (``planner.forced.megatron_tp(..., sequence_parallel=True)``).

The row linears' residual adds are pinned sequence-sharded over the TP axis; the plan must then reduce-scatter
the row-parallel partial sums into them (plain TP all-reduces there) and all-gather the sequence again before
the column linears, and the runtime must run that plan equal to one device: the zoo's tiny GPT and a tiny
Hugging Face Llama (``use_cache=False``) on 4 gloo ranks, meshes (2, 2) and (1, 4) with TP on the last axis,
3 AdamW steps, loss and every gradient within 1e-5 and each step's collectives the plan's.

As Megatron's SP, the backward gathers each pinned norm output again from its saved shard rather than keep the
gathered copy (``planner.recompute``, *Re-gathered values*): the plan's backward holds those all-gathers, its
accounting saves the shard, and in the same spawn a wider Llama's SP plan (:func:`_wide`) holds within 10 % of
the peak its ranks measure (``cluster.memtrack.StorageTracker``, as ``benchmarks/bench_recompute.py`` measures).
"""

from __future__ import annotations

import pytest
from dist_utils import captures, graph_of, lockstep_adamw, run_distributed
from tiers import matrix

TOL = 1e-5
MEMORY_TOL = 0.10
STEPS = 3
WORLD = 4
MESHES = ((2, 2), (1, 4))
MODELS = ("gpt", "llama")
TP_AXIS = 1
RUNS = matrix(
    (("gpt", (1, 4)), ("llama", (2, 2))),
    tuple((name, shape) for name in MODELS for shape in MESHES),
)
"""The SP plans run on the 4 ranks (every one is planned and checked). Default: each model on one mesh, each
mesh once (the GPT on (1, 4), the Llama on (2, 2)); full only: the GPT on (2, 2) and the Llama on (1, 4). The
spawn's CPU s (ranks included): 134 before (the last full run, load ~20), 66 after (default, load ~7); the file:
201 before, 79 after (5 passed)."""


def _build(name: str):
    """The model (seeded) and its inputs: the zoo GPT (2 blocks, h 32, batch 8, sequence 8) or HF's tiny
    Llama (2 layers, h 32, batch 4, sequence 8)."""
    if name == "gpt":
        from test_models_parallel import build

        return build("gpt")
    from meshpilot.models.hf_families import Family, build, no_dropout, tiny_overrides

    return build(Family("llama", "LlamaForCausalLM", "causal"), {**tiny_overrides("llama"), **no_dropout("llama")})


def _plans(name: str, shape: tuple[int, int]):
    """(plain TP plan, SP plan, the SP pins of residual adds, the graph) of model `name` on mesh `shape`;
    the SP pins of the norm outputs the column linears read are checked apart."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import plan
    from meshpilot.planner.forced import megatron_tp

    model, inputs = _build(name)
    graph = capture(model, inputs)
    tp = megatron_tp(model, inputs, shape, graph=graph)
    sp = megatron_tp(model, inputs, shape, graph=graph, sequence_parallel=True)
    p_tp = plan(model, inputs, "atp-ic3", mesh_shape=shape, force=tp, graph=graph)
    p_sp = plan(model, inputs, "atp-ic3", mesh_shape=shape, force=sp, graph=graph)
    pins = {k: v for k, v in sp.items() if k not in tp}
    gathered = {k: v for k, v in pins.items() if graph[k].target != "aten.add.Tensor"}
    assert all(v.endswith("R") for v in gathered.values()), gathered  # the columns read the sequence whole
    # Llama's RMSNorm ends in a multiply: each block's two norms and the final one before the head are pinned;
    # GPT's LayerNorm output is an item of native_layer_norm's tuple, left to the ILP (it gathers per column)
    assert len(gathered) == (2 * 2 + 1 if name == "llama" else 0), gathered
    for node, lay in gathered.items():
        assert "".join(p_sp.node(node).outs[0]) == lay
    regathered = tuple("regather:" + k for k in gathered)  # every gathered norm output gathered again
    assert (p_sp.recompute.regions if p_sp.recompute is not None else ()) == regathered
    return p_tp, p_sp, {k: v for k, v in pins.items() if k not in gathered}, graph


@pytest.fixture(scope="module")
def plans():
    return {(name, shape): _plans(name, shape) for name in MODELS for shape in MESHES}


def test_sequence_parallel_pins_every_residual_add_on_the_sequence_dim(plans):
    """Two blocks, two row linears each: four residual adds, each ``[batch, seq, hidden]`` sharded on the
    sequence (dim 1) over the TP axis and on the batch over DP where there is one."""
    for (name, shape), (_, p_sp, pins, graph) in plans.items():
        assert len(pins) == 4, (name, shape, pins)
        for node, lay in pins.items():
            assert graph[node].target == "aten.add.Tensor"
            assert lay == ("S(0)" if shape[0] > 1 else "R") + "S(1)", (name, shape, node, lay)
            assert "".join(p_sp.node(node).outs[0]) == lay  # the plan keeps the pin


def test_partial_sums_reach_the_residual_adds_reduce_scattered(plans):
    """Sequence parallelism reduce-scatters the row linears' partial sums into the residual adds and
    all-gathers the sequence again before the column linears, in the forward; plain TP does neither there."""
    for (name, shape), (p_tp, p_sp, pins, _) in plans.items():
        into = {c.dst: c.kind for c in p_sp.collectives if c.phase == "fwd" and c.axis == TP_AXIS}
        rs = [c for c in p_sp.collectives if c.phase == "fwd" and c.axis == TP_AXIS and c.dst in pins]
        assert {c.dst for c in rs if c.kind == "reduce_scatter"} == set(pins), (name, shape, into)
        fwd_sp = [c.kind for c in p_sp.collectives if c.phase == "fwd" and c.axis == TP_AXIS]
        assert "all_gather" in fwd_sp, (name, shape, fwd_sp)
        # plain TP keeps these adds whole or partial on the TP axis (on these latency-bound sizes the ILP
        # carries the partial sums through the residual stream and reduces them where a norm needs them)
        assert all(p_tp.node(n).outs[0][TP_AXIS] in ("P", "R") for n in pins), (name, shape)
        assert not any(c.dst in pins for c in p_tp.collectives)


def test_the_backward_gathers_the_norm_outputs_again_and_saves_their_shards(plans):
    """Each re-gathered norm output: not saved for the backward (its sequence shard is), gathered again there by
    an all-gather on the TP axis that reads into or out of its backward copy; the plan saves less than the same
    strategies with the gathered copies kept."""
    from meshpilot.planner.accounting import phase_peaks, plan_strategies, saved_values, storage_base
    from meshpilot.planner.recompute import REGATHER, for_plan, gather_region, original

    for (name, shape), (_, p_sp, _, graph) in plans.items():
        if name != "llama":
            continue
        g = for_plan(graph, p_sp)
        saved = {s for s, _ in saved_values(g)}
        regathered = 0
        for region in p_sp.recompute.regions:
            node = region.removeprefix(REGATHER)
            chain = set(gather_region(graph, node).recomputed)
            copies = {n.name for n in g.nodes if original(n.name) in chain and n.name not in chain}
            assert node not in saved and copies, (name, shape, node)
            shard = {storage_base(graph, s, i)[0] for s, i in graph[node].inputs if graph[s].kind != "param"}
            assert shard and shard <= saved, (name, shape, node)  # the normalised value, sequence-sharded
            tp_gathers = [c for c in p_sp.collectives if c.kind == "all_gather" and c.axis == TP_AXIS]
            forward = [c for c in tp_gathers if c.phase == "fwd" and c.dst in chain]
            again = [c for c in tp_gathers if c.phase == "bwd" and {c.src, c.dst} & copies]
            # gathered in the forward (not the first block's norm, whose input the vocabulary-parallel lookup
            # leaves whole on TP at DP 1): gathered again in the backward
            assert len(again) >= len(forward), (name, shape, node)
            regathered += len(again)
        assert regathered >= 2 * 2 - 1, (name, shape)  # the blocks' norms, but perhaps the first
        chosen = plan_strategies(p_sp, g)
        regathering = phase_peaks(g, chosen, p_sp.mesh_shape).activations
        kept = phase_peaks(graph, {n.name: chosen[n.name] for n in graph.nodes}, p_sp.mesh_shape).activations
        assert regathering < kept, (name, shape, regathering, kept)


def _wide():
    """HF's tiny Llama made wider and longer, so that activations outweigh the weights: 2 layers, h 128, 4
    heads of 32, FFN 256, batch 4, sequence 256."""
    from meshpilot.models.hf_families import Family, build, no_dropout, tiny_overrides

    wide = {**tiny_overrides("llama"), **no_dropout("llama")}
    wide.update(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=32)
    wide.update(max_position_embeddings=256)
    return build(Family("llama", "LlamaForCausalLM", "causal"), wide, batch=4, seq=256)


@pytest.fixture(scope="module")
def wide():
    """The SP plan of :func:`_wide` on a (1, 4) mesh, and the capture it was planned on."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import plan
    from meshpilot.planner.forced import megatron_tp

    model, inputs = _wide()
    graph = capture(model, inputs)
    sp = megatron_tp(model, inputs, (1, WORLD), graph=graph, sequence_parallel=True)
    return plan(model, inputs, "atp-ic3", mesh_shape=(1, WORLD), force=sp, graph=graph), graph


def _measured_peak(plan_json: str) -> int:
    """This rank's peak storage bytes over two AdamW steps of :func:`_wide` run by the plan, after one warm-up
    step (``memtrack.adamw_step_peak``, as the memory benchmarks measure)."""
    from meshpilot.cluster.memtrack import adamw_step_peak
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.spmd import parallelize

    model, inputs = _wide()
    plan = StagePlan.from_json(plan_json)
    return adamw_step_peak(parallelize(model, plan, graph=graph_of("wide", model, plan)), inputs)


def _lockstep(jobs: list[tuple[str, str]], wide_json: str) -> tuple[list[dict], int]:
    """On each rank: per job (model name, SP plan JSON) the model built twice, the copy parallelized by the
    plan, both trained :data:`STEPS` AdamW steps side by side (``dist_utils.lockstep_adamw``); then the peak
    of :func:`_wide` run by `wide_json` (:func:`_measured_peak`)."""
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.spmd import parallelize

    out = []
    for name, plan_json in jobs:
        plan = StagePlan.from_json(plan_json)
        ref, inputs = _build(name)
        model, _ = _build(name)
        pm = parallelize(model, plan, graph=graph_of(name, model, plan))  # one capture per model, both meshes
        res = lockstep_adamw(ref, pm, inputs, STEPS, lr=1e-3)
        planned = plan.collective_counts(backend="gloo")
        res["counts_equal"] = [c == planned for c in res.pop("counts")]
        res["reduce_scatters"] = sum(n for (kind, *_), n in planned.items() if kind == "reduce_scatter")
        out.append(res)
    return out, _measured_peak(wide_json)


def _graphs(keys: list[tuple[str, tuple[int, int]]], plans: dict, wide_plan) -> dict:
    """The captures :func:`_lockstep`'s ``graph_of`` finds, made here once for the ranks (each traced the GPT,
    the Llama and the wide Llama: ~1-3 CPU s a rank a model) by ``graph_of``'s own call on the model the rank
    builds."""
    builds = [(name, _build(name)[0], plans[(name, shape)][1]) for name, shape in keys]
    return captures(*builds, ("wide", _wide()[0], wide_plan))


@pytest.mark.dist
def test_sequence_parallel_plans_run_equal_to_one_device(plans, wide):
    """Every plan equal to one device with the plan's collectives, its backward's all-gathers counted; the wide
    Llama's predicted peak (as gloo issues its redistributions) within :data:`MEMORY_TOL` of the largest rank's."""
    from meshpilot.planner.accounting import memory_use, plan_strategies
    from meshpilot.planner.recompute import for_plan

    wide_plan, wide_graph = wide
    keys = [key for key in plans if key in RUNS]
    jobs = [(name, plans[(name, shape)][1].to_json()) for name, shape in keys]
    graphs = _graphs(keys, plans, wide_plan)
    got = run_distributed(_lockstep, WORLD, jobs, wide_plan.to_json(), timeout=1500, graphs=graphs)
    per_rank = [results for results, _ in got]
    measured = max(peak for _, peak in got)
    g = for_plan(wide_graph, wide_plan)  # the capture the plan was made on
    issued = memory_use(g, plan_strategies(wide_plan, g), wide_plan.mesh_shape, on_cpu=True).total
    assert abs(issued / measured - 1) <= MEMORY_TOL, (issued, wide_plan.memory.total, measured)
    for rank, results in enumerate(per_rank):
        for (name, shape), res in zip(keys, results):
            where = f"{name} on {shape}, rank {rank}"
            assert max(res["loss"]) < TOL, (where, res["loss"])
            assert max(res["grad"]) < TOL, (where, res["grad"])
            assert all(res["counts_equal"]), where  # the runtime issued the plan's collectives, every step
            assert res["reduce_scatters"] > 0, where


def test_sequence_parallel_layout_skips_what_tp_does_not_divide():
    """A sequence the TP degree does not divide keeps plain TP's residual adds (no pin), and a 2-D residual
    stream is sharded on its token rows."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.forced import _TPPins

    model, inputs = _build("gpt")
    pins = _TPPins(capture(model, inputs), {}, (2, 4), 1, [0])
    assert pins.sequence_layout((8, 6, 32)) is None  # 6 tokens over 4
    assert pins.sequence_layout((8, 8, 32)) == "S(0)S(1)"
    assert pins.sequence_layout((64, 32)) == "S(0)S(0)"
    assert pins.sequence_layout((4, 32)) is None  # 4 rows over 2 · 4
