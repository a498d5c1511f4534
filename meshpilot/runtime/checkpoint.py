"""Checkpoints of a training run through ``torch.distributed.checkpoint`` (DCP), resumable under another plan.

**On disk.** One folder per run (``--checkpoint-dir DIR``), one sub-folder per saved step::

    DIR/step-2/                     a complete checkpoint: the state after 2 optimizer steps
        .metadata                   DCP's index: every tensor's global shape and which file holds which shard
        __0_0.distcp, __1_0.distcp  each rank's shards (DCP's FileSystemWriter, fsynced)
        meshpilot-checkpoint.json   the manifest, written last (see below)
    DIR/step-4.tmp/                 a save in progress, or one a crash interrupted: never read

**What is saved.** The model's state dict (every parameter as the DTensor it is under the plan, so each rank
writes only its shards, and the buffers, replicated, written once), the optimizer's (AdamW's ``exp_avg`` /
``exp_avg_sq`` DTensors beside their parameters, its ``step`` counts and param groups), through
``torch.distributed.checkpoint.state_dict.get_state_dict``, which names both by the model's parameter names.
The manifest holds what is not a tensor: the step, the data position (samples consumed, see
:func:`meshpilot.runtime.train.sample_generator`), the losses so far, the model's signature (every state
tensor's name, global shape and dtype), the random generator state, and where it was made (world size,
mesh, plan, seed).

**Completion protocol.** ``save`` writes into ``step-N.tmp`` (rank 0 first removes a stale one and creates
it; a barrier), every rank writes its shards with ``dcp.save`` (which returns once rank 0 has written
``.metadata`` after every rank's write), then rank 0 writes the manifest (temp file, fsync, rename) and
renames ``step-N.tmp`` to ``step-N`` (and fsyncs ``DIR``); a last barrier. The rename is the commit: a
process killed at any point before it (SIGKILL, a crash, a lost node) leaves only ``step-N.tmp``, which
:func:`newest` ignores, so the previous checkpoint stays the one ``--resume`` picks. The next run's start
(or the next save of that step) removes the leftover. DIR must be one folder every rank sees (a shared file
system across nodes).

**Newest complete.** :func:`newest` lists ``DIR/step-<N>`` folders (exactly that name, no suffix) whose
manifest reads as JSON with the same step, and takes the largest N.

**Resharding across plans.** DCP records every tensor by its global shape; at load each rank asks for the
pieces its own DTensor shards cover in the *current* plan, and DCP reads them from whichever saved shards
hold them. So a checkpoint saved by 8 ranks under a (2, 4) plan loads on 4 ranks under a (4, 1) plan (or on
one device): ``load`` builds the current model's and optimizer's state dicts (their DTensors in the new
layouts; the optimizer's states created by a zero-learning-rate step), has DCP fill them in place, and hands
them back with ``set_state_dict``. The signature is compared first: another model (a different size,
precision or architecture) is one line naming the first tensor that differs.

**Pipelines.** A pipeline (``runtime.pipeline_stages.PlannedPipelineModule``) has no one module whose state
``get_state_dict`` could name: each rank holds its stages' parameters, DTensors on the stage's submesh. Each
rank therefore writes those, its stages' persistent buffers and AdamW's states of its parameters, under the
model's parameter names, with param groups that name every parameter of the model (the same on every rank,
as ``get_state_dict`` names them for one module): together the ranks write what a one-stage run writes, so a
pipeline's checkpoint loads under another pipeline (each rank reads its new stages' names) or under a
one-stage plan, and a one-stage checkpoint under a pipeline. At load the optimizer's states are made by one
step of learning rate 0 on zero gradients (:func:`_init_optimizer_state`) and filled in place.

**Random state.** meshpilot's random ops (dropout) draw the mask of the whole tensor on every rank from the
same generator state, and ``parallelize`` checks that the ranks' states agree: the one meaningful state is
global. ``save`` keeps rank 0's CPU generator (and its CUDA generator when the model runs on a GPU) and
records whether every rank's agreed; ``load`` gives every rank that state, on any world size. Per-rank
streams that differ cannot carry across a change of world size (there is no rank k to give rank k's state
to); if the ranks' states differed at the save, ``load`` warns that every rank continues from rank 0's.

**SIGTERM.** :class:`Checkpointing` installs a handler that only sets a flag; after each step the ranks
agree (an all-reduce of the flag, so a signal that reached some ranks a step later than others still stops
all of them at the same step), save, and raise :class:`Stopped`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshpilot.errors import UserError
from meshpilot.io import atomic_write

MANIFEST = "meshpilot-checkpoint.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
KILL_ENV = "MESHPILOT_TEST_KILL_IN_SAVE"
"""Tests: ``STEP`` or ``STEP:RANK``: that rank SIGKILLs itself inside the save of that step, after every shard
is written and before the commit (the worst moment: the data is all there, the checkpoint is not)."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its folder and manifest."""

    path: Path
    step: int
    position: int
    logs: list[dict]
    manifest: dict = field(repr=False)


class Stopped(Exception):  # noqa: N818 - not an error: the run was asked to stop and saved
    """SIGTERM reached the run: the state after `step` steps was saved to `path`."""

    def __init__(self, step: int, path: Path) -> None:
        super().__init__(f"stopped by SIGTERM after step {step}; saved {path}")
        self.step = step
        self.path = path


# ------------------------------------------------------------------------------------------- finding


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step}"


def read(path: str | Path) -> Checkpoint:
    """The checkpoint in folder `path`, or a one-line UserError saying why it is not a complete one."""
    path = Path(path)
    man = path / MANIFEST
    if not man.is_file():
        raise UserError(f"{path}: no {MANIFEST}; not a complete meshpilot checkpoint (a save that did not finish)")
    try:
        data = json.loads(man.read_text())
        step, position, logs = int(data["step"]), int(data["position"]), list(data["logs"])
        fmt = int(data["format"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{man}: not a readable checkpoint manifest ({type(e).__name__}: {e})") from None
    if fmt > FORMAT:
        raise UserError(f"{man}: format {fmt} is newer than this meshpilot reads ({FORMAT}); upgrade meshpilot")
    return Checkpoint(path, step, position, logs, data)


def complete(directory: str | Path) -> list[Checkpoint]:
    """Every complete checkpoint in `directory`, oldest first (``step-N`` folders with a readable manifest
    of step N; ``.tmp`` folders and damaged ones are skipped)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        m = _STEP_DIR.match(entry.name)
        if not m or not entry.is_dir():
            continue
        try:
            ck = read(entry)
        except UserError:
            continue
        if ck.step == int(m.group(1)):
            found.append(ck)
    return sorted(found, key=lambda c: c.step)


def newest(directory: str | Path) -> Checkpoint | None:
    """The complete checkpoint of the largest step in `directory`, or None."""
    found = complete(directory)
    return found[-1] if found else None


# ------------------------------------------------------------------------------------------- state


def _pipelined(model: Any) -> bool:
    from meshpilot.runtime.pipeline_stages import PlannedPipelineModule

    return isinstance(model, PlannedPipelineModule)


def _target(model: Any) -> torch.nn.Module:
    """The user's module: a ParallelModule's (or a pipeline's) state is its wrapped model's, named as on one
    device."""
    from meshpilot.runtime.spmd import ParallelModule

    return model.module if isinstance(model, ParallelModule) or _pipelined(model) else model


def _state_dicts(model: Any, optimizer: torch.optim.Optimizer, saving: bool = False) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts as DCP saves and fills them, named by the model's parameter
    names. A pipeline rank (module docstring, *Pipelines*) holds its stages' part: their parameters (DTensors on
    the stage's mesh) and buffers, AdamW's states of those parameters, and param groups that name every
    parameter of the model, alike on every rank, as ``get_state_dict`` names them for the whole module;
    `saving`: a tied weight's copies but its first holder's left out (one layout per name is written; every
    copy reads it back)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not _pipelined(model):
        return get_state_dict(_target(model), optimizer)
    params = dict(model.saved_parameters() if saving else model.named_parameters())
    name_of = {id(p): n for n, p in params.items()}
    state = {name_of[id(p)]: dict(st) for p, st in optimizer.state.items() if id(p) in name_of}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(model.model_parameter_names)}
              for g in optimizer.param_groups]  # fmt: skip
    named = {alias: p for n, p in params.items() for alias in model.aliases.get(n, (n,))}  # as the state dict
    return {**named, **model.owned_buffers()}, {"state": state, "param_groups": groups}


def _set_state_dicts(model: Any, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Hand what DCP loaded into `model_sd` / `optim_sd` (made by :func:`_state_dicts`) back to the model and
    the optimizer; a pipeline's tensors were filled in place, its param groups' settings are set here."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not _pipelined(model):
        set_state_dict(_target(model), optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        return
    for group, saved in zip(optimizer.param_groups, optim_sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _init_optimizer_state(model: Any, optimizer: torch.optim.Optimizer) -> None:
    """A pipeline's optimizer given its states (AdamW's moments and step counts) by one step of learning rate
    0 on zero gradients, so that DCP can fill them in place (``get_state_dict`` does the same for a module)."""
    if not _pipelined(model) or optimizer.state:
        return
    rates = [g["lr"] for g in optimizer.param_groups]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, rates):
        g["lr"] = lr


def signature(model: torch.nn.Module) -> dict[str, list]:
    """Every state tensor's name -> [global shape, dtype]: what a checkpoint must match to load into `model`."""
    out = {}
    for name, t in _target(model).state_dict().items():
        if isinstance(t, torch.Tensor):
            out[name] = [list(t.shape), str(t.dtype).removeprefix("torch.")]
    return out


def _mismatch(saved: dict[str, list], mine: dict[str, list]) -> str | None:
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            return f"it holds {name!r}, which this model lacks"
        if name not in saved:
            return f"this model has {name!r}, which it lacks"
        if list(saved[name]) != list(mine[name]):
            (s_shape, s_dt), (m_shape, m_dt) = saved[name], mine[name]
            return f"{name!r} is {tuple(s_shape)} {s_dt} there, {tuple(m_shape)} {m_dt} here"
    return None


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def _digest(states: dict[str, torch.Tensor]) -> int:
    h = hashlib.sha256()
    for k in sorted(states):
        h.update(states[k].cpu().numpy().tobytes())
    return int.from_bytes(h.digest()[:7], "little")


def _model_device(model: Any) -> torch.device:
    from meshpilot.runtime.spmd import ParallelModule

    if isinstance(model, ParallelModule) or _pipelined(model):
        return model.device
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _all_agree(value: int, device: torch.device) -> bool:
    if not _distributed():
        return True
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return len({int(t) for t in every}) == 1


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened for fsync
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _kill_hook(step: int) -> None:
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    at, _, rank = spec.partition(":")
    if int(at) == step and (not rank or int(rank) == _rank()):
        os.kill(os.getpid(), signal.SIGKILL)


def save(
    directory: str | Path,
    model: Any,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    position: int,
    logs: list[dict] | None = None,
    info: dict | None = None,
) -> Path:
    """Save the state after `step` steps as ``directory/step-<step>`` (module docstring: the protocol).

    Collective: every rank of the group calls it with the same arguments. `position` is the data position
    (samples consumed), `logs` the steps so far (``{"step", "loss", "seconds"}``), `info` anything more for
    the manifest (plan, mesh, seed). Returns the checkpoint's folder.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    directory = Path(directory)
    final = step_dir(directory, step)
    tmp = final.with_name(final.name + ".tmp")
    device = _model_device(model)
    rng = _rng_states(device)
    agree = _all_agree(_digest(rng), device)
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # what an interrupted save of this step left
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = _state_dicts(model, optimizer, saving=True)
    dcp_save({"model": model_sd, "optim": optim_sd}, storage_writer=FileSystemWriter(tmp, sync_files=True))
    _kill_hook(step)
    if _rank() == 0:
        manifest = {
            "format": FORMAT,
            "step": step,
            "position": position,
            "logs": list(logs or []),
            "signature": signature(model),
            "world_size": dist.get_world_size() if _distributed() else 1,
            "rng": {k: base64.b64encode(v.cpu().numpy().tobytes()).decode() for k, v in rng.items()},
            "rng_ranks_agree": agree,
            **(info or {}),
        }
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=1))
        if final.exists():  # a checkpoint of this step from before a resume to an earlier one: replaced
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(directory)
    _barrier()
    return final


def load(checkpoint: Checkpoint | str | Path, model: Any, optimizer: torch.optim.Optimizer) -> Checkpoint:
    """Load `checkpoint` into `model` (a ParallelModule under any plan, a pipeline's ``PlannedPipelineModule``,
    or a plain module) and `optimizer`
    (built on ``model.parameters()``, not yet stepped), and set this rank's random generators to the saved
    state. Collective. A checkpoint of another model is a UserError naming the first tensor that differs."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    ck = checkpoint if isinstance(checkpoint, Checkpoint) else read(checkpoint)
    why = _mismatch(ck.manifest.get("signature", {}), signature(model))
    if why is not None:
        raise UserError(
            f"--resume {ck.path}: the checkpoint was saved from another model ({why}); resume with the model, "
            "sizes and precision it was saved with, or give a new --checkpoint-dir"
        )
    _init_optimizer_state(model, optimizer)
    model_sd, optim_sd = _state_dicts(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp_load(state, storage_reader=FileSystemReader(ck.path))
    _set_state_dicts(model, optimizer, state["model"], state["optim"])
    refresh = getattr(model, "invalidate_copies", None)
    if refresh is not None:  # ZeRO-2 weights: their full copies are gathered again from the loaded shards
        refresh()
    device = _model_device(model)
    for kind, text in ck.manifest.get("rng", {}).items():
        value = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
        if kind == "cpu":
            torch.set_rng_state(value)
        elif kind == "cuda" and device.type == "cuda":
            torch.cuda.set_rng_state(value, device)
    if not ck.manifest.get("rng_ranks_agree", True) and _rank() == 0:
        warnings.warn(
            f"{ck.path}: the ranks' random generators differed when it was saved; every rank continues from "
            "rank 0's state",
            stacklevel=2,
        )
    return ck


# ------------------------------------------------------------------------------------------- a run


class Checkpointing:
    """What a training loop needs: resume at the start, save every `every` steps, at the end, and on SIGTERM.

    Use as a context manager around the loop (it installs the SIGTERM handler and restores the old one)::

        with Checkpointing(dir, every=100, resume=newest(dir)) as ck:
            step, position, logs = ck.restore(model, opt)
            for ...:
                ...
                ck.after_step(model, opt, step=s + 1, position=p, logs=logs, last=s + 1 == steps)
    """

    def __init__(
        self,
        directory: str | Path,
        every: int | None = None,
        resume: Checkpoint | None = None,
        info: dict | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.every = every
        self.resume = resume
        self.info = dict(info or {})
        self.saved: list[Path] = []
        self._term = False
        self._old: Any = None

    def __enter__(self) -> Checkpointing:
        try:
            self._old = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:  # not the main thread: no handler, saves still happen every N steps
            self._old = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)
            self._old = None

    def _on_term(self, signum: int, frame: Any) -> None:
        self._term = True

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int, list[dict]]:
        """(step, data position, logs so far): from the checkpoint to resume, or a fresh start. Rank 0 first
        removes what interrupted saves of earlier runs left (``step-N.tmp``)."""
        if _rank() == 0 and self.directory.is_dir():
            for tmp in self.directory.glob("step-*.tmp"):
                shutil.rmtree(tmp, ignore_errors=True)
        if self.resume is None:
            return 0, 0, []
        ck = load(self.resume, model, optimizer)
        return ck.step, ck.position, list(ck.logs)

    def stop_requested(self, device: torch.device) -> bool:
        """Whether any rank got SIGTERM (collective: every rank learns it at the same step)."""
        if not _distributed():
            return self._term
        flag = torch.tensor([1 if self._term else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def after_step(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        position: int,
        logs: list[dict],
        last: bool,
    ) -> Path | None:
        """Save if this step is due (every N, the last, or SIGTERM); raise :class:`Stopped` after a SIGTERM save."""
        stop = self.stop_requested(_model_device(model))
        due = last or stop or (self.every is not None and step % self.every == 0)
        path = None
        if due:
            path = save(self.directory, model, optimizer, step=step, position=position, logs=logs, info=self.info)
            self.saved.append(path)
        if stop and not last:  # a SIGTERM during the last step: the run is complete, nothing to stop
            raise Stopped(step, path)
        return path


__all__ = ["Checkpoint", "Checkpointing", "Stopped", "complete", "load", "newest", "read", "save", "signature"]
