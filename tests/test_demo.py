"""`meshpilot demo`, the README's first command, end to end: topology, ATP, a plan for gpt-tiny on 4 devices,
its simulated timeline, then real training with that plan on 4 gloo processes (torchrun), checkpointed and resumed
under a plan on another mesh, next to the single-device loss."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist


def test_demo_plans_then_trains_with_the_single_device_loss(tmp_path):
    env = dict(os.environ, COLUMNS="160", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "meshpilot.cli.main", "demo", "--steps", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    for part in ("1. The cluster", "2. ATP's mesh search", "3. Automatic sharding", "4. Real training"):
        assert part in out, part
    assert "Predicted step time" in out and "Memory per device" in out and "saved the plan to" in out
    assert "train --plan" in out and "--resume" in out
    header = next(line for line in out.splitlines() if "loss, 4 processes" in line)
    assert "loss, 1 device" in header and "|difference|" in header
    table = out.split("loss, 4 processes")[1]
    row = r"│\s+(\d+)\s+│\s+\(([\d, ]+)\)( resumed)?\s+│\s+([\d.]+)\s+│\s+([\d.]+)\s+│\s+([\d.e+-]+)\s+│"
    rows = re.findall(row, table)
    assert [int(s) for s, *_ in rows] == [0, 1, 2]
    # steps 0 on the planned mesh with a checkpoint, then resumed from it on another mesh
    assert [bool(r[2]) for r in rows] == [False, True, True] and rows[0][1] != rows[1][1]
    for _, _, _, par, single, diff in rows:
        assert abs(float(par) - float(single)) <= 1e-5 and float(diff) <= 1e-5
    assert "the same loss as the single-device model" in out and "across the checkpoint" in out
    png = re.search(r"its timeline: (\S+\.png)", out.replace("\n", ""))
    assert png
    with open(png.group(1), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.iterdir()) == []  # the plan went to a temporary folder
