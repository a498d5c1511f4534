"""Suite-wide collection order: the long files first.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadfile`` in ``pyproject.toml``): each file stays on
one worker, so a module's fixtures (one multi-rank spawn per world size) are built once. xdist hands out files in
collection order, so the files whose spawns take minutes go first and the short ones fill in behind them; in
alphabetical order the longest (``test_pipeline_runtime.py``) would start last and run alone at the end.
The list is the suite's ``--durations`` report (heaviest first); a file missing from it only runs later.
"""

from __future__ import annotations

import pytest

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
