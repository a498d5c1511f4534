"""The approximate repeated-block stage table (``planner.stack`` module docstring, 4): its chosen stages searched
again under their own caps, and its plans against the exact table's (every cap level of every logical mesh)."""

from __future__ import annotations

import pytest

from meshpilot.errors import UserError
from meshpilot.models import _gpt_builder
from meshpilot.models.gpt import gpt_tiny
from meshpilot.planner.pipeline import plan_pipeline, stage_memory
from meshpilot.planner.stack import Stack, StageCosting, capture_stack, compose_stage
from meshpilot.planner.stage import StagePlanner


@pytest.fixture(scope="module")
def stack() -> Stack:
    """A 6-block GPT traced with 4 of its blocks (``capture_stack``), 4 microbatches of 4 sequences."""
    got = capture_stack(*_gpt_builder(gpt_tiny(layers=6, batch=16, hidden=256))("meta", 4))
    assert isinstance(got, Stack) and got.kept < got.blocks
    return got


@pytest.fixture(scope="module")
def roomy(stack: Stack) -> float:
    """The largest stage's Eq. 5 memory of the exact table's plan on 4 devices with the whole device."""
    p = plan_pipeline(stack, "alpa-p3x8", microbatches=4, num_devices=4, costing="exact", workers=1)
    return max(st.memory_bytes for st in p.stages)


@pytest.mark.parametrize(
    ("cluster", "n", "share"),
    [("alpa-p3x8", 8, 1.0), ("alpa-p3x8", 8, 0.5), ("hidup-2x4-10g", 8, 0.5), ("atp-ic3", 4, 1.0)],
)
def test_approximate_table_within_one_percent_of_the_exact_table(stack, roomy, cluster, n, share):
    """On a few clusters and memories (half the memory makes the exact table's blocks descend cap levels), the
    approximate table's final step is within 1 % of the exact table's, and its plan says how it was costed."""
    memory = share * roomy
    kw = dict(microbatches=4, num_devices=n, memory_bytes=memory, workers=1)
    fast = plan_pipeline(stack, cluster, costing="approximate", **kw)
    exact = plan_pipeline(stack, cluster, costing="exact", **kw)
    assert fast.costing == StageCosting.STACK_APPROX and exact.costing == StageCosting.STACK
    assert "approximate-then-exact stage costs" in str(fast)
    assert fast.step_s == pytest.approx(exact.step_s, rel=0.01)
    assert all(st.memory_bytes <= memory * (1 + 1e-9) for st in fast.stages)


def test_chosen_stages_are_searched_again_under_their_own_caps(stack, roomy):
    """With half the memory, each stage of the approximate plan costs what an exact search of the same stage
    gives: its block on the stage's logical mesh at the device's capacity, then under the caps its k blocks and
    in-flight microbatches ask for, the fastest composition that fits Eq. 5 (searched here on a fresh planner,
    as the exact table's levels would) — never a table entry slower than that search."""
    memory = 0.5 * roomy
    B = 4
    fast = plan_pipeline(stack, "alpa-p3x8", microbatches=B, num_devices=8, memory_bytes=memory, workers=1,
                         costing="approximate")  # fmt: skip
    sp = StagePlanner(stack.graph, "alpa-p3x8")
    block = (stack.middle, stack.middle + 1)
    for st in fast.stages:
        a, b = st.layers
        _, k, _ = stack.parts(a, b)
        best, cap = None, memory
        for _ in range(5):
            c = compose_stage(sp, stack, a, b, st.ranks, st.mesh_shape, microbatches=B, capacity=memory,
                              block_capacity=cap)  # fmt: skip
            if stage_memory(c, st.in_flight) <= memory:
                best = c
                break
            if not k:
                break
            m = sp.plan_with_memory(*block, st.ranks, st.mesh_shape, microbatches=B, capacity=cap)[1]
            carry = max(m.saved, m.grads)
            need = max(k * (m.static + carry) - carry + m.live_peak + (st.in_flight - 1) * k * m.saved,
                       k * (m.static + m.grads + m.update_temp))  # fmt: skip
            own = max(m.static + m.live_peak, m.static + m.grads + m.update_temp)
            cap = min(0.9 * cap, own * memory / need)
        assert best is not None
        assert st.cost.time.total_s <= best.time.total_s * (1 + 1e-9)
        assert stage_memory(st.cost, st.in_flight) <= memory * (1 + 1e-9)


def test_costing_is_checked(stack):
    with pytest.raises(UserError, match="costing='cheap'"):
        plan_pipeline(stack, "alpa-p3x8", microbatches=4, num_devices=4, costing="cheap")
