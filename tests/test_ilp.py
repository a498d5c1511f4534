"""Alpa's ILP: optimality on small graphs, the memory row, PlanError, layer tying, Plan JSON round trip."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from test_graph_capture import Tiny
from torch import nn

from meshpilot.graph.capture import capture
from meshpilot.planner.auto import plan
from meshpilot.planner.ilp import PlanError, build_problem, solve
from meshpilot.planner.plan import Plan


class Wide(nn.Module):
    """Big enough that sharding beats replication on a real cluster."""

    def __init__(self, h: int = 4096) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        return self.down(F.relu(self.up(x))).float().pow(2).mean()


def meta_wide(h=4096, tokens=8192):
    with torch.device("meta"):
        m = Wide(h)
    return m, (torch.empty(tokens, h, device="meta"),)


def test_large_mlp_is_sharded_and_solved_to_optimality():
    m, x = meta_wide()
    p = plan(m, x, "atp-ic3", mesh_shape=(2, 4))
    assert p.solver.gap <= 1e-3
    assert "Optimal" in p.solver.status
    mm = [n for n in p.nodes if n.target == "aten.mm.default" and n.phase == "fwd"]
    # no replicated matmul: every device does a share of the work
    assert all(any(o != "R" for o in n.outs[0]) for n in mm)
    assert p.time.compute_s > 0 and p.time.total_s >= p.time.compute_s
    assert p.memory.total < p.memory.capacity


def test_memory_row_forces_sharding_and_plan_error_names_need_and_capacity():
    import dataclasses

    from meshpilot.cluster import load_cluster

    m, x = meta_wide()
    # a device whose memory-bound work (the optimizer's update among it) is free: with the update priced, the
    # unconstrained optimum already stores the weights sharded (``test_planner_search``), leaving no room below
    ic3 = load_cluster("atp-ic3")
    cl = dataclasses.replace(ic3, device=dataclasses.replace(ic3.device, memory_bandwidth=1e30))
    free = plan(m, x, cl, mesh_shape=(2, 4))
    need = free.memory.total
    # a capacity below what the unconstrained optimum's peak needs still has a (more sharded) plan ...
    tight = plan(m, x, cl, mesh_shape=(2, 4), memory_bytes=0.75 * need)
    assert tight.memory.total <= 0.75 * need * 1.0001
    # ... and one below the smallest possible need fails with one clear line
    with pytest.raises(PlanError) as e:
        plan(m, x, cl, mesh_shape=(2, 4), memory_bytes=1e6)
    msg = str(e.value)
    assert "smallest" in msg and "977 KiB" in msg and "\n" not in msg  # sizes print in a readable unit
    # the same facts as fields (the CLI's candidate table reads these, never the text)
    assert e.value.mesh_shape == (2, 4) and e.value.capacity_bytes == 1e6 and e.value.need_bytes > 1e6


def test_repeated_layers_are_decided_once():
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    cl = load_cluster("atp-ic3")
    g = capture(Tiny(layers=6), (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8))))
    dm = fake_device_mesh((2, 2))
    cm = CostModel(LogicalMesh(cl, (2, 2)))
    builder = StrategyBuilder(g, dm)
    prob = build_problem(g, builder, Resharder(dm, cm), cm)
    sol = solve(prob)
    # tied nodes got the same strategy in every layer
    for k, v in g.canonical.items():
        if k != v and prob.node_group[k] == prob.node_group[v]:
            assert prob.strategies[k][sol.choice[k]] == prob.strategies[v][sol.choice[v]]
    tied = len(prob.groups)
    g.canonical = {n.name: n.name for n in g.nodes}
    untied = len(build_problem(g, builder, Resharder(dm, cm), cm).groups)
    assert tied < 0.5 * untied, (tied, untied)


def test_plan_json_round_trip_and_printable_strategies(tmp_path):
    m, x = meta_wide(h=1024, tokens=2048)
    p = plan(m, x, "atp-ic1", num_devices=4)
    path = tmp_path / "plan.json"
    p.save(path)
    q = Plan.load(path).only  # saved as the one-stage Plan of it
    assert q == p
    assert q.to_dict() == p.to_dict()
    line = next(s for s in p.strategy_lines() if s.startswith("mm:"))
    assert " → " in line and ("×" in line)
    assert {c.shape for c in p.solver.candidates} == {(4, 1), (2, 2), (1, 4)}
    from dataclasses import FrozenInstanceError

    with pytest.raises(FrozenInstanceError):
        p.mesh_shape = (1, 4)  # type: ignore[misc]


def test_plan_names_mesh_axes_by_cluster_layer_and_old_plans_get_positional_names(tmp_path):
    import json
    from collections import Counter

    m, x = meta_wide(h=1024, tokens=2048)
    p = plan(m, x, "atp-ic1", mesh_shape=(2, 4), mappings=("row",))  # 2 sockets of 4 GPUs
    assert p.mesh_axes == ("socket", "gpu")  # axis 0 crosses the sockets, axis 1 stays inside one
    path = tmp_path / "plan.json"
    p.save(path)
    assert json.loads(path.read_text())["stages"][0]["plan"]["mesh_axes"] == ["socket", "gpu"]
    assert Plan.load(path).only == p
    # every collective is counted and printed under its axis' name
    counts = p.collective_counts()
    by_name = Counter()
    for (_, axis, _), n in counts.items():
        by_name[axis] += n
    assert by_name and by_name == Counter(("socket", "gpu")[c.axis] for c in p.collectives)
    assert any(f"@{p.axis_name(c.axis)} " in str(p) for c in p.collectives)
    # a plan saved before axes had names loads with positional ones
    old = p.to_dict()
    del old["mesh_axes"]
    q = Plan.from_dict(old).only  # a one-stage file of version 1
    assert q.mesh_axes == ("axis0", "axis1")
    assert {axis for _, axis, _ in q.collective_counts()} <= {"axis0", "axis1"}


def test_cluster_matrix_changes_the_plan():
    m, x = meta_wide(h=2048, tokens=4096)
    a = plan(m, x, "atp-ic1", mesh_shape=(2, 4))
    b = plan(m, x, "atp-ic3", mesh_shape=(2, 4))
    assert a.time.total_s > b.time.total_s
    assert a.time.communication_s + a.time.resharding_s > b.time.communication_s + b.time.resharding_s


def _bench_graph(layers=2, h=256, heads=4, batch=4, seq=64):
    from meshpilot.models.zoo import PlanBenchTransformer

    with torch.device("meta"):
        m = PlanBenchTransformer(layers, h, heads)
    return capture(m, (torch.empty(batch, seq, h, device="meta"),))


def test_structure_priced_per_mapping_is_a_fresh_build():
    """The structure is built once per shape (row mapping's cost model) and priced for the col mapping:
    the ILP is the one a full build on the col mapping gives."""
    import numpy as np

    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mapped_ranks
    from meshpilot.planner.ilp import Pricer, build_structure, price
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    g = _bench_graph()
    cl = load_cluster("dgx-h100:2")
    shape = (4, 4)
    dm = fake_device_mesh(shape)
    row = CostModel(LogicalMesh(cl, shape, mapped_ranks(shape, "row")))
    col = CostModel(LogicalMesh(cl, shape, mapped_ranks(shape, "col")))
    struct = build_structure(g, StrategyBuilder(g, dm), Resharder(dm, row), row)
    priced = price(struct, Pricer(struct.table, Resharder(dm, col)))
    fresh = build_problem(g, StrategyBuilder(g, dm), Resharder(dm, col), col)
    assert len(priced.groups) == len(fresh.groups)
    for a, b in zip(priced.groups, fresh.groups):
        assert np.allclose(a.cost, b.cost, rtol=1e-12, atol=0) and np.array_equal(a.mem, b.mem)
    assert priced.edges.keys() == fresh.edges.keys()
    for k, e in priced.edges.items():
        assert np.allclose(e.cost, fresh.edges[k].cost, rtol=1e-12, atol=0)
    s1, s2 = solve(priced), solve(fresh)
    assert s1.objective == pytest.approx(s2.objective, rel=1e-12)
    # the two mappings do price differently on a hierarchical cluster
    assert solve(price(struct, Pricer(struct.table, Resharder(dm, row)))).objective != pytest.approx(s1.objective)


def test_compute_lower_bound_is_below_every_plan_of_the_shape():
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mesh_shapes_2d
    from meshpilot.planner.auto import compute_lower_bound
    from meshpilot.planner.ilp import build_structure
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    g = _bench_graph()
    cl = load_cluster("dgx-h100:2")
    for shape in mesh_shapes_2d(16):
        dm = fake_device_mesh(shape)
        cm = CostModel(LogicalMesh(cl, shape))
        lb = compute_lower_bound(build_structure(g, StrategyBuilder(g, dm), Resharder(dm, cm), cm))
        for mapping in ("row", "col") if min(shape) > 1 else ("row",):
            p = plan(None, (), cl, mesh_shape=shape, mappings=(mapping,), graph=g)
            assert 0 < lb <= p.time.compute_s * (1 + 1e-12), (shape, mapping, lb, p.time)


def test_a_problem_solved_again_under_another_capacity_is_a_fresh_solve():
    """``ilp.priced`` keeps a mapping's problem on its structure and ``solve`` keeps its matrices per memory row
    kind: a second solve of the kept problem under a tighter capacity (and the ZeRO rows) picks what a freshly
    priced problem under that capacity picks, and the capacity binds (the choice differs from the roomy one)."""
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.planner.auto import min_memory
    from meshpilot.planner.ilp import Pricer, build_structure, price, priced
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    g = _bench_graph()
    shape = (2, 4)
    dm = fake_device_mesh(shape)
    cm = CostModel(LogicalMesh(load_cluster("dgx-h100:2"), shape))
    struct = build_structure(g, StrategyBuilder(g, dm), Resharder(dm, cm), cm)
    rs = Resharder(dm, cm)
    roomy = solve(priced(struct, rs, 1e12), memory="zero")
    tight_cap = 1.05 * min_memory(struct, "zero")
    kept = priced(struct, rs, tight_cap)
    assert kept is priced(struct, rs) and len(kept.lp) >= 1
    again = solve(kept, memory="zero", capacity=tight_cap)
    fresh = solve(price(struct, Pricer(struct.table, rs)), memory="zero", capacity=tight_cap)
    assert again.choice == fresh.choice and again.objective == fresh.objective
    assert again.choice != roomy.choice and again.num_constraints == fresh.num_constraints


def test_a_capacity_is_answered_by_what_the_problem_already_solved(monkeypatch):
    """``solve`` keeps each problem's answers: the plan without memory rows (once per problem) answers every
    capacity its rows fit, a capped plan answers a smaller capacity its rows still fit, and HiGHS runs only
    for the rest. Each answer is what a fresh problem under that capacity gets, within the MIP gap."""
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.planner import ilp
    from meshpilot.planner.auto import min_memory
    from meshpilot.planner.ilp import Pricer, build_structure, price, priced
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    g = _bench_graph()
    dm = fake_device_mesh((2, 4))
    cm = CostModel(LogicalMesh(load_cluster("dgx-h100:2"), (2, 4)))
    struct = build_structure(g, StrategyBuilder(g, dm), Resharder(dm, cm), cm)
    rs = Resharder(dm, cm)
    runs = []
    real = ilp._milp
    monkeypatch.setattr(ilp, "_milp", lambda prob, memory, cap, *a: runs.append(cap) or real(prob, memory, cap, *a))
    kept = priced(struct, rs)
    free = solve(kept, memory="zero", capacity=1e15)  # rows far from binding: the row-free plan, one solve
    assert runs == [math.inf]
    tight = 1.05 * min_memory(struct, "zero")
    assert free.memory_zero > tight  # the capacity below binds
    caps = [free.memory_zero, tight, tight * (1 - 1e-9)]
    answers = [solve(kept, memory="zero", capacity=cap) for cap in caps]
    caps.append(answers[1].memory_zero)  # the capped plan's own rows: it still fits
    answers.append(solve(kept, memory="zero", capacity=caps[-1]))
    # one HiGHS run with the rows (the tight cap); the others reused: a fitting plan of an equal or larger cap
    assert runs == [math.inf, tight], runs
    for cap, got in zip(caps, answers, strict=True):
        fresh = solve(price(struct, Pricer(struct.table, rs)), memory="zero", capacity=cap)
        assert got.memory_zero <= cap and got.row == "zero"
        assert abs(got.objective - fresh.objective) <= 2e-3 * fresh.objective
    assert answers[0].choice == free.choice and answers[1].choice != free.choice


def test_a_zero_rows_answer_whose_plain_rows_fit_answers_the_plain_rows(monkeypatch):
    """The ZeRO rows of every choice are at most its plain rows, so a plan solved on the ZeRO rows under a capacity
    whose plain rows fit it too is the plain problem's optimum there (within the gap): ``solve`` answers the plain
    rows from it without a HiGHS run, and the answer is what a fresh problem on the plain rows gets. One whose plain
    rows do not fit answers nothing on them."""
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.planner import ilp
    from meshpilot.planner.auto import min_memory
    from meshpilot.planner.ilp import Pricer, build_structure, price, priced
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    g = _bench_graph()
    runs = []
    real = ilp._milp
    monkeypatch.setattr(ilp, "_milp", lambda prob, memory, cap, *a: runs.append(memory) or real(prob, memory, cap, *a))
    for shape, reused in (((8, 1), True), ((2, 4), False)):
        dm = fake_device_mesh(shape)
        cm = CostModel(LogicalMesh(load_cluster("dgx-h100:2"), shape))
        struct = build_structure(g, StrategyBuilder(g, dm), Resharder(dm, cm), cm)
        rs = Resharder(dm, cm)
        kept = priced(struct, rs)
        cap = 1.05 * min_memory(struct, "zero")  # binds both row kinds on both meshes
        assert solve(kept, memory="plain").memory_zero > cap
        zero = solve(kept, memory="zero", capacity=cap)
        # on (8, 1) the ZeRO answer shards every weight already (its plain rows fit); on (2, 4) it does not
        assert (zero.memory <= cap) is reused, (shape, zero.memory, cap)
        runs.clear()
        try:
            plain = solve(kept, memory="plain", capacity=cap)
        except PlanError:
            plain = None
        assert runs == ([] if reused else ["plain"]), (shape, runs)
        if reused:
            assert plain.choice == zero.choice and plain.row == "plain" and plain.memory <= cap
            fresh = solve(price(struct, Pricer(struct.table, rs)), memory="plain", capacity=cap)
            assert abs(plain.objective - fresh.objective) <= 2e-3 * fresh.objective


def test_a_capacity_highs_finds_no_plan_under_is_one_line_and_answers_smaller_ones(monkeypatch):
    """A capped solve HiGHS proves infeasible (stood in for by its answer: the real one needs a capacity between
    the memory floor and the true least need) is a PlanError naming the capacity and HiGHS' words; a smaller
    capacity is answered by it without another run, and one HiGHS ran out of time on is not."""
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.planner import ilp
    from meshpilot.planner.auto import min_memory
    from meshpilot.planner.ilp import build_structure, priced
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    g = _bench_graph()
    dm = fake_device_mesh((2, 4))
    cm = CostModel(LogicalMesh(load_cluster("dgx-h100:2"), (2, 4)))
    struct = build_structure(g, StrategyBuilder(g, dm), Resharder(dm, cm), cm)
    kept = priced(struct, Resharder(dm, cm))
    tight = 1.05 * min_memory(struct, "zero")
    runs = []
    real = ilp._milp

    def milp(prob, memory, cap, *a):
        runs.append(cap)
        if math.isinf(cap):
            return real(prob, memory, cap, *a)
        return ilp._NoPlan("The problem is infeasible.", infeasible=cap < 1.02 * tight)

    monkeypatch.setattr(ilp, "_milp", milp)
    for cap in (tight, 0.99 * tight):
        with pytest.raises(PlanError, match=r"no sharding plan fits in .* \(HiGHS: The problem is infeasible\.\)"):
            solve(kept, memory="zero", capacity=cap)
    assert runs == [math.inf, tight]  # the smaller capacity: answered by the proven one
    runs.clear()
    for cap in (1.03 * tight, 1.029 * tight):  # not proven (a time limit, say): each capacity is solved
        with pytest.raises(PlanError):
            solve(kept, memory="zero", capacity=cap)
    assert runs == [1.03 * tight, 1.029 * tight]


def test_highs_debug_print_is_kept_off_stdout(capfd):
    """scipy's HiGHS prints a debug line to the C stdout on some MIPs (one of the GPT-39B plan's), which
    ``meshpilot plan --json > plan.json`` would carry into the JSON; around a solve, `highs_stdout_filtered`
    drops it and passes on, in order, everything else written to the descriptor (fails without the filter)."""
    import ctypes

    from meshpilot.planner.ilp import highs_stdout_filtered

    libc = ctypes.CDLL(None)
    print("before", flush=True)
    with highs_stdout_filtered():
        libc.printf(b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        libc.printf(b"another line of the solver\n")
        os.write(1, b"written to the descriptor\n")
    print("after", flush=True)
    out = capfd.readouterr().out
    assert "HighsMipSolverData" not in out
    assert out.splitlines() == ["before", "another line of the solver", "written to the descriptor", "after"]


def test_reshard_table_by_ids_is_the_resharders_collectives():
    """The table's entries (steps keyed by interned layout ids) are exactly ``Resharder.collectives`` of every
    layout pair, on tensors of 1-3 dims, on a 2D and a 3D mesh."""
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster, mapped_ranks
    from meshpilot.graph.capture import TensorInfo
    from meshpilot.planner.ilp import ReshardTable
    from meshpilot.sharding.placements import by_id, candidate_placements, pid
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import fake_device_mesh

    cl = load_cluster("dgx-h100:2")
    for shape in [(2, 4), (2, 2, 2)]:
        dm = fake_device_mesh(shape)
        rs = Resharder(dm, CostModel(LogicalMesh(cl, shape, mapped_ranks(shape, "row"))))
        table = ReshardTable(rs)
        for info in [TensorInfo((16,), "float32"), TensorInfo((8, 24), "bfloat16"), TensorInfo((4, 8, 12), "float32")]:
            ids = tuple(pid(p) for p in candidate_placements(info.shape, shape))
            P, Q = ids + (-1,), ids[::-1]
            n_p, n_q, ent, cid = table.spec(P, Q, info)
            got: dict[int, list] = {}
            for e, c in zip(ent.tolist(), cid.tolist()):
                got.setdefault(e, []).append(table.colls[c])
            want = {}
            for a, p in enumerate(P):
                for b, q in enumerate(Q):
                    if p >= 0 and q >= 0 and p != q:
                        colls = list(rs.collectives(by_id(p), by_id(q), info))
                        if colls:
                            want[a * n_q + b] = colls
            assert (n_p, n_q) == (len(P), len(Q)) and got == want and want


def _scipy_milp(c, A, lb, ub, integrality, time_limit, node_limit, mip_rel_gap):
    """The solve as ``ilp._milp`` made it before ``planner.highs``: ``scipy.optimize.milp``."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csc_array

    A = csc_array((A.data, A.indices, A.indptr), shape=A.shape)
    return milp(
        c,
        constraints=LinearConstraint(A, lb, ub),
        integrality=integrality,
        bounds=Bounds(0, 1),
        options={"time_limit": time_limit, "node_limit": node_limit, "mip_rel_gap": mip_rel_gap, "presolve": True},
    )


@pytest.mark.parametrize("memory", ["plain", "zero"])
def test_highspy_solve_is_scipy_milps(memory):
    """``planner.highs.solve_milp`` (``highspy``) returns what ``scipy.optimize.milp`` returns on the same ILPs
    — the same solution vector bit for bit, message and gap, or no solution with the same status — on the bench
    graph's problem on two meshes, without and with a memory capacity that binds (a capped solve: branch and
    bound), and under a capacity that has no plan."""
    import numpy as np

    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.planner import ilp
    from meshpilot.planner.auto import min_memory
    from meshpilot.planner.highs import solve_milp
    from meshpilot.sharding.reshard import UNSUPPORTED_S, Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    g = _bench_graph()
    compared = 0
    for shape in ((2, 4), (1, 8)):  # (4, 4)'s capped solves are equal too, but take 10-20 s each
        dm = fake_device_mesh(shape)
        cm = CostModel(LogicalMesh(load_cluster("dgx-h100:2"), shape))
        struct = ilp.build_structure(g, StrategyBuilder(g, dm), Resharder(dm, cm), cm)
        prob = ilp.priced(struct, Resharder(dm, cm))
        need = min_memory(struct, memory)
        for cap in (math.inf, 1.05 * need, 0.5 * need):
            c, A, lb, ub, _, n_s, n_vars, r, *_ = ilp._lp(prob, memory, math.isfinite(cap))
            ub = ub.copy()
            if math.isfinite(cap):
                ub[r - len(ilp.MEMORY_ROWS) :] = cap
            integrality = np.zeros(n_vars)
            integrality[:n_s] = 1
            c = c / np.abs(c[c < UNSUPPORTED_S]).max()
            args = (c, A, lb, ub, integrality)
            limits = {"time_limit": 300.0, "node_limit": ilp.NODE_LIMIT, "mip_rel_gap": 1e-3}
            ours, ref = solve_milp(*args, **limits), _scipy_milp(*args, **limits)
            if ref.x is None:  # scipy's message goes on with the primal status (None): the status itself is equal
                assert ours.x is None and ours.infeasible == (ref.status == 2)
                assert ours.message.partition(":")[0] == ref.message.partition(":")[0]
                continue
            assert ours.message == ref.message, (shape, cap)
            assert np.array_equal(ours.x, ref.x), (shape, cap)
            assert ours.mip_gap == ref.mip_gap
            compared += 1
    assert compared == 4  # the roomy and the binding capacity on each mesh solved, not only refused


def test_csc_from_entries_is_scipys_coo_to_csc(monkeypatch):
    """``highs.Csc.from_entries`` is ``scipy.sparse.coo_matrix(…).tocsc()``: the same column pointers, row
    indices and values, entries at one place summed, explicit zeros kept — on random entries with repeats
    and on the bench graph's ILP with its memory rows."""
    import numpy as np
    from scipy.sparse import coo_matrix

    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.planner import ilp
    from meshpilot.planner.highs import Csc
    from meshpilot.sharding.reshard import Resharder
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    def same(rows, cols, vals, shape):
        ours = Csc.from_entries(rows, cols, vals, shape)
        ref = coo_matrix((vals, (rows, cols)), shape=shape).tocsc()
        assert np.array_equal(ours.indptr, ref.indptr) and np.array_equal(ours.indices, ref.indices)
        assert np.array_equal(ours.data, ref.data) and ours.shape == ref.shape

    rng = np.random.default_rng(0)
    for n in (0, 1, 50, 2000):
        rows, cols = rng.integers(0, 30, n), rng.integers(0, 40, n)  # many repeats at n = 2000
        vals = rng.choice([0.0, 1.0, -2.5, 3.25], n)
        same(rows, cols, vals, (30, 40))
    shape = (2, 4)
    g = _bench_graph()
    dm = fake_device_mesh(shape)
    cm = CostModel(LogicalMesh(load_cluster("dgx-h100:2"), shape))
    prob = ilp.build_problem(g, StrategyBuilder(g, dm), Resharder(dm, cm), cm)
    entries = []
    real = Csc.from_entries.__func__
    monkeypatch.setattr(Csc, "from_entries", classmethod(lambda cls, *a: entries.append(a) or real(cls, *a)))
    A = ilp._lp(prob, "plain", True)[1]
    ((rows, cols, vals, shape),) = entries  # what _lp handed to the matrix: the same matrix as scipy's from it
    same(rows, cols, vals, shape)
    assert A.indices.size > A.shape[1] > 10_000


def test_the_loss_getitem_reads_its_operands_layout_as_it_is_on_a_cost_tie():
    """The loss' ``getitem`` merged into its operand (``_merge_map_ids`` with ``as_is``) that can read the
    operand's replica as it is or take a free ``R -> P`` / ``R -> S(0)`` step at the same cost keeps the
    replica: after a replicated data-parallel loss a partial sum would be all-reduced again at the loss edge
    (``test_vocab_parallel_ce``'s data-parallel plan checks the plan has no such collective). Where reading it
    otherwise is cheaper, that strategy is kept; other merged nodes keep the first cheapest, as before."""
    import numpy as np
    from torch.distributed.tensor import Partial, Replicate, Shard

    from meshpilot.planner.ilp import _merge_map_ids
    from meshpilot.sharding.placements import pid

    class Free:
        def matrix(self, P, Q, info, gradient=False):
            return np.zeros((len(P), len(Q)))

    R, P, S = (Replicate(),), (Partial(),), (Shard(0),)
    src = np.array([pid(R), pid(S)])
    ins = np.array([pid(P), pid(S), pid(R)])
    got = _merge_map_ids(np.zeros(3), src, ins, object(), Free(), as_is=True)
    assert got.tolist() == [2, 1]  # R read as R (not the first free choice, P); S as S
    cheaper = np.array([0.0, 0.0, 1.0])  # reading it as R costs more: the cheapest first
    assert _merge_map_ids(cheaper, src, ins, object(), Free(), as_is=True).tolist() == [0, 1]
    assert _merge_map_ids(np.zeros(3), src, ins, object(), Free()).tolist() == [0, 0]


def test_a_model_solved_to_the_end_is_answered_again_without_a_second_solve(monkeypatch):
    """``highs.solve_milp`` remembers a model solved to the end: the same model again (new arrays, same
    values) is answered without calling HiGHS, with the same solution; a changed bound is solved anew; an
    infeasible model is remembered as infeasible; an answer a limit stopped is not remembered."""
    import numpy as np

    from meshpilot.planner import highs

    monkeypatch.setattr(highs, "_ANSWERS", highs.OrderedDict())
    calls = []
    real = highs._solve
    monkeypatch.setattr(highs, "_solve", lambda *a: calls.append(a) or real(*a))

    def model(bound: float, limit: int = 10_000):
        # min -x0 - 2 x1 - 3 x2 over x0 + x1 + x2 <= bound, x binary: a knapsack with one row
        A = highs.Csc.from_entries(np.array([0, 0, 0]), np.array([0, 1, 2]), np.ones(3), (1, 3))
        args = (np.array([-1.0, -2.0, -3.0]), A, np.array([-np.inf]), np.array([bound]), np.ones(3))
        return highs.solve_milp(*args, time_limit=60.0, node_limit=limit, mip_rel_gap=0.0)

    first = model(2.0)
    again = model(2.0)
    assert len(calls) == 1 and np.array_equal(first.x, again.x) and list(again.x) == [0.0, 1.0, 1.0]
    assert again.message == first.message and first.final
    again.x[:] = 7.0  # a caller's copy: the remembered answer is not changed through it
    assert list(model(2.0).x) == [0.0, 1.0, 1.0] and len(calls) == 1
    assert list(model(1.0).x) == [0.0, 0.0, 1.0] and len(calls) == 2
    infeasible = model(-1.0)
    assert infeasible.x is None and infeasible.infeasible and model(-1.0).infeasible and len(calls) == 3
    stopped = highs.MilpAnswer(np.zeros(3), "Time limit reached. ", 0.5, False, final=False)
    monkeypatch.setattr(highs, "_solve", lambda *a: calls.append(a) or stopped)
    model(3.0), model(3.0)
    assert len(calls) == 5  # not remembered: solved both times


def test_a_relaxed_solve_is_a_plan_within_the_gap_it_reports():
    """``ilp._relaxed_then_fixed`` (``solve(relaxed=)``, the estimated stage table's pricing) on multiple-choice
    knapsacks — one selection per group, a memory row: with the row roomy the relaxation is integral and its answer
    is the ILP's, gap 0; held tight, the relaxation is fractional and the answer is still one selection per group
    under the row, no better than the ILP's optimum and within the gap it reports of it."""
    import numpy as np

    from meshpilot.planner import ilp
    from meshpilot.planner.highs import Csc, solve_milp

    rng = np.random.default_rng(0)
    groups, options = 12, 4
    n = groups * options
    limits = {"time_limit": 60.0, "node_limit": ilp.NODE_LIMIT, "mip_rel_gap": 0.0}
    fractional = 0
    for trial in range(6):
        t = rng.uniform(1, 10, (groups, options))
        mem = 11 - t + rng.uniform(0, 2, (groups, options))  # the faster, the heavier
        rows = np.concatenate([np.repeat(np.arange(groups), options), np.full(n, groups)])
        cols = np.concatenate([np.arange(n), np.arange(n)])
        vals = np.concatenate([np.ones(n), mem.ravel()])
        A = Csc.from_entries(rows, cols, vals, (groups + 1, n))
        least, most = mem.min(axis=1).sum(), mem.max(axis=1).sum()
        cap = most + 1 if trial == 0 else least + (most - least) * rng.uniform(0.2, 0.6)
        lb = np.concatenate([np.ones(groups), [-np.inf]])
        ub = np.concatenate([np.ones(groups), [cap]])
        c, integrality = t.ravel() / t.max(), np.ones(n)
        exact = solve_milp(c, A, lb, ub, integrality, **limits)
        ours = ilp._relaxed_then_fixed(c, A, lb, ub, integrality, limits)
        x = np.round(ours.x).reshape(groups, options)
        assert np.allclose(ours.x, x.ravel(), atol=1e-6) and (x.sum(axis=1) == 1).all()
        assert (mem * x).sum() <= cap * (1 + 1e-9)
        z, z_opt = float(c @ ours.x), float(c @ exact.x)
        if trial == 0:  # nothing binds: the relaxation is integral, the answer the ILP's
            assert ours.mip_gap == 0.0 and np.isclose(z, z_opt)
            continue
        fractional += ours.mip_gap > 0
        assert z >= z_opt * (1 - 1e-9) and z * (1 - ours.mip_gap) <= z_opt * (1 + 1e-9), (trial, z, z_opt)
    assert fractional  # the fixed path was taken, not only integral relaxations
