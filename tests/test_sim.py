"""The simulator (meshpilot.sim) against timelines computed by hand, a real plan's closed form, and the CLI.

Hand-built plans run on a made-up cluster of GPUs joined by 100 GB/s links with zero latency, so a collective's
duration is its bandwidth term alone: an all-reduce of M bytes over 2 ranks takes 2(n-1)/n * M/B' = M / 1e11
(1 ms for 1e8 bytes), an all-gather producing M bytes (n-1)/n * M/B' (0.5 ms for 1e8 bytes).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from meshpilot.cluster import DEVICES, load_cluster
from meshpilot.cluster.topology import Cluster, Layer
from meshpilot.errors import UserError
from meshpilot.planner.plan import MemoryUse, NodeChoice, PlannedCollective, SolverReport, StagePlan, StepTime
from meshpilot.planner.schedule import accumulate, overlapped, parse_schedule
from meshpilot.sim import parse_straggler, rank_classes, simulate

MS = 1e-3
REL = 1e-9


def _cluster(n: int) -> Cluster:
    bw = 100e9
    layer = Layer("gpu", n, np.full((n, n), bw), np.full(n, bw), 0.0)
    return Cluster("test", (layer,), load_cluster("atp-ic3").device)


def _plan(mesh_shape, nodes, collectives, schedule=None) -> StagePlan:
    """A plan with the given nodes ((name, phase, seconds)) and collectives ((kind, axis, nbytes, src, dst, op))."""
    world = int(np.prod(mesh_shape))
    cm = _cost(mesh_shape)
    cols = tuple(
        PlannedCollective(k, a, nb, "fwd", src, dst, getattr(cm, k)(nb, a), op)
        for k, a, nb, src, dst, op in collectives
    )
    return StagePlan(
        cluster="test",
        mesh_shape=tuple(mesh_shape),
        mesh_ranks=tuple(range(world)),
        mapping="row",
        nodes=tuple(NodeChoice(name, "t", "op", (), (), "s", ph, sec) for name, ph, sec in nodes),
        params=(),
        inputs=(),
        input_shapes=(),
        time=StepTime(sum(s for _, _, s in nodes), sum(c.seconds for c in cols), 0.0),
        memory=MemoryUse(0, 0, 0, 0, 0, 1),
        collectives=cols,
        warnings=(),
        solver=SolverReport("", 0, 0, 0, 0, 0, 0, 0, 0, 0),
        fingerprint="",
        schedule=parse_schedule(schedule) if schedule else None,
    )


def _cost(mesh_shape):
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh

    return CostModel(LogicalMesh(_cluster(int(np.prod(mesh_shape))), tuple(mesh_shape)))


def _chain(mesh_shape=(2,), axis=0):
    """n0 (1 ms) → all-reduce 1e8 B (1 ms) → n1 (2 ms)."""
    return _plan(mesh_shape, [("n0", "fwd", 1 * MS), ("n1", "fwd", 2 * MS)], [("all_reduce", axis, 1e8, "n0", "n1", 0)])


def _close(a, b):
    return a == pytest.approx(b, rel=REL, abs=1e-15)


def test_two_rank_chain_compute_collective_compute():
    plan = _chain()
    assert _close(plan.collectives[0].seconds, 1 * MS)
    r = simulate(plan, cluster=_cluster(2))
    assert _close(r.step_s, 4 * MS)  # 1 + 1 + 2, nothing overlaps
    (c,) = r.classes  # both ranks do the same: simulated once
    assert c.ranks == (0, 1)
    assert _close(c.compute_s, 3 * MS) and _close(c.exposed_comm_s, 1 * MS)
    assert c.hidden_comm_s == 0 and abs(c.idle_s) < 1e-15
    spans = sorted((e.cat, round(e.start_s / MS, 9), round(e.dur_s / MS, 9)) for e in r.events)
    assert spans == [("comm", 1, 1), ("compute", 0, 1), ("compute", 2, 2), ("wait", 1, 1)]


def test_two_rank_pipeline_chain_send_receive():
    """Rank 0 computes n0 (1 ms) and sends 1e8 B (1 ms at 100 GB/s); rank 1 receives, then computes n1 (2 ms)."""
    plan = _plan((2,), [("n0", "fwd", 1 * MS), ("n1", "fwd", 2 * MS)], [])
    sched = parse_schedule("schedule pipe, 1 microbatch\nranks 0: F0[0:1] S0>1\nranks 1: R0<0 F0[1:2]")
    r = simulate(plan, cluster=_cluster(2), schedule=sched, p2p_bytes=1e8)
    assert _close(r.step_s, 4 * MS)
    first, second = r.classes
    assert _close(first.end_s, 2 * MS) and _close(first.compute_s, 1 * MS)
    assert _close(second.compute_s, 2 * MS) and _close(second.idle_s, 2 * MS)  # waited 0..2 ms for the send


def test_one_groups_collectives_run_in_issue_order():
    """Both issued at 1 ms on mesh axis 0's process group, which runs one collective at a time (gloo's queue,
    NCCL's stream): the all-reduce (1 ms) runs 1..2 ms, the all-gather (0.5 ms) 2..2.5 ms. n1 (1 ms) runs
    beside them, n2 (0.5 ms) waits for both: step 3 ms."""
    plan = _plan(
        (2,),
        [("n0", "fwd", 1 * MS), ("n1", "fwd", 1 * MS), ("n2", "fwd", 0.5 * MS)],
        [("all_reduce", 0, 1e8, "n0", "n2", 0), ("all_gather", 0, 1e8, "n0", "n2", 1)],
        "schedule overlapped, 1 microbatch\nranks 0-1: F0[0:1] +0.0 +1.0 F0[1:2] -0.0 -1.0 F0[2:3]",
    )
    assert _close(plan.collectives[0].seconds, 1 * MS) and _close(plan.collectives[1].seconds, 0.5 * MS)
    r = simulate(plan, cluster=_cluster(2))
    comm = {e.name.split()[0]: e for e in r.events if e.cat == "comm"}
    assert _close(comm["all_reduce@axis0"].start_s, 1 * MS) and _close(comm["all_reduce@axis0"].dur_s, 1 * MS)
    assert _close(comm["all_gather@axis0"].start_s, 2 * MS) and _close(comm["all_gather@axis0"].dur_s, 0.5 * MS)
    assert _close(r.step_s, 3 * MS)
    (c,) = r.classes
    assert _close(c.compute_s, 2.5 * MS)
    assert _close(c.hidden_comm_s, 1 * MS) and _close(c.exposed_comm_s, 0.5 * MS)  # comm spans 1..2.5 ms
    assert abs(c.idle_s) < 1e-15


def _busy_cluster(device: str, latency: bool) -> Cluster:
    """Two ranks whose axis-0 all-reduce of 1e8 B is measured at 1 ms alone and 2 ms while computing (busy
    factor 2). Through the origin (`latency` False) the latency part L = 2 t(M) - t(2M) is 0: all link; with
    t(2M) = 1.5 ms (`latency` True) it is L = 0.5 ms of latency and 0.5 ms of link."""
    from meshpilot.cluster.topology import Calibration

    t2 = 1.5 if latency else 2.0
    alone = ((100_000_000, 1 * MS), (200_000_000, t2 * MS))
    busy = ((100_000_000, 2 * MS), (200_000_000, 2 * t2 * MS))
    cal = Calibration(mesh=(2, 1), algbw=(None, None), curve=(alone, None), busy_curve=(busy, None))
    return dataclasses.replace(_cluster(2), device=DEVICES[device], calibration=(cal,))


@pytest.mark.parametrize(
    "beside_ms, device, latency, end_ms",
    [
        (3.0, "cpu", False, 3.0),  # wholly beside n1: 2 x 1 ms, from 1 to 3 ms
        (0.5, "cpu", False, 2.25),  # 0.5 ms beside n1 does a quarter of its work; the rest alone: 1 + 0.5 + 0.75
        (1.5, "cpu", True, 2.75),  # latency 0.5 ms at half speed (to 2 ms), link 0.5 ms busy, then 0.25 ms alone
        (3.0, "a100-80gb", False, 2.0),  # a GPU: no contention, 1 ms
    ],
)
def test_a_collective_beside_compute_runs_slower_by_its_busy_factor_on_cpu(beside_ms, device, latency, end_ms):
    cluster = _busy_cluster(device, latency)
    plan = _plan(
        (2,),
        [("n0", "fwd", 1 * MS), ("n1", "fwd", beside_ms * MS), ("n2", "fwd", 1 * MS)],
        [("all_reduce", 0, 1e8, "n0", "n2", 0)],
        "schedule overlapped, 1 microbatch\nranks 0-1: F0[0:1] +0.0 F0[1:2] -0.0 F0[2:3]",
    )
    (comm,) = [e for e in simulate(plan, cluster=cluster).events if e.cat == "comm"]
    assert _close(comm.start_s, 1 * MS) and _close(comm.start_s + comm.dur_s, end_ms * MS)
    # alone (the blocking chain: nothing computes while it is in flight) it takes its 1 ms on either device
    (alone,) = [e for e in simulate(_chain(), cluster=cluster).events if e.cat == "comm"]
    assert _close(alone.dur_s, 1 * MS)


def test_straggler_delays_the_collective_and_everything_after():
    """Rank 1 computes 50% slower: n0 ends at 1.5 ms there, so the all-reduce runs 1.5..2.5 ms on both ranks;
    n1 then takes 2 ms on rank 0 (ends 4.5) and 3 ms on rank 1 (ends 5.5): step 5.5 ms instead of 4."""
    r = simulate(_chain(), cluster=_cluster(2), straggler={1: 50})
    assert _close(r.step_s, 5.5 * MS)
    fast, slow = r.classes
    assert fast.ranks == (0,) and slow.ranks == (1,)
    assert _close(fast.end_s, 4.5 * MS) and _close(slow.end_s, 5.5 * MS)
    assert _close(fast.compute_s, 3 * MS) and _close(fast.exposed_comm_s, 1 * MS)
    assert _close(fast.idle_s, 1.5 * MS)  # 0.5 ms waiting for rank 1's n0, 1 ms waiting for the step's end
    assert _close(slow.compute_s, 4.5 * MS) and abs(slow.idle_s) < 1e-15


def test_straggler_on_a_2d_mesh_only_holds_back_its_group():
    """Mesh (2, 2), the all-reduce over axis 1 (groups {0, 1} and {2, 3}); rank 0 is 50% slower: rank 1 waits
    for it, ranks 2 and 3 do not. Three classes; simulating every rank alone gives the same numbers."""
    plan = _chain((2, 2), axis=1)
    r = simulate(plan, cluster=_cluster(4), straggler={0: 50})
    assert [c.ranks for c in r.classes] == [(0,), (1,), (2, 3)]
    assert _close(r.step_s, 5.5 * MS)
    end = {c.ranks[0]: c.end_s for c in r.classes}
    assert _close(end[0], 5.5 * MS) and _close(end[1], 4.5 * MS) and _close(end[2], 4 * MS)
    each = simulate(plan, cluster=_cluster(4), straggler={0: 50}, symmetric=False)
    assert {c.ranks[0]: c.end_s for c in each.classes} == {0: end[0], 1: end[1], 2: end[2], 3: end[2]}


def test_rank_classes_of_one_straggler_on_a_2d_mesh():
    sched = accumulate(16, 1)
    assert rank_classes(sched, (4, 4), [0, 1]) == [tuple(range(16))]
    classes = rank_classes(sched, (4, 4), [0, 1], {5: 20})
    assert len(classes) == 4  # itself, its row, its column, the rest
    assert (5,) in classes and (1, 9, 13) in classes and (4, 6, 7) in classes


def test_straggler_spec_and_range_errors():
    assert parse_straggler(["3:50", "0:12.5"]) == {3: 50.0, 0: 12.5}
    for bad in ("3", "x:5", "3:abc", "-1:5", "2:-100"):
        with pytest.raises(UserError, match="RANK:PCT"):
            parse_straggler([bad])
    with pytest.raises(UserError, match="not in the plan's mesh"):
        simulate(_chain(), cluster=_cluster(2), straggler={2: 10})


# ------------------------------------------------------------------------------------------------ a real plan


@pytest.fixture(scope="module")
def tiny_plan():
    import meshpilot
    from meshpilot.cli.plan import build_model

    built = build_model("gpt-tiny", device="meta")
    return meshpilot.plan(built.model, built.inputs, "atp-ic3", num_devices=4).only


def _unbucketed(plan):
    """`plan` without its gradient buckets: one collective per gradient at ``G``, nothing hidden."""
    return dataclasses.replace(plan, grad_buckets=(), time=dataclasses.replace(plan.time, hidden_s=0.0))


def test_trivial_schedule_equals_the_closed_form(tiny_plan):
    """Without buckets nothing overlaps in the trivial step: the serial closed form. (With them: the
    buckets' own tests, ``test_sim_buckets``.)"""
    tiny_plan = _unbucketed(tiny_plan)
    r = simulate(tiny_plan)
    assert r.step_s == pytest.approx(tiny_plan.time.total_s, rel=REL)
    (c,) = r.classes
    assert len(c.ranks) == 4 and c.hidden_comm_s == 0
    assert tiny_plan.time.optimizer_s > 0  # the update runs after G, on the compute stream
    assert c.compute_s == pytest.approx(tiny_plan.time.compute_s + tiny_plan.time.optimizer_s, rel=REL)
    assert [e.dur_s for e in r.events if e.name == "optimizer"] == [pytest.approx(tiny_plan.time.optimizer_s)]
    comm = tiny_plan.time.communication_s + tiny_plan.time.resharding_s
    assert c.exposed_comm_s == pytest.approx(comm, rel=REL)
    # every collective duration is the cost model's, as the plan recorded it
    assert sum(e.dur_s for e in r.events if e.cat == "comm") == pytest.approx(comm, rel=REL)


def test_overlapped_and_accumulated_schedules(tiny_plan):
    tiny_plan = _unbucketed(tiny_plan)
    trivial = simulate(tiny_plan)
    over = simulate(tiny_plan, schedule=overlapped(tiny_plan))
    assert over.step_s <= trivial.step_s * (1 + REL)
    assert over.classes[0].hidden_comm_s > 0
    assert over.classes[0].compute_s == pytest.approx(trivial.classes[0].compute_s, rel=REL)
    # two microbatches: twice the compute and the per-microbatch collectives, the gradients' and the update once
    acc = simulate(tiny_plan, schedule=accumulate(4, 2))
    grads = sum(c.seconds for c in tiny_plan.collectives if c.dst.startswith("grad:"))
    assert acc.step_s == pytest.approx(2 * trivial.step_s - grads - tiny_plan.time.optimizer_s, rel=REL)


def test_a_data_parallel_plans_buckets_priced_as_simulated():
    """A forced data-parallel GPT (no collective in its backward beside a bucket: the loss' token count is
    all-reduced before the first bucket is issued): its planner's buckets run
    behind the backward, and the planner's predicted step (``StepTime.overlapped_s``) is the simulated step;
    with two microbatches ``G`` synchronises them: the closed form of the unbucketed plan, less the
    per-gradient collectives, plus the buckets' span at ``G`` (``bucket_overlap`` with nothing to hide
    behind)."""
    import meshpilot
    from meshpilot.cli.plan import build_model
    from meshpilot.planner.buckets import bucket_overlap, grad_producers
    from meshpilot.planner.forced import data_parallel

    built = build_model("gpt-tiny", device="meta")
    force = data_parallel(built.model, built.inputs, (4, 1))
    plan = meshpilot.plan(built.model, built.inputs, "atp-ic3", mesh_shape=(4, 1), force=force).only
    assert plan.grad_buckets and plan.time.hidden_s > 0
    at = {n.name: i for i, n in enumerate(plan.nodes)}
    first = min(at[grad_producers(plan)[p]] for b in plan.grad_buckets for p in b.params)
    assert all(at[c.dst] < first for c in plan.collectives if c.phase == "bwd" and not c.dst.startswith("grad:"))
    r = simulate(plan)
    assert r.step_s == pytest.approx(plan.time.overlapped_s, rel=REL)
    assert meshpilot.Plan.single(plan).step_s == plan.time.overlapped_s
    acc = simulate(plan, schedule=accumulate(4, 2))
    plain = simulate(_unbucketed(plan), schedule=accumulate(4, 2))
    at_g = bucket_overlap(plan, plan.grad_buckets, _cost_of(plan), in_backward=False).exposed_s
    grads = sum(c.seconds for c in plan.collectives if c.dst.startswith("grad:"))
    assert at_g < grads  # fewer latencies
    assert acc.step_s == pytest.approx(plain.step_s - grads + at_g, rel=REL)


def _cost_of(plan):
    from meshpilot.cluster.cost import CostModel
    from meshpilot.cluster.mesh import LogicalMesh

    return CostModel(
        LogicalMesh(
            load_cluster(plan.cluster), tuple(plan.mesh_shape), np.asarray(plan.mesh_ranks).reshape(plan.mesh_shape)
        )
    )


def test_duplex_overlap_ratio(tiny_plan, tmp_path):
    """Duplex against the same two microbatches without it: the same compute, collectives of one microbatch
    hidden behind the other's compute, an overlap ratio (HiDup Table 4) of hidden ÷ min(compute, comm)."""
    from meshpilot.planner.schedule import duplex
    from meshpilot.sim import overlap_ratio, write_timelines

    assert overlap_ratio(2.0, 1.0, 0.5) == 0.5 and overlap_ratio(1.0, 4.0, 0.25) == 0.25
    assert overlap_ratio(0.0, 1.0, 0.0) == 0.0
    acc = simulate(tiny_plan, schedule=accumulate(4, 2))
    dup = simulate(tiny_plan, schedule=duplex(tiny_plan))
    (a,), (d,) = acc.classes, dup.classes
    assert a.overlap_ratio == 0 and a.hidden_comm_s == 0
    assert d.compute_s == pytest.approx(a.compute_s, rel=REL)
    assert d.hidden_comm_s > 0 and 0 < d.overlap_ratio <= 1
    assert d.overlap_ratio == pytest.approx(d.hidden_comm_s / min(d.compute_s, d.comm_s))
    assert dup.step_s < acc.step_s
    write_timelines([dup, acc], tmp_path / "both.png")
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"


def test_trace_and_png(tiny_plan, tmp_path):
    r = simulate(tiny_plan, straggler={1: 30})
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    r.write_trace(trace)
    r.write_png(png)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {c.ranks[0] for c in r.classes} and len(r.classes) > 1
    assert all(e["dur"] >= 0 and isinstance(e["tid"], int) for e in spans)
    assert {e["cat"] for e in spans} >= {"compute", "comm"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.png"]  # no temporaries left


def test_cli_simulate(tiny_plan, tmp_path, capsys):
    from meshpilot.cli.main import main

    path = tmp_path / "plan.json"
    tiny_plan.save(path)
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", str(path), "--trace", str(trace), "--png", str(png), "--straggler", "1:50"]) == 0
    out = capsys.readouterr().out
    for word in ("compute", "exposed", "hidden", "idle", "closed form"):
        assert word in out, word
    assert trace.is_file() and png.is_file()
    for args, needle in (
        ([str(path), "--straggler", "one:50"], "RANK:PCT"),
        ([str(path), "--straggler", "9:50"], "not in the plan's mesh"),
        ([str(tmp_path / "missing.json")], "does not exist"),
    ):
        assert main(["simulate", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("meshpilot simulate: error: ") and needle in err, err


def test_plan_command_shows_the_simulated_step(capsys):
    from meshpilot.cli.main import main

    assert (
        main(["plan", "--model", "mlp", "--cluster", "atp-ic3", "--devices", "2", "--ops", "none", "--stages", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "simulated" in out and "trivial schedule" in out


def test_a_collective_one_member_never_issues_is_a_deadlock():
    plan = _chain()
    sched = parse_schedule("schedule broken, 1 microbatch\nranks 0: F0[0:1] +0.0 -0.0\nranks 1: F0[0:1]")
    with pytest.raises(UserError, match="deadlocks: rank 0 waits forever"):
        simulate(plan, cluster=_cluster(2), schedule=sched)
