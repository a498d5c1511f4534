"""Dropless mixture-of-experts as one node: ``meshpilot::moe_experts`` and ``meshpilot::moe_experts_backward``.

Hugging Face's default experts path (``MixtralExperts.forward``, eager) loops over the experts that were hit,
finding their tokens with ``nonzero``/``where``: shapes that depend on the routing, which capture on fake
tensors cannot see. meshpilot registers its own experts implementation with transformers
(``experts_implementation="meshpilot"``, :func:`register_with_transformers`; ``hf:mixtral`` uses it by
default): the whole experts computation becomes one custom op whose operands have static shapes, so the
captured graph holds one forward and one backward node, and everything data-dependent happens inside them.

Math (per token t, its k chosen experts e with routing weights w_{t,e}, SwiGLU experts)::

    y_{t,e} = W2_e · (act(G_e x_t) ⊙ (U_e x_t))          (gate_up_proj[e] = [G_e; U_e], down_proj[e] = W2_e)
    out_t   = Σ_e w_{t,e} · y_{t,e}                       (no capacity: no token is dropped)
    ∂w_{t,e} = ⟨g_t, y_{t,e}⟩,  ∂x_t = Σ_e vjp_x(w_{t,e} g_t),  ∂W_e = Σ_t vjp_W(w_{t,e} g_t)

Locally (:func:`_forward_local`, :func:`_backward_local`) the (token, expert) pairs are sorted by expert
(stable, so each token's contributions add in expert order, as HF's loop adds them) and each expert runs on
its rows; the backward recomputes the experts' activations (:func:`_expert_vjp`).

Strategies (:func:`_forward_strategies`, :func:`_backward_strategies`; per mesh axis, exclusive):

==============  ===================================================  ============================================
per axis        layouts                                              collectives inside the op (that axis)
==============  ===================================================  ============================================
expert-parallel tokens ``S(0)``, experts ``S(0)``; expert gradients    forward: all-to-all of per-expert counts,
                ``S(0)`` (each rank gets every token's contribution   dispatch of token rows, combine of expert
                to its experts)                                       outputs; backward: counts, dispatch of
                                                                      ``[x | g | w]`` rows, combine of ``[∂x | ∂w]``
data-parallel   tokens ``S(0)``, experts replicated; expert           none
                gradients ``Partial`` (summed by the gradient sync)
replicated      everything replicated                                 none
==============  ===================================================  ============================================

At most one axis is expert-parallel. Expert parallelism follows GShard/Switch: tokens are sharded over the
same axis the experts are, each rank sends each (token, expert) pair to the rank owning that expert with
``all_to_all_single`` and *variable* split sizes (gloo and NCCL both carry them), the owners compute and send
the results back.

**Pricing data-dependent sizes.** Capture sees no routing, so the plan prices the variable all-to-alls at the
expected load of a uniform router: every rank sends and receives ``T_local · k`` rows. The dispatch input is
exactly that on every rank (each rank sends all of its pairs); the combine input (the rows a rank received) is
``T_local · k`` on average over the ranks — the plan's bytes are the mean, a skewed router moves more through
the busiest rank. :func:`expected_pairs` is that one number; the docs (docs/moe.md) say the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.errors import UserError
from meshpilot.graph.capture import OpNode, dtype_from_name
from meshpilot.ops import OwnCall, OwnOp
from meshpilot.sharding.reshard import Collective, CollectiveKind
from meshpilot.sharding.strategies import Strategy, StrategyBuilder, per_axis_products

FORWARD = "meshpilot.moe_experts.default"
BACKWARD = "meshpilot.moe_experts_backward.default"
IMPLEMENTATION = "meshpilot"
"""The ``experts_implementation`` name meshpilot registers with transformers."""


def _silu_grad(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _gelu_grad(x: Tensor) -> Tensor:
    return 0.5 * (1 + torch.erf(x * 0.5**0.5)) + x * torch.exp(-0.5 * x * x) * (2 * torch.pi) ** -0.5


_ACTIVATIONS = {
    "silu": (torch.nn.functional.silu, _silu_grad),
    "swish": (torch.nn.functional.silu, _silu_grad),
    "gelu": (torch.nn.functional.gelu, _gelu_grad),
    "relu": (torch.relu, lambda x: (x > 0).to(x.dtype)),
}
"""Activations of the experts' gate: (function, derivative); the backward is written out (a custom op's
kernel runs below autograd)."""


def _activation(name: str):
    if name not in _ACTIVATIONS:
        raise UserError(
            f"meshpilot::moe_experts: hidden_act {name!r} is not one of {', '.join(_ACTIVATIONS)}; "
            "set --hf-config experts_implementation=batched_mm"
        )
    return _ACTIVATIONS[name]


# ------------------------------------------------------------------------------------------- local kernels


class _Routing:
    """The (token, expert) pairs of `idx` [t, k] sorted by expert: ``order`` (into the flat pairs),
    ``token`` of each sorted pair, ``counts`` per expert [E]."""

    def __init__(self, idx: Tensor, experts: int) -> None:
        t, k = idx.shape
        flat = idx.reshape(-1)
        self.order = torch.argsort(flat, stable=True)
        self.token = torch.arange(t, device=idx.device).repeat_interleave(k)[self.order]
        self.counts = torch.bincount(flat, minlength=experts)


def _expert_rows(rows: Tensor, gate_up: Tensor, down: Tensor, act) -> Tensor:
    """One expert's output for its rows: ``down · (act(gate) ⊙ up)``."""
    gate, up = torch.nn.functional.linear(rows, gate_up).chunk(2, dim=-1)
    return torch.nn.functional.linear(act(gate) * up, down)


def _grouped(rows: Tensor, counts: list[int], gate_up: Tensor, down: Tensor, act) -> Tensor:
    """`rows` grouped by local expert (`counts` rows each, in order) through their experts."""
    outs = [_expert_rows(part, gate_up[j], down[j], act) for j, part in enumerate(rows.split(counts)) if counts[j] > 0]
    return torch.cat(outs) if outs else rows.new_empty((0, down.shape[1]))


@dataclass(frozen=True)
class _EP:
    """Expert parallelism over one mesh axis: its process group (by name), the axis's name and size."""

    group: str
    axis: str
    peers: int


class _Exchange:
    """Who sends how many rows where: ``send`` / ``recv`` are the split sizes per peer; ``local_counts`` rows
    per local expert of what was received; ``perm`` reorders the received rows (peer-major) by local expert."""

    def __init__(self, ep: _EP, counts: Tensor) -> None:
        self.ep = ep
        per = counts.numel() // ep.peers
        got = self._all_to_all(counts, [per] * ep.peers, [per] * ep.peers).view(ep.peers, per)  # [peer][expert]
        self.send = counts.view(ep.peers, per).sum(1).tolist()
        self.recv = got.sum(1).tolist()
        self.local_counts = got.sum(0).tolist()
        expert_of_row = torch.arange(per, device=counts.device).repeat(ep.peers).repeat_interleave(got.reshape(-1))
        self.perm = torch.argsort(expert_of_row, stable=True)

    def dispatch(self, rows: Tensor) -> Tensor:
        """Rows (sorted by global expert) to the experts' owners, then grouped by local expert."""
        return self._all_to_all(rows, self.recv, self.send)[self.perm]

    def combine(self, rows: Tensor) -> Tensor:
        """Results grouped by local expert back to the ranks that sent them, in their sorted order."""
        back = torch.empty_like(rows)
        back[self.perm] = rows
        return self._all_to_all(back, self.send, self.recv)

    def _all_to_all(self, t: Tensor, out_splits: list[int], in_splits: list[int]) -> Tensor:
        """``all_to_all_single`` with split sizes, reported to the collective recorder as the bytes this
        rank holds (its input)."""
        import torch.distributed as dist

        from meshpilot import compat
        from meshpilot.runtime import collective_log

        t = t.contiguous()
        out = t.new_empty((sum(out_splits), *t.shape[1:]))
        collective_log.record(CollectiveKind.ALL_TO_ALL, self.ep.axis, self.ep.peers, t.numel() * t.element_size())
        group = compat.resolve_process_group()(self.ep.group)
        dist.all_to_all_single(out, t, out_splits, in_splits, group=group)
        return out


def _forward_local(x, idx, w, gate_up, down, act_name: str, experts: int, ep: _EP | None) -> Tensor:
    act = _activation(act_name)[0]
    r = _Routing(idx, experts)
    rows = x[r.token]
    if ep is None:
        y = _grouped(rows, r.counts.tolist(), gate_up, down, act)
    else:
        ex = _Exchange(ep, r.counts)
        y = ex.combine(_grouped(ex.dispatch(rows), ex.local_counts, gate_up, down, act))
    weights = w.reshape(-1)[r.order].unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, r.token, (y * weights).to(x.dtype))


def _expert_vjp(x, g, w, gate_up, down, act) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For one expert's rows: (∂x, ∂w per row, ∂gate_up, ∂down), its activations recomputed::

    h = [a; u] = x·gate_upᵀ,  m = act(a) ⊙ u,  y = m·downᵀ,  ∂y = w g
    ∂down = ∂yᵀ m,  ∂m = ∂y down,  ∂a = ∂m ⊙ u ⊙ act'(a),  ∂u = ∂m ⊙ act(a)
    ∂gate_up = [∂a; ∂u]ᵀ x,  ∂x = [∂a; ∂u] gate_up,  ∂w = ⟨g, y⟩"""
    fn, grad = act
    a, u = torch.nn.functional.linear(x, gate_up).chunk(2, dim=-1)
    fa = fn(a)
    m = fa * u
    y = torch.nn.functional.linear(m, down)
    dy = g * w.unsqueeze(-1).to(g.dtype)
    dm = dy @ down
    dh = torch.cat([dm * u * grad(a), dm * fa], dim=-1)
    return dh @ gate_up, (g * y).sum(-1), dh.t() @ x, dy.t() @ m


def _backward_local(g, x, idx, w, gate_up, down, act_name: str, experts: int, ep: _EP | None):
    act = _activation(act_name)
    r = _Routing(idx, experts)
    h = x.shape[-1]
    dtype = torch.promote_types(torch.promote_types(x.dtype, g.dtype), w.dtype)
    wf = w.reshape(-1)[r.order]
    rows = torch.cat([x[r.token].to(dtype), g[r.token].to(dtype), wf.unsqueeze(-1).to(dtype)], dim=-1)
    ex = _Exchange(ep, r.counts) if ep is not None else None
    if ex is not None:
        rows, counts = ex.dispatch(rows), ex.local_counts
    else:
        counts = r.counts.tolist()
    d_gate_up, d_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    back = []
    for j, part in enumerate(rows.split(counts)):
        if counts[j] == 0:
            continue
        px, pg, pw = part[:, :h].to(x.dtype), part[:, h : 2 * h].to(g.dtype), part[:, 2 * h].to(w.dtype)
        dx, dw, d_gate_up[j], d_down[j] = _expert_vjp(px, pg, pw, gate_up[j], down[j], act)
        back.append(torch.cat([dx.to(dtype), dw.unsqueeze(-1).to(dtype)], dim=-1))
    back_rows = torch.cat(back) if back else rows.new_empty((0, h + 1))
    if ex is not None:
        back_rows = ex.combine(back_rows)
    dx = torch.zeros_like(x).index_add_(0, r.token, back_rows[:, :h].to(x.dtype))
    dw = torch.empty(w.numel(), dtype=w.dtype, device=w.device)
    dw[r.order] = back_rows[:, h].to(w.dtype)
    return dx, dw.view_as(w), d_gate_up, d_down


# ------------------------------------------------------------------------------------------- the op pair


@torch.library.custom_op("meshpilot::moe_experts", mutates_args=())
def moe_experts(x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str) -> Tensor:
    """Dropless top-k experts: ``out[t] = Σ_j w[t, j] · expert_{idx[t, j]}(x[t])`` (SwiGLU experts)."""
    return _forward_local(x, idx, w, gate_up, down, act, gate_up.shape[0], None)


@moe_experts.register_fake
def _moe_experts_fake(x, idx, w, gate_up, down, act):
    return torch.empty_like(x)


@torch.library.custom_op("meshpilot::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    g: Tensor, x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(∂x, ∂w, ∂gate_up, ∂down)`` of :data:`moe_experts`."""
    return _backward_local(g, x, idx, w, gate_up, down, act, gate_up.shape[0], None)


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(g, x, idx, w, gate_up, down, act):
    return torch.empty_like(x), torch.empty_like(w), torch.empty_like(gate_up), torch.empty_like(down)


def _setup_context(ctx, inputs, output) -> None:
    x, idx, w, gate_up, down, act = inputs
    ctx.save_for_backward(x, idx, w, gate_up, down)
    ctx.act = act


def _autograd_backward(ctx, g):
    x, idx, w, gate_up, down = ctx.saved_tensors
    dx, dw, dgu, dd = moe_experts_backward(g, x, idx, w, gate_up, down, ctx.act)
    return dx, None, dw, dgu, dd, None


moe_experts.register_autograd(_autograd_backward, setup_context=_setup_context)


def experts_forward(self: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor):
    """transformers' experts interface entry (``experts_implementation="meshpilot"``): the experts module's
    forward as one :data:`moe_experts` call."""
    layout_ok = getattr(self, "has_gate", True) and not getattr(self, "has_bias", False)
    layout_ok = layout_ok and getattr(self, "is_concatenated", True) and not getattr(self, "is_transposed", False)
    if not layout_ok or getattr(self, "has_post_expert_norm", False):
        raise UserError(
            f"{type(self).__name__}: experts_implementation=meshpilot takes concatenated [gate; up] experts "
            "without bias or post-norm; set --hf-config experts_implementation=batched_mm"
        )
    act = _act_name(self)
    _activation(act)  # an unsupported activation is refused here, at capture, in one line
    return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, act)


def _act_name(module: torch.nn.Module) -> str:
    return getattr(module.config, "hidden_act", None) or getattr(module.config, "hidden_activation", "silu")


def register_with_transformers() -> None:
    """Make ``experts_implementation="meshpilot"`` a valid choice in transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


# ------------------------------------------------------------------------------------------- pricing


def expected_pairs(tokens: int, top_k: int) -> int:
    """Rows one rank sends (exactly) and receives (on average) in a dispatch: its pairs under uniform load."""
    return tokens * top_k


def moe_flops(target: str, args: tuple) -> float | None:
    """FLOPs of the pair (three matmuls of the SwiGLU expert per (token, expert) pair; backward twice that
    plus the recomputed forward), or None for another op."""
    if target == FORWARD:
        x, idx, _, gate_up, _ = args[:5]
        pairs, h, i2 = idx.numel(), x.shape[-1], gate_up.shape[1]
        return float(2 * pairs * h * i2 * 1.5)
    if target == BACKWARD:
        x, idx, _, gate_up, _ = args[1:6]
        pairs, h, i2 = idx.numel(), x.shape[-1], gate_up.shape[1]
        return float(3 * 2 * pairs * h * i2 * 1.5)
    return None


# ------------------------------------------------------------------------------------------- strategies


def _token_shards(ins, mesh) -> int:
    n = 1
    for a, p in enumerate(ins[0]):
        if isinstance(p, Shard) and mesh[a] > 1:
            n *= mesh[a]
    return n


def _strategies(b: StrategyBuilder, node: OpNode, backward: bool) -> list[Strategy]:
    """Per axis: expert-parallel (first), data-parallel, replicated; at most one expert-parallel axis."""
    fx = node.fx_node
    if fx is None:
        return []
    off = 1 if backward else 0
    x = fx.args[off].meta["val"]
    idx = fx.args[off + 1].meta["val"]
    w = fx.args[off + 2].meta["val"]
    experts = fx.args[off + 3].meta["val"].shape[0]
    mesh = b.mesh_shape
    item = dtype_from_name(str(x.dtype).removeprefix("torch.")).itemsize
    wide = torch.promote_types(torch.promote_types(x.dtype, w.dtype), x.dtype).itemsize
    S, R, P = Shard(0), Replicate(), Partial()
    n_in = 6 if backward else 5
    if backward:
        ep = ((S, S, S, S), (S,) * n_in)
        dp = ((S, S, P, P), (S, S, S, S, R, R))
    else:
        ep = ((S,), (S,) * n_in)
        dp = ((S,), (S, S, S, R, R))
    rep = ((R,) * (4 if backward else 1), (R,) * n_in)
    e_arg = 4 if backward else 3

    def colls(outs, ins):
        axes = [a for a, p in enumerate(ins[e_arg]) if isinstance(p, Shard) and mesh[a] > 1]
        if not axes:
            return ()
        a = axes[0]
        pairs = expected_pairs(idx.shape[0] // _token_shards(ins, mesh), idx.shape[1])
        h = x.shape[-1]
        if backward:
            sizes = (experts * 8, pairs * (2 * h + 1) * wide, pairs * (h + 1) * wide)
        else:
            sizes = (experts * 8, pairs * h * item, pairs * h * item)
        return tuple(Collective(CollectiveKind.ALL_TO_ALL, a, n) for n in sizes)

    out = per_axis_products(b, node, [ep, dp, rep], colls, require_first=False)
    return [s for s in out if sum(isinstance(p, Shard) and n > 1 for p, n in zip(s.ins[e_arg], mesh)) <= 1]


def _forward_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    return _strategies(b, node, backward=False)


def _backward_strategies(b: StrategyBuilder, node: OpNode) -> list[Strategy]:
    return _strategies(b, node, backward=True)


# ------------------------------------------------------------------------------------------- on the shards
#
# The runtime records each step's local ops once and replays them (runtime/record.py); the routing decides
# split sizes and row counts, so the sharded kernels are custom ops too: the recording holds one opaque call
# that runs the routing afresh every step. Their collectives are reported to the recorder by the kernel.


@torch.library.custom_op("meshpilot::moe_experts_shard", mutates_args=())
def moe_experts_shard(
    x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str, experts: int, ep: str
) -> Tensor:
    """:data:`moe_experts` on this rank's shards; ``ep`` is ``"group axis-name peers"`` (tab-separated) or empty."""
    return _forward_local(x, idx, w, gate_up, down, act, experts, _ep_of(ep))


@torch.library.custom_op("meshpilot::moe_experts_shard_backward", mutates_args=())
def moe_experts_shard_backward(
    g: Tensor, x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str, experts: int, ep: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:data:`moe_experts_backward` on this rank's shards."""
    return _backward_local(g, x, idx, w, gate_up, down, act, experts, _ep_of(ep))


def _ep_of(ep: str) -> _EP | None:
    if not ep:
        return None
    group, axis, peers = ep.split("\t")
    return _EP(group, axis, int(peers))


def _ep_args(call: OwnCall, experts_operand: int) -> str:
    """``"group axis-name peers"`` (tab-separated) of the axis the experts are sharded over, or ``""``."""
    axes = call.sharding_axes(call.ins[experts_operand], 0)
    if not axes:
        return ""
    a = axes[0]
    from meshpilot.cluster.mesh import default_axis_names

    names = call.mesh.mesh_dim_names or default_axis_names(call.mesh.ndim)
    return "\t".join((call.mesh.get_group(a).group_name, names[a], str(call.mesh.size(a))))


def _run_forward(call: OwnCall, x, idx, w, gate_up, down, act):
    experts = call.global_shape(3)[0]
    return moe_experts_shard(x, idx, w, gate_up, down, act, experts, _ep_args(call, 3))


def _run_backward(call: OwnCall, g, x, idx, w, gate_up, down, act):
    experts = call.global_shape(4)[0]
    return moe_experts_shard_backward(g, x, idx, w, gate_up, down, act, experts, _ep_args(call, 4))


OPS = (
    OwnOp(FORWARD, _forward_strategies, _run_forward, exclusive=True),
    OwnOp(BACKWARD, _backward_strategies, _run_backward, exclusive=True),
)
