"""``planner.heap``: planning freezes the process's objects (and the captured graph) while it runs, unfreezes
them however it ends, leaves a process that froze objects itself or disabled the collector alone, and plans
the same plan as without it."""

from __future__ import annotations

import gc

import pytest
import torch
from test_planner_search import Wide

from meshpilot.planner import auto, heap, pipeline
from meshpilot.planner.auto import plan


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def _wide():
    with torch.device("meta"):
        return Wide(256)


def _x():
    return (torch.empty(512, 256, device="meta"),)


def test_plan_freezes_while_planning_and_unfreezes_after(monkeypatch):
    seen = []
    orig_capture, orig_structures = auto.capture, auto._ShapeSearch.structures
    threshold = gc.get_threshold()

    def capture(*a, **k):
        seen.append(("capture", gc.get_freeze_count()))
        assert gc.get_threshold()[0] == heap.CAPTURE  # no young collections while capturing (heap.kept)
        return orig_capture(*a, **k)

    def structures(self, *a, **k):
        seen.append(("search", gc.get_freeze_count()))
        return orig_structures(self, *a, **k)

    monkeypatch.setattr(auto, "capture", capture)
    monkeypatch.setattr(auto._ShapeSearch, "structures", structures)
    plan(_wide(), _x(), "dgx-h100:4", mesh_shape=(4, 1), mappings=("row",))
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold
    (_, at_capture), (_, at_search), _ = seen
    assert at_capture > 0
    assert at_search > at_capture  # the captured graph frozen as well


def test_plan_is_the_same_with_and_without_the_freeze(monkeypatch):
    a = plan(_wide(), _x(), "dgx-h100:4", mesh_shape=(4, 1), mappings=("row",))
    gc.freeze()  # a process that froze objects itself: planning freezes nothing more
    count = gc.get_freeze_count()
    b = plan(_wide(), _x(), "dgx-h100:4", mesh_shape=(4, 1), mappings=("row",))
    # its own objects stay frozen (but for those freed by their count meanwhile), none of planning's added
    assert 0.9 * count < gc.get_freeze_count() <= count
    assert a.strategy_lines() == b.strategy_lines()
    assert a.time.total_s == b.time.total_s


def test_kept_collects_nothing_young_and_freezes_after():
    with heap.kept():  # outside a block: nothing changed
        assert gc.get_threshold()[0] < heap.YOUNG and gc.get_freeze_count() == 0
    with heap.spared_from_collection():
        before = gc.get_freeze_count()
        with heap.kept():
            assert gc.get_threshold()[0] == heap.CAPTURE
            made = [[i] for i in range(1000)]  # noqa: F841 - young objects that survive the block
        assert gc.get_threshold()[0] == heap.YOUNG and gc.get_freeze_count() >= before + 1000
    assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] < heap.YOUNG


def test_unfrozen_on_error():
    with pytest.raises(ValueError), heap.spared_from_collection() as more:
        assert gc.get_freeze_count() > 0
        more()
        raise ValueError("planning failed")
    assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] < heap.YOUNG  # CPython's 700 back


def test_disabled_collector_left_alone():
    gc.disable()
    try:
        with heap.spared_from_collection() as more:
            more()
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_plan_pipeline_freezes_and_its_workers_start_frozen(monkeypatch, tmp_path):
    """``plan_pipeline`` freezes the process's objects while it plans, its forked workers start with everything
    the parent held at the fork frozen (the planner too: more than on entry), everything is unfrozen after, and
    the plan is the one planned with nothing frozen by it (a process that froze objects itself)."""
    from test_pipeline_plan import _capture

    from meshpilot.models import _gpt_builder
    from meshpilot.models.gpt import gpt_tiny
    from meshpilot.planner.stage import StagePlanner

    graph = _capture(*_gpt_builder(gpt_tiny(layers=4, batch=16, hidden=256))("meta", 4))
    seen = tmp_path / "frozen"
    orig_mark, orig_prepare = StagePlanner.mark, pipeline._prepare
    entry = []

    def mark(self):  # in a worker (forked), before its column
        with open(seen, "a") as f:
            f.write(f"{gc.get_freeze_count()}\n")
        return orig_mark(self)

    def prepare(*a, **k):
        entry.append(gc.get_freeze_count())
        return orig_prepare(*a, **k)

    monkeypatch.setattr(StagePlanner, "mark", mark)
    monkeypatch.setattr(pipeline, "_prepare", prepare)
    kw = dict(microbatches=4, num_devices=4, workers=2)  # 4 devices: 100 CPU s on 8 (a 2-core AMD EPYC)
    a = pipeline.plan_pipeline(graph, "alpa-p3x8", **kw)
    assert gc.get_freeze_count() == 0
    in_workers = [int(x) for x in seen.read_text().split()]
    assert entry[0] > 0 and len(in_workers) >= 2 and min(in_workers) > entry[0]
    gc.freeze()  # the process's own freeze: plan_pipeline (and the workers) freeze nothing more
    count = gc.get_freeze_count()
    b = pipeline.plan_pipeline(graph, "alpa-p3x8", **kw)
    assert gc.get_freeze_count() <= count
    assert [(s.layers, s.ranks, s.mesh_shape, s.t_s) for s in a.stages] == [
        (s.layers, s.ranks, s.mesh_shape, s.t_s) for s in b.stages
    ]
    assert a.step_s == b.step_s


def test_freeze_more_only_inside_an_owned_block():
    heap.freeze_more()
    assert gc.get_freeze_count() == 0
    with heap.spared_from_collection() as more:
        count = gc.get_freeze_count()
        made = [[] for _ in range(1000)]
        with heap.spared_from_collection() as inner:  # nested: freezes (the new objects), unfreezes nothing
            inner()
            assert gc.get_freeze_count() >= count + 1000
        assert gc.get_freeze_count() > count
        more()
        del made
    assert gc.get_freeze_count() == 0
