"""planner.decide: the one-stage floor, the default microbatches and the choice (pure, no search)."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshpilot.graph.capture import capture
from meshpilot.models import gpt_config
from meshpilot.models.gpt import GPT
from meshpilot.planner.accounting import saved_values
from meshpilot.planner.decide import (
    Choice,
    ModelBytes,
    default_microbatches,
    model_bytes,
    one_stage_floor,
    weigh,
)
from meshpilot.planner.stack import capture_stack


def _gpt(layers: int, batch: int):
    cfg = gpt_config("gpt-tiny", layers=layers, batch=batch)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.zeros((cfg.batch, cfg.seq), dtype=torch.long, device="meta")
    return model, (tokens, tokens)


def test_model_bytes_are_the_graphs_and_a_stack_counts_every_block():
    model, inputs = _gpt(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = capture(model, inputs)
        stack = capture_stack(model, inputs)
    mb = model_bytes(whole)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert mb.state == pytest.approx(3 * params)  # weights and AdamW's two states
    saved = sum(whole[s].outputs[i].nbytes for s, i in saved_values(whole))
    assert mb.per_microbatch == pytest.approx(saved + sum(x.nbytes for x in whole.input_infos))
    assert mb.rows == 8
    of_stack = model_bytes(stack)  # 4 blocks captured, the middle one standing for the 4 middle blocks
    assert stack.kept < stack.blocks
    assert of_stack.state == pytest.approx(mb.state) and of_stack.per_microbatch == pytest.approx(mb.per_microbatch)


def test_floors_and_default_microbatches():
    mb = ModelBytes(state=64.0, per_microbatch=32.0, rows=2)  # 16 bytes a row
    assert one_stage_floor(mb, 4, 8) == (64 + 8 * 32) / 4
    # a batch of 64 rows on 4 devices: B microbatches hold (64 + 16 · 64 / B) / 4 per device at least
    assert default_microbatches(mb, 4, 64, capacity=2 * 80.0) == 4  # (64 + 256) / 4 = 80: half of 160
    assert default_microbatches(mb, 4, 64, capacity=2 * 24.0) == 32  # B = 16: (64 + 64) / 4 = 32 > 24; 32: 24
    assert default_microbatches(mb, 4, 64, capacity=1.0) == 64  # nothing is enough: the most there are
    assert default_microbatches(mb, 4, 6, capacity=1e9) == 1  # no power of two ≥ 4 divides 6


def test_weigh_keeps_the_shorter_step_one_stage_on_a_tie():
    assert weigh(1.0, 2.0, "one", "pp").choice is Choice.ONE_STAGE
    assert weigh(2.0, 1.0, "one", "pp").choice is Choice.PIPELINE
    assert weigh(1.0, 1.0, "one", "pp").choice is Choice.ONE_STAGE
    w = weigh(None, 3.0, "one stage does not fit", "the pipeline")
    assert w.choice is Choice.PIPELINE and w.why == "chose the pipeline; one stage does not fit"
    assert weigh(1.0, None, "one stage", "no pipeline").why == "chose one stage; weighed against no pipeline"
    with pytest.raises(ValueError):
        weigh(None, None, "", "")


def test_the_floor_with_recomputation_is_below_plain_and_a_lower_bound_of_the_recomputed_graph():
    """Where the one-stage search may recompute, the floor counts what the backward keeps with every block
    recomputed: less than as captured, never more than the recomputed graph really keeps (a lower bound), and
    a stack counts it as the whole model does."""
    from meshpilot.planner.recompute import apply, regions

    model, inputs = _gpt(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole = capture(model, inputs)
        stack = capture_stack(model, inputs)
    plain, rec = model_bytes(whole), model_bytes(whole, recompute=True)
    assert rec.state == plain.state and rec.per_microbatch < 0.6 * plain.per_microbatch
    recomputed = apply(whole, [r.name for r in regions(whole) if r.random is None])
    kept = sum(recomputed[s].outputs[i].nbytes for s, i in saved_values(recomputed))
    assert rec.per_microbatch <= kept + sum(x.nbytes for x in whole.input_infos) + 1e-6
    assert model_bytes(stack, recompute=True).per_microbatch == pytest.approx(rec.per_microbatch)
