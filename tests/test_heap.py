"""``planner.heap``: planning freezes the process's objects (and the captured graph) while it runs, unfreezes
them however it ends, leaves a process that froze objects itself or disabled the collector alone, and plans
the same plan as without it."""

from __future__ import annotations

import gc

import pytest
import torch
from test_planner_search import Wide

from meshpilot.planner import auto, heap
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

    def capture(*a, **k):
        seen.append(("capture", gc.get_freeze_count()))
        return orig_capture(*a, **k)

    def structures(self, *a, **k):
        seen.append(("search", gc.get_freeze_count()))
        return orig_structures(self, *a, **k)

    monkeypatch.setattr(auto, "capture", capture)
    monkeypatch.setattr(auto._ShapeSearch, "structures", structures)
    plan(_wide(), _x(), "dgx-h100:4", mesh_shape=(4, 1), mappings=("row",))
    assert gc.get_freeze_count() == 0
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


def test_unfrozen_on_error():
    with pytest.raises(ValueError), heap.spared_from_collection() as more:
        assert gc.get_freeze_count() > 0
        more()
        raise ValueError("planning failed")
    assert gc.get_freeze_count() == 0


def test_disabled_collector_left_alone():
    gc.disable()
    try:
        with heap.spared_from_collection() as more:
            more()
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
