"""Schedules are values: they print, parse back and survive JSON; the builders say what the runtime runs."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshpilot.errors import UserError
from meshpilot.planner.schedule import (
    Action,
    ActionKind,
    RankClass,
    Schedule,
    accumulate,
    duplex,
    interleaved,
    overlapped,
    parse_action,
    parse_schedule,
    trivial,
)

_mb = st.integers(0, 63)


@st.composite
def actions(draw) -> Action:
    kind = draw(st.sampled_from(list(ActionKind)))
    if kind.is_compute:
        nodes = draw(st.none() | st.tuples(st.integers(0, 5000), st.integers(0, 5000)).map(lambda t: tuple(sorted(t))))
        return Action(kind, draw(_mb), nodes=nodes)
    if kind == ActionKind.GRAD_SYNC:
        return Action(kind)
    if kind in (ActionKind.ISSUE, ActionKind.WAIT):
        return Action(kind, draw(_mb), collective=draw(st.integers(0, 10_000)))
    return Action(kind, draw(_mb), peer=draw(st.integers(0, 4095)))


@st.composite
def schedules(draw) -> Schedule:
    n = draw(st.integers(1, 4))
    ranks = draw(st.lists(st.integers(0, 511), min_size=n, max_size=n * 8, unique=True).map(sorted))
    groups = [tuple(ranks[i::n]) for i in range(n) if ranks[i::n]]
    classes = tuple(RankClass(g, tuple(draw(st.lists(actions(), max_size=12)))) for g in groups)
    name = draw(st.sampled_from(["trivial", "accumulate", "overlapped", "duplex", "1f1b", "zero-bubble"]))
    return Schedule(classes, draw(st.integers(1, 64)), name)


@given(actions())
def test_an_action_prints_and_parses_back(a):
    assert parse_action(str(a)) == a


@given(schedules())
def test_a_schedule_round_trips_through_text_and_json(s):
    assert parse_schedule(str(s)) == s
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_builders_print_as_documented():
    assert str(trivial(4)) == "schedule trivial, 1 microbatch\nranks 0-3: F0 B0 G"
    assert str(accumulate(8, 2)) == "schedule accumulate, 2 microbatches\nranks 0-7: F0 B0 F1 B1 G"
    assert trivial(4).actions(2) == (Action(ActionKind.FORWARD), Action(ActionKind.BACKWARD, 0), Action("G"))


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("schedule x, 1 microbatch\nranks 0: X3", "action 'X3': write F3"),
        ("schedule x, 1 microbatch\nranks 0: F", "action 'F': write"),
        ("schedule x, 1 microbatch\nranks 0: +3", "action '\\+3': write"),
        ("schedule x, 1 microbatch\nranks 0: S3>", "action 'S3>': write"),
        ("schedule x, 1 microbatch\nranks 0: F3[4]", "action 'F3\\[4\\]': write"),
        ("schedule x, 1 microbatch\nranks: F0", "line 'ranks: F0': write 'ranks 0-3: F0 B0 G'"),
        ("ranks 0: F0", "first line must read"),
    ],
)
def test_bad_text_is_one_line(text, says):
    with pytest.raises(UserError, match=says):
        parse_schedule(text)


def test_overlapped_issues_each_edge_first_collective_after_its_producer():
    """On a planned MLP: every early-issued collective's issue precedes its wait, sits after its producer's
    node range and before its consumer's; compute ranges of a phase cover its nodes once."""
    import torch

    import meshpilot
    from meshpilot.models import zoo

    model = zoo.MLPModel((32, 64, 64, 16))
    inputs = (torch.randn(8, 32), torch.randint(0, 16, (8,)))
    plan = meshpilot.plan(model, inputs, "atp-ic3", mesh_shape=(2, 2)).only
    sched = overlapped(plan)
    acts = sched.actions(3)
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    issued = {a.collective: k for k, a in enumerate(acts) if a.kind == ActionKind.ISSUE}
    waited = {a.collective: k for k, a in enumerate(acts) if a.kind == ActionKind.WAIT}
    assert issued and set(issued) == set(waited)
    for c, k in issued.items():
        col = plan.collectives[c]
        assert k < waited[c]
        before = [a for a in acts[:k] if a.kind.is_compute and a.nodes]
        after = [a for a in acts[waited[c] :] if a.kind.is_compute and a.nodes]
        assert col.src not in index or any(a.nodes[0] <= index[col.src] < a.nodes[1] for a in before)
        assert after and after[0].nodes[0] == index[col.dst]
    for kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
        spans = [a.nodes for a in acts if a.kind == kind]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, no overlap
    assert acts[-1] == Action(ActionKind.GRAD_SYNC)


def test_duplex_interleaves_two_microbatches_stage_by_stage():
    """On a planned GPT: per phase, stages alternate microbatch 0 then 1 over the same node range, the ranges
    tile the phase; each collective cut at a stage start is issued by a microbatch right after its compute
    of the stage before (so the other microbatch computes meanwhile) and waited right before its own compute
    of that stage; one G at the end; it prints and parses back."""
    import torch

    import meshpilot
    from meshpilot.models.gpt import GPT, gpt_tiny

    torch.manual_seed(0)
    idx = torch.randint(0, 64, (8, 9))
    model = GPT(gpt_tiny(batch=8, seq=8))
    plan = meshpilot.plan(model, (idx[:, :-1], idx[:, 1:]), "atp-ic3", mesh_shape=(2, 2)).only
    sched = duplex(plan)
    assert sched.name == "duplex" and sched.microbatches == 2 and parse_schedule(str(sched)) == sched
    acts = sched.actions(0)
    assert acts[-1] == Action(ActionKind.GRAD_SYNC) and sum(a.kind == ActionKind.GRAD_SYNC for a in acts) == 1
    issued = {(a.collective, a.microbatch): k for k, a in enumerate(acts) if a.kind == ActionKind.ISSUE}
    waited = {(a.collective, a.microbatch): k for k, a in enumerate(acts) if a.kind == ActionKind.WAIT}
    assert issued and set(issued) == set(waited)
    index = {n.name: i for i, n in enumerate(plan.nodes)}
    for kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
        comp = [a for a in acts if a.kind == kind]
        assert interleaved(acts, kind) and [a.microbatch for a in comp] == [0, 1] * (len(comp) // 2)
        spans = [a.nodes for a in comp[::2]]
        assert spans == [a.nodes for a in comp[1::2]]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for (c, m), k in issued.items():
        before = next(a for a in reversed(acts[:k]) if a.kind.is_compute)
        after = next(a for a in acts[waited[(c, m)] :] if a.kind.is_compute)
        assert before.microbatch == m and before.nodes[1] == index[plan.collectives[c].dst]
        assert after.microbatch == m and after.nodes[0] == index[plan.collectives[c].dst]
        between = [a for a in acts[k : waited[(c, m)]] if a.kind.is_compute]
        assert between and all(a.microbatch != m for a in between)  # the other microbatch computes meanwhile
    assert not interleaved(accumulate(4, 2).actions(0), ActionKind.FORWARD)
