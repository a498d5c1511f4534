"""Issue 32's frontier rows on a reduced case: the presets, a published configuration read and refused, its plan's
ranks and chunks, Megatron's pairs found in a Hugging Face Llama, and ``bench_frontier.run_row`` end to end on a
tiny Llama on 8 GPUs (the same code path as the 16,384-GPU rows; no spawn)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_frontier as bf  # noqa: E402

from meshpilot.cluster import load_cluster  # noqa: E402
from meshpilot.errors import UserError  # noqa: E402
from meshpilot.models.sources import build_hf  # noqa: E402
from meshpilot.planner.config_plan import (  # noqa: E402
    Split,
    boundary_pins,
    parse_config,
    send_shares,
    stage_bounds,
    stage_ranks,
)
from meshpilot.planner.forced import megatron_groups  # noqa: E402
from meshpilot.planner.schedule import PipelineKind  # noqa: E402
from meshpilot.planner.stack import capture_stack  # noqa: E402

TINY = dict(
    num_hidden_layers=6, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=512, tie_word_embeddings=False, use_cache=False, max_position_embeddings=256,
)  # fmt: skip
"""A Llama with Llama 3's structure (grouped-query attention, rotary embeddings, a gated MLP) at toy size."""


def _eq2_without_syncs(plan) -> float:
    """Eq. 2 (``Plan.step_s``) with each stage's gradient sync taken out of its t: the step below which a plan whose
    syncs overlap (``Plan.sync_overlap``) cannot simulate (less the sends' share)."""
    B = plan.microbatches
    stages = tuple(dataclasses.replace(st, t_s=st.t_s - st.cost.sync_s / B) for st in plan.stages)
    return dataclasses.replace(plan, stages=stages).step_s


def test_llama3_cluster_is_pods_of_3072_at_one_seventh_between():
    from meshpilot.cluster.presets import NCCL_NVLINK_BUSBW_GBPS

    cl = load_cluster("llama3-h100")
    assert cl.num_devices == 24_576 and [x.name for x in cl.layers] == ["pod", "node", "gpu"]
    pod, node, gpu = cl.layers
    assert (pod.ranks, node.ranks, gpu.ranks) == (8, 384, 8)
    assert pod.group_bw[0] == pytest.approx(3072 * 50e9 / 7)  # 1:7 oversubscribed aggregation
    assert node.group_bw[0] == pytest.approx(400e9) and gpu.group_bw[0] == pytest.approx(NCCL_NVLINK_BUSBW_GBPS * 1e9)
    assert cl.device.flops_for("bfloat16") * cl.device.compute_efficiency == pytest.approx(756.7e12, rel=1e-3)
    assert load_cluster("llama3-h100:2").num_devices == 6144
    tt = load_cluster("torchtitan-h100:64")
    assert tt.num_devices == 512 and tt.device.memory_bytes == 96 * 2**30


def test_config_is_read_and_what_cannot_be_planned_is_one_line():
    cfg = parse_config("tp=8,pp=16,dp=64,schedule=interleaved-1f1b,virtual=8,microbatches=32,split=ends")
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.virtual, cfg.microbatches) == (8, 16, 64, 8, 32)
    assert cfg.schedule == PipelineKind.INTERLEAVED_1F1B and cfg.split == Split.ENDS
    assert cfg.devices == 8192 and cfg.global_batch == 64 * 32 and cfg.graph_batch == 64
    for text, needle in [
        ("tp=8,cp=16,micro_batch=2", "micro_batch=1"),
        ("tp=8,cp=0", "give at least 1"),
        ("tp=8,zero=1", "no ranks to shard"),
        ("tp=8,dp=2,zero=2", "give zero=1 or zero=0"),
        ("pp=4,schedule=interleaved-1f1b", "virtual"),
        ("pp=4,virtual=2,schedule=interleaved-1f1b,microbatches=6", "multiple of pp=4"),
        ("tp=eight", "whole number"),
        ("tensor=8", "known key"),
        ("schedule=pipedream", "choose one of"),
        ("tp=2,tp=4", "twice"),
        ("tp=8,sp=2", "give sp=1 or sp=0"),
    ]:
        with pytest.raises(UserError, match=needle) as e:
            parse_config(text)
        assert "\n" not in str(e.value)


def test_ranks_follow_llama3_order_and_chunks_balance_the_ends():
    cfg = parse_config("tp=2,pp=2,dp=2")
    # [TP, CP, PP, DP], TP fastest: group p's (DP, TP) mesh holds t + 2 (p + 2 d)
    assert stage_ranks(cfg) == [(0, 1, 4, 5), (2, 3, 6, 7)]
    # 126 blocks, 16 groups of 8 chunks: the embeddings alone first, the head alone last, one block a chunk
    ends = stage_bounds(2, 126, 2, 128, Split.ENDS)
    assert ends[0] == (0, 2) and ends[-1] == (128, 130) and all(b - a == 1 for a, b in ends[1:-1])
    assert stage_bounds(2, 8, 2, 4, Split.EVEN) == [(0, 4), (4, 6), (6, 8), (8, 12)]
    with pytest.raises(UserError, match="do not split evenly"):
        stage_bounds(2, 126, 2, 16, Split.EVEN)


# default tier: bf16-mixed (autocast's casts between the pairs' products, besides rotary and GQA); full only: bf16
# (the same pairs with no casts to see through). CPU s 15 + 17 before (the last full run, load ~20), 6 after
# (load ~7; the file: 406 before, 108 after, 25 passed, 1 full only: nearly all of the drop is the load)
@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=pytest.mark.full), "bf16-mixed"])
def test_megatron_pairs_of_a_hugging_face_llama(precision):
    """Rotary embeddings, grouped-query attention's repeated kv heads and autocast's casts do not hide the pairs."""
    built = build_hf("llama", TINY, batch=2, seq=32)
    stack = capture_stack(built.model, built.inputs, precision=precision)
    got = {g.names() for g in megatron_groups(stack.graph) if "layers.1." in g.columns[0].weight}
    pre = "model.model.layers.1."
    attn = tuple(f"{pre}self_attn.{x}_proj.weight" for x in "qkv"), (f"{pre}self_attn.o_proj.weight",)
    mlp = (f"{pre}mlp.gate_proj.weight", f"{pre}mlp.up_proj.weight"), (f"{pre}mlp.down_proj.weight",)
    assert got == {attn, mlp}


def _row(config: str) -> bf.Row:
    return bf.Row("tiny", "test", "TFLOP/s/GPU", 1.0, TINY, 64, "dgx-h100:1", config)


def test_reduced_row_plans_simulates_and_splits_its_step():
    res = bf.run_row(_row("tp=2,pp=2,dp=2,schedule=interleaved-1f1b,virtual=2,microbatches=4,split=ends"))
    assert not res.refused and res.simulated > 0 and res.step_s > 0
    t = res.terms
    parts = [t.compute_s, t.tp_s, t.dp_s, t.optimizer_s]
    assert all(x >= 0 for x in parts) and t.tp_s > 0 and t.dp_s > 0
    # the pipeline term is what the simulated step adds to the busiest group's work: bubble and sends
    assert t.pipeline_s == pytest.approx(res.step_s - sum(parts)) and t.pipeline_s > 0
    # the simulated step holds Eq. 2's (which leaves the sends out and every sync exposed) within the sends' share
    # and the syncs hidden
    assert res.step_s >= (res.eq2_step_s - t.dp_hidden_s) * 0.99
    row = res.to_json()
    assert {"name", "unit", "published", "simulated_as_published", "planned", "planning_s"} <= set(row)
    assert row["simulated_as_published"] == res.simulated and row["planned"] is None
    # the same step with attention counted causally: fewer model FLOPs, by exactly 6 · L · h · s a token
    gap = (res.simulated - row["simulated_causal_count"]) * 1e12 * res.step_s * 8 / (8 * 64)  # 8 GPUs, 8 x 64 tokens
    assert gap == pytest.approx(6 * TINY["num_hidden_layers"] * TINY["hidden_size"] * 64)


def test_chunk_syncs_are_the_once_a_step_costs_and_the_plan_overlaps_them():
    """A configuration's plan overlaps each chunk's gradient sync with the group's later backwards
    (``Plan.sync_overlap``; ``config_plan``, *The gradients' synchronisation, overlapped*). Each chunk's
    ``sync_s`` is what its cost does not repeat per microbatch (costed at 2B, its communication grows by B
    microbatches' worth and nothing else), and the breakdown's exposed and hidden sync add up to the busiest
    group's syncs (a little more: they share the server's link with the sends); interleaved, some of it hides."""
    from meshpilot.planner.config_plan import breakdown, plan_config, simulate_config
    from meshpilot.planner.stage import StagePlanner

    cfg = parse_config("tp=2,pp=2,dp=2,schedule=interleaved-1f1b,virtual=2,microbatches=4,split=ends,zero=1")
    built = build_hf("llama", TINY, batch=cfg.graph_batch, seq=64)
    stack = capture_stack(built.model, built.inputs, precision=cfg.precision)
    sp = StagePlanner(stack.graph, "dgx-h100:1")
    cp = plan_config(built.model, built.inputs, stack, sp.cluster, cfg, planner=sp)
    twice_cfg = dataclasses.replace(cfg, microbatches=8)
    twice = plan_config(built.model, built.inputs, stack, sp.cluster, twice_cfg, planner=sp)
    assert cp.plan.sync_overlap

    def comm(c):
        return c.time.communication_s + c.time.resharding_s

    for one, two in zip(cp.costs, twice.costs):
        assert one.sync_s > 0 and one.sync_s == pytest.approx(2 * comm(one) - comm(two), rel=1e-9)
    sim = simulate_config(cp)
    t = breakdown(cp, sim)
    busiest = max(range(2), key=lambda g: sum(c.time.total_s for c in cp.costs[g::2]))
    syncs = sum(c.sync_s for c in cp.costs[busiest::2])
    assert 0 < t.dp_s < syncs and t.dp_hidden_s > 0
    assert syncs <= t.dp_s + t.dp_hidden_s <= 1.05 * syncs
    assert t.pipeline_s == pytest.approx(sim.step_s - t.compute_s - t.tp_s - t.dp_s - t.optimizer_s)


def test_without_tp_the_tp_term_all_but_vanishes_and_sends_are_a_replicas_share():
    # pure DP stages: what is left per microbatch is the loss' reduction, a few latencies
    no_tp = bf.run_row(_row("pp=2,dp=4,microbatches=4")).terms
    tp = bf.run_row(_row("tp=2,pp=2,dp=2,microbatches=4")).terms
    assert no_tp.tp_s < 0.05 * tp.tp_s and no_tp.dp_s > 0
    from meshpilot.planner.config_plan import plan_config
    from meshpilot.planner.stage import StagePlanner

    cfg = parse_config("pp=2,dp=4,microbatches=4")
    built = build_hf("llama", TINY, batch=cfg.graph_batch, seq=64)
    stack = capture_stack(built.model, built.inputs, precision=cfg.precision)
    sp = StagePlanner(stack.graph, "dgx-h100:1")
    cp = plan_config(built.model, built.inputs, stack, sp.cluster, cfg, planner=sp)
    shares = send_shares(cp)
    assert shares and all(shares[(x.src, x.dst)] == x.nbytes / 4 for x in cp.plan.transfers)
    # every piece's boundary rows arrive batch-sharded over DP (one replica's rows a rank), the hidden state among them
    pins = boundary_pins(sp, stack, cfg)
    assert pins and set(pins.values()) == {"S(0)R"}
    assert len(pins) >= 2  # the block's hidden-state input in the forward and its gradient in the backward


def test_tp_plans_run_sequence_parallel_unless_told_not_to():
    """``sp`` is on by default where TP > 1 (Llama 3, Megatron): the residual adds and the hidden state between
    stages are sequence-sharded over TP and each TP rank sends its share; ``sp=0`` plans plain TP."""
    from meshpilot.planner.config_plan import plan_config, residual_shapes, stage_setup
    from meshpilot.planner.forced import megatron_tp
    from meshpilot.planner.recompute import REGATHERED
    from meshpilot.planner.stage import StagePlanner
    from meshpilot.planner.zero import ZeroMode

    text = "tp=2,pp=2,dp=2,microbatches=4"
    on, off = parse_config(text), parse_config(text + ",sp=0")
    assert on.sequence_parallel and not off.sequence_parallel and not parse_config("pp=2,dp=4").sequence_parallel
    assert "SP" in on.short() and "SP" not in off.short()
    built = build_hf("llama", TINY, batch=on.graph_batch, seq=64)
    stack = capture_stack(built.model, built.inputs, precision=on.precision)
    sp = StagePlanner(stack.graph, "dgx-h100:1")
    force = megatron_tp(built.model, built.inputs, (2, 2), graph=stack.graph, sequence_parallel=True)
    adds = {k: v for k, v in force.items() if stack.graph.by_name.get(k) is not None and v.endswith("S(1)")}
    assert len([k for k in adds if stack.graph[k].target == "aten.add.Tensor"]) == 2 * stack.kept
    assert residual_shapes(stack.graph, force) == {(2, 64, 256)}
    pins = boundary_pins(sp, stack, on, force)
    assert "S(0)S(1)" in pins.values() and set(pins.values()) <= {"S(0)S(1)", "S(0)R"}
    assert set(boundary_pins(sp, stack, off, force).values()) == {"S(0)R"}
    plans = {c.sp: plan_config(built.model, built.inputs, stack, sp.cluster, c, planner=sp) for c in (on, off)}
    assert plans[1].plan.send_split == 4 and plans[0].plan.send_split == 2
    # as Megatron's SP, each norm output is gathered again in the backward: the SP stack holds the copies, and
    # its block saves less than the same pins with the gathered copies kept; sp=0 plans the captured graph
    mesh, ranks = (2, 2), (0, 1, 2, 3)
    again, again_sp, pins = stage_setup(built.model, built.inputs, stack, sp.cluster, on, sp, mesh)
    assert stage_setup(built.model, built.inputs, stack, sp.cluster, off, sp, mesh)[0] is stack
    assert again is not stack and again.blocks == stack.blocks
    assert {n.name for n in again.graph.nodes if n.name.endswith(REGATHERED)}
    kw = dict(microbatches=1, zero=ZeroMode.OFF, force=pins)
    _, kept = sp.plan_with_memory(stack.middle, stack.middle + 1, ranks, mesh, **kw)
    _, regathered = again_sp.plan_with_memory(again.middle, again.middle + 1, ranks, mesh, **kw)
    assert regathered.saved < kept.saved


def test_selective_recomputation_keeps_less_than_none_and_runs_less_than_full():
    """``recompute=selective`` (Megatron's selective recompute, as torchtitan's op policy draws it): every block
    keeps its matrix products' and attention's outputs and runs the rest again, so the row's plan holds less
    than without recomputation and recomputes far less than whole blocks."""
    base = "tp=2,pp=2,dp=2,microbatches=4,split=even"  # blocks in every stage: the peak is a stage of blocks
    rcs = ("none", "selective", "full")
    row = dataclasses.replace(_row(base), seq=256)  # activations over the optimizer's update peak
    res = {rc: bf.run_row(dataclasses.replace(row, config=f"{base},recompute={rc}"), terms=False) for rc in rcs}
    assert all(not r.refused for r in res.values())
    none, sel, full = res["none"], res["selective"], res["full"]
    assert full.peak_gib < sel.peak_gib < none.peak_gib
    assert none.step_s <= sel.step_s < full.step_s
    assert sel.step_s - none.step_s < 0.25 * (full.step_s - none.step_s)


def test_group_bound_counts_chunk_microbatches_in_flight_at_once():
    """Llama 3's 8,192-GPU schedule (16 groups of 8 chunks, 32 microbatches): each chunk's own maximum summed
    is 192 chunk-microbatches, the most group 0 holds at once 143; at 16 microbatches both are 128."""
    from meshpilot.planner.config_plan import group_bound, in_flight_peaks

    ones = (1.0,) * 128
    assert in_flight_peaks(PipelineKind.INTERLEAVED_1F1B, 16, 8, 32, ones)[0] == 143
    assert max(in_flight_peaks(PipelineKind.INTERLEAVED_1F1B, 16, 8, 16, ones)) == 128
    # 1F1B: one chunk a group, its own min(B, p - j)
    assert in_flight_peaks(PipelineKind.ONE_F_ONE_B, 4, 1, 8, (1.0,) * 4) == [4, 3, 2, 1]
    # the bound: the chunks' statics and transients once, the activations in flight at once
    fb, upd, act = [10.0] * 128, [12.0] * 128, [2.0] * 128
    assert group_bound(PipelineKind.INTERLEAVED_1F1B, 16, 8, 32, fb, upd, act) == 8 * (10 - 2) + 143 * 2
    # with what each chunk holds while another computes (weights, states, gradients: 5), the working sets
    # beyond it count once: 8 · 5 + (10 − 5) + 143 · 2, not 8 · (10 − 2) + 143 · 2
    res = [5.0] * 128
    assert group_bound(PipelineKind.INTERLEAVED_1F1B, 16, 8, 32, fb, upd, act, res) == 8 * 5 + 5 + 143 * 2
    # one chunk a group: every chunk at its own peak is the smaller bound, as before
    one = dict(fb=[10.0] * 4, upd=[12.0] * 4, act=[2.0] * 4)
    plain = group_bound(PipelineKind.ONE_F_ONE_B, 4, 1, 8, one["fb"], one["upd"], one["act"])
    assert group_bound(PipelineKind.ONE_F_ONE_B, 4, 1, 8, *one.values(), [5.0] * 4) == plain == 10 - 2 + 4 * 2
    # a plan saved before the resident bytes were recorded: unknown, the old bound
    assert group_bound(PipelineKind.INTERLEAVED_1F1B, 16, 8, 32, fb, upd, act, [None] * 128) == 8 * 8 + 143 * 2


def test_one_chunk_counts_come_off_one_schedule_as_each_stage_counted_them():
    """``held_one_chunk`` reads every stage's in-flight count off one p-stage schedule (one schedule per stage
    took 17 s at p = 256 in the search's ranking): the counts each schedule gives its stages — GPipe all B,
    1F1B min(B, p - j), ZB-H1 min(B, p) at every stage — and what ``stage_in_flight`` answers per stage."""
    from meshpilot.planner.pipeline import held_one_chunk, stage_in_flight

    for p, B in ((1, 3), (4, 2), (8, 3), (16, 32)):
        want = {
            PipelineKind.GPIPE: [B] * p,
            PipelineKind.ONE_F_ONE_B: [min(B, p - j) for j in range(p)],
            PipelineKind.ZERO_BUBBLE: [min(B, p)] * p,
        }
        for kind, counts in want.items():
            assert list(held_one_chunk(kind, p, B)) == counts, (kind, p, B)
            assert [stage_in_flight(kind, p - j, B, p) for j in range(p)] == counts, (kind, p, B)
    assert held_one_chunk(PipelineKind.ONE_F_ONE_B, 4, 8) == (4, 3, 2, 1)
    assert set(held_one_chunk(PipelineKind.ZERO_BUBBLE, 4, 8)) == {4}  # ZB-H1: min(B, p), every stage


def test_context_parallel_config_plans_the_sequence_on_an_axis_of_its_own():
    """``cp=2`` (the 131,072-token row's CP16, reduced): each pipeline group a ``(DP, CP, TP)`` mesh in Llama 3's
    rank order; the token ids, the residual stream and the stage boundaries sharded on the sequence over CP
    (``S(1)``, with SP over TP as well: ``S(0)S(1)S(1)``), the weights whole over it; attention sequence-parallel on
    the CP axis by the ring (its key/value blocks sent round the axis, ``is_causal`` with no mask tensor), the
    gradients reduced over DP and CP. The plan validates, simulates, and each rank sends its own share; a
    sequence that cp · tp does not divide is refused in one line."""
    from meshpilot.models.sources import unpacked_sequences
    from meshpilot.planner.config_plan import context_views, plan_config, simulate_config, stage_mesh, stage_setup
    from meshpilot.planner.stage import StagePlanner
    from meshpilot.planner.validate import validate
    from meshpilot.planner.zero import ZeroMode
    from meshpilot.sharding.reshard import CollectiveKind

    cfg = parse_config("tp=2,cp=2,pp=2,dp=2,microbatches=4")
    assert stage_mesh(cfg) == (2, 2, 2) and cfg.devices == 16
    # [TP, CP, PP, DP], TP fastest: group p's (DP, CP, TP) mesh holds t + 2 (c + 2 (p + 2 d))
    assert stage_ranks(cfg)[0] == (0, 1, 2, 3, 8, 9, 10, 11)
    built = build_hf("llama", TINY, batch=cfg.graph_batch, seq=64)
    with unpacked_sequences():
        stack = capture_stack(built.model, built.inputs, precision=cfg.precision)
    calls = [n for n in stack.graph.nodes if n.target == "meshpilot.sdpa.default"]
    assert calls and all(len(n.inputs) == 3 for n in calls)  # q, k, v: is_causal, no [b, 1, t, t] mask
    sp = StagePlanner(stack.graph, "dgx-h100:2")
    mesh = stage_mesh(cfg)
    st, planner, force = stage_setup(built.model, built.inputs, stack, sp.cluster, cfg, sp, mesh)
    assert force["input:0"] == force["input:1"] == "S(0)S(1)R"
    assert force["model.model.layers.1.self_attn.q_proj.weight"] == "RRS(0)"  # whole over DP and CP
    adds = {v for k, v in force.items() if k in stack.graph.by_name and stack.graph[k].target == "aten.add.Tensor"}
    assert adds == {"S(0)S(1)S(1)"}  # the residual stream: the sequence over CP, then over TP
    assert "S(0)S(1)S(1)" in {v for k, v in force.items() if k.startswith("boundary")}
    with context_views(cfg):
        planner.plan(
            st.middle, st.middle + 1, stage_ranks(cfg)[0], mesh, microbatches=1, zero=ZeroMode.OFF, force=force
        )
    on_cp = [c for c in planner.last_collectives() if c.axis == 1]
    sends = [c for c in on_cp if c.kind == CollectiveKind.SEND]
    assert sends and all(c.nbytes > 0 for c in sends)  # the ring passes key/value blocks on the CP axis
    assert {c.phase for c in sends} == {"fwd", "bwd"}
    # the weights' gradients are reduced over DP and CP (each CP rank's share of the sequence's sum)
    grads = {c.dst for c in on_cp if c.kind == "all_reduce" and c.dst.startswith("grad:")}
    assert any(g.endswith("q_proj.weight") for g in grads)

    cp = plan_config(built.model, built.inputs, stack, sp.cluster, cfg, planner=sp)
    assert all(s.mesh_shape == (2, 2, 2) for s in cp.plan.stages)
    validate(cp.plan, world_size=16)
    assert cp.plan.send_split == 2 * 2 * 2  # each (DP, CP, TP) rank sends its own share of the boundary
    # Eq. 2 prices each chunk's sync exposed (amortised in its t); the simulation hides all but the last's
    assert _eq2_without_syncs(cp.plan) * 0.99 <= simulate_config(cp).step_s <= cp.plan.step_s * 1.01
    with pytest.raises(UserError, match="does not split") as e:
        plan_config(built.model, built.inputs, stack, sp.cluster, parse_config("tp=2,cp=3,pp=2,dp=2"), planner=sp)
    assert "\n" not in str(e.value)


def test_refused_rows_say_why_and_simulate_nothing():
    """A row marked refused, or whose configuration does not parse, is printed with its reason in one line and
    simulated as nothing (every published row plans now: torchtitan's Float8 rows since ``float8=linears``)."""
    assert not [r.name for r in bf.ROWS if r.refused]
    for row in (dataclasses.replace(_row("tp=2"), refused="not planned"), _row("tp=2,float8=linear")):
        res = bf.run_row(row)
        assert res.simulated is None and res.refused and "\n" not in res.refused
        assert res.to_json()["simulated_as_published"] is None


def test_cli_plans_a_config_saves_it_and_simulate_prices_the_same_step(tmp_path, capsys):
    from meshpilot.cli.main import main
    from meshpilot.planner.plan import Plan

    hf = [f"{k}={v}" for k, v in TINY.items()]
    out = tmp_path / "cfg.json"
    cfg = "tp=2,pp=2,dp=2,schedule=interleaved-1f1b,virtual=2,microbatches=4,split=ends"
    argv = ["plan", "--model", "hf:llama", "--hf-config", *hf, "--seq", "64", "--cluster", "dgx-h100:1"]
    assert main([*argv, "--config", cfg, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.load(out)
    # send_split DP · TP: sequence parallelism, each rank sends its share
    assert plan.send_split == 4 and len(plan.stages) == 4 and plan.schedule == PipelineKind.INTERLEAVED_1F1B
    step = plan.simulate().step_s
    assert f"simulated step {bf_fmt(step)}" in printed
    assert main(["simulate", str(out)]) == 0
    assert bf_fmt(step) in capsys.readouterr().out
    for extra, needle in [
        (["--mesh", "2x4"], "--mesh"),
        (["--batch", "3"], "--batch 3"),
        (["--precision", "fp32"], "give it once"),
    ]:
        assert main([*argv, "--config", cfg, *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1


def bf_fmt(seconds: float) -> str:
    from meshpilot.cli.plan import fmt_s

    return fmt_s(seconds)


def test_config_search_beats_the_stated_config_within_its_memory_and_every_candidate_fits():
    """The same path as the frontier rows' own plans (``config_search.search_configs``) on 8 GPUs: within the
    memory the stated configuration's plan takes, the search's plan simulates no slower than it, every candidate
    it reports is within its Eq. 5 bound, and the plan kept is ``plan_config``'s for the chosen configuration."""
    from meshpilot.planner.config_search import config_string, search_configs

    stated = bf.run_row(
        _row("tp=2,pp=2,dp=2,schedule=interleaved-1f1b,virtual=2,microbatches=4,split=ends"), terms=False
    )
    cap = stated.peak_gib * 2**30

    def build(rows):
        b = build_hf("llama", TINY, batch=rows, seq=64)
        return b.model, b.inputs

    res = search_configs(build, "dgx-h100:1", 8, 8, precision="bf16-mixed", capacity=cap, top=2, shown=6)
    assert res.best_step_s <= stated.step_s
    assert all(c.config.tp == 1 or c.config.sequence_parallel for c in res.leading)  # SP wherever there is TP
    assert res.leading and all(c.memory_bytes <= cap for c in res.leading)
    assert [c.config for c in res.planned] == [c.config for c in res.leading if c.simulated_s is not None]
    assert all(c.plan_memory_bytes is not None and c.fits == (c.plan_memory_bytes <= cap) for c in res.planned)
    kept = next(c for c in res.planned if c.config == res.best.config)
    assert kept.fits and kept.simulated_s == res.best_step_s == min(c.simulated_s for c in res.planned if c.fits)
    # the chosen configuration reads back as --config, and plans to the same step
    again = bf.run_row(_row(config_string(res.best.config)), terms=False)
    assert again.step_s == pytest.approx(res.best_step_s, rel=1e-9)
    # estimates are ordered, and each is the pieces' price of its configuration
    ests = [c.estimate_s for c in res.leading]
    assert ests == sorted(ests) and res.enumerated >= len(res.leading)


def test_context_parallel_config_takes_llama3s_balanced_layout_where_the_step_allows():
    """With its labels pre-shifted (Megatron's loader; ``pre_shifted_labels``) the reduced CP row's step takes the
    zig-zag order on the CP axis (``Plan.sequence_order``: 2 · CP chunks, the ids, labels and shifted labels and
    the position ``arange`` permuted), its attention calls marked balanced and priced so (each rank's causal work
    the average: less than the contiguous split's slowest rank), and the order round-trips through a plan file.
    Captured with transformers' own labels shift (a pad along the sequence) the order is refused: the contiguous
    layout stays, priced at its slowest rank, and the plan says why in one line."""
    from meshpilot.models.sources import pre_shifted_labels, unpacked_sequences
    from meshpilot.planner.config_plan import plan_config
    from meshpilot.planner.plan import Plan
    from meshpilot.planner.stage import StagePlanner

    cfg = parse_config("tp=2,cp=2,pp=2,dp=2,microbatches=4")
    built = build_hf("llama", TINY, batch=cfg.graph_batch, seq=128)  # head dim 64: a sequence of another length
    plans = {}
    for shifted in (False, True):
        model, inputs = built.model, tuple(built.inputs)
        if shifted:
            model, inputs = pre_shifted_labels(model, inputs)
        with unpacked_sequences():
            stack = capture_stack(model, inputs, precision=cfg.precision)
        sp = StagePlanner(stack.graph, "llama3-h100:2")  # measured attention rates, causal-aware
        plans[shifted] = plan_config(model, inputs, stack, sp.cluster, cfg, planner=sp)
    contiguous, balanced = plans[False], plans[True]
    assert contiguous.plan.sequence_order is None and "labels shift" in contiguous.contiguous_why
    assert "\n" not in contiguous.contiguous_why
    order = balanced.plan.sequence_order
    assert balanced.contiguous_why is None and (order.axis, order.peers, order.length) == (1, 2, 128)
    assert order.inputs == ((0, 1), (1, 1), (2, 1)) and order.factories == (("arange", 0),)
    assert "zigzag over axis cp: 128 tokens in chunks of 32" in str(balanced.plan)
    assert Plan.from_json(balanced.plan.to_json()).sequence_order == order
    assert "sequence_order" not in contiguous.plan.to_dict()
    compute = {k: sum(c.time.compute_s for c in p.costs) for k, p in plans.items()}
    assert compute[True] < compute[False]  # every rank at the average causal work, not the slowest's
    # the order is taken before the ILP: its block's attention must be one the order serves, on the CP axis
    # (the ring or the all-gather method by query rows, not Ulysses' all-to-alls)
    from meshpilot.planner.config_plan import context_views, stage_mesh, stage_setup
    from meshpilot.planner.zero import ZeroMode

    mesh = stage_mesh(cfg)
    st, planner, force = stage_setup(model, inputs, stack, sp.cluster, cfg, sp, mesh)
    assert any(n.zigzag for n in st.graph.nodes)
    with context_views(cfg):
        planner.plan(
            st.middle, st.middle + 1, stage_ranks(cfg)[0], mesh, microbatches=1, zero=ZeroMode.OFF, force=force
        )
    on_cp = {str(c.kind) for c in planner.last_collectives() if c.axis == 1 and not c.dst.startswith("grad:")}
    assert on_cp and not any("all_to_all" in k for k in on_cp), on_cp


def test_balanced_cp_prices_every_rank_at_the_average_causal_work():
    """``CostModel.attention`` balanced (zig-zag, each rank two of 2n chunks): ``(2n − 1)/(4n)`` of a rank's share at
    the non-causal rate and ``1/(2n)`` at the causal one; by the row-key pairs it counts (the rectangle's whole,
    the squares' causal halves) every rank does ``1/n`` of the causal triangle; one rank (n = 1) is the causal
    kernel either way."""
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.cluster.presets import H100_ATTENTION_TFLOPS

    cm = CostModel(LogicalMesh(load_cluster("llama3-h100:1"), (1, 1), [[0]]))
    rf, _, cf, _ = (t * 1e12 for t in H100_ATTENTION_TFLOPS)
    f = 1e12
    for n in (2, 4, 16):
        got = cm.attention(f, 0, True, n, False, balanced=True)
        assert got == pytest.approx((2 * n - 1) / (4 * n) * f / rf + f / (2 * n) / cf)
        assert got < cm.attention(f, 0, True, n, False)
        m = 1.0 / (2 * n)  # a chunk of the unit sequence: a rank's rectangle whole, its two squares' halves
        assert (2 * n - 1) * m * m + 2 * (m * m / 2) == pytest.approx(1 / 2 / n)  # the triangle's share
    assert cm.attention(f, 0, True, 1, False, balanced=True) == pytest.approx(f / cf)


def test_config_search_offers_context_parallelism_for_long_sequences_only():
    """From 32,768 tokens the search offers TP of a whole server with CP 1, 2, 4, …, each CP rank keeping at least
    8,192 tokens (Llama 3's CP16 at 131,072), one sequence a replica's microbatch; below, every TP and CP 1 (the 8K
    rows' searches as they were)."""
    from meshpilot.planner.config_search import config_string, enumerate_configs, tp_cp

    cl = load_cluster("llama3-h100")
    assert tp_cp(cl, 16384, 8192) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    assert tp_cp(cl, 16384, 131072) == [(8, 1), (8, 2), (8, 4), (8, 8), (8, 16)]
    built = build_hf("llama", TINY, batch=1, seq=64)
    stack = capture_stack(built.model, built.inputs, precision="bf16")
    small = load_cluster("dgx-h100:2")
    import meshpilot.planner.config_search as cs

    old = cs.CONTEXT_FROM, cs.CONTEXT_SHARD
    try:
        cs.CONTEXT_FROM, cs.CONTEXT_SHARD = 64, 16
        got = enumerate_configs(stack, small, 16, 8, "bf16", seq=64)
    finally:
        cs.CONTEXT_FROM, cs.CONTEXT_SHARD = old
    with_cp = [c for c in got if c.cp > 1]
    assert {c.cp for c in with_cp} == {2} and all(c.tp == 8 and c.micro_batch == 1 for c in with_cp)
    assert all(c.devices == 16 and c.global_batch == 8 and c.tp == 8 for c in got)
    assert parse_config(config_string(with_cp[0])) == with_cp[0]


def test_context_parallel_pieces_plan_on_cp_tp_as_on_one_cp_tp():
    """The search's CP pieces are planned on ``(CP, TP)``, the pins of ``(1, CP, TP)`` without their axis of one
    device: the block's plan costs what it costs on ``(1, CP, TP)`` (its CP gradient reduction taken out, once a
    step), and holds the same memory."""
    from meshpilot.models.sources import unpacked_sequences
    from meshpilot.planner.config_plan import ParallelConfig, context_views, stage_setup
    from meshpilot.planner.config_search import plan_pieces
    from meshpilot.planner.stage import StagePlanner
    from meshpilot.planner.zero import ZeroMode

    built = build_hf("llama", TINY, batch=1, seq=64)
    with unpacked_sequences():
        stack = capture_stack(built.model, built.inputs, precision="bf16")
    sp = StagePlanner(stack.graph, "dgx-h100:1")
    pieces = plan_pieces(built.model, built.inputs, stack, sp, 2, 2)
    cfg = ParallelConfig(tp=2, cp=2)
    st, planner, force = stage_setup(built.model, built.inputs, stack, sp.cluster, cfg, sp, (1, 2, 2))
    with context_views(cfg):
        kw = dict(microbatches=1, zero=ZeroMode.OFF, force=force)
        cost, mem = planner.plan_with_memory(st.middle, st.middle + 1, (0, 1, 2, 3), (1, 2, 2), **kw)
    once = sum(x.seconds for x in planner.last_collectives() if x.axis == 1 and x.dst.startswith("grad:"))
    t = cost.time
    assert once > 0
    assert pieces.block.per_mb_s == pytest.approx(t.compute_s + t.communication_s + t.resharding_s - once, rel=1e-6)
    assert pieces.block.memory == mem


def test_config_auto_needs_the_batch_and_help_names_it(capsys):
    from meshpilot.cli.main import main

    hf = [f"{k}={v}" for k, v in TINY.items()]
    argv = ["plan", "--model", "hf:llama", "--hf-config", *hf, "--seq", "64", "--cluster", "dgx-h100:1"]
    assert main([*argv, "--config", "auto"]) == 2
    err = capsys.readouterr().err
    assert "--batch" in err and err.count("\n") == 1
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--config auto" in " ".join(capsys.readouterr().out.split())


def test_float8_linears_price_each_block_product_at_the_table_rate_and_nothing_else():
    """``float8=linears`` (torchtitan's Float8 rows): every block linear's three products — forward, input
    gradient, weight gradient — and nothing else are marked (the head stays bf16, every other field as captured);
    a marked product costs its Float8 rate from the preset's measured table plus its operands' casts, so
    at Llama 3's q projection the product itself takes the bf16 / Float8 rate ratio of the two tables; a block's
    plan changes by exactly those products' difference in compute, and not in communication or memory."""
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.devices import FLOAT8
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.cluster.presets import FLOAT8_CAST_BYTES, LLAMA3_405B_TP8_FP8_GEMMS, LLAMA3_405B_TP8_GEMMS
    from meshpilot.graph.gemms import node_gemm
    from meshpilot.planner.config_plan import float8_stack, plan_config
    from meshpilot.planner.stage import StagePlanner
    from meshpilot.planner.zero import ZeroMode

    cl = load_cluster("torchtitan-h100:1")
    dev = cl.device
    assert dev.has_float8 and dev.float8_cast_bytes == FLOAT8_CAST_BYTES
    cm = CostModel(LogicalMesh(cl, (1, 1), [[0]]))
    q = (8192, 2048, 16384)
    flops = 2 * 8192 * 2048 * 16384
    bf16, fp8 = LLAMA3_405B_TP8_GEMMS[0][3], LLAMA3_405B_TP8_FP8_GEMMS[0][3]
    assert LLAMA3_405B_TP8_GEMMS[0][:3] == LLAMA3_405B_TP8_FP8_GEMMS[0][:3] == q
    cast = FLOAT8_CAST_BYTES * (8192 * 16384 + 16384 * 2048) / (dev.memory_bandwidth * dev.memory_efficiency)
    product = cm.float8_gemm(flops, 0, q) - cast
    assert product == pytest.approx(flops / (fp8 * 1e12), rel=1e-12)
    assert cm.compute(flops, 0, "bfloat16", q) / product == pytest.approx(fp8 / bf16, rel=1e-12)

    built = build_hf("llama", TINY, batch=1, seq=64)
    stack = capture_stack(built.model, built.inputs, precision="bf16")
    f8 = float8_stack(stack)
    marked = [n for n in f8.graph.nodes if n.float8]
    per_block = 7 * 3  # q, k, v, o, gate, up, down: forward, input gradient, weight gradient
    assert len(marked) == per_block * stack.kept
    assert all(n.module.startswith(stack.container + ".") and n.target == "aten.mm.default" for n in marked)
    assert not any(n.float8 for n in f8.graph.nodes if n.module == "model.lm_head")
    assert [dataclasses.replace(n, float8=False) for n in f8.graph.nodes] == list(stack.graph.nodes)

    mesh, ranks, kw = (1, 1), (0,), dict(microbatches=1, zero=ZeroMode.OFF)
    got, block = {}, set()
    for name, st in (("bf16", stack), ("fp8", f8)):
        sp = StagePlanner(st.graph, cl)
        got[name] = sp.plan_with_memory(st.middle, st.middle + 1, ranks, mesh, **kw)
        block = set(sp.layers[st.middle].nodes)
    (c0, m0), (c1, m1) = got["bf16"], got["fp8"]
    eff = dev.memory_bandwidth * dev.memory_efficiency

    def extra(n) -> float:  # what Float8 adds to (or takes off) one marked product on one device
        g, nbytes = node_gemm(f8.graph, n), n.bytes_read + n.bytes_written
        return cm.float8_gemm(n.flops, nbytes, g) - max(n.flops / dev.matmul_flops(*g, "bfloat16"), nbytes / eff)

    want = sum(extra(n) for n in marked if n.name in block)
    assert want != 0 and sum(1 for n in marked if n.name in block) == per_block
    assert c1.time.compute_s - c0.time.compute_s == pytest.approx(want, rel=1e-9)
    assert c1.time.communication_s == c0.time.communication_s and c1.time.resharding_s == c0.time.resharding_s
    assert m1 == m0
    assert FLOAT8 == "float8_e4m3fn"

    # bad input: one clear line each
    for text, needle in (("float8=linear", "choose one of none, linears"), ("float8=linears", "precision=bf16")):
        with pytest.raises(UserError, match=needle) as e:
            parse_config(text)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="no measured Float8") as e:
        plan_config(built.model, built.inputs, stack, "dgx-h100:1", parse_config("precision=bf16,float8=linears"))
    assert "\n" not in str(e.value)


def test_attention_is_priced_at_the_measured_kernel_rates_causal_aware(tmp_path):
    """A profile with measured attention rates (the Llama 3 preset's H100) prices an attention call by the kernel:
    non-causal at the non-causal rate, ``is_causal`` with its query rows whole at the causal rate (the kernel
    skips the hidden half), split n ways by query rows (``causal_rows``) at the slowest rank's work — its
    rectangle non-causal, its own square causal. A profile without them (``dgx-h100``'s) prices attention as any
    op. A captured tiny Llama's attention is ``is_causal`` under ``unpacked_sequences``, and its plan's compute
    falls where the rates apply; a cluster file's bad ``attention_tflops`` is refused in one line."""
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.cluster.presets import H100_ATTENTION_TFLOPS
    from meshpilot.errors import ClusterFileError
    from meshpilot.models.sources import unpacked_sequences
    from meshpilot.ops.attention import attention_kind
    from meshpilot.planner.accounting import ComputeCost
    from meshpilot.sharding.strategies import Strategy

    cl = load_cluster("llama3-h100:1")
    cm = CostModel(LogicalMesh(cl, (1, 1), [[0]]))
    rf, rb, cf, cb = (t * 1e12 for t in H100_ATTENTION_TFLOPS)
    f = 1e12
    assert cm.attention(f, 0, False, 1, False) == pytest.approx(f / rf)
    assert cm.attention(f, 0, False, 16, True) == pytest.approx(f / rb)  # rows split: non-causal all the same
    assert cm.attention(f, 0, True, 1, False) == pytest.approx(f / cf)
    assert cm.attention(f, 0, True, 16, True) == pytest.approx(15 / 16 * f / rb + f / 16 / cb)
    assert f / cf < cm.attention(f, 0, True, 16, False) < f / rf  # between the two kernels
    assert CostModel(LogicalMesh(load_cluster("dgx-h100:1"), (1, 1), [[0]])).attention(f, 0, True, 1, False) is None

    built = build_hf("llama", TINY, batch=1, seq=64)
    with unpacked_sequences():
        stack = capture_stack(built.model, built.inputs, precision="bf16")
    calls = [n for n in stack.graph.nodes if attention_kind(n) is not None]
    assert {attention_kind(n) for n in calls} == {(True, False), (True, True)}
    masked = capture_stack(built.model, built.inputs, precision="bf16")  # fake tensors: a [b, 1, t, t] mask
    assert {attention_kind(n)[0] for n in masked.graph.nodes if attention_kind(n) is not None} == {False}
    node = next(n for n in calls if not attention_kind(n)[1])
    whole = Strategy(outs=(None,), ins=())
    fast = dataclasses.replace(cl, device=dataclasses.replace(cl.device, memory_bandwidth=1e18))  # FLOPs bound
    cc = ComputeCost(CostModel(LogicalMesh(fast, (1, 1), [[0]])), (1,), stack.graph)
    assert cc.node(node, whole) == pytest.approx(node.flops / cf)
    plain = dataclasses.replace(fast, device=dataclasses.replace(fast.device, attention=None))
    cc = ComputeCost(CostModel(LogicalMesh(plain, (1, 1), [[0]])), (1,), stack.graph)
    assert cc.node(node, whole) == pytest.approx(node.flops / (989.5e12 * plain.device.compute_efficiency))

    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[device_profile]\nkind = "x"\npeak_tflops_fp32 = 1.0\nmemory_GBps = 1.0\nmemory_GiB = 1.0\n'
        'attention_tflops = [1.0, 2.0]\n[[layers]]\nname = "x"\nranks = 1\np2p_GBps = 1.0\ngroup_GBps = 1.0\n'
    )
    with pytest.raises(ClusterFileError, match="attention_tflops") as e:
        load_cluster(str(bad))
    assert "\n" not in str(e.value)


def test_config_search_plans_no_candidate_estimated_beyond_the_margin(monkeypatch):
    """``config_search._plan_best`` plans candidates by estimate until the next one's estimate is more than
    ``ESTIMATE_MARGIN`` over the best simulated step so far; a plan that does not fit does not set the bar.
    Planning and simulating are stubbed: each candidate simulates at its estimate less 1 %."""
    import types

    from meshpilot.planner import config_search as cs
    from meshpilot.planner.config_plan import ParallelConfig

    steps = {}
    monkeypatch.setattr(cs, "plan_config", lambda m, i, s, cl, cfg, planner: cfg)
    monkeypatch.setattr(cs, "simulate_config", lambda cfg: types.SimpleNamespace(step_s=steps[cfg]))
    monkeypatch.setattr(cs, "group_memory", lambda cfg: 2.0 if cfg.dp == 9 else 1.0)  # dp=9: does not fit
    cands = []
    for dp, est in ((9, 1.00), (1, 1.01), (2, 1.03), (3, 1.06), (4, 1.07)):
        cfg = ParallelConfig(dp=dp)
        steps[cfg] = est * 0.99
        cands.append(cs.Candidate(cfg, est, 0.0))
    planned, best = cs._plan_best(lambda rows, rc: (None, None, None, None), None, cands, cap=1.5)
    # the first does not fit; the bar is then the second's 0.9999 s: 1.03 is within 5 %, 1.06 is not
    assert [c.config.dp for c in planned] == [9, 1, 2]
    assert [c.fits for c in planned] == [False, True, True]
    assert best == (ParallelConfig(dp=1), 1.01 * 0.99)  # the fastest that fits
    monkeypatch.setattr(cs, "ESTIMATE_MARGIN", float("inf"))
    planned, _ = cs._plan_best(lambda rows, rc: (None, None, None, None), None, cands, cap=1.5)
    assert len(planned) == len(cands)


@functools.lru_cache(maxsize=4)
def _tiny_plan(config: str, seq: int = 64):
    """``plan_config`` of `config` for :data:`TINY` on one DGX H100 (the frontier rows' path, 8 GPUs); the
    configurations of one microbatch share one capture and planner (:func:`_tiny_capture`)."""
    from meshpilot.planner.config_plan import plan_config

    cfg = parse_config(config)
    model, inputs, stack, sp = _tiny_capture(cfg.graph_batch, seq, cfg.precision)
    return model, stack, plan_config(model, inputs, stack, sp.cluster, cfg, planner=sp)


@functools.lru_cache(maxsize=2)
def _tiny_capture(rows: int, seq: int, precision: str):
    from meshpilot.planner.stage import StagePlanner

    built = build_hf("llama", TINY, batch=rows, seq=seq)
    stack = capture_stack(built.model, built.inputs, precision=precision)
    return built.model, built.inputs, stack, StagePlanner(stack.graph, "dgx-h100:1")


def test_zero1_shards_each_chunks_states_and_update_over_dp_and_nothing_else():
    """``zero=1`` (Megatron's distributed optimizer, the optimizer-state half of Llama 3's FSDP): per chunk, with
    ``T`` its parameters' bytes per GPU (the update temporary), the states ``2 · T`` and the temporary held over
    DP, the gradients' sum and the activations whole, the update's streams over DP; the memory terms of the
    fullest group add up to its bound, its weights and gradients ``T`` each."""
    from meshpilot.planner.accounting import update_stream_seconds
    from meshpilot.planner.config_plan import group_memory, group_terms

    base = "tp=2,pp=2,dp=2,schedule=interleaved-1f1b,virtual=2,microbatches=4,split=ends,precision=bf16"
    model, stack, plain = _tiny_plan(base)
    _, _, zero = _tiny_plan(f"{base},zero=1")
    dev = load_cluster("dgx-h100:1").device
    for a, b in zip(plain.costs, zero.costs):
        pa, pb = a.peaks, b.peaks
        T = pa.update - pa.resident
        assert T > 0
        assert pb.forward_backward == pytest.approx(pa.forward_backward - 0.5 * 2 * T)
        assert pb.resident == pytest.approx(pa.resident - 0.5 * 2 * T)
        assert pb.update == pytest.approx(pa.update - 0.5 * 3 * T)
        assert pb.activations == pa.activations
        assert b.time.optimizer_s == pytest.approx(a.time.optimizer_s - 0.5 * update_stream_seconds(T, dev))
        assert b.time.compute_s == a.time.compute_s and b.time.communication_s == a.time.communication_s
        assert b.memory.total == pytest.approx(max(pb.forward_backward, pb.update))
    # T is the parameters' bytes: a chunk of k blocks holds k blocks' Megatron pairs halved over TP 2 and their
    # two norms whole, in bf16
    blk = next(m for n, m in model.named_modules() if n.endswith("layers.0"))
    norms = sum(p.numel() for n, p in blk.named_parameters() if "norm" in n)
    per_block = 2 * ((sum(p.numel() for p in blk.parameters()) - norms) / 2 + norms)
    inner = [(c, stack.parts(*c.layers)) for c in plain.costs]
    inner = [(c, k) for c, (pre, k, post) in inner if pre is None and post is None and k]
    assert inner
    for c, k in inner:
        assert c.peaks.update - c.peaks.resident == pytest.approx(k * per_block)
    # the fullest group's terms: they add up to the bound, and only the states change
    tp_, tz = group_terms(plain), group_terms(zero)
    assert tp_.total == pytest.approx(group_memory(plain)) and tz.total == pytest.approx(group_memory(zero))
    assert tz.optimizer == pytest.approx(tp_.optimizer / 2) and tz.grads == pytest.approx(tp_.grads)
    assert tz.weights == pytest.approx(tp_.weights) and tz.in_flight == pytest.approx(tp_.in_flight)
    assert tp_.optimizer == pytest.approx(2 * tp_.grads)
    assert group_memory(zero) < group_memory(plain)
    assert zero.plan.step_s < plain.plan.step_s


def test_config_search_shards_the_optimizer_states_over_dp_and_prices_them_so():
    """Every candidate with DP · CP > 1 carries ``zero=1`` (it never costs time nor adds memory in the model), and
    the search's estimate prices it: within a capacity between the stated configuration's plans with and without
    its states sharded, the estimate admits the sharded candidate and rules out the other, as the plans do."""
    from meshpilot.planner.config_plan import group_memory
    from meshpilot.planner.config_search import (
        _Captures,
        _Estimator,
        config_string,
        enumerate_configs,
        estimate,
        plan_pieces,
    )

    base = "tp=2,pp=2,dp=2,schedule=interleaved-1f1b,virtual=2,microbatches=4,split=ends,precision=bf16"
    _, stack, plain = _tiny_plan(base)
    _, _, zero = _tiny_plan(f"{base},zero=1")
    cl = load_cluster("dgx-h100:1")
    got = enumerate_configs(stack, cl, 8, 8, "bf16", seq=64)
    assert got and all(c.zero == (1 if c.dp * c.cp > 1 else 0) for c in got)
    assert zero.config in got and plain.config not in got
    assert parse_config(config_string(zero.config)) == zero.config
    cap = (group_memory(plain) + group_memory(zero)) / 2  # the stated configuration fits only with its states sharded

    def build(rows):
        b = build_hf("llama", TINY, batch=rows, seq=64)
        return b.model, b.inputs

    captures = _Captures(build, "bf16", cl)
    one = captures(1)[2]
    est = _Estimator(one, cl, {(2, 1, plain.config.recompute): plan_pieces(*captures(1), 2, 1)})
    m0, m1 = (est.memory(c.config, est.chunks(c.config)) for c in (plain, zero))
    assert m1 < cap < m0
    assert m0 - m1 == pytest.approx(group_memory(plain) - group_memory(zero), rel=0.05)
    assert estimate(est, zero.config) < estimate(est, plain.config)  # the update over a 1/DP shard
