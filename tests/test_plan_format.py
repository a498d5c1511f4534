"""The one plan type and its one JSON format (``meshpilot.planner.plan``, ``planner.plan_format``): files saved by
meshpilot before there was one (main at 4cbfa11: ``meshpilot plan --model gpt-tiny --cluster atp-ic3 --devices 4
--stages 1 --out`` and ``--cluster alpa-p3x8 --stages 2``) load, round-trip and simulate; anything else is refused
in one line; a pipeline's schedule prints short; ``validate`` checks a pipeline against the model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from meshpilot.errors import UserError
from meshpilot.planner.plan import Plan, StagePlan
from meshpilot.planner.plan_format import PLAN_FORMAT, PLAN_VERSION
from meshpilot.planner.validate import validate

DATA = Path(__file__).parent / "data"
ONE = DATA / "plan-main-4cbfa11-one-stage.json"
PIPE = DATA / "plan-main-4cbfa11-pipeline.json"


def test_an_old_one_stage_file_loads_as_a_one_stage_plan():
    p = Plan.load(ONE)
    raw = json.loads(ONE.read_text())
    assert p.is_single and p.schedule is None and p.transfers == ()
    assert p.only == StagePlan.from_dict(raw) and p.only.mesh_shape == (4, 1)
    assert p.num_devices == 4 and p.microbatches == 1 and p.step_s == p.only.time.total_s > 0
    again = json.loads(p.to_json())
    assert (again["format"], again["version"]) == (PLAN_FORMAT, PLAN_VERSION)
    assert Plan.from_dict(again) == p
    assert p.simulate().step_s == pytest.approx(p.only.time.total_s, rel=0.05)


def test_an_old_pipeline_file_loads_with_its_stage_plans_and_transfers():
    p = Plan.load(PIPE)
    assert not p.is_single and len(p.stages) == len(p.intra) == 2 and p.schedule.value == "1f1b"
    assert [st.ranks for st in p.stages] == [(0, 1), (2, 3)] and p.microbatches == 4
    assert {(x.src, x.dst) for x in p.transfers} == {(0, 1), (1, 0)} and all(x.nbytes > 0 for x in p.transfers)
    assert Plan.from_json(p.to_json()) == p
    assert p.simulate().step_s > p.simulate(p2p_bytes=0.0).step_s  # the transfers are priced
    with pytest.raises(UserError, match="pipeline of 2 stages, not one stage"):
        _ = p.only


def test_a_stage_plan_saves_as_the_one_format(tmp_path):
    sp = Plan.load(ONE).only
    sp.save(tmp_path / "p.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["format"] == PLAN_FORMAT and doc["stages"][0]["plan"]["mesh_shape"] == [4, 1]
    assert StagePlan.load(tmp_path / "p.json") == sp and json.loads(sp.to_json()) == doc


@pytest.mark.parametrize(
    "edit, needles",
    [
        (lambda d: {**d, "version": 3}, ("version", "3", "plan again")),
        (lambda d: {**d, "format": "someone-else/1"}, ("not a meshpilot plan", "someone-else/1")),
        (lambda d: {k: v for k, v in d.items() if k != "stages"}, ("stages", "missing", "plan again")),
        (lambda d: {**d, "stages": [{**d["stages"][0], "ranks": None}]}, ("malformed plan", "plan again")),
        (lambda d: [d], ("not a meshpilot plan", "list")),
    ],
)
def test_anything_else_is_refused_in_one_line(tmp_path, edit, needles):
    doc = json.loads(Plan.load(PIPE).to_json())
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(edit(doc)))
    with pytest.raises(UserError) as e:
        Plan.load(path)
    text = str(e.value)
    assert "\n" not in text and str(path) in text and all(n in text for n in needles), text


def test_a_long_pipeline_schedule_prints_short_and_saves_whole():
    p = dataclasses.replace(Plan.load(PIPE), microbatches=64)
    short, full = p.schedule_lines(), p.schedule_lines(full=True)
    assert short[0] == full[0] == "schedule 1f1b, 64 microbatches"
    assert all(len(line) < 120 for line in short) and "more) …" in short[1]
    assert max(len(line) for line in full) > 1000  # 64 microbatches: every F, B, S, R of a rank on one line
    assert json.loads(p.to_json())["step_schedule"]["text"] == full[1:]


def _gpt_graph(plan: Plan, layers: int = 2):
    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT, gpt_tiny

    (b, t), _ = plan.input_shapes[0]
    with torch.device("meta"):
        model = GPT(dataclasses.replace(gpt_tiny(layers=layers), batch=b, seq=t))
    idx = torch.empty(b, t, dtype=torch.long, device="meta")
    return capture(model, (idx, idx))


def test_validate_checks_a_pipeline_against_its_model():
    p = Plan.load(PIPE)
    graph = _gpt_graph(p)
    validate(p, world_size=4, graph=graph)
    cases = [
        (dict(world_size=8, graph=None), p, ("2 stages on 4 devices", "world size is 8", "--nproc-per-node 4")),
        (dict(graph=_gpt_graph(p, layers=3)), p, ("planned for 6 layers", "has 7")),
        (dict(graph=graph), dataclasses.replace(p, transfers=(dataclasses.replace(p.transfers[0], nbytes=1.0),)),
         ("transfers", "stage 0 → 1", "plan again")),
        (dict(graph=None), dataclasses.replace(p, stages=(p.stages[0], dataclasses.replace(p.stages[1], ranks=(1, 3)))),
         ("every rank 0 … 3 once",)),
    ]  # fmt: skip
    for kw, plan, needles in cases:
        with pytest.raises(UserError) as e:
            validate(plan, source="pp.json", **kw)
        text = str(e.value)
        assert "\n" not in text and text.startswith("pp.json: ") and all(n in text for n in needles), text


def test_the_runtime_moves_the_plans_transfers_which_are_what_the_slices_read():
    """Lowered at plan time: the pipeline runtime takes its transfers from the Plan (``planned_transfers``), the
    same values, directions and boundary inputs it would read off the stages' slices (``find_transfers``)."""
    from meshpilot.planner.stage import runnable_layers, slice_graph, stays_in_stage
    from meshpilot.runtime.pipeline_stages import find_transfers, planned_transfers, zero_filled

    p = Plan.load(PIPE)
    graph = _gpt_graph(p)
    layers = runnable_layers(graph)
    slices = [slice_graph(graph, st.layers[0], st.layers[1], layers) for st in p.stages]
    stage_of = {name: s for s, st in enumerate(p.stages) for x in layers[slice(*st.layers)] for name in x.nodes}
    zeros = zero_filled(slices, stage_of, stays_in_stage(graph, layers))
    planned = planned_transfers(p, graph, slices, zeros)
    found = find_transfers(graph, slices, stage_of, zeros)

    def key(t):
        return (t.node, t.index, t.src, t.dst, t.forward, t.boundary, t.info)

    assert planned is not None and sorted(map(key, planned)) == sorted(map(key, found))
    assert [t.k for t in planned] == list(range(len(planned)))
    assert planned_transfers(dataclasses.replace(p, transfers=()), graph, slices, zeros) is None  # an older plan


def test_two_plans_that_differ_say_where_and_the_digest_is_the_views():
    import dataclasses as dc
    import hashlib

    from meshpilot.planner.plan import first_difference

    p = Plan.load(ONE).only
    view = p.run_view()
    assert p.run_digest() == hashlib.sha256(json.dumps(list(view.values())).encode()).hexdigest()
    assert first_difference(view, Plan.load(ONE).run_view()) is None
    k = next(i for i, n in enumerate(p.nodes) if n.kind == "op")
    nodes = tuple(dc.replace(n, source="elsewhere") if i == k else n for i, n in enumerate(p.nodes))
    other = dc.replace(p, nodes=nodes)
    assert other.run_digest() != p.run_digest()
    where = first_difference(view, other.run_view())
    assert where.startswith(f"nodes[{k} {p.nodes[k].name!r}].source: ") and where.endswith(' vs "elsewhere"'), where
    pipe = Plan.load(PIPE)
    assert first_difference(pipe.run_view(), Plan.load(PIPE).run_view()) is None
    assert first_difference(pipe.run_view(), Plan.load(ONE).run_view()).startswith("stages: present vs absent")
