"""Pipeline schedules as ``Schedule`` values (GPipe, 1F1B, Interleaved1F1B): their orders, what they keep in
flight, and the simulator's timeline of them against one computed by hand (Interleaved1F1B: against Narayanan
et al.'s (B + (P − 1)/v)·t step)."""

from __future__ import annotations

import pytest
from test_sim import MS, _cluster, _plan

from meshpilot.errors import UserError
from meshpilot.planner.schedule import (
    ActionKind,
    PipelineKind,
    in_flight,
    interleaved_1f1b,
    parse_schedule,
    pipeline,
    stage_in_flight_of,
)
from meshpilot.sim import simulate

ONE_STAGE_PER_CLASS = (PipelineKind.GPIPE, PipelineKind.ONE_F_ONE_B)


def _compute_order(sched, cls):
    return [str(a) for a in sched.classes[cls].actions if a.kind.is_compute]


def test_orders_follow_torch_pipelining():
    g = pipeline([[0], [1]], 4, PipelineKind.GPIPE)
    assert _compute_order(g, 0) == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    o = pipeline([[0], [1]], 4, "1f1b")
    # Schedule1F1B: stage s warms up with min(B, S - s) forwards, then one backward, one forward
    assert _compute_order(o, 0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert _compute_order(o, 1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert str(o).splitlines()[1] == "ranks 0: F0 S0>1 F1 S1>1 R0<1 B0 F2 S2>1 R1<1 B1 F3 S3>1 R2<1 B2 R3<1 B3 G"
    assert parse_schedule(str(o)) == o and parse_schedule(str(g)) == g


def test_every_send_has_its_receive_and_peers_pair_by_position():
    for kind in ONE_STAGE_PER_CLASS:
        s = pipeline([[0, 1], [2, 3], [4, 5]], 5, kind)
        sends = {(c.ranks[0], a.peer, a.microbatch) for c in s.classes for a in c.actions if a.kind == ActionKind.SEND}
        recvs = {(a.peer, c.ranks[0], a.microbatch) for c in s.classes for a in c.actions if a.kind == ActionKind.RECV}
        assert sends == recvs and len(sends) == 2 * 2 * 5  # 2 boundaries, forward and backward, 5 microbatches


def test_in_flight():
    assert in_flight(pipeline([[0], [1], [2], [3]], 8, "gpipe")) == {(0,): 8, (1,): 8, (2,): 8, (3,): 8}
    assert in_flight(pipeline([[0], [1], [2], [3]], 8, "1f1b")) == {(0,): 4, (1,): 3, (2,): 2, (3,): 1}
    assert in_flight(pipeline([[0], [1]], 1, "1f1b")) == {(0,): 1, (1,): 1}


def test_bad_input():
    with pytest.raises(UserError, match="microbatches"):
        pipeline([[0], [1]], 0, "gpipe")
    with pytest.raises(ValueError):
        pipeline([[0], [1]], 2, "dualpipe")


def _starts(result, rank):
    return {e.name: round(e.start_s / MS, 6) for e in result.events if e.rank == rank and e.cat == "compute"}


@pytest.mark.parametrize("kind", ONE_STAGE_PER_CLASS)
def test_two_stages_four_microbatches_hand_timeline(kind):
    """F = 1 ms, B = 2 ms per stage, free sends. By hand: GPipe's stage 1 runs F0..F3 at 1,2,3,4 and B0..B3
    at 5,7,9,11; stage 0 F at 0..3, B at 7,9,11,13. 1F1B: stage 0 F0 F1 at 0,1, B0 at 4 (after stage 1's
    B0 at 2-4), F2 at 6, B1 at 7, F3 at 9, B2 at 10, B3 at 13; stage 1 alternates F at 1,4,7,10 and B at
    2,5,8,11. Both end at 15 ms = (B + S − 1)(F + B): the same bubble."""
    plan = _plan((2,), [("f", "fwd", 1 * MS), ("b", "bwd", 2 * MS)], [])
    r = simulate(plan, cluster=_cluster(2), schedule=pipeline([[0], [1]], 4, kind))
    assert r.step_s == pytest.approx(15 * MS)
    s0, s1 = _starts(r, 0), _starts(r, 1)
    if kind == PipelineKind.GPIPE:
        want0 = {"F0": 0, "F1": 1, "F2": 2, "F3": 3, "B0": 7, "B1": 9, "B2": 11, "B3": 13}
        want1 = {"F0": 1, "F1": 2, "F2": 3, "F3": 4, "B0": 5, "B1": 7, "B2": 9, "B3": 11}
    else:
        want0 = {"F0": 0, "F1": 1, "B0": 4, "F2": 6, "B1": 7, "F3": 9, "B2": 10, "B3": 13}
        want1 = {"F0": 1, "B0": 2, "F1": 4, "B1": 5, "F2": 7, "B2": 8, "F3": 10, "B3": 11}
    assert {k[:2]: v for k, v in s0.items()} == want0
    assert {k[:2]: v for k, v in s1.items()} == want1
    idle0 = r.classes[0].idle_s
    assert idle0 == pytest.approx(3 * MS)  # stage 0 computes 12 of the 15 ms: the bubble (S − 1)(F + B)


def test_gpipe_with_sends_hand_timeline():
    """Each send takes 1 ms: stage 1's F0 starts at 2, its B0 at 6 arrives at stage 0 at 9; step 17 ms."""
    plan = _plan((2,), [("f", "fwd", 1 * MS), ("b", "bwd", 2 * MS)], [])
    r = simulate(plan, cluster=_cluster(2), schedule=pipeline([[0], [1]], 4, "gpipe"), p2p_bytes=1e8)
    assert r.step_s == pytest.approx(17 * MS)
    assert {k[:2]: v for k, v in _starts(r, 1).items()} == {
        "F0": 2, "F1": 3, "F2": 4, "F3": 5, "B0": 6, "B1": 8, "B2": 10, "B3": 12
    }  # fmt: skip
    assert {k[:2]: v for k, v in _starts(r, 0).items()}["B0"] == 9


def test_interleaved_order_round_trip_and_pairs():
    """Depth first: class 0 of 2 warms up with (v − 1)·P + 2·(P − 1) = 4 forwards (chunk 0 of microbatches 0, 1,
    then chunk 1 = stage 2 of them), the last class with (v − 1)·P = 2; every stage runs F then B of every
    microbatch once; every send has its receive, named by the two stages (boundary and direction)."""
    s = pipeline([[0, 1], [2, 3]], 4, PipelineKind.INTERLEAVED_1F1B, chunks=2)
    assert s == interleaved_1f1b([[0, 1], [2, 3]], 4, 2) and parse_schedule(str(s)) == s
    assert _compute_order(s, 0)[:6] == ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0"]
    assert _compute_order(s, 1)[:4] == ["1F0", "1F1", "3F0", "3B0"]
    assert str(s).splitlines()[2].startswith("ranks 2-3: 1R0<0/0 1F0 1S0>0/2 ")
    for j in range(4):
        cls = s.classes[j % 2]
        for m in range(4):
            f = [i for i, a in enumerate(cls.actions) if a.kind.is_compute and (a.stage, a.microbatch) == (j, m)]
            assert [cls.actions[i].kind for i in f] == [ActionKind.FORWARD, ActionKind.BACKWARD]
    sends = [(c.ranks[0], a.peer, a.boundary) for c in s.classes for a in c.actions if a.kind == ActionKind.SEND]
    recvs = [(a.peer, c.ranks[0], a.boundary) for c in s.classes for a in c.actions if a.kind == ActionKind.RECV]
    assert sorted(sends) == sorted(recvs) and len(set(sends)) == len(sends) == 2 * 3 * 4  # 3 boundaries, 2 ways
    assert in_flight(s) == {(0, 1): 5, (2, 3): 3}  # chunk-microbatches: warm-up + 1
    assert stage_in_flight_of(s) == {0: 4, 1: 3, 2: 2, 3: 1}


def test_interleaved_bad_input():
    with pytest.raises(UserError, match="multiple of 2"):
        interleaved_1f1b([[0], [1]], 3, 2)
    with pytest.raises(UserError, match="at least 2 stages per rank class"):
        interleaved_1f1b([[0], [1]], 4, 1)
    with pytest.raises(UserError, match="2S3>5/3"):
        parse_schedule("schedule x, 1 microbatch\nranks 0: 2S3>5")


@pytest.mark.parametrize(("P", "B"), [(2, 4), (2, 8), (4, 8)])
def test_interleaved_step_is_narayanans(P, B):
    """Each class's work split into 2 chunks of F = 0.5 ms, B = 1 ms (the 1F1B case's stage: F = 1, B = 2 ms),
    free sends: the simulated step is (B + (P − 1)/v)·3 ms, 1F1B's (B + P − 1)·3 ms."""
    plan = _plan((P,), [("f", "fwd", 0.5 * MS), ("b", "bwd", 1 * MS)], [])
    r = simulate(plan, cluster=_cluster(P), schedule=interleaved_1f1b([[p] for p in range(P)], B, 2))
    assert r.step_s == pytest.approx((B + (P - 1) / 2) * 3 * MS)
    whole = _plan((P,), [("f", "fwd", 1 * MS), ("b", "bwd", 2 * MS)], [])
    one = simulate(whole, cluster=_cluster(P), schedule=pipeline([[p] for p in range(P)], B, "1f1b"))
    assert one.step_s == pytest.approx((B + P - 1) * 3 * MS)


def test_the_planner_interleaves_1f1b_stages_and_auto_weighs_it():
    """Pure: ``plan_pipeline(schedule="interleaved-1f1b")`` on 2 devices in 2 groups cuts the GPT's 8 layers
    into 2·P chunks itself (stage j on group j mod P), prices each with the stage planner and times the step by
    the simulator; saved and loaded equal. Its simulated step is below 1F1B's and GPipe's (stages of about a
    millisecond, sends of microseconds: the bubble about halves). ``auto`` takes the shortest simulated step,
    here ZB-H1's (the first stage's backward is all weight work, the drain's input gradients pass the others
    unblocked); on this repeated stack it leaves the interleaved search out (the others' stage costs are
    composed from one block's plan), and ZB-H1 is below the interleaved plan anyway."""
    import warnings

    import torch

    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT, GPTConfig
    from meshpilot.planner.pipeline import AUTO, plan_pipeline
    from meshpilot.planner.plan import Plan
    from meshpilot.planner.stack import StageCosting
    from meshpilot.planner.stage import StagePlanner

    cfg = GPTConfig(vocab=64, seq=64, layers=4, hidden=256, heads=8, batch=2)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.zeros((2, cfg.seq), dtype=torch.long, device="meta")  # one microbatch of 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, (x, x))
    sp = StagePlanner(graph, "alpa-p3x8")
    kw = dict(microbatches=4, num_devices=2, num_stages=2, planner=sp, epsilon=0.0)
    one = plan_pipeline(graph, "alpa-p3x8", **kw)
    assert one.costing == StageCosting.STACK  # a repeated stack: auto does not run the interleaved search (below)
    inter = plan_pipeline(graph, "alpa-p3x8", schedule="interleaved-1f1b", **kw)
    assert inter.groups == one.groups and inter.chunks == 2 and len(inter.stages) == 4
    assert [st.ranks for st in inter.stages] == [g for _ in range(2) for g in one.groups]
    assert [st.mesh_shape for st in inter.stages] == [st.mesh_shape for _ in range(2) for st in one.stages]
    assert [st.layers for st in inter.stages] == list(inter.clustering.bounds)
    assert inter.step_schedule().name == "interleaved-1f1b" and len(inter.step_schedule().classes) == 2
    assert Plan.from_json(inter.to_json()).step_schedule() == inter.step_schedule()
    sims = {p.schedule.value: p.simulate("alpa-p3x8").step_s for p in (one, inter)}
    sims["gpipe"] = plan_pipeline(graph, "alpa-p3x8", schedule="gpipe", **kw).simulate("alpa-p3x8").step_s
    assert sims["interleaved-1f1b"] < min(sims["1f1b"], sims["gpipe"])
    assert inter.step_s < one.step_s  # the closed form agrees: the fill and drain halve
    zb = plan_pipeline(graph, "alpa-p3x8", schedule="zb-h1", **kw)
    sims["zb-h1"] = zb.simulate("alpa-p3x8").step_s
    best = plan_pipeline(graph, "alpa-p3x8", schedule=AUTO, **kw)
    assert min(sims, key=sims.get) == "zb-h1" and sims["zb-h1"] < sims["interleaved-1f1b"]
    assert best.schedule == PipelineKind.ZERO_BUBBLE and best.stages == zb.stages
