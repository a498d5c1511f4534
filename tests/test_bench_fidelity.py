"""The logic of benchmarks/bench_fidelity.py that its numbers rest on (no emulation, nothing timed):
the statistics, re-pricing a fixed plan on another cluster."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_fidelity as bf  # noqa: E402

from meshpilot.cluster import load_cluster  # noqa: E402

SLOW = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "emulated-2x4-slow.toml"


def test_statistics():
    meas = [1.0, 2.0, 3.0, 4.0]
    assert bf.spearman([10, 20, 30, 40], meas) == pytest.approx(1.0)
    assert bf.spearman([4, 3, 2, 1], meas) == pytest.approx(-1.0)
    # one swapped pair of four: 1 - 6 * 2 / (4 * 15)
    assert bf.spearman([1, 3, 2, 4], meas) == pytest.approx(0.8)
    assert bf.relative_errors([0.5, 2.0, 6.0, 4.0], meas) == pytest.approx([0.5, 0.0, 1.0, 0.0])
    f = bf.fidelity([0.5, 2.0, 6.0, 4.0], meas)
    assert f["median_rel_error"] == pytest.approx(0.25) and f["error_ok"]
    assert f["median_ratio"] == pytest.approx(1.0)
    assert f["spearman"] == pytest.approx(0.8) and not f["spearman_ok"]
    with pytest.raises(ValueError):
        bf.spearman([1.0], [1.0])


@pytest.fixture(scope="module")
def tiny_plans(tmp_path_factory):
    cfg = {"vocab": 64, "seq": 16, "layers": 1, "hidden": 32, "heads": 8, "batch": 8}
    specs = [bf.PlanSpec("solver", "solver", None), bf.PlanSpec("megatron-2x4", "Megatron TP", (2, 4))]
    return bf.make_plans(specs, cfg, load_cluster(str(SLOW)), tmp_path_factory.mktemp("plans"), log=lambda _: None)


def test_reprice(tiny_plans):
    graph, plans = tiny_plans["graph"], tiny_plans["plans"]
    cluster = load_cluster(str(SLOW))
    for p, _ in plans.values():
        same = bf.reprice(p, graph, cluster)
        assert same.time.total_s == pytest.approx(p.time.total_s, rel=1e-12)
        assert [n.seconds for n in same.nodes] == pytest.approx([n.seconds for n in p.nodes], rel=1e-12)
        # a device twice as fast and links twice as wide halve every price; layouts stay as they were
        faster = dataclasses.replace(
            cluster,
            device=dataclasses.replace(
                cluster.device,
                peak_flops={k: 2 * v for k, v in cluster.device.peak_flops.items()},
                memory_bandwidth=2 * cluster.device.memory_bandwidth,
            ),
            layers=tuple(
                dataclasses.replace(lay, p2p=lay.p2p * 2, group_bw=lay.group_bw * 2, latency=lay.latency / 2)
                for lay in cluster.layers
            ),
        )
        q = bf.reprice(p, graph, faster)
        assert q.time.compute_s == pytest.approx(p.time.compute_s / 2, rel=1e-9)
        assert q.time.communication_s + q.time.resharding_s == pytest.approx(
            (p.time.communication_s + p.time.resharding_s) / 2, rel=1e-9
        )
        assert [n.ins for n in q.nodes] == [n.ins for n in p.nodes]
        what = [(c.kind, c.axis, c.nbytes) for c in p.collectives]
        assert [(c.kind, c.axis, c.nbytes) for c in q.collectives] == what
