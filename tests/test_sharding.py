"""Layouts on N-D meshes, DTensor-backed strategies, and resharding per mesh axis (Alpa Tables 1-3)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
from meshpilot.graph.capture import TensorInfo, capture
from meshpilot.sharding.placements import candidate_placements, fmt, from_json, to_json
from meshpilot.sharding.reshard import Collective, Resharder, via_replicate
from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

R = Replicate()


def resharder(shape=(2, 4), cluster="atp-ic3"):
    cl = load_cluster(cluster)
    return Resharder(fake_device_mesh(shape), CostModel(LogicalMesh(cl, shape)))


def test_table1_layouts_of_a_matrix_on_a_2d_mesh():
    layouts = {fmt(p) for p in candidate_placements((8, 8), (2, 2))}
    # Alpa Table 1: RR, S0R, S1R, RS0, RS1, S0S1, S1S0, S01R, RS01 (our S(0)S(0) is S01R)
    assert layouts == {"RR", "S(0)R", "S(1)R", "RS(0)", "RS(1)", "S(0)S(1)", "S(1)S(0)", "S(0)S(0)", "S(1)S(1)"}
    # uneven shards are never planned
    assert "S(0)R" not in {fmt(p) for p in candidate_placements((3, 8), (2, 2))}
    for p in candidate_placements((8, 8, 8), (2, 2)):
        assert from_json(to_json(p)) == p
    assert fmt((Partial(), Shard(1))) == "PS(1)"


def test_table2_resharding_collectives():
    rs = resharder((2, 4))
    info = TensorInfo((64, 64), "float32")
    m = info.nbytes
    S0, S1 = Shard(0), Shard(1)
    assert rs.collectives((R, R), (S0, S1), info) == ()  # 1: local slice
    assert rs.collectives((S0, R), (R, R), info) == (Collective("all_gather", 0, m),)  # 2
    assert rs.collectives((S0, S1), (S0, R), info) == (Collective("all_gather", 1, m // 2),)  # 3
    (a2a,) = rs.collectives((S0, R), (S1, R), info)  # 4: swap the sharded dim
    assert a2a.kind == "all_to_all" and a2a.axis == 0 and a2a.nbytes == m // 2
    assert rs.collectives((Partial(), R), (R, R), info) == (Collective("all_reduce", 0, m),)
    assert rs.collectives((R, Partial()), (R, S0), info) == (Collective("reduce_scatter", 1, m),)
    assert rs.cost((S0, R), (R, R), info) > 0 == rs.cost((R, R), (S0, S1), info)
    # one partial kind to another (P(avg) -> P(sum)), which DTensor's redistribute refuses ("Redistribution
    # from one partial type ... is unsupported"), goes through a replica: its all-reduce, then a free share
    src, dst = (Partial("avg"), R), (Partial("sum"), R)
    assert rs.collectives(src, dst, info) == (Collective("all_reduce", 0, m),)
    # shard -> partial, which DTensor has no step for either, goes through a replica (via_replicate): the
    # all-gather of that axis, then a free partial share (Gemma's tiny plan needed 32 such steps)
    assert rs.collectives((S0, R), (Partial(), R), info) == (Collective("all_gather", 0, m),)
    assert rs.collectives((S0, S1), (S0, Partial()), info) == (Collective("all_gather", 1, m // 2),)
    assert rs.cost((S0, R), (Partial(), R), info) == rs.cost((S0, R), (R, R), info)
    assert rs.collectives((Partial("avg"), R), (Partial("avg"), R), info) == ()


def test_reshard_costs_follow_the_clusters_matrix():
    info = TensorInfo((4096, 4096), "float32")
    pcie = resharder((2, 4), "atp-ic1").cost((Partial(), R), (R, R), info)
    nvswitch = resharder((2, 4), "atp-ic3").cost((Partial(), R), (R, R), info)
    assert pcie > 2 * nvswitch


def test_matmul_strategies_are_alpas_table3():
    import torch.nn as nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 32))

        def forward(self, x):
            return (x @ self.w).sum()

    g = capture(M(), (torch.randn(16, 32),))
    sb = StrategyBuilder(g, fake_device_mesh((2, 2)))
    strats = {}
    for n in g.nodes:
        strats[n.name] = sb.for_node(n, [StrategyBuilder.out_candidates(strats[s], i) for s, i in n.inputs])
    mm = next(n for n in g.nodes if n.target == "aten.mm.default" and n.phase == "fwd")
    forms = {s.short() for s in strats[mm.name]}
    assert "S(0)R × RS(1) → S(0)S(1)" in forms  # i->0, j->1: no communication
    assert "S(0)S(1) × RS(0) → S(0)P" in forms  # i->0, k->1: partial sums on axis 1
    assert "RR × RR → RR" in forms
    assert all(s.source == "dtensor" for s in strats[mm.name])
    assert not sb.fallbacks


def test_op_without_strategy_falls_back_to_replicated_with_a_warning():
    import torch.nn as nn

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            h = x @ self.w
            return torch.cdist(h, h).sum()  # DTensor has no strategy for _cdist_forward

    g = capture(M(), (torch.randn(4, 8),))
    sb = StrategyBuilder(g, fake_device_mesh((2, 2)))
    strats = {}
    for n in g.nodes:
        strats[n.name] = sb.for_node(n, [StrategyBuilder.out_candidates(strats[s], i) for s, i in n.inputs])
    cd = [n for n in g.nodes if "_cdist_forward" in n.target]
    assert cd and all(strats[n.name][0].source == "fallback" for n in cd)
    assert all(fmt(p) == "RR" for n in cd for p in strats[n.name][0].ins)
    assert {n.name for n in cd} <= set(sb.fallbacks)
    assert all("_cdist_forward" in sb.fallbacks[n.name] for n in cd)


def test_an_all_to_all_is_priced_as_dtensor_issues_it_on_a_cpu_mesh():
    """DTensor reshards S(i) -> S(j) on a gloo (CPU) mesh by an all-gather of every rank's shard and a local
    chunk: the planner prices that all-gather (n times the bytes each rank holds); on a GPU cluster the
    all-to-all itself. A collective an op issues itself (expert parallelism's all_to_all_single) stays an
    all-to-all on CPU too."""
    from meshpilot.cluster.devices import DEVICES
    from meshpilot.cluster.topology import Cluster

    info = TensorInfo((64, 64), "float32")
    swap = ((Shard(0), R), (Shard(1), R))
    gpu = load_cluster("atp-ic3")
    cpu = Cluster("same-links-on-cpu", gpu.layers, DEVICES["cpu"], gpu.calibration)
    on_gpu, on_cpu = (Resharder(fake_device_mesh((2, 4)), CostModel(LogicalMesh(c, (2, 4)))) for c in (gpu, cpu))
    (a2a,) = on_cpu.collectives(*swap, info)
    assert a2a == Collective("all_to_all", 0, info.nbytes // 2)
    assert on_gpu.cost(*swap, info) == on_gpu.cost_model.all_to_all(info.nbytes // 2, 0)
    assert on_cpu.cost(*swap, info) == on_cpu.cost_model.all_gather(2 * (info.nbytes // 2), 0)
    assert on_cpu.cost(*swap, info) != on_cpu.cost_model.all_to_all(info.nbytes // 2, 0)
    assert on_cpu.op_collective_cost(a2a) == on_cpu.cost_model.all_to_all(info.nbytes // 2, 0)


def test_gloo_reduce_scatter_costs_an_all_reduce():
    """ProcessGroupGloo has no reduce-scatter algorithm (it all-reduces and keeps its chunk): on a CPU device
    the cost model prices a reduce-scatter as the all-reduce of the same buffer; on a GPU as half of it."""
    from meshpilot.cluster.devices import DEVICES
    from meshpilot.cluster.topology import Cluster

    gpu = load_cluster("atp-ic3")
    cpu = Cluster("same-links-on-cpu", gpu.layers, DEVICES["cpu"], gpu.calibration)
    on_gpu, on_cpu = (CostModel(LogicalMesh(c, (2, 4))) for c in (gpu, cpu))
    m = 1 << 24
    assert on_cpu.reduce_scatter(m, 1) == on_cpu.all_reduce(m, 1)
    assert on_gpu.reduce_scatter(m, 1) == on_gpu.all_gather(m, 1) < on_gpu.all_reduce(m, 1)


def _shard_to_partial(x: torch.Tensor, src: str = "shard") -> tuple[torch.Tensor, list]:
    """On 2 gloo ranks: `x` sharded on dim 0 (`src` ``shard``) or as a partial average (``avg``: rank r holds
    ``x * (r + 0.5)``, whose average is ``x`` exactly), redistributed to a partial sum by the runtime; the
    sum of the ranks' partial shares and the collectives issued."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.interpret import redistribute

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("x",))
    if src == "avg":
        dt = DTensor.from_local(x * (dist.get_rank() + 0.5), mesh, [Partial("avg")], run_check=False)
    else:
        dt = distribute_tensor(x, mesh, [Shard(0)])
    with record_collectives(mesh) as log:
        out = redistribute(dt, (Partial(),))
    assert out.placements == (Partial(),)
    total = out.to_local().clone()
    dist.all_reduce(total)
    return total, [(str(e.kind), e.nbytes) for e in log]


def test_shard_to_partial_runs_through_a_replica_as_planned():
    """The runtime's ``redistribute`` takes S -> P as the planner prices it (one all-gather of the whole
    tensor), and the partial shares sum to the tensor exactly."""
    from dist_utils import run_distributed

    assert via_replicate((Shard(0), R), (Partial(), Shard(1))) == (R, Shard(1))
    assert via_replicate((Shard(0), R), (Shard(0), Partial())) is None  # R -> P: DTensor's own free step
    x = torch.arange(32.0).reshape(8, 4)
    planned = resharder((2,)).collectives((Shard(0),), (Partial(),), TensorInfo((8, 4), "float32"))
    for total, issued in run_distributed(_shard_to_partial, 2, x):
        assert torch.equal(total, x)
        assert issued == [(str(c.kind), c.nbytes) for c in planned] == [("all_gather", x.nbytes)]
    # P(avg) -> P(sum) the same way: the all-reduce of the averages, then a free share; exact
    assert via_replicate((Partial("avg"), R), (Partial(), R)) == (R, R)
    planned = resharder((2,)).collectives((Partial("avg"),), (Partial(),), TensorInfo((8, 4), "float32"))
    for total, issued in run_distributed(_shard_to_partial, 2, x, "avg"):
        assert torch.equal(total, x)
        assert issued == [(str(c.kind), c.nbytes) for c in planned] == [("all_reduce", x.nbytes)]
