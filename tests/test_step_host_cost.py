"""A recorded step costs the host what eager's does: the same kernels, and no per-gradient name look-ups.

Issue 30 item 3 asked whether the recorded programs run decomposed ops where eager runs fused kernels (the
programs come from AOTAutograd's joint export). They do not: a 1-device plan's recorded forward + backward runs
each of eager's fused kernels (layer norm, GELU, attention, log-softmax, their backwards, the matmuls) exactly as
often as eager does (``docs/benchmarks.md``, issue 30 item 3's per-op breakdown). What it paid beyond eager was
per step and outside the kernels; the part fixed here: each gradient's layout was looked up by the parameter's
name on every step (``Module.get_parameter``: 12 µs a gradient, 0.65 ms of a 53-parameter GPT's backward).

Runs in this process with a one-rank gloo group (nothing is spawned).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dist_utils import tiny_gpt

FUSED = (
    "aten::mm",
    "aten::addmm",
    "aten::native_layer_norm",
    "aten::native_layer_norm_backward",
    "aten::gelu",
    "aten::gelu_backward",
    "aten::_log_softmax",
    "aten::_log_softmax_backward_data",
    "aten::nll_loss_forward",
    "aten::nll_loss_backward",
    "aten::embedding_dense_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
)
"""The kernels eager's GPT step runs that a decomposition would replace by several smaller ops."""


@pytest.fixture(scope="module")
def pair(group):
    """(eager GPT, its 1-device plan parallelized, the inputs), the plan's programs recorded."""
    import meshpilot
    from meshpilot.runtime.spmd import parallelize

    eager, inputs = tiny_gpt()
    model, _ = tiny_gpt()
    pm = parallelize(model, meshpilot.plan(model, inputs, "dgx-h100", num_devices=1).only)
    for m in (eager, pm):
        for _ in range(2):  # the first step records the programs
            m(*inputs).backward()
            m.zero_grad(set_to_none=True)
    return eager, pm, inputs


def _kernels(step) -> Counter:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return Counter(e.name for e in prof.events() if e.name in FUSED)


def test_a_recorded_step_runs_eagers_fused_kernels_and_equals_eager(pair):
    eager, pm, inputs = pair

    def step(m):
        loss = m(*inputs)
        loss.backward()
        return loss

    want = _kernels(lambda: step(eager))
    got = _kernels(lambda: step(pm))
    assert want["aten::native_layer_norm_backward"] > 0 and want["aten::gelu_backward"] > 0
    assert got == want
    loss_e, loss_p = step(eager), step(pm)  # the third step of each: .grad holds two steps' sums
    assert torch.equal(loss_e.detach(), loss_p.detach())
    for (name, p), q in zip(eager.named_parameters(), pm.module.parameters()):
        assert torch.equal(p.grad, q.grad), name  # one device: plain parameters (ParallelModule.plain)
    eager.zero_grad(set_to_none=True)
    pm.zero_grad(set_to_none=True)


def test_a_recorded_step_looks_no_parameter_up_by_name(pair, monkeypatch):
    _, pm, inputs = pair
    calls = Counter()
    real = torch.nn.Module.get_submodule

    def counted(self, target):
        calls[target] += 1
        return real(self, target)

    monkeypatch.setattr(torch.nn.Module, "get_submodule", counted)
    pm(*inputs).backward()
    pm.zero_grad(set_to_none=True)
    assert not calls, f"{sum(calls.values())} look-ups by name in one step: {sorted(calls)[:5]}"


@pytest.mark.parametrize("plain", [True, False], ids=["plain", "dtensor"])
def test_a_frozen_parameter_keeps_the_others_gradients_in_their_own_layouts(group, plain, monkeypatch):
    """The gradients' layouts are the trainable parameters' in order: a frozen one in between shifts nothing
    (with DTensor parameters, ``ParallelModule.plain = False``, and with the plain ones a 1-device plan keeps)."""
    from torch.distributed.tensor import DTensor

    import meshpilot
    from meshpilot.runtime.spmd import ParallelModule, parallelize

    monkeypatch.setattr(ParallelModule, "plain", plain)
    eager, inputs = tiny_gpt()
    model, _ = tiny_gpt()
    for m in (eager, model):
        m.blocks[0].attn.qkv.weight.requires_grad_(False)
    pm = parallelize(model, meshpilot.plan(model, inputs, "dgx-h100", num_devices=1).only)
    for _ in range(2):
        loss_e, loss_p = eager(*inputs), pm(*inputs)
        loss_e.backward()
        loss_p.backward()
    assert torch.equal(loss_e.detach(), loss_p.detach())
    for (name, p), q in zip(eager.named_parameters(), pm.module.parameters()):
        if p.grad is None:
            assert q.grad is None, name
        elif plain:
            assert not isinstance(q, DTensor) and torch.equal(p.grad, q.grad), name
        else:
            assert q.grad._spec == q._spec and torch.equal(p.grad, q.grad.full_tensor()), name


def test_a_recorded_program_calls_each_op_through_its_cpp_entry(pair, monkeypatch):
    """The programs' code calls ``OpOverload._op`` bound once, not ``torch.ops.<ns>.<op>.<overload>`` through
    ``OpOverload.__call__`` (a Python frame and four look-ups per op, ``program.direct_ops``), and computes the same."""
    _, pm, inputs = pair
    prog = pm.program
    ops = sum(
        1
        for gm in (prog.forward_gm, prog.backward_gm)
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
    )
    calls = Counter()
    real = torch._ops.OpOverload.__call__

    def counted(self, /, *args, **kwargs):
        calls[str(self)] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "__call__", counted)
    pm(*inputs).backward()
    pm.zero_grad(set_to_none=True)
    assert ops > 100 and sum(calls.values()) < ops // 4, f"{sum(calls.values())} calls through __call__ of {ops} ops"
    monkeypatch.undo()
    from meshpilot.runtime.program import direct_ops

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    g = torch.fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output(g.call_function(torch.ops.aten.relu.default, (g.call_function(torch.ops.aten.mm.default, (a, b)),)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    fn = direct_ops(gm)
    assert "torch.ops.aten.mm.default" in gm.code and torch.equal(fn(x, w), gm(x, w))
    x.requires_grad_()  # the program runs below autograd: no graph, whatever the grad mode
    assert gm(x, w).requires_grad and not fn(x, w).requires_grad


def test_a_recorded_program_folds_its_no_op_views_to_the_same_bits(group, monkeypatch):
    """The recorded programs call no ``t(t(x))``, ``detach``, identity ``permute`` or view of a view
    (``runtime.fold``): the same GPT step recorded with the pass and without it computes the same loss and
    gradients bit for bit, in fewer ops."""
    import meshpilot
    from meshpilot.runtime import program, spmd

    steps = {}
    for fold in (True, False):
        monkeypatch.setattr(spmd, "_PROGRAMS", {})  # each records its own programs
        if not fold:
            monkeypatch.setattr(program, "fold_views", lambda gm: 0)
        model, inputs = tiny_gpt()
        pm = spmd.parallelize(model, meshpilot.plan(model, inputs, "dgx-h100", num_devices=1).only)
        losses = []
        for _ in range(2):  # the recording step and a step of the programs
            loss = pm(*inputs)
            loss.backward()
            losses.append(loss.detach())
        prog = pm.program
        ops = sum(n.op == "call_function" for gm in (prog.forward_gm, prog.backward_gm) for n in gm.graph.nodes)
        steps[fold] = (losses, [q.grad for q in pm.module.parameters()], dict(prog.folded), ops)
    (loss_f, grads_f, folded, ops_f), (loss_r, grads_r, none, ops_r) = steps[True], steps[False]
    assert all(torch.equal(a, b) for a, b in zip(loss_f, loss_r))
    assert all(torch.equal(a, b) for a, b in zip(grads_f, grads_r))
    assert folded["backward"] > 10 and not any(none.values()), (folded, none)
    assert ops_f == ops_r - folded["forward"] - folded["backward"], (ops_f, ops_r, folded)


def test_folding_leaves_what_a_program_returns_its_own():
    """A no-op view the program returns stays a tensor of its own where its operand is an input (the caller's
    parameter) or already returned; a view of a view folds only to the layout it was recorded with."""
    from meshpilot.runtime.fold import fold_views
    from meshpilot.runtime.record import record

    def fn(x, w):
        y = x.t().t().detach()  # folds to the mm below reading x
        z = (y @ w).view(4, 2, 2).view(4, 4)  # folds to one view
        p = z.permute(0, 1)  # identity: folds
        return w.detach(), p.sum(0), z.t().t(), z

    x, w = torch.randn(4, 3), torch.randn(3, 4)
    gm, want = record(fn, x, w)
    folded = fold_views(gm)
    got = gm(x, w)
    assert folded == 5, (folded, gm.code)  # t, t, detach of x; the inner view; the permute
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0] is not w and got[2] is not got[3]  # an input, an output already returned: left their own
    counts = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert counts["aten.view.default"] == 1 and counts["aten.permute.default"] == 0, gm.code
