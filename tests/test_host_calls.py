"""The host's calls as a cost-model term (issue 30 item 5, ``planner.accounting``, *Host time per runtime call*):
the count of calls a step makes derived from the plan equals the runtime's as the torch profiler sees it, the
probe measures a call's host seconds and the foreach AdamW step's rates, and the accounting prices them (on a
CPU added to the compute, on an accelerator each phase the larger of host and device).

The profiled step runs in this process with a one-rank gloo group (nothing is spawned).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from dist_utils import tiny_gpt


def _top_level_aten_calls(fn) -> int:
    """ATen calls `fn` makes from Python: profiler events named ``aten::*`` with no ``aten::`` event above them
    (what an op calls inside is part of its call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    count = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        count += p is None
    return count


def test_the_calls_derived_from_the_plan_are_the_runtime_s_within_10_percent(group):
    import meshpilot
    from meshpilot.graph.capture import capture
    from meshpilot.planner.accounting import runtime_calls
    from meshpilot.runtime.spmd import parallelize
    from meshpilot.runtime.train import adamw

    model, inputs = tiny_gpt()
    graph = capture(model, inputs)
    plan = meshpilot.plan(model, inputs, "dgx-h100", num_devices=1).only
    pm = parallelize(model, plan)
    opt = adamw(pm.parameters(), lr=1e-4)
    for _ in range(2):  # the first step records the programs
        pm(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = []
    fwd = _top_level_aten_calls(lambda: out.append(pm(*inputs)))
    bwd = _top_level_aten_calls(lambda: out[0].backward())
    upd = _top_level_aten_calls(lambda: (opt.step(), opt.zero_grad(set_to_none=True)))
    want = runtime_calls(graph, plan.collectives, buckets=plan.grad_buckets)
    assert want.forward > 50 and want.backward > want.forward  # the graph's op nodes, views included
    assert want.total == pytest.approx(fwd + bwd + upd, rel=0.10), (want, fwd, bwd, upd)
    assert want.optimizer == pytest.approx(upd, rel=0.10)


def test_the_probe_measures_a_call_and_the_adamw_step():
    from meshpilot.cluster import probe

    gm, _ = probe.tiny_joint_program()
    calls = probe.program_calls(gm)
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert calls > 30 and "aten.native_layer_norm_backward.default" in ops and "aten.view.default" in ops

    def timed(action, target_s=0.005):  # the least of 5 runs: one run on a loaded box can be preempted
        action()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            action()
            runs.append(time.perf_counter() - t0)
        return min(runs)

    c = probe.call_overhead(torch.device("cpu"), timed)
    assert 1e-7 < c < 1e-2  # seconds a call: µs here, ms under heavy load; a unit slip is off by 1e3 or more
    bw, each = probe.adamw_rates(torch.device("cpu"), timed, 4 * 2**20)
    assert 1e7 < bw < 1e12 and 1e-7 < each < 1e-2


def test_the_probe_s_reduction_and_the_cluster_file_carry_the_new_rates():
    from meshpilot.cluster import probe
    from meshpilot.cluster.loader import cluster_from_dict, cluster_to_toml

    base = {"float32": 5e10, "memory_bandwidth": 1e10, "memory_bytes": 2**34, "matmul": [], "host_memory": True}
    devs = [
        base | {"call_overhead": c, "adamw_bandwidth": bw, "adamw_overhead": a}
        for c, bw, a in ((8e-6, 1e9, 20e-6), (9e-6, 2e9, 30e-6), (30e-6, 3e9, 90e-6))
    ]
    d = probe.device_profile(devs, ["h"] * 3, probe.ProbeOptions(), "probed-cpu")
    assert (d.call_overhead, d.adamw_bandwidth, d.adamw_overhead) == (
        pytest.approx(9e-6),
        pytest.approx(2e9),
        pytest.approx(30e-6),
    )
    spec = {
        "name": "t",
        "device_profile": {
            "kind": "probed-cpu",
            "peak_tflops_fp32": 0.05,
            "memory_GBps": 10.0,
            "memory_GiB": 8.0,
            "call_overhead_us": 9.0,
            "adamw_GBps": 2.0,
            "adamw_overhead_us": 30.0,
        },
        "layers": [{"name": "rank", "ranks": 4, "p2p_GBps": 1.0, "group_GBps": 1.0, "latency_us": 10.0}],
    }
    cl = cluster_from_dict(spec, "t")
    assert (cl.device.call_overhead, cl.device.adamw_bandwidth) == (pytest.approx(9e-6), pytest.approx(2e9))
    text = cluster_to_toml(cl)
    assert "call_overhead_us = 9" in text and "adamw_GBps = 2" in text and "adamw_overhead_us = 30" in text


@pytest.fixture(scope="module")
def dp_plan():
    import meshpilot
    from meshpilot.graph.capture import capture
    from meshpilot.planner import forced

    model, inputs = tiny_gpt()
    graph = capture(model, inputs)
    force = forced.data_parallel(model, inputs, (4,))
    return meshpilot.plan(model, inputs, "atp-ic3", num_devices=4, mesh_shape=(4,), force=force).only, graph


def _on(kind: str, **device):
    from meshpilot.cluster import load_cluster

    cl = load_cluster("atp-ic3")
    return dataclasses.replace(cl, device=dataclasses.replace(cl.device, kind=kind, **device))


def test_the_host_s_calls_add_to_a_cpu_s_compute_and_overlap_an_accelerator_s(dp_plan):
    from meshpilot.planner.accounting import reprice, runtime_calls

    plan, graph = dp_plan

    c = 20e-6
    calls = runtime_calls(graph, plan.collectives)
    bare = reprice(plan, graph, _on("probed-cpu", op_overhead=3e-6)).time
    cpu = reprice(plan, graph, _on("probed-cpu", op_overhead=3e-6, call_overhead=c)).time
    kernels = sum(1 for n in plan.nodes if n.seconds > 0)  # the op_overhead each kernel paid, dropped for c
    assert cpu.compute_s == pytest.approx(bare.compute_s - kernels * 3e-6 + c * (calls.forward + calls.backward))
    assert cpu.optimizer_s == bare.optimizer_s and cpu.communication_s == bare.communication_s
    gpu = reprice(plan, graph, _on("gpu-like", call_overhead=c)).time
    plain = reprice(plan, graph, _on("gpu-like")).time
    assert plain.compute_s < gpu.compute_s <= plain.compute_s + c * (calls.forward + calls.backward)
    assert gpu.compute_s >= c * (calls.forward + calls.backward)  # each phase the larger of its two parts


def test_the_optimizer_is_priced_at_the_measured_adamw_rate(dp_plan):
    from meshpilot.planner.accounting import optimizer_seconds, reprice

    plan, graph = dp_plan
    dev = _on("probed-cpu", adamw_bandwidth=1e9, adamw_overhead=50e-6).device
    info = next(n.out for n in graph.nodes if n.kind == "param")
    assert optimizer_seconds(info, 2, dev) == pytest.approx(info.nbytes / 2 / 1e9 + 50e-6)
    t = reprice(plan, graph, _on("probed-cpu", adamw_bandwidth=1e9, adamw_overhead=50e-6)).time
    params = [n for n in graph.nodes if n.kind == "param" and graph.grads.get(n.fqn) is not None]
    assert t.optimizer_s == pytest.approx(sum(p.out.nbytes / 1e9 + 50e-6 for p in params))
