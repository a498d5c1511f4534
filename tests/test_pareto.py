"""HiDup's models and its duplex-aware Pareto search (``meshpilot.planner.pareto``): the §6.1 models build and
train, Eq. 4–5 as the DP computes them, the searcher's candidate priced by the one accounting, its duplex time
never above the ILP plan's it was seeded with, and ``--searcher`` on ``meshpilot plan``. Pure, one process."""

from __future__ import annotations

import math

import pytest
import torch

from meshpilot.cli.main import main
from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mapped_ranks
from meshpilot.cluster.mesh import MeshMapping
from meshpilot.graph.capture import capture
from meshpilot.models import builtin_models, zoo
from meshpilot.planner import pareto
from meshpilot.planner.accounting import ComputeCost, account, step_edges
from meshpilot.planner.ilp import Pricer, build_structure
from meshpilot.planner.search import SEARCHERS, SearchTask, get_searcher
from meshpilot.planner.zero import ParamEdges
from meshpilot.sharding.reshard import Resharder
from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

HIDUP = ("bert-sgmoe", "bert-switch", "vit-sgmoe", "vit-switch")


@pytest.mark.parametrize("name", HIDUP)
def test_hidup_models_train_and_match_table_1(name):
    """Tiny: a finite loss with the load-balancing term and gradients for every expert. Paper size (meta):
    Table 1's parameter counts for n = 8 GPUs (BERT 89 + 19n M, ViT 38 + 38n M) within 3%."""
    models = builtin_models()
    torch.manual_seed(0)
    model, inputs = models[f"{name}-tiny"].build("cpu", None)
    loss = model(*inputs)
    loss.backward()
    assert math.isfinite(loss.item())
    moe = model.layers[1].moe
    assert moe.top_k == (2 if "sgmoe" in name else 1)
    assert moe.w_in.grad is not None and moe.w_in.grad.abs().sum(dim=(1, 2)).gt(0).all()  # every expert learns
    assert isinstance(model.layers[0], zoo._EncoderLayer) and not hasattr(model.layers[0], "moe")
    big, _ = models[name].build("meta", None)
    n = 8
    want = (89 + 19 * n) if name.startswith("bert") else (38 + 38 * n)
    got = sum(p.numel() for p in big.parameters()) / 1e6
    assert abs(got - want) / want < 0.03, (got, want)
    assert len(big.layers) == 8 and sum(hasattr(layer, "moe") for layer in big.layers) == 4
    assert big.layers[1].moe.experts == (n if name.startswith("bert") else 2 * n)


def test_capacity_drops_overflow_and_balance_loss_is_one_when_uniform():
    """Per-expert capacity: a token past its expert's capacity is dropped (its combine row is zero); the
    load-balancing loss e·Σ f_e·P_e is 1 for a router that spreads tokens evenly with uniform probabilities."""
    layer = zoo.MoELayer(4, 8, experts=2, capacity=1, top_k=1)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[0, 0] = 10.0  # every token with x[0] > 0 picks expert 0
    x = torch.tensor([[1.0, 0, 0, 0], [2.0, 0, 0, 0], [-1.0, 0, 0, 0]])
    dispatch, combine = layer.routing(x)
    assert dispatch[0, 0, 0] == 1 and dispatch[1].sum() == 0  # token 1 overflows expert 0: dropped
    assert dispatch[2, 1, 0] == 1
    flat = zoo.MoELayer(4, 8, experts=2, capacity=2, top_k=1)
    with torch.no_grad():
        flat.gate.weight.zero_()
    _, balance = flat.moe(torch.randn(6, 4))
    assert float(balance) == pytest.approx(1.0)


def test_eq5_on_a_hand_timeline():
    """Two stages, (comm 0, comp 3) then (comm 2, comp 1): microbatch 0 computes 3, microbatch 1 computes 3
    while microbatch 0's collective (2) runs, then microbatch 0 computes 1 while microbatch 1's collective
    runs (max(2, 1) = 2), then microbatch 1 computes 1: ψ = 3 + 3 + 2 + 1 = 9 (serial: 2·(3 + 2 + 1) = 12)."""
    state = (0.0, 0.0, 0.0, 0.0)
    state = pareto._advance(*state, comm=0.0, comp=3.0)
    assert pareto._psi(*state) == 6.0  # one stage, no communication: both microbatches' compute
    state = pareto._advance(*state, comm=2.0, comp=1.0)
    assert pareto._psi(*state) == 9.0
    # communication longer than the compute it hides behind is exposed: (comp 1) then (comm 5, comp 1)
    s2 = pareto._advance(*pareto._advance(0.0, 0.0, 0.0, 0.0, 0.0, 1.0), comm=5.0, comp=1.0)
    assert pareto._psi(*s2) == 1 + 5 + 5 + 1


@pytest.fixture(scope="module")
def tiny_task():
    """bert-sgmoe-tiny on hidup-2x4-10g, mesh (2, 4) row-mapped: one SearchTask."""
    model, inputs = builtin_models()["bert-sgmoe-tiny"].build("meta", None)
    graph = capture(model, inputs)
    shape = (2, 4)
    cl = load_cluster("hidup-2x4-10g")
    dmesh = fake_device_mesh(shape)
    cm = CostModel(LogicalMesh(cl, shape, mapped_ranks(shape, MeshMapping.ROW)))
    rs = Resharder(dmesh, cm)
    struct = build_structure(graph, StrategyBuilder(graph, dmesh), rs, cm)
    edges = step_edges(graph)
    task = SearchTask(graph, struct, rs, ParamEdges.of(graph, edges), MeshMapping.ROW, capacity=cl.device.memory_bytes)
    return task, ComputeCost(cm, shape, graph)


def test_pareto_candidate_is_priced_by_the_accounting_and_beats_its_seed(tiny_task):
    """The candidate's time is the accounting's of its strategies (not the DP's own number); the DP's ψ is
    what :func:`duplex_time` says of the same strategies, below the serial two-microbatch step, and never
    above the ψ of the ILP plan it was seeded with."""
    task, compute = tiny_task
    ilp = SEARCHERS["ilp"].search(task)
    cand = pareto.ParetoSearcher().search(task, incumbent=ilp)
    acct = account(task.graph, cand.chosen, task.resharder, compute, task.microbatches)
    assert cand.time_s == pytest.approx(acct.time.total_s, rel=1e-12)
    psi = pareto.duplex_time(task.graph, cand.chosen, task.resharder, compute)
    assert cand.objective_s == pytest.approx(psi, rel=1e-9)
    serial2 = account(task.graph, cand.chosen, task.resharder, compute, 2).time.total_s
    assert psi <= serial2 * (1 + 1e-9)
    assert psi >= 2 * acct.time.compute_s * (1 - 1e-9)  # overlap hides communication, never compute
    assert psi <= pareto.duplex_time(task.graph, ilp.chosen, task.resharder, compute) * (1 + 1e-9)


def test_unseeded_beam_is_a_valid_plan(tiny_task):
    """The pure beam (no incumbent) gives a complete choice the accounting prices; its ψ matches the
    evaluator's. (It is not as good as the seeded search: docs/hidup.md has the numbers.)"""
    task, compute = tiny_task
    res = pareto.pareto_search(task.graph, task.struct, Pricer(task.struct.table, task.resharder), compute, beam=4)
    assert set(res.chosen) == {n.name for n in task.graph.nodes}
    assert res.psi_s == pytest.approx(pareto.duplex_time(task.graph, res.chosen, task.resharder, compute), rel=1e-9)


def test_searchers_registered_and_unknown_name_is_one_line():
    assert {"ilp", "pareto", "best"} <= set(SEARCHERS)
    with pytest.raises(Exception, match="expected one of ilp, pareto, best"):
        get_searcher("dp")


def test_cli_searcher_recorded_in_the_plan(capsys, tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "bert-sgmoe-tiny", "-c", "hidup-2x4-10g", "--mesh", "2x4", "--searcher", "best"]
    assert main([*args, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "solver: best" in text and "best of ilp" in text
    from meshpilot.planner.plan import Plan

    assert Plan.load(out).solver.searcher == "best"
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "mlp", "-c", "atp-ic3", "-n", "2", "--searcher", "dp"])
    assert exc.value.code == 2
    assert "--searcher" in capsys.readouterr().err
