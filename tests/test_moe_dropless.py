"""Hugging Face Mixtral's dropless experts (``experts_implementation="meshpilot"``, :mod:`meshpilot.ops.moe`).

Pure: the op equals HF's own eager experts loop (loss and gradients) and captures as one forward and one
backward node; the ILP picks expert parallelism by itself where the experts' gradients outweigh the tokens'
all-to-alls (large experts, few tokens) and data parallelism where they do not (tiny experts); an
activation the op lacks runs transformers' batched_mm path, with a warning.

On 4 and 8 gloo ranks (one spawn each): the solver's plans (expert-parallel on (4, 1); on (2, 2) and (2, 4) with
data parallelism on the other axis) and the forced data-parallel plans ((4, 1) and (8, 1)), trained 2 AdamW steps beside
the single-device HF model: loss and every gradient within 1e-5, and the collectives equal the plan's. The
expert-parallel combine moves a routing-dependent number of rows (the plan prices the mean,
:func:`meshpilot.ops.moe.expected_pairs`), so its all-to-alls are compared per rank by count and axis and over
all ranks by total bytes; every other collective by kind, axis and bytes.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import transformers  # noqa: F401 - a test dependency (pyproject test extra): never skipped silently
from dist_utils import run_distributed
from tiers import params

TOL = 1e-5
STEPS = 2
VOCAB, BATCH, SEQ = 64, 8, 4
CLUSTER = "atp-ic2"  # PCIe between NVLink pairs: the experts' gradient all-reduce is dear
# large experts, few tokens: the experts' gradient all-reduce costs more than the tokens' all-to-alls
BIG = dict(hidden_size=256, intermediate_size=1024, num_local_experts=8)
TINY = dict(hidden_size=32, intermediate_size=48, num_local_experts=4)
MESHES = {4: [(4, 1), (2, 2)], 8: [(8, 1), (2, 4)]}


def build(sizes: dict, impl: str | None = None, device: str = "cpu"):
    from meshpilot.models.sources import hf_model

    cfg = dict(
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        vocab_size=VOCAB,
        **sizes,
    )
    if impl is not None:
        cfg["experts_implementation"] = impl
    torch.manual_seed(0)
    model = hf_model("mixtral", cfg, device=device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    if device == "meta":
        ids, labels = ids.to("meta"), labels.to("meta")
    return model, (ids, labels)


def _moe_node(p, backward: bool = False):
    target = "meshpilot.moe_experts_backward.default" if backward else "meshpilot.moe_experts.default"
    (node,) = [n for n in p.nodes if n.target == target]
    return node


def _expert_axes(p) -> list[int]:
    """Mesh axes the plan shards the experts over (gate_up_proj, operand 3 of the forward op)."""
    return [a for a, pl in enumerate(_moe_node(p).ins[3]) if pl == "S(0)" and p.mesh_shape[a] > 1]


# ------------------------------------------------------------------------------------------- one process


def test_op_equals_hf_eager_experts_and_captures_as_one_node():
    from meshpilot.graph.capture import capture

    got = {}
    for impl in ("eager", "meshpilot"):
        model, inputs = build(TINY, impl)
        loss = model(*inputs)
        loss.backward()
        got[impl] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
    assert abs(got["meshpilot"][0] - got["eager"][0]) <= TOL
    for n, g in got["eager"][1].items():
        assert (got["meshpilot"][1][n] - g).abs().max().item() <= TOL, n
    model, inputs = build(TINY, device="meta")  # the default path of hf:mixtral
    assert model.model.config._experts_implementation == "meshpilot"
    targets = Counter(str(n.target) for n in capture(model, inputs).nodes)
    assert targets["meshpilot.moe_experts.default"] == 1
    assert targets["meshpilot.moe_experts_backward.default"] == 1
    assert not any("nonzero" in t for t in targets)


def test_batched_mm_stays_available():
    model, inputs = build(TINY, "batched_mm")
    assert model.model.config._experts_implementation == "batched_mm"
    assert torch.isfinite(model(*inputs))


def test_unsupported_activation_runs_transformers_path():
    from meshpilot.ops import moe

    moe._NOTED.clear()  # noted once per process: this test must see it
    got = {}
    for impl in ("batched_mm", "meshpilot"):
        torch.manual_seed(0)
        model, inputs = build(dict(TINY, hidden_act="tanh"), impl)
        if impl == "meshpilot":
            with pytest.warns(UserWarning, match="activation 'tanh'.*batched_mm"):
                got[impl] = model(*inputs)
        else:
            got[impl] = model(*inputs)
    torch.testing.assert_close(got["meshpilot"], got["batched_mm"], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def plans():
    """Solver plans for BIG on every mesh of MESHES and forced data-parallel ones, and TINY's on (4, 1)."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import plan
    from meshpilot.planner.forced import forced

    model, inputs = build(BIG, device="meta")
    graph = capture(model, inputs)
    out = {}
    for shapes in MESHES.values():
        for shape in shapes:
            out[("solver", shape)] = plan(model, inputs, CLUSTER, mesh_shape=shape, graph=graph, mappings=("row",))
        shape = shapes[0]
        dp = forced("data_parallel", model, inputs, shape)
        out[("data_parallel", shape)] = plan(
            model, inputs, CLUSTER, mesh_shape=shape, force=dp, graph=graph, mappings=("row",)
        )
    tiny, tiny_inputs = build(TINY, device="meta")
    out[("tiny", (4, 1))] = plan(tiny, tiny_inputs, CLUSTER, mesh_shape=(4, 1), mappings=("row",))
    return out


def test_solver_finds_expert_parallelism_where_it_is_cheaper(plans):
    for shapes in MESHES.values():
        for shape in shapes:
            p = plans[("solver", shape)]
            assert not p.fallbacks, [f.line() for f in p.fallbacks][:3]
            assert len(_expert_axes(p)) == 1, (shape, _moe_node(p))
            a2a = [c for c in p.collectives if c.kind == "all_to_all" and c.src == c.dst]
            assert len(a2a) == 6, (shape, a2a)  # counts, dispatch, combine; forward and backward
    dp = plans[("data_parallel", (4, 1))]
    assert _expert_axes(dp) == []
    assert plans[("solver", (4, 1))].time.total_s < dp.time.total_s
    assert _expert_axes(plans[("tiny", (4, 1))]) == []  # tiny experts: their all-reduce is cheaper


def test_duplex_schedule_and_simulator_hide_the_expert_all_to_alls(plans):
    """The duplex schedule cuts around the expert-parallel MoE (the op issues its counts and dispatch before
    its computation, ``OwnOp.leading``, and its combine after): microbatch 1's dispatch is issued before
    microbatch 0's experts and waited after them, microbatch 0's combine likewise around microbatch 1's; the
    simulator runs those transfers beside that compute (one at a time on their process group), and without
    duplex prices the op as the closed form does (the step equals ``plan.time``'s, where only the gradient
    buckets overlap the backward)."""
    import dataclasses

    from meshpilot.planner.schedule import ActionKind, duplex
    from meshpilot.sim import simulate

    p = plans[("solver", (4, 1))]
    assert simulate(p).step_s == pytest.approx(p.time.overlapped_s, rel=1e-9)
    for backward in (False, True):
        node = _moe_node(p, backward)
        i = next(k for k, n in enumerate(p.nodes) if n.name == node.name)
        own = [c for c, col in enumerate(p.collectives) if col.src == col.dst == node.name]
        assert len(own) == 3  # counts, dispatch, combine
        counts, dispatch, combine = own
        kind = ActionKind.BACKWARD if backward else ActionKind.FORWARD
        acts = [str(a) for a in duplex(p).actions(0)]
        experts = [f"{kind.value}{m}[{i}:{i + 1}]" for m in (0, 1)]
        at = {a: k for k, a in enumerate(acts)}
        assert at[f"+{dispatch}.1"] < at[experts[0]] < at[f"-{dispatch}.1"], acts
        assert at[f"+{combine}.0"] < at[experts[1]] < at[f"-{combine}.0"], acts

        sim = simulate(dataclasses.replace(p, schedule=duplex(p)))
        span = {e.name: (e.start_s, e.start_s + e.dur_s) for e in sim.events if e.rank == 0}
        axis = p.axis_name(p.collectives[dispatch].axis)
        # a process group runs one collective at a time: microbatch 1's dispatch queues behind its counts, so
        # what runs beside microbatch 0's experts is the first of the two in flight
        for colls, m, other in (((counts, dispatch), 1, 0), ((combine,), 0, 1)):
            (c0, c1) = span[experts[other]]
            runs = [span[f"all_to_all@{axis} #{coll}.{m}"] for coll in colls]
            assert any(max(a0, c0) < min(a1, c1) for a0, a1 in runs), (colls, m, runs, (c0, c1))
    assert sim.classes[0].hidden_comm_s > 0


def test_pareto_search_prices_the_expert_all_to_alls_around_the_experts():
    """HiDup's Pareto DP prices the expert-parallel MoE as the duplex schedule runs it: its counts and dispatch
    in the communication step of its stage, its combine opening the next (``OwnOp.leading``), so the ψ of an
    expert-parallel plan is below the same plan's with the op's all-to-alls inside its computation; the DP's
    own ψ is :func:`duplex_time`'s of the strategies it returns."""
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mapped_ranks
    from meshpilot.cluster.mesh import MeshMapping
    from meshpilot.graph.capture import capture
    from meshpilot.planner import pareto
    from meshpilot.planner.accounting import ComputeCost, step_edges
    from meshpilot.planner.ilp import build_structure
    from meshpilot.planner.search import SEARCHERS, SearchTask
    from meshpilot.planner.zero import ParamEdges
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    model, inputs = build(BIG, device="meta")
    graph = capture(model, inputs)
    shape = (4, 1)
    dmesh = fake_device_mesh(shape)
    cm = CostModel(LogicalMesh(load_cluster(CLUSTER), shape, mapped_ranks(shape, MeshMapping.ROW)))
    struct = build_structure(graph, StrategyBuilder(graph, dmesh), Resharder(dmesh, cm), cm, microbatches=2)
    task = SearchTask(graph, struct, Resharder(dmesh, cm), ParamEdges.of(graph, step_edges(graph)), MeshMapping.ROW,
                      microbatches=2)  # fmt: skip
    compute = ComputeCost(cm, shape, graph)
    ilp = SEARCHERS["ilp"].search(task)
    moe = [n for n in graph.nodes if pareto.leading_collectives(str(n.target))]
    assert moe and all(len(ilp.chosen[n.name].colls) == 3 for n in moe)  # expert-parallel: counts, dispatch, combine
    split = pareto.duplex_time(graph, ilp.chosen, task.resharder, compute)
    with pytest.MonkeyPatch.context() as mp:  # the op's collectives counted inside its computation, as before
        mp.setattr(pareto, "leading_collectives", lambda target: 0)
        inside = pareto.duplex_time(graph, ilp.chosen, task.resharder, compute)
    assert split < inside, (split, inside)
    cand = pareto.ParetoSearcher().search(task, incumbent=ilp)
    assert cand.objective_s == pytest.approx(pareto.duplex_time(graph, cand.chosen, task.resharder, compute), rel=1e-9)
    assert cand.objective_s <= split * (1 + 1e-9)


# ------------------------------------------------------------------------------------------- 4 and 8 ranks


def _reference() -> list[dict]:
    model, inputs = build(BIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        out.append({"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
        opt.step()
    return out


def _local(ref: torch.Tensor, got) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    from meshpilot import compat

    if not isinstance(got, DTensor):
        return ref
    shape, offset = compat.local_shape_and_offset()(ref.shape, got.device_mesh, got.placements)
    return ref[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def _worker(jobs: list[tuple[str, str]], graph) -> dict:
    """Each (job, plan JSON) of BIG run beside the single device on `graph`, its capture made once in the parent
    (``capture(*build(BIG))``, the call each rank made)."""
    from torch.distributed.tensor import DTensor

    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.spmd import parallelize

    ref = _reference()
    out = {}
    for job, plan_json in jobs:
        plan = StagePlan.from_json(plan_json)
        model, inputs = build(BIG)
        pm = parallelize(model, plan, graph=graph)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        res: dict = {"loss": [], "grad": [], "counts": []}
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            with record_collectives(pm.mesh) as log:
                loss = pm(*inputs)
                loss.backward()
            res["loss"].append(abs(loss.item() - ref[step]["loss"]))
            errs = []
            for n, p in model.named_parameters():
                local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                errs.append((local - _local(ref[step]["grads"][n], p.grad)).abs().max().item())
            res["grad"].append(max(errs))
            res["counts"].append(sorted(log.counts().items()))
            opt.step()
        res["mismatches"] = list(pm.mismatches)
        out[job] = res
    return out


def _check_counts(per_rank: list[list], planned: Counter) -> None:
    """Every collective but the all-to-alls by (kind, axis, bytes) on every rank; the all-to-alls by (axis,
    count) on every rank and by total bytes over the ranks (the combine's size follows the routing)."""
    a2a = "all_to_all"
    want_rest = Counter({k: v for k, v in planned.items() if k[0] != a2a})
    want_a2a: Counter = Counter()
    for k, v in planned.items():
        if k[0] == a2a:
            want_a2a[k[1]] += v
    want_bytes = len(per_rank) * sum(k[2] * v for k, v in planned.items() if k[0] == a2a)
    got_bytes = 0
    for items in per_rank:
        got = Counter(dict((tuple(k), v) for k, v in items))
        assert Counter({k: v for k, v in got.items() if k[0] != a2a}) == want_rest, (sorted(got), sorted(planned))
        got_a2a: Counter = Counter()
        for k, v in got.items():
            if k[0] == a2a:
                got_a2a[k[1]] += v
                got_bytes += k[2] * v
        assert got_a2a == want_a2a, (got_a2a, want_a2a)
    assert got_bytes == want_bytes, (got_bytes, want_bytes)


@pytest.mark.dist
@pytest.mark.slow
# 8 ranks (EP x DP on (2, 4): 145 CPU s on a 2-core AMD EPYC) in the full matrix only (tests/tiers.py)
@pytest.mark.parametrize("world", params(sorted(MESHES), default=[4]))
def test_mixtral_equals_single_device(plans, world):
    keys = [k for k in plans if k[0] != "tiny" and k[1][0] * k[1][1] == world]
    if world == 8:  # the suite's time: on 8 ranks EP x DP on (2, 4) only; pure EP and forced DP (whose replicated
        # backward hands its gradients to getitems that take them dim-0 sharded, a resharding at the getitem the
        # runtime once skipped) run on 4 ranks, on (4, 1); (8, 1)'s solver plan is checked in one process above
        keys = [k for k in keys if k == ("solver", (2, 4))]
    from meshpilot.graph.capture import capture

    jobs = [(f"job{i}", plans[k].to_json()) for i, k in enumerate(keys)]
    per_rank = run_distributed(_worker, world, jobs, capture(*build(BIG)), timeout=900)
    for i, key in enumerate(keys):
        job = f"job{i}"
        for r in per_rank:
            assert max(r[job]["loss"]) <= TOL, (key, r[job]["loss"])
            assert max(r[job]["grad"]) <= TOL, (key, r[job]["grad"])
            assert not r[job]["mismatches"], (key, r[job]["mismatches"][:3])
        planned = plans[key].collective_counts(backend="gloo")
        for step in range(STEPS):
            _check_counts([r[job]["counts"][step] for r in per_rank], planned)


LAZY_CHECK = """
import sys, torch
from meshpilot.models.zoo import PlanBenchTransformer
from meshpilot.planner.auto import plan
from meshpilot import ops
with torch.device("meta"):
    model = PlanBenchTransformer(2, 64, 4)
p = plan(model, (torch.empty(8, 16, 64, device="meta"),), "dgx-h100:8", mesh_shape=(4, 2), mappings=("row",))
print("planned without it:", "meshpilot.ops.moe" not in sys.modules)
print("in flight before:", sorted(ops.in_flight_targets()))
op = ops.own_op("meshpilot.moe_experts.default")  # a saved plan's target, read before the module is loaded
from meshpilot.ops import moe
print("found:", op is moe.OPS[0], ops.leading_collectives(moe.BACKWARD) == moe.LEADING)
print("in flight after:", set(moe.IN_FLIGHT) <= ops.in_flight_targets())
"""


def test_the_experts_module_is_loaded_only_where_its_ops_can_be():
    """Planning a model without experts defines none of the experts' custom ops (25–50 ms of CPU, issue 33 item
    4: ``ops._SELF_DEFINED``); a ``meshpilot.`` target the registry lacks (a saved plan's, read in a fresh
    process) loads the module and finds its op, and the in-flight kernels follow the registry."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-c", LAZY_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert "planned without it: True" in lines
    assert "in flight before: []" in lines
    assert "found: True True" in lines
    assert "in flight after: True" in lines
