"""Run a function in N real ``torch.distributed`` processes (gloo, CPU) from a test.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters (the
``spawn`` start method: no forked OpenMP pools), joins them into one gloo process group through
a ``FileStore`` in a private temporary directory (no TCP port to pick or race for), calls
``fn(*args)`` in each, and returns the list of per-rank return values, indexed by rank. Inside
``fn`` the rank is ``torch.distributed.get_rank()``.

If a rank raises, the others are terminated and the parent raises ``DistributedTestError``
whose message holds the failing rank's traceback text. A rank that hangs is killed after
``timeout`` seconds and reported the same way.

``fn`` and its arguments must be picklable: define ``fn`` at module level in the test module
(pytest's default ``prepend`` import mode puts ``tests/`` on ``sys.path``, which the spawned
children inherit), and pass plain data. Return values come back through pickled files, so they
can be large. Return CPU tensors or plain Python data.

``lockstep_adamw(ref, pm, inputs, steps)`` is the check most workers run inside ``fn``: the
single-device model and its ``parallelize``'d copy trained side by side, compared step by step.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["DistributedTestError", "lockstep_adamw", "run_distributed"]


class DistributedTestError(RuntimeError):
    """A spawned rank raised, crashed or timed out; the message carries its traceback."""


def _child(
    rank: int,
    world_size: int,
    tmpdir: str,
    backend: str,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    out_path = os.path.join(tmpdir, f"rank{rank}.pkl")
    # a segfault in native code (gloo) leaves no traceback: faulthandler writes every thread's Python stack
    # here, and the parent puts it in the failure message
    fault = open(os.path.join(tmpdir, f"rank{rank}.fault"), "w")  # noqa: SIM115 - open until the process dies
    faulthandler.enable(file=fault, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = fn(*args, **kwargs)
        # Barrier so no rank tears down its sockets while a peer still talks to it. On an
        # error there is no barrier (peers may be stuck in a collective); the parent kills them.
        dist.barrier()
        dist.destroy_process_group()
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - everything must reach the parent as text
        payload = ("error", traceback.format_exc())
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as fh:
        pickle.dump(payload, fh)
    os.replace(tmp, out_path)


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


class _RankCrashed(DistributedTestError):
    """A rank died by a signal (a segfault in gloo's native code, say) without reporting."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result (``_run`` below).

    A rank killed by a signal before it reported (seen once: a segfault in one of 8 ranks of a duplex run that
    passed on every rerun) is retried once, with a warning that names it, so the crash is visible in the
    test report; a second crash, and every exception or timeout, fails the test.
    """
    try:
        return _run(fn, world_size, *args, **kwargs)
    except _RankCrashed as crash:
        warnings.warn(f"{fn.__name__} on {world_size} ranks: {crash}; retried once", stacklevel=2)
        return _run(fn, world_size, *args, **kwargs)


def _run(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result.

    ``timeout`` bounds the whole run (seconds); ``threads_per_rank`` sets
    ``torch.set_num_threads`` in each child (keep 1 on shared CPUs).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="meshpilot-dist-") as tmpdir:
        procs = []
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, tmpdir, backend, threads_per_rank, fn, args, kwargs),
                daemon=False,
            )
            p.start()
            procs.append(p)

        deadline = time.monotonic() + timeout
        failure: str | None = None
        crashed = False
        pending = set(range(world_size))
        while pending and failure is None:
            for rank in sorted(pending):
                p = procs[rank]
                if p.is_alive():
                    continue
                pending.discard(rank)
                path = os.path.join(tmpdir, f"rank{rank}.pkl")
                if not os.path.exists(path):
                    failure = f"rank {rank} exited with code {p.exitcode} without a result"
                    crashed = p.exitcode is not None and p.exitcode < 0
                    stack = _read(os.path.join(tmpdir, f"rank{rank}.fault"))
                    if stack:
                        failure += f"; its Python stacks when it died:\n{stack}"
                    break
                with open(path, "rb") as fh:
                    status, _ = pickle.load(fh)
                if status != "ok":
                    with open(path, "rb") as fh:
                        failure = f"rank {rank} raised:\n{pickle.load(fh)[1]}"
                    break
            if pending and failure is None:
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout:.0f}s; ranks still running: {sorted(pending)}"
                    break
                time.sleep(0.05)

        if failure is not None:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
            raise (_RankCrashed if crashed else DistributedTestError)(failure)

        results = []
        for rank, p in enumerate(procs):
            p.join()
            with open(os.path.join(tmpdir, f"rank{rank}.pkl"), "rb") as fh:
                results.append(pickle.load(fh)[1])
        return results


_GRAPHS: dict = {}


def graph_of(key: str, model: Any, plan: Any) -> Any:
    """A capture of `model` at `plan`'s input shapes, made once per rank for each (key, shapes, precision):
    several plans of one model then run without tracing it again (``parallelize(..., graph=)``; the plan's
    fingerprint is still checked against it). `key` names the model build, `plan` is a ``StagePlan`` in
    float32 (``parallelize`` casts the model before it captures a lower-precision plan: None lets it)."""
    import torch

    from meshpilot.graph.capture import Precision, capture, dtype_from_name

    if Precision.of_label(plan.precision) not in (None, Precision.FP32):
        return None
    shapes = tuple((tuple(shape), dt) for shape, dt in plan.input_shapes)
    k = (key, shapes, plan.precision)
    if k not in _GRAPHS:
        examples = [torch.empty(shape, dtype=dtype_from_name(dt), device="meta") for shape, dt in shapes]
        _GRAPHS[k] = capture(model, examples, precision=plan.precision)
    return _GRAPHS[k]


def lockstep_adamw(ref: Any, pm: Any, inputs: Any, steps: int, lr: float = 1e-2, ref64: Any = None) -> dict:
    """Train the single-device `ref` and the parallelized `pm` (a ``ParallelModule``) side by side with AdamW.

    Per step: ``loss`` (|loss difference|), ``grad`` (largest |gradient difference| over the parameters) and
    ``counts`` (the collectives `pm`'s forward and backward issued, ``CollectiveLog.counts()``); after
    the last step ``param`` (largest |parameter difference|). The last step's gradients are left in place.

    ``ref64``, a float64 copy of `ref` (the same initial weights), is the referee for a difference: it trains
    in lockstep and per step ``grad64_ref`` / ``grad64_par`` are how far the float32 single-device and the
    parallel gradients are from its. A parallel run no farther from float64 than the single device is as
    exact as float32 allows (another order of the same sums, amplified by AdamW where a gradient is near its
    eps), however far the two float32 runs are from each other.
    """
    import torch

    from meshpilot.runtime.collective_log import record_collectives

    # foreach, as meshpilot's trainer and CUDA's default do: on CPU the per-parameter loop would send every
    # AdamW op of every DTensor parameter through DTensor's dispatch (the bulk of a small model's step)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=lr, foreach=True)
    o_par = torch.optim.AdamW(pm.parameters(), lr=lr, foreach=True)
    o_64 = None if ref64 is None else torch.optim.AdamW(ref64.parameters(), lr=lr, foreach=True)
    pairs = list(zip(ref.parameters(), pm.parameters()))
    out: dict = {"loss": [], "grad": [], "counts": []}
    for step in range(steps):
        o_ref.zero_grad()
        o_par.zero_grad()
        torch.manual_seed(1000 + step)  # the same random stream (dropout) for both
        l_ref = ref(*inputs)
        l_ref.backward()
        if o_64 is not None:
            o_64.zero_grad()
            torch.manual_seed(1000 + step)
            ref64(*[x.double() if torch.is_floating_point(x) else x for x in inputs]).backward()
        torch.manual_seed(1000 + step)
        with record_collectives(pm.mesh) as log:
            loss = pm(*inputs)
            loss.backward()
        out["loss"].append(abs(l_ref.item() - loss.item()))
        out["grad"].append(max(_grad_difference(a.grad, b.grad) for a, b in pairs))
        out["counts"].append(log.counts())
        if o_64 is not None:
            g64 = [p.grad for p in ref64.parameters()]
            out.setdefault("grad64_ref", []).append(max(_grad_difference(b, a.grad) for (a, _), b in zip(pairs, g64)))
            out.setdefault("grad64_par", []).append(max(_grad_difference(b, p.grad) for (_, p), b in zip(pairs, g64)))
            o_64.step()
        o_ref.step()
        o_par.step()
    out["param"] = max((a - b.full_tensor()).abs().max().item() for a, b in pairs)
    return out


def _grad_difference(ref: Any, got: Any) -> float:
    """Largest |difference| of one parameter's gradients; a parameter the loss does not read (BART's causal
    LM: the encoder-side weights) has None on both sides (0.0), on one side only infinity."""
    if ref is None or got is None:
        return 0.0 if ref is None and got is None else float("inf")
    full = got.full_tensor() if hasattr(got, "full_tensor") else got
    return (ref - full.to(ref.dtype)).abs().max().item()
