"""The one mesh search (``planner.meshsearch``) that the single-stage planner and the stage planner share."""

import warnings

import numpy as np
import pytest

from meshpilot.cluster import CostModel, LogicalMesh, MeshMapping, load_cluster
from meshpilot.graph.capture import capture
from meshpilot.models import builtin_models
from meshpilot.planner.accounting import step_edges
from meshpilot.planner.auto import plan
from meshpilot.planner.ilp import build_structure
from meshpilot.planner.meshsearch import mappings_of, search_mesh
from meshpilot.planner.search import get_searcher
from meshpilot.planner.zero import ParamEdges, ZeroMode
from meshpilot.sharding.reshard import Resharder
from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh


@pytest.fixture(scope="module")
def mlp():
    model, inputs = builtin_models()["mlp"].build("meta", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(model, inputs)


def test_mappings_of_a_shape():
    """The column mapping only where two axes have devices; the row mapping always."""
    assert mappings_of((2, 2)) == [MeshMapping.ROW, MeshMapping.COL]
    assert mappings_of((4, 1)) == mappings_of((1, 4)) == [MeshMapping.ROW]
    assert mappings_of((2, 2), [MeshMapping.COL]) == [MeshMapping.COL]
    assert mappings_of((4, 1), [MeshMapping.COL]) == [MeshMapping.ROW]


def test_search_mesh_keeps_the_fastest_mapping_and_is_what_auto_plan_picks(mlp):
    """On a 2x2 mesh of ``atp-ic3`` the search tries both mappings (each on its own physical ranks), reports both
    and keeps the faster, whose time is that of the plan ``auto.plan`` makes on that shape; mappings keyed alike
    are searched once."""
    cl = load_cluster("atp-ic3")
    shape = (2, 2)
    dmesh = fake_device_mesh(shape)
    cm0 = CostModel(LogicalMesh(cl, shape, np.arange(4).reshape(shape)))
    struct = build_structure(mlp, StrategyBuilder(mlp, dmesh), Resharder(dmesh, cm0), cm0)
    pe = ParamEdges.of(mlp, step_edges(mlp))
    made = []

    def resharder(mapping, physical):
        made.append((mapping, physical.tolist()))
        return Resharder(dmesh, CostModel(LogicalMesh(cl, shape, physical)))

    kw = dict(capacity=cl.device.memory_bytes, zero=ZeroMode.AUTO, microbatches=1, time_limit=30.0)
    found = search_mesh(mlp, struct, pe, get_searcher("ilp"), range(4), mappings_of(shape), resharder, **kw)
    assert [t.mapping for t in found.tries] == [MeshMapping.ROW, MeshMapping.COL] and not found.errors
    assert made[0][1] != made[1][1]  # each mapping its own physical ranks
    times = [t.candidate.time_s for t in found.tries]
    assert found.best.candidate.time_s == min(times)
    p = plan(None, (), cl, graph=mlp, mesh_shape=shape)
    assert p.time.total_s == pytest.approx(min(times), rel=1e-9)
    once = search_mesh(mlp, struct, pe, get_searcher("ilp"), range(4), mappings_of(shape), resharder,
                       same=lambda m: "one problem", **kw)  # fmt: skip
    assert [t.mapping for t in once.tries] == [MeshMapping.ROW]
