"""Eq. 3/4 on ATP's worked example and on every preset; properties of the hierarchical matrix."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshpilot.cluster import (
    GB,
    PRESETS,
    LogicalMesh,
    cluster_from_dict,
    cluster_to_toml,
    effective_bandwidth,
    load_cluster,
    load_cluster_file,
    mapped_ranks,
    mesh_shapes_2d,
)


def test_atp_fig7a_worked_example():
    """ATP §3.5: DeviceMesh(8,2) on Fig. 7a gives B2' = 200 GB/s and B1' = 12.5 GB/s."""
    m = LogicalMesh(load_cluster("atp-fig7a"), (8, 2))
    assert m.effective_bandwidth(1) == pytest.approx(200 * GB)
    assert m.effective_bandwidth(0) == pytest.approx(12.5 * GB)
    # Eq. 4: B = d / (2(d-1)) * B'
    assert m.algorithm_bandwidth(0) == pytest.approx(8 / 14 * 12.5 * GB)
    assert m.algorithm_bandwidth(1) == pytest.approx(2 / 2 * 200 * GB)


@pytest.mark.parametrize(
    "preset, shape, mapping, names",
    [
        ("atp-ic4", (2, 8), "row", ("node", "gpu")),  # one axis between the 2 nodes, one inside each
        ("atp-ic4", (4, 4), "row", ("node", "gpu")),  # axis 0's groups (ranks 0, 4, 8, 12) cross the nodes
        ("atp-ic4", (4, 4), "col", ("gpu", "node")),  # the transpose
        ("atp-ic4", (1, 16), "row", ("single", "node")),  # size one crosses nothing
        ("atp-ic3", (2, 4), "row", ("gpu.0", "gpu.1")),  # one layer: both axes cross it, told apart by index
        ("atp-ic3", (1, 1), "row", ("single.0", "single.1")),
    ],
)
def test_axis_names_say_the_topmost_layer_crossed(preset, shape, mapping, names):
    from meshpilot.cluster import mapped_ranks

    assert LogicalMesh(load_cluster(preset), shape, mapped_ranks(shape, mapping)).axis_names() == names


def test_ic1_calibration_overrides_matrix():
    cal = LogicalMesh(load_cluster("atp-ic1-calibrated"), (2, 4))
    assert cal.algorithm_bandwidth(0) == pytest.approx(1.20 * GB)
    assert cal.algorithm_bandwidth(1) == pytest.approx(4.95 * GB)
    m81 = LogicalMesh(load_cluster("atp-ic1-calibrated"), (8, 1))
    assert m81.algorithm_bandwidth(0) == pytest.approx(0.97 * GB)
    raw = LogicalMesh(load_cluster("atp-ic1"), (8, 1))
    assert raw.algorithm_bandwidth(0) > 2 * GB  # what the matrix alone predicts (§5.3: it cannot)


def test_calibration_entries_match_by_rank_groups_not_shape():
    """A probe measures each shape row-mapped; a col-mapped (4, 2)'s axis 0 (ranks 0-3, 4-7) is the row (2, 4)'s
    axis 1, so it must get that entry's B2, not the row (4, 2) entry's B1 (other groups)."""
    c = load_cluster("atp-ic1-calibrated")
    row24 = LogicalMesh(c, (2, 4))
    col42 = LogicalMesh(c, (4, 2), mapped_ranks((4, 2), "col"))
    assert col42.algorithm_bandwidth(0) == row24.algorithm_bandwidth(1) == pytest.approx(4.95 * GB)
    assert col42.algorithm_bandwidth(1) == row24.algorithm_bandwidth(0) == pytest.approx(1.20 * GB)
    row42 = LogicalMesh(c, (4, 2))
    assert row42.algorithm_bandwidth(0) != col42.algorithm_bandwidth(0)


@pytest.mark.parametrize("n", [4, 16, 64, 1024])
def test_ic5_every_axis_gets_group_bandwidth(n):
    """ATP §5.4: on the NVLink-Network switch B1' = B2' = GroupBW for every mesh."""
    c = load_cluster(f"atp-ic5:{n}")
    for shape in mesh_shapes_2d(n):
        m = LogicalMesh(c, shape)
        for axis, d in enumerate(shape):
            expect = math.inf if d == 1 else 900 * GB
            assert m.effective_bandwidth(axis) == pytest.approx(expect)


@pytest.mark.parametrize("q", [2, 4, 8])
def test_ic6_torus_aligned_mesh_gets_group_bandwidth(q):
    """ATP §5.4: on a q x q torus, DeviceMesh(q, q) has B1' = B2' = GroupBW (50 GB/s: two 25 GB/s links)."""
    m = LogicalMesh(load_cluster(f"atp-ic6:{q}"), (q, q))
    assert m.effective_bandwidth(0) == pytest.approx(50 * GB)
    assert m.effective_bandwidth(1) == pytest.approx(50 * GB)


def test_ic6_relay_path_when_no_direct_link():
    """Ring members 0 and 2 have no direct link; they talk through 1 at 25 GB/s, not 0."""
    m = LogicalMesh(load_cluster("atp-ic6:4"), (8, 2))
    assert m.effective_bandwidth(0) == pytest.approx(50 * GB)
    assert m.effective_bandwidth(1) == pytest.approx(25 * GB)


# Eq. 3 by hand for every preset: (preset, mesh, B1' GB/s, B2' GB/s)
EXPECTED = [
    ("atp-ic1", (2, 4), 1.2, 7.4),  # 4 groups share the 4.8 socket link; 4 GPUs of a socket: min(7.4, 3*3.0)
    ("atp-ic1-calibrated", (4, 2), 2.4, 3.0),
    ("atp-ic2", (4, 2), 32.0, 200.0),  # two groups share a pair's 64 GB/s PCIe; the pair's NVLink
    ("atp-ic2", (8, 1), 64.0, math.inf),
    ("atp-ic3", (4, 2), 600.0, 600.0),
    ("atp-ic4", (2, 8), 25 / 8, 600.0),  # 8 groups cross each node's 25 GB/s IB link
    ("atp-ic4", (16, 1), 25.0, math.inf),
    ("atp-ic5:8", (2, 4), 900.0, 900.0),
    ("atp-ic6:4", (4, 4), 50.0, 50.0),
    ("atp-fig7a", (4, 4), 25 / 4, 600.0),
    ("atp-fig7a", (8, 2), 12.5, 200.0),
    ("alpa-p3x8", (8, 8), 3.125 / 8, 200.0),  # hybrid cube mesh: best ring of 100 GB/s hops, both ways
    ("alpa-p3x8", (32, 2), 3.125 / 2, 50.0),  # GPUs 0 and 1: one NVLink-2 link
    ("hidup-v100x64", (8, 8), 9.71 / 8 / 8, 175.0),
    ("hidup-2x4-100g", (2, 4), 12.5 / 4, 75.0),
    ("hidup-2x4-30g", (2, 4), 3.75 / 4, 75.0),
    ("hidup-2x4-10g", (4, 2), 1.25 / 2, 25.0),
    ("dgx-h100:2", (8, 2), 200.0, 900.0),
    ("torchtitan-h100:2", (2, 8), 400 / 8, 331.0),  # 8 groups share 8 x 50 GB/s NICs; NVLink at NCCL's
    ("torchtitan-h100:2", (16, 1), 331.0, math.inf),  # a ring through both hosts: NVLink at NCCL's rate binds
    ("llama3-h100:1", (384, 8), 400 / 8, 331.0),
    ("llama3-h100:2", (2, 3072), 50 / 7, 331.0),  # 3,072 groups share a pod's uplinks (1:7); a pod's servers
]


@pytest.mark.parametrize("preset,shape,b1,b2", EXPECTED)
def test_eq3_on_presets(preset, shape, b1, b2):
    m = LogicalMesh(load_cluster(preset), shape)
    assert m.effective_bandwidth(0) == pytest.approx(b1 * GB)
    assert m.effective_bandwidth(1) == pytest.approx(b2 * GB)


def test_every_preset_is_covered_and_round_trips(tmp_path):
    covered = {p.partition(":")[0] for p, *_ in EXPECTED}
    assert covered == set(PRESETS)
    for name in PRESETS:
        c = load_cluster(name)
        path = tmp_path / f"{name}.toml"
        path.write_text(cluster_to_toml(c))
        back = load_cluster_file(path)
        assert back.radices == c.radices and back.device == c.device and back.calibration == c.calibration
        for a, b in zip(c.layers, back.layers):
            np.testing.assert_allclose(a.p2p, b.p2p)
            np.testing.assert_allclose(a.group_bw, b.group_bw)
            assert a.latency == pytest.approx(b.latency)
        for shape in mesh_shapes_2d(c.num_devices):
            m1, m2 = LogicalMesh(c, shape), LogicalMesh(back, shape)
            for axis in (0, 1):
                assert m1.algorithm_bandwidth(axis) == pytest.approx(m2.algorithm_bandwidth(axis))
                assert m1.algorithm_bandwidth(axis) > 0


def test_custom_mapping_changes_bandwidth():
    """Putting mesh axis 1 across nodes instead of inside them makes it slow: the mapping matters."""
    c = load_cluster("atp-ic4")
    inner = LogicalMesh(c, (2, 8))
    swapped = LogicalMesh(c, (2, 8), ranks=np.arange(16).reshape(8, 2).T)
    assert inner.effective_bandwidth(1) == pytest.approx(600 * GB)
    assert swapped.effective_bandwidth(1) < 30 * GB


# ---- properties -------------------------------------------------------------------------------------------

layer_st = st.fixed_dictionaries(
    {
        "ranks": st.integers(1, 4),
        "p2p": st.floats(0.5, 500),
        "group": st.floats(0.5, 1000),
        "lat": st.one_of(st.just(0.0), st.floats(1e-3, 20)),  # 0, or a real latency (tinier is refused)
    }
)


def _cluster(layers, matrix: bool):
    out = []
    for i, lay in enumerate(layers):
        r = lay["ranks"]
        p2p = [[lay["p2p"]] * r for _ in range(r)] if matrix else lay["p2p"]
        group = [lay["group"]] * r if matrix else lay["group"]
        out.append({"name": f"l{i}", "ranks": r, "p2p_GBps": p2p, "group_GBps": group, "latency_us": lay["lat"]})
    return cluster_from_dict({"device": "a100-80gb", "layers": out}, source="hypothesis")


@settings(max_examples=60, deadline=None)
@given(st.lists(layer_st, min_size=1, max_size=3))
def test_scalar_and_matrix_layers_agree_and_bandwidths_positive(layers):
    scalar, full = _cluster(layers, False), _cluster(layers, True)
    n = scalar.num_devices
    for shape in mesh_shapes_2d(n):
        a, b = LogicalMesh(scalar, shape), LogicalMesh(full, shape)
        for axis in (0, 1):
            assert a.effective_bandwidth(axis) == b.effective_bandwidth(axis)
            assert a.algorithm_bandwidth(axis) > 0
            assert a.latency(axis) == b.latency(axis)


@settings(max_examples=60, deadline=None)
@given(st.lists(layer_st, min_size=1, max_size=3), st.data())
def test_more_groups_sharing_never_raise_bandwidth(layers, data):
    """Adding concurrent groups to a set of groups can only lower B' (they share the same links)."""
    c = _cluster(layers, False)
    n = c.num_devices
    shapes = [s for s in mesh_shapes_2d(n) if s[1] > 1]
    if not shapes:
        return
    shape = data.draw(st.sampled_from(shapes))
    groups = LogicalMesh(c, shape).groups(1)
    k = data.draw(st.integers(1, groups.shape[0]))
    subset = groups[:k]
    assert effective_bandwidth(c, subset) >= effective_bandwidth(c, groups)
    assert effective_bandwidth(c, groups[:1]) >= effective_bandwidth(c, subset)


def test_ring_crosses_the_slow_hop_between_racks():
    """Two racks of two nodes, 0.2 GB/s inside a rack, 0.05 GB/s across: any ring crosses a slow hop, so B'
    is two directions of it (0.1), not a node's 0.2 GB/s group bandwidth (the sum of its links)."""
    p2p = [[0, 0.2, 0.05, 0.05], [0.2, 0, 0.05, 0.05], [0.05, 0.05, 0, 0.2], [0.05, 0.05, 0.2, 0]]
    c = cluster_from_dict(
        {
            "device": "cpu",
            "layers": [
                {"name": "node", "ranks": 4, "p2p_GBps": p2p, "group_GBps": 0.2, "latency_us": 50},
                {"name": "rank", "ranks": 2, "p2p_GBps": 2.0, "group_GBps": 2.0, "latency_us": 5},
            ],
        },
        source="racks",
    )
    assert LogicalMesh(c, (8, 1)).effective_bandwidth(0) == pytest.approx(0.1 * GB)
    # a group inside one rack keeps the fast link
    assert LogicalMesh(c, (2, 4)).effective_bandwidth(1) == pytest.approx(0.2 * GB)
