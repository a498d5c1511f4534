"""`meshpilot probe`: the hierarchy from synthetic measurements, the [device_profile] table, and real
4-process gloo runs (torchrun end to end; two fake nodes in-process)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

from meshpilot.cluster import DEVICES, GB, LogicalMesh, cluster_from_dict, load_cluster_file, preset_cluster
from meshpilot.cluster.devices import DeviceProfile
from meshpilot.cluster.loader import cluster_to_toml
from meshpilot.cluster.probe import (
    Measurements,
    ProbeOptions,
    _busy_curve,
    _curve,
    build_cluster,
    busy_sizes,
    curve_sizes,
    node_layout,
    round_robin,
    summarize,
    two_layer,
    write_cluster_toml,
)
from meshpilot.errors import ClusterFileError

REPO = Path(__file__).resolve().parents[1]
DEV = DeviceProfile("probed-test", {"float32": 2e12, "bfloat16": 8e12}, 500 * GB, 16 * 2**30, 1.0, 1.0)


def _measurements(hosts, p2p, lat=None, fanout=None, node_bw=None, allreduce=None) -> Measurements:
    w = len(hosts)
    p2p = np.array(p2p, dtype=float)
    np.fill_diagonal(p2p, np.nan)
    lat = np.full((w, w), 10e-6) if lat is None else np.array(lat, dtype=float)
    fanout = np.full(w, np.nan) if fanout is None else np.array(fanout, dtype=float)
    return Measurements("gloo", list(hosts), 1 << 20, p2p, lat, fanout, node_bw, allreduce or {}, DEV)


# ---------------------------------------------------------------------------------------------------
# Pure parts


@pytest.mark.parametrize("n", range(1, 10))
def test_round_robin_pairs_every_rank_pair_once_and_each_rank_once_per_round(n):
    rounds = round_robin(n)
    seen = [p for r in rounds for p in r]
    assert sorted(seen) == [(a, b) for a in range(n) for b in range(a + 1, n)]
    for r in rounds:
        members = [x for p in r for x in p]
        assert len(members) == len(set(members))
    assert len(rounds) == (0 if n < 2 else n - 1 + n % 2)


def test_node_layout_and_two_layer():
    assert node_layout(["a", "a", "b", "b"]) == [[0, 1], [2, 3]]
    assert two_layer([[0, 1], [2, 3]])
    assert not two_layer([[0, 1, 2, 3]])  # one node
    assert not two_layer([[0, 2], [1, 3]])  # interleaved ranks
    assert not two_layer([[0, 1, 2], [3]])  # unequal nodes
    assert not two_layer([[0], [1]])  # one rank per node


def test_single_node_flat_layer_symmetrises_fills_and_uses_fanout():
    g = GB
    p2p = [[0, 10 * g, 20 * g, np.nan], [30 * g, 0, 10 * g, 10 * g], [20 * g, 10 * g, 0, 10 * g], [np.nan] * 4]
    lat = np.full((4, 4), 20e-6)
    lat[0, 1] = lat[1, 0] = 10e-6
    m = _measurements(["h"] * 4, p2p, lat=lat, fanout=[25 * g, np.nan, 30 * g, 40 * g])
    (layer,) = build_cluster(m).layers
    assert layer.name == "device" and layer.ranks == 4
    assert layer.p2p[0, 1] == layer.p2p[1, 0] == 20 * g  # mean of 10 and 30
    assert layer.p2p[1, 3] == layer.p2p[3, 1] == 10 * g  # one direction stands for both
    assert layer.p2p[0, 3] == 10 * g  # never measured: median of the measured entries
    assert np.all(np.diag(layer.p2p) == 0)
    assert layer.group_bw.tolist() == [25 * g, 20 * g, 30 * g, 40 * g]  # rank 1: its best P2P entry
    assert layer.latency == pytest.approx(20e-6)


def test_two_nodes_make_node_and_device_layers():
    g = GB
    hosts = ["a", "a", "b", "b", "c", "c"]
    p2p = np.full((6, 6), 5 * g)  # one rank pair across nodes: 5 GB/s
    for n in range(3):
        p2p[2 * n, 2 * n + 1] = p2p[2 * n + 1, 2 * n] = (100 + n) * g  # inside a node: ~100 GB/s
    lat = np.full((6, 6), 8e-6)
    for n in range(3):
        lat[2 * n, 2 * n + 1] = lat[2 * n + 1, 2 * n] = 2e-6
    node_bw = np.full((3, 3), 9 * g)
    node_bw[0, 2] = node_bw[2, 0] = np.nan  # a node pair the probe did not measure
    node_bw[1, 2] = 11 * g  # asymmetric: the mean of 11 and 9
    m = _measurements(hosts, p2p, lat=lat, fanout=[90 * g, 80 * g] * 3, node_bw=node_bw)
    cluster = build_cluster(m)
    node, device = cluster.layers
    assert (node.name, node.ranks, device.name, device.ranks) == ("node", 3, "device", 2)
    assert device.p2p[0, 1] == 101 * g  # median over the three nodes
    assert device.group_bw.tolist() == [90 * g, 80 * g]
    assert device.latency == pytest.approx(2e-6) and node.latency == pytest.approx(8e-6)
    assert node.p2p[0, 1] == 9 * g and node.p2p[1, 2] == 10 * g
    assert node.p2p[0, 2] == 5 * g  # falls back to the single rank-pair bandwidth
    assert node.group_bw.tolist() == [9 * g, 10 * g, 10 * g]  # each node's largest entry
    assert cluster.num_devices == 6 and cluster.p2p_bandwidth(0, 1) == 80 * g  # capped by the group bandwidths


def test_pairs_the_budget_skipped_are_estimated(tmp_path):
    p2p = np.full((4, 4), np.nan)
    p2p[0, 2] = p2p[1, 3] = 4 * GB  # only the first round ran: pairs across the two nodes
    m = _measurements(["a", "a", "b", "b"], p2p, lat=np.full((4, 4), np.nan))
    node, device = build_cluster(m).layers
    assert device.p2p[0, 1] == 4 * GB and node.p2p[0, 1] == 4 * GB  # median of what was measured
    assert device.latency == 0.0
    assert load_cluster_file(write_cluster_toml(build_cluster(m), tmp_path / "c.toml")).num_devices == 4


def test_irregular_or_one_rank_per_node_stay_flat():
    p2p = np.full((3, 3), GB)
    assert [layer.name for layer in build_cluster(_measurements(["a", "a", "b"], p2p)).layers] == ["device"]
    assert [layer.name for layer in build_cluster(_measurements(["a", "b", "c"], p2p)).layers] == ["node"]
    solo = build_cluster(_measurements(["a"], np.zeros((1, 1))))
    assert solo.num_devices == 1 and solo.layers[0].group_bw[0] == DEV.memory_bandwidth


def test_calibration_overrides_eq4_and_the_file_round_trips(tmp_path):
    m = _measurements(
        ["h"] * 4, np.full((4, 4), 10 * GB), allreduce={(4, 1): (3e9, None), (2, 2): (4e9, 5e9), (1, 4): (None, 2e9)}
    )
    cluster = build_cluster(m, name="rt")
    assert LogicalMesh(cluster, (2, 2)).algorithm_bandwidth(1) == 5e9
    assert LogicalMesh(build_cluster(m, calibrate=False), (2, 2)).algorithm_bandwidth(1) == 10e9  # Eq. 4, d = 2
    path = write_cluster_toml(cluster, tmp_path / "c.toml", comment="test")
    back = load_cluster_file(path)
    assert back.device == DEV
    assert [(c.mesh, c.algbw) for c in back.calibration] == [(c.mesh, c.algbw) for c in cluster.calibration]
    for a, b in zip(back.layers, cluster.layers):
        assert (a.name, a.ranks, a.latency) == (b.name, b.ranks, b.latency)
        assert np.array_equal(a.p2p, b.p2p) and np.array_equal(a.group_bw, b.group_bw)
    assert [p.name for p in tmp_path.iterdir()] == ["c.toml"]


def test_calibrated_latency_prices_the_axis_it_was_measured_on_and_round_trips(tmp_path):
    """A 4-byte all-reduce's alpha overrides the layers' latency on exactly the rank groups it was measured on
    (row-mapped (2, 2): axis 1 = {0, 1}, {2, 3}); it survives the TOML round trip; the other axis keeps the
    layer latency; the cost model's small all-reduce on that axis then takes the measured time."""
    from meshpilot.cluster.cost import CostModel

    m = _measurements(["h"] * 4, np.full((4, 4), 10 * GB), allreduce={(2, 2): (4e9, 5e9)})
    m.allreduce_latency = {(2, 2): (None, 300e-6)}
    cluster = build_cluster(m, name="lat")
    mesh = LogicalMesh(cluster, (2, 2))
    assert mesh.latency(1) == pytest.approx(300e-6)
    assert mesh.latency(0) == pytest.approx(10e-6)  # the layer's
    assert CostModel(mesh).all_reduce(4, 1) == pytest.approx(300e-6, rel=1e-3)
    back = load_cluster_file(write_cluster_toml(cluster, tmp_path / "c.toml"))
    assert LogicalMesh(back, (2, 2)).latency(1) == pytest.approx(300e-6)
    assert [c.latency for c in back.calibration] == [(None, 300e-6)]


def test_write_leaves_nothing_behind_when_the_rename_fails(tmp_path, monkeypatch):
    cluster = build_cluster(_measurements(["h"] * 2, np.full((2, 2), GB)))

    def boom(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_cluster_toml(cluster, tmp_path / "c.toml")
    assert list(tmp_path.iterdir()) == []


def test_summarize_reduces_raw_timings():
    opts = ProbeOptions(nbytes=1000, repeats=2, warmup=0)
    lat = {(0, 1): [2e-6, 2e-6, 4e-6]}  # median RTT 2 us: one-way 1 us
    rec0 = {
        "lat": lat,
        "p2p": {(0, 1): [11e-6, 21e-6]},
        "fan": {0: (1, [6e-6, 9e-6])},
        "node": {},
        "ar": {((2, 1), 0): [1e-6, 5e-6]},
        "ar_small": {((2, 1), 0): [30e-6, 50e-6]},
        "ar_curve": {},
        "skipped": 0,
        "device": {"float32": 1e9, "bfloat16": None, "memory_bandwidth": 4e9, "memory_bytes": 8e9, "host_memory": True}
        | {"op_overhead": 4e-6, "foreach_overhead": 1e-6, "collective_overhead": 1000e-6},
    }
    rec1 = {
        "lat": {},
        "p2p": {(1, 0): [6e-6, 5e-6]},
        "fan": {},
        "node": {},
        "ar": {((2, 1), 0): [4e-6, 2e-6]},
        "ar_small": {((2, 1), 0): [40e-6, 20e-6]},
        "skipped": 0,
        "device": {"float32": 3e9, "bfloat16": None, "memory_bandwidth": 2e9, "memory_bytes": 8e9, "host_memory": True}
        | {"op_overhead": 7e-6, "foreach_overhead": 2e-6, "collective_overhead": 2000e-6},
    }
    m = summarize([rec0, rec1], ["h", "h"], "gloo", opts, "probed-cpu")
    assert m.p2p_latency[0, 1] == m.p2p_latency[1, 0] == pytest.approx(1e-6)
    assert m.p2p_bw[0, 1] == pytest.approx(1000 / 10e-6)  # best 11 us less 1 us latency
    assert m.p2p_bw[1, 0] == pytest.approx(1000 / 4e-6)
    assert m.fanout_bw[0] == pytest.approx(1000 / 5e-6) and math.isnan(m.fanout_bw[1])
    assert m.allreduce[(2, 1)] == (pytest.approx(1000 / 4e-6), None)  # slowest rank per repeat, best repeat
    assert m.allreduce[(1, 2)] == (None, None)
    # 4-byte all-reduce: slowest rank per repeat (40, 50 us), median 45 us, over ceil(log2 2) = 1 step
    assert m.allreduce_latency[(2, 1)] == (pytest.approx(45e-6), None)
    assert m.device.flops_for("float32") == 2e9 and m.device.memory_bytes == 4e9  # host memory / 2 ranks
    # fixed costs: the median over ranks, rounded to 4 digits and printing back as whole microseconds
    assert (m.device.op_overhead, m.device.foreach_overhead) == (5.5e-6, 1.5e-6)
    assert m.device.collective_overhead == 1500e-6
    # curve (64 B between 4 B and 1000 B, not measured here): per repeat the slowest rank, median over repeats
    assert m.allreduce_curve[(2, 1)] == (((4, pytest.approx(45e-6)), (1000, pytest.approx(4.5e-6))), None)


def test_the_allreduce_curve_is_measured_between_the_small_and_large_messages_and_prices_collectives(tmp_path):
    """Sizes between the 4-byte and the large all-reduce (16 KiB, then 8x); the curve survives the TOML
    round trip on the axis it was measured on; the cost model interpolates it for all-reduce and takes half
    for all-gather / reduce-scatter; the other axis keeps alpha-beta."""
    from meshpilot.cluster.cost import CostModel, monotone, on_curve

    assert curve_sizes(4 * 2**20) == (64, 1024, 16384, 131072, 1048576)
    assert curve_sizes(16384) == (64, 1024)
    key = ((2, 2), 1)
    recs = []
    for slow in (1.0, 2.0):  # the slower rank's times are what counts
        recs.append(
            {
                "ar": {key: [slow * 0.5, slow * 0.7]},
                "ar_small": {key: [slow * 1e-3, slow * 3e-3]},
                "ar_curve": {(*key, 16384): [slow * 0.01, slow * 0.01], (*key, 131072): [slow * 0.03, slow * 0.05]},
            }
        )
    # rank 1 slower: 4 B median(2, 6) ms; 16 KiB 20 ms; 128 KiB median(60, 100) ms; 1 MiB median(1.0, 1.4) s;
    # 64 B and 1 KiB not measured: left out
    got = _curve(recs, (2, 2), 1, 2**20)
    assert got == ((4, 4e-3), (16384, 0.02), (131072, 0.08), (2**20, 1.2))
    # interpolation by hand: halfway between 16 KiB and 128 KiB; beyond the last point its segment's slope
    assert on_curve(got, (16384 + 131072) / 2) == pytest.approx(0.05)
    assert on_curve(got, 2) == 4e-3
    assert on_curve(got, 2 * 2**20) == pytest.approx(1.2 + 2**20 * (1.2 - 0.08) / (2**20 - 131072))
    # never cheaper for a larger message: a dip is pooled with the point before it (mean 2.0), not lifted to 3.0
    assert on_curve(((10, 3.0), (20, 1.0), (30, 5.0)), 20) == 2.0
    assert monotone([1.0, 4.0, 2.0, 3.0, 5.0]) == [1.0, 3.0, 3.0, 3.0, 5.0]
    m = _measurements(["h"] * 4, np.full((4, 4), 10 * GB), allreduce={(2, 2): (4e9, 5e9)})
    m.allreduce_curve = {(2, 2): (None, got)}
    back = load_cluster_file(write_cluster_toml(build_cluster(m, name="curve"), tmp_path / "c.toml"))
    assert [c.curve for c in back.calibration] == [(None, got)]
    cost = CostModel(LogicalMesh(back, (2, 2)))
    assert cost.all_reduce(65536, 1) == pytest.approx(on_curve(got, 65536))
    assert cost.all_gather(65536, 1) == cost.reduce_scatter(65536, 1) == pytest.approx(on_curve(got, 65536) / 2)
    m.allreduce_curve = {}
    plain = CostModel(LogicalMesh(build_cluster(m), (2, 2)))
    assert cost.all_reduce(65536, 0) == pytest.approx(plain.all_reduce(65536, 0))  # axis 0: no curve


def test_the_busy_curve_round_trips_and_gives_the_busy_factor_on_cpu_only(tmp_path):
    """Phase 6: the all-reduce beside compute at 1 KiB up to the large message, per repeat the slowest rank,
    median over repeats; written as busy1 / busy2 and read back on its axis; the cost model's busy factor is its
    ratio to the curve alone (never below 1) on a CPU device, 1 on a GPU, on an axis without it, or without the
    curve alone."""
    from meshpilot.cluster.cost import CostModel

    assert busy_sizes(4 * 2**20) == (1024, 16384, 131072, 1048576, 4 * 2**20)
    key = ((2, 2), 1)
    recs = [
        {"ar_busy": {(*key, 1024): [slow * 0.1, slow * 0.3], (*key, 16384): [slow * 0.2, slow * 0.2]}}
        for slow in (1, 2)
    ]
    busy = _busy_curve(recs, (2, 2), 1, 16384)
    assert busy == ((1024, pytest.approx(0.4)), (16384, pytest.approx(0.4)))  # 0.2, 0.6 -> 0.4; 0.4, 0.4 -> 0.4
    alone = ((4, 0.01), (1024, 0.1), (16384, 0.5))
    cpu = dataclasses.replace(DEV, kind="probed-cpu")
    m = _measurements(["h"] * 4, np.full((4, 4), 10 * GB), allreduce={(2, 2): (4e9, 5e9)})
    m.device = cpu
    m.allreduce_curve = {(2, 2): (None, alone)}
    m.allreduce_busy = {(2, 2): (None, busy)}
    back = load_cluster_file(write_cluster_toml(build_cluster(m, name="busy"), tmp_path / "c.toml"))
    ((none, loaded),) = [c.busy_curve for c in back.calibration]
    assert none is None and loaded == ((1024, pytest.approx(0.4)), (16384, pytest.approx(0.4)))
    cost = CostModel(LogicalMesh(back, (2, 2)))
    assert cost.busy_factor(1024, 1) == pytest.approx(4.0)
    assert cost.busy_factor(4, 1) == pytest.approx(40.0)  # below 1 KiB: the first busy point over 4 B's time
    assert cost.busy_factor(16384, 1) == 1.0  # 0.4 s beside compute against 0.5 s alone: never below 1
    assert cost.busy_factor(1024, 0) == 1.0  # axis 0 not measured
    gpu = dataclasses.replace(back, device=DEVICES["a100-80gb"])
    assert CostModel(LogicalMesh(gpu, (2, 2))).busy_factor(1024, 1) == 1.0
    m.allreduce_curve = {}  # a busy curve without its curve alone is not written
    assert all(not c.busy_curve for c in build_cluster(m).calibration)


# ---------------------------------------------------------------------------------------------------
# The [device_profile] table of cluster files


def _doc(**extra):
    doc = {"layers": [{"name": "gpu", "ranks": 2, "p2p_GBps": 10.0, "group_GBps": 10.0, "latency_us": 1.0}]}
    doc.update(extra)
    return doc


def test_device_profile_table_loads_and_named_devices_stay_names():
    prof = {"kind": "mine", "peak_tflops_fp32": 1.5, "memory_GBps": 100.0, "memory_GiB": 2.0}
    c = cluster_from_dict(_doc(device_profile=prof), "t")
    assert c.device == DeviceProfile("mine", {"float32": 1.5e12}, 100e9, 2 * 2**30)
    assert c.device.flops_for("bfloat16") == 1.5e12
    text = cluster_to_toml(preset_cluster("atp-ic3"))
    assert 'device = "a100-80gb"' in text and "device_profile" not in text
    assert cluster_from_dict(tomllib.loads(text), "t").device == DEVICES["a100-80gb"]
    assert DEVICES["h100"].op_overhead == DEVICES["h100"].foreach_overhead == 0.0  # no datasheet number
    assert DEVICES["h100"].collective_overhead == 0.0


def test_device_profile_fixed_costs_load_and_round_trip():
    prof = {"kind": "mine", "peak_tflops_fp32": 1.5, "memory_GBps": 100.0, "memory_GiB": 2.0}
    fixed = {"op_overhead_us": 12.5, "foreach_overhead_us": 0.0, "collective_overhead_us": 1500.0}
    c = cluster_from_dict(_doc(device_profile=prof | fixed), "t")
    assert c.device.op_overhead == pytest.approx(12.5e-6) and c.device.foreach_overhead == 0.0
    assert c.device.collective_overhead == pytest.approx(1.5e-3)
    text = cluster_to_toml(c)
    assert "op_overhead_us = 12.5" in text and "foreach_overhead_us" not in text  # 0: not modelled, left out
    assert "collective_overhead_us = 1500.0" in text
    assert cluster_from_dict(tomllib.loads(text), "t").device == c.device
    assert "op_overhead_us" not in cluster_to_toml(cluster_from_dict(_doc(device_profile=prof), "t"))


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"device": "h100", "device_profile": {}}, "device_profile"),
        ({"device_profile": "fast"}, "device_profile"),
        ({"device_profile": {"kind": "x", "memory_GBps": 1.0, "memory_GiB": 1.0}}, "device_profile.peak_tflops_fp32"),
        (
            {"device_profile": {"kind": "x", "peak_tflops_fp32": 0, "memory_GBps": 1.0, "memory_GiB": 1.0}},
            "device_profile.peak_tflops_fp32",
        ),
        (
            {
                "device_profile": {
                    "kind": "x",
                    "peak_tflops_fp32": 1.0,
                    "memory_GBps": 1.0,
                    "memory_GiB": 1.0,
                    "compute_efficiency": 1.5,
                }
            },
            "device_profile.compute_efficiency",
        ),
        (
            {"device_profile": {"kind": "", "peak_tflops_fp32": 1.0, "memory_GBps": 1.0, "memory_GiB": 1.0}},
            "device_profile.kind",
        ),
        (
            {"device_profile": {"kind": "x", "peak_tflops_fp32": 1, "memory_GBps": 1, "memory_GiB": 1, "tf32": 2}},
            "device_profile.tf32",
        ),
        (
            {
                "device_profile": {
                    "kind": "x",
                    "peak_tflops_fp32": 1,
                    "memory_GBps": 1,
                    "memory_GiB": 1,
                    "op_overhead_us": -1,
                }
            },
            "device_profile.op_overhead_us",
        ),
        (
            {
                "device_profile": {
                    "kind": "x",
                    "peak_tflops_fp32": 1,
                    "memory_GBps": 1,
                    "memory_GiB": 1,
                    "collective_overhead_us": -1.5,
                }
            },
            "device_profile.collective_overhead_us",
        ),
        ({}, "device"),
    ],
)
def test_device_profile_mistakes_name_the_key(extra, key):
    with pytest.raises(ClusterFileError) as e:
        cluster_from_dict(_doc(**extra), "f.toml")
    assert e.value.key == key


# ---------------------------------------------------------------------------------------------------
# Real processes


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "120"
    return env


def test_probe_outside_torchrun_exits_2_with_one_line(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "meshpilot.cli.main", "probe", "--out", str(tmp_path / "c.toml")],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchrun --nproc-per-node" in lines[0] and "probe" in lines[0]
    assert not (tmp_path / "c.toml").exists()


@pytest.mark.dist
def test_probe_under_torchrun_writes_a_file_that_loads_back(tmp_path, capsys):
    out = tmp_path / "c.toml"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    cmd += ["-m", "meshpilot.cli.main", "probe", "--quick", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    cluster = load_cluster_file(out)
    assert cluster.num_devices == 4
    for shape, axes in {(4, 1): (0,), (2, 2): (0, 1), (1, 4): (1,)}.items():
        entry = cluster.calibrated(shape)
        assert entry is not None, shape
        assert all(entry.algbw[a] > 0 for a in axes)
    assert cluster.device.flops_for("float32") > 0 and cluster.device.memory_bandwidth > 0
    # the host CPU of one gloo collective: written, read back, positive (the backend's threads do work)
    assert "collective_overhead_us = " in out.read_text() and cluster.device.collective_overhead > 0
    assert "B1 measured" in r.stdout and "wrote" in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]  # no temp file left
    # `meshpilot topology` reads the file back in this process (a fresh interpreter would only import torch again)
    from meshpilot.cli.main import main

    capsys.readouterr()
    assert main(["topology", "--cluster", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["meshes"]
    assert [r["mesh"] for r in rows] == [[4, 1], [2, 2], [1, 4]] and all(r["calibrated"] for r in rows)


def _probe_as_two_nodes():
    import torch.distributed as dist

    from meshpilot.cluster.probe import ProbeOptions, build_cluster, probe

    m = probe(ProbeOptions.for_device(cuda=False, quick=True), host=f"node{dist.get_rank() // 2}")
    if m is None:
        return None
    c = build_cluster(m)
    return {
        "layers": [(layer.name, layer.ranks) for layer in c.layers],
        "node_bw": m.node_bw.tolist(),
        "calibrated": sorted(e.mesh for e in c.calibration),
        "busy": {e.mesh: [None if b is None else [n for n, _ in b] for b in e.busy_curve] for e in c.calibration},
        "toml": cluster_to_toml(c),
    }


@pytest.mark.dist
def test_probe_on_two_fake_nodes_measures_both_layers():
    from dist_utils import run_distributed

    result = run_distributed(_probe_as_two_nodes, 4, timeout=120)[0]
    assert result["layers"] == [("node", 2), ("device", 2)]
    assert result["node_bw"][0][1] > 0 and result["node_bw"][1][0] > 0
    assert result["calibrated"] == [(1, 4), (2, 2), (4, 1)]
    # phase 6 (gloo): every axis of more than one rank timed beside compute at every size
    sizes = list(busy_sizes(ProbeOptions.for_device(cuda=False, quick=True).nbytes))
    assert result["busy"] == {(1, 4): [None, sizes], (2, 2): [sizes, sizes], (4, 1): [sizes, None]}
    assert cluster_from_dict(tomllib.loads(result["toml"]), "t").num_devices == 4


def test_device_rates_are_timed_in_lockstep_with_the_other_ranks():
    """Every timed repeat of the device measurements starts at the all-rank barrier (so ranks sharing cores
    are timed while all of them compute, as a training step runs), the same number of times on every rank
    whatever its speed (or the barriers would pair up wrongly), and the rates are positive."""
    import torch

    from meshpilot.cluster.probe import measure_device

    calls = []
    opts = dataclasses.replace(
        ProbeOptions.for_device(cuda=False, quick=True), matmul_shapes=((32, 48, 16, "float32"),)
    )
    out = measure_device(torch.device("cpu"), opts, barrier=lambda: calls.append(1))
    # square matmuls, model GEMMs, the tiny operator and the foreach operator, a recorded program's calls, the
    # AdamW step over tiny and over large parameters, the copy
    timed = len(opts.matmul_sizes) + len(opts.matmul_shapes) + 2 + 1 + 2 + 1
    assert len(calls) == timed * opts.repeats
    assert out["float32"] > 0 and out["memory_bandwidth"] > 0 and out["matmul"][0] > 0
    assert out["op_overhead"] > 0 and out["foreach_overhead"] > 0
    assert out["call_overhead"] > 0 and out["adamw_bandwidth"] > 0 and out["adamw_overhead"] > 0


def test_a_cpu_gemm_timing_spans_many_time_slices():
    """On a CPU device each timed repeat of a model GEMM runs about ``GEMM_TIMING_CPU_S`` (100 ms), not 10 ms:
    a 10 ms timing fits in one scheduler time slice of ranks sharing cores, so it measured a rank that held a
    core or one that waited (one shape 0.26-2.42x between two runs on a loaded 2-core box; 100 ms: 0.41-1.48x).
    A GPU keeps 10 ms."""
    import torch

    from meshpilot.cluster.probe import GEMM_TIMING_CPU_S, gemm_timing_s

    assert gemm_timing_s(torch.device("cpu")) == GEMM_TIMING_CPU_S == 0.1
    assert gemm_timing_s(torch.device("cuda", 0)) == 0.01


def test_the_bench_s_loopback_cluster_takes_the_probe_s_device_reduction(monkeypatch):
    """``bench_vs_torch`` plans on the device its ranks measured at launch, reduced by the probe's own
    ``device_profile`` (the median over ranks, as ``summarize``): the matmul peak, the GEMM table, the copy
    bandwidth and the fixed costs reach the loopback cluster; ``--nominal`` (no measurement) keeps the
    single-thread matmul rate and the nominal 10 GB/s (issue 30 item 5)."""
    import argparse

    from meshpilot.cluster.probe import device_profile

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_vs_torch as bvt

    opts = ProbeOptions(matmul_shapes=((64, 256, 256, "float32"),))
    devs = [
        {"float32": f, "bfloat16": None, "matmul": [g], "memory_bandwidth": bw, "memory_bytes": 8e9}
        | {"host_memory": True, "op_overhead": op, "foreach_overhead": each}
        for f, g, bw, op, each in ((1e11, 2e10, 8e9, 3e-6, 2e-6), (3e11, 4e10, 6e9, 5e-6, 4e-6))
    ]
    spec = bvt.device_spec(device_profile(devs, ["h", "h"], opts, "local-cpu"))
    assert spec["peak_tflops_fp32"] == pytest.approx(0.2) and spec["memory_GBps"] == pytest.approx(7.0)
    assert (spec["op_overhead_us"], spec["foreach_overhead_us"]) == (pytest.approx(4.0), pytest.approx(3.0))
    assert spec["matmul"] == [{"m": 64, "n": 256, "k": 256, "dtype": "float32", "tflops": pytest.approx(0.03)}]
    args = argparse.Namespace(gbps=0.25, latency_us=125.0, collective_overhead_us=900.0, tflops=None)
    args.loopback_device = spec
    d = cluster_from_dict(bvt.loopback_cluster(4, 0.2, args), "t").device
    assert d.matmul_flops(64, 256, 256, "float32") == pytest.approx(3e10) and d.memory_bandwidth == pytest.approx(7e9)
    assert (d.memory_efficiency, d.op_overhead, d.foreach_overhead) == (1.0, pytest.approx(4e-6), pytest.approx(3e-6))
    args.loopback_device = None  # --nominal
    d = cluster_from_dict(bvt.loopback_cluster(4, 0.05, args), "t").device
    assert (d.flops_for("float32"), d.memory_bandwidth, d.op_overhead, d.matmul) == (5e10, 1e10, 0.0, ())
    assert d.collective_overhead == pytest.approx(9e-4)
    assert [256, 768, 256, "float32"] in bvt.loopback_gemms(["gpt"], 4)  # qkv of 1/4 of the batch (2 x 128)


def test_the_bench_hands_its_ranks_every_option_but_its_own(monkeypatch):
    """``bench_vs_torch --nproc 2`` failed before its ranks started: the parent handed its whole command line to
    the ranks after the script, and torchrun, which reads its arguments for abbreviations of its own options,
    stopped at ``--nproc`` (ambiguous with ``--nproc-per-node``). The ranks get every option but the parent's."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_vs_torch as bvt

    argv = ["--models", "gpt", "--nproc", "2", "--json-out", "x.json", "--steps", "3", "--nproc=2", "--no-solver"]
    assert bvt.worker_args(argv) == ["--models", "gpt", "--steps", "3", "--no-solver"]
    assert bvt.worker_args(["--json-out=x.json", "--overlap"]) == ["--overlap"]
