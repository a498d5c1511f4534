"""A few real training steps, parallel or single-device, on the same data: what `train` and `demo` run.

All paths build the model from the same seed and feed the same batches (a fixed generator), and step
`torch.optim.AdamW`, so their losses are comparable step by step: `train_single` (one device), `train_atp`
(ATP's 2D tensor parallelism on a mesh) and `train_plan` (a `meshpilot.plan` Plan run by
`meshpilot.parallelize`). `train_model` is the same loop for any model (``hf:<name>``, a factory, a zoo
model): single-device, or under a plan.

`device` is where the model runs (``cuda:LOCAL_RANK`` on a GPU, with an NCCL group). `precision` is how:
``fp32``; ``bf16`` (the model cast to bfloat16, AdamW's states with it); ``bf16-mixed`` (float32 master
weights and AdamW states, the forward and backward under ``torch.autocast(bfloat16)``). A plan carries its
own precision, which ``meshpilot.parallelize`` follows (the casts of bf16-mixed are in the plan's graph).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshpilot.models.gpt import GPT, GPTConfig


@dataclass(frozen=True)
class StepLog:
    """One optimizer step: its loss (before the update) and wall time."""

    step: int
    loss: float
    seconds: float


def batches(cfg: GPTConfig, steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` (idx, targets) batches of [batch, seq] tokens from a fixed generator."""
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def reference_model(cfg: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def autocast(precision: str | None, device: Any = "cpu"):
    """bfloat16 autocast for ``bf16-mixed`` on `device`'s type; no-op otherwise."""
    if precision == "bf16-mixed":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _as_precision(model: torch.nn.Module, precision: str | None) -> torch.nn.Module:
    if precision == "bf16":
        model.to(torch.bfloat16)
    elif precision in ("fp32", "bf16-mixed"):
        model.float()  # master weights in float32
    return model


def _adamw_steps(
    model: torch.nn.Module,
    cfg: GPTConfig,
    steps: int,
    seed: int,
    lr: float,
    device: Any = "cpu",
    precision: str | None = None,
) -> list[StepLog]:
    """`steps` AdamW steps of `model` (whose call returns the replicated loss) on the full global batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    logs = []
    for i, (idx, tgt) in enumerate(batches(cfg, steps, seed)):
        idx, tgt = idx.to(device), tgt.to(device)
        t0 = time.perf_counter()
        with autocast(precision, device):
            loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        logs.append(StepLog(i, float(loss.detach().float()), time.perf_counter() - t0))
    return logs


def train_single(
    cfg: GPTConfig, steps: int, seed: int = 0, lr: float = 1e-3, device: Any = "cpu", precision: str | None = None
) -> list[StepLog]:
    """The single-device reference."""
    model = _as_precision(reference_model(cfg, seed).to(device), precision)
    return _adamw_steps(model, cfg, steps, seed, lr, device, precision)


def train_atp(
    cfg: GPTConfig,
    mesh_shape: tuple[int, int],
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    chunks: int = 1,
    device: Any = "cpu",
    precision: str | None = None,
) -> list[StepLog]:
    """ATP tensor parallelism on DeviceMesh(mesh_shape) (data parallel over the rest of the world).

    Call on every rank of an initialised process group. With data parallelism each replica takes an equal
    slice of every batch, so the averaged loss is the single-device loss.
    """
    import torch.distributed as dist

    from meshpilot.runtime.atp import ATPGPT, init_meshes

    device = torch.device(device)
    meshes = init_meshes(mesh_shape, device.type)
    model = ATPGPT.from_gpt(_as_precision(reference_model(cfg, seed), precision), meshes.tp, chunks=chunks)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    dp, dp_rank = meshes.dp_size, (0 if meshes.dp is None else meshes.dp.get_local_rank())
    logs = []
    for i, (idx, tgt) in enumerate(batches(cfg, steps, seed)):
        idx, tgt = idx.chunk(dp)[dp_rank].to(device), tgt.chunk(dp)[dp_rank].to(device)
        t0 = time.perf_counter()
        with autocast(precision, device):
            loss = model(idx, tgt)
        loss.backward()
        model.sync_gradients()
        opt.step()
        opt.zero_grad()
        seen = loss.detach().float().clone()
        if meshes.dp is not None:
            dist.all_reduce(seen, group=meshes.dp.get_group())
            seen /= dp
        logs.append(StepLog(i, float(seen), time.perf_counter() - t0))
    return logs


def train_plan(
    cfg: GPTConfig, plan, steps: int, seed: int = 0, lr: float = 1e-3, graph=None, device: Any = "cpu"
) -> list[StepLog]:
    """A :class:`~meshpilot.planner.plan.Plan` for the GPT `cfg` run by ``meshpilot.parallelize``.

    Call on every rank of an initialised process group whose size is the plan's device count. Every rank
    passes the full global batch (the runtime takes its local slice) and gets the replicated loss, which is
    the single-device loss. `graph` reuses a capture of the model at the plan's shapes.
    """
    from meshpilot.runtime.spmd import parallelize

    model = parallelize(reference_model(cfg, seed), plan, device=device, graph=graph)  # it follows plan.precision
    return _adamw_steps(model, cfg, steps, seed, lr, device)


def train_model(
    build: Callable[[Any], Any],
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    *,
    plan: Any = None,
    device: Any = "cpu",
    precision: str | None = None,
) -> list[StepLog]:
    """`steps` AdamW steps of any model: ``build(device)`` returns a
    :class:`~meshpilot.models.sources.Built` (seeded: the same on every rank), fed ``built.batches``.

    With `plan` (every rank of an initialised group) the model runs under ``meshpilot.parallelize`` in the
    plan's precision; without, on `device` alone in `precision` (the single-device reference). The RNG is
    reseeded before each step, so dropout draws the same numbers in both.
    """
    built = build(torch.device(device))
    model = built.model
    if plan is not None:
        from meshpilot.runtime.spmd import parallelize

        precision = None  # the plan's graph has it
        model = parallelize(model, plan)
    else:
        model = _as_precision(model, precision)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    logs = []
    for i, inputs in enumerate(built.batches(steps, seed)):
        torch.manual_seed(seed + 1000 + i)
        t0 = time.perf_counter()
        with autocast(precision, device):
            out = model(*inputs)
        loss = _loss_of(out)
        loss.backward()
        opt.step()
        opt.zero_grad()
        logs.append(StepLog(i, float(loss.detach().float()), time.perf_counter() - t0))
    return logs


def _loss_of(out: Any) -> torch.Tensor:
    """The loss in a model's output: itself, a tuple's first element or an output's ``.loss``."""
    if not isinstance(out, torch.Tensor) and getattr(out, "loss", None) is not None:
        out = out.loss
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out
