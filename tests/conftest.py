"""Suite-wide collection order: the long files first.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadfile`` in ``pyproject.toml``): each file stays on
one worker, so a module's fixtures (one multi-rank spawn per world size) are built once. xdist hands out files in
collection order, so the files whose spawns take minutes go first and the short ones fill in behind them; in
alphabetical order the longest (``test_pipeline_runtime.py``) would start last and run alone at the end.
The list is the suite's ``--durations`` report (heaviest first); a file missing from it only runs later.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

# Property tests share two cores with the other worker's multi-rank spawns: generating inputs can take over a
# second there (hypothesis' too_slow health check failed test_schedule once in a full run), which says nothing
# about the code under test, so neither generation time nor per-example time is held against them.
settings.register_profile("suite", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("suite")

HEAVY_FIRST = (
    "test_models_parallel.py",
    "test_pipeline_runtime.py",
    "test_hf_models.py",
    "test_hf_families.py",
    "test_checkpoint.py",
    "test_duplex.py",
    "test_emulate.py",
    "test_moe_dropless.py",
    "test_atp_layers.py",
    "test_layouts.py",
    "test_demo.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    # sorted() is stable: within a file, and among the files not listed, the collection order stays
    items[:] = sorted(items, key=lambda item: rank.get(item.path.name, len(rank)))
