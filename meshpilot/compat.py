"""Every private torch symbol meshpilot uses, in one place, with what happens when one has moved.

meshpilot supports ``torch>=2.11`` (GPU machines come with the CUDA torch their drivers need, and pip must
not replace it). Private symbols (``torch.distributed.tensor._…``, ``torch._functorch``, ``torch._subclasses``)
move between releases, so nothing else in meshpilot imports them: it asks this module. Each symbol is looked
up once, by dotted path; a symbol the installed torch lacks is recorded in :data:`MISSING` with the feature
that needs it, and that feature degrades by name instead of failing with an ``ImportError`` at plan time:

=====================================  =====================================================================
symbol                                 without it
=====================================  =====================================================================
``_adjust_group_norm_scalars``         GroupNorm's backward has no batch-parallel strategy: replicated,
                                       and the plan's warnings say why
``register_single_dim_strategy`` …     the same for every strategy meshpilot registers that way
``_expand_single_dim_strategy_to_mesh`` DTensor's single-dim strategies are not enumerated (older torch has
                                       none: its strategies are all ``op_strategy_funcs``)
=====================================  =====================================================================

The core (capture, DTensor specs, redistribution) has no fallback: :func:`require` raises one line naming
the symbol and the torch version. ``MESHPILOT_COMPAT_HIDE`` (comma-separated dotted paths) hides symbols on
purpose, so a test can show a fallback on a torch that has them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

from meshpilot.errors import UserError

MIN_TORCH = (2, 11)
"""The oldest torch meshpilot declares (``pyproject.toml``)."""

MISSING: dict[str, str] = {}
"""Dotted path -> what meshpilot does without it (filled as symbols are looked up)."""

_HIDDEN = frozenset(s.strip() for s in os.environ.get("MESHPILOT_COMPAT_HIDE", "").split(",") if s.strip())
_CACHE: dict[str, Any] = {}
_ABSENT = object()


def lookup(path: str, fallback_note: str) -> Any | None:
    """The object at dotted `path` (``package.module.name``), or None if this torch lacks it — then
    :data:`MISSING` records `fallback_note`, what meshpilot does instead."""
    hit = _CACHE.get(path)
    if hit is None:
        hit = _import(path)
        _CACHE[path] = hit
    if hit is _ABSENT:
        MISSING.setdefault(path, fallback_note)
        return None
    return hit


def require(path: str) -> Any:
    """The object at dotted `path`; one line naming it and the installed torch if it is missing."""
    hit = lookup(path, "none: meshpilot needs it")
    if hit is None:
        raise UserError(
            f"this torch ({torch.__version__}) has no {path}, which meshpilot needs; install a torch "
            f"meshpilot supports (>= {'.'.join(map(str, MIN_TORCH))}, tested on 2.13)"
        )
    return hit


def _import(path: str) -> Any:
    if path in _HIDDEN:
        return _ABSENT
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return _ABSENT


def missing_note(path: str) -> str | None:
    """Why a feature is off: ``"torch 2.11.0 has no …"`` if `path` was looked up and is missing."""
    if path not in MISSING:
        return None
    return f"torch {torch.__version__} has no {path.rpartition('.')[2]}"


# ------------------------------------------------------------------------------------- the core symbols
# Looked up lazily (functions, not module-level imports), so `meshpilot --help` never imports them.


def fake_tensor_mode() -> type:
    return require("torch._subclasses.fake_tensor.FakeTensorMode")


def aot_export_module() -> Any:
    return require("torch._functorch.aot_autograd.aot_export_module")


def reparametrize_module() -> Any:
    return require("torch.nn.utils.stateless._reparametrize_module")


def dtensor_spec() -> tuple[type, type]:
    """(DTensorSpec, TensorMeta)."""
    return (
        require("torch.distributed.tensor._dtensor_spec.DTensorSpec"),
        require("torch.distributed.tensor._dtensor_spec.TensorMeta"),
    )


def op_schema() -> Any:
    """The module holding OpSchema, OpSpec, OpStrategy, RuntimeSchemaInfo, TupleStrategy."""
    require("torch.distributed.tensor._op_schema.OpSchema")
    return importlib.import_module("torch.distributed.tensor._op_schema")


def all_gather_single() -> Any:
    """``torch.distributed.all_gather_single`` (torch 2.13), ``all_gather_into_tensor`` on an older torch: the same
    call, whose old name 2.13 deprecates and 2.11 has alone. Public API, so no fallback note."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def redistribute_local_tensor() -> Any:
    return require("torch.distributed.tensor._redistribute.redistribute_local_tensor")


def gen_transform_infos() -> Any:
    return require("torch.distributed.tensor._redistribute._gen_transform_infos")


def no_transform_optimization() -> Any:
    """A context manager keeping DTensor's redistribute to the planned steps (no flattening), or a null one."""
    import contextlib

    fn = lookup(
        "torch.distributed.tensor._redistribute.disable_redistribute_transform_optimization",
        "redistribute may flatten steps: the planned collectives are still issued, possibly merged",
    )
    return fn() if fn is not None else contextlib.nullcontext()


def local_shape_and_offset() -> Any:
    """``(global shape, mesh, placements) -> (local shape, global offset)`` of this rank's shard; computed as
    plain Python even while a program is traced (it reads the mesh coordinate from a tensor)."""
    fn = require("torch.distributed.tensor._utils.compute_local_shape_and_global_offset")
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    from meshpilot.runtime.record import outside_program

    def untraced(global_shape, mesh, placements):
        with disable_proxy_modes_tracing(), outside_program():
            return fn(global_shape, mesh, placements)

    return untraced


def expand_to_full_mesh_op_strategy() -> Any:
    return require("torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy")


def register_work() -> Any | None:
    """``_register_work(tensor, work)``: ``_c10d_functional.wait_tensor(tensor)`` then waits for `work`
    (an expert-parallel all-to-all left in flight, ``meshpilot.ops.moe``); None on a torch without it."""
    return lookup(
        "torch._C._distributed_c10d._register_work",
        "the expert-parallel MoE waits for its all-to-alls inside each step (duplex cannot overlap them)",
    )


def resolve_process_group() -> Any:
    return require("torch.distributed.distributed_c10d._resolve_process_group")


def sharding_propagator() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher.sharding_propagator


def single_dim_registry() -> tuple[dict, dict]:
    """(op -> single-dim strategy function, op -> its schema info); empty on a torch without them."""
    prop = sharding_propagator()
    return (
        getattr(prop, "op_single_dim_strategy_funcs", {}),
        getattr(prop, "op_to_schema_info_for_single_dim_strategy", {}),
    )


EXPAND_SINGLE_DIM = "torch.distributed.tensor._ops.single_dim_strategy._expand_single_dim_strategy_to_mesh"
REGISTER_SINGLE_DIM = "torch.distributed.tensor._ops.single_dim_strategy.register_single_dim_strategy"
SHARDING_PLACEHOLDER = "torch.distributed.tensor._ops.single_dim_strategy._ShardingPlaceholder"
GROUP_NORM_SCALARS = "torch.distributed.tensor._ops._math_ops._adjust_group_norm_scalars"


# ------------------------------------------------------------------------------- the joint export (capture)

STAMP = "meshpilot:"
"""Prefix of the ``stack_trace`` meshpilot stamps on captured nodes (``meshpilot:file.py:12``)."""


LOOP = "meshpilot_loop"
"""Key of ``node.meta["custom"]`` (a field torch.fx copies onto every node it makes) naming the iteration of a
loop over a set that made the node: ``(loop's file:line, its frame's id, repr of the element)``."""


def stamp_node_meta(module: str, source: str, loop: tuple | None = None) -> None:
    """Label the nodes the tracer makes next with `module`, `source` and the iteration `loop` of a loop over a
    set that runs them, if any (torch.fx's preserved node meta)."""
    fx_traceback = torch.fx.traceback
    if fx_traceback.has_preserved_node_meta():
        meta = fx_traceback.get_current_meta()
        meta["stack_trace"] = STAMP + source
        meta["nn_module_stack"] = {"meshpilot": (module, None)}
        if loop is not None:
            meta["custom"] = {LOOP: loop}
        else:
            meta.pop("custom", None)


def unstamp_loop() -> None:
    """The nodes the tracer makes next are in no loop over a set (made outside the model's code)."""
    fx_traceback = torch.fx.traceback
    if fx_traceback.has_preserved_node_meta():
        fx_traceback.get_current_meta().pop("custom", None)


def stamped_place(fx_node: torch.fx.Node) -> tuple[str | None, str | None]:
    """(module path, ``file:line``) :func:`stamp_node_meta` put on a node (None for what it did not stamp)."""
    stack = fx_node.meta.get("nn_module_stack") or {}
    module = None
    if isinstance(stack, dict) and stack:
        module = next(reversed(stack.values()))[0]
    source = fx_node.meta.get("stack_trace")
    if isinstance(source, str) and source.startswith(STAMP):
        source = source[len(STAMP) :]
    else:
        source = None
    return module, source


class JointExport:
    """A functional joint forward + backward graph: placeholders are the flat arguments; outputs are the
    mutated inputs' new values (``mutated_inputs`` in order), the loss, then the gradient of every argument
    that requires one and receives one (``has_grad``)."""

    def __init__(self, gm: torch.fx.GraphModule, mutated_inputs: list[int], has_grad: list[bool]) -> None:
        self.gm, self.mutated_inputs, self.has_grad = gm, mutated_inputs, has_grad


@contextlib.contextmanager
def tracing_state() -> Iterator[None]:
    """Tell the model's code that it is being traced, as ``torch.compile`` does: ``torch.compiler.is_compiling()``
    answers True. Code that guards a data-dependent branch with "am I traced" — transformers' ``is_tracing`` /
    ``is_torchdynamo_compiling``, ``torch._dynamo.is_compiling`` — then takes its tracing branch, whatever kind
    of tensor it sees (ours are functional wrappers of fake tensors, which no ``isinstance`` check recognises).

    Compiling, not exporting (``is_exporting()`` stays False; ``torch.export`` sets both): a capture, like a
    compiled step, serves the example shapes it was made for, while an exported graph must serve any input, so
    under "exporting" transformers materialises every causal mask and gives up ``is_causal``. Attention would
    then carry an explicit mask, which the flash and memory-efficient kernels refuse on a GPU."""
    compiler = torch.compiler
    saved = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = saved


def joint_export(fn, flat_args: list, num_params_buffers: int) -> JointExport:
    """AOTAutograd's export of ``fn(*flat_args) -> (loss,)`` with the gradients of the arguments that require
    them — ``torch._functorch.aot_autograd.aot_export_module(trace_joint=True)`` done by hand, so that

    * a parameter the loss does not use gets no gradient (``aot_export_module`` raises), and
    * the module path and source line stamped on the trace's nodes stay on them (backward nodes take their
      forward op's, matched by autograd's sequence number).

    The model is traced once: the export's graph is then rewritten in place of a second trace (which
    replayed it through ``torch.fx.Interpreter`` under ``make_fx`` and cost as much as the first), by
    :func:`_flat_joint` — the same nodes, metadata and fake values, with flat outputs. The export's own graph
    module is made lazy (torch.fx's ``_use_lazy_graph_module``): it is read as a graph and dropped, and the
    Python code the export generated and compiled for it twice (when made, and after its dead-code pass) was
    ≈ 3 % of a planning benchmark's ``plan()`` (issue 33 item 4).
    """
    export = require("torch._functorch.aot_autograd._aot_export_function")
    lazy = lookup("torch.fx._lazy_graph_module._use_lazy_graph_module", "the export's graph module generates its code")

    fx_traceback = torch.fx.traceback
    with fx_traceback.preserve_node_meta(), lazy(True) if lazy is not None else contextlib.nullcontext():
        fx_g, meta, _, _ = export(
            fn, tuple(flat_args), num_params_buffers=num_params_buffers, no_tangents=True, trace_joint=True
        )
    _places_from_forward(fx_g)
    kernel_backwards(fx_g)
    wants = [isinstance(a, torch.Tensor) and a.requires_grad for a in flat_args]
    gm, has_grad = _flat_joint(fx_g, len(flat_args), wants)
    return JointExport(gm, list(meta.mutated_inp_runtime_indices), has_grad)


def kernel_backwards(gm: torch.fx.GraphModule) -> int:
    """Put back the fused backward kernel eager autograd runs where the export traced a composite formula; returns
    how many were put back.

    SiLU's derivative (``derivatives.yaml``) is ``silu_backward(grad, x)`` unless grad mode is on *or an operand
    is a tensor subclass*: then ``grad * (σ(x) · (1 + x · (1 − σ(x))))`` in separate ops. The export traces with
    functional wrapper tensors, so every captured SiLU got the composite, which eager training never runs: it
    rounds each intermediate (a bf16 gradient of ``silu_backward``'s differs by up to 5e-3 relative; in float32
    the gate projection's gradient of a Llama by 4e-7 where eager against eager is 0). Matched by structure: the
    ``sigmoid`` of a value the forward passes to ``silu``, used only by that formula."""
    aten = torch.ops.aten
    silu_of = {n.args[0] for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.silu.default}
    fused = 0
    for sig in list(gm.graph.nodes):
        if sig.op == "call_function" and sig.target is aten.sigmoid.default and sig.args[0] in silu_of:
            found = _silu_formula(sig)
            if found is None:
                continue
            out, grad, dead = found
            with gm.graph.inserting_before(out):
                new = gm.graph.call_function(aten.silu_backward.default, (grad, sig.args[0]))
            new.meta = dict(out.meta)
            out.replace_all_uses_with(new)
            for node in dead:  # consumers first
                gm.graph.erase_node(node)
            fused += 1
    if fused:
        gm.recompile()
    return fused


def _silu_formula(sig: torch.fx.Node) -> tuple[torch.fx.Node, Any, list[torch.fx.Node]] | None:
    """The nodes of ``grad * (s * (x * (1 - s) + 1))``, s = `sig` = σ(x), as the export writes it: (the product,
    grad, every node of the formula consumers first); None where `sig` is not used so exactly."""
    aten = torch.ops.aten
    x = sig.args[0]

    def only_user(n: torch.fx.Node, target) -> torch.fx.Node | None:
        users = list(n.users)
        return users[0] if len(users) == 1 and users[0].target is target else None

    users = {u.target: u for u in sig.users}
    if len(users) != len(sig.users) or set(users) != {aten.empty_like.default, aten.sub.Tensor, aten.mul.Tensor}:
        return None
    empty, one_minus, prod = users[aten.empty_like.default], users[aten.sub.Tensor], users[aten.mul.Tensor]
    fill = only_user(empty, aten.fill.Scalar)
    if fill is None or fill.args[1] != 1 or one_minus.args != (fill, sig) or only_user(fill, aten.sub.Tensor) is None:
        return None
    times_x = only_user(one_minus, aten.mul.Tensor)
    plus_one = times_x and only_user(times_x, aten.add.Scalar)
    if times_x is None or times_x.args != (x, one_minus) or plus_one is None or plus_one.args != (times_x, 1):
        return None
    if prod.args != (sig, plus_one) or plus_one.kwargs or only_user(plus_one, aten.mul.Tensor) is not prod:
        return None
    out = only_user(prod, aten.mul.Tensor)
    if out is None or out.args[1] is not prod or out.kwargs:
        return None
    return out, out.args[0], [out, prod, plus_one, times_x, one_minus, fill, empty, sig]


def _flat_joint(
    fx_g: torch.fx.GraphModule, num_args: int, wants: list[bool]
) -> tuple[torch.fx.GraphModule, list[bool]]:
    """The export's joint graph as meshpilot reads it: placeholders ``arg{i}_1`` for the flat arguments only
    (the tangents the export adds are unused: ``no_tangents``), outputs the forward's (mutated inputs, loss)
    then each gradient an argument wants and receives; and which arguments received one. Every other node
    is copied with its metadata (its fake value included) and named as its trace named it, renumbered in order
    (:class:`GraphCopy`), so a graph with the same ops in the same order has the same names however it was
    made (``graph.replicate`` builds one without tracing every block)."""
    pytree = torch.utils._pytree
    out = GraphCopy(fx_g)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    old_placeholders = [n for n in fx_g.graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(old_placeholders):
        if i < num_args:
            env[ph] = out.placeholder(f"arg{i}_1", ph.meta)
        elif ph.users:
            raise RuntimeError(f"the joint export reads its tangent {ph.name}; meshpilot exports without tangents")
    output = None
    for node in fx_g.graph.nodes:
        if node.op == "output":
            output = node
        elif node.op != "placeholder":
            env[node] = out.copy(node, lambda a: env[a])
    leaves = pytree.tree_leaves(output.args[0])
    # the graph's own out spec: the lazy module the export made sets ``_out_spec`` only once its code is made
    fw_outs, grads = pytree.tree_unflatten(leaves, fx_g.graph._codegen.pytree_info.out_spec)
    has_grad = [False] * num_args
    outs = [env[o] for o in fw_outs]
    for i, (want, g) in enumerate(zip(wants, grads)):
        if want and g is not None:
            has_grad[i] = True
            outs.append(env[g])
    out.graph.output(tuple(outs))
    return out.module(), has_grad


_NUMBERED = re.compile(r"(.*)_(\d+)$")
_CONSTANT = "_tensor_constant"


class GraphCopy:
    """A graph built from copies of another graph module's nodes, named as a trace names them: each copy by
    its name's stem (``mm_12`` -> ``mm``) numbered by the new graph, a traced constant (``get_attr`` of
    ``_tensor_constant<k>``) as the next ``_tensor_constant<k>`` with its value (a buffer where it was one);
    so two graphs with the same ops in the same order have the same names however they were made."""

    def __init__(self, owner: torch.fx.GraphModule) -> None:
        self.graph = torch.fx.Graph()
        self.owner = owner
        self.holder = torch.nn.Module()
        self.constants = 0

    def placeholder(self, name: str, meta: dict) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        node.meta = dict(meta)
        return node

    def copy(self, node: torch.fx.Node, arg_transform, meta: dict | None = None) -> torch.fx.Node:
        """`node` appended, its arguments mapped by `arg_transform`, with `meta` or a copy of its own."""
        target, name = node.target, node.name
        if node.op == "get_attr":
            value = getattr(self.owner, target)
            if target.startswith(_CONSTANT):
                target = name = f"{_CONSTANT}{self.constants}"
                self.constants += 1
            if node.target in self.owner._buffers:
                self.holder.register_buffer(target, value)
            else:
                setattr(self.holder, target, value)
        else:
            match = _NUMBERED.match(name)
            name = match.group(1) if match else name
        args = torch.fx.node.map_arg(node.args, arg_transform)
        kwargs = torch.fx.node.map_arg(node.kwargs, arg_transform)
        # made without arguments, then given them: torch 2.13's ``create_node`` walks a call's arguments with
        # pytree to warn of raw SymInts, most of a copy's cost; a copy's non-node arguments are its traced
        # node's, which passed that check when the trace made it. Users and uses are kept by the assignments.
        new = self.graph.create_node(node.op, target, name=name, type_expr=node.type)
        if args:
            new.args = args
        if kwargs:
            new.kwargs = kwargs
        new.meta = dict(node.meta) if meta is None else meta
        return new

    def module(self) -> torch.fx.GraphModule:
        """The graph as a module whose Python code is generated when first read or called (torch.fx's lazy
        graph module): planning reads the graph only, and generating the code of a 32-block step's ~5,000
        nodes cost a tenth of the capture."""
        lazy = lookup("torch.fx._lazy_graph_module._LazyGraphModule", "graph modules generate their code when made")
        return (lazy or torch.fx.GraphModule)(self.holder, self.graph)


def _places_from_forward(fx_g: torch.fx.GraphModule) -> None:
    """Give every backward node the module path of the forward node with its autograd sequence number."""
    forward: dict[int, dict] = {}
    for node in fx_g.graph.nodes:
        seq = node.meta.get("seq_nr")
        if seq is not None and not node.meta.get("autograd_backward") and "nn_module_stack" in node.meta:
            forward.setdefault(seq, node.meta)
    for node in fx_g.graph.nodes:
        if node.meta.get("autograd_backward"):
            src = forward.get(node.meta.get("seq_nr"))
            if src is not None:
                node.meta["nn_module_stack"] = src["nn_module_stack"]
                if not str(node.meta.get("stack_trace", "")).startswith(STAMP) and "stack_trace" in src:
                    node.meta["stack_trace"] = src["stack_trace"]
