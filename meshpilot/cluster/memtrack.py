"""Measure the bytes of tensor storage a block of eager PyTorch holds at its peak, on any device.

``torch.cuda.max_memory_allocated()`` does this on CUDA; on CPU nothing does, so :class:`StorageTracker`
counts it from the dispatcher: every ATen call's output storages are added once (keyed by the storage's
C++ object, so views add nothing) and subtracted when the storage is freed (``weakref.finalize`` on the
preserved Python storage object). Storages that exist before the block (parameters, inputs) are passed
in, so the total is comparable to a plan's predicted peak. What it cannot see: allocator rounding and
kernel workspaces that never become tensors; inside a custom op (one call to the dispatcher) only where the op
runs its body through :func:`measured_inside`. Used by ``tests/test_cost_fidelity.py`` and
``benchmarks/gpu_check.py --device cpu``; :func:`adamw_step_peak` measures a training step as the memory
benchmarks and ``tests/test_sequence_parallel.py`` compare it with a plan's prediction.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class StorageTracker(TorchDispatchMode):
    """``with StorageTracker(existing=model.parameters()) as t: ...`` then ``t.peak`` (bytes) and
    ``t.peak_op`` (the ATen op whose outputs made the peak)."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        """Bytes held now."""
        self.peak = 0
        """Most bytes held at once since the tracker was made."""
        self.peak_op = ""
        for t in existing:
            self._add(t)

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def _add(self, t: torch.Tensor) -> None:
        t = getattr(t, "_local_tensor", t)  # a DTensor holds its shard
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live:
            return
        self._live[key] = storage.nbytes()
        self.current += storage.nbytes()
        weakref.finalize(storage, self._free, key)

    def __enter__(self) -> StorageTracker:
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._add(t)
        if self.current > self.peak:
            self.peak, self.peak_op = self.current, str(func)
        return out


_ACTIVE: list[StorageTracker] = []
"""The trackers open now, innermost last."""


def measured_inside(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, the body of a custom op that an open tracker sees as one call (its own allocations run
    below the tracker's mode): counted by a tracker of its own, and every open tracker's peak raised to what it
    held before the call plus the most the body held at once (its outputs are added when the op returns).
    Ring attention's key/value blocks in flight are seen so (:mod:`meshpilot.ops.ring`)."""
    if not _ACTIVE:
        return fn(*args)
    outer = list(_ACTIVE)
    with StorageTracker(existing=[a for a in args if isinstance(a, torch.Tensor)]) as inner:
        before = inner.peak = inner.current  # the operands: held already, by the callers
        out = fn(*args)
    for t in outer:
        if t.current + inner.peak - before > t.peak:
            t.peak, t.peak_op = t.current + inner.peak - before, f"{what} ({inner.peak_op})"
    return out


def adamw_step_peak(module: torch.nn.Module, inputs: tuple, held: Callable[[], Iterable[torch.Tensor]] = tuple) -> int:
    """This process' peak storage bytes over two training steps of `module` (``module(*inputs).backward()``, a
    foreach AdamW step, ``zero_grad(set_to_none=True)``) after one warm-up step: the step a plan's predicted
    peak describes. What persists across steps is counted from the start: the parameters, AdamW's states, the
    inputs and `held()` (tensors the warm-up made that stay, such as ZeRO-2's gathered copies)."""
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=True)

    def step() -> None:
        module(*inputs).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    with StorageTracker(existing=[*module.parameters(), *state, *held(), *inputs]) as tracker:
        step()
        step()
    return tracker.peak
