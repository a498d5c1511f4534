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
from tiers import matrix

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
RUN_MESHES = matrix(((1, 4),), MESHES)
"""The vocabulary-parallel plans run on 4 processes. Default: (1, 4) (the vocabulary over 4 ranks), beside the
data-parallel (4, 1) plan (the loss' sum and count all-reduced together); full only: (2, 2), both at once (its
plan's layouts and in-op collectives are checked in the default tier by the planning test). The spawn's CPU s
(ranks included): 119 before (the last full run, load ~20), 32 after (default tier, load ~7); the file: 150
before, 37 after (6 passed)."""


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


def _plans(meshes=MESHES):
    model, inputs = build("gpt")
    graph = capture(model, inputs)
    return graph, {shape: _vocab_plan(model, inputs, graph, shape) for shape in meshes}


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
        # the loss is a partial sum over the TP axis; over the batch axis its sum and the count of targets are
        # all-reduced together in the op (one collective), so it is replicated there
        assert lay["aten.nll_loss_forward.default"] == "RP"
        # in-op collectives: MAX and SUM of one fp32 value per local row in the forward, SUM in the backward
        local_rows = rows // (1 if shape == (1, 4) else 2)
        lsm, lsmb = _node(graph, "aten._log_softmax.default"), _node(graph, "aten._log_softmax_backward_data.default")
        nll = _node(graph, "aten.nll_loss_forward.default")
        # (2, 2): the loss' sum and the count of non-ignored targets summed over the batch axis (two fp32 scalars)
        count = [] if shape == (1, 4) else [(nll.name, "all_reduce", 0, 8, "fwd")]
        assert _in_op(p) == sorted(
            [(lsm.name, "all_reduce", 1, 4 * local_rows, "fwd")] * 2
            + [(lsmb.name, "all_reduce", 1, 4 * local_rows, "bwd")]
            + count
        )
        assert p.time.communication_s >= sum(c.seconds for c in p.collectives if c.src == c.dst) > 0


def test_a_batch_sharded_mean_loss_divides_by_the_global_count_never_averages_shards():
    """DTensor's mean ``nll_loss`` over row-sharded targets is ``P(avg)``, the mean of the shards' means: not the
    batch's mean where shards hold unequal numbers of ignored targets (padding). Those strategies are dropped
    (``AVG_INEXACT``); a data-parallel plan takes meshpilot's rule instead: the summed loss and the count of
    targets all-reduced together in the op (one two-scalar collective), the loss replicated — and no second
    all-reduce of the loss at the loss edge (its ``getitem`` reads the replica as it is)."""
    from meshpilot.planner.forced import data_parallel
    from meshpilot.sharding.strategies import AVG_INEXACT

    model, inputs = build("gpt")
    graph = capture(model, inputs)
    assert "aten.nll_loss_forward.default" in AVG_INEXACT
    p = plan(model, inputs, "atp-ic3", mesh_shape=(4, 1), force=data_parallel(model, inputs, (4, 1)), graph=graph)
    nll = next(n for n in p.nodes if n.target == "aten.nll_loss_forward.default")
    assert nll.source == "meshpilot" and "".join(nll.outs[0]) == "RR", (nll.source, nll.outs)
    assert not any("avg" in "".join(o) for n in p.nodes for o in n.outs if o), "a P(avg) output left in the plan"
    loss = {nll.name, graph.loss[0], "loss"}
    of_loss = [(c.src, c.dst, c.kind, c.axis, c.nbytes) for c in p.collectives if {c.src, c.dst} & loss]
    assert of_loss == [(nll.name, nll.name, "all_reduce", 0, 8)], of_loss
    # its backward keeps the rows sharded as DDP does (each rank writes its rows' gradient): not a replicated
    # backward that gathers the saved log-probabilities and writes the whole [N, C] gradient on every rank
    for target in ("aten.nll_loss_backward.default", "aten._log_softmax_backward_data.default"):
        n = next(n for n in p.nodes if n.target == target)
        assert "".join(n.outs[0]) == "S(0)R", (target, n.outs)


def test_the_loss_reductions_follow_the_planned_layout_and_price_the_shards_work():
    """Per row-sharding axis, ``nll_loss_forward`` all-reduces its summed loss and the count together where the
    loss is planned replicated (two scalars), the count alone where a plan saved before this rule keeps it
    partial; and the op's work on an axis where its own collective made the output whole is priced as split
    there (``accounting.reduced_in_op``), as the output's layout alone would not say."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from meshpilot.ops.vocab import _loss_reductions
    from meshpilot.planner.accounting import reduced_in_op
    from meshpilot.sharding.reshard import Collective, CollectiveKind
    from meshpilot.sharding.strategies import Strategy, StrategySource

    R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
    multi = lambda a: True  # noqa: E731
    assert _loss_reductions((R, P), (S0, R), multi) == ([0], [])  # (2, 2) Megatron: rows on 0, classes on 1
    assert _loss_reductions((P, P), (S0, R), multi) == ([], [0])  # the same, saved with the loss partial
    assert _loss_reductions((R, R), (S0, S0), multi) == ([0, 1], [])  # rows over both axes
    assert _loss_reductions((R, R), (S0, S0), lambda a: a == 1) == ([1], [])  # an axis of one device: none

    def strategy(outs, ins, axes):
        colls = tuple(Collective(CollectiveKind.ALL_REDUCE, a, 8) for a in axes)
        return Strategy(outs, ins, StrategySource.MESHPILOT, colls=colls)

    dp = strategy(((R, R), (R, R)), ((S0, S0), (S0, S0)), [0, 1])
    assert reduced_in_op(dp, dp.outs[0], (4, 2)) == 8
    vocab = strategy(((R, P), (R, R)), ((S0, S1), (S0, R)), [0])
    assert reduced_in_op(vocab, vocab.outs[0], (2, 2)) == 2  # the class axis: split by its partial output
    whole = strategy(((R, R), (R, R)), ((R, R), (R, R)), [])
    assert reduced_in_op(whole, whole.outs[0], (4, 2)) == 1
    # a collective on an axis whose operands are whole there (a softmax's row max over the class axis) splits
    # nothing more than the output's own layout says
    lsm = strategy(((R, S1),), ((R, S1),), [1])
    assert reduced_in_op(lsm, lsm.outs[0], (2, 2)) == 1


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


def _worker(jobs: list[tuple[str, str]], graph) -> dict:
    """Each (key, plan JSON) run beside the single device on `graph`, the parent's capture of the GPT (each rank
    traced it again before)."""
    from meshpilot.planner.plan import StagePlan

    ref = _reference("gpt", ADAMW)
    out = {}
    for key, plan_json in jobs:
        out[key] = _run_plan("gpt", StagePlan.from_json(plan_json), graph, ref)
    return out


def _dp_plan(graph):
    """The data-parallel plan of the GPT on (4, 1) (`graph`: its capture, :func:`_plans`'): the loss' sum and
    count all-reduced together, its backward row-sharded (``test_a_batch_sharded_mean_loss_…``)."""
    from meshpilot.planner.forced import data_parallel

    model, inputs = build("gpt")
    return plan(model, inputs, "atp-ic3", mesh_shape=(4, 1), force=data_parallel(model, inputs, (4, 1)), graph=graph)


@pytest.mark.dist
def test_vocab_parallel_loss_runs_exactly_on_four_processes():
    graph, plans = _plans(RUN_MESHES)
    plans[(4, 1)] = _dp_plan(graph)  # and the data-parallel loss (one joint all-reduce, row-sharded backward)
    jobs = [(str(shape), p.to_json()) for shape, p in plans.items()]
    results = run_distributed(_worker, 4, jobs, graph, timeout=600)
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


def test_a_row_sharded_nll_loss_backward_writes_each_shards_rows_of_the_whole_gradient():
    """``_run_nll_loss_backward`` with the rows sharded and the classes whole (the data-parallel loss' backward,
    the rule where DTensor offers none): each of 4 row blocks, given the batch's ``g`` and ``total_weight``, is
    exactly those rows of the single-device gradient of the mean ``nll_loss``, ignored targets included."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard

    from meshpilot.ops.vocab import _run_nll_loss_backward

    torch.manual_seed(0)
    n, c, ignore = 16, 8, -100
    lp = torch.randn(n, c).log_softmax(1).requires_grad_()
    target = torch.randint(0, c, (n,))
    target[[1, 2, 3, 9]] = ignore  # unequal ignored counts per block of 4 rows
    F.nll_loss(lp, target, ignore_index=ignore).backward()
    total = (target != ignore).sum().float()

    class Call:  # the rows this rank holds; the classes whole (local_range over dim 1: all of them)
        ins = (None, (Shard(0), Replicate()), (Shard(0), Replicate()), None)

        def global_shape(self, arg):
            return torch.Size((n, c))

        def local_range(self, shape, layout, dim):
            assert dim == 1 and layout == self.ins[1]
            return 0, c

    g = torch.tensor(1.0)
    for r in range(4):
        rows = slice(4 * r, 4 * r + 4)
        got = _run_nll_loss_backward(Call(), g, lp.detach()[rows], target[rows], None, 1, ignore, total)
        torch.testing.assert_close(got, lp.grad[rows], rtol=0, atol=0)
