"""What planning leaves out to be fast (issue 33 item 4) leaves its answers as they were: the ZeRO post-pass priced
once per repeated parameter is the pass priced per parameter, and a model whose forward reads no value is planned
without defining the guard's custom op, which a saved plan's ``meshpilot.guard`` target still finds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch


def _bench(layers: int, h: int):
    from meshpilot.models.zoo import PlanBenchTransformer

    with torch.device("meta"):
        model = PlanBenchTransformer(layers, h, 4)
    return model, (torch.empty(8, 64, h, device="meta"),)


def test_the_zero_pass_prices_each_repeated_parameter_as_it_would_alone(monkeypatch):
    """The post-pass answers a parameter whose question a twin asked already from the twin's options; with every
    parameter priced on its own (no two keys alike) the plan is the same, switch for switch."""
    from meshpilot.planner import zero
    from meshpilot.planner.auto import plan

    model, inputs = _bench(4, 512)
    calls = []
    options = zero._options
    monkeypatch.setattr(zero, "_options", lambda *a: calls.append(1) or options(*a))
    shared = plan(model, inputs, "dgx-h100:2", mesh_shape=(4, 4), mappings=("row",))
    priced_shared = len(calls)
    monkeypatch.setattr(zero, "_same_options", lambda *a: object())  # every key its own: nothing shared
    alone = plan(model, inputs, "dgx-h100:2", mesh_shape=(4, 4), mappings=("row",))
    assert len(shared.zero) == 8 and 0 < priced_shared < len(calls) - priced_shared
    assert shared.zero == alone.zero
    assert shared.strategy_lines() == alone.strategy_lines()
    assert shared.time == alone.time and shared.memory == alone.memory


PLAN_ALONE = """
import sys, torch
from meshpilot import ops
from meshpilot.models.zoo import PlanBenchTransformer
from meshpilot.planner.auto import plan
with torch.device("meta"):
    model = PlanBenchTransformer(4, 64, 4)
p = plan(model, (torch.empty(8, 64, 64, device="meta"),), "dgx-h100:2", mesh_shape=(2, 4), mappings=("row",))
print("planned:", p.time.total_s > 0)
print("guard defined:", "meshpilot.ops.guard" in sys.modules or hasattr(torch.ops.meshpilot, "guard"))
print("guard found:", ops.own_op("meshpilot.guard.default") is not None)
"""


def test_a_plan_that_reads_no_value_leaves_the_guard_undefined_until_a_target_names_it():
    """A fresh process plans a model whose forward reads no tensor's value without defining ``meshpilot::guard``;
    a ``meshpilot.guard`` target read afterwards (a saved plan's) defines it and finds it."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-c", PLAN_ALONE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines == ["planned: True", "guard defined: False", "guard found: True"], lines
