"""``meshpilot.parallelize(model, plan)``: run a :class:`~meshpilot.planner.plan.Plan` under torchrun.

Parameters become DTensors in their planned layouts (the model's ``nn.Parameter`` objects are replaced, so
``torch.optim.AdamW(model.parameters())`` steps the shards and ``torch.distributed.checkpoint`` saves them).
A plan that replicates every parameter on every mesh axis (pure data parallelism, or one device) keeps the
model's own plain parameters instead, as DDP does (``ParallelModule.plain``): each rank's piece is the whole
tensor, the programs' buckets all-reduce the gradients to the whole gradient, so nothing is left for a DTensor
to describe but host time per parameter at every step, in autograd and in the optimizer.
``loss = pmodel(*inputs)`` runs the step's forward and ``loss.backward()`` its backward: two programs of
generated code per rank (:mod:`meshpilot.runtime.program`), traced on the first step from the DTensor
interpreter (:mod:`meshpilot.runtime.interpret`) — the plan's resharding collectives, its strategies, its
own ops — and then called directly. The gradients arrive in the parameters' layouts as ``.grad``; buffers
the forward updates (BatchNorm's running statistics) are written back into the module. Under
``torch.no_grad()`` only the forward runs.

The model's device is the mesh's: a model on ``cuda:LOCAL_RANK`` runs on a CUDA mesh (NCCL), a CPU model on
a CPU mesh (gloo); ``device=`` moves the model first, ``mesh=`` gives the mesh. Every rank passes the full
global batch (the single-device model's inputs, moved to the device): sharding an input is a local slice.
All ranks must hold identical initial weights and, for plans with random ops (dropout), the same random
generator state (same seed), as with any SPMD launch; parallelize checks the latter.

The mesh's axes carry the plan's names (``Plan.mesh_axes`` as ``mesh_dim_names``; a mesh given as ``mesh=``
keeps its own), so ``meshpilot.runtime.collective_log.record_collectives(pm.mesh)`` records the collectives a
step issues under the names ``Plan.collective_counts()`` uses; every action of the schedule runs in its
phase's ``phase_scope``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshpilot.errors import UserError, first_line
from meshpilot.graph.capture import NodeKind, OpGraph, Phase, Precision, capture, dtype_from_name
from meshpilot.ops import register_dtensor_strategies
from meshpilot.planner import recompute
from meshpilot.planner.plan import Plan, StagePlan
from meshpilot.runtime.collective_log import phase_scope
from meshpilot.runtime.executor import StepRun, executed_actions
from meshpilot.runtime.groups import device_mesh
from meshpilot.runtime.interpret import Interpreter, permute_sequence, redistribute, to_dtensor
from meshpilot.runtime.program import StageProgram
from meshpilot.sharding.placements import from_json, replicated

if TYPE_CHECKING:
    from meshpilot.runtime.pipeline_stages import PlannedPipelineModule


def mesh_for_plan(plan: StagePlan, device_type: str = "cpu") -> DeviceMesh:
    """The DeviceMesh a plan runs on, its axes named ``plan.mesh_axes`` (the process group must already be
    initialised)."""
    n = math.prod(plan.mesh_shape)
    if not dist.is_initialized():
        raise UserError("meshpilot.parallelize needs torch.distributed initialised (run under torchrun)")
    if dist.get_world_size() != n:
        raise UserError(
            f"the plan's mesh {plan.mesh_shape} has {n} devices but the world size is {dist.get_world_size()}; "
            f"launch with --nproc-per-node {n} or plan for this world size"
        )
    key = (device_type, tuple(plan.mesh_shape), tuple(plan.mesh_ranks), tuple(plan.mesh_axes))
    world, mesh = _MESHES.get(key, (None, None))
    if mesh is None or world is not dist.group.WORLD:
        ranks = torch.tensor(plan.mesh_ranks, dtype=torch.int).reshape(plan.mesh_shape)
        mesh = device_mesh(device_type, ranks, tuple(plan.mesh_axes))
        _MESHES[key] = (dist.group.WORLD, mesh)
    return mesh


# One DeviceMesh (and one set of process groups) per mesh layout, axis names and world: parallelizing several models
# or plans in one process reuses it instead of creating new groups each time.
_MESHES: dict[tuple, tuple[Any, DeviceMesh]] = {}


# ------------------------------------------------------------------------------------------- the device


def model_device(model: torch.nn.Module) -> torch.device:
    """The one device the model's parameters and buffers live on (one line if there is none)."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if not devices:
        return torch.device("cpu")
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise UserError(
            f"the model's parameters and buffers are on several devices ({names}); move it to one first, "
            "e.g. model.to(f'cuda:{LOCAL_RANK}')"
        )
    device = devices.pop()
    if device.type == "meta":
        raise UserError(
            "the model's parameters are on the meta device (no values); materialise them before parallelize, "
            "e.g. model.to_empty(device='cpu') then initialise them (the same seed on every rank)"
        )
    return device


def check_backend(device: torch.device) -> None:
    """A CUDA model needs a process group with NCCL for CUDA tensors; a CPU model one with gloo."""
    backend = str(dist.get_backend()).lower()
    if device.type == "cuda":
        if "nccl" not in backend:
            raise UserError(
                f"the model is on {device} but the process group's backend is {backend!r}; "
                "init_process_group('nccl') (or 'cpu:gloo,cuda:nccl'), or pass device='cpu' to stay on the CPU"
            )
        want = torch.cuda.current_device()
        if device.index is not None and device.index != want:
            raise UserError(
                f"the model is on {device} but this rank's CUDA device is cuda:{want}; move the model to "
                "cuda:LOCAL_RANK (torch.cuda.set_device(LOCAL_RANK) before building it)"
            )
    elif device.type == "cpu" and "gloo" not in backend:
        raise UserError(
            f"the model is on the CPU but the process group's backend is {backend!r} (no gloo); "
            "init_process_group('gloo'), or move the model to its GPU"
        )


def _check_same_rng(device: torch.device) -> None:
    """Plans with random ops draw the same numbers on every rank: their generator states must agree."""
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    digest = int.from_bytes(hashlib.sha256(state.cpu().numpy().tobytes()).digest()[:7], "little")
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if len({int(t) for t in every}) > 1:
        raise UserError(
            "the plan holds random ops (dropout) and the ranks' random generators differ; call "
            "torch.manual_seed(s) with the same s on every rank before parallelize"
        )


def agree(error: BaseException | None, what: str) -> None:
    """Every rank's outcome of a set-up step it did alone (its capture, the plan checked against it), made one:
    if any rank failed, every rank raises the same one line naming the ranks and the first one's error, so no
    rank goes on into a collective that a refusing peer never reaches (it would wait there for ever). One small
    all_gather of the error lines; alone (one process), the error itself is raised."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    line = None if error is None else _one_line(error)
    every: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, line)
    bad = [r for r, e in enumerate(every) if e is not None]
    if not bad:
        return
    ranks = f"rank {bad[0]}" if len(bad) == 1 else f"ranks {', '.join(map(str, bad))}"
    message = f"{ranks} of {len(every)} refused {what}: {every[bad[0]]}"
    if error is not None:
        raise UserError(message) from error
    raise UserError(message)


@contextlib.contextmanager
def agreed(what: str) -> Iterator[None]:
    """Run the block each rank does alone (its capture, the plan checked against it), then :func:`agree` on its
    outcome: an exception in it is every rank's one line, raised on every rank."""
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - raised on every rank by agree
        error = e
    agree(error, what)


def _one_line(e: BaseException) -> str:
    """`e` as one line: its message's first line (its type's name when it has none; a non-UserError named)."""
    text = first_line(e)
    return text if isinstance(e, UserError) and text else f"{type(e).__name__}: {text}".rstrip(": ")


# ------------------------------------------------------------------------------------------- the module


class _Step(torch.autograd.Function):
    """A step's schedule as one autograd node: ``forward`` runs the actions up to the last microbatch's
    forward (so the loss exists), ``backward`` the rest (the trailing backwards and the gradient sync)."""

    @staticmethod
    def forward(ctx, pm: ParallelModule, inputs: tuple, *params: torch.Tensor) -> torch.Tensor:
        run = _ScheduleRun(pm, inputs)
        run.until_loss()
        ctx.run = run
        return run.loss()

    @staticmethod
    def backward(ctx, gout: torch.Tensor):
        run, ctx.run = ctx.run, None
        return (None, None, *run.finish(gout))


class _ScheduleRun:
    """One step of the plan's schedule on this rank: the one loop over its actions (``runtime.executor``) on the
    module's one stage, split where autograd needs it — the actions up to the loss in ``forward``, the rest in
    ``backward`` — and the gradients handed to autograd as DTensors, times the loss' gradient."""

    def __init__(self, pm: ParallelModule, inputs: tuple) -> None:
        self.pm = pm
        actions, paired = executed_actions(pm.schedule, dist.get_rank())
        if pm._cudagraphs:  # the last step's outputs are dead: CUDA graphs may reuse their memory
            torch.compiler.cudagraph_mark_step_begin()
        params = pm.read_locals()
        self.run = StepRun(
            actions, paired, {0: pm.program}, {0: params}, pm._buffers_by_name, inputs, pm.schedule.microbatches
        )

    def until_loss(self) -> None:
        self.run.until_loss()

    def loss(self) -> torch.Tensor:
        loss = self.run.loss().detach()
        return loss.clone() if self.pm._cudagraphs else loss  # outlives the graph's memory

    def finish(self, gout: torch.Tensor | None) -> list:
        """The rest of the step; the parameters' gradients (DTensors), times the loss' gradient `gout`."""
        self.run.run()
        pm = self.pm
        grads = list(self.run.synced.get(0) or [None] * len(pm._trainable))
        at = [i for i, g in enumerate(grads) if g is not None]
        if gout is not None and at and gout.device.type != "cpu":
            # Scaled on the device: reading `gout` (1 for loss.backward()) on the host would wait for the whole
            # forward and leave the GPU idle while the backward's first kernels are launched. Exact for 1. In
            # place on the program's own outputs; copies out of the CUDA graphs' memory, which the step outlives.
            present = [grads[i] for i in at]
            if pm._cudagraphs or len({g.data_ptr() for g in present}) < len(present):  # or one tensor twice
                present = torch._foreach_mul(present, gout)
            else:
                torch._foreach_mul_(present, gout)
            for i, g in zip(at, present):
                grads[i] = g
        else:
            scale = float(gout) if gout is not None else 1.0
            for i in at:
                if scale != 1.0:
                    grads[i] = grads[i] * scale
                elif pm._cudagraphs:
                    grads[i] = grads[i].clone()  # a gradient outlives the step, the graph's memory does not
        specs = pm._grad_specs
        if specs is None:  # plain replicated parameters (ParallelModule.plain): each gradient is the whole one
            return grads
        return [DTensor(g, spec, requires_grad=False) if g is not None else None for g, spec in zip(grads, specs)]


# Programs depend on the plan, the captured graph, the mesh and this rank, not on the parameters' values (the
# programs take them as inputs): a second model parallelized with the same plan and graph (a restart, a
# second optimizer's run in a test) reuses the recorded programs instead of recording them again.
_PROGRAMS: dict[tuple, tuple[StagePlan, StageProgram]] = {}
_MAX_PROGRAMS = 16


def replicated_everywhere(plan: StagePlan, param_names: Sequence[str]) -> bool:
    """Whether `plan` keeps every parameter of `param_names` whole on every device (replicated on every mesh
    axis: data parallelism, possibly per axis, or one device): then each rank's piece of a parameter, and of its
    gradient once the plan's buckets have reduced it, is the whole tensor."""
    whole = replicated(len(plan.mesh_shape))
    return all(tuple(plan.param_layout(fqn)) == whole for fqn in param_names)


def plain_parameters(model: torch.nn.Module, param_names: Sequence[str]) -> tuple[list[torch.nn.Parameter], list[str]]:
    """The model's own parameters of `param_names`, left as they are, and the names of those that require
    gradients: what :func:`distribute_parameters` returns for a plan that replicates every parameter, without
    the DTensors (``ParallelModule.plain``)."""
    params = [model.get_parameter(fqn) for fqn in param_names]
    return params, [fqn for fqn, p in zip(param_names, params) if p.requires_grad]


def distribute_parameters(
    model: torch.nn.Module, param_names: Sequence[str], plan: StagePlan, mesh: DeviceMesh
) -> tuple[list[torch.nn.Parameter], list[str]]:
    """Each parameter of `param_names` (fully qualified) replaced in `model`, under every name it has there (tied
    weights), by a Parameter holding a DTensor on `mesh` in `plan`'s layout for it. Returns the new parameters
    in `param_names`' order and the names of those that require gradients. The SPMD module and each pipeline
    stage (``runtime.pipeline_stages``) distribute theirs with it."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    params: list[torch.nn.Parameter] = []
    trainable: list[str] = []
    for fqn in param_names:
        old = model.get_parameter(fqn)
        with torch.no_grad():
            d = to_dtensor(old.detach(), mesh, plan.param_layout(fqn))
        new = torch.nn.Parameter(d, requires_grad=old.requires_grad)
        for alias in aliases[id(old)]:
            mod_name, _, leaf = alias.rpartition(".")
            model.get_submodule(mod_name)._parameters[leaf] = new
        params.append(new)
        if old.requires_grad:
            trainable.append(fqn)
    return params, trainable


class GatheredCopies:
    """The full copies of a plan's ZeRO-2 parameters (``planner.zero``; ``ZeroStage.GATHER_ONCE``).

    The module's parameter (what ``parameters()`` gives the optimizer, and what checkpoints save) is the shard
    the plan stores (``StagePlan.params``): the programs reduce-scatter its gradient into it and AdamW updates
    it and its states there. The programs read a full copy in the layout of the parameter's node (the
    readers' layout), all-gathered from the shard by the first step that reads it after the shard changed —
    once a step, in the forward phase, as the plan's ``gather:<fqn>`` collective. The shard changes under an
    optimizer's ``step()`` (a global step hook, :func:`_after_optimizer_step`, marks the copies of the
    parameters it stepped stale: DTensor's in-place ops do not move the local tensor's version counter) and
    when a checkpoint is loaded into it (``runtime.checkpoint`` calls :meth:`invalidate`); a parameter changed
    any other way needs :meth:`invalidate` too. The old copy is dropped before the new one is gathered, so a
    device holds one copy: the ``W / sf(read)`` of ``accounting._parts``.
    """

    def __init__(self, graph: OpGraph, plan: StagePlan, params: Sequence[torch.nn.Parameter]) -> None:
        once = {z.param for z in plan.zero if z.gathered_once}
        node = {n.fqn: n.name for n in graph.nodes if n.kind == NodeKind.PARAM}
        self.params = list(params)
        self.read = {
            i: plan.node(node[fqn]).out_placements(0) for i, fqn in enumerate(graph.param_names) if fqn in once
        }
        self.copies: dict[int, DTensor | None] = dict.fromkeys(self.read)
        if self.read:
            _LIVE_COPIES.add(self)
            _install_step_hook()

    def invalidate(self) -> None:
        """Gather every copy again before the next read (the shards changed)."""
        self.copies = dict.fromkeys(self.read)

    def owns(self, params: set[int]) -> bool:
        """Whether any of the parameters whose ids are `params` is one of this module's ZeRO-2 shards."""
        return any(id(self.params[i]) in params for i in self.read)

    def read_locals(self) -> list[torch.Tensor]:
        out = [p._local_tensor if isinstance(p, DTensor) else p.detach() for p in self.params]
        for i, layout in self.read.items():
            if self.copies[i] is None:
                with torch.no_grad(), phase_scope(Phase.FWD):
                    self.copies[i] = redistribute(self.params[i].detach(), layout)
            out[i] = self.copies[i]._local_tensor
        return out


_LIVE_COPIES: weakref.WeakSet[GatheredCopies] = weakref.WeakSet()
_STEP_HOOK: list[Any] = []


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After any optimizer's step: the ZeRO-2 copies of the parameters it stepped are stale."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for copies in list(_LIVE_COPIES):
        if copies.owns(stepped):
            copies.invalidate()


def _install_step_hook() -> None:
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _STEP_HOOK.append(register_optimizer_step_post_hook(_after_optimizer_step))


class ParallelModule(torch.nn.Module):
    """The model with DTensor parameters; ``forward(*inputs)`` runs one planned step (module docstring)."""

    def __init__(
        self, model: torch.nn.Module, plan: StagePlan, mesh: DeviceMesh, graph: OpGraph, *, compile: bool | str = False
    ):
        super().__init__()
        self.module = model
        self.plan = plan
        self.schedule = plan.step_schedule()
        self.mesh = mesh
        self.graph = graph
        self.device = (
            torch.device(mesh.device_type, torch.cuda.current_device())
            if mesh.device_type == "cuda"
            else (torch.device(mesh.device_type))
        )
        self._cudagraphs = compile == "cudagraphs"
        if self._cudagraphs and (mesh.device_type != "cuda" or self.schedule.microbatches > 1):
            raise UserError(
                f"compile='cudagraphs' replays one microbatch's programs on a CUDA mesh; this is a "
                f"{mesh.device_type} mesh with {self.schedule.microbatches} microbatches per step: "
                "use compile=True or False (or a plan with one microbatch on GPUs)"
            )
        self._distribute_parameters()
        key = (id(graph), plan.to_json(), id(mesh), str(self.device), tuple(self._trainable), compile)
        cached = _PROGRAMS.get(key)
        if cached is None or cached[0] is not plan and cached[0].to_json() != key[1]:
            interp = Interpreter(graph, plan, mesh, self.device)
            program = StageProgram(interp, self._trainable, compile=compile, schedule=self.schedule)
            cached = _PROGRAMS[key] = (plan, program)
            while len(_PROGRAMS) > _MAX_PROGRAMS:
                del _PROGRAMS[next(iter(_PROGRAMS))]
        self.program = cached[1]
        self.interpreter = self.program.interp
        self._buffers_by_name = dict(model.named_buffers())

    @property
    def mismatches(self) -> list[str]:
        """Nodes where DTensor chose another output layout than the plan (the run redistributed them)."""
        return self.interpreter.mismatches

    # ------------------------------------------------------------------ parameters
    plain: bool = True
    """Whether a plan that replicates every parameter (``replicated_everywhere``: pure data parallelism) keeps
    the model's own plain parameters and hands autograd plain gradients, as DDP does, instead of DTensors:
    the step's programs run on local tensors either way, so the DTensors only cost host time — their
    wrapping at ``_Step.apply``, autograd's ``detach`` of each DTensor gradient through DTensor's dispatch,
    and every foreach op of the optimizer's step (module docstring of ``runtime.program``; docs/benchmarks.md).
    False (set on the class before ``parallelize``) makes every parameter a DTensor, for comparing the two."""

    def _distribute_parameters(self) -> None:
        names = self.graph.param_names
        # _grad_specs: the layout of each trainable parameter's gradient (its own), in ``_trainable``'s order, read
        # once, not looked up by name for every gradient of every step (53 ``get_parameter`` calls were 0.65 ms of
        # a GPT's); None for plain parameters, whose gradients are plain.
        self._grad_specs: list | None = None
        if self.plain and replicated_everywhere(self.plan, names):
            self._params, self._trainable = plain_parameters(self.module, names)
        else:
            self._params, self._trainable = distribute_parameters(self.module, names, self.plan, self.mesh)
            self._grad_specs = [p._spec for p in self._params if p.requires_grad]
        self._trainable_params = [p for p in self._params if p.requires_grad]
        self._copies = GatheredCopies(self.graph, self.plan, self._params)

    def read_locals(self) -> list[torch.Tensor]:
        """This rank's piece of every parameter as the step's programs read it (a ZeRO-2 weight: its full copy,
        gathered from the updated shard first if it changed: :class:`GatheredCopies`)."""
        return self._copies.read_locals()

    def invalidate_copies(self) -> None:
        """The parameters changed outside an optimizer step (a checkpoint loaded): gather the ZeRO-2 copies
        again before the next step reads them."""
        self._copies.invalidate()

    # ------------------------------------------------------------------ step
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        inputs = self._check_inputs(inputs)
        if torch.is_grad_enabled() and self._trainable:
            return _Step.apply(self, inputs, *self._trainable_params)
        run = _ScheduleRun(self, inputs)
        run.run.forward_only()
        return run.loss()

    def train_step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One training step on the full global batch: the loss (replicated: every rank has it), the gradients
        added to ``.grad``. The same call as a pipeline's (``PlannedPipelineModule.train_step``)."""
        loss = self(*inputs)
        loss.backward()
        return loss.detach()

    def _check_inputs(self, inputs: tuple) -> tuple:
        graph, m = self.graph, self.schedule.microbatches
        if len(inputs) != graph.num_inputs:
            raise UserError(f"the plan was made for {graph.num_inputs} inputs; got {len(inputs)}")
        out = []
        for i, (x, info) in enumerate(zip(inputs, graph.input_infos)):
            if not isinstance(x, torch.Tensor):
                raise UserError(f"input {i} is a {type(x).__name__}; pass tensors")
            want = dtype_from_name(info.dtype)
            whole = (info.shape[0] * m, *info.shape[1:]) if info.shape else info.shape
            if tuple(x.shape) != whole or (x.dtype != want and not (x.is_floating_point() and want.is_floating_point)):
                per = f" ({m} microbatches of {info.shape})" if m > 1 else ""
                raise UserError(
                    f"input {i} is {tuple(x.shape)} {x.dtype} but the plan was made for {whole}{per} "
                    f"torch.{info.dtype}; plan again for these shapes"
                )
            out.append(x.to(self.device, want, non_blocking=True))
        return tuple(out)


def parallelize(
    model: torch.nn.Module,
    plan: Plan | StagePlan,
    mesh: DeviceMesh | None = None,
    *,
    device: str | torch.device | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    graph: OpGraph | None = None,
    compile: bool | str = False,
    inputs: Sequence[torch.Tensor] | None = None,
) -> ParallelModule | PlannedPipelineModule:
    """Make `model` run `plan` on the current process group (see the module docstring).

    `plan` is a :class:`~meshpilot.planner.plan.Plan` (or the :class:`~meshpilot.planner.plan.StagePlan` of one
    stage, run as ``Plan.single`` of it). A one-stage plan runs here on one mesh of every device; a pipeline runs
    each stage's plan on its own submesh (``runtime.pipeline.pipeline_parallelize``, `inputs` an example global
    batch, `graph` a capture at one microbatch; no `mesh` or `loss_fn`). Either module's ``train_step(*batch)``
    is one training step.

    The mesh's device is the model's (``device=`` moves the model there first; ``mesh=`` gives the mesh).
    `loss_fn` must be the one given to ``meshpilot.plan`` (if any). The model's parameters are replaced by
    DTensor parameters in place; build the optimizer on the returned module's ``parameters()``. `graph`
    reuses a capture of this model on the plan's input shapes (several plans of one model are then run
    without tracing it again); its fingerprint is still checked against the plan's. ``compile=True`` runs
    the step's programs through ``torch.compile`` (a string names its backend: ``"cudagraphs"`` replays the
    same kernels as CUDA graphs, for a step that Python launches slower than the GPU runs it).
    """
    from meshpilot.planner.validate import validate

    whole = plan if isinstance(plan, Plan) else Plan.single(plan)
    if not whole.is_single:
        return _parallelize_pipeline(model, whole, mesh, device, loss_fn, graph, compile, inputs)
    plan = whole.only
    register_dtensor_strategies()
    if not dist.is_initialized():
        raise UserError(
            "meshpilot.parallelize needs torch.distributed initialised; run under torchrun and call "
            "torch.distributed.init_process_group first"
        )
    validate(whole, world_size=dist.get_world_size())
    if device is not None:
        model.to(torch.device(device))
    dev = model_device(model)
    if mesh is None:
        check_backend(dev)
        mesh = mesh_for_plan(plan, dev.type)
    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise UserError(f"mesh shape {tuple(mesh.shape)} does not match the plan's {plan.mesh_shape}")
    if mesh.device_type != dev.type:
        raise UserError(f"the mesh is on {mesh.device_type} but the model on {dev}; build the mesh for {dev.type}")
    own = Precision.of_label(plan.precision)  # the plan trains in bfloat16 / float16: so does the model
    if own is not None and (cast := own.cast_dtype) is not None:
        model.to(cast)
    examples = [torch.empty(shape, dtype=dtype_from_name(dt), device="meta") for shape, dt in plan.input_shapes]
    with agreed("the plan"):  # what each rank does alone: its capture of the model, the plan checked against it
        if graph is None:
            graph = capture(model, examples, loss_fn=loss_fn, precision=plan.precision, guards=plan.guards)
        validate(whole, graph=graph)
        graph = recompute.for_plan(graph, plan)  # the blocks the plan recomputes run again in the backward
    if any(is_random_op(n.target) for n in graph.nodes if n.kind == NodeKind.OP):
        _check_same_rng(dev)
    return ParallelModule(model, plan, mesh, graph, compile=compile)


def _parallelize_pipeline(model, plan, mesh, device, loss_fn, graph, compile, inputs) -> PlannedPipelineModule:
    """:func:`parallelize` of a pipeline plan: every stage on its own submesh (``runtime.pipeline``)."""
    from meshpilot.runtime.pipeline import pipeline_parallelize

    if mesh is not None or loss_fn is not None:
        raise UserError(
            "a pipeline plan builds one mesh per stage and takes the model's own loss; leave mesh= and loss_fn= out"
        )
    if inputs is None:
        raise UserError("a pipeline plan needs inputs= (an example global batch) to cut its microbatches")
    if device is not None:
        model.to(torch.device(device))
    dev = model_device(model)
    return pipeline_parallelize(model, [x.to(dev) for x in inputs], plan, graph=graph, compile=compile)


def is_random_op(target: str) -> bool:
    """Whether the op named `target` (``aten.native_dropout.default``) draws from the random generator."""
    op = _ATEN_BY_NAME.get(target)
    if op is None:
        namespace, _, rest = target.partition(".")
        packet, _, overload = rest.partition(".")
        try:
            op = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
        except AttributeError:
            op = False
        _ATEN_BY_NAME[target] = op
    return bool(op) and torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())


_ATEN_BY_NAME: dict[str, Any] = {}


def shard_inputs(inputs: Sequence[torch.Tensor], plan: StagePlan, mesh: DeviceMesh) -> list[Any]:
    """The planned DTensor of each input (what a step does with full-batch inputs); a zig-zag plan's inputs
    with their sequence permuted first (``StagePlan.sequence_order``, as ``Interpreter.leaf`` does)."""
    order = plan.sequence_order
    dims = dict(order.inputs) if order is not None else {}
    return [
        to_dtensor(permute_sequence(x, dims[i], order) if i in dims else x, mesh, from_json(layout))
        for i, (x, layout) in enumerate(zip(inputs, plan.inputs))
    ]


__all__ = [
    "ParallelModule",
    "agree",
    "agreed",
    "distribute_parameters",
    "mesh_for_plan",
    "model_device",
    "parallelize",
    "shard_inputs",
]
