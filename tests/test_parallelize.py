"""``parallelize`` on real gloo groups: loss and gradients equal the single-device model's over 3 AdamW
steps, and the collectives the run issues are exactly the ones the plan predicts. All plans of the module
run in one 4-rank spawn (see ``tests/test_models_parallel.py`` for every model, mesh and plan kind), which
also records one step of the DTensor runtime and one ATP block in the same collective recorder."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dist_utils import lockstep_adamw, run_distributed
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


def _run_one(name: str, plan_json: str, graphs: dict) -> dict:
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.spmd import parallelize

    plan = StagePlan.from_json(plan_json)
    ref, inputs = _build(name)
    model, _ = _build(name)
    pm = parallelize(model, plan, graph=graphs[name])
    r = lockstep_adamw(ref, pm, inputs, steps=3)
    planned = plan.collective_counts(backend="gloo")
    return {
        "loss": r["loss"],
        "grad": r["grad"],
        "counts_equal": [issued == planned for issued in r["counts"]],
        "counts": (sorted(r["counts"][-1].items()), sorted(planned.items())),
        "param": r["param"],
        "mismatches": pm.mismatches,
    }


def _both_runtimes(name: str, plan_json: str, graphs: dict) -> list:
    """One step of the DTensor runtime (`plan_json`) and one ATP block, recorded by one recorder."""
    from meshpilot.models.gpt import gpt_tiny
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.atp import ATPBlock, init_mesh
    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.spmd import parallelize

    model, inputs = _build(name)
    pm = parallelize(model, StagePlan.from_json(plan_json), graph=graphs[name])
    cfg = gpt_tiny()
    block = ATPBlock(cfg, init_mesh((2, 2)))
    x = torch.randn(cfg.batch, cfg.seq, cfg.hidden // 2, requires_grad=True)
    with record_collectives(pm.mesh) as log:
        pm(*inputs).backward()
        block(x).sum().backward()
    return log.entries


def _worker(jobs: list[tuple[str, str, str]], graphs: dict) -> dict:
    """Every (key, model, plan JSON) in one process group: one spawn for the whole module; `graphs`: each model's
    capture, made once in the parent (``capture(model, inputs)`` of the same build, the call each rank made)."""
    out = {key: _run_one(name, plan_json, graphs) for key, name, plan_json in jobs}
    key, name, plan_json = next(j for j in jobs if j[0] == ("mlp", "forced"))
    out["both runtimes"] = _both_runtimes(name, plan_json, graphs)
    return out


def _check(r: dict) -> None:
    assert max(r["loss"]) <= TOL, r["loss"]
    assert max(r["grad"]) <= TOL, r["grad"]
    assert r["param"] <= TOL, r["param"]
    assert all(r["counts_equal"]), r["counts"]
    assert not r["mismatches"], r["mismatches"]


NAMES = ["mlp", "tiny_transformer"]
SHAPES = [(4, 1), (2, 2), (1, 4)]

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


@pytest.fixture(scope="module")
def runs() -> tuple[dict, dict]:
    """Every plan of this module (made here), run on 4 gloo ranks in one spawn: (plans, rank -> results)."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import plan

    plans = {}
    for name in NAMES:
        model, inputs = _build(name)
        for shape in SHAPES:
            plans[(name, shape)] = plan(model, inputs, "atp-ic3", mesh_shape=shape)
        plans[(name, "forced")] = plan(model, inputs, "atp-ic3", mesh_shape=(2, 2), force=FORCED[name])
    jobs = [(key, key[0], p.to_json()) for key, p in plans.items()]
    graphs = {name: capture(*_build(name)) for name in NAMES}
    return plans, run_distributed(_worker, 4, jobs, graphs)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_solver_plan_matches_single_device(runs, name, shape):
    _, results = runs
    for r in results:
        _check(r[(name, shape)])


@pytest.mark.parametrize("name", NAMES)
def test_forced_tensor_parallel_plan_matches_single_device(runs, name):
    plans, results = runs
    assert any(c.kind in ("all_reduce", "reduce_scatter") for c in plans[(name, "forced")].collectives)
    for r in results:
        _check(r[(name, "forced")])


def test_both_runtimes_feed_one_recorder_with_one_record_type(runs):
    """The DTensor runtime's functional collectives and the ATP runtime's c10d ones arrive as the same
    ``CollectiveRecord`` (enum kind and phase, axis by name), each once: DTensor's under the plan's axis
    names, ATP's under its mesh's (``atp0``, ``atp1``)."""
    from meshpilot.graph.capture import Phase
    from meshpilot.runtime.collective_log import CollectiveRecord
    from meshpilot.sharding.reshard import CollectiveKind

    plans, results = runs
    plan = plans[("mlp", "forced")]
    assert plan.mesh_axes == ("gpu.0", "gpu.1")  # atp-ic3 is one layer of GPUs
    for r in results:
        entries = r["both runtimes"]
        assert all(type(e) is CollectiveRecord for e in entries)
        assert all(isinstance(e.kind, CollectiveKind) and isinstance(e.phase, Phase) for e in entries)
        dtensor = [e for e in entries if e.axis in plan.mesh_axes]
        atp = [e for e in entries if e.axis in ("atp0", "atp1")]
        assert len(dtensor) + len(atp) == len(entries)
        issued = Counter((e.kind, e.axis, e.nbytes) for e in dtensor)
        assert issued == plan.collective_counts(backend="gloo")
        assert {e.phase for e in dtensor} == {e.phase for e in atp} == {Phase.FWD, Phase.BWD}
        assert len(atp) == 14  # ATP Fig. 6 on DeviceMesh(2, 2): 14 per block (one chunk)
