"""The line ``meshpilot train`` prints after every step: loss, measured and planned step time, throughput, MFU.

::

    step 3: loss 4.152300 (182.4 ms; plan 0.21 ms on dgx-h100) | 5,612 tok/s | MFU 0.04% | 4/10 ████░░░░░░

- **Measured** step time: the step's wall seconds on rank 0 (forward, backward, optimizer step); the first step
  also records the runtime's programs (``meshpilot.runtime.program``) and is slower.
- **Planned**: ``Plan.step_s``, the cost model's step on the cluster the plan was made for (a plan made
  for H100s and run on CPU processes predicts the H100 step, which is what it says).
- **Throughput**: tokens per second when the model's first input is integer token ids ``[batch, seq]`` (every
  microbatch of the step), samples per second otherwise.
- **MFU** (model FLOP/s utilisation) = the stage plans' ``StagePlan.step_flops`` / measured seconds / (world
  size x ``StagePlan.peak_flops``): the model's own FLOPs (the captured graph's, not recomputation or
  communication) over the peak of the devices the plan was made for. Without a plan (ATP's layers), or with a
  plan saved before those fields existed, the MFU is left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BAR_WIDTH = 10


@dataclass(frozen=True)
class Throughput:
    """What one step processes and what its plan predicts: the numbers behind the progress line."""

    items: int
    """Tokens (or samples, see `unit`) in one step, all microbatches."""
    unit: str
    """``tok`` or ``samples``."""
    steps: int
    """Steps of the run (the bar's length)."""
    world: int = 1
    step_flops: float = 0.0
    """The model's FLOPs per step (``Plan.step_flops``); 0: unknown."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one planned device (``Plan.peak_flops``); 0: unknown."""
    planned_s: float = 0.0
    """The plan's predicted step (``Plan.step_s``); 0: no plan."""
    cluster: str = ""

    @classmethod
    def of_plan(cls, plan: Any, steps: int, world: int, items: int = 0) -> Throughput:
        """From a :class:`~meshpilot.planner.plan.Plan`: its first input (``Plan.input_shapes``: one microbatch)
        times its microbatches (`items` when it holds no stage plans to read them from), the stages' FLOPs
        added up, its predicted step (``Plan.step_s``) where it names its cluster."""
        shape, dtype = plan.input_shapes[0] if plan.input_shapes else ((), "float32")
        tokens = len(shape) == 2 and ("int" in dtype or "long" in dtype)
        per_mb = shape[0] * shape[1] if tokens else (shape[0] if shape else 0)
        stage_plans = plan.intra
        return cls(
            items=int(per_mb) * plan.microbatches if per_mb else items,
            unit="tok" if tokens or not per_mb else "samples",
            steps=steps,
            world=world,
            step_flops=sum(p.step_flops for p in stage_plans),
            peak_flops=stage_plans[0].peak_flops if stage_plans else 0.0,
            planned_s=plan.step_s if plan.cluster else 0.0,
            cluster=plan.cluster,
        )

    def mfu(self, seconds: float) -> float | None:
        """Model FLOP/s utilisation of a step that took `seconds` (module docstring), or None if unknown."""
        if not (self.step_flops and self.peak_flops and seconds > 0):
            return None
        return self.step_flops / seconds / (self.world * self.peak_flops)

    def line(self, step: int, loss: float, seconds: float) -> str:
        """The progress line of step `step` (0-based) whose loss is `loss` and which took `seconds`."""
        plan = f"; plan {seconds_text(self.planned_s)} on {self.cluster}" if self.planned_s else ""
        parts = [f"step {step}: loss {loss:.6f} ({seconds_text(seconds)}{plan})"]
        if self.items and seconds > 0:
            parts.append(f"{self.items / seconds:,.0f} {self.unit}/s")
        mfu = self.mfu(seconds)
        if mfu is not None:
            parts.append(f"MFU {mfu:.2%}" if mfu >= 1e-4 else f"MFU {mfu:.1e}")
        done = step + 1
        filled = round(BAR_WIDTH * done / self.steps) if self.steps else BAR_WIDTH
        parts.append(f"{done}/{self.steps} {'█' * filled}{'░' * (BAR_WIDTH - filled)}")
        return " | ".join(parts)


def seconds_text(s: float) -> str:
    """``182.4 ms``, ``0.21 ms``, ``3.40 s``: enough digits to compare a measured step with a planned one."""
    if s >= 1:
        return f"{s:.2f} s"
    ms = s * 1e3
    return f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms" if ms >= 0.1 else f"{ms * 1e3:.1f} µs"
