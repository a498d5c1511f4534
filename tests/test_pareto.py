"""HiDup's models and its duplex-aware Pareto search (``meshpilot.planner.pareto``): the §6.1 models build and
train, Eq. 4–5 as the DP computes them, the searcher's candidate priced by the one accounting, its duplex time
never above the ILP plan's it was seeded with, Fig. 11 / Fig. 12's layouts on BERT-SGMoE (reduced size) at
10 and 100 Gbps — the halves that do not come out are strict xfails, explained in docs/hidup.md — and
``--searcher`` on ``meshpilot plan``. Pure, one process."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Shard

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
    assert balance.item() == pytest.approx(1.0)


def test_cut_keys_of_distinct_layouts_do_not_collide():
    """A state's key is the sum of its values' ``_h(value, layout id)``: two values in different layouts must
    not share a key with the same values in other layouts of the same total (Python's tuple hash, near linear
    in a small int, made 31 % of such pairs collide, so ``_prune`` dropped distinct cuts as one and the plan
    depended on PYTHONHASHSEED)."""
    names = [(f"node_{i}", 0) for i in range(60)]
    for i, v in enumerate(names):
        for w in names[i + 1 :]:
            keys = {(pareto._h(v, a) + pareto._h(w, b)) & pareto._MASK for a in range(5) for b in range(5)}
            assert len(keys) == 25, (v, w)


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


MESH = (1, 8)
"""HiDup's SPMD: one mesh axis over the 8 GPUs of the 2 x 4 clusters (it spans the node link)."""


@dataclass
class Reduced:
    graph: Any
    struct: Any
    tasks: dict[str, SearchTask]
    compute: dict[str, ComputeCost]


@pytest.fixture(scope="module")
def reduced() -> Reduced:
    """BERT-SGMoE with the paper's structure at a reduced size (2 layers, h = 256, 4 heads, ffn 1024, seq 64,
    vocab 1024, 8 experts, batch 64 = 2 microbatches of 32), mesh (1, 8), on hidup-2x4-10g and -100g. The
    strategies and structure are built once: only the links differ (compute is priced on the device, the
    same V100; resharding per cluster), as ``plan`` shares a structure between device mappings."""
    with torch.device("meta"):
        model = zoo.BertMoE(layers=2, hidden=256, heads=4, ffn=1024, seq=64, vocab=1024, experts=8)
    graph = capture(model, zoo.example_inputs("bert-sgmoe", model, 32, "meta"))
    dmesh = fake_device_mesh(MESH)

    def cost_model(cluster: str) -> CostModel:
        return CostModel(LogicalMesh(load_cluster(cluster), MESH, mapped_ranks(MESH, MeshMapping.ROW)))

    cm0 = cost_model(SLOW)
    struct = build_structure(graph, StrategyBuilder(graph, dmesh), Resharder(dmesh, cm0), cm0, microbatches=2)
    edges = ParamEdges.of(graph, step_edges(graph))
    tasks, compute = {}, {}
    for cluster in (SLOW, FAST):
        cm = cost_model(cluster)
        tasks[cluster] = SearchTask(graph, struct, Resharder(dmesh, cm), edges, MeshMapping.ROW, microbatches=2)
        compute[cluster] = ComputeCost(cm, MESH, graph)
    return Reduced(graph, struct, tasks, compute)


SLOW, FAST = "hidup-2x4-10g", "hidup-2x4-100g"


@pytest.fixture(scope="module")
def found(reduced) -> dict[str, tuple[Any, Any]]:
    """(ILP candidate, Pareto candidate seeded by it) per cluster."""
    out = {}
    for cluster, task in reduced.tasks.items():
        ilp = SEARCHERS["ilp"].search(task)
        out[cluster] = (ilp, pareto.ParetoSearcher().search(task, incumbent=ilp))
    return out


def test_pareto_candidate_is_priced_by_the_accounting_and_beats_its_seed(reduced, found):
    """The candidate's time is the accounting's of its strategies (not the DP's own number); the DP's ψ is
    what :func:`duplex_time` says of the same strategies, between the compute of two microbatches and their
    serial step, and never above the ψ of the ILP plan it was seeded with."""
    for cluster, (ilp, cand) in found.items():
        task, compute = reduced.tasks[cluster], reduced.compute[cluster]
        acct = account(task.graph, cand.chosen, task.resharder, compute, 2)
        assert cand.time_s == pytest.approx(acct.time.total_s, rel=1e-12)
        psi = pareto.duplex_time(task.graph, cand.chosen, task.resharder, compute)
        assert cand.objective_s == pytest.approx(psi, rel=1e-9)
        assert 2 * acct.time.compute_s * (1 - 1e-9) <= psi <= acct.time.total_s * (1 + 1e-9)
        assert psi <= pareto.duplex_time(task.graph, ilp.chosen, task.resharder, compute) * (1 + 1e-9)
        assert psi < acct.time.total_s * 0.99  # the overlap is real on this model: more than 1% hidden
        assert cand.status.endswith("seeded by the ILP")
        # on the serial (no-overlap) step the ILP is the optimum; the DP's plan stays within 5% of it
        assert ilp.time_s * (1 - 1e-3) <= cand.time_s <= ilp.time_s * 1.05


def test_unseeded_beam_is_a_valid_plan(reduced):
    """The pure beam (no incumbent) gives a complete choice; its ψ is the evaluator's (docs/hidup.md: it is
    not as good as the seeded search)."""
    task, compute = reduced.tasks[FAST], reduced.compute[FAST]
    res = pareto.pareto_search(task.graph, task.struct, Pricer(task.struct.table, task.resharder), compute, beam=4)
    assert set(res.chosen) == {n.name for n in task.graph.nodes}
    assert res.psi_s == pytest.approx(pareto.duplex_time(task.graph, res.chosen, task.resharder, compute), rel=1e-9)


def _params(reduced, cand) -> dict[str, Any]:
    return {n.fqn: cand.chosen[n.name].outs[0] for n in reduced.graph.nodes if n.kind == "param"}


def _replicated(layout) -> bool:
    return all(p.is_replicate() for p in layout)


def _grad_kinds(reduced, cluster, cand) -> dict[str, set[str]]:
    task, compute = reduced.tasks[cluster], reduced.compute[cluster]
    out: dict[str, set[str]] = {}
    for c in account(task.graph, cand.chosen, task.resharder, compute, 2).collectives:
        if c.dst.startswith("grad:"):
            out.setdefault(c.dst.removeprefix("grad:"), set()).add(str(c.kind))
    return out


def test_fig11_slow_link_replicates_parameters_and_all_reduces(reduced, found):
    """HiDup Fig. 11, 10 Gbps: parameters replicated, their gradients all-reduced (no reduce-scatter). Every
    parameter but the experts' (expert-parallel: sharded on the expert dim) is replicated."""
    _, cand = found[SLOW]
    params = _params(reduced, cand)
    sharded = {f for f, lay in params.items() if not _replicated(lay)}
    assert sharded <= {f for f in params if f.endswith(("w_in", "w_out"))}, sharded
    grads = _grad_kinds(reduced, SLOW, cand)
    for fqn in set(params) - sharded:
        assert "reduce_scatter" not in grads.get(fqn, set()), fqn
    assert sum("all_reduce" in k for k in grads.values()) >= len(params) - len(sharded) - 2  # biases of 1 elem aside


@pytest.mark.xfail(strict=True, reason="not reproduced: docs/hidup.md, 'Fig. 11 and 12' (the cost model's numbers)")
def test_fig11_fast_link_shards_more_parameters(reduced, found):
    """HiDup Fig. 11, 100 Gbps: more parameters sharded (all-gather + reduce-scatter) than at 10 Gbps."""
    count = {c: sum(not _replicated(lay) for lay in _params(reduced, found[c][1]).values()) for c in (SLOW, FAST)}
    assert count[FAST] > count[SLOW], count


def _moe_layouts(reduced, cand) -> tuple[Any, Any, Any]:
    """(gating matmul's output, the dispatch einsum's token operand, the experts' w_in) of the MoE layer."""
    g = reduced.graph
    gate = next(n for n in g.nodes if n.phase == "fwd" and n.target == "aten.mm.default" and n.module.endswith("gate"))
    dispatch = next(n for n in g.nodes if n.phase == "fwd" and n.target == "aten.bmm.default")
    w_in = next(n for n in g.nodes if n.kind == "param" and n.fqn.endswith("w_in"))
    c = cand.chosen
    return c[gate.name].outs[0], c[dispatch.name].ins[1], c[w_in.name].outs[0]


def test_fig12_fast_link_is_gshards_expert_parallel_layout(reduced, found):
    """HiDup Fig. 12 (left), 100 Gbps: GShard's layout — gating on each device's own tokens (sharded), experts
    sharded on the expert dim over the devices, all-to-alls between (dispatch and combine, forward)."""
    ilp, cand = found[FAST]
    gate, _, w_in = _moe_layouts(reduced, cand)
    assert gate[1].is_shard() and w_in[1] == Shard(0), (gate, w_in)
    task, compute = reduced.tasks[FAST], reduced.compute[FAST]
    colls = account(task.graph, cand.chosen, task.resharder, compute, 2).collectives
    assert sum(str(c.kind) == "all_to_all" and c.phase == "fwd" for c in colls) >= 2


@pytest.mark.xfail(strict=True, reason="not reproduced: docs/hidup.md, 'Fig. 11 and 12' (the cost model's numbers)")
def test_fig12_slow_link_replicates_gating_and_the_moe_input(reduced, found):
    """HiDup Fig. 12 (right), 10 Gbps: the gating computed on every device and the MoE input unpartitioned."""
    gate, tokens, _ = _moe_layouts(reduced, found[SLOW][1])
    assert _replicated(gate) and _replicated(tokens), (gate, tokens)


def test_fig12_hidup_layout_forced_costs_its_token_collectives(reduced, found):
    """docs/hidup.md, "Fig. 11 and Fig. 12" (traced with benchmarks/bench_hidup_fig12.py): HiDup's 10 Gbps layout,
    forced (:func:`pareto.hidup_moe_force`), is a plan the model prices with no all-to-all of the dispatched
    tokens in the forward — the dispatch reads the replicated MoE input, the combine contracts the
    expert-sharded expert outputs into a Partial (it needs the model's combine to contract (e, c) with e outer)
    — and it is dearer than GShard's by its all-gather of the MoE input and reduce-scatter of the MoE output,
    each priced above an all-to-all of the dispatched tokens: per-rank bytes (T against 2T / 8)."""
    task, compute = reduced.tasks[SLOW], reduced.compute[SLOW]
    cm = task.resharder.cost_model
    force = pareto.hidup_moe_force(reduced.graph)
    struct = build_structure(
        reduced.graph,
        StrategyBuilder(reduced.graph, fake_device_mesh(MESH)),
        task.resharder,
        cm,
        force=force,
        microbatches=2,
    )
    forced = SEARCHERS["ilp"].search(
        SearchTask(reduced.graph, struct, task.resharder, task.param_edges, MeshMapping.ROW, microbatches=2)
    )
    gate, tokens, w_in = _moe_layouts(reduced, forced)
    assert _replicated(gate) and _replicated(tokens) and w_in[1] == Shard(0), (gate, tokens, w_in)
    colls = account(task.graph, forced.chosen, task.resharder, compute, 2).collectives
    fwd = [c for c in colls if c.phase == "fwd"]
    moe_in = 32 * 64 * 256 * 4  # the MoE input [g, s, m], fp32: T
    dispatched = 2 * moe_in // 8  # expert_in [e, g, c, m] has e·c = 2s slots; one rank's share
    assert all(c.nbytes < dispatched for c in fwd if str(c.kind) == "all_to_all"), fwd
    gathered = [c for c in fwd if str(c.kind) == "all_gather" and c.nbytes == moe_in]
    scattered = [c for c in fwd if str(c.kind) == "reduce_scatter" and c.nbytes == moe_in]
    assert gathered and scattered, fwd
    gshard_a2a = [
        c
        for c in account(task.graph, found[SLOW][0].chosen, task.resharder, compute, 2).collectives
        if c.phase == "fwd" and str(c.kind) == "all_to_all" and c.nbytes == dispatched
    ]
    assert len(gshard_a2a) == 2, gshard_a2a  # dispatch and combine, the latter with no detour (e outer)
    # HiDup's two collectives of the MoE input / output against GShard's two all-to-alls: 1.6x dearer here, with
    # the all-to-all priced at the node link all 4 ranks of a node cross at once (3x with a ring's share of it)
    assert gathered[0].seconds + scattered[0].seconds > 1.5 * sum(c.seconds for c in gshard_a2a)
    assert forced.time_s > found[SLOW][0].time_s


def test_searchers_registered_and_unknown_name_is_one_line():
    assert {"ilp", "pareto", "best"} <= set(SEARCHERS)
    with pytest.raises(Exception, match="expected one of ilp, pareto, best"):
        get_searcher("dp")


def test_cli_searcher_recorded_in_the_plan(capsys, tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "mlp", "-c", "atp-ic3", "-n", "2", "--searcher", "best"]
    assert main([*args, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "solver: best" in text and "best of ilp" in text
    from meshpilot.planner.plan import StagePlan

    assert StagePlan.load(out).solver.searcher == "best"
    assert main(["plan", "--model", "mlp", "-c", "atp-ic3", "-n", "2", "--searcher", "pareto", "--ops", "none"]) == 0
    text = capsys.readouterr().out
    assert "pareto: duplex" in text
    assert re.search(r"★.*1\.00x", text), text  # the chosen row is the reference, not the duplex objective
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "mlp", "-c", "atp-ic3", "-n", "2", "--searcher", "dp"])
    assert exc.value.code == 2
    assert "--searcher" in capsys.readouterr().err
