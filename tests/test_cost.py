"""The collective and roofline cost model."""

from __future__ import annotations

import math

import pytest

from meshpilot.cluster import GB, CostModel, LogicalMesh, load_cluster


def test_all_reduce_matches_eq4_without_latency():
    m = LogicalMesh(load_cluster("atp-fig7a"), (8, 2))
    cm = CostModel(m)
    nbytes = 1e9
    # bandwidth term of Rabenseifner: M / B with B = Eq. 4; latency adds a little on top
    t = cm.all_reduce(nbytes, 0)
    assert t == pytest.approx(nbytes / m.algorithm_bandwidth(0), rel=1e-3)
    assert t > nbytes / m.algorithm_bandwidth(0)


def test_collective_relations():
    cm = CostModel(LogicalMesh(load_cluster("atp-ic4"), (2, 8)))
    m = 256e6
    for axis in (0, 1):
        ar, ag, rs = cm.all_reduce(m, axis), cm.all_gather(m, axis), cm.reduce_scatter(m, axis)
        assert ag == rs
        assert ar == pytest.approx(2 * ag, rel=0.05)  # all-reduce = reduce-scatter + all-gather
        assert cm.all_to_all(m, axis) > 0 and cm.broadcast(m, axis) > 0 and cm.send_recv(m, axis) > 0
    assert cm.all_reduce(m, 0) > cm.all_reduce(m, 1)  # axis 0 crosses the 25 GB/s IB link
    assert cm.all_reduce(m, (0, 1)) >= cm.all_reduce(m, 1)


def test_all_to_all_counts_every_member_crossing_the_node_link():
    """An all-to-all of all 8 ranks of 2 nodes x 4: each of a node's 4 ranks sends 4 of its 8 slices to the
    other node, 2 M through the node's link at once (a ring puts (7/8) M through it); with 4 groups of one
    rank per node (mesh 4x2 row-mapped: axis 0), each group sends M/2 out of each node, 4 groups together
    the same 2 M."""
    c = load_cluster("hidup-2x4-10g")
    link = float(c.layers[0].group_bw[0])
    m = 3 * 2**20
    whole = CostModel(LogicalMesh(c, (1, 8))).all_to_all(m, 1)
    assert whole == pytest.approx(2 * m / link + 7 * c.layers[0].latency, rel=1e-6)
    across = CostModel(LogicalMesh(c, (2, 4))).all_to_all(m, 0)  # 4 groups of 2, one rank per node each
    assert across == pytest.approx(2 * m / link + c.layers[0].latency, rel=1e-6)
    inside = CostModel(LogicalMesh(c, (2, 4))).all_to_all(m, 1)  # never leaves a node: the formula as before
    mesh = LogicalMesh(c, (2, 4))
    assert inside == pytest.approx(3 / 4 * m / mesh.bus_bandwidth(1) + 3 * mesh.latency(1), rel=1e-9)


def test_small_messages_pay_latency_and_size_one_axes_are_free():
    cm = CostModel(LogicalMesh(load_cluster("atp-ic4"), (16, 1)))
    assert cm.all_reduce(1e9, 1) == 0.0 and cm.all_gather(1e9, 1) == 0.0
    tiny = cm.all_reduce(8, 0)
    assert tiny >= 5e-6  # at least one inter-node latency
    assert cm.all_reduce(0, 0) == 0.0


def test_send_recv_between_ranks_uses_highest_differing_layer():
    cm = CostModel(LogicalMesh(load_cluster("atp-ic4"), (16, 1)))
    inside = cm.send_recv_ranks(1e9, 0, 1)
    across = cm.send_recv_ranks(1e9, 0, 8)
    assert inside == pytest.approx(2e-6 + 1e9 / (600 * GB))
    assert across == pytest.approx(5e-6 + 1e9 / (25 * GB))


def test_roofline():
    cm = CostModel(LogicalMesh(load_cluster("atp-ic3"), (8, 1)))
    dev = cm.device
    # compute-bound: a big matmul
    f = 2 * 8192**3
    assert cm.compute(f, 3 * 8192**2 * 2, "bfloat16") == pytest.approx(f / (312e12 * dev.compute_efficiency))
    # memory-bound: an elementwise op
    b = 4e9
    assert cm.compute(1e9, b, "float32") == pytest.approx(b / (dev.memory_bandwidth * dev.memory_efficiency))
    assert cm.compute(f, 0, "float32") > cm.compute(f, 0, "bfloat16")


def _host_cpu_cluster(overhead_us: float):
    """The bench's 4 gloo ranks on loopback (125 us a ring step, 0.25 GB/s) with a host cost per collective."""
    from meshpilot.cluster.loader import cluster_from_dict

    profile = {"kind": "probed-cpu", "peak_tflops_fp32": 0.05, "memory_GBps": 10.0, "memory_GiB": 4.0}
    layer = {"name": "rank", "ranks": 4, "p2p_GBps": 0.25, "group_GBps": 0.25, "latency_us": 125.0}
    doc = {"device_profile": profile | {"collective_overhead_us": overhead_us}, "layers": [layer]}
    return cluster_from_dict(doc, "t")


def test_host_cost_per_collective_is_added_to_every_collective_that_runs():
    bare = CostModel(LogicalMesh(_host_cpu_cluster(0.0), (4, 1)))
    host = CostModel(LogicalMesh(_host_cpu_cluster(1500.0), (4, 1)))
    assert host.device.collective_overhead == pytest.approx(1.5e-3)
    for m in (4.0, 2**20):
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
            assert getattr(host, kind)(m, 0) == pytest.approx(getattr(bare, kind)(m, 0) + 1.5e-3), kind
        assert host.send_recv(m, 0) == bare.send_recv(m, 0)  # point-to-point: not a collective here
    # a collective that does not run (axis of one rank, no bytes) costs nothing
    assert host.all_reduce(2**20, 1) == host.all_reduce(0, 0) == host.all_gather(0, 0) == 0.0


def test_the_bucket_rule_sees_the_host_cost_and_gpu_presets_keep_their_buckets():
    """With 1.5 ms of host CPU a collective (what gloo cost on the 2-core box, docs/benchmarks.md) the latency a
    bucket must amortise is 1.5 ms + the wire's, so the buckets grow >= 5x; a GPU preset has no host cost
    (0: not measured) and its bucket is the alpha-beta one, n * alpha * B' * (1 - f) / f."""
    from meshpilot.planner.buckets import LATENCY_SHARE, MIN_BUCKET, bucket_bytes

    bare = bucket_bytes(CostModel(LogicalMesh(_host_cpu_cluster(0.0), (4,))), 0)
    host = bucket_bytes(CostModel(LogicalMesh(_host_cpu_cluster(1500.0), (4,))), 0)
    assert bare > MIN_BUCKET and host >= 5 * bare
    cm = CostModel(LogicalMesh(load_cluster("atp-ic3"), (4, 2)))
    assert cm.device.collective_overhead == 0.0
    for axis in (0, 1):
        n, bw, a = cm._axis(axis)
        size = bucket_bytes(cm, axis)
        assert cm.all_reduce(1, axis) == _alpha_beta(1, n, bw, a)
        assert cm.all_reduce(size, axis) == _alpha_beta(size, n, bw, a)
        latency = _alpha_beta(1, n, bw, a)
        assert size > MIN_BUCKET and latency <= LATENCY_SHARE * _alpha_beta(size, n, bw, a) <= latency * 1.01


def _alpha_beta(m: float, n: int, bw: float, a: float) -> float:
    """An all-reduce of `m` bytes by the module docstring's three algorithms, no host term."""
    ring, log = 2 * (n - 1) / n * m / bw, math.ceil(math.log2(n))
    return min(ring + 2 * (n - 1) * a, ring + 2 * log * a, log * (a + m / bw))


def _bench_gpt_dp(kind: str, overhead_us: float):
    """``bench_vs_torch``'s GPT (the zoo's, 4 layers, h 256, batch 8 x 128, on meta), its data-parallel plan on
    the bench's 4 loopback ranks with `overhead_us` of host cost a collective, on a device of `kind`."""
    from meshpilot.cluster.loader import cluster_from_dict
    from meshpilot.graph.capture import capture
    from meshpilot.models.sources import build_model
    from meshpilot.planner import forced
    from meshpilot.planner.auto import plan

    built = build_model("gpt-tiny", device="meta", seed=0, layers=4, hidden=256, heads=8, batch=8, seq=128)
    graph = capture(built.model, built.inputs)
    profile = {"kind": kind, "peak_tflops_fp32": 0.068, "memory_GBps": 10.0, "memory_GiB": 16.0}
    layer = {"name": "rank", "ranks": 4, "p2p_GBps": 0.25, "group_GBps": 0.25, "latency_us": 125.0}
    doc = {"device_profile": profile | {"collective_overhead_us": overhead_us}, "layers": [layer]}
    cluster = cluster_from_dict(doc, "t")
    force = forced.data_parallel(built.model, built.inputs, (4,))
    p = plan(built.model, built.inputs, cluster, mesh_shape=(4,), force=force, graph=graph)
    return p, graph, CostModel(LogicalMesh(cluster, (4,)))


def test_on_a_cpu_with_a_host_cost_the_buckets_are_the_size_the_step_waits_least_for():
    """With 1 ms of host cost a collective on a CPU device the compute stream pays it (K buckets: K ms nothing
    hides), so the planner prices every candidate size (``planner.buckets.candidate_sizes``) and keeps the one
    whose buckets the step waits for least: here 13 buckets (28.2 ms exposed), fewer waits than the latency
    rule's 7 (29.7 ms) and far fewer than 25 MiB's 1 (78.9 ms: the last bucket after the backward). Without a
    host cost, or where it stays latency (not a CPU), the latency rule decides as before."""
    from meshpilot.planner.buckets import bucket_bytes, bucket_overlap, candidate_sizes, plan_buckets

    p, graph, cost = _bench_gpt_dp("probed-cpu", 1000.0)
    waited = {
        m: bucket_overlap(p, plan_buckets(graph, p, cost, m), cost, True).exposed_s for m in candidate_sizes(cost, {0})
    }
    chosen = bucket_overlap(p, p.grad_buckets, cost, True).exposed_s
    rule = bucket_bytes(cost, 0)
    assert chosen == pytest.approx(min(waited.values())) and chosen < waited[rule] * 0.99
    assert len(p.grad_buckets) != len(plan_buckets(graph, p, cost, rule))
    for kind, us in (("probed-cpu", 0.0), ("local-gpu", 1000.0)):
        p, graph, cost = _bench_gpt_dp(kind, us)
        assert p.grad_buckets == plan_buckets(graph, p, cost, bucket_bytes(cost, 0)), kind


LOOPBACK_4x1 = {
    "mesh": [4, 1],
    "B1_GBps": 0.409,
    "alpha1_us": 300.1,
    "curve1": [[4, 600.2], [64, 2575.0], [1024, 7512.0], [16384, 7485.0], [131072, 6526.0], [1048576, 7314.0],
               [4194304, 12560.0]],
    "busy1": [[1024, 47170.0], [16384, 63680.0], [131072, 78900.0], [1048576, 60010.0], [4194304, 88520.0]],
}  # fmt: skip
"""The world group's all-reduce that ``bench_vs_torch.measure_loopback`` measured on 4 gloo ranks of the 2-core
AMD EPYC box at load ~10 (2026-12-03 04:15 UTC; host CPU 918 µs a collective): alone 7.3 ms at 1 MiB, beside
back-to-back matmuls 60 ms."""


def test_a_measured_busy_curve_makes_the_loopback_gpt_s_buckets_ddp_sized():
    """On 4 gloo ranks sharing 2 cores a bucket issued during the backward runs beside it several times slower
    than alone, so small buckets hide little and each costs its host CPU: planned with the measured busy curve
    (``LOOPBACK_4x1``) the bench's GPT takes at most 2 buckets, as DDP issues (its 1 MiB first bucket and the
    rest); planned with the host cost alone (the same 918 µs, the nominal alpha-beta link) it keeps 13, the
    count that made its data-parallel step 1.16-1.22x DDP's CPU (docs/benchmarks.md, issue 30)."""
    from meshpilot.cluster.loader import cluster_from_dict
    from meshpilot.graph.capture import capture
    from meshpilot.models.sources import build_model
    from meshpilot.planner import forced
    from meshpilot.planner.auto import plan

    built = build_model("gpt-tiny", device="meta", seed=0, layers=4, hidden=256, heads=8, batch=8, seq=128)
    graph = capture(built.model, built.inputs)
    profile = {"kind": "local-cpu", "peak_tflops_fp32": 0.03, "memory_GBps": 10.0, "memory_GiB": 16.0}
    layer = {"name": "rank", "ranks": 4, "p2p_GBps": 0.25, "group_GBps": 0.25, "latency_us": 125.0}
    doc = {"device_profile": profile | {"collective_overhead_us": 918.0}, "layers": [layer]}
    force = forced.data_parallel(built.model, built.inputs, (4,))
    counts = {}
    for name, extra in (("host cost alone", {}), ("measured curves", {"calibration": [LOOPBACK_4x1]})):
        cluster = cluster_from_dict(doc | extra, "t")
        p = plan(built.model, built.inputs, cluster, mesh_shape=(4,), force=force, graph=graph)
        counts[name] = len(p.grad_buckets)
    assert counts["measured curves"] <= 2 < 13 == counts["host cost alone"], counts


def test_every_kind_with_the_word_cpu_is_a_cpu_device_and_prices_as_gloo_runs():
    """``DeviceProfile.is_cpu`` is one rule: the kind has the word ``cpu``. The benchmarks' loopback cluster
    (kind ``local-cpu``) was not one, so its reduce-scatter was priced as a ring's half and its host cost as
    latency, where gloo all-reduces and the call runs on the compute cores (issue 30)."""
    from dataclasses import replace

    from meshpilot.cluster.devices import device_profile

    local = replace(_host_cpu_cluster(1000.0).device, kind="local-cpu")
    assert local.is_cpu and device_profile("cpu").is_cpu and _host_cpu_cluster(0.0).device.is_cpu
    assert not any(device_profile(k).is_cpu for k in ("h100", "a100-80gb", "v100-16gb"))
    assert not replace(local, kind="probed-nvidia-h200").is_cpu
    cluster = _host_cpu_cluster(1000.0)
    cm = CostModel(LogicalMesh(replace(cluster, device=local), (4,)))
    assert cm.reduce_scatter(2**20, 0) == cm.all_reduce(2**20, 0)
    assert cm.compute_host_s(cm.all_reduce(2**20, 0)) == pytest.approx(1e-3)


def test_a_coalesced_collective_costs_its_share_of_a_bucket():
    """``CostModel.coalesced``: `M` bytes issued inside a collective of `S` bytes cost ``t(S) M / S``; a tensor of
    `S` bytes or more is its own collective, ``t(M)``."""
    cm = CostModel(LogicalMesh(_host_cpu_cluster(1000.0), (4,)))
    s = 2**20
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        t = getattr(cm, kind)
        assert cm.coalesced(kind, s // 4, 0, s) == pytest.approx(t(s, 0) / 4)
        assert cm.coalesced(kind, 4 * s, 0, s) == pytest.approx(t(4 * s, 0))
        assert cm.coalesced(kind, 4 * s, 0, s) < t(s // 4, 0) * 16  # 16 calls pay 16 fixed costs
    assert cm.coalesced("all_reduce", 0, 0, s) == 0.0
