"""A pipeline stage that recomputes its blocks (``StageCost.recompute``: the stage tables' recomputing candidates,
``planner.stack``) is planned so by ``Plan.with_intra`` and run so by the stage runtime
(``runtime.pipeline_stages``: ``recompute.for_plan`` on its slice). One 4-rank spawn: a 2-stage 1F1B pipeline
of a tiny GPT on 2 + 2 ranks, its first stage recomputing its blocks' selective regions and its second its
blocks whole, 3 AdamW steps beside the single device (loss and every gradient within 1e-5), every collective as
the plans say."""

from __future__ import annotations

import dataclasses
import functools

from dist_utils import run_distributed
from test_pipeline_runtime import (
    MICRO,
    _beside_single_device,
    _check_intra,
    _gpt_graph,
    _gpt_graphs,
    _tiny_gpt_graph,
    _tiny_gpt_run,
)

from meshpilot.planner.recompute import Recompute

STAGES = [((0, 4), (0, 1), (1, 2)), ((4, 8), (2, 3), (2, 1))]
"""(layers, ranks, logical mesh): embeddings and blocks 0-1 on a (1, 2) mesh, blocks 2-3 and the head on (2, 1)."""
NAME = "recomputed"


@functools.cache
def _plan_json() -> str:
    """STAGES as a saved plan, stage 0 marked as recomputing its blocks' selective regions and stage 1 its blocks
    whole (as the stage table marks a stage composed from a recomputing block) before their plans are made."""
    from meshpilot.planner.pipeline import fixed_pipeline

    _, _, graph = _tiny_gpt_graph()
    pp = fixed_pipeline(graph, "atp-ic3", STAGES, microbatches=4, schedule="1f1b")
    modes = (Recompute.SELECTIVE, Recompute.FULL)
    stages = tuple(
        dataclasses.replace(st, cost=dataclasses.replace(st.cost, recompute=m)) for st, m in zip(pp.stages, modes)
    )
    return dataclasses.replace(pp, stages=stages).with_intra(graph, "atp-ic3").to_json()


def _worker(text: str) -> dict:
    from meshpilot.planner.plan import Plan
    from meshpilot.planner.recompute import is_copy
    from meshpilot.runtime.pipeline import pipeline_parallelize

    graph = _gpt_graph(MICRO)  # the parent's, which the plan was made on
    batch, ref, model = _tiny_gpt_run()
    pm = pipeline_parallelize(model, batch, Plan.from_json(text), graph=graph)
    res = _beside_single_device(pm, ref, batch)
    res["copies"] = sum(is_copy(n.name) for n in pm.graph.nodes)
    return {NAME: res}


def test_a_recomputing_stage_equals_the_single_device():
    from meshpilot.planner.plan import Plan

    plan = Plan.from_json(_plan_json())
    rc = [st.plan.recompute for st in plan.stages]
    assert rc[0].regions == ("selective:blocks.0", "selective:blocks.1") and rc[1].regions == ("blocks.2", "blocks.3")
    for st in plan.stages:
        assert any(n.name.endswith("_recomputed") for n in st.plan.nodes)
    outs = run_distributed(_worker, 4, _plan_json(), timeout=900, graphs=_gpt_graphs(MICRO))
    _check_intra(outs, STAGES, NAME)
    copies = [out[NAME]["copies"] for out in outs]  # every rank runs its stage's copies; a whole block has more
    assert all(c > 0 for c in copies) and copies[0] == copies[1] < copies[2] == copies[3], copies
