"""The variant repeated-block stage table (``planner.stack`` module docstring, 4): every entry a real plan (the
block's uncapped plan, ZeRO-sharded, recomputed), so the chosen stages are priced exactly by construction; and
its plans against the exact table's (every cap level of every logical mesh)."""

from __future__ import annotations

import numpy as np
import pytest
from tiers import matrix

from meshpilot.errors import UserError
from meshpilot.models import _gpt_builder
from meshpilot.models.gpt import gpt_tiny
from meshpilot.planner.config_plan import recomputed_stack
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.pipeline import plan_pipeline, stage_memory
from meshpilot.planner.recompute import Recompute
from meshpilot.planner.stack import ApproxLevel, Stack, StageCosting, capture_stack, compose_stage
from meshpilot.planner.stage import StagePlanner

full = pytest.mark.full


@pytest.fixture(scope="module")
def stack() -> Stack:
    """A 6-block GPT traced with 4 of its blocks (``capture_stack``), 4 microbatches of 4 sequences."""
    got = capture_stack(*_gpt_builder(gpt_tiny(layers=6, batch=16, hidden=256))("meta", 4))
    assert isinstance(got, Stack) and got.kept < got.blocks
    return got


@pytest.fixture(scope="module")
def roomy(stack: Stack) -> float:
    """The largest stage's Eq. 5 memory of the exact table's plan on 4 devices with the whole device."""
    p = plan_pipeline(stack, "alpa-p3x8", microbatches=4, num_devices=4, costing="exact", workers=1)
    return max(st.memory_bytes for st in p.stages)


@pytest.mark.parametrize(
    ("cluster", "n", "share"),
    [
        # default tier: alpa-p3x8 at half the room (the exact table's blocks descend cap levels); full only: the
        # whole room, another cluster's (hidup) and another's on 4 devices. CPU s 145 before (the last full run,
        # load ~20), 26 after (default tier, load ~7; the file: 448 before, 78 after, 11 passed, 7 full only)
        pytest.param("alpa-p3x8", 8, 1.0, marks=full),
        # these three were 19 % and 45 % slower and without a plan while the exact table's capped block searches
        # left the summed gradients out of their memory rows (issue 29: they hold them now, as auto.plan's)
        ("alpa-p3x8", 8, 0.5),
        pytest.param("hidup-2x4-10g", 8, 0.5, marks=full),
        pytest.param("atp-ic3", 4, 1.0, marks=full),
    ],
)
def test_variant_table_within_one_percent_of_the_exact_table_or_better(stack, roomy, cluster, n, share):
    """On a few clusters and memories (half the memory makes the exact table's blocks descend cap levels), the
    variant table's final step is at most 1 % over the exact table's, both counting the gradients summed over the
    microbatches (faster is allowed: its recomputing and
    ZeRO-sharded blocks are plans the exact table's cap levels may not reach), every stage within Eq. 5, and the
    plan says how it was costed."""
    memory = share * roomy
    kw = dict(microbatches=4, num_devices=n, memory_bytes=memory, workers=1)
    fast = plan_pipeline(stack, cluster, costing="approximate", **kw)
    # both tables counting the gradients summed over the microbatches (the variant table's default)
    exact = plan_pipeline(stack, cluster, costing="exact", accumulated=True, **kw)
    assert fast.costing == StageCosting.STACK_APPROX and exact.costing == StageCosting.STACK
    assert "repeated-block variants stage costs" in str(fast)
    assert fast.step_s <= exact.step_s * 1.01, (fast.step_s, exact.step_s)
    assert all(st.memory_bytes <= memory * (1 + 1e-9) for st in fast.stages)


@pytest.mark.parametrize("share", [pytest.param(1.0, marks=full), 0.5])  # default: half the room (stages that
# recompute or shard; 11-13 CPU s before, 6 after); full only: the whole room (7-9 CPU s before)
def test_chosen_stages_are_real_plans_priced_again_equal(stack, roomy, share):
    """Each stage of the variant plan is one of its variants (the block's uncapped plan, or ZeRO-3-sharded; on
    the captured or the recomputing graph, as the stage says) composed on its ranks by ``compose_stage`` on a
    fresh planner (the gradients summed over the microbatches counted): the same time and memory to the last
    bit, within Eq. 5; and the plan's step is Eq. 2 of those times (at half the room too, where it recomputes
    or shards)."""
    memory, B = share * roomy, 4
    fast = plan_pipeline(stack, "alpa-p3x8", microbatches=B, num_devices=8, memory_bytes=memory, workers=1,
                         costing="approximate")  # fmt: skip
    graphs = {rc: recomputed_stack(stack, rc) if rc is not Recompute.NONE else stack for rc in Recompute}
    planners = {rc: StagePlanner(st.graph, "alpa-p3x8") for rc, st in graphs.items()}
    chosen = []
    for st in fast.stages:
        rc = st.cost.recompute
        again = []
        for level in ApproxLevel:  # a stage with no block is marked NONE whichever graph it was composed on
            if level.recompute != rc and (rc is not Recompute.NONE or graphs[Recompute.FULL].parts(*st.layers)[1]):
                continue
            c = compose_stage(planners[level.recompute], graphs[level.recompute], *st.layers, st.ranks, st.mesh_shape,
                              microbatches=B, capacity=memory, block_zero=level.zero, accumulated=True,
                              ends=planners[Recompute.NONE])  # fmt: skip
            again.append((c.time.total_s, c.peaks))
        assert (st.cost.time.total_s, st.cost.peaks) in again, (st.layers, st.cost.time.total_s, again)
        assert stage_memory(st.cost, st.in_flight) <= memory * (1 + 1e-9)
        chosen.append(st.cost.time.total_s / B)
    assert fast.step_s == pytest.approx(sum(chosen) + (B - 1) * max(chosen), rel=1e-12)


def test_costing_is_checked(stack):
    with pytest.raises(UserError, match="costing='cheap'"):
        plan_pipeline(stack, "alpa-p3x8", microbatches=4, num_devices=4, costing="cheap")


@pytest.fixture(scope="module")
def long_stack() -> Stack:
    """A 6-block GPT of 256-token sequences (its saved activations outweigh its weights), 4 microbatches of 4."""
    got = capture_stack(*_gpt_builder(gpt_tiny(layers=6, batch=16, hidden=128, seq=256))("meta", 4))
    assert isinstance(got, Stack)
    return got


def test_the_exact_table_recomputes_where_it_pays(long_stack):
    """The exact table offers the recomputing blocks after its cap levels (``stack`` module docstring, 2): below the
    memory where any stage fits without recomputation the plan recomputes; a little above it, recomputing some
    stages beats every plan without (at this size one stage of 4 devices under a capped block plan); and each
    recomputing stage is its block's plan composed again on its ranks, within Eq. 5."""
    kw = dict(microbatches=4, num_devices=4, costing="exact", workers=1)
    roomy = max(st.memory_bytes for st in plan_pipeline(long_stack, "alpa-p3x8", recompute="none", **kw).stages)
    with pytest.raises(PlanError, match="no pipeline fits"):
        plan_pipeline(long_stack, "alpa-p3x8", recompute="none", memory_bytes=0.6 * roomy, **kw)
    tight = plan_pipeline(long_stack, "alpa-p3x8", memory_bytes=0.6 * roomy, **kw)
    assert all(st.cost.recompute is not Recompute.NONE for st in tight.stages)
    plain = plan_pipeline(long_stack, "alpa-p3x8", recompute="none", memory_bytes=0.7 * roomy, **kw)
    mixed = plan_pipeline(long_stack, "alpa-p3x8", memory_bytes=0.7 * roomy, **kw)
    assert mixed.step_s < plain.step_s and any(st.cost.recompute is not Recompute.NONE for st in mixed.stages)
    captured = StagePlanner(long_stack.graph, "alpa-p3x8")  # the pre and post parts' planner, as the table's
    for p, cap in ((tight, 0.6 * roomy), (mixed, 0.7 * roomy)):
        for st in p.stages:
            assert stage_memory(st.cost, st.in_flight) <= cap * (1 + 1e-9)
            mode = st.cost.recompute
            if mode is Recompute.NONE:  # a cap level's block: the other tests re-price those
                continue
            graph = recomputed_stack(long_stack, mode)
            again = [
                compose_stage(StagePlanner(graph.graph, "alpa-p3x8"), graph, *st.layers, st.ranks, st.mesh_shape,
                              microbatches=4, capacity=cap, block_zero=zero, recompute=mode, accumulated=True,
                              ends=captured)
                for zero in (None, ApproxLevel.ZERO.zero)
            ]  # fmt: skip
            assert (st.cost.time.total_s, st.cost.peaks) in [(c.time.total_s, c.peaks) for c in again], st.layers


def test_the_variant_table_plans_a_capped_block_where_no_uncapped_one_fits(long_stack):
    """Without recomputation, at 0.7 of the roomy plan's memory the exact table's plan has a stage under a capped
    block plan that neither the uncapped block nor its ZeRO-3 answer fit (``stack`` module docstring, 4; GPT-39B's
    8-device stage on alpa-p3x8): the variant table's second pass (``StackTable.refine``) plans the block under
    caps there, so its plan is within 1 % of the exact one's, with a stage of a capped block, each stage within
    Eq. 5."""
    kw = dict(microbatches=4, num_devices=4, workers=1, recompute="none")
    roomy = max(st.memory_bytes for st in plan_pipeline(long_stack, "alpa-p3x8", costing="exact", **kw).stages)
    memory = 0.7 * roomy
    exact = plan_pipeline(long_stack, "alpa-p3x8", costing="exact", memory_bytes=memory, **kw)
    fast = plan_pipeline(long_stack, "alpa-p3x8", costing="approximate", memory_bytes=memory, **kw)
    assert fast.step_s <= exact.step_s * 1.01, (fast.step_s, exact.step_s)
    assert all(stage_memory(st.cost, st.in_flight) <= memory * (1 + 1e-9) for st in fast.stages)


def _final_step(p, graph) -> float:
    """Eq. 2 of the plan's stages planned on their own (``Plan.with_intra`` on the whole model's graph)."""
    final = p.with_intra(graph, p.cluster)
    ts = [st.plan.time.total_s / final.microbatches for st in final.stages]
    return sum(ts) + (final.microbatches - 1) * max(ts)


@pytest.mark.parametrize(
    ("n", "share"),
    [
        # default tier: 4 devices (replicas of the base meshes' blocks priced); full only: 8 devices at the whole
        # and half the room, 16 across two servers (xfail). CPU s 119 before (the last full run), 5 after
        pytest.param(8, 1.0, marks=full),
        pytest.param(8, 0.5, marks=full),
        (4, 1.0),
        # across two servers this tiny model's step is mostly collectives, which replicas of a base plan price
        # poorly: 0.631 ms against the exact table's 0.476 (docs/benchmarks.md, the estimated table)
        pytest.param(
            16, 1.0, marks=[full, pytest.mark.xfail(strict=True, reason="the estimate misses across servers")]
        ),
    ],
)
def test_the_estimated_table_final_plan_within_one_percent_of_the_exact_tables(stack, roomy, n, share):
    """The estimated table (``planner.stack`` module docstring, 5: only the base meshes searched, every other
    priced as replicas of one — on 16 devices across two servers too) chooses stages whose own plans
    (``with_intra``) step at most 1 % slower than the exact table's stages' own plans; it searches fewer pieces;
    the plan says how it was costed."""
    from meshpilot.graph.capture import capture

    model, inputs = _gpt_builder(gpt_tiny(layers=6, batch=16, hidden=256))("meta", 4)
    whole = capture(model, inputs)
    kw = dict(microbatches=4, num_devices=n, memory_bytes=share * roomy, workers=1)
    est = plan_pipeline(stack, "alpa-p3x8", costing="estimated", **kw)
    exact = plan_pipeline(stack, "alpa-p3x8", costing="exact", **kw)
    assert est.costing == StageCosting.STACK_ESTIMATED
    assert est.stage_plans < exact.stage_plans, (est.stage_plans, exact.stage_plans)
    fin_est, fin_exact = _final_step(est, whole), _final_step(exact, whole)
    assert fin_est <= fin_exact * 1.01, (fin_est, fin_exact)


def test_the_estimated_tables_catalogue_is_searched_by_the_workers_once(stack, monkeypatch):
    """The estimated table (``planner.stack`` module docstring, 5) with two workers: the server column's cap levels
    start first in a forked process of their own (``planner.parallel.start_task``), the catalogue and the columns
    are searched over the other worker, each search of the catalogue once, each graph's planner — the recomputing
    ones' too — gets what they searched, and the plan is the one planned in one process (those cap levels, pruned
    against no replica, may search more)."""
    import meshpilot.planner.stack as stack_mod

    calls, started = [], []
    real, real_start = stack_mod.map_columns, stack_mod.start_task

    def spy(fn, items, planner, workers):
        calls.append((getattr(fn, "__name__", ""), list(items), workers))  # a column's partial has none
        return real(fn, items, planner, workers)

    def spy_start(fn, item, planner):
        started.append((fn.func.__name__, list(item)))
        return real_start(fn, item, planner)

    kw = dict(microbatches=4, num_devices=8, costing="estimated")
    one = plan_pipeline(stack, "alpa-p3x8", workers=1, **kw)
    monkeypatch.setattr(stack_mod, "map_columns", spy)
    monkeypatch.setattr(stack_mod, "start_task", spy_start)
    sp = StagePlanner(stack.graph, "alpa-p3x8")
    two = plan_pipeline(stack, "alpa-p3x8", workers=2, planner=sp, **kw)
    assert [(st.layers, st.ranks, st.mesh_shape) for st in two.stages] == [
        (st.layers, st.ranks, st.mesh_shape) for st in one.stages
    ]
    assert two.step_s == one.step_s
    assert started == [("_server_caps_alone", [3])]  # sizes 1, 2, 4, 8: the server column, first
    searched = [(items, w) for name, items, w in calls if name == "_catalogue_piece"]
    assert searched and {w for _, w in searched} == {1}, calls  # the other worker: here, as the caps run beside it
    pieces = [task for items, _ in searched for task in items]
    assert {task[0] for task in pieces} == {(1, 1), (1, 2), (1, 4), (1, 8)}
    assert {task[3] for task in pieces} == {None}  # every mapping: one server's bases are searched on each
    assert len(pieces) == len(set(pieces))  # each search once
    assert two.stage_plans >= one.stage_plans  # the caps process' searches counted (merged) here


def test_the_estimated_table_searches_a_whole_servers_meshes_under_cap_levels(stack, roomy, monkeypatch):
    """The estimated table (``planner.stack`` module docstring, 5) searches the logical meshes of one whole server
    under the exact table's cap levels (a capped block is a plan no replica prices), and no other size's."""
    from meshpilot.planner.stack import StackTable

    calls = []
    real = StackTable._cap_levels

    def spy(self, ctx, win, j, shape, lower):
        calls.append((len(ctx.ranks), tuple(shape)))
        return real(self, ctx, win, j, shape, lower)

    monkeypatch.setattr(StackTable, "_cap_levels", spy)
    # default tier: one server's 8 devices (the sizes 1, 2 and 4 searched without caps); full only: 16 devices on
    # two servers (16 not searched under caps either). CPU s 66-75 before (16 only, the last full run), 5 after
    for n in matrix((8,), (8, 16)):
        calls.clear()
        kw = dict(microbatches=4, num_devices=n, memory_bytes=0.5 * roomy, workers=1)
        p = plan_pipeline(stack, "alpa-p3x8", costing="estimated", **kw)
        assert p.costing == StageCosting.STACK_ESTIMATED
        assert calls and {d for d, _ in calls} == {8}, (n, calls)


def test_a_composed_stage_holds_its_blocks_gradients_as_the_backward_produces_them(stack):
    """A ZeRO-3 block's gradients are produced whole (partial sums) and stored sharded; each is live from its
    backward to the end of the stage's backward (``accounting.liveness``), so while one block of a stage peaks
    the others already past their backward hold theirs whole (``StageMemory.grads_held``, ``StageMemory.carry``):
    two middle blocks composed from the block's ZeRO-3 plan on 4x2 hold no less than the same two blocks searched
    as one range. Before the carry read the stored (sharded) gradients: 5.49 MiB composed against 5.75 MiB
    searched; GPT-6.7B's ``[0,18)@8x1`` (16 selectively recomputing ZeRO-3 blocks, 2 microbatches in flight) read
    14.6 GiB in both stage tables and needed 17.7 GiB once planned, so both tables chose a stage that does not fit
    (docs/benchmarks.md, issue 29 item 6)."""
    from meshpilot.planner.zero import ZeroMode

    sp, B, p, shape = StagePlanner(stack.graph, "alpa-p3x8"), 4, stack.pre, (4, 2)
    zero = ZeroMode.STAGE3
    composed = compose_stage(sp, stack, p + 1, p + 3, range(8), shape, microbatches=B, block_zero=zero,
                             accumulated=True)  # fmt: skip
    searched = sp.plan(*stack.graph_range(p + 1, p + 3), range(8), shape, microbatches=B, zero=zero)
    assert composed.peaks.forward_backward >= searched.peaks.forward_backward
    _, m = sp.plan_with_memory(stack.middle, stack.middle + 1, range(8), shape, microbatches=B, zero=zero)
    assert m.grads_held > 2 * m.grads and m.carry == max(m.saved, m.grads_held)


def test_a_zero3_replica_carries_the_weights_its_backward_reads_gathered(stack):
    """The estimated table's ZeRO-3 replica of a block (``stack._replicated``, module docstring 5) gathers its
    weights once a microbatch; those the backward reads through a view the forward saved (``t(weight)`` of each
    linear: ``accounting.weights_read_back``) stay gathered from its forward to its backward, so while another
    block of the stage peaks it carries them beside its share of the saved values. Without them GPT-6.7B's
    ``[10,18)@4x1`` (8 ZeRO-3 replicas of 1x1's block, 2 microbatches in flight) read 14.3 GiB and needed 16.4 GiB
    once planned."""
    from meshpilot.cluster import CostModel, LogicalMesh, load_cluster
    from meshpilot.planner.stack import _Piece, _replicated

    sp, B = StagePlanner(stack.graph, "alpa-p3x8"), 4
    cost, m = sp.plan_with_memory(stack.middle, stack.middle + 1, range(2), (1, 2), microbatches=B)
    assert m.read_back > 0  # the linears' weights, through their saved transposes
    cm = CostModel(LogicalMesh(load_cluster("alpa-p3x8"), (4, 2), np.arange(8).reshape(4, 2)))
    z = _replicated(_Piece(cost, m), 4, cm, True, B).mem
    assert z.carry >= z.saved + m.read_back and z.grads_held == m.grads_held
    plain = _replicated(_Piece(cost, m), 4, cm, False, B).mem
    assert plain.carry == max(plain.saved, plain.grads, plain.grads_held)  # nothing gathered: nothing kept


def test_the_estimated_table_prices_the_embedding_and_head_as_their_own_search_on_each_mesh(stack, monkeypatch):
    """The estimated table prices a mesh's blocks as replicas of a base's block (``stack._replicated``), but its
    pre and post pieces (embeddings; final norm and head) as their own search on that mesh (``planner.stack``
    module docstring, 5), as the exact table and ``StackTable.stage_cost`` plan them: a replica of 1x1's embedding
    holds its gradient whole (the partial sums a ZeRO-3 replica produces), where the search on 4x1 shards the
    table over the vocabulary and produces its gradient sharded (GPT-39B's embedding on 4x1: 0.797 GiB held as a
    replica, 0.199 by its own search; docs/benchmarks.md, issue 29 item 6, est29c)."""
    from meshpilot.planner.stack import StackTable, TableCosting

    seen = {}
    real = StackTable._offer

    def spy(self, ctx, win, key, specials, blk, c):
        if self.costing == TableCosting.ESTIMATED:
            seen.setdefault(c.shape, (specials, ctx.pres, ctx.posts))
        return real(self, ctx, win, key, specials, blk, c)

    monkeypatch.setattr(StackTable, "_offer", spy)
    B, shape = 4, (4, 1)
    plan_pipeline(stack, "alpa-p3x8", microbatches=B, num_devices=4, costing="estimated", workers=1)
    (pre_pieces, post_pieces), pres, posts = seen[shape]
    sp = StagePlanner(stack.graph, "alpa-p3x8")
    checked = 0
    for pieces, ranges in ((pre_pieces, pres), (post_pieces, posts)):
        for x, rng in zip(pieces[1:], ranges[1:]):
            if x is None:
                continue
            _, own = sp.plan_with_memory(*rng, range(4), shape, microbatches=B)
            assert x.mem == own, rng
            checked += 1
    assert checked >= 2
    _, one = sp.plan_with_memory(0, stack.pre, range(1), (1, 1), microbatches=B)
    embedding = pre_pieces[pres.index((0, stack.pre))].mem
    assert embedding.grads_held < one.grads_held  # produced sharded, not whole as a replica's
