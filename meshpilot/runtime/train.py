"""A few real training steps, parallel or single-device, on the same data: what `train` and `demo` run.

All paths build the model from the same seed and feed the same batches, and step `torch.optim.AdamW`, so
their losses are comparable step by step: `train_single` (one device), `train_atp`
(ATP's 2D tensor parallelism on a mesh) and `train_plan` (a `meshpilot.plan` Plan run by
`meshpilot.parallelize`). `train_model` is the same loop for any model (``hf:<name>``, a factory, a zoo
model): single-device, or under a plan. A ``Plan`` of one stage or of a pipeline's runs through
``meshpilot.parallelize``, whose module's ``train_step`` is the step on every rank (a pipeline's loss sent from
its last stage), so one loop (:func:`_loop`) trains, checkpoints and resumes either.

`device` is where the model runs (``cuda:LOCAL_RANK`` on a GPU, with an NCCL group). `precision` is how:
``fp32``; ``bf16`` (the model cast to bfloat16, AdamW's states with it); ``bf16-mixed`` (float32 master
weights and AdamW states, the forward and backward under ``torch.autocast(bfloat16)``). A plan carries its
own precision, which ``meshpilot.parallelize`` follows (the casts of bf16-mixed are in the plan's graph).

**Data.** The synthetic batches are a pure function of (seed, sample index): sample j's tokens come from
:func:`sample_generator` ``(seed, j)``, and a step at data position p (samples consumed so far) takes
samples p .. p + batch - 1. Every rank builds the same global batch (the runtime takes its slice), so a run
resumed at position p on another world size or plan sees exactly the batches the uninterrupted run saw.

**Checkpoints.** `train_plan` and `train_model` take
``checkpoint=`` (a
:class:`~meshpilot.runtime.checkpoint.Checkpointing`): resume from its checkpoint before the first step,
save every N steps, after the last, and on SIGTERM (:mod:`meshpilot.runtime.checkpoint`). `on_step` sees
each step's log as it finishes (``train --json-out`` writes the curve as it goes).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from meshpilot.graph.capture import Precision
from meshpilot.models.gpt import GPT, GPTConfig
from meshpilot.runtime.data import ByteText


@dataclass(frozen=True)
class StepLog:
    """One optimizer step: its loss (before the update) and wall time."""

    step: int
    loss: float
    seconds: float

    @classmethod
    def of(cls, d: dict) -> StepLog:
        """A step as a checkpoint's manifest keeps it (``__dict__``, through JSON)."""
        return cls(int(d["step"]), float(d["loss"]), float(d["seconds"]))


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    """The optimizer every training path uses: AdamW with ``foreach`` — CUDA's default, and on CPU it
    spares DTensor parameters one trip through DTensor's dispatch per op per parameter (the per-parameter
    loop tripled the optimizer step of a 12-layer GPT: ``benchmarks/bench_program_overhead.py``)."""
    return torch.optim.AdamW(params, lr=lr, foreach=True)


def sample_generator(seed: int, index: int) -> torch.Generator:
    """The generator of sample `index` of the data seeded `seed`: its own stream, independent of the batch
    size, the step and the world size (the seed mixes both numbers through SHA-256)."""
    digest = hashlib.sha256(f"meshpilot-data:{seed}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def batch_at(
    cfg: GPTConfig, position: int, seed: int, data: ByteText | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (idx, targets) batch of [batch, seq] tokens at data position `position` (samples consumed): random
    tokens, or windows of the user's text `data` (``meshpilot.runtime.data``)."""
    if data is not None:
        tokens = data.batch(position, seed, cfg.batch, cfg.seq + 1)  # [batch, seq + 1]
    else:
        rows = [
            torch.randint(0, cfg.vocab, (cfg.seq + 1,), generator=sample_generator(seed, j))
            for j in range(position, position + cfg.batch)
        ]
        tokens = torch.stack(rows)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def batches(
    cfg: GPTConfig, steps: int, seed: int, start: int = 0, data: ByteText | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` consecutive (idx, targets) batches beginning at data position `start`."""
    return [batch_at(cfg, start + i * cfg.batch, seed, data) for i in range(steps)]


def reference_model(cfg: GPTConfig, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def autocast(precision: str | None, device: Any = "cpu"):
    """bfloat16 autocast for ``bf16-mixed`` on `device`'s type; no-op otherwise."""
    if precision == "bf16-mixed":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _as_precision(model: torch.nn.Module, precision: str | None) -> torch.nn.Module:
    own = Precision.of_label(precision)
    if own is not None and (cast := own.cast_dtype) is not None:
        model.to(cast)
    elif precision in (Precision.FP32, Precision.BF16_MIXED):
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
    *,
    checkpoint: Any = None,
    on_step: Callable[[StepLog], None] | None = None,
    data: ByteText | None = None,
    microbatches: int = 1,
) -> list[StepLog]:
    """`steps` AdamW steps of `model` (a parallelized model, or one whose call returns the loss) on the full
    global batches."""
    return _loop(
        model,
        lambda position: batch_at(cfg, position, seed, data),
        cfg.batch,
        steps,
        lr,
        device=device,
        precision=precision,
        checkpoint=checkpoint,
        on_step=on_step,
        microbatches=microbatches,
    )


def _loop(
    model: torch.nn.Module,
    batch_at_position: Callable[[int], tuple],
    batch_size: int,
    steps: int,
    lr: float,
    *,
    device: Any = "cpu",
    precision: str | None = None,
    reseed: int | None = None,
    checkpoint: Any = None,
    on_step: Callable[[StepLog], None] | None = None,
    microbatches: int = 1,
) -> list[StepLog]:
    """The step loop every path shares: AdamW on `model`, step i at data position (samples consumed) p
    taking ``batch_at_position(p)``; `reseed` s reseeds the RNG with s + i before step i. `microbatches` > 1
    (single-device references of microbatched plans) cuts each batch along dim 0 and accumulates the gradients
    of loss / M in order, the loss being the microbatches' mean. With `checkpoint`
    the loop starts where its checkpoint left off and saves as it is told; the logs it returns are the whole
    run's, the resumed steps' included (their losses from the checkpoint)."""
    opt = adamw(model.parameters(), lr)
    logs: list[StepLog] = []
    start, position = 0, 0
    ctx = checkpoint if checkpoint is not None else contextlib.nullcontext()
    with ctx:
        if checkpoint is not None:
            start, position, done = checkpoint.restore(model, opt)
            logs = [StepLog.of(d) for d in done]
        for i in range(start, steps):
            inputs = tuple(x.to(device) for x in batch_at_position(position))
            if reseed is not None:
                torch.manual_seed(reseed + i)
            t0 = time.perf_counter()
            if hasattr(model, "train_step"):  # under a plan, one-stage or pipelined: the step on every rank
                loss = model.train_step(*inputs)
            elif microbatches == 1:
                with autocast(precision, device):
                    out = model(*inputs)
                loss = _loss_of(out)
                loss.backward()
            else:  # gradient accumulation, as a microbatched plan's schedule runs the step (one device only)
                parts = []
                for chunk in zip(*(x.chunk(microbatches) for x in inputs)):
                    with autocast(precision, device):
                        part = _loss_of(model(*chunk))
                    (part / microbatches).backward()
                    parts.append(part.detach())
                loss = torch.stack(parts).mean()
            opt.step()
            opt.zero_grad()
            log = StepLog(i, float(loss.detach().float()), time.perf_counter() - t0)
            logs.append(log)
            position += batch_size
            if on_step is not None:
                on_step(log)
            if checkpoint is not None:
                checkpoint.after_step(
                    model, opt, step=i + 1, position=position, logs=[x.__dict__ for x in logs], last=i + 1 == steps
                )
    return logs


def train_single(
    cfg: GPTConfig,
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    device: Any = "cpu",
    precision: str | None = None,
    data: ByteText | None = None,
    microbatches: int = 1,
) -> list[StepLog]:
    """The single-device reference (with `microbatches`: gradient accumulation, see ``_loop``)."""
    model = _as_precision(reference_model(cfg, seed).to(device), precision)
    return _adamw_steps(model, cfg, steps, seed, lr, device, precision, data=data, microbatches=microbatches)


def train_atp(
    cfg: GPTConfig,
    mesh_shape: tuple[int, int],
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    chunks: int = 1,
    device: Any = "cpu",
    precision: str | None = None,
    *,
    on_step: Callable[[StepLog], None] | None = None,
    data: ByteText | None = None,
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
    opt = adamw(model.parameters(), lr)
    dp, dp_rank = meshes.dp_size, (0 if meshes.dp is None else meshes.dp.get_local_rank())
    logs = []
    for i, (idx, tgt) in enumerate(batches(cfg, steps, seed, data=data)):
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
        if on_step is not None:
            on_step(logs[-1])
    return logs


def train_plan(
    cfg: GPTConfig,
    plan,
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    graph=None,
    device: Any = "cpu",
    *,
    checkpoint: Any = None,
    on_step: Callable[[StepLog], None] | None = None,
    data: ByteText | None = None,
) -> list[StepLog]:
    """A plan for the GPT `cfg` — a :class:`~meshpilot.planner.plan.Plan`, one stage or a pipeline — run by
    ``meshpilot.parallelize`` (in the plan's precision).

    Call on every rank of an initialised process group whose size is the plan's device count. Every rank
    passes the full global batch (the runtime takes its local slice) and gets the loss on every rank, which is
    the single-device loss (of gradient accumulation over the plan's microbatches). `graph` reuses a capture
    of the model at one microbatch. `checkpoint`: see the module docstring.
    """
    from meshpilot.runtime.spmd import parallelize

    example = batch_at(cfg, 0, seed, data)  # a pipeline's stages are cut for one microbatch of this batch
    model = parallelize(reference_model(cfg, seed), plan, device=device, graph=graph, inputs=example)
    return _adamw_steps(model, cfg, steps, seed, lr, device, checkpoint=checkpoint, on_step=on_step, data=data)


def train_model(
    build: Callable[[Any], Any],
    steps: int,
    seed: int = 0,
    lr: float = 1e-3,
    *,
    plan: Any = None,
    device: Any = "cpu",
    precision: str | None = None,
    checkpoint: Any = None,
    on_step: Callable[[StepLog], None] | None = None,
    data: ByteText | None = None,
    microbatches: int = 1,
    graph: Any = None,
) -> list[StepLog]:
    """`steps` AdamW steps of any model: ``build(device)`` returns a
    :class:`~meshpilot.models.sources.Built` (seeded: the same on every rank), fed ``built.batches``.

    With `plan` (every rank of an initialised group; a one-stage or a pipeline plan, `graph` a capture of the
    model at one microbatch) the model runs under ``meshpilot.parallelize`` in the plan's precision; without,
    on `device` alone in `precision` (the single-device reference). The RNG is
    reseeded before each step, so dropout draws the same numbers in both. `checkpoint`, `on_step`: see the
    module docstring.
    """
    built = build(torch.device(device))
    model = built.model
    source = _batch_source(built, seed, data)
    if plan is not None:
        from meshpilot.runtime.spmd import parallelize

        precision = None  # the plan's graph has it
        model = parallelize(model, plan, graph=graph, inputs=source(0))
    else:
        model = _as_precision(model, precision)
    return _loop(
        model,
        source,
        built.batch_size,
        steps,
        lr,
        device=device,
        precision=precision,
        reseed=seed + 1000,
        checkpoint=checkpoint,
        on_step=on_step,
        microbatches=1 if plan is not None else microbatches,
    )


def _batch_source(built: Any, seed: int, data: ByteText | None) -> Callable[[int], tuple]:
    """``position -> batch`` of a built model: `built`'s own batches from sample `position`, or with `data` a
    token model's [batch, seq] input_ids read from the text there, and labels = input_ids (module docstring)."""
    if data is None:
        return lambda position: built.batches(1, seed, position)[0]
    b, t = built.inputs[0].shape

    def batch_at_position(position: int) -> tuple:
        ids = data.batch(position, seed, b, t)
        return ids, ids.clone()

    return batch_at_position


def _loss_of(out: Any) -> torch.Tensor:
    """The loss in a model's output: itself, a tuple's first element or an output's ``.loss``."""
    if not isinstance(out, torch.Tensor) and getattr(out, "loss", None) is not None:
        out = out.loss
    if isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out
