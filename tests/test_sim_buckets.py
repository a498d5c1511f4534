"""Gradient buckets in the simulator and in the planner's closed form, against timelines computed by hand.

The hand-built plans of ``test_sim`` (2 ranks, 100 GB/s links, no latency: an all-reduce of 1e8 B takes 1 ms)
with a forward node ``f`` (1 ms) and two backward nodes, ``b0`` (1 ms) producing the gradient of ``p1`` and
``b1`` (2 ms) producing that of ``p0``; ``p1``'s bucket is ready at 2 ms, ``p0``'s at 4 ms. The runtime
(``runtime.program``) issues a bucket right after its last gradient when the step runs the backward once and
waits for the buckets at the backward's end; with two microbatches ``G`` issues them all, then waits.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_sim import MS, _close, _cluster, _cost, _plan

from meshpilot.planner.buckets import GradBucket, backward_issues_buckets, bucket_overlap, repriced_buckets
from meshpilot.planner.plan import PlannedCollective
from meshpilot.planner.schedule import accumulate, parse_schedule, trivial
from meshpilot.sharding.reshard import CollectiveKind
from meshpilot.sim import simulate

AR = CollectiveKind.ALL_REDUCE


def _bucketed(first_bytes: float = 1e8, schedule: str | None = None):
    """The plan above with ``p1``'s bucket of `first_bytes` and ``p0``'s of 1e8 B, priced (``StepTime``)."""
    cm = _cost((2,))
    plan = _plan((2,), [("f", "fwd", 1 * MS), ("b0", "bwd", 1 * MS), ("b1", "bwd", 2 * MS)], [], schedule)
    grads = tuple(
        PlannedCollective(AR, 0, int(nb), "bwd", src, f"grad:{p}", cm.all_reduce(nb, 0))
        for p, src, nb in (("p1", "b0", first_bytes), ("p0", "b1", 1e8))
    )
    buckets = tuple(GradBucket((c.dst[5:],), AR, 0, c.nbytes, c.seconds) for c in grads)
    time = dataclasses.replace(plan.time, communication_s=sum(c.seconds for c in grads))
    plan = dataclasses.replace(plan, collectives=grads, grad_buckets=buckets, time=time)
    return repriced_buckets(plan, cm)


def _spans(result, cat: str) -> list[tuple[float, float]]:
    return sorted(
        (round(e.start_s / MS, 9), round((e.start_s + e.dur_s) / MS, 9)) for e in result.events if e.cat == cat
    )


def test_a_bucket_runs_behind_the_backward_of_the_layers_before_it():
    """p1's bucket (1 ms) runs 2..3 ms beside b1 (2..4 ms); p0's is issued at 4 ms and exposed: step 5 ms
    where the serial step (every collective after the backward) is 1 + 1 + 2 + 1 + 1 = 6 ms."""
    plan = _bucketed()
    r = simulate(plan, cluster=_cluster(2))
    assert _close(r.step_s, 5 * MS)
    assert _spans(r, "compute") == [(0, 1), (1, 2), (2, 4)]
    assert _spans(r, "comm") == [(2, 3), (4, 5)]  # issued the moment b0, then b1, ends; not after the backward
    (c,) = r.classes
    assert _close(c.hidden_comm_s, 1 * MS) and _close(c.exposed_comm_s, 1 * MS)
    # the closed form: 1 ms of the 2 hidden
    assert _close(plan.time.total_s, 6 * MS) and _close(plan.time.hidden_s, 1 * MS)
    assert _close(plan.time.overlapped_s, r.step_s)


def test_a_groups_buckets_run_one_after_the_other():
    """p1's bucket of 3e8 B (3 ms) runs 2..5 ms; p0's, issued at 4 ms on the same process group, waits for it
    (a group runs one collective at a time) and runs 5..6 ms: 6 ms of the serial 8 ms, in both."""
    plan = _bucketed(3e8)
    r = simulate(plan, cluster=_cluster(2))
    assert _close(r.step_s, 6 * MS)
    assert _spans(r, "comm") == [(2, 5), (5, 6)]
    assert _close(plan.time.total_s, 8 * MS) and _close(plan.time.hidden_s, 2 * MS)
    assert _close(plan.time.overlapped_s, r.step_s)


def test_with_two_microbatches_G_synchronises_the_buckets():
    """Two backwards a step: G issues both buckets at 8 ms (two microbatches of 4 ms) and waits: they run one
    after the other and end at 10 ms, as the serial step prices them; nothing is hidden."""
    plan = _bucketed(schedule=None)
    plan = repriced_buckets(dataclasses.replace(plan, schedule=accumulate(2, 2)), _cost((2,)))
    assert not backward_issues_buckets(plan.schedule)
    r = simulate(plan, cluster=_cluster(2))
    assert _close(r.step_s, 10 * MS)
    assert _spans(r, "comm") == [(8, 9), (9, 10)]
    priced = bucket_overlap(plan, plan.grad_buckets, _cost((2,)), False)
    assert _close(priced.exposed_s, 2 * MS) and abs(plan.time.hidden_s) < 1e-15


def test_a_zero_bubble_split_backward_synchronises_at_G():
    """``I``/``W`` halves run the backward twice: the rule the runtime follows keeps the buckets for G."""
    sched = parse_schedule("schedule zb, 1 microbatch\nranks 0-1: F0 I0[1:2] W0[2:3] G")
    assert not backward_issues_buckets(sched) and backward_issues_buckets(trivial(2))
    plan = _bucketed()
    r = simulate(plan, cluster=_cluster(2), schedule=sched)
    assert _close(r.step_s, 6 * MS) and _spans(r, "comm") == [(4, 5), (5, 6)]


@pytest.mark.parametrize("device, end_ms", [("cpu", 4.0), ("a100-80gb", 3.0)])
def test_a_bucket_beside_compute_is_slowed_by_its_busy_factor(device, end_ms):
    """On the CPU cluster of ``test_sim._busy_cluster`` (busy factor 2) p1's bucket runs beside b1 (2..4 ms)
    at half speed: its 1 ms takes 2 ms, to 4 ms; p0's then runs 4..5 ms alone. The closed form follows."""
    from test_sim import _busy_cluster

    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh

    cluster = _busy_cluster(device, latency=False)
    plan = repriced_buckets(_bucketed(), CostModel(LogicalMesh(cluster, (2,))))
    r = simulate(plan, cluster=cluster)
    assert _spans(r, "comm") == [(2, end_ms), (4, 5)]
    assert _close(r.step_s, 5 * MS) and _close(plan.time.overlapped_s, r.step_s)
    priced = bucket_overlap(plan, plan.grad_buckets, CostModel(LogicalMesh(cluster, (2,))), True)
    assert _close(priced.exposed_s, 1 * MS)


@pytest.mark.parametrize(
    "first_bytes, comm, step_ms", [(1e8, [(2, 3.5), (4, 5.5)], 5.5), (3e8, [(2, 5.5), (5.5, 7)], 7.0)]
)
def test_a_host_cost_per_collective_lengthens_every_bucket_alike_in_the_simulator_and_the_closed_form(
    first_bytes, comm, step_ms
):
    """With 0.5 ms of host cost a collective (``DeviceProfile.collective_overhead``) each bucket takes 0.5 ms
    more, as latency: p1's runs 2..3.5 ms beside b1, p0's 4..5.5 ms (or, with p1's bucket of 3 ms, 2..5.5 and
    then 5.5..7 ms behind it on the same group); the simulator and ``bucket_overlap`` agree."""
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.planner.buckets import collective_parts

    base = _cluster(2)
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, collective_overhead=0.5 * MS))
    cm = CostModel(LogicalMesh(cluster, (2,)))
    plan = repriced_buckets(_bucketed(first_bytes), cm)
    assert _close(plan.grad_buckets[1].seconds, 1.5 * MS)
    assert _close(collective_parts(cm, "all_reduce", 1e8, 0, by_op=False, seconds=0.0).latency_s, 0.5 * MS)
    r = simulate(plan, cluster=cluster)
    assert _spans(r, "comm") == comm
    assert _close(r.step_s, step_ms * MS)
    priced = bucket_overlap(plan, plan.grad_buckets, cm, True)
    assert _close(priced.exposed_s, (step_ms - 4) * MS)  # what runs after the backward's end at 4 ms


def test_a_collective_of_the_backward_waits_for_its_groups_bucket():
    """b1 first all-gathers 2e8 B (1 ms) on the process group p1's bucket was issued on at 2 ms: the gather
    waits for the bucket (2..3), runs 3..4, b1 4..6, p0's bucket 6..7: step 7 ms, the serial step (nothing
    hidden: the bucket delayed the backward as much as it ran behind it), in both."""
    plan = _bucketed()
    gather = PlannedCollective("all_gather", 0, int(2e8), "bwd", "b0", "b1", _cost((2,)).all_gather(2e8, 0), 0)
    time = dataclasses.replace(plan.time, resharding_s=gather.seconds)
    plan = repriced_buckets(dataclasses.replace(plan, collectives=(*plan.collectives, gather), time=time), _cost((2,)))
    r = simulate(plan, cluster=_cluster(2))
    assert _close(r.step_s, 7 * MS) and _spans(r, "comm") == [(2, 3), (3, 4), (6, 7)]
    assert _close(plan.time.total_s, 7 * MS) and _close(plan.time.overlapped_s, 7 * MS)


def test_on_a_cpu_a_collectives_host_cost_runs_on_the_compute_stream_in_the_simulator_and_the_closed_form():
    """On a CPU device (gloo: the call and the backend's threads run on the cores the ranks compute on) the
    0.5 ms of host cost a collective is paid by the compute stream when it is issued: b0 ends at 2 ms, p1's
    host cost 2..2.5, its bucket 2.5..3.5 beside b1 (now 2.5..4.5), p0's host cost 4.5..5 and its bucket
    5..6: step 6 ms, where the same cost as latency (a GPU, the test above) hides behind b1: 5.5 ms. The
    closed form agrees: 2 ms of the buckets exposed (1 ms of host cost on the compute stream, 1 ms after it)."""
    from meshpilot.cluster import DEVICES
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh
    from meshpilot.planner.buckets import collective_parts

    base = _cluster(2)
    cluster = dataclasses.replace(base, device=dataclasses.replace(DEVICES["cpu"], collective_overhead=0.5 * MS))
    cm = CostModel(LogicalMesh(cluster, (2,)))
    plan = repriced_buckets(_bucketed(), cm)
    parts = collective_parts(cm, "all_reduce", 1e8, 0, by_op=False, seconds=0.0)
    assert _close(parts.host_s, 0.5 * MS) and _close(parts.latency_s + parts.work_s, 1 * MS)
    r = simulate(plan, cluster=cluster)
    assert _spans(r, "comm") == [(2.5, 3.5), (5, 6)]
    assert _close(r.step_s, 6 * MS)
    priced = bucket_overlap(plan, plan.grad_buckets, cm, True)
    assert _close(priced.exposed_s, 2 * MS)
    assert _close(plan.time.overlapped_s, r.step_s)
