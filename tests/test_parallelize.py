"""``parallelize`` on real gloo groups: loss and gradients equal the single-device model's over 3 AdamW
steps, and the collectives the run issues are exactly the ones the plan predicts."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from test_graph_capture import MLP, Tiny

pytestmark = pytest.mark.dist

TOL = 1e-5


def _build(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        m = MLP(d=16, h=32, c=8)
        g = torch.Generator().manual_seed(1)
        return m, (torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g))
    m = Tiny(layers=2, h=32, heads=4, vocab=64)
    g = torch.Generator().manual_seed(1)
    return m, (torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))


def _worker(name: str, plan_json: str) -> dict:
    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.spmd import CollectiveCounter, parallelize

    plan = Plan.from_json(plan_json)
    ref, inputs = _build(name)
    model, _ = _build(name)
    pm = parallelize(model, plan)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_par = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    out = {"loss": [], "grad": [], "counts_equal": [], "counts": None}
    for _ in range(3):
        l_ref = ref(*inputs)
        l_ref.backward()
        with CollectiveCounter(pm.mesh) as cc:
            loss = pm(*inputs)
        loss.backward()
        out["loss"].append(abs(l_ref.item() - loss.item()))
        out["grad"].append(
            max((a.grad - b.grad.full_tensor()).abs().max().item() for a, b in zip(ref.parameters(), pm.parameters()))
        )
        out["counts_equal"].append(cc.counts() == plan.collective_counts(backend="gloo"))
        out["counts"] = (sorted(cc.counts().items()), sorted(plan.collective_counts(backend="gloo").items()))
        o_ref.step()
        o_par.step()
        o_ref.zero_grad()
        o_par.zero_grad()
    out["param"] = max((a - b.full_tensor()).abs().max().item() for a, b in zip(ref.parameters(), pm.parameters()))
    out["mismatches"] = pm.mismatches
    return out


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert max(r["loss"]) <= TOL, (rank, r["loss"])
        assert max(r["grad"]) <= TOL, (rank, r["grad"])
        assert r["param"] <= TOL, (rank, r["param"])
        assert all(r["counts_equal"]), (rank, r["counts"])
        assert not r["mismatches"], r["mismatches"]


@pytest.mark.parametrize("name", ["mlp", "tiny_transformer"])
@pytest.mark.parametrize("shape", [(4, 1), (2, 2), (1, 4)])
def test_solver_plan_matches_single_device(name, shape):
    from meshpilot.planner.auto import plan

    model, inputs = _build(name)
    p = plan(model, inputs, "atp-ic3", mesh_shape=shape)
    _check(run_distributed(_worker, 4, name, p.to_json()))


FORCED = {
    # Megatron-style: column-parallel first layer, row-parallel second, over mesh axis 1
    "mlp": {"fc1.weight": "RS(0)", "fc1.bias": "RS(0)", "fc2.weight": "RS(1)"},
    "tiny_transformer": {
        "blocks.*.up.weight": "RS(0)",
        "blocks.*.down.weight": "RS(1)",
        "blocks.*.qkv.weight": "RS(0)",
        "blocks.*.o.weight": "RS(1)",
        "input:*": "S(0)R",
    },
}


@pytest.mark.parametrize("name", ["mlp", "tiny_transformer"])
def test_forced_tensor_parallel_plan_matches_single_device(name):
    from meshpilot.planner.auto import plan

    model, inputs = _build(name)
    p = plan(model, inputs, "atp-ic3", mesh_shape=(2, 2), force=FORCED[name])
    assert any(c.kind in ("all_reduce", "reduce_scatter") for c in p.collectives)
    _check(run_distributed(_worker, 4, name, p.to_json()))
