"""``meshpilot.parallelize(model, plan)``: run a :class:`~meshpilot.planner.plan.Plan` under torchrun.

Parameters become DTensors in their planned layouts (the model's ``nn.Parameter`` objects are replaced, so
``torch.optim.AdamW(model.parameters())`` steps the shards). A step interprets the captured joint
forward + backward graph on DTensors: before each node, every operand is redistributed to the layout the
planned strategy needs (exactly the plan's resharding edges), then the ATen op runs through DTensor's
dispatcher, which takes the planned strategy since its inputs match it. The loss is made replicated and
each gradient is redistributed to its parameter's layout, as the plan predicts.

Two exceptions to "DTensor runs the op": ops whose planned source is ``fallback`` (no strategy) run on
full replicas of their operands and their outputs are replicated; ops in :data:`_LOCAL_OPS`
(convolution forward and backward, whose DTensor handler rejects a batch sharded over two mesh axes) run
on the local shards and their outputs are labelled with the planned layouts. Each node's call is prepared
once (:class:`_NodeExec`: layouts parsed, argument template), and meshes are cached per layout, so several
plans or models parallelized in one process share their process groups.

``loss = pmodel(*inputs)`` runs the whole step (forward and backward) and returns the loss; calling
``loss.backward()`` then hands the precomputed gradients to autograd, so the usual
``loss.backward(); opt.step()`` loop works. Under ``torch.no_grad()`` only the forward nodes run.

Every rank passes the full global batch (the single-device model's inputs): sharding an input is a local
slice. All ranks must hold identical initial weights (same seed), as with any SPMD launch.

:class:`CollectiveCounter` records the collectives a step issues (kind, mesh axis, bytes, phase) by
intercepting the functional collectives DTensor calls, to compare with ``Plan.collectives``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from meshpilot.errors import UserError
from meshpilot.graph.capture import OpGraph, capture, dtype_from_name
from meshpilot.planner.plan import Plan
from meshpilot.sharding.placements import from_json, replicated
from meshpilot.sharding.strategies import register_meshpilot_strategies

_ACTIVE_COUNTERS: list[CollectiveCounter] = []


class CollectiveCounter(TorchDispatchMode):
    """Records every functional collective (as DTensor issues them) with its mesh axis and bytes.

    Bytes follow the cost model's convention (all-gather: gathered output; reduce-scatter: input;
    all-reduce: buffer; all-to-all: what each rank holds), so ``counts()`` compares with
    ``Plan.collective_counts()``.
    """

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.axis_of = {mesh.get_group(a).group_name: a for a in range(mesh.ndim)}
        # DTensor's sharding cache hashes meshes by shape and ranks, so a value may carry an equal mesh
        # built earlier (other groups, other names): axes are also recognised by their rank sets
        self._axis_of_ranks = {frozenset(dist.get_process_group_ranks(mesh.get_group(a))): a for a in range(mesh.ndim)}
        self.records: list[tuple[str, int, int, str]] = []
        self.phase = "fwd"

    def _axis(self, group_name: str | None) -> int:
        axis = self.axis_of.get(group_name) if group_name is not None else None
        if axis is None and group_name is not None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            try:
                ranks = frozenset(dist.get_process_group_ranks(_resolve_process_group(group_name)))
            except Exception:  # noqa: BLE001 - an unknown group: reported as axis -1
                ranks = frozenset()
            axis = self._axis_of_ranks.get(ranks, -1)
            self.axis_of[group_name] = axis
        return -1 if axis is None else axis

    def __enter__(self):
        _ACTIVE_COUNTERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE_COUNTERS.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        ns = getattr(func, "namespace", "")
        if ns == "_c10d_functional" and not name.startswith("wait_tensor"):
            base = name.split(".")[0]
            t = args[0]
            group = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
            axis = self._axis(group)
            nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            kind = None
            if base == "all_gather_into_tensor":
                kind, nbytes = "all_gather", nbytes * int(args[1])
            elif base == "reduce_scatter_tensor":
                kind = "reduce_scatter"
            elif base == "all_reduce":
                kind = "all_reduce"
            elif base == "all_to_all_single":
                kind = "all_to_all"
            elif base in ("broadcast", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"):
                kind = base
            if kind is not None:
                self.records.append((kind, axis, int(nbytes), self.phase))
        return func(*args, **kwargs)

    def counts(self, phase: str | None = None) -> Counter:
        return Counter((k, a, b) for k, a, b, p in self.records if phase is None or p == phase)


def _set_phase(phase: str) -> None:
    for c in _ACTIVE_COUNTERS:
        c.phase = phase


def mesh_for_plan(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    """The DeviceMesh a plan runs on (the process group must already be initialised)."""
    n = math.prod(plan.mesh_shape)
    if not dist.is_initialized():
        raise UserError("meshpilot.parallelize needs torch.distributed initialised (run under torchrun)")
    if dist.get_world_size() != n:
        raise UserError(
            f"the plan's mesh {plan.mesh_shape} has {n} devices but the world size is {dist.get_world_size()}; "
            f"launch with --nproc-per-node {n} or plan for this world size"
        )
    key = (device_type, tuple(plan.mesh_shape), tuple(plan.mesh_ranks))
    world, mesh = _MESHES.get(key, (None, None))
    if mesh is None or world is not dist.group.WORLD:
        ranks = torch.tensor(plan.mesh_ranks, dtype=torch.int).reshape(plan.mesh_shape)
        mesh = DeviceMesh(device_type, ranks)
        _MESHES[key] = (dist.group.WORLD, mesh)
    return mesh


# One DeviceMesh (and one set of process groups) per mesh layout and world: parallelizing several models
# or plans in one process reuses it instead of creating new groups each time.
_MESHES: dict[tuple, tuple[Any, DeviceMesh]] = {}


def _redistribute(x: DTensor, placements) -> DTensor:
    """``x`` in `placements` (Partial targets allowed), by DTensor's own transform steps; no autograd."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import redistribute_local_tensor

    placements = tuple(placements)
    if tuple(x.placements) == placements:
        return x
    spec = DTensorSpec(x.device_mesh, placements, tensor_meta=x._spec.tensor_meta)
    local = redistribute_local_tensor(x._local_tensor, x._spec, spec)
    return DTensor(local, spec, requires_grad=False)


def _to_dtensor(x: torch.Tensor, mesh: DeviceMesh, layout) -> DTensor:
    """A DTensor of the (replicated, identical on every rank) tensor `x` in `layout`: a local slice."""
    if isinstance(x, DTensor):
        return _redistribute(x, layout)
    d = DTensor.from_local(x, mesh, replicated(mesh.ndim), run_check=False)
    return _redistribute(d, layout)


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: ParallelModule, inputs: tuple, *params: torch.Tensor) -> torch.Tensor:
        loss, grads = runner._run(inputs, with_grads=True)
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, gout: torch.Tensor):
        grads = ctx.grads
        ctx.grads = None
        scale = float(gout) if gout is not None else 1.0
        if scale != 1.0:
            grads = [g * scale if g is not None else None for g in grads]
        return (None, None, *grads)


class ParallelModule(torch.nn.Module):
    """The model with DTensor parameters; ``forward(*inputs)`` runs one planned step (module docstring)."""

    def __init__(self, model: torch.nn.Module, plan: Plan, mesh: DeviceMesh, graph: OpGraph):
        super().__init__()
        self.module = model
        self.plan = plan
        self.mesh = mesh
        self.graph = graph
        self.mismatches: list[str] = []
        self._exec: dict[str, _NodeExec] = {}
        nodes = graph.nodes
        self._last_use: dict[str, int] = {}
        for n in nodes:
            for s, _ in n.inputs:
                self._last_use[s] = n.index
        keep = {graph.loss[0]} | {g[0] for g in graph.grads.values() if g is not None}
        for k in keep:
            self._last_use[k] = len(nodes)
        self._distribute_parameters()

    # ------------------------------------------------------------------ parameters
    def _distribute_parameters(self) -> None:
        model, mesh = self.module, self.mesh
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        self._params: list[torch.nn.Parameter] = []
        self._trainable: list[str] = []
        for fqn in self.graph.param_names:
            old = model.get_parameter(fqn)
            layout = self.plan.param_layout(fqn)
            with torch.no_grad():
                d = _to_dtensor(old.detach(), mesh, layout)
            new = torch.nn.Parameter(d, requires_grad=old.requires_grad)
            for alias in aliases[id(old)]:
                mod_name, _, leaf = alias.rpartition(".")
                model.get_submodule(mod_name)._parameters[leaf] = new
            self._params.append(new)
            if old.requires_grad:
                self._trainable.append(fqn)

    # ------------------------------------------------------------------ step
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self._trainable:
            params = [p for p, fqn in zip(self._params, self.graph.param_names) if p.requires_grad]
            return _Step.apply(self, tuple(inputs), *params)
        loss, _ = self._run(tuple(inputs), with_grads=False)
        return loss

    def _run(self, inputs: tuple, with_grads: bool) -> tuple[torch.Tensor, list]:
        from torch.distributed.tensor._redistribute import disable_redistribute_transform_optimization

        graph, plan, mesh = self.graph, self.plan, self.mesh
        if len(inputs) != graph.num_inputs:
            raise UserError(f"the plan was made for {graph.num_inputs} inputs; got {len(inputs)}")
        env: dict[str, tuple] = {}
        pvals = dict(zip(graph.param_names, self._params))
        buffers = dict(self.module.named_buffers())
        input_layouts = iter(plan.inputs)
        _set_phase("fwd")
        with torch.no_grad(), disable_redistribute_transform_optimization():
            for node in graph.nodes:
                if not with_grads and node.phase == "bwd":
                    continue
                choice = plan.node(node.name)
                if node.kind == "param":
                    env[node.name] = (pvals[node.fqn],)
                elif node.kind == "buffer":
                    env[node.name] = (_to_dtensor(buffers[node.fqn], mesh, choice.out_placements(0)),)
                elif node.kind == "input":
                    layout = from_json(next(input_layouts))
                    x = inputs[int(node.fqn.split(":")[1])]
                    env[node.name] = (_to_dtensor(x, mesh, layout),)
                elif node.kind == "getitem":
                    src, i = node.inputs[0]
                    env[node.name] = (env[src][i],)
                else:
                    _set_phase(node.phase)
                    env[node.name] = self._call(node, choice, env)
                for s, _ in node.inputs:
                    if self._last_use.get(s, -1) <= node.index and s in env:
                        del env[s]
            _set_phase("fwd")
            ln, li = graph.loss
            loss = env[ln][li]
            loss = _redistribute(loss, replicated(mesh.ndim)).to_local() if isinstance(loss, DTensor) else loss
            grads: list = []
            if with_grads:
                _set_phase("bwd")
                for fqn in graph.param_names:
                    if fqn not in self._trainable:
                        continue
                    g = graph.grads.get(fqn)
                    if g is None:
                        grads.append(None)
                        continue
                    val = env[g[0]][g[1]]
                    grads.append(_redistribute(val, self.plan.param_layout(fqn)))
                _set_phase("fwd")
        return loss.detach(), grads

    def _call(self, node, choice, env) -> tuple:
        ex = self._exec.get(node.name)
        if ex is None:
            ex = self._exec[node.name] = _NodeExec(node, choice)
        operands = []
        for a, (src, i) in enumerate(node.inputs):
            v = env[src][i]
            want = ex.ins[a]
            if isinstance(v, DTensor) and v._spec.placements != want:
                v = _redistribute(v, want)
            if ex.mode != "dtensor" and isinstance(v, DTensor):
                v = v._local_tensor
            operands.append(v)
        args, kwargs = ex.arguments(operands)
        if ex.mode == "own":
            out = _OWN_IMPLS[ex.target](ex, self.mesh, *args, **kwargs)
        else:
            out = ex.target(*args, **kwargs)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        mesh = self.mesh
        fixed = []
        for i, o in enumerate(outs):
            want = ex.outs[i] if i < len(ex.outs) else None
            if ex.mode in ("local", "own"):
                if isinstance(o, torch.Tensor) and want is not None and isinstance(ex.vals[i], torch.Tensor):
                    o = _wrap_local(o, mesh, want, ex.vals[i])
            elif isinstance(o, torch.Tensor) and not isinstance(o, DTensor):
                o = DTensor.from_local(o, mesh, replicated(mesh.ndim), run_check=False)
                if want is not None and want != o._spec.placements:
                    o = _redistribute(o, want)
            elif isinstance(o, DTensor) and want is not None and o._spec.placements != want:
                self.mismatches.append(f"{node.name}: DTensor chose {o.placements}, plan says {want}")
                o = _redistribute(o, want)
            fixed.append(o)
        return tuple(fixed)


class _NodeExec:
    """How the runtime calls one node, prepared once: the planned layouts parsed, and the op's arguments as
    a template whose tensor slots take the operands (no pytree walk per call).

    ``mode`` is ``dtensor`` (DTensor's dispatcher runs the planned strategy), ``local`` (meshpilot runs the op
    on the local shards and labels the outputs with the planned layouts, see :data:`_LOCAL_OPS`), ``own``
    (one of meshpilot's own strategies, run by :data:`_OWN_IMPLS` on the local shards) or ``fallback`` (no
    strategy: the op runs on full replicas, its outputs are replicated)."""

    __slots__ = (
        "node",
        "target",
        "ins",
        "outs",
        "vals",
        "mode",
        "cache",
        "_leaves",
        "_slots",
        "_spec",
        "_nargs",
        "_keys",
    )

    def __init__(self, node, choice) -> None:
        fx = node.fx_node
        self.node = node
        self.cache: dict = {}
        self.target = fx.target
        self.ins = tuple(tuple(from_json(p)) for p in choice.ins)
        self.outs = tuple(tuple(from_json(p)) if p is not None else None for p in choice.outs)
        vals = fx.meta.get("val")
        self.vals = tuple(vals) if isinstance(vals, (tuple, list)) else (vals,)
        if choice.source == "fallback":
            self.mode = "fallback"
        elif choice.source == "meshpilot" and fx.target in _OWN_IMPLS:
            self.mode = "own"
        elif fx.target in _LOCAL_OPS:
            self.mode = "local"
        else:
            self.mode = "dtensor"
        top = (*fx.args, *fx.kwargs.values())
        nested = any(
            isinstance(a, (list, tuple, dict)) and any(isinstance(x, torch.fx.Node) for x in pytree.tree_leaves(a))
            for a in top
        )
        # flat: one leaf per top-level argument (constant lists such as a view's shape stay whole)
        leaves, spec = pytree.tree_flatten((fx.args, fx.kwargs)) if nested else (list(top), None)
        self._leaves, self._slots = [], []
        k = 0
        for pos, a in enumerate(leaves):
            if isinstance(a, torch.fx.Node):
                v = a.meta.get("val")
                if isinstance(v, torch.Tensor):
                    self._slots.append((pos, k))
                    k += 1
                    a = None
                else:
                    a = v
            self._leaves.append(a)
        self._spec = spec
        self._nargs = len(fx.args)
        self._keys = tuple(fx.kwargs)

    def arguments(self, operands: list) -> tuple[tuple, dict]:
        vals = list(self._leaves)
        for pos, k in self._slots:
            vals[pos] = operands[k]
        if self._spec is None:
            n = self._nargs
            return tuple(vals[:n]), dict(zip(self._keys, vals[n:]))
        return pytree.tree_unflatten(vals, self._spec)


# Ops the runtime runs on the local shards instead of through DTensor's dispatcher (mode ``local`` of
# _NodeExec): exact for any strategy of the op's sharding rule, since the operands already hold the planned
# layouts and each rank computes its piece. Used where DTensor's own runtime handler cannot run a planned
# strategy: its convolution handler rejects a batch sharded over two mesh axes (``S(0)S(0)``).
_LOCAL_OPS = {torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default}


def _local_range(ex: _NodeExec, mesh: DeviceMesh, global_shape, placements, dim: int) -> tuple[int, int]:
    """(first index, length) along `dim` of this rank's shard of a tensor of `global_shape` laid out as
    `placements`: the rows of a vocabulary-sharded table, the class columns of sharded logits (cached per
    node)."""
    hit = ex.cache.get("range")
    if hit is None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(torch.Size(global_shape), mesh, tuple(placements))
        hit = ex.cache["range"] = (int(offset[dim]), int(shape[dim]))
    return hit


def _embedding_vocab_parallel(ex, mesh, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Vocabulary-parallel lookup: this rank's rows for the ids it holds, zeros elsewhere (a partial sum)."""
    off, rows = _local_range(ex, mesh, ex.node.fx_node.args[0].meta["val"].shape, ex.ins[0], 0)
    mask = (ids >= off) & (ids < off + rows)
    out = torch.ops.aten.embedding.default(weight, torch.where(mask, ids - off, torch.zeros_like(ids)))
    return out * mask.unsqueeze(-1).to(out.dtype)


def _embedding_backward_vocab_parallel(ex, mesh, grad, ids, num_weights, padding_idx, scale_grad_by_freq):
    """The gradient rows this rank holds: other ranks' ids contribute nothing here."""
    hidden = ex.vals[0].shape[1]
    off, rows = _local_range(ex, mesh, (num_weights, hidden), ex.outs[0], 0)
    mask = (ids >= off) & (ids < off + rows)
    grad = grad * mask.unsqueeze(-1).to(grad.dtype)
    pad = padding_idx - off if 0 <= padding_idx - off < rows and padding_idx >= 0 else -1
    local_ids = torch.where(mask, ids - off, torch.zeros_like(ids))
    return torch.ops.aten.embedding_dense_backward.default(grad, local_ids, rows, pad, scale_grad_by_freq)


def _sharding_axes(placements, dim: int, mesh: DeviceMesh) -> list[int]:
    """The mesh axes (of more than one device) that shard tensor dim `dim` in `placements`."""
    return [a for a, p in enumerate(placements) if p.is_shard(dim) and mesh.size(a) > 1]


def _all_reduce(t: torch.Tensor, op: str, mesh: DeviceMesh, axes: list[int]) -> torch.Tensor:
    """`t` all-reduced with `op` over each mesh axis in turn (functional collectives, as DTensor issues them,
    so :class:`CollectiveCounter` sees them)."""
    for a in axes:
        t = torch.ops._c10d_functional.all_reduce(t.contiguous(), op, mesh.get_group(a).group_name)
        t = torch.ops._c10d_functional.wait_tensor(t)
    return t


def _log_softmax_vocab_parallel(ex, mesh, x, dim, half_to_float):
    """log_softmax over a class dim sharded on some mesh axes: the row max and the row sum of exponentials
    are all-reduced (MAX, then SUM) over those axes; the output keeps the input's layout."""
    cls = dim % x.dim()
    axes = _sharding_axes(ex.ins[0], cls, mesh)
    m = _all_reduce(x.amax(dim=cls, keepdim=True), "max", mesh, axes)
    shifted = x - m
    s = _all_reduce(shifted.exp().sum(dim=cls, keepdim=True), "sum", mesh, axes)
    return shifted - s.log()


def _log_softmax_backward_vocab_parallel(ex, mesh, grad, out, dim, input_dtype):
    """``grad - exp(out) * sum(grad, dim)``, the row sums of `grad` all-reduced over the class-sharding axes."""
    cls = dim % grad.dim()
    axes = _sharding_axes(ex.ins[0], cls, mesh)
    s = _all_reduce(grad.sum(dim=cls, keepdim=True), "sum", mesh, axes)
    return (grad - out.exp() * s).to(input_dtype)


def _local_targets(ex, mesh, target, ignore_index, lp_layout, lp_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's column of each target, or 0; whether the target is in its columns and not ignored)."""
    off, cols = _local_range(ex, mesh, lp_shape, lp_layout, 1)
    mine = (target >= off) & (target < off + cols) & (target != ignore_index)
    return torch.where(mine, target - off, torch.zeros_like(target)), mine


def _nll_loss_vocab_parallel(ex, mesh, lp, target, weight, reduction, ignore_index):
    """Minus the sum of the targets' log-probabilities held here (a partial sum over the class- and
    row-sharding axes), divided for the mean by the count of non-ignored targets: whole over the
    class-sharding axes (targets are replicated there), all-reduced over the row-sharding ones."""
    lp_shape = ex.node.fx_node.args[0].meta["val"].shape
    local, mine = _local_targets(ex, mesh, target, ignore_index, ex.ins[0], lp_shape)
    picked = lp.gather(1, local.unsqueeze(1)).squeeze(1)
    loss = -(picked * mine.to(lp.dtype)).sum()
    rows = _sharding_axes(ex.ins[1], 0, mesh)  # the targets [N]: their rows
    total = _all_reduce((target != ignore_index).sum().to(lp.dtype), "sum", mesh, rows)
    return (loss / total if reduction == 1 else loss), total


def _nll_loss_backward_vocab_parallel(ex, mesh, grad, lp, target, weight, reduction, ignore_index, total):
    """The gradient columns held here: ``-grad`` (``/ total_weight`` for the mean) at each row's target
    column if this rank holds it; zeros elsewhere. No collective."""
    lp_shape = ex.node.fx_node.args[1].meta["val"].shape
    local, mine = _local_targets(ex, mesh, target, ignore_index, ex.ins[1], lp_shape)
    g = -grad / total if reduction == 1 else -grad
    out = torch.zeros_like(lp)
    return out.scatter_(1, local.unsqueeze(1), (g * mine.to(lp.dtype)).unsqueeze(1))


# meshpilot's own strategies (``meshpilot.sharding.strategies.OWN_OPS``, source ``meshpilot``): how each op
# runs on the local shards; the outputs get the planned layouts.
_OWN_IMPLS = {
    torch.ops.aten.embedding.default: _embedding_vocab_parallel,
    torch.ops.aten.embedding_dense_backward.default: _embedding_backward_vocab_parallel,
    torch.ops.aten._log_softmax.default: _log_softmax_vocab_parallel,
    torch.ops.aten._log_softmax_backward_data.default: _log_softmax_backward_vocab_parallel,
    torch.ops.aten.nll_loss_forward.default: _nll_loss_vocab_parallel,
    torch.ops.aten.nll_loss_backward.default: _nll_loss_backward_vocab_parallel,
}


def _wrap_local(local: torch.Tensor, mesh: DeviceMesh, placements, global_val: torch.Tensor) -> DTensor:
    """A DTensor of `local` (this rank's piece) in `placements`, of `global_val`'s global shape."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(global_val.shape, global_val.stride(), global_val.dtype)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=False)


def parallelize(
    model: torch.nn.Module,
    plan: Plan,
    mesh: DeviceMesh | None = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    graph: OpGraph | None = None,
) -> ParallelModule:
    """Make `model` run `plan` on the current process group (see the module docstring).

    `loss_fn` must be the one given to ``meshpilot.plan`` (if any). The model's parameters are replaced
    by DTensor parameters in place; build the optimizer on the returned module's ``parameters()``.
    `graph` reuses a capture of this model on the plan's input shapes (several plans of one model are then
    run without tracing it again); its fingerprint is still checked against the plan's.
    """
    register_meshpilot_strategies()
    mesh = mesh if mesh is not None else mesh_for_plan(plan)
    if tuple(mesh.shape) != tuple(plan.mesh_shape):
        raise UserError(f"mesh shape {tuple(mesh.shape)} does not match the plan's {plan.mesh_shape}")
    examples = [torch.empty(shape, dtype=dtype_from_name(dt), device="meta") for shape, dt in plan.input_shapes]
    if graph is None:
        graph = capture(model, examples, loss_fn=loss_fn)
    if graph.fingerprint() != plan.fingerprint:
        raise UserError(
            "this plan was made for a different model or input shapes (graph fingerprint "
            f"{plan.fingerprint} vs {graph.fingerprint()}); plan again for this model"
        )
    return ParallelModule(model, plan, mesh, graph)


def shard_inputs(inputs: Sequence[torch.Tensor], plan: Plan, mesh: DeviceMesh) -> list[Any]:
    """The planned DTensor of each input (what a step does with full-batch inputs)."""
    return [_to_dtensor(x, mesh, from_json(layout)) for x, layout in zip(inputs, plan.inputs)]


__all__ = ["CollectiveCounter", "ParallelModule", "mesh_for_plan", "parallelize", "shard_inputs", "Replicate"]
