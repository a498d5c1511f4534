"""A few real training steps, parallel or single-device, on the same data: what `train` and `demo` run.

All paths build the model from the same seed and feed the same batches (a fixed generator), and step
`torch.optim.AdamW`, so their losses are comparable step by step: `train_single` (one device), `train_atp`
(ATP's 2D tensor parallelism on a mesh) and `train_plan` (a `meshpilot.plan` Plan run by
`meshpilot.parallelize`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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


def _adamw_steps(model: torch.nn.Module, cfg: GPTConfig, steps: int, seed: int, lr: float) -> list[StepLog]:
    """`steps` AdamW steps of `model` (whose call returns the replicated loss) on the full global batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    logs = []
    for i, (idx, tgt) in enumerate(batches(cfg, steps, seed)):
        t0 = time.perf_counter()
        loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        logs.append(StepLog(i, float(loss.detach()), time.perf_counter() - t0))
    return logs


def train_single(cfg: GPTConfig, steps: int, seed: int = 0, lr: float = 1e-3) -> list[StepLog]:
    """The single-device reference."""
    return _adamw_steps(reference_model(cfg, seed), cfg, steps, seed, lr)


def train_atp(
    cfg: GPTConfig, mesh_shape: tuple[int, int], steps: int, seed: int = 0, lr: float = 1e-3, chunks: int = 1
) -> list[StepLog]:
    """ATP tensor parallelism on DeviceMesh(mesh_shape) (data parallel over the rest of the world).

    Call on every rank of an initialised process group. With data parallelism each replica takes an equal
    slice of every batch, so the averaged loss is the single-device loss.
    """
    import torch.distributed as dist

    from meshpilot.runtime.atp import ATPGPT, init_meshes

    meshes = init_meshes(mesh_shape)
    model = ATPGPT.from_gpt(reference_model(cfg, seed), meshes.tp, chunks=chunks)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    dp, dp_rank = meshes.dp_size, (0 if meshes.dp is None else meshes.dp.get_local_rank())
    logs = []
    for i, (idx, tgt) in enumerate(batches(cfg, steps, seed)):
        idx, tgt = idx.chunk(dp)[dp_rank], tgt.chunk(dp)[dp_rank]
        t0 = time.perf_counter()
        loss = model(idx, tgt)
        loss.backward()
        model.sync_gradients()
        opt.step()
        opt.zero_grad()
        seen = loss.detach().clone()
        if meshes.dp is not None:
            dist.all_reduce(seen, group=meshes.dp.get_group())
            seen /= dp
        logs.append(StepLog(i, float(seen), time.perf_counter() - t0))
    return logs


def train_plan(cfg: GPTConfig, plan, steps: int, seed: int = 0, lr: float = 1e-3, graph=None) -> list[StepLog]:
    """A :class:`~meshpilot.planner.plan.Plan` for the GPT `cfg` run by ``meshpilot.parallelize``.

    Call on every rank of an initialised process group whose size is the plan's device count. Every rank
    passes the full global batch (the runtime takes its local slice) and gets the replicated loss, which is
    the single-device loss. `graph` reuses a capture of the model at the plan's shapes.
    """
    from meshpilot.runtime.spmd import parallelize

    return _adamw_steps(parallelize(reference_model(cfg, seed), plan, graph=graph), cfg, steps, seed, lr)
