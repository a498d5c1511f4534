"""The multi-process harness itself: a rank that dies by a signal is reported with its Python stack and
retried once; a second crash fails. The parent's captures (``graphs=``) are what the ranks' capture cache holds
for that task, and only that task."""

from __future__ import annotations

import os

import pytest
from dist_utils import DistributedTestError, run_distributed


def _crash_once(marker: str) -> int:
    import ctypes

    import torch.distributed as dist

    if dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        ctypes.string_at(0)  # SIGSEGV in native code, as gloo once did
    return dist.get_rank()


def _crash_always() -> None:
    import ctypes

    import torch.distributed as dist

    if dist.get_rank() == 1:
        ctypes.string_at(0)


def test_a_rank_killed_by_a_signal_is_reported_with_its_stack_and_retried_once(tmp_path):
    with pytest.warns(UserWarning, match=r"(?s)_crash_once on 2 ranks: rank 1 exited with code -11.*_crash_once"):
        assert run_distributed(_crash_once, 2, str(tmp_path / "crashed")) == [0, 1]
    with pytest.raises(DistributedTestError, match="exited with code -11"), pytest.warns(UserWarning):
        run_distributed(_crash_always, 2)


def _cached(key: tuple) -> tuple:
    from dist_utils import cached_graph

    return cached_graph(key, lambda: "traced in the rank"), cached_graph(("other",), lambda: "traced in the rank")


def test_the_parents_captures_are_the_ranks_for_one_task():
    got = run_distributed(_cached, 2, ("k",), graphs={("k",): "the parent's"})
    assert got == [("the parent's", "traced in the rank")] * 2
    assert run_distributed(_cached, 2, ("k",)) == [("traced in the rank", "traced in the rank")] * 2
