"""Malformed cluster files: each ends with one line naming the file, the key and the fix, and exit code 2."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from meshpilot.cli.main import main

GOOD_LAYER = """
[[layers]]
name = "gpu"
ranks = 4
p2p_GBps = 100.0
group_GBps = 300.0
latency_us = 2.0
"""

# (case id, file body, key the message must name, words of the fix the message must carry)
CASES = [
    ("missing-device", GOOD_LAYER, "device", "add device"),
    ("unknown-device", 'device = "tpu-v9"\n' + GOOD_LAYER, "device", "use one of"),
    ("missing-layers", 'device = "h100"\n', "layers", "add at least one [[layers]]"),
    ("layers-not-tables", 'device = "h100"\nlayers = [1, 2]\n', "layers", "[[layers]]"),
    ("missing-ranks", 'device = "h100"\n' + GOOD_LAYER.replace("ranks = 4\n", ""), "layers[0].ranks", "add ranks"),
    ("zero-ranks", 'device = "h100"\n' + GOOD_LAYER.replace("ranks = 4", "ranks = 0"), "layers[0].ranks", "e.g."),
    ("float-ranks", 'device = "h100"\n' + GOOD_LAYER.replace("ranks = 4", "ranks = 2.5"), "layers[0].ranks", "whole"),
    (
        "negative-bandwidth",
        'device = "h100"\n' + GOOD_LAYER.replace("p2p_GBps = 100.0", "p2p_GBps = -5.0"),
        "layers[0].p2p_GBps",
        "GB/s",
    ),
    (
        "zero-group-bandwidth",
        'device = "h100"\n' + GOOD_LAYER.replace("group_GBps = 300.0", "group_GBps = 0"),
        "layers[0].group_GBps",
        "greater than zero",
    ),
    (
        "non-square-matrix",
        'device = "h100"\n' + GOOD_LAYER.replace("p2p_GBps = 100.0", "p2p_GBps = [[0, 1, 1, 1], [1, 0, 1]]"),
        "layers[0].p2p_GBps",
        "4 rows of 4",
    ),
    (
        "wrong-size-matrix",
        'device = "h100"\n' + GOOD_LAYER.replace("p2p_GBps = 100.0", "p2p_GBps = [[0, 1], [1, 0]]"),
        "layers[0].p2p_GBps",
        "4 rows of 4",
    ),
    (
        "wrong-size-group-list",
        'device = "h100"\n' + GOOD_LAYER.replace("group_GBps = 300.0", "group_GBps = [300.0, 300.0]"),
        "layers[0].group_GBps",
        "give 4 numbers",
    ),
    (
        "string-bandwidth",
        'device = "h100"\n' + GOOD_LAYER.replace("p2p_GBps = 100.0", 'p2p_GBps = "fast"'),
        "layers[0].p2p_GBps",
        "plain number",
    ),
    (
        "negative-latency",
        'device = "h100"\n' + GOOD_LAYER.replace("latency_us = 2.0", "latency_us = -1.0"),
        "layers[0].latency_us",
        "latency in microseconds",
    ),
    (
        "missing-latency",
        'device = "h100"\n' + GOOD_LAYER.replace("latency_us = 2.0\n", ""),
        "layers[0].latency_us",
        "add latency_us",
    ),
    ("unknown-key", 'device = "h100"\nnodes = 3\n' + GOOD_LAYER, "nodes", "remove it"),
    (
        "unknown-layer-key",
        'device = "h100"\n' + GOOD_LAYER.replace("ranks = 4", "ranks = 4\nbandwidth = 3"),
        "layers[0].bandwidth",
        "remove it",
    ),
    (
        "isolated-rank",
        'device = "h100"\n'
        + GOOD_LAYER.replace("p2p_GBps = 100.0", "p2p_GBps = [[0,1,1,0],[1,0,1,0],[1,1,0,0],[0,0,0,0]]"),
        "layers[0].p2p_GBps[3]",
        "positive off-diagonal",
    ),
    (
        "calibration-mesh-not-dividing",
        'device = "h100"\n' + GOOD_LAYER + "\n[[calibration]]\nmesh = [3, 2]\nB1_GBps = 1.0\n",
        "calibration[0].mesh",
        "product is 4",
    ),
    (
        "calibration-without-bandwidth",
        'device = "h100"\n' + GOOD_LAYER + "\n[[calibration]]\nmesh = [2, 2]\n",
        "calibration[0]",
        "at least one",
    ),
    (
        "calibration-curve-not-ascending",
        'device = "h100"\n' + GOOD_LAYER + "\n[[calibration]]\nmesh = [2, 2]\ncurve1 = [[1024, 5.0], [512, 9.0]]\n",
        "calibration[0].curve1[1]",
        "bytes ascending",
    ),
    (
        "calibration-curve-not-pairs",
        'device = "h100"\n' + GOOD_LAYER + "\n[[calibration]]\nmesh = [2, 2]\ncurve2 = [1024, 5.0]\n",
        "calibration[0].curve2[0]",
        "[[bytes, microseconds], ...]",
    ),
    (
        "calibration-curve-negative-time",
        'device = "h100"\n' + GOOD_LAYER + "\n[[calibration]]\nmesh = [2, 2]\ncurve1 = [[1024, -5.0]]\n",
        "calibration[0].curve1[0]",
        "microseconds",
    ),
    (
        "calibration-busy-without-its-curve",
        'device = "cpu"\n' + GOOD_LAYER + "\n[[calibration]]\nmesh = [2, 2]\ncurve1 = [[1024, 5.0]]\n"
        "busy2 = [[1024, 9.0]]\n",
        "calibration[0].busy2",
        "add curve2",
    ),
    (
        "calibration-busy-not-ascending",
        'device = "cpu"\n' + GOOD_LAYER + "\n[[calibration]]\nmesh = [2, 2]\ncurve1 = [[1024, 5.0]]\n"
        "busy1 = [[1024, 9.0], [64, 9.0]]\n",
        "calibration[0].busy1[1]",
        "bytes ascending",
    ),
    ("bad-toml", 'device = "h100\n', "file", "fix the TOML syntax"),
]


@pytest.mark.parametrize("case,body,key,fix", CASES, ids=[c[0] for c in CASES])
def test_malformed_cluster_file(tmp_path, capsys, case, body, key, fix):
    path = tmp_path / f"{case}.toml"
    path.write_text(textwrap.dedent(body))
    code = main(["topology", "--cluster", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert str(path) in err and f": {key}:" in err and fix in err, err


def test_unknown_preset_and_missing_file(capsys):
    assert main(["topology", "--cluster", "atp-ic99"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset" in err and "meshpilot presets" in err
    assert main(["topology", "--cluster", "/nonexistent/c.toml"]) == 2
    err = capsys.readouterr().err
    assert "/nonexistent/c.toml: file: does not exist" in err
    assert main(["topology", "--cluster", "atp-ic3:8"]) == 2  # fixed-size preset given a size
    assert "fixed size" in capsys.readouterr().err


def test_mesh_larger_than_cluster_is_one_line(capsys):
    assert main(["topology", "--cluster", "atp-ic3", "--devices", "16"]) == 2
    assert "has 8 devices" in capsys.readouterr().err


def test_subprocess_prints_no_traceback(tmp_path):
    path = tmp_path / "neg.toml"
    path.write_text('device = "h100"\n' + GOOD_LAYER.replace("p2p_GBps = 100.0", "p2p_GBps = -5.0"))
    r = subprocess.run(
        [sys.executable, "-m", "meshpilot.cli.main", "topology", "--cluster", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "layers[0].p2p_GBps" in r.stderr


def test_topology_table_of_a_one_rank_layer(tmp_path, capsys):
    path = tmp_path / "one.toml"
    path.write_text('device = "cpu"\n' + GOOD_LAYER.replace("ranks = 4", "ranks = 1"))
    assert main(["topology", "--cluster", str(path)]) == 0
    assert "—" in capsys.readouterr().out
