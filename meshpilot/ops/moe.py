"""Dropless mixture-of-experts as one node: ``meshpilot::moe_experts`` and ``meshpilot::moe_experts_backward``.

Hugging Face's default experts path (``MixtralExperts.forward``, eager) loops over the experts that were hit,
finding their tokens with ``nonzero``/``where``: shapes that depend on the routing, which capture on fake
tensors cannot see. meshpilot registers its own experts implementation with transformers
(``experts_implementation="meshpilot"``, :func:`register_with_transformers`; ``hf:mixtral`` uses it by
default): the whole experts computation becomes one custom op whose operands have static shapes, so the
captured graph holds one forward and one backward node, and everything data-dependent happens inside them.
Experts the op does not compute (biases, no gate, a clamped or scaled gate of their own: GPT-OSS, DeepSeek-V4,
Nemotron-H) run transformers' ``batched_mm`` path instead, with a one-line warning: static shapes, so they
plan and run exactly, but their weights are gathered per (token, expert) pair and not expert-parallel.

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

**In steps, for duplex.** With expert parallelism the runtime runs the op as kernels in three steps
(``meshpilot.ops.OpPart``; the section *on the shards* below): lead (counts exchanged, dispatch issued and left
in flight), body (dispatch waited, local experts, combine issued), tail (combine waited, weighted sum). The
op declares its first two collectives as issued before its computation (``OwnOp.leading``), so the duplex
schedule cuts around it and runs one microbatch's all-to-alls beside the other's experts
(``meshpilot.runtime.duplex``); the simulator prices them so. The arithmetic is the one-kernel path's.

**Pricing data-dependent sizes.** Capture sees no routing, so the plan prices the variable all-to-alls at the
expected load of a uniform router: every rank sends and receives ``T_local · k`` rows. The dispatch input is
exactly that on every rank (each rank sends all of its pairs); the combine input (the rows a rank received) is
``T_local · k`` on average over the ranks — the plan's bytes are the mean, a skewed router moves more through
the busiest rank. :func:`expected_pairs` is that one number; the docs (docs/moe.md) say the same.
"""

from __future__ import annotations

import warnings
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
    """Who sends how many rows where, from `got` [peers, E / peers] (how many rows each peer sends to each
    of this rank's experts) and this rank's per-expert `counts` [E]: ``send`` / ``recv`` are the split sizes
    per peer; ``local_counts`` rows per local expert of what was received; ``perm`` reorders the received rows
    (peer-major) by local expert. Without `counts` (:meth:`local`) only the receiving side is known."""

    def __init__(self, got: Tensor, ep: _EP | None = None, counts: Tensor | None = None) -> None:
        self.ep = ep
        peers, per = got.shape
        self.send = counts.view(peers, per).sum(1).tolist() if counts is not None else []
        self.recv = got.sum(1).tolist()
        self.local_counts = got.sum(0).tolist()
        expert_of_row = torch.arange(per, device=got.device).repeat(peers).repeat_interleave(got.reshape(-1))
        self.perm = torch.argsort(expert_of_row, stable=True)

    @classmethod
    def local(cls, got: Tensor) -> _Exchange:
        """The receiving side only: grouping received rows by local expert and back."""
        return cls(got)

    def dispatch(self, rows: Tensor) -> Tensor:
        """Issue: rows (sorted by global expert) to the experts' owners; the received rows, peer-major, with
        the all-to-all in flight (``wait_tensor`` before reading them)."""
        return _all_to_all(self.ep, rows, self.recv, self.send, in_flight=True)

    def combine(self, rows: Tensor) -> Tensor:
        """Issue: rows (peer-major, as received) back to the ranks that sent them; this rank's pairs' rows in
        their sorted order, with the all-to-all in flight."""
        return _all_to_all(self.ep, rows, self.send, self.recv, in_flight=True)

    def grouped(self, rows: Tensor) -> Tensor:
        """Received rows (peer-major) grouped by local expert."""
        return rows[self.perm]

    def ungrouped(self, rows: Tensor) -> Tensor:
        """Rows grouped by local expert back in the received (peer-major) order."""
        back = torch.empty_like(rows)
        back[self.perm] = rows
        return back


def _exchange_counts(ep: _EP, counts: Tensor) -> Tensor:
    """``got`` [peers, E / peers]: every peer's per-expert counts of this rank's experts (an all-to-all,
    waited: the split sizes of the dispatch follow from it)."""
    per = counts.numel() // ep.peers
    return _all_to_all(ep, counts, [per] * ep.peers, [per] * ep.peers).view(ep.peers, per)


def _all_to_all(ep: _EP, t: Tensor, out_splits: list[int], in_splits: list[int], in_flight: bool = False) -> Tensor:
    """``all_to_all_single`` with split sizes, reported to the collective recorder as the bytes this rank
    holds (its input). `in_flight`: return at once with the work registered on the output, so
    ``_c10d_functional.wait_tensor(output)`` waits for it (backend threads move the rows meanwhile; gloo
    keeps the input alive until then); waited here on a torch without ``_register_work``."""
    import torch.distributed as dist

    from meshpilot import compat
    from meshpilot.runtime import collective_log

    t = t.contiguous()
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    collective_log.record(CollectiveKind.ALL_TO_ALL, ep.axis, ep.peers, t.numel() * t.element_size())
    group = compat.resolve_process_group()(ep.group)
    register = compat.register_work() if in_flight else None
    work = dist.all_to_all_single(out, t, out_splits, in_splits, group=group, async_op=register is not None)
    if register is not None:
        register(out, work)
    return out


def _forward_local(x, idx, w, gate_up, down, act_name: str, experts: int) -> Tensor:
    act = _activation(act_name)[0]
    r = _Routing(idx, experts)
    y = _grouped(x[r.token], r.counts.tolist(), gate_up, down, act)
    return _weighted_sum(y, x, w, r)


def _weighted_sum(y: Tensor, x: Tensor, w: Tensor, r: _Routing) -> Tensor:
    """``out_t = Σ_e w_{t,e} y_{t,e}`` from the pairs' outputs `y` in sorted order."""
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


def _backward_dtype(x: Tensor, g: Tensor, w: Tensor) -> torch.dtype:
    """The dtype the backward's rows ``[x | g | w]`` and ``[∂x | ∂w]`` travel in."""
    return torch.promote_types(torch.promote_types(x.dtype, g.dtype), w.dtype)


def _backward_feats(g: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """Each token's ``[x | g]`` in the backward's row dtype."""
    dtype = _backward_dtype(x, g, w)
    return torch.cat([x.to(dtype), g.to(dtype)], dim=-1)


def _pair_rows(feats: Tensor, w: Tensor | None, r: _Routing) -> Tensor:
    """Each (token, expert) pair's row ``feats[token]``, sorted by expert, with the pair's routing weight
    appended when `w` is given (the backward's ``[x | g | w]``)."""
    rows = feats[r.token]
    if w is None:
        return rows
    return torch.cat([rows, w.reshape(-1)[r.order].unsqueeze(-1).to(rows.dtype)], dim=-1)


def _backward_experts(rows, counts: list[int], x, g, w, gate_up, down, act) -> tuple[Tensor, Tensor, Tensor]:
    """(``[∂x | ∂w]`` rows, ∂gate_up, ∂down) of rows ``[x | g | w]`` grouped by local expert."""
    h = x.shape[-1]
    dtype = rows.dtype
    d_gate_up, d_down = torch.zeros_like(gate_up), torch.zeros_like(down)
    back = []
    for j, part in enumerate(rows.split(counts)):
        if counts[j] == 0:
            continue
        px, pg, pw = part[:, :h].to(x.dtype), part[:, h : 2 * h].to(g.dtype), part[:, 2 * h].to(w.dtype)
        dx, dw, d_gate_up[j], d_down[j] = _expert_vjp(px, pg, pw, gate_up[j], down[j], act)
        back.append(torch.cat([dx.to(dtype), dw.unsqueeze(-1).to(dtype)], dim=-1))
    back_rows = torch.cat(back) if back else rows.new_empty((0, h + 1))
    return back_rows, d_gate_up, d_down


def _backward_unsort(back_rows, x, w, r: _Routing) -> tuple[Tensor, Tensor]:
    """(∂x, ∂w) from the pairs' ``[∂x | ∂w]`` rows in sorted order."""
    h = x.shape[-1]
    dx = torch.zeros_like(x).index_add_(0, r.token, back_rows[:, :h].to(x.dtype))
    dw = torch.empty(w.numel(), dtype=w.dtype, device=w.device)
    dw[r.order] = back_rows[:, h].to(w.dtype)
    return dx, dw.view_as(w)


def _backward_local(g, x, idx, w, gate_up, down, act_name: str, experts: int):
    act = _activation(act_name)
    r = _Routing(idx, experts)
    rows = _pair_rows(_backward_feats(g, x, w), w, r)
    back_rows, d_gate_up, d_down = _backward_experts(rows, r.counts.tolist(), x, g, w, gate_up, down, act)
    dx, dw = _backward_unsort(back_rows, x, w, r)
    return dx, dw, d_gate_up, d_down


# ------------------------------------------------------------------------------------------- the op pair


@torch.library.custom_op("meshpilot::moe_experts", mutates_args=())
def moe_experts(x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str) -> Tensor:
    """Dropless top-k experts: ``out[t] = Σ_j w[t, j] · expert_{idx[t, j]}(x[t])`` (SwiGLU experts)."""
    return _forward_local(x, idx, w, gate_up, down, act, gate_up.shape[0])


@moe_experts.register_fake
def _moe_experts_fake(x, idx, w, gate_up, down, act):
    return torch.empty_like(x)


@torch.library.custom_op("meshpilot::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    g: Tensor, x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(∂x, ∂w, ∂gate_up, ∂down)`` of :data:`moe_experts`."""
    return _backward_local(g, x, idx, w, gate_up, down, act, gate_up.shape[0])


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
    forward as one :data:`moe_experts` call. Experts stored transposed (``is_transposed``: ``[E, h, 2f]`` and
    ``[E, f, h]``, Aria's) are passed as transposed views (autograd carries the gradients back)."""
    why = _not_ours(self)
    if why:  # the op would compute something else: transformers' own static-shape path, said once per class
        from transformers.integrations.moe import batched_mm_experts_forward

        _note_once(
            f"{type(self).__name__}: these experts have {why}, which meshpilot's experts op does not compute; "
            "they run transformers' batched_mm experts instead (static shapes, exact, no expert parallelism)"
        )
        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    act = _act_name(self)
    gate_up, down = self.gate_up_proj, self.down_proj  # [E, 2f, h], [E, h, f]
    if getattr(self, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, act)


def _not_ours(module: torch.nn.Module) -> str:
    """What of `module`'s experts :data:`moe_experts` does not compute ("" when it computes them all)."""
    checks = [
        (not getattr(module, "has_gate", True), "no gate"),
        (getattr(module, "has_bias", False), "biases"),
        (not getattr(module, "is_concatenated", True), "gate and up not concatenated"),
        (getattr(module, "has_post_expert_norm", False), "a post-expert norm"),
        (_own_gate(module), "a gate of their own"),
        (_act_name(module) not in _ACTIVATIONS, f"activation {_act_name(module)!r}"),
    ]
    return ", ".join(what for hit, what in checks if hit)


_NOTED: set[str] = set()


def _note_once(line: str) -> None:
    """Warn with `line` once per process (every layer's experts call the entry on every capture)."""
    if line not in _NOTED:
        _NOTED.add(line)
        warnings.warn(line, UserWarning, stacklevel=3)


def _own_gate(module: torch.nn.Module) -> bool:
    """Whether the experts gate ``[gate; up]`` their own way (a clamped or scaled SwiGLU: their class overrides
    transformers' ``_apply_gate``), which :data:`moe_experts`' ``act(gate) * up`` would not compute."""
    from transformers.integrations import moe as hf_moe

    default = getattr(hf_moe, "_default_apply_gate", None)
    gate = getattr(type(module), "_apply_gate", default)
    return default is not None and gate is not default


_ACT_CLASSES = {"SiLUActivation": "silu", "SiLU": "silu", "GELUActivation": "gelu", "ReLU": "relu"}
"""Activation modules (transformers' and torch's) by class name: the experts' ``act_fn``, when they have one."""


def _act_name(module: torch.nn.Module) -> str:
    """The gate's activation: the configuration's name when the experts' own ``act_fn`` is that activation
    (or they hold none), else the name of ``act_fn``'s class (Aria's routed experts are SiLU whatever
    ``hidden_act`` says)."""
    from transformers.activations import ACT2FN

    name = getattr(module.config, "hidden_act", None) or getattr(module.config, "hidden_activation", "silu")
    act_fn = getattr(module, "act_fn", None)
    if not isinstance(act_fn, torch.nn.Module) or (name in ACT2FN and type(ACT2FN[name]) is type(act_fn)):
        return name
    cls = type(act_fn).__name__
    if cls == "GELU" and getattr(act_fn, "approximate", "none") == "none":
        return "gelu"
    return _ACT_CLASSES.get(cls, cls)


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
# split sizes and row counts, so the sharded kernels are custom ops too: the recording holds opaque calls
# that run the routing afresh every step. Their collectives are reported to the recorder by the kernel.
#
# Without expert parallelism the op is one kernel. With it, the op runs in steps (OpPart), so that HiDup's
# duplex can put the other microbatch's compute beside each all-to-all:
#
#   LEAD  moe_ep_counts (per-expert counts exchanged, waited: they are the split sizes)
#         moe_ep_dispatch (rows sorted by expert, all-to-all issued, left in flight)
#   BODY  wait_tensor; moe_ep_experts (the local experts); moe_ep_combine (all-to-all back issued, in flight)
#   TAIL  wait_tensor; moe_ep_sum (Σ_e w_{t,e} y_{t,e})
#
# and the backward alike, with rows [x | g | w] out and [∂x | ∂w] back. The arithmetic is the one-kernel
# path's, step for step; only where the program waits changes.


@torch.library.custom_op("meshpilot::moe_experts_shard", mutates_args=())
def moe_experts_shard(
    x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str, experts: int
) -> Tensor:
    """:data:`moe_experts` on this rank's shards, without expert parallelism (data-parallel or replicated)."""
    return _forward_local(x, idx, w, gate_up, down, act, experts)


@torch.library.custom_op("meshpilot::moe_experts_shard_backward", mutates_args=())
def moe_experts_shard_backward(
    g: Tensor, x: Tensor, idx: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str, experts: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:data:`moe_experts_backward` on this rank's shards, without expert parallelism."""
    return _backward_local(g, x, idx, w, gate_up, down, act, experts)


@torch.library.custom_op("meshpilot::moe_ep_counts", mutates_args=())
def moe_ep_counts(idx: Tensor, experts: int, ep: str) -> Tensor:
    """[peers, experts / peers]: how many of each peer's pairs go to each of this rank's experts."""
    return _exchange_counts(_ep_of(ep), torch.bincount(idx.reshape(-1), minlength=experts))


@torch.library.custom_op("meshpilot::moe_ep_dispatch", mutates_args=())
def moe_ep_dispatch(feats: Tensor, idx: Tensor, w: Tensor | None, got: Tensor, experts: int, ep: str) -> Tensor:
    """Issue the dispatch: each (token, expert) pair's row ``feats[token]`` (with its routing weight appended
    when `w` is given: the backward's ``[x | g | w]``), sorted by expert, to the owner of its expert. Returns
    the received rows (peer-major) while the all-to-all is in flight."""
    r = _Routing(idx, experts)
    return _Exchange(got, _ep_of(ep), r.counts).dispatch(_pair_rows(feats, w, r))


@torch.library.custom_op("meshpilot::moe_ep_combine", mutates_args=())
def moe_ep_combine(rows: Tensor, idx: Tensor, got: Tensor, experts: int, ep: str) -> Tensor:
    """Issue the combine: results (peer-major, as received) back to the ranks that sent them. Returns this
    rank's pairs' results, sorted by expert, while the all-to-all is in flight."""
    counts = torch.bincount(idx.reshape(-1), minlength=experts)
    return _Exchange(got, _ep_of(ep), counts).combine(rows)


@torch.library.custom_op("meshpilot::moe_ep_experts", mutates_args=())
def moe_ep_experts(rows: Tensor, got: Tensor, gate_up: Tensor, down: Tensor, act: str) -> Tensor:
    """The local experts on the received rows (peer-major): their outputs, in the same order."""
    ex = _Exchange.local(got)
    y = _grouped(ex.grouped(rows), ex.local_counts, gate_up, down, _activation(act)[0])
    return ex.ungrouped(y)


@torch.library.custom_op("meshpilot::moe_ep_experts_backward", mutates_args=())
def moe_ep_experts_backward(
    rows: Tensor, got: Tensor, x: Tensor, g: Tensor, w: Tensor, gate_up: Tensor, down: Tensor, act: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(``[∂x | ∂w]`` rows in the received order, ∂gate_up, ∂down) of the received ``[x | g | w]`` rows."""
    ex = _Exchange.local(got)
    back, d_gate_up, d_down = _backward_experts(
        ex.grouped(rows), ex.local_counts, x, g, w, gate_up, down, _activation(act)
    )
    return ex.ungrouped(back), d_gate_up, d_down


@torch.library.custom_op("meshpilot::moe_ep_sum", mutates_args=())
def moe_ep_sum(y: Tensor, x: Tensor, idx: Tensor, w: Tensor, experts: int) -> Tensor:
    """``out_t = Σ_e w_{t,e} y_{t,e}`` from this rank's pairs' results (sorted by expert)."""
    return _weighted_sum(y, x, w, _Routing(idx, experts))


@torch.library.custom_op("meshpilot::moe_ep_unsort", mutates_args=())
def moe_ep_unsort(back: Tensor, x: Tensor, idx: Tensor, w: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """(∂x, ∂w) from this rank's pairs' ``[∂x | ∂w]`` rows (sorted by expert)."""
    return _backward_unsort(back, x, w, _Routing(idx, experts))


IN_FLIGHT = (str(torch.ops.meshpilot.moe_ep_dispatch.default), str(torch.ops.meshpilot.moe_ep_combine.default))
"""The kernels that return an all-to-all's output in flight (``OwnOp.in_flight``)."""


def _ep_of(ep: str) -> _EP:
    group, axis, peers = ep.split("\t")
    return _EP(group, axis, int(peers))


def _ep_args(call: OwnCall, experts_operand: int) -> str:
    """``"group axis-name peers"`` (tab-separated) of the axis the experts are sharded over, or ``""``."""
    axes = call.sharding_axes(call.ins[experts_operand], 0)
    if not axes:
        return ""
    group, name, peers = call.axis_group(axes[0])
    return "\t".join((group, name, str(peers)))


def _wait(t: Tensor) -> Tensor:
    return torch.ops._c10d_functional.wait_tensor(t)


def _run_forward(call: OwnCall, x, idx, w, gate_up, down, act):
    experts = call.global_shape(3)[0]
    ep = _ep_args(call, 3)
    if not ep:
        return moe_experts_shard(x, idx, w, gate_up, down, act, experts)
    from meshpilot.ops import OpPart
    from meshpilot.runtime.record import in_part

    with in_part(OpPart.LEAD):
        got = moe_ep_counts(idx, experts, ep)
        sent = moe_ep_dispatch(x, idx, None, got, experts, ep)
    y = moe_ep_experts(_wait(sent), got, gate_up, down, act)
    back = moe_ep_combine(y, idx, got, experts, ep)
    with in_part(OpPart.TAIL):
        return moe_ep_sum(_wait(back), x, idx, w, experts)


def _run_backward(call: OwnCall, g, x, idx, w, gate_up, down, act):
    experts = call.global_shape(4)[0]
    ep = _ep_args(call, 4)
    if not ep:
        return moe_experts_shard_backward(g, x, idx, w, gate_up, down, act, experts)
    from meshpilot.ops import OpPart
    from meshpilot.runtime.record import in_part

    with in_part(OpPart.LEAD):
        got = moe_ep_counts(idx, experts, ep)
        sent = moe_ep_dispatch(_backward_feats(g, x, w), idx, w, got, experts, ep)
    back, d_gate_up, d_down = moe_ep_experts_backward(_wait(sent), got, x, g, w, gate_up, down, act)
    back = moe_ep_combine(back, idx, got, experts, ep)
    with in_part(OpPart.TAIL):
        dx, dw = moe_ep_unsort(_wait(back), x, idx, w, experts)
    return dx, dw, d_gate_up, d_down


LEADING = 2
"""Own collectives issued before the computation: the per-expert counts and the dispatch (the combine after)."""

OPS = (
    OwnOp(FORWARD, _forward_strategies, _run_forward, exclusive=True, leading=LEADING, in_flight=IN_FLIGHT),
    OwnOp(BACKWARD, _backward_strategies, _run_backward, exclusive=True, leading=LEADING, in_flight=IN_FLIGHT),
)
