"""The one accounting of a plan: its step time, the collectives it issues, and what torch's caching allocator
holds on one device during the step. The ILP's terms (``meshpilot.planner.ilp``), the ZeRO post-pass and the
plan's assembly (``meshpilot.planner.auto``) all price a choice of strategies through this module, so the
objective the search minimises is the step time the plan reports (``tests/test_accounting.py``).

Time and collectives
--------------------
A chosen plan maps every node ``v`` to a strategy ``s_v`` (output layouts ``outs``, operand layouts ``ins``).
Its step, over ``m`` microbatches (``F0 B0 … F(m-1) B(m-1) G``, ``meshpilot.planner.schedule``)::

    T = m · Σ_v compute(v, s_v)                       → :class:`ComputeCost` (roofline on the device)
      + m · Σ_v Σ own collectives of s_v               (``Strategy.colls``: ops that communicate inside)
      + Σ_e runs(e) · Σ_{c ∈ reshard(e)} cost(c)      → :func:`step_edges`, ``Resharder``
      + Σ_p update(p, s_p)                             → :func:`optimizer_seconds` (once a step)

``compute(v, s) = roofline(v's share under s) + o`` for an operator that runs a kernel (views and aliases
cost nothing): ``o`` is the device's fixed cost per operator (``DeviceProfile.op_overhead``, what
``meshpilot probe`` measures for a one-element ``add`` among many; on a CPU the dispatch, on a GPU the
launch; 0 when not measured). The sum is exact where the host waits for every operator (a CPU); where a
device queues kernels asynchronously (a GPU) it is an upper bound, by at most ``o`` per operator.

*Host time per runtime call.* Where the device profile holds ``c = DeviceProfile.call_overhead`` (the host
seconds of one call of a recorded forward + backward, ``probe.call_overhead``), every call the runtime's program
makes is priced at ``c`` instead, and ``o`` is dropped (the tiny ``add`` is the floor of a call). The calls of
one device's step (:func:`runtime_calls`, :class:`RuntimeCalls`; :func:`node_calls` per node)::

    N_fwd = Σ_{v ∈ fwd} calls(v) + P_all                       (each parameter's local enters the program)
    N_bwd = Σ_{v ∈ bwd} calls(v) + GRAD_CALLS · P + BUCKETED_GRAD_CALLS · P_b + BUCKET_CALLS · n_b
                                                                (each gradient out of the program; the P_b
                                                                 gradients in the plan's n_b buckets into them)
    N_col = Σ_{collectives k} COLLECTIVE_CALLS[kind(k)] · runs(k)   (DTensor's and the runtime's ops around it)
    N_opt = ADAMW_SCALAR_OPS · P + ADAMW_FOREACH_OPS            (the optimizer's calls: counted, priced below)

``calls(v) = 1`` for every op node, views and aliases included (each is one line of the recorded program),
0 for a leaf or a ``getitem``; ``P`` the trainable parameters, ``P_all`` every parameter. A phase's host time is
``H = c · N`` of its calls (→ :meth:`ComputeCost.host`, :func:`account`), its device time
``D = Σ_v roofline(v)``, and the phase costs

    on a CPU device (``DeviceProfile.is_cpu``: the host computes the kernels too)    D + H
    on an accelerator (the host queues kernels ahead of the device)                  max(D, H)

so ``compute_s = m · Σ_{fwd, bwd} (D + H)`` on a CPU — each node ``roofline + c · calls(v)``
(:meth:`ComputeCost.node`), plus ``c`` times the parameters' and collectives' calls (:func:`account`) — and
``m · Σ_{fwd, bwd} max(D, H)`` on an accelerator, where a node's seconds are its roofline and the ILP's per-node
terms leave the host out (it is a property of the phase, not of one node's strategy). ``c = 0`` (every preset:
no vendor publishes it) leaves every plan as before.

``update(p, s) = B_p / sf_p / bw_adamw + a_adamw`` where the profile holds the foreach AdamW step's measured
rates (``DeviceProfile.adamw_bandwidth``, ``adamw_overhead``: ``probe.adamw_rates``, the step run as training
runs it, its calls' host time included); otherwise
``update(p, s) = 21 · B_p / sf_p / (membw · eff_m) + 9 · o_foreach + 2 · o`` for every trainable
parameter ``p`` (``B_p`` its bytes, ``sf_p`` the shard factor of its layout under ``s``: a parameter
sharded by the plan or by the ZeRO pass updates only its shard): the foreach AdamW step
(``torch/optim/adam.py``, ``_multi_tensor_adam``, defaults: decoupled weight decay, no amsgrad) streams
21 parameter-sized tensors per parameter — ``mul_`` of the weight (read, write: 2), ``lerp_`` of
``exp_avg`` towards the gradient (3), ``mul_`` (2) and ``addcmul_`` (4) of ``exp_avg_sq``, ``sqrt`` (2),
``div_`` (2) and ``add_`` of ``eps`` (2) making the denominator, ``addcdiv_`` into the weight (4) —
through 9 foreach operators (those 8 and the step counter's ``add_``), each paying
``o_foreach = DeviceProfile.foreach_overhead`` for this parameter's tensor in its list, and reads its step
counter twice (``_get_value``: two scalar operators, ``o`` each). Memory-bound on every device: no FLOP term.

over the *edges* ``e`` of the step (:class:`Edge`, :class:`EdgeKind`): every operand of a node, read in the
layout its strategy wants from the layout its producer emits; the loss, made replicated; every parameter's
gradient, resharded into the layout the parameter is stored in (:func:`stored_layout`); every updated
buffer's new value, into the buffer's layout. ``runs(e)`` is ``m`` except for gradients (synchronised once a
step, ``G``). A collective that reduces (all-reduce, reduce-scatter) counts as communication, the others as
resharding, the update as ``optimizer_s`` (``StepTime``). :func:`account` returns ``T``'s parts, the seconds
of each node and the ``PlannedCollective`` list in graph order, then each ZeRO-2 parameter's (a
:class:`StoredApart` strategy, ``meshpilot.planner.zero``) all-gather of its updated shard into the full copy
its readers read, once a step (``gather:<fqn>``); its update is priced at the shard's size. The ILP prices the
same terms (``ilp.build_structure``: the update as a cost of the parameter's strategy), the ZeRO pass the
change of the update with its layout.

Memory
------
Everything here is bytes *per device*: a tensor of ``B`` bytes stored in layout ``L`` takes ``B / sf(L)``
(``sf`` = :func:`~meshpilot.sharding.placements.shard_factor`, the product of the mesh axes sharding it;
replicated and partial axes hold the whole tensor). The step modelled is the one people run and the one
``../shared/gpu/h100-gpt-steps.json`` measured::

    loss = model(*inputs); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

with ``opt = torch.optim.AdamW(...)`` at its defaults (``foreach`` on CUDA), so between steps the device
holds the parameters and AdamW's states, and no gradients.

Terms
-----
Persistent (held for the whole step):

* ``W = Σ_p bytes(p) / sf(p)`` — parameters in their dtype. → :func:`state_bytes` ``.param``. A ZeRO-2
  parameter (:class:`StoredApart`) holds its full copy ``bytes(p) / sf(read)`` besides its shard, and ``sf`` of
  ``W``, ``O``, ``G`` and ``T_opt`` is the shard's (``_parts``; on both ILP rows too).
* ``O = Σ_trainable 2 · bytes(p) / sf(p)`` — AdamW's ``exp_avg`` and ``exp_avg_sq``, allocated by
  ``torch.zeros_like(p)``: in the parameter's dtype, not fp32. → :func:`state_bytes` ``.optimizer``.
  Under ``precision="bf16-mixed"`` (autocast) the parameters are the fp32 master weights, so ``W`` and
  ``O`` are fp32 by the same formula; the bf16 copies autocast makes are graph values (below).
* ``I = Σ inputs and buffers / sf`` — the example inputs and the module's buffers. → :func:`memory_use`

Values of the joint forward + backward graph, by liveness (→ :func:`liveness`). Nodes run in the captured
order (``make_fx`` records the autograd engine's own order, so it is eager's order). A node's output is
allocated when the node runs and freed after its last consumer; a view (``is_view``, ``getitem``,
``_unsafe_view``: ``graph.views.aliases_input``) allocates nothing and keeps its base alive until the view's last
consumer; a value the backward reads (``saved_for_backward``) therefore lives from the forward into the
backward. Gradients of parameters live to the end of the backward (they become ``.grad``); the loss too.
Where an operand's planned layout differs from its producer's, the redistributed copy (``bytes / sf(want)``)
is live while its consumer runs; when the consumer is a view, the copy is that view's base and lives as
long as the view (a weight all-gathered for a view the backward keeps). The copy's bytes and the buffers its
collectives hold only while they run (an all-gather along a dim other than 0 stacks the shards in a buffer
before its ``cat``) are DTensor's as issued (:func:`reshard_bytes`; ``on_cpu``: on gloo, where an all-to-all
is a gather of the whole); the node's peak is the larger of that moment and the one after its outputs.
Where a gradient is resharded into its parameter's layout, the reduced copy is allocated at the end of the
backward, as the runtime does.

*Gradient buckets* (``StagePlan.grad_buckets``, :func:`bucket_buffers`): a bucket is issued right after the
node that produces its last gradient. An all-reduce sums its flat buffer in place and every gradient becomes
a view of it, so the buffer (the bucket's bytes) is held from there to the end of the backward instead of
each gradient's reduced copy. A reduce-scatter moves each gradient whose shard dim is not 0 into rank rows (a
copy), concatenates them into the flat buffer and keeps this rank's row of the sum (``1/n`` of the bucket) to
the end: while it flattens, the rows and the flat buffer (or the flat buffer and the row) are live at once.
The reduced shards are still allocated at the end, as above.

    live(i) = Σ_{values v allocated at or before node i, last used at or after i} bytes(v) / sf(v)

Phases of the step and its peak (→ :func:`memory_use`):

* forward + backward:  ``W + O + I + max_i live(i)``; over ``m > 1`` microbatches (``F0 B0 F1 B1 … G``)
  ``W + O + I + max(max_{i < end} live(i) + A, live(end))`` with ``A = Σ_p bytes(∂p) / sf(∂p as produced)``
  (:func:`accumulated_bytes`): the runtime sums each microbatch's gradients into the step's own tensors
  (``runtime.executor.StepRun._accumulate``, in place), so from microbatch 1 on every node of the graph runs
  beside the sum of the earlier ones, in the layout the backward produces them (a replicated or ZeRO
  parameter's partial sums: whole). At the end the last microbatch's gradients are added into the sum and
  freed, and ``G`` reduces the sum: ``live(end)`` (one set of gradients and their reduced copies) again.
  ``graph`` is one microbatch's; ``m = 1`` is the line above. Measured: ``docs/benchmarks.md``, "Gradient
  accumulation's memory".
* optimizer step:      ``W + O + I + G + T_opt``, ``G = Σ_trainable bytes(p) / sf(p)`` (``.grad`` in the
  parameter's dtype, :func:`state_bytes` ``.grad``) and ``T_opt = Σ_trainable bytes(p) / sf(p)``:
  ``torch._foreach_sqrt(exp_avg_sqs)``, the one state-sized temporary of the foreach AdamW update
  (``torch/optim/adam.py``, ``_multi_tensor_adam``; every other foreach op there is in place).
* ``peak = max`` of the two. ``MemoryUse`` splits the peak into what is live at that moment: parameters
  ``W``, optimizer ``O``, inputs ``I``, gradients (those already produced), activations (saved-for-backward
  values) and temporaries (everything else: logits, their fp32 upcast, the loss' gradient, ``T_opt``).

Not modelled: allocator rounding (blocks round up to 512 B), cuBLAS / cuDNN / flash-attention workspaces
(tens of MiB), fragmentation (``max_memory_allocated`` does not count it), and ``torch.compile``.

The ILP's linear rows
---------------------
``max_i live(i)`` is not linear in the layout choices, so the ILP (``meshpilot.planner.ilp``) holds two
linear lower bounds of the peak to the capacity, both built from :func:`row_bytes` and the saved values of
:func:`saved_values`:

* ``update``:   ``W + O + I + G + T_opt``  — the optimizer step, exactly;
* ``backward``: ``W + O + I + Σ saved values / sf`` — the start of the backward, where every value the
  backward reads is live (grads not yet produced; the temporaries live then are left out); over ``m > 1``
  microbatches plus ``A``, the earlier microbatches' summed gradients (:func:`row_bytes` with
  ``accumulating``: ``G`` in the parameter's layout; ``_parts``: ``A`` exactly).

``peak − max(rows)`` is what lives at the peak beyond them (transient temporaries, gradients produced
before the peak node, redistributed copies; ``MemoryUse.row`` is ``max(rows)``): when a plan's peak
exceeds the capacity, the planner re-solves with the rows held to the capacity less that gap
(``meshpilot.planner.search``, ``ILPSearcher``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from torch.distributed.tensor import Replicate, Shard

from meshpilot.graph.capture import NodeKind, OpGraph, OpNode, Phase, TensorInfo
from meshpilot.graph.gemms import GEMM_OPERANDS, gemm_dims
from meshpilot.graph.views import aliases_input
from meshpilot.ops import own_op
from meshpilot.ops.attention import attention_kind
from meshpilot.planner.plan import MemoryUse, PlannedCollective, StepTime
from meshpilot.sharding.placements import replicated, shard_factor, work_split
from meshpilot.sharding.reshard import CollectiveKind
from meshpilot.sharding.strategies import Strategy, StrategySource

ADAMW_STATES = 2
"""AdamW's per-parameter states (``exp_avg``, ``exp_avg_sq``), each the parameter's size and dtype."""

ADAMW_PASSES = 21
"""Parameter-sized tensors one foreach AdamW step reads or writes per parameter (module docstring)."""

ADAMW_FOREACH_OPS = 9
"""``torch._foreach_*`` operators of one foreach AdamW step (module docstring)."""

ADAMW_SCALAR_OPS = 2
"""Scalar operators per parameter of one foreach AdamW step: its step counter read twice (``_get_value``)."""

GRAD_CALLS = 1
"""Calls per trainable parameter's gradient beyond the graph's (module docstring, ``N_bwd``): the runtime's
backward program hands each gradient out detached."""

BUCKETED_GRAD_CALLS = 2
"""Further calls per gradient in one of the plan's buckets (``StagePlan.grad_buckets``): written into its
bucket's flat buffer and read back as a view of it (``runtime.buckets.write_into_buckets``)."""

BUCKET_CALLS = 4
"""Calls per gradient bucket: its flat buffer allocated (``new_empty``), split into the gradients' slots twice
(``split_with_sizes``: written, read back) and the gradients not written in place copied in (``_foreach_copy_``)."""

COLLECTIVE_CALLS = {
    CollectiveKind.ALL_GATHER: 6,
    CollectiveKind.REDUCE_SCATTER: 4,
}
"""ATen calls the runtime makes around one planned collective of a kind, beyond the collective itself (module
docstring, ``N_col``): an all-gather of a parameter's shard is flattened into its gather group's buffer, and the
gathered rows split, narrowed, reshaped and copied back into the parameter's shape; a gradient reduce-scattered
is moved into rank rows first (permute, reshape, copy into the flat buffer). An all-reduce sums the bucket in
place: nothing beyond :data:`GRAD_CALLS`. Read off the runtime's programs (``runtime.overlap.group_gathers``,
``runtime.buckets``) as the torch profiler shows them (docs/benchmarks.md, issue 30 item 5, "host per call")."""


@dataclass(frozen=True)
class StoredApart(Strategy):
    """A ZeRO-2 parameter's strategy (``meshpilot.planner.zero``): ``outs[0]`` is the full copy its readers
    read, ``stored`` the shard its gradient is reduced into and AdamW updates, all-gathered into the copy once
    a step (``gather:<fqn>``)."""

    stored: Any = None


def stored_layout(s: Any) -> Any:
    """The layout parameter strategy `s` stores and updates the parameter in (its gradient's target)."""
    return s.stored if isinstance(s, StoredApart) else s.outs[0]


MEMORY_ROWS = ("update", "backward")
"""The ILP's memory rows (module docstring)."""

OPTIMIZER_PHASE = "optimizer step"
"""``MemoryUse.peak_at`` when the peak is the optimizer update rather than a graph node."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one parameter's training state (whole tensor; divide by its shard factor per device)."""

    param: float
    grad: float
    """``.grad`` in the parameter's dtype (0 for a frozen parameter)."""
    optimizer: float
    """AdamW ``exp_avg`` + ``exp_avg_sq`` in the parameter's dtype (0 for a frozen parameter)."""
    update_temp: float
    """The foreach update's ``sqrt(exp_avg_sq)`` temporary (0 for a frozen parameter)."""

    @property
    def persistent(self) -> float:
        """Held between steps: the weight and its AdamW states."""
        return self.param + self.optimizer


def state_bytes(info: TensorInfo, trainable: bool) -> StateBytes:
    """A parameter's weight, gradient, AdamW states and update temporary, in its own dtype."""
    w = float(info.nbytes)
    if not trainable:
        return StateBytes(w, 0.0, 0.0, 0.0)
    return StateBytes(w, w, ADAMW_STATES * w, w)


@dataclass(frozen=True)
class RowBytes:
    """A tensor's bytes on each of the ILP's memory rows (:data:`MEMORY_ROWS`)."""

    update: float
    backward: float

    def as_tuple(self) -> tuple[float, float]:
        return (self.update, self.backward)


def row_bytes(node: OpNode, trainable: bool, accumulating: bool = False) -> RowBytes:
    """A leaf's (parameter, buffer, input) bytes on each row, unsharded: a trainable parameter holds
    ``W + O + G + T_opt`` during the update and ``W + O`` at the start of the backward, ``W + O + G`` when
    `accumulating` (more than one microbatch: the earlier ones' summed gradient)."""
    assert node.out is not None
    if node.kind != "param":
        b = float(node.out.nbytes)
        return RowBytes(b, b)
    s = state_bytes(node.out, trainable)
    return RowBytes(s.persistent + s.grad + s.update_temp, s.persistent + (s.grad if accumulating else 0.0))


def zero_row_bytes(node: OpNode, n_rep: float, accumulating: bool = False) -> RowBytes:
    """A trainable parameter's rows when the ZeRO post-pass shards its state over the `n_rep` devices that
    replicate it: the state divided by `n_rep`, plus (backward row) the gathered copy the forward keeps and,
    when `accumulating`, the summed gradient, whole (reduced once, at ``G``)."""
    assert node.out is not None
    s = state_bytes(node.out, True)
    acc = s.grad if accumulating else 0.0
    return RowBytes((s.persistent + s.grad + s.update_temp) / n_rep, s.param + acc + s.persistent / n_rep)


def optimizer_seconds(info: TensorInfo, sf: float, device: Any) -> float:
    """Seconds of the foreach AdamW update of a trainable parameter's shard on `device` (module docstring:
    ``update(p, s)``): at the measured foreach AdamW rates where the profile holds them; otherwise
    :data:`ADAMW_PASSES` parameter-sized streams of ``B / sf`` bytes at the device's memory bandwidth, plus the
    fixed costs of its operators."""
    if device.adamw_bandwidth:
        return info.nbytes / sf / device.adamw_bandwidth + device.adamw_overhead
    streams = update_stream_seconds(info.nbytes / sf, device)
    return streams + ADAMW_FOREACH_OPS * device.foreach_overhead + ADAMW_SCALAR_OPS * device.op_overhead


def update_stream_seconds(nbytes: float, device: Any) -> float:
    """Seconds of the foreach AdamW update's streams over `nbytes` of parameters per device
    (:func:`optimizer_seconds` less its fixed per-tensor costs): at the measured AdamW rate, or
    :data:`ADAMW_PASSES` streams at the device's memory bandwidth."""
    if device.adamw_bandwidth:
        return nbytes / device.adamw_bandwidth
    return ADAMW_PASSES * nbytes / (device.memory_bandwidth * device.memory_efficiency)


# ------------------------------------------------------------------------------------------ runtime calls


@dataclass(frozen=True)
class RuntimeCalls:
    """Calls one device's step makes as the runtime runs a plan (module docstring, *Host time per runtime
    call*): each phase's, every microbatch's forward and backward included."""

    forward: int
    backward: int
    """The backward's, with the gradients' and every collective's calls."""
    optimizer: int

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.optimizer


def node_calls(node: OpNode) -> int:
    """Calls of one run of `node` in the recorded program: 1 for an op (a view or an alias too: one line of the
    program), 0 for a leaf or a ``getitem`` (a Python tuple index)."""
    return 1 if node.kind == NodeKind.OP else 0


def step_calls(
    graph: OpGraph, collectives: Sequence[Any], microbatches: int = 1, buckets: Sequence[Any] = ()
) -> tuple[int, int, int]:
    """The calls beyond the nodes' (module docstring): ``(forward, backward, optimizer)`` — each parameter's
    local entering the forward program, each trainable parameter's gradient leaving the backward
    (:data:`GRAD_CALLS`) and the `buckets`' (:data:`BUCKETED_GRAD_CALLS`, :data:`BUCKET_CALLS`), the runtime's ops
    around the planned `collectives` (:data:`COLLECTIVE_CALLS`; each a ``PlannedCollective`` of one microbatch,
    gradients' of the step: counted as issued), the optimizer's calls."""
    trainable = sum(1 for fqn in graph.param_names if graph.grads.get(fqn) is not None)
    fwd = bwd = 0
    for c in collectives:
        k = COLLECTIVE_CALLS.get(CollectiveKind(c.kind), 0)
        runs = 1 if c.dst.startswith(("grad:", "gather:")) else microbatches
        if c.phase == Phase.FWD.value:
            fwd += k * runs
        else:
            bwd += k * runs
    fwd += len(graph.param_names) * microbatches
    bwd += GRAD_CALLS * trainable
    bwd += sum(BUCKETED_GRAD_CALLS * len(b.params) + BUCKET_CALLS for b in buckets)
    return fwd, bwd, ADAMW_SCALAR_OPS * trainable + ADAMW_FOREACH_OPS


def runtime_calls(
    graph: OpGraph, collectives: Sequence[Any], microbatches: int = 1, buckets: Sequence[Any] = ()
) -> RuntimeCalls:
    """The calls one device's step makes under a plan of `graph` whose collectives are `collectives` (the plan's
    ``PlannedCollective`` list) and gradient buckets `buckets` (``StagePlan.grad_buckets``): the one count of the
    module docstring's ``N_fwd``, ``N_bwd`` (with ``N_col``) and ``N_opt``. What the torch profiler counts as
    top-level ATen calls of a step (an op's own calls inside it are part of its cost,
    :data:`~meshpilot.cluster.devices.DeviceProfile.call_overhead`)."""
    fwd, bwd, opt = step_calls(graph, collectives, microbatches, buckets)
    for n in graph.nodes:
        if n.phase == Phase.FWD:
            fwd += node_calls(n) * microbatches
        elif n.phase == Phase.BWD:
            bwd += node_calls(n) * microbatches
    return RuntimeCalls(fwd, bwd, opt)


def kernel_fixed_seconds(device: Any) -> float:
    """The fixed seconds a kernel-running operator costs beyond its roofline on `device` when the host's calls
    are not priced on their own: ``op_overhead``; 0 where ``call_overhead`` prices every call instead (module
    docstring)."""
    return 0.0 if device.call_overhead else device.op_overhead


def kept_copy_bytes(info: TensorInfo, layout: Any, wants: Sequence[Any], mesh_shape: Sequence[int]) -> float:
    """Bytes per device of the redistributed copies of a parameter stored in `layout` that views the
    backward keeps read in the layouts `wants` (each a copy ``bytes / sf(want)`` living into the backward;
    the same copies :func:`liveness` allocates for resharded views)."""
    lay = _Layouts(None, mesh_shape)
    return sum(info.nbytes / shard_factor(w, mesh_shape) for w in wants if lay.differ(layout, w))


def storage_base(graph: OpGraph, name: str, idx: int) -> tuple[str, int]:
    """The (node, output) whose storage the value ``name[idx]`` aliases (itself unless it is a view)."""
    n = graph[name]
    while aliases_input(n):
        name, idx = n.inputs[0]
        n = graph[name]
    return name, idx


def saved_values(graph: OpGraph) -> list[tuple[str, int]]:
    """Op outputs the backward reads (views counted at their base), each once, in graph order."""
    seen: dict[tuple[str, int], None] = {}
    for n in graph.nodes:
        if not n.saved_for_backward:
            continue
        for i in range(len(n.outputs)) if n.kind == "op" else [0]:
            b = storage_base(graph, n.name, i)
            if graph[b[0]].kind == "op" and graph[b[0]].outputs[b[1]] is not None:
                seen.setdefault(b, None)
    return list(seen)


def weights_read_back(graph: OpGraph, chosen: Mapping[str, Any] | None, mesh_shape: Sequence[int]) -> float:
    """Bytes per device of the parameters the backward reads through a view the forward saved (a linear's
    ``t(weight)``), each once, in the layout that view reads them: were they redistributed on the way (a ZeRO-3
    weight gathered), :func:`liveness` would keep that copy from the forward to the backward (the view's base).
    A block that recomputes its views saves none (``planner.stack`` prices a ZeRO-3 replica's carry with it)."""
    lay = _Layouts(chosen, mesh_shape)
    seen: dict[str, float] = {}
    for n in graph.nodes:
        if not (n.saved_for_backward and aliases_input(n)):
            continue
        src = graph[n.inputs[0][0]]
        if src.kind == "param" and src.out is not None and src.name not in seen:
            seen[src.name] = lay.per_device(src.out, lay.operand(n.name, 0) or lay.out(src.name, 0))
    return sum(seen.values())


# ------------------------------------------------------------------------------------------ liveness


@dataclass(frozen=True)
class ReshardBytes:
    """Bytes per device one redistribution of a value allocates, as DTensor issues it (:func:`reshard_bytes`)."""

    held: float
    """The redistributed copy its reader reads (or the storage that copy is a view of), live until the reader
    is done."""
    passing: float
    """Further buffers live only while the redistribution runs (an all-gather's buffer before its ``cat``)."""


def reshard_bytes(
    info: TensorInfo, have: Any, want: Any, mesh_shape: Sequence[int], on_cpu: bool = False
) -> ReshardBytes:
    """What redistributing a value of `info` from layout `have` to `want` allocates per device, one mesh axis
    after the other as DTensor's ``redistribute`` walks them (``torch.distributed.tensor``:
    ``_collective_utils``, ``Shard._to_replicate_tensor``, ``Shard._to_new_shard_dim``).

    * ``S(d) → R``: an all-gather stacks the shards along dim 0 into a buffer of the result's size; for
      ``d ≠ 0`` a ``cat`` along ``d`` then makes the result, the buffer live beside it: ``passing`` +=
      the result's bytes.
    * ``P → S(d)``, ``d ≠ 0``: the reduce-scatter's input is first ``cat`` into dim-0 order, a copy of the
      input's size: ``passing`` += the input's bytes.
    * ``S(a) → S(b)`` on gloo (``on_cpu``): no all-to-all, so DTensor all-gathers the whole of that axis
      (buffer, and the ``cat`` for ``a ≠ 0``) and takes its own chunk along ``b``; ``.contiguous()`` copies
      that chunk only when it is not contiguous already, so a chunk along the outermost non-unit dim is a
      view that keeps the whole gathered tensor as the copy: ``held`` is the whole then. On a GPU the
      all-to-all makes the shard.
    * Every other step (``R → S``: a local chunk; ``P → R``: an all-reduce) makes the result only.

    ``held`` is the last step's result; ``passing`` the largest step's buffers beyond it."""
    lay = _Layouts(None, mesh_shape)
    cur = list(have)
    held, passing = lay.per_device(info, tuple(have)), 0.0
    for i, (h, w) in enumerate(zip(have, want)):
        if mesh_shape[i] == 1 or h == w:
            continue
        before = lay.per_device(info, tuple(cur))
        cur[i] = w
        after = lay.per_device(info, tuple(cur))
        step = 0.0
        if isinstance(h, Shard) and w.is_replicate() and h.dim != 0:
            step = after
        elif h.is_partial() and isinstance(w, Shard) and w.dim != 0:
            step = before
        elif isinstance(h, Shard) and isinstance(w, Shard) and on_cpu:
            whole = before * mesh_shape[i]
            gathered = 2 * whole if h.dim != 0 else whole  # the gather's buffer beside its cat
            local = _local_shape(info, tuple(cur), mesh_shape)
            if all(x == 1 for x in local[: w.dim]):  # the chunk is a view of the whole
                after, step = whole, gathered - whole
            else:  # .contiguous() copies the chunk out of the whole, both live then
                step = max(gathered, whole + after) - after
        held = after
        passing = max(passing, step)
    return ReshardBytes(held, passing)


def _local_shape(info: TensorInfo, layout: Any, mesh_shape: Sequence[int]) -> list[int]:
    """The shape one device holds of a value of `info` in `layout` (even shards, as the planner assumes)."""
    shape = list(info.shape)
    for p, n in zip(layout, mesh_shape):
        if isinstance(p, Shard) and p.dim < len(shape):
            shape[p.dim] = -(-shape[p.dim] // n)
    return shape


@dataclass(frozen=True)
class Liveness:
    """The graph's values at their peak (bytes per device; persistent state not included)."""

    peak: float
    """``max_i live(i)``."""
    peak_node: str
    saved: float
    """Of the peak: values the backward reads (activations)."""
    grads: float
    """Of the peak: parameter gradients already produced."""
    temporaries: float
    """Of the peak: everything else live there."""
    accumulated: float = 0.0
    """``A``: the earlier microbatches' summed gradients, live through every node of a later microbatch
    (module docstring; 0 with one microbatch). Included in :attr:`peak` and :attr:`grads` when the peak is
    a node's, not the end of the backward."""
    produced: float = 0.0
    """All the parameter gradients (or their buckets) the backward produces, whatever the peak, in the layouts they
    are produced in: what the graph holds from its backward to the end (the reduced copies made at the end
    left out; ``planner.stack`` composes pieces with it)."""


class _Layouts:
    """Shard factors of a plan's values and operands (everything whole when `chosen` is None)."""

    def __init__(self, chosen: Mapping[str, Any] | None, mesh_shape: Sequence[int]):
        self.chosen = chosen
        self.mesh_shape = tuple(mesh_shape)

    def out(self, name: str, i: int) -> Any:
        return None if self.chosen is None else self.chosen[name].outs[i]

    def operand(self, name: str, a: int) -> Any:
        return None if self.chosen is None else self.chosen[name].ins[a]

    def stored(self, name: str) -> Any:
        """The layout parameter `name` is stored and updated in (:func:`stored_layout`)."""
        return None if self.chosen is None else stored_layout(self.chosen[name])

    def per_device(self, info: TensorInfo, layout: Any) -> float:
        return info.nbytes / (shard_factor(layout, self.mesh_shape) if layout is not None else 1)

    def differ(self, have: Any, want: Any) -> bool:
        """Whether a value in layout `have` must be redistributed to `want` (mesh axes of size 1 aside)."""
        if have is None or want is None or have == want:
            return False
        return any(h != w for h, w, n in zip(have, want, self.mesh_shape) if n > 1)

    def reshards(self, src: tuple[str, int], node: str, a: int) -> Any:
        """The layout operand `a` of `node` is redistributed to, or None when it reads `src` as produced."""
        have, want = self.out(*src), self.operand(node, a)
        return want if self.differ(have, want) else None


@dataclass(frozen=True)
class BucketBuffers:
    """What a plan's gradient buckets allocate (``runtime.buckets.BucketSync.issue``), as :func:`liveness` adds
    it (module docstring, *Gradient buckets*)."""

    held: dict[int, float]
    """Node index -> bytes the buckets issued after that node hold to the end of the backward (each result)."""
    flattening: dict[int, float]
    """Node index -> bytes beyond `held` while those buckets are flattened: a reduce-scatter's flat buffer,
    beside the rows its gradients are moved into when their shard dim is not 0 or beside its result."""
    viewed: frozenset[str]
    """Parameters whose synchronised gradient is a view of its bucket's result (all-reduce): no reduced copy
    of their own at the end."""


def bucket_buffers(
    graph: OpGraph, chosen: Mapping[str, Any] | None, mesh_shape: Sequence[int], buckets: Sequence[Any]
) -> BucketBuffers:
    """The buffers of `buckets` (``StagePlan.grad_buckets``) under the layouts `chosen`; each bucket issued
    right after the node that produces its last gradient, as the recorded backward issues it."""
    from meshpilot.planner.buckets import grad_move

    lay = _Layouts(chosen, mesh_shape)
    pnodes = {n.fqn: n for n in graph.nodes if n.kind == "param"}
    held: dict[int, float] = {}
    flattening: dict[int, float] = {}
    viewed: set[str] = set()
    for b in buckets:
        at, moved = -1, 0.0
        for fqn in b.params:
            src = graph.grads[fqn]
            at = max(at, graph[src[0]].index)
            info = graph[src[0]].outputs[src[1]]
            move = grad_move(lay.out(*src), lay.stored(pnodes[fqn].name), info.shape, lay.mesh_shape)
            if move is not None and move.kind == CollectiveKind.REDUCE_SCATTER and move.dim != 0:
                moved += lay.per_device(info, lay.out(*src))  # movedim(dim, 0).reshape: a copy
        if b.kind == CollectiveKind.ALL_REDUCE:  # in place on the flat buffer, the gradients its views
            result, extra = float(b.nbytes), 0.0
            viewed.update(b.params)
        else:  # the moved rows and the flat buffer, then the flat buffer and this rank's row of the sum
            result = b.nbytes / lay.mesh_shape[b.axis]
            extra = max(moved + b.nbytes - result, float(b.nbytes))
        held[at] = held.get(at, 0.0) + result
        flattening[at] = flattening.get(at, 0.0) + extra
    return BucketBuffers(held, flattening, frozenset(viewed))


def _inside_bytes(n: Any, lay: _Layouts) -> float:
    """Bytes node `n`'s own kernel holds at its peak beyond its operands (``OwnOp.inside``), 0 for others.
    The strategy's source is read first: most nodes run DTensor's, and looking up the own op of each of a
    plan's ~4,000 nodes was most of this pass' time (issue 33 item 4)."""
    if lay.chosen is None or n.kind != "op":
        return 0.0
    st = lay.chosen.get(n.name)
    if st is None or getattr(st, "source", None) != StrategySource.MESHPILOT:
        return 0.0
    op = own_op(str(n.target))
    if op is None or op.inside is None:
        return 0.0
    return float(op.inside(n, st, lay.mesh_shape))


@dataclass
class Births:
    """The first pass of :func:`liveness` over a plan's nodes, which its gradient buckets do not change: per
    value its bytes (`size`), the index of its last reader (`last`), the node indices that make it (`born`);
    each node output's storage key (`store`); each node's operand redistributions' passing bytes (`passing`).
    Made once per plan by :func:`births` and handed to the bucketed plan's :func:`memory_use` (the search
    prices a plan without buckets, ``planner.auto._bucketed`` with them); valid only for the graph, `chosen`
    object, mesh shape and `on_cpu` it was made for, which :func:`liveness` checks (by identity: a plan's
    `chosen` is not changed once priced; ``zero.zero_pass`` switches parameters before)."""

    graph: OpGraph
    chosen: Mapping[str, Any] | None
    mesh_shape: tuple[int, ...]
    on_cpu: bool
    size: dict[Any, float]
    last: dict[Any, int]
    store: dict[tuple[str, int], Any]
    born: dict[int, list[Any]]
    passing: dict[int, float]

    def __reduce__(self) -> tuple:  # pickled as None: a planning worker's answer does not carry the graph back
        return type(None), ()

    def made_for(
        self, graph: OpGraph, chosen: Mapping[str, Any] | None, mesh_shape: Sequence[int], on_cpu: bool
    ) -> bool:
        return (
            self.graph is graph and self.chosen is chosen and self.mesh_shape == tuple(mesh_shape)
            and self.on_cpu == on_cpu
        )  # fmt: skip


def births(
    graph: OpGraph, chosen: Mapping[str, Any] | None = None, mesh_shape: Sequence[int] = (), on_cpu: bool = False
) -> Births:
    """:func:`liveness`'s first pass (:class:`Births`)."""
    lay = _Layouts(chosen, mesh_shape)
    size: dict[Any, float] = {}
    last: dict[Any, int] = {}
    store: dict[tuple[str, int], Any] = {}  # value -> storage key (None: persistent leaf)
    born: dict[int, list[Any]] = {}
    passing: dict[int, float] = {}  # node -> bytes its operands' redistributions hold only while they run

    def copy_bytes(info: TensorInfo, src: tuple[str, int], want: Any, idx: int) -> float:
        r = reshard_bytes(info, lay.out(*src), want, lay.mesh_shape, on_cpu)
        passing[idx] = max(passing.get(idx, 0.0), r.passing)
        return r.held

    for n in graph.nodes:
        if n.kind in ("param", "buffer", "input"):
            store[(n.name, 0)] = None
            continue
        if aliases_input(n):
            src = n.inputs[0]
            want = lay.reshards(src, n.name, 0)
            key = store.get(src)
            if want is not None:  # a redistributed copy becomes the view's base
                key = ("copy", n.name)
                info = graph[src[0]].outputs[src[1]]
                size[key] = copy_bytes(info, src, want, n.index) if info is not None else 0.0
                born.setdefault(n.index, []).append(key)
            for i in range(len(n.outputs)):
                store[(n.name, i)] = key
        else:
            for i, info in enumerate(n.outputs):
                if info is None:
                    continue
                key = (n.name, i)
                store[key] = key
                size[key] = lay.per_device(info, lay.out(n.name, i))
                born.setdefault(n.index, []).append(key)
            for a, src in enumerate(n.inputs):
                want = lay.reshards(src, n.name, a)
                info = graph[src[0]].outputs[src[1]]
                if want is not None and info is not None:
                    key = ("operand", n.name, a)
                    size[key] = copy_bytes(info, src, want, n.index)
                    born.setdefault(n.index, []).append(key)
                    last[key] = n.index
        inside = _inside_bytes(n, lay)
        if inside:  # an own kernel's buffers while it runs (ring attention's blocks), in place of its outputs
            passing[n.index] = max(passing.get(n.index, 0.0), inside)
        for src in n.inputs:
            key = store.get(src)
            if key is not None:
                last[key] = max(last.get(key, -1), n.index)
    return Births(graph, chosen, lay.mesh_shape, on_cpu, size, last, store, born, passing)


def liveness(
    graph: OpGraph,
    chosen: Mapping[str, Any] | None = None,
    mesh_shape: Sequence[int] = (),
    microbatches: int = 1,
    on_cpu: bool = False,
    buckets: Sequence[Any] = (),
    first: Births | None = None,
) -> Liveness:
    """Sweep the graph in execution order and return its peak of live values (module docstring).

    `chosen` maps every node to its strategy (``.outs`` / ``.ins`` layouts on `mesh_shape`); without it every
    value is whole (one device). With `microbatches` > 1 every node before the end also holds ``A``, the
    gradients the earlier microbatches summed (:func:`accumulated_bytes`). `on_cpu`: the redistributions are
    issued as DTensor issues them on gloo (:func:`reshard_bytes`). `buckets`: the plan's gradient buckets
    (:func:`bucket_buffers`); without them every gradient is reduced on its own at the end. `first`: the
    first pass (:func:`births`) where it was made already for these arguments."""
    lay = _Layouts(chosen, mesh_shape)
    end = len(graph.nodes)
    if first is None or not first.made_for(graph, chosen, mesh_shape, on_cpu):
        first = births(graph, chosen, mesh_shape, on_cpu)
    size, last, store, passing = dict(first.size), dict(first.last), first.store, first.passing
    born = {idx: list(keys) for idx, keys in first.born.items()}
    grad_keys: set[Any] = set()
    reduced: list[Any] = []
    pnodes = {n.fqn: n for n in graph.nodes if n.kind == "param"}
    flat = bucket_buffers(graph, chosen, mesh_shape, buckets)
    for idx, nbytes in flat.held.items():
        key = ("bucket", idx)
        size[key], last[key] = nbytes, end
        born.setdefault(idx, []).append(key)
        grad_keys.add(key)
    for fqn, src in graph.grads.items():
        if src is None or store.get(src) is None:
            continue
        key = store[src]
        last[key] = end
        grad_keys.add(key)
        p = pnodes[fqn]
        have, want = lay.out(*src), lay.stored(p.name)
        if lay.differ(have, want) and p.out is not None and fqn not in flat.viewed:
            rkey = ("grad", fqn)
            size[rkey] = lay.per_device(p.out, want)
            reduced.append(rkey)
    loss_key = store.get(graph.loss)
    if loss_key is not None:
        last[loss_key] = end
    born[end] = reduced
    grad_keys.update(reduced)
    saved = {store.get(v) for v in saved_values(graph)}
    # a redistributed copy that a view the backward reads aliases is kept for the backward too
    saved |= {store.get((n.name, i)) for n in graph.nodes if n.saved_for_backward for i in range(len(n.outputs))}
    held = accumulated_bytes(graph, chosen, mesh_shape) if microbatches > 1 else 0.0
    return _sweep(graph, size, last, born, grad_keys, saved - {None}, end, held, passing, flat.flattening)


def accumulated_bytes(graph: OpGraph, chosen: Mapping[str, Any] | None, mesh_shape: Sequence[int]) -> float:
    """``A = Σ_p bytes(∂p) / sf(layout ∂p is produced in)``: the running sum of the gradients over the
    microbatches (``runtime.executor.StepRun._accumulate``), each in the layout the backward produces it —
    partial sums unreduced, so a replicated or ZeRO parameter's is whole (module docstring)."""
    lay = _Layouts(chosen, mesh_shape)
    total = 0.0
    for src in {src for src in graph.grads.values() if src is not None}:
        info = graph[src[0]].outputs[src[1]]
        total += lay.per_device(info, lay.out(*src)) if info is not None else 0.0
    return total


def _sweep(
    graph: OpGraph,
    size: dict,
    last: dict,
    born: dict,
    grad_keys: set,
    saved: set,
    end: int,
    held: float = 0.0,
    passing: Mapping[int, float] | None = None,
    after: Mapping[int, float] | None = None,
) -> Liveness:
    """Allocate at birth, free after the last use; the peak and what is live there. `held` is live at every
    node before `end` (the accumulated gradients; at `end` the last microbatch's are added into them).
    `passing[i]`: bytes node ``i``'s operand redistributions hold only while they run, before the node's own
    outputs exist (:func:`reshard_bytes`); `after[i]`: bytes held briefly once its outputs exist (a gradient
    bucket flattened: :func:`bucket_buffers`)."""
    death: dict[Any, int] = {}
    dying: dict[int, list[Any]] = {}
    best, best_idx, total = -1.0, -1, 0.0
    passing, after = passing or {}, after or {}
    for idx in sorted(born):
        for key in born[idx]:
            total += size[key]
            death[key] = max(last.get(key, idx), idx)
            dying.setdefault(death[key], []).append(key)
        base = total + (held if idx < end else 0.0)
        now = base + after.get(idx, 0.0)
        if idx in passing:  # the redistribution's moment: the copies and their buffers, not the outputs yet
            outputs = sum(size[k] for k in born[idx] if len(k) == 2 and isinstance(k[1], int))
            now = max(now, base - outputs + passing[idx])
        if now > best:
            best, best_idx = now, idx
        for key in dying.pop(idx, ()):
            total -= size[key]
    if best_idx < 0:
        return Liveness(0.0, "", 0.0, 0.0, 0.0)
    at = [k for idx in born if idx <= best_idx for k in born[idx] if death[k] >= best_idx]
    in_saved = sum(size[k] for k in at if k in saved)
    in_grads = sum(size[k] for k in at if k in grad_keys and k not in saved)  # the rest: temporaries
    name = graph.nodes[best_idx].name if best_idx < end else "end of backward"
    held = held if best_idx < end else 0.0
    at_end = set(born.get(end, ()))
    produced = sum(size[k] for k in grad_keys if k not in saved and k not in at_end)
    return Liveness(best, name, in_saved, in_grads + held, best - in_saved - in_grads - held, held, produced)


# ------------------------------------------------------------------------------------------ memory use


@dataclass(frozen=True)
class _Parts:
    """The persistent state, the ILP rows and the liveness of one step: what :func:`memory_use` and
    :func:`phase_peaks` are made of."""

    params: float
    optimizer: float
    grads: float
    update_temp: float
    inputs: float
    rows: tuple[float, float]
    saved: float
    """Σ saved-for-backward values per device (one microbatch's activations)."""
    live: Liveness


def _parts(
    graph: OpGraph,
    chosen: Mapping[str, Any] | None,
    mesh_shape: Sequence[int],
    microbatches: int = 1,
    on_cpu: bool = False,
    buckets: Sequence[Any] = (),
    first: Births | None = None,
) -> _Parts:
    lay = _Layouts(chosen, mesh_shape)
    w = o = g = t_opt = inputs = 0.0
    rows = [0.0, 0.0]
    for n in graph.nodes:
        if n.kind not in ("param", "buffer", "input") or n.out is None:
            continue
        sf = shard_factor(lay.out(n.name, 0), lay.mesh_shape) if lay.chosen is not None else 1
        trainable = n.kind == "param" and graph.grads.get(n.fqn) is not None
        copy = 0.0  # a ZeRO-2 parameter's full copy, besides its stored shard
        if n.kind == "param" and isinstance(lay.chosen and lay.chosen[n.name], StoredApart):
            copy, sf = n.out.nbytes / sf, shard_factor(lay.stored(n.name), lay.mesh_shape)
        if n.kind == "param":
            s = state_bytes(n.out, trainable)
            w, o, g, t_opt = w + copy + s.param / sf, o + s.optimizer / sf, g + s.grad / sf, t_opt + s.update_temp / sf
        else:
            inputs += n.out.nbytes / sf
        r = row_bytes(n, trainable)
        rows = [rows[0] + copy + r.update / sf, rows[1] + copy + r.backward / sf]
    saved = 0.0
    for v in saved_values(graph):
        info = graph[v[0]].outputs[v[1]]
        saved += lay.per_device(info, lay.out(*v)) if info is not None else 0.0
    rows[1] += saved
    if microbatches > 1:  # the earlier microbatches' gradients, held at the start of a later one's backward
        rows[1] += accumulated_bytes(graph, chosen, mesh_shape)
    live = liveness(graph, chosen, mesh_shape, microbatches, on_cpu, buckets, first)
    return _Parts(w, o, g, t_opt, inputs, (rows[0], rows[1]), saved, live)


def memory_use(
    graph: OpGraph,
    chosen: Mapping[str, Any] | None = None,
    mesh_shape: Sequence[int] = (),
    capacity: float = float("inf"),
    microbatches: int = 1,
    on_cpu: bool = False,
    buckets: Sequence[Any] = (),
    first: Births | None = None,
) -> MemoryUse:
    """Predicted peak bytes per device of one training step of a plan (module docstring), as a
    :class:`~meshpilot.planner.plan.MemoryUse` whose parts add up to the peak; `graph` is one microbatch's,
    accumulated over `microbatches` (``F0 B0 … G``); `on_cpu`: its redistributions issued as on gloo
    (:func:`reshard_bytes`); `buckets`: its gradient buckets (:func:`bucket_buffers`); `first`: :func:`liveness`'s
    first pass made already (:func:`births`)."""
    p = _parts(graph, chosen, mesh_shape, microbatches, on_cpu, buckets, first)
    live = p.live
    if live.peak >= p.grads + p.update_temp:  # the forward + backward peaks higher than the optimizer step
        grads, saved, temporaries, at = live.grads, live.saved, live.temporaries, live.peak_node
    else:
        grads, saved, temporaries, at = p.grads, 0.0, p.update_temp, OPTIMIZER_PHASE
    return MemoryUse(
        p.params, grads, p.optimizer, saved, p.inputs, capacity, temporaries=temporaries, row=max(p.rows), peak_at=at
    )


@dataclass(frozen=True)
class PhasePeaks:
    """Bytes per device at the peak of each phase of the step, and one microbatch's activations: what a
    pipeline schedule that keeps several microbatches in flight adds up (``planner.pipeline``)."""

    forward_backward: float
    """``W + O + I + max_i live(i)`` (module docstring)."""
    update: float
    """``W + O + I + G + T_opt``."""
    activations: float
    """Σ saved-for-backward values: what each further microbatch in flight holds until its backward."""
    resident: float | None = None
    """``W + O + I + G``: what the stage holds while another stage of its device computes — its weights,
    states, inputs and gradients (``config_plan.group_bound``); None where unknown (plans saved before it)."""


def phase_peaks(graph: OpGraph, chosen: Mapping[str, Any] | None = None, mesh_shape: Sequence[int] = ()) -> PhasePeaks:
    """Each phase's peak of one step of a plan (module docstring) and its activations."""
    p = _parts(graph, chosen, mesh_shape)
    base = p.params + p.optimizer + p.inputs
    return PhasePeaks(base + p.live.peak, base + p.grads + p.update_temp, p.saved, base + p.grads)


def in_flight_peak(
    graph: OpGraph,
    chosen: Mapping[str, Any] | None,
    mesh_shape: Sequence[int],
    microbatches: int,
    in_flight: int,
    on_cpu: bool = False,
    buckets: Sequence[Any] = (),
) -> float:
    """Alpa's Eq. 5 for a pipeline stage's plan: ``max(W + O + I + G + T_opt, W + O + I + max_i live(i) +
    (in_flight − 1) · saved)``, the forward + backward over `microbatches` as :func:`memory_use` counts it (the
    summed gradients, the buckets) and beside it the saved values of the `in_flight` − 1 other microbatches a
    pipeline schedule keeps (``planner.pipeline.stage_memory``, of the stage table's costs)."""
    p = _parts(graph, chosen, mesh_shape, microbatches, on_cpu, buckets)
    base = p.params + p.optimizer + p.inputs
    return max(base + p.grads + p.update_temp, base + p.live.peak + (in_flight - 1) * p.saved)


# ------------------------------------------------------------------------------------------ time


def reduced_in_op(s: Any, out: Any, mesh_shape: Sequence[int]) -> int:
    """How many more devices share `s`'s work than its output layout `out` says: the axes where the output is
    replicated because the op's own collective (``Strategy.colls``) reduced what each rank computed from its
    shard of an operand (the data-parallel loss: rows sharded, the summed loss all-reduced in the op)."""
    axes = {c.axis for c in s.colls}
    return math.prod(
        n
        for a, n in enumerate(mesh_shape)
        if a in axes and isinstance(out[a], Replicate) and any(p is not None and isinstance(p[a], Shard) for p in s.ins)
    )


class ComputeCost:
    """Seconds of a node's share of the work under a strategy, on one mesh shape and device."""

    def __init__(self, cost_model: Any, mesh_shape: Sequence[int], graph: OpGraph | None = None):
        self.cm = cost_model
        self.mesh_shape = tuple(mesh_shape)
        self.graph = graph

    def node(self, node: OpNode, s: Any) -> float:
        """Seconds of the device's share of `node` under strategy `s`: its roofline, a matmul at the rate
        measured for its local GEMM shape (``CostModel.compute``; a Float8 product, ``OpNode.float8``, at the
        Float8 rate with its casts: ``CostModel.float8_gemm``), plus the device's fixed cost per operator
        (``DeviceProfile.op_overhead``). Views and aliases (``_unsafe_view``) cost nothing. Where the profile
        prices the host's calls (``call_overhead``) on a CPU, every op node adds its calls' host seconds
        (:meth:`host`), views included, and ``op_overhead`` is dropped (module docstring)."""
        device = self.cm.device  # the ILP's hottest call: the kind's test only where calls are priced
        host = self.host(node) if device.call_overhead and device.is_cpu else 0.0
        if node.kind != NodeKind.OP or aliases_input(node) or (node.flops == 0 and node.bytes_written == 0):
            return host
        out = next((p for p in s.outs if p is not None), None)
        split = work_split(out, self.mesh_shape) * reduced_in_op(s, out, self.mesh_shape) if out is not None else 1
        dtype = node.out.dtype if node.out is not None else "float32"
        nbytes = (node.bytes_read + node.bytes_written) / split
        gemm = self._local_gemm(node, s)
        attention = self._attention(node, out, nbytes, split)
        if attention is not None:  # a fused kernel's measured rates, causal-aware (``CostModel.attention``)
            roofline = attention
        elif node.float8 and gemm is not None:  # a Float8 linear's product and its operands' casts
            roofline = self.cm.float8_gemm(node.flops / split, nbytes, gemm)
        else:
            roofline = self.cm.compute(node.flops / split, nbytes, dtype, gemm)
        return roofline + kernel_fixed_seconds(device) + host

    def host(self, node: OpNode) -> float:
        """Host seconds of `node`'s calls in the runtime's program: ``call_overhead · node_calls`` (module
        docstring; 0 where the profile does not price calls)."""
        return self.cm.device.call_overhead * node_calls(node)

    def _attention(self, node: OpNode, out: Any, nbytes: float, split: int) -> float | None:
        """Seconds of an attention node's share at the device's measured attention rates; None for other nodes
        or without rates. Its query rows (dim 2 of its first output, ``[b, h, t, e]``) split over the mesh
        axes that shard them: ``ops.causal_rows``' contiguous chunks, the slowest rank's work priced; a call in
        the zig-zag order (``OpNode.zigzag``) with its rows split over one axis, every rank's balanced work."""
        kind = attention_kind(node)
        if kind is None or self.cm.device.attention is None:
            return None
        causal, backward = kind
        rows, axes = 1, 0
        for axis, p in enumerate(out or ()):
            if isinstance(p, Shard) and p.dim == 2 and self.mesh_shape[axis] > 1:
                rows *= self.mesh_shape[axis]
                axes += 1
        balanced = node.zigzag and axes == 1
        return self.cm.attention(node.flops / split, nbytes, causal, rows, backward, balanced)

    def update(self, node: OpNode, s: Any) -> float:
        """Seconds of the optimizer's update of parameter `node` stored as strategy `s` lays it out
        (:func:`optimizer_seconds`); 0 for anything but a trainable parameter."""
        if node.kind != NodeKind.PARAM or node.out is None or self.graph is None:
            return 0.0
        if self.graph.grads.get(node.fqn) is None:
            return 0.0
        lay = stored_layout(s) if s.outs else None
        sf = shard_factor(lay, self.mesh_shape) if lay is not None else 1
        return optimizer_seconds(node.out, sf, self.cm.device)

    def local_gemm(self, node: OpNode, s: Any) -> tuple[int, int, int] | None:
        """(m, n, k) of the device's shard of a matmul under `s`; None for anything else."""
        return self._local_gemm(node, s)

    def _local_gemm(self, node: OpNode, s: Any) -> tuple[int, int, int] | None:
        """(m, n, k) of the device's shard of a matmul under `s` (operand dims divided by their shards)."""
        if self.graph is None or node.target not in GEMM_OPERANDS:
            return None
        shapes = []
        for a, (src, i) in enumerate(node.inputs):
            info = self.graph[src].outputs[i]
            shape = list(info.shape) if info is not None else []
            layout = s.ins[a] if a < len(s.ins) else None
            for axis, p in enumerate(layout or ()):
                if isinstance(p, Shard) and p.dim < len(shape):
                    shape[p.dim] = -(-shape[p.dim] // self.mesh_shape[axis])
            shapes.append(shape)
        return gemm_dims(node.target, shapes)


class EdgeKind(StrEnum):
    """What an edge of the step carries (module docstring, "Time and collectives")."""

    OPERAND = "operand"
    """Operand ``operand`` of node ``dst``, into the layout its strategy reads."""
    LOSS = "loss"
    """The loss, made replicated."""
    GRAD = "grad"
    """A parameter's gradient, into the layout of parameter node ``dst`` (once a step)."""
    BUFFER = "buffer"
    """A buffer's new value, into the layout of buffer node ``dst``."""


@dataclass(frozen=True)
class Edge:
    """Value ``src[index]`` flowing to where the step needs it (:class:`EdgeKind`)."""

    src: str
    index: int
    dst: str
    kind: EdgeKind
    operand: int = -1

    def runs(self, microbatches: int) -> int:
        """How often a step crosses the edge: once per microbatch, a gradient once."""
        return 1 if self.kind == EdgeKind.GRAD else microbatches

    def want(self, chosen: Mapping[str, Any], ndim: int) -> Any:
        """The layout the edge delivers the value in, under the strategies `chosen`."""
        if self.kind == EdgeKind.OPERAND:
            return chosen[self.dst].ins[self.operand]
        if self.kind == EdgeKind.LOSS:
            return replicated(ndim)
        if self.kind == EdgeKind.GRAD:
            return stored_layout(chosen[self.dst])
        return chosen[self.dst].outs[0]

    def label(self, graph: OpGraph) -> str:
        """The ``dst`` a plan's collective names: the reading node, ``loss``, ``grad:<fqn>``, ``buffer:<fqn>``."""
        if self.kind == EdgeKind.OPERAND:
            return self.dst
        if self.kind == EdgeKind.LOSS:
            return "loss"
        return f"{self.kind.value}:{graph[self.dst].fqn}"

    def phase(self, graph: OpGraph) -> Phase:
        if self.kind == EdgeKind.OPERAND:
            return Phase.FWD if graph[self.dst].phase == Phase.FWD else Phase.BWD
        return Phase.BWD if self.kind == EdgeKind.GRAD else Phase.FWD


def step_edges(graph: OpGraph) -> list[Edge]:
    """Every edge of the step: each node's operands in graph order, then the loss, the gradients (in
    parameter order) and the buffer updates."""
    out = [Edge(src, i, n.name, EdgeKind.OPERAND, a) for n in graph.nodes for a, (src, i) in enumerate(n.inputs)]
    if graph.loss is not None:  # a pipeline stage before the last has none (``planner.stage``)
        out.append(Edge(*graph.loss, graph.loss[0], EdgeKind.LOSS))
    pnode = {n.fqn: n.name for n in graph.nodes if n.kind == NodeKind.PARAM}
    for fqn in graph.param_names:
        g = graph.grads.get(fqn)
        if g is not None:
            out.append(Edge(g[0], g[1], pnode[fqn], EdgeKind.GRAD))
    bnode = {n.fqn: n.name for n in graph.nodes if n.kind == NodeKind.BUFFER}
    for fqn, (src, i) in graph.buffer_updates.items():
        out.append(Edge(src, i, bnode[fqn], EdgeKind.BUFFER))
    return out


def edge_seconds(graph: OpGraph, edge: Edge, have: Any, want: Any, resharder: Any, microbatches: int = 1) -> float:
    """Seconds a step spends resharding `edge`'s value from layout `have` to `want` (all its crossings)."""
    info = graph[edge.src].outputs[edge.index]
    if info is None or have is None or want is None:
        return 0.0
    return edge.runs(microbatches) * resharder.cost(have, want, info)


@dataclass(frozen=True)
class TimeAccount:
    """The step time of a chosen plan, per node and per collective (module docstring)."""

    time: StepTime
    node_seconds: dict[str, float]
    """Each node's compute for one microbatch."""
    collectives: tuple[PlannedCollective, ...]
    """Every collective of one microbatch's step (gradients': of the step), in graph order."""


def account(
    graph: OpGraph,
    chosen: Mapping[str, Any],
    resharder: Any,
    compute: ComputeCost,
    microbatches: int = 1,
    edges: Sequence[Edge] | None = None,
) -> TimeAccount:
    """The step time and collectives of the strategies `chosen` (module docstring, "Time and collectives").
    `edges` is :func:`step_edges` of `graph` (computed when not given)."""
    nd = len(resharder.mesh_shape)
    parts = {"comm": 0.0, "reshard": 0.0}
    colls: list[PlannedCollective] = []

    def add(c: Any, sec: float, runs: int, phase: Phase, src: str, dst: str, operand: int = -1) -> None:
        parts["comm" if c.is_reduction else "reshard"] += sec * runs
        colls.append(PlannedCollective(c.kind, c.axis, c.nbytes, phase.value, src, dst, sec, operand))

    by_dst: dict[str, list[Edge]] = {}
    tail: list[Edge] = []
    for e in edges if edges is not None else step_edges(graph):
        (by_dst.setdefault(e.dst, []) if e.kind == EdgeKind.OPERAND else tail).append(e)

    def cross(e: Edge) -> None:
        info = graph[e.src].outputs[e.index]
        have, want = chosen[e.src].outs[e.index], e.want(chosen, nd)
        if info is None or have is None or want is None:
            return
        for c in resharder.collectives(have, want, info):
            add(c, resharder.collective_cost(c), e.runs(microbatches), e.phase(graph), e.src, e.label(graph), e.operand)

    seconds: dict[str, float] = {}
    total_compute = total_update = 0.0
    device_s = {Phase.FWD: 0.0, Phase.BWD: 0.0}  # one microbatch's roofline and host seconds per phase
    host_s = {Phase.FWD: 0.0, Phase.BWD: 0.0}
    for node in graph.nodes:
        st = chosen[node.name]
        seconds[node.name] = sec = compute.node(node, st)
        total_compute += sec * microbatches
        total_update += compute.update(node, st)
        if node.phase in device_s:
            device_s[node.phase] += sec
            host_s[node.phase] += compute.host(node)
        phase = Phase.FWD if node.phase == Phase.FWD else Phase.BWD
        for c in st.colls:  # collectives the op issues itself (own strategies): src = dst = the node
            add(c, resharder.op_collective_cost(c), microbatches, phase, node.name, node.name)
        for e in by_dst.get(node.name, ()):
            cross(e)
    for e in tail:
        cross(e)
    for node in graph.nodes:  # ZeRO-2 weights: the updated shard all-gathered into the full copy, once a step
        st = chosen[node.name]
        if isinstance(st, StoredApart) and node.out is not None:
            for c in resharder.collectives(st.stored, st.outs[0], node.out):
                add(c, resharder.collective_cost(c), 1, Phase.FWD, node.name, f"gather:{node.fqn}")
    total_compute = _with_host(graph, colls, compute.cm, microbatches, total_compute, device_s, host_s)
    step = StepTime(total_compute, parts["comm"], parts["reshard"], total_update)
    return TimeAccount(step, seconds, tuple(colls))


def _with_host(
    graph: OpGraph,
    colls: Sequence[PlannedCollective],
    cm: Any,
    microbatches: int,
    total: float,
    device_s: dict[Phase, float],
    host_s: dict[Phase, float],
) -> float:
    """The forward and backward's compute with the host's calls (module docstring, *Host time per runtime
    call*): on a CPU the nodes' seconds (which hold their calls) plus the parameters' and collectives' calls;
    on an accelerator each phase's ``max(D, H)``. `total` is the nodes' seconds over every microbatch,
    `device_s` / `host_s` one microbatch's per phase. The buckets' calls are not priced here: the plan's buckets
    are chosen after its strategies are priced (``planner.buckets``), and they are a few per gradient."""
    c = cm.device.call_overhead if cm is not None else 0.0
    if not c:
        return total
    fwd, bwd, _ = step_calls(graph, colls, microbatches)
    if cm.device.is_cpu:
        return total + c * (fwd + bwd)
    extra = {Phase.FWD: c * fwd, Phase.BWD: c * bwd}
    return sum(max(device_s[p] * microbatches, host_s[p] * microbatches + extra[p]) for p in device_s)


def reprice(plan: Any, graph: OpGraph, cluster: Any) -> Any:
    """`plan` priced on `cluster`: the same strategies, layouts, collectives and schedule, every node's compute
    and every collective's seconds (and so ``Plan.time``) recomputed by :func:`account` on the cluster's
    device and links, at the plan's mesh shape and rank map. On the cluster it was planned on, it reproduces
    the plan. `graph` is the captured model the plan was made for (its FLOPs and bytes are not in the plan)."""
    import dataclasses

    import numpy as np

    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.planner.buckets import repriced_buckets
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import fake_device_mesh

    cl = load_cluster(cluster)
    shape = tuple(plan.mesh_shape)
    lm = LogicalMesh(cl, shape, np.asarray(plan.mesh_ranks, dtype=np.int64).reshape(shape))
    resharder = Resharder(fake_device_mesh(shape), CostModel(lm))
    chosen = plan_strategies(plan, graph)
    acct = account(
        graph, chosen, resharder, ComputeCost(resharder.cost_model, shape, graph), plan.step_schedule().microbatches
    )
    nodes = tuple(dataclasses.replace(n, seconds=acct.node_seconds[n.name]) for n in plan.nodes)
    out = dataclasses.replace(plan, cluster=cl.name, nodes=nodes, collectives=acct.collectives, time=acct.time)
    return repriced_buckets(out, resharder.cost_model)  # the same buckets, their overlap priced again


def plan_strategies(plan: Any, graph: OpGraph | None = None) -> dict[str, Any]:
    """Every node's chosen strategy, rebuilt from a saved plan (layouts, source, and the collectives an own
    strategy issues inside the op); with `graph` (the plan's: it names the parameters' nodes), a ZeRO-2
    parameter's as the :class:`StoredApart` it was planned as."""
    from meshpilot.sharding.placements import from_json
    from meshpilot.sharding.reshard import Collective

    own: dict[str, list[Collective]] = {}
    for c in plan.collectives:
        if c.src == c.dst:  # issued inside the op (an own strategy's)
            own.setdefault(c.src, []).append(Collective(c.kind, c.axis, c.nbytes))
    out = {
        n.name: Strategy(
            tuple(from_json(x) if x is not None else None for x in n.outs),
            tuple(from_json(x) for x in n.ins),
            n.source,
            colls=tuple(own.get(n.name, ())),
        )
        for n in plan.nodes
    }
    node = {n.fqn: n.name for n in graph.nodes if n.kind == NodeKind.PARAM} if graph is not None else {}
    for z in plan.zero:
        if z.gathered_once and z.param in node:
            st = out[node[z.param]]
            out[node[z.param]] = StoredApart(st.outs, st.ins, st.source, colls=st.colls, stored=from_json(z.after))
    return out


def plan_gemms(plan: Any, graph: OpGraph) -> list[tuple[int, int, int, str]]:
    """The distinct GEMMs ``(m, n, k, dtype)`` one device of `plan` runs: every matmul of `graph` at its local
    shard's shape under the plan's strategies, most frequent first. What ``meshpilot probe --matmul-shapes``
    measures so that a custom model's plans are priced at their own GEMMs' rates."""
    from collections import Counter

    chosen = plan_strategies(plan)
    cc = ComputeCost(None, plan.mesh_shape, graph)
    seen: Counter = Counter()
    for node in graph.nodes:
        dims = cc.local_gemm(node, chosen[node.name]) if node.kind == NodeKind.OP else None
        if dims is not None and node.out is not None:
            seen[(*dims, node.out.dtype)] += 1
    return [key for key, _ in seen.most_common()]
