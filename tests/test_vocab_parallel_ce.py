"""meshpilot's vocabulary-parallel cross-entropy (``_log_softmax``, ``nll_loss_forward`` and their backward
with the class dim sharded, Megatron-LM's): the strategies are offered, a plan whose LM head output is
vocabulary-sharded runs them on 4 gloo processes and equals the single-device GPT, the collectives the run
issues (the softmax's in-op all-reduces included) are exactly the plan's, and on a large vocabulary they
cost less than gathering the logits."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed
from test_models_parallel import ADAMW, STEPS, TOL, _reference, _run_plan, build

from meshpilot.graph.capture import capture
from meshpilot.planner.auto import plan
from meshpilot.planner.forced import megatron_tp

CE_OPS = {
    "aten._log_softmax.default",
    "aten.nll_loss_forward.default",
    "aten.nll_loss_backward.default",
    "aten._log_softmax_backward_data.default",
}
MESHES = ((1, 4), (2, 2))


def _node(graph, target: str):
    return next(n for n in graph.nodes if n.target == target)


def _vocab_plan(model, inputs, graph, shape, cluster="atp-ic3", gather=False):
    """Megatron TP over the last axis: the LM head is column-parallel (vocabulary-sharded weight) and the
    log-softmax's output is pinned vocabulary-sharded, rows batch-sharded on axis 0; with `gather` the
    log-softmax is pinned replicated instead (the logits are all-gathered before the loss)."""
    force = megatron_tp(model, inputs, shape, graph=graph)
    lsm = _node(graph, "aten._log_softmax.default").name
    assert force[lsm].endswith("S(1)") and force["lm_head.weight"].endswith("S(0)")
    if gather:
        force[lsm] = force[lsm][: -len("S(1)")] + "R"
    return plan(model, inputs, cluster, mesh_shape=shape, force=force, graph=graph)


def _plans():
    model, inputs = build("gpt")
    graph = capture(model, inputs)
    return graph, {shape: _vocab_plan(model, inputs, graph, shape) for shape in MESHES}


def _in_op(p) -> list[tuple[str, str, int, int, str]]:
    return sorted((c.src, c.kind, c.axis, c.nbytes, c.phase) for c in p.collectives if c.src == c.dst)


def test_vocab_parallel_strategies_are_offered_and_chosen():
    graph, plans = _plans()
    rows = 8 * 8  # logits [b*s, V] = [64, 64]
    for shape, p in plans.items():
        chosen = {n.target: n for n in p.nodes if n.target in CE_OPS}
        assert {t: n.source for t, n in chosen.items()} == dict.fromkeys(CE_OPS, "meshpilot"), shape
        lay = {t: "".join(n.outs[0]) for t, n in chosen.items()}
        vocab = "RS(1)" if shape == (1, 4) else "S(0)S(1)"
        assert lay["aten._log_softmax.default"] == vocab
        assert lay["aten._log_softmax_backward_data.default"] == vocab
        assert lay["aten.nll_loss_backward.default"] == vocab
        # the loss is a partial sum over both axes (over the batch axis: divided by the all-reduced count)
        assert lay["aten.nll_loss_forward.default"] == ("RP" if shape == (1, 4) else "PP")
        # in-op collectives: MAX and SUM of one fp32 value per local row in the forward, SUM in the backward
        local_rows = rows // (1 if shape == (1, 4) else 2)
        lsm, lsmb = _node(graph, "aten._log_softmax.default"), _node(graph, "aten._log_softmax_backward_data.default")
        nll = _node(graph, "aten.nll_loss_forward.default")
        # (2, 2): the count of non-ignored targets is summed over the batch axis (one fp32 scalar)
        count = [] if shape == (1, 4) else [(nll.name, "all_reduce", 0, 4, "fwd")]
        assert _in_op(p) == sorted(
            [(lsm.name, "all_reduce", 1, 4 * local_rows, "fwd")] * 2
            + [(lsmb.name, "all_reduce", 1, 4 * local_rows, "bwd")]
            + count
        )
        assert p.time.communication_s >= sum(c.seconds for c in p.collectives if c.src == c.dst) > 0


def test_a_batch_sharded_mean_loss_divides_by_the_global_count_never_averages_shards():
    """DTensor's mean ``nll_loss`` over row-sharded targets is ``P(avg)``, the mean of the shards' means: not the
    batch's mean where shards hold unequal numbers of ignored targets (padding). Those strategies are dropped
    (``AVG_INEXACT``); a data-parallel plan takes meshpilot's rule instead: the loss a partial sum, the count of
    targets all-reduced in the op."""
    from meshpilot.planner.forced import data_parallel
    from meshpilot.sharding.strategies import AVG_INEXACT

    model, inputs = build("gpt")
    graph = capture(model, inputs)
    assert "aten.nll_loss_forward.default" in AVG_INEXACT
    p = plan(model, inputs, "atp-ic3", mesh_shape=(4, 1), force=data_parallel(model, inputs, (4, 1)), graph=graph)
    nll = next(n for n in p.nodes if n.target == "aten.nll_loss_forward.default")
    assert nll.source == "meshpilot" and "".join(nll.outs[0]) == "PR", (nll.source, nll.outs)
    assert not any("avg" in "".join(o) for n in p.nodes for o in n.outs if o), "a P(avg) output left in the plan"
    count = [c for c in p.collectives if c.src == c.dst == nll.name]
    assert [(c.kind, c.axis, c.nbytes) for c in count] == [("all_reduce", 0, 4)]


def test_vocab_parallel_loss_is_cheaper_than_gathering_a_large_vocabulary():
    """Planning only: a GPT with a 32000-token vocabulary under Megatron TP on 8 H100s, mesh (1, 8)."""
    from meshpilot.models.gpt import GPT, gpt_tiny

    cfg = gpt_tiny(batch=8, seq=128)
    cfg = type(cfg)(**{**cfg.__dict__, "vocab": 32000, "hidden": 256, "heads": 8})
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.empty(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
    inputs = (idx, idx)
    graph = capture(model, inputs)
    vp = _vocab_plan(model, inputs, graph, (1, 8), cluster="dgx-h100")
    gathered = _vocab_plan(model, inputs, graph, (1, 8), cluster="dgx-h100", gather=True)
    assert {n.source for n in vp.nodes if n.target in CE_OPS} == {"meshpilot"}
    lsm = _node(graph, "aten._log_softmax.default").name
    assert gathered.node(lsm).source == "dtensor" and gathered.node(lsm).outs[0] == ("R", "R")
    bytes_vp = sum(c.nbytes for c in vp.collectives)
    bytes_g = sum(c.nbytes for c in gathered.collectives)
    print(
        f"\nvocab 32000, (1, 8) dgx-h100: vocab-parallel CE {vp.time.total_s * 1e3:.3f} ms, "
        f"{bytes_vp / 2**20:.2f} MiB moved; gathered logits {gathered.time.total_s * 1e3:.3f} ms, "
        f"{bytes_g / 2**20:.2f} MiB moved"
    )
    assert vp.time.total_s < gathered.time.total_s
    assert bytes_vp < bytes_g


def _worker(jobs: list[tuple[str, str]]) -> dict:
    from meshpilot.planner.plan import StagePlan

    model, inputs = build("gpt")
    graph = capture(model, inputs)
    ref = _reference("gpt", ADAMW)
    out = {}
    for key, plan_json in jobs:
        out[key] = _run_plan("gpt", StagePlan.from_json(plan_json), graph, ref)
    return out


@pytest.mark.dist
def test_vocab_parallel_loss_runs_exactly_on_four_processes():
    _, plans = _plans()
    jobs = [(str(shape), p.to_json()) for shape, p in plans.items()]
    results = run_distributed(_worker, 4, jobs, timeout=600)
    for rank, res in enumerate(results):
        for shape, p in plans.items():
            r = res[str(shape)]
            want = {ph: p.collective_counts(phase=ph, backend="gloo") for ph in ("fwd", "bwd")}
            for step in range(STEPS):
                where = f"rank {rank} mesh {shape} step {step}"
                assert r["loss"][step] <= TOL, f"{where}: loss off by {r['loss'][step]:.3g}"
                err, name = r["grad"][step]
                assert err <= TOL, f"{where}: grad of {name} off by {err:.3g}"
                assert r["counts"][step] == want, f"{where}: issued {r['counts'][step]} planned {want}"
            assert not r["mismatches"], r["mismatches"][:3]
