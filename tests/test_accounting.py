"""One accounting: the time the search minimises is the time the plan reports.

The ILP's objective (built from ``ilp.build_structure``'s vectorised terms), plus the ZeRO post-pass's
Δt, is what ranks mesh candidates (``MeshCandidate.objective_s``); ``accounting.account`` recomputes the
chosen plan's step edge by edge for ``Plan.time`` and ``Plan.collectives``. They must agree — with
gradient accumulation (gradients synchronised once, everything else once per microbatch) and with ZeRO
switches — or the search optimises one number and reports another.
"""

import warnings

import pytest
import torch
from tiers import matrix

from meshpilot.models import builtin_models
from meshpilot.planner.accounting import EdgeKind, step_edges
from meshpilot.planner.auto import plan
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.search import SEARCHERS

# the encoder's search (19 CPU s on a 2-core AMD EPYC) in the full matrix only (tests/tiers.py): the GPT's attention
# and MLPs, the MoE's experts and the conv net's convolutions are the default tier's
ALL_MODELS = ["gpt-tiny", "bert-tiny", "moe-tiny", "wrn-tiny"]
MODELS = list(matrix(["gpt-tiny", "moe-tiny", "wrn-tiny"], ALL_MODELS))


@pytest.fixture(scope="module")
def built():
    return {name: builtin_models()[name].build("cpu", None) for name in ALL_MODELS}  # the encoder: the reprice test


def _chosen_objective(p) -> float:
    rows = [c for c in p.solver.candidates if c.objective_s is not None]
    match = [c.objective_s for c in rows if tuple(c.shape) == tuple(p.mesh_shape) and c.mapping == p.mapping]
    assert match, p.solver.candidates
    return match[0]


@pytest.mark.parametrize("name", MODELS)
def test_search_objective_is_the_plans_step_time(built, name):
    model, inputs = built[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for microbatches, zero in ((1, "auto"), (2, "all")):
            p = plan(model, inputs, "atp-ic3", num_devices=4, microbatches=microbatches, zero=zero)
            assert p.solver.searcher == "ilp"
            # the mesh search compares the step with the gradient buckets' overlap priced (planner.buckets)
            assert p.time.overlapped_s == pytest.approx(_chosen_objective(p), rel=1e-9, abs=1e-15)
            # the collectives the plan lists add up to its communication and resharding time
            total = sum(c.seconds * (1 if c.dst.startswith("grad:") else microbatches) for c in p.collectives)
            assert total == pytest.approx(p.time.communication_s + p.time.resharding_s, rel=1e-9, abs=1e-15)
            # compute once per microbatch
            per_microbatch = sum(n.seconds for n in p.nodes)
            assert p.time.compute_s == pytest.approx(microbatches * per_microbatch, rel=1e-9)


class _BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.bn(self.conv(x)).mean((2, 3)), y)


def test_step_edges_cover_operands_loss_grads_buffers():
    from meshpilot.graph.capture import capture

    g = capture(_BatchNormNet(), (torch.randn(4, 3, 8, 8), torch.randint(0, 8, (4,))))
    edges = step_edges(g)
    kinds = [e.kind for e in edges]
    assert kinds.count(EdgeKind.OPERAND) == sum(len(n.inputs) for n in g.nodes)
    assert kinds.count(EdgeKind.LOSS) == 1
    assert kinds.count(EdgeKind.GRAD) == sum(v is not None for v in g.grads.values()) == 4
    assert kinds.count(EdgeKind.BUFFER) == len(g.buffer_updates) == 3  # running mean, var, batches seen
    assert all(e.runs(4) == (1 if e.kind == EdgeKind.GRAD else 4) for e in edges)


def test_unknown_searcher_is_one_line(built):
    model, inputs = built["gpt-tiny"]
    with pytest.raises(PlanError, match="searcher='annealing': expected one of " + ", ".join(SEARCHERS)):
        plan(model, inputs, "atp-ic3", num_devices=4, searcher="annealing")


def test_reprice_on_the_planning_cluster_reproduces_the_plan(built):
    from meshpilot.graph.capture import capture
    from meshpilot.planner.accounting import reprice

    model, inputs = built["bert-tiny"]
    graph = capture(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(model, inputs, "atp-ic3", num_devices=4, graph=graph, microbatches=2)
    same = reprice(p, graph, "atp-ic3")
    assert same.time == p.time and same.collectives == p.collectives
    assert [n.seconds for n in same.nodes] == [n.seconds for n in p.nodes]
    other = reprice(p, graph, "atp-ic1")  # another device and links: every price changes, nothing else
    assert other.time.total_s != p.time.total_s and other.cluster == "atp-ic1"
    assert [(c.kind, c.axis, c.nbytes, c.src, c.dst) for c in other.collectives] == [
        (c.kind, c.axis, c.nbytes, c.src, c.dst) for c in p.collectives
    ]


def _with_fixed_costs(cluster, op: float, each: float):
    import dataclasses

    from meshpilot.cluster import load_cluster

    cl = load_cluster(cluster)
    return dataclasses.replace(cl, device=dataclasses.replace(cl.device, op_overhead=op, foreach_overhead=each))


def test_fixed_costs_and_the_optimizer_step_are_priced_by_the_one_accounting(built):
    """The per-operator cost is paid once per kernel and microbatch, the AdamW update once a step at 21
    parameter-sized streams per shard plus its operators' fixed costs; the ILP ranks by the same number."""
    from meshpilot.graph.capture import capture
    from meshpilot.graph.views import aliases_input
    from meshpilot.planner.accounting import ADAMW_PASSES, reprice
    from meshpilot.sharding.placements import from_json, shard_factor

    model, inputs = built["gpt-tiny"]
    graph = capture(model, inputs)
    cl = _with_fixed_costs("atp-ic3", op=3e-6, each=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = plan(model, inputs, cl, mesh_shape=(2, 2), graph=graph, microbatches=2)
    assert p.time.total_s == pytest.approx(_chosen_objective(p), rel=1e-9, abs=1e-15)
    base = reprice(p, graph, _with_fixed_costs(cl, 0.0, 0.0))
    kernels = [n for n in graph.nodes if n.kind == "op" and not aliases_input(n) and (n.flops or n.bytes_written)]
    assert p.time.compute_s - base.time.compute_s == pytest.approx(2 * len(kernels) * 3e-6, rel=1e-9)
    trainable = [n for n in graph.nodes if n.kind == "param" and graph.grads.get(n.fqn) is not None]
    assert p.time.optimizer_s - base.time.optimizer_s == pytest.approx(len(trainable) * (9e-6 + 2 * 3e-6), rel=1e-9)
    layout = {n.name: from_json(n.outs[0]) for n in p.nodes}
    dev = cl.device
    streams = sum(ADAMW_PASSES * n.out.nbytes / shard_factor(layout[n.name], p.mesh_shape) for n in trainable) / (
        dev.memory_bandwidth * dev.memory_efficiency
    )
    assert base.time.optimizer_s == pytest.approx(streams, rel=1e-9)
    assert p.time.total_s == pytest.approx(
        p.time.compute_s + p.time.communication_s + p.time.resharding_s + p.time.optimizer_s
    )


def test_plan_gemms_are_the_local_shards_a_device_runs(built):
    """Under data parallelism over 4 devices every GEMM a device runs is the model's at a quarter batch."""
    from meshpilot.graph.capture import capture
    from meshpilot.graph.gemms import graph_gemms
    from meshpilot.planner import forced
    from meshpilot.planner.accounting import plan_gemms

    model, inputs = built["gpt-tiny"]
    graph = capture(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = forced.data_parallel(model, inputs, (4, 1))
        p = plan(model, inputs, "atp-ic3", graph=graph, mesh_shape=(4, 1), force=dp)
    quarter = capture(model, tuple(x[: x.shape[0] // 4] for x in inputs))
    assert sorted(plan_gemms(p, graph)) == sorted((g.m, g.n, g.k, g.dtype) for g in graph_gemms(quarter))
    assert sorted(plan_gemms(p, graph)) != sorted((g.m, g.n, g.k, g.dtype) for g in graph_gemms(graph))
