"""transformers' experts interface under ``experts_implementation="meshpilot"`` (:mod:`meshpilot.ops.moe`) for
layouts beyond Mixtral's, in one process.

Experts stored transposed (Aria's ``[E, h, 2f]``) run as the op on transposed views and equal transformers'
own eager loop (loss and every gradient); experts that gate ``[gate; up]`` their own way (a class overriding
``_apply_gate``) run transformers' ``batched_mm`` path with one warning, instead of being computed as
``act(gate) * up``; GPT-OSS's tiny model (biases, interleaved clamped gate) then equals its eager loop.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401 - a test dependency (pyproject test extra): never skipped silently

TOL = 1e-5


def _aria(impl: str):
    from meshpilot.models.hf_families import Family, build, no_dropout, tiny_overrides

    over = {**tiny_overrides("aria_text"), **no_dropout("aria_text"), "experts_implementation": impl}
    return build(Family("aria_text", "AriaTextForCausalLM", "causal"), over)


def _assert_same_loss_and_grads(got: tuple, want: tuple) -> None:
    """(loss, {name: gradient}) of two runs within TOL: the loss and every gradient, the same names."""
    assert abs(got[0] - want[0]) <= TOL
    assert got[1].keys() == want[1].keys()
    for n, g in want[1].items():
        assert (got[1][n] - g).abs().max().item() <= TOL, n


def test_transposed_experts_equal_the_eager_loop():
    got = {}
    for impl in ("eager", "meshpilot"):
        model, inputs = _aria(impl)
        experts = next(m for m in model.modules() if type(m).__name__ == "AriaExperts")
        assert experts.is_transposed and experts.config._experts_implementation == impl
        loss = model(*inputs)
        loss.backward()
        got[impl] = (loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    _assert_same_loss_and_grads(got["meshpilot"], got["eager"])


def test_experts_with_their_own_gate_run_transformers_path():
    from transformers.integrations.moe import use_experts_implementation

    from meshpilot.ops import moe
    from meshpilot.ops.moe import experts_forward

    @use_experts_implementation()
    class ClampedExperts(torch.nn.Module):
        def __init__(self, config) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(2, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.randn(2, 4, 4))
            self.act_fn = torch.nn.SiLU()

        def _apply_gate(self, gate_up_out: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=1.0)) * up

    cfg = transformers.MixtralConfig(hidden_size=4, intermediate_size=4)
    experts = ClampedExperts(cfg)
    x, idx, w = torch.randn(3, 4), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 1)
    moe._NOTED.clear()  # noted once per process: this test must see it
    with pytest.warns(UserWarning, match="ClampedExperts: these experts have a gate of their own.*batched_mm"):
        got = experts_forward(experts, x, idx, w)
    gate_up = x @ experts.gate_up_proj[0].T  # every token to expert 0 with weight 1: the clamped SwiGLU by hand
    gate, up = gate_up.chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate.clamp(max=1.0)) * up) @ experts.down_proj[0].T
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_gpt_oss_experts_equal_the_eager_loop():
    from meshpilot.models.hf_families import Family, build, no_dropout, tiny_overrides

    got = {}
    for impl in ("eager", "meshpilot"):
        over = {**tiny_overrides("gpt_oss"), **no_dropout("gpt_oss"), "experts_implementation": impl}
        model, inputs = build(Family("gpt_oss", "GptOssForCausalLM", "causal"), over)
        loss = model(*inputs)
        loss.backward()
        got[impl] = (loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    _assert_same_loss_and_grads(got["meshpilot"], got["eager"])
