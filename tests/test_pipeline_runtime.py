"""The pipeline runtime on 4 gloo ranks against the single device: 2 stages x 2 ranks under GPipe and 1F1B, and
stages on submeshes of 1 and 3 ranks under 1F1B (tile sends between them), 4 microbatches of the tiny GPT: loss
and gradients over 3 AdamW steps, and the sends, receives and all-reduces counted against the schedule's. One
spawn; every check inside it."""

from __future__ import annotations

import pytest
from dist_utils import run_distributed

from meshpilot.planner.schedule import PipelineKind

STEPS = 3


CONFIGS = {  # name: (stage ranks, schedule, global batch)
    "gpipe": ([[0, 1], [2, 3]], "gpipe", 8),
    "1f1b": ([[0, 1], [2, 3]], "1f1b", 8),
    "1f1b-1+3": ([[0], [1, 2, 3]], "1f1b", 12),  # submeshes of different sizes: tile sends of 1 row
}


def _worker(configs: dict, mlp_plan: str) -> dict:
    import torch
    import torch.distributed as dist

    from meshpilot.errors import UserError
    from meshpilot.models.gpt import GPT, gpt_tiny
    from meshpilot.planner.schedule import pipeline
    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.pipeline import pipeline_parallelize

    cfg = gpt_tiny(layers=4)
    torch.manual_seed(0)
    out: dict = {}
    for name, (stage_ranks, kind, batch) in configs.items():
        torch.manual_seed(0)
        idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        torch.manual_seed(1)
        ref = GPT(cfg)
        torch.manual_seed(1)
        model = GPT(cfg)
        sched = pipeline(stage_ranks, 4, kind)
        pm = pipeline_parallelize(model, (idx, tgt), ["blocks.2"], sched)
        params = dict(ref.named_parameters())
        mine = pm.named_parameters()
        o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o_pp = torch.optim.AdamW([p for _, p in mine], lr=1e-2)
        res: dict = {"loss": [], "grad": [], "counts": [], "planned": pm.planned_counts(), "names": len(mine)}
        res["stage"] = pm.stage
        for _ in range(STEPS):
            o_ref.zero_grad()
            o_pp.zero_grad()
            l_ref = ref(idx, tgt)
            l_ref.backward()
            with record_collectives() as log:
                loss = pm.step(idx, tgt)
            if loss is not None:  # the model's loss: the mean over the last stage's ranks
                loss = loss.clone()
                if pm.group is not None:
                    dist.all_reduce(loss, group=pm.group)
                res["loss"].append(abs(loss.item() / pm.d - l_ref.item()))
            res["grad"].append(max((params[n].grad - p.grad).abs().max().item() for n, p in mine))
            res["counts"].append(log.counts())
            o_ref.step()
            o_pp.step()
        out[name] = res
    out["planned-mlp"] = _run_planned_mlp(mlp_plan)
    try:  # 8 / 4 microbatches = 2 rows: no equal shards over 3 ranks
        pipeline_parallelize(GPT(cfg), (idx[:8], tgt[:8]), ["blocks.2"], pipeline([[0], [1, 2, 3]], 4, "1f1b"))
    except UserError as e:
        out["uneven"] = str(e)
    from meshpilot.planner.schedule import parse_schedule

    zb = "schedule zb, 1 microbatch\nranks 0-1: F0 S0>2 I0 W0 G\nranks 2-3: R0<0 F0 B0 G"
    bad = {"split": (["blocks.9"], pipeline([[0, 1], [2, 3]], 4, "1f1b")), "action": (["blocks.2"], parse_schedule(zb))}
    for key, (points, sched) in bad.items():
        try:
            pipeline_parallelize(GPT(cfg), (idx[:8], tgt[:8]), points, sched)
        except UserError as e:
            out[key] = str(e)
    return out


def _run_planned_mlp(text: str) -> dict:
    """The planner's pipeline of the MLP (JSON, as `meshpilot plan --pipeline --out` saves it) run as planned."""
    import torch

    from meshpilot.models.zoo import MLPModel
    from meshpilot.planner.pipeline import PipelinePlan
    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.pipeline import pipeline_parallelize

    plan = PipelinePlan.from_json(text)
    torch.manual_seed(2)
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    torch.manual_seed(3)
    ref = MLPModel()
    torch.manual_seed(3)
    pm = pipeline_parallelize(MLPModel(), (x, y), plan)
    ref(x, y).backward()
    with record_collectives() as log:
        pm.step(x, y)
    params = dict(ref.named_parameters())
    grad = max((params[n].grad - p.grad).abs().max().item() for n, p in pm.named_parameters())
    return {"grad": grad, "equal_counts": log.counts() == pm.planned_counts(), "stage": pm.stage}


@pytest.fixture(scope="module")
def mlp_plan() -> str:
    import warnings

    from meshpilot.graph.capture import capture
    from meshpilot.models import builtin_models
    from meshpilot.planner.pipeline import plan_pipeline

    model, inputs = builtin_models()["mlp"].build("meta", 4)  # one microbatch of 4 of the global 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(model, inputs)
    return plan_pipeline(graph, "atp-ic3", microbatches=4, num_devices=4, num_stages=2).to_json()


@pytest.fixture(scope="module")
def four_ranks(mlp_plan):
    return run_distributed(_worker, 4, CONFIGS, mlp_plan, timeout=300)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_stages_equal_the_single_device(four_ranks, name):
    for rank, out in enumerate(four_ranks):
        res = out[name]
        assert res["names"] > 0
        assert max(res["grad"]) < 1e-5, (rank, res["grad"])
        if res["stage"] == 1:  # the last stage holds the loss
            assert len(res["loss"]) == STEPS and max(res["loss"]) < 1e-5, res["loss"]


@pytest.mark.parametrize("kind", [k.value for k in PipelineKind])
def test_sends_receives_and_all_reduces_counted_equal_to_the_schedule(four_ranks, kind):
    from meshpilot.sharding.reshard import CollectiveKind

    boundary = 1 * 16 * 32 * 4  # batch 8 / 4 microbatches / 2 ranks: 1 sequence of 16 tokens x hidden 32, float32
    for out in four_ranks:
        res = out[kind]
        for counts in res["counts"]:
            assert counts == res["planned"]
        got = res["counts"][0]
        assert got[(CollectiveKind.SEND, "pp", boundary)] == 4  # 4 microbatches cross the one boundary
        assert got[(CollectiveKind.RECV, "pp", boundary)] == 4
        n_reduce = sum(c for (k, _, _), c in got.items() if k == CollectiveKind.ALL_REDUCE)
        assert n_reduce == res["names"]  # one gradient all-reduce per parameter of the stage, once per step


def test_submeshes_of_different_sizes_exchange_tiles(four_ranks):
    from meshpilot.sharding.reshard import CollectiveKind

    row = 16 * 32 * 4  # one sequence of 16 tokens x hidden 32, float32
    first, *rest = [out["1f1b-1+3"] for out in four_ranks]
    for res in [first, *rest]:
        assert all(counts == res["planned"] for counts in res["counts"])
    # stage 0 (1 rank, 3 rows a microbatch) sends each of the 3 ranks of stage 1 its row, 4 microbatches
    assert first["counts"][0][(CollectiveKind.SEND, "pp", row)] == 12
    assert first["counts"][0][(CollectiveKind.RECV, "pp", row)] == 12
    assert not any(k == CollectiveKind.ALL_REDUCE for k, _, _ in first["counts"][0])  # one rank: nothing to sum
    for res in rest:
        assert res["counts"][0][(CollectiveKind.SEND, "pp", row)] == 4


def test_bad_input_is_refused_in_one_line(four_ranks):
    out = four_ranks[0]
    assert "equal shards" in out["uneven"] and "divisible by 4" in out["uneven"]
    assert "'blocks.9' is no module" in out["split"]
    assert "I0, W0" in out["action"] and "GPipe or 1F1B" in out["action"]


def test_a_saved_pipeline_plan_runs_as_planned(four_ranks, mlp_plan):
    from meshpilot.planner.pipeline import PipelinePlan

    plan = PipelinePlan.from_json(mlp_plan)
    assert len(plan.stages) == 2
    stage_of = {r: j for j, s in enumerate(plan.stages) for r in s.ranks}
    for rank, out in enumerate(four_ranks):
        res = out["planned-mlp"]
        assert res["stage"] == stage_of[rank]
        assert res["grad"] < 1e-5 and res["equal_counts"]
