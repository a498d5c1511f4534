"""Suite-wide collection order: the long files first.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadfile`` in ``pyproject.toml``): each file stays on
one worker, so a module's fixtures (one multi-rank spawn per world size) are built once. xdist hands out files in
collection order (``--no-loadscope-reorder`` in ``pyproject.toml``: by default xdist re-sorts the files by their
number of tests, which sent the few-test, minutes-long files such as ``test_emulate.py`` and ``test_hf_models.py``
last), so the files whose spawns take minutes go first and the short ones fill in behind them. The list is the
files' CPU seconds, heaviest first (``MESHPILOT_TEST_CPU``, below: a quiet suite at 66bba7a); a file missing from it
only runs later.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from tiers import FULL, FULL_ENV

# Property tests share two cores with the other worker's multi-rank spawns: generating inputs can take over a
# second there (hypothesis' too_slow health check failed test_schedule once in a full run), which says nothing
# about the code under test, so neither generation time nor per-example time is held against them.
settings.register_profile("suite", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("suite")

HEAVY_FIRST = (
    "test_models_parallel.py",
    "test_hf_families.py",
    "test_pipeline_runtime.py",
    "test_pipeline_plan.py",
    "test_context_parallel.py",
    "test_frontier.py",
    "test_recompute.py",
    "test_emulate.py",
    "test_demo.py",
    "test_checkpoint.py",
    "test_grad_buckets.py",
    "test_hf_models.py",
    "test_bad_input.py",
    "test_moe_dropless.py",
    "test_probe.py",
    "test_layouts.py",
    "test_model_sources.py",
    "test_duplex.py",
    "test_capture_stacked.py",
    "test_sequence_parallel.py",
    "test_stack_approx.py",
    "test_ilp.py",
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if not FULL:
        skip = pytest.mark.skip(reason=f"the full matrix only: {FULL_ENV}=1 (tests/tiers.py)")
        for item in items:
            if "full" in item.keywords:
                item.add_marker(skip)
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    # sorted() is stable: within a file, and among the files not listed, the collection order stays
    items[:] = sorted(items, key=lambda item: rank.get(item.path.name, len(rank)))


# ------------------------------------------------------------------------------------------- CPU per test
# The suite's limit is CPU: two cores, and most of a multi-rank test's work happens in pool ranks and torchrun
# children that pytest's --durations (wall, one process) cannot see. With MESHPILOT_TEST_CPU=DIR (root, and the
# cgroup-v1 cpuacct controller mounted, as on this project's machines) each pytest process moves itself into a
# cpuacct cgroup of its own, which every process it starts afterwards inherits, and appends one line per test to
# DIR/cpu.<pid>.tsv: node id, CPU seconds of that cgroup over the test's setup, call and teardown (its ranks and
# children included: a pool started by a test is charged to it), wall seconds.
_CPUACCT = "/sys/fs/cgroup/cpuacct"


def _cpu_log_dir() -> str | None:
    import os

    out = os.environ.get("MESHPILOT_TEST_CPU")
    return out if out and os.access(_CPUACCT, os.W_OK) else None


def _cgroup_usage_s(group: str) -> float:
    with open(f"{group}/cpuacct.usage") as fh:
        return int(fh.read()) / 1e9


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    import atexit
    import os

    out = _cpu_log_dir()
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    group = f"{_CPUACCT}/meshpilot-tests-{os.getpid()}"
    os.makedirs(group, exist_ok=True)
    with open(f"{group}/cgroup.procs", "w") as fh:
        fh.write(str(os.getpid()))
    session.config._cpu_cgroup = group  # type: ignore[attr-defined]
    session.config._cpu_log = f"{out}/cpu.{os.getpid()}.tsv"  # type: ignore[attr-defined]
    atexit.register(_leave_cgroup, group)  # after the test pools' own atexit closes them (atexit runs LIFO)


def _leave_cgroup(group: str) -> None:
    import contextlib
    import os

    with open(f"{_CPUACCT}/cgroup.procs", "w") as fh:
        fh.write(str(os.getpid()))
    with contextlib.suppress(OSError):  # a child outlived the session: the empty group stays until a reboot
        os.rmdir(group)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    import time

    group = getattr(item.config, "_cpu_cgroup", None)
    if group is None:
        yield
        return
    c0, w0 = _cgroup_usage_s(group), time.perf_counter()
    yield
    with open(item.config._cpu_log, "a") as log:  # type: ignore[attr-defined]
        log.write(f"{item.nodeid}\t{_cgroup_usage_s(group) - c0:.1f}\t{time.perf_counter() - w0:.1f}\n")


@pytest.fixture(scope="module")
def group():
    """A gloo process group of one rank in this process (a test module's own, or the one already made)."""
    import os
    import tempfile

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
