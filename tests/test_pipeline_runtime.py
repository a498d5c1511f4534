"""The pipeline runtime on 4 gloo ranks (2 stages x 2 ranks, 4 microbatches, GPipe and 1F1B) against the single
device: loss and gradients over 3 AdamW steps, and the sends, receives and all-reduces counted against the
schedule's. One spawn; every check inside it."""

from __future__ import annotations

import pytest
from dist_utils import run_distributed

from meshpilot.planner.schedule import PipelineKind

STEPS = 3


def _worker(kinds: list[str]) -> dict:
    import torch
    import torch.distributed as dist

    from meshpilot.errors import UserError
    from meshpilot.models.gpt import GPT, gpt_tiny
    from meshpilot.planner.schedule import pipeline
    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.pipeline import pipeline_parallelize

    cfg = gpt_tiny(layers=4)
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (8, cfg.seq))
    tgt = torch.randint(0, cfg.vocab, (8, cfg.seq))
    out: dict = {}
    for kind in kinds:
        torch.manual_seed(1)
        ref = GPT(cfg)
        torch.manual_seed(1)
        model = GPT(cfg)
        sched = pipeline([[0, 1], [2, 3]], 4, kind)
        pm = pipeline_parallelize(model, (idx, tgt), ["blocks.2"], sched)
        params = dict(ref.named_parameters())
        mine = pm.named_parameters()
        o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o_pp = torch.optim.AdamW([p for _, p in mine], lr=1e-2)
        res: dict = {"loss": [], "grad": [], "counts": [], "planned": pm.planned_counts(), "names": len(mine)}
        for _ in range(STEPS):
            o_ref.zero_grad()
            o_pp.zero_grad()
            l_ref = ref(idx, tgt)
            l_ref.backward()
            with record_collectives() as log:
                loss = pm.step(idx, tgt)
            if loss is not None:  # the model's loss: the mean over the last stage's ranks
                loss = loss.clone()
                dist.all_reduce(loss, group=pm.group)
                res["loss"].append(abs(loss.item() / pm.d - l_ref.item()))
            res["grad"].append(max((params[n].grad - p.grad).abs().max().item() for n, p in mine))
            res["counts"].append(log.counts())
            o_ref.step()
            o_pp.step()
        out[kind] = res
    try:
        pipeline_parallelize(GPT(cfg), (idx, tgt), ["blocks.2"], pipeline([[0], [1, 2, 3]], 4, "1f1b"))
    except UserError as e:
        out["uneven"] = str(e)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_distributed(_worker, 4, [k.value for k in PipelineKind], timeout=300)


@pytest.mark.parametrize("kind", [k.value for k in PipelineKind])
def test_two_stages_of_two_ranks_equal_the_single_device(four_ranks, kind):
    for rank, out in enumerate(four_ranks):
        res = out[kind]
        assert res["names"] > 0
        assert max(res["grad"]) < 1e-5, (rank, res["grad"])
        if rank >= 2:  # the last stage holds the loss
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


def test_stages_of_different_sizes_are_refused(four_ranks):
    assert "same number of ranks" in four_ranks[0]["uneven"]
