"""Pipeline schedules as ``Schedule`` values (GPipe, 1F1B): their orders, what they keep in flight, and the
simulator's timeline of them against one computed by hand."""

from __future__ import annotations

import pytest
from test_sim import MS, _cluster, _plan

from meshpilot.errors import UserError
from meshpilot.planner.schedule import ActionKind, PipelineKind, in_flight, parse_schedule, pipeline
from meshpilot.sim import simulate


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
    for kind in PipelineKind:
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


@pytest.mark.parametrize("kind", list(PipelineKind))
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
