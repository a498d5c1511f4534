"""The progress line of `meshpilot train` (``meshpilot.runtime.progress``): its numbers from a real plan."""

from __future__ import annotations

import pytest

from meshpilot.models import builtin_models
from meshpilot.planner.auto import plan
from meshpilot.planner.plan import Plan
from meshpilot.runtime.progress import Throughput, seconds_text


@pytest.fixture(scope="module")
def gpt_plan():
    model, inputs = builtin_models()["gpt-tiny"].build("meta", None)
    return plan(model, inputs, "dgx-h100", mesh_shape=(2, 2), microbatches=2)


def test_a_plan_knows_its_flops_tokens_and_peak(gpt_plan):
    (b, t), dtype = gpt_plan.input_shapes[0]  # one microbatch of token ids
    rate = Throughput.of_plan(Plan.single(gpt_plan), steps=10, world=4)
    assert (rate.items, rate.unit) == (2 * b * t, "tok")  # both microbatches
    assert rate.peak_flops == 67e12  # an H100's float32 peak, the dgx-h100 preset's device
    # the model's FLOPs: at least the 6 N D of its matmuls' parameters (N weights x D tokens x 6), not wildly more
    n = sum(
        p.numel() for name, p in builtin_models()["gpt-tiny"].build("meta", None)[0].named_parameters() if p.dim() == 2
    )
    assert 6 * n * rate.items <= rate.step_flops <= 20 * 6 * n * rate.items
    assert rate.planned_s == gpt_plan.time.overlapped_s > 0


def test_mfu_is_model_flops_over_the_worlds_peak():
    rate = Throughput(items=4096, unit="tok", steps=4, world=8, step_flops=8e12, peak_flops=1e12, planned_s=0.5)
    assert rate.mfu(2.0) == pytest.approx(8e12 / 2.0 / 8e12)  # 0.5
    assert Throughput(items=1, unit="tok", steps=1).mfu(1.0) is None  # no plan: no MFU
    line = rate.line(1, 2.5, 2.0)
    assert line.startswith("step 1: loss 2.500000 (2.00 s; plan 500.0 ms on ")
    assert "| 2,048 tok/s |" in line and "| MFU 50.00% |" in line and line.endswith("2/4 █████░░░░░")


def test_samples_for_models_whose_input_is_not_tokens():
    class P:  # a plan's fields the line reads
        input_shapes = (((16, 3, 8, 8), "torch.float32"),)
        microbatches, cluster, step_s = 1, "c", 1e-3
        intra = (type("S", (), {"step_flops": 1e9, "peak_flops": 1e12})(),)

    rate = Throughput.of_plan(P(), steps=2, world=2)
    assert (rate.items, rate.unit) == (16, "samples")
    assert [seconds_text(x) for x in (3.4, 0.1824, 0.00021, 2e-5)] == ["3.40 s", "182.4 ms", "0.21 ms", "20.0 µs"]
