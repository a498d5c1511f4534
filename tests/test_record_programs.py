"""A recorded program does not depend on how the recording reached its local ops.

``runtime.interpret`` runs the DTensor-planned matrix products and pointwise ops on the local shards itself
(``runs_on_shards``: DTensor's dispatcher would only find the plan's strategy again). On 2 gloo ranks a tiny
GPT's Megatron plan on a (1, 2) mesh — column- and row-parallel matrix products, the latter's partial sums and
their all-reduces — is recorded both ways: every program's generated code is the same text (the same ops,
arguments, collectives and order), the first step's loss and gradients the same bits.
"""

from __future__ import annotations

import pytest
from dist_utils import run_distributed


def _gpt():
    import torch

    from meshpilot.models.gpt import GPT, gpt_tiny

    torch.manual_seed(0)
    model = GPT(gpt_tiny(batch=4, seq=8, layers=1))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (4, 9), generator=g)
    return model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())


def _record_both_ways(plan) -> dict:
    import torch

    from meshpilot.graph.capture import capture
    from meshpilot.runtime import interpret, spmd

    model, inputs = _gpt()
    graph = capture(model, inputs)
    out = {}
    for on in (False, True):
        interpret._ON_SHARDS[0] = on
        spmd._PROGRAMS.clear()
        model, inputs = _gpt()
        try:
            pm = spmd.parallelize(model, plan, graph=graph)
            loss = pm.train_step(*inputs)
        finally:  # the pool's rank runs the next task as it was
            interpret._ON_SHARDS[0] = True
        prog = pm.program
        out[on] = dict(
            code={k: getattr(prog, f"{k}_gm").code for k in ("forward", "backward", "grad_sync")},
            local=sum(c.mode == interpret.ExecMode.LOCAL for c in pm.interpreter.calls.values()),
            loss=loss,
            grads=[p.grad.to_local().clone() for p in pm.parameters() if p.grad is not None],
        )
    assert all(torch.equal(a, b) for a, b in zip(out[False]["grads"], out[True]["grads"]))
    return {k: {**v, "grads": len(v["grads"]), "loss": float(v["loss"])} for k, v in out.items()}


@pytest.mark.timeout(300)
def test_programs_recorded_on_the_shards_are_those_recorded_through_dtensor():
    from meshpilot.planner.auto import plan
    from meshpilot.planner.forced import forced
    from meshpilot.sharding.reshard import CollectiveKind

    model, inputs = _gpt()
    p = plan(
        model,
        inputs,
        "atp-ic3",
        mesh_shape=(1, 2),
        force=forced("megatron_tp", model, inputs, (1, 2)),
        mappings=("row",),
    )
    assert any(
        c.kind == CollectiveKind.ALL_REDUCE for c in p.collectives
    )  # partial sums: the products' row-parallel half
    for rank in run_distributed(_record_both_ways, 2, p):
        off, on = rank[False], rank[True]
        assert on["local"] > off["local"] + 10  # the products and pointwise ops ran on the shards
        assert on["code"] == off["code"]
        assert on["loss"] == off["loss"] and on["grads"] == off["grads"] > 0
