"""The suite's two tiers: what `pytest -q` (CI, the README's command) runs, and the full matrix.

Every mechanism is checked in the default tier, on at least one model and one world size, against the single
device. The full matrix repeats those checks on more models, meshes, families and world sizes (8 ranks): on
a 2-core AMD EPYC machine it took 35 minutes quiet and CI past its 90 busy (8 ranks cost 2.4-4.4x the
per-collective cost of 4, ``benchmarks/bench_gloo_ranks.py``); the default tier took 23 minutes, 0.64x the full
matrix's CPU s (docs/benchmarks.md, "The suite in two tiers"). The full matrix runs only with
``MESHPILOT_TEST_FULL=1``. A test, or a fixture
parameter, outside the default tier carries ``@pytest.mark.full`` (skipped with the reason, so the count shows
in every run: :func:`params` marks a list of them); a matrix a test loops over itself is chosen with
:func:`matrix`. Before a change to the runtime
or the planner lands, run the full matrix once: ``MESHPILOT_TEST_FULL=1 .venv/bin/python -m pytest -q``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Sequence
from typing import Any, TypeVar

import pytest

FULL_ENV = "MESHPILOT_TEST_FULL"
FULL = os.environ.get(FULL_ENV, "") == "1"

T = TypeVar("T")


def matrix(default: Sequence[T], full: Sequence[T]) -> tuple[T, ...]:
    """`full` under ``MESHPILOT_TEST_FULL=1``, else `default` (which must be a part of `full`: the default tier
    checks nothing the full matrix does not)."""
    missing = [x for x in default if x not in full]
    assert not missing, f"the default tier's {missing} are not in the full matrix"
    return tuple(full if FULL else default)


def params(full: Iterable[T], default: Collection[T]) -> list[Any]:
    """`full` as ``parametrize`` values (or a fixture's ``params``): each one not in `default` marked
    ``@pytest.mark.full`` (skipped with the reason unless ``MESHPILOT_TEST_FULL=1``), in `full`'s order."""
    return [x if x in default else pytest.param(x, marks=pytest.mark.full) for x in full]
