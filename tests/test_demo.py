"""`meshpilot demo`, the README's first command, end to end: topology, ATP, a plan for gpt-tiny on N devices,
its simulated timeline, then real training with that plan on N gloo processes (torchrun), checkpointed and resumed
under a plan on another mesh, next to the single-device loss.

The tiers (tests/tiers.py): the full matrix runs the demo as the README does (``--procs 4``: two torchrun launches
of 4 ranks); the default tier with ``--procs 2``: the same code path end to end (plan over every 2D mesh, save,
timeline, a torchrun launch with a checkpoint, a second resuming on the other mesh, (2, 1) against (1, 2), the
losses against one device), with 4 fewer interpreters that import torch, capture the model and record its programs.
A 4-rank resume under another mesh and plan is checked in the default tier by tests/test_checkpoint.py
(test_resume_under_another_plan_equals_the_uninterrupted_run: (2, 2) to (4, 1), in the rank pool)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from tiers import params

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("procs", params([4, 2], default={2}))
def test_demo_plans_then_trains_with_the_single_device_loss(tmp_path, procs):
    env = dict(os.environ, COLUMNS="160", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "meshpilot.cli.main", "demo", "--steps", "3", "--procs", str(procs)],
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
    header = next(line for line in out.splitlines() if f"loss, {procs} processes" in line)
    assert "loss, 1 device" in header and "|difference|" in header
    table = out.split(f"loss, {procs} processes")[1]
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
