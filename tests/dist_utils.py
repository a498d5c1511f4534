"""Run a function in N real ``torch.distributed`` processes (gloo, CPU) from a test.

``run_distributed(fn, world_size, *args)`` calls ``fn(*args)`` in each of ``world_size`` ranks and returns
the list of per-rank return values, indexed by rank. Inside ``fn`` the rank is
``torch.distributed.get_rank()``. The ranks are interpreters started with the ``spawn`` method (no forked
OpenMP pools) and joined into one gloo group through a ``FileStore`` in a private temporary directory (no TCP
port to pick or race for), once per world size: they stay up and take the next call of that size (a
:class:`_Pool`), so the suite starts 4 ranks once rather than once per test module. Each call still starts
as a fresh process did: the parent's environment, torch's initial random state, no cached captures.

If a rank raises, the ranks are terminated (a peer may be stuck in a collective) and the parent raises
``DistributedTestError`` whose message holds the failing rank's traceback text; the next call starts fresh
ranks. A rank that hangs is killed after ``timeout`` seconds and reported the same way.

``fn`` and its arguments must be picklable: define ``fn`` at module level in the test module
(pytest's default ``prepend`` import mode puts ``tests/`` on ``sys.path``, which the spawned
children inherit), and pass plain data. Return values come back through pickled files, so they
can be large. Return CPU tensors or plain Python data.

A capture (``OpGraph``) pickles (``meshpilot.graph.portable``): a capture the parent made is an argument like
any other, pickled once with the task and loaded by each rank, where tracing the model in every rank cost each
rank the capture's CPU again (a sixth of a 4-rank test's). ``run_distributed(..., graphs=)`` hands the ranks'
:func:`graph_of` and :func:`cached_graph` the parent's captures under their keys (:func:`captures` makes them).

``lockstep_adamw(ref, pm, inputs, steps)`` is the check most workers run inside ``fn``: the
single-device model and its ``parallelize``'d copy trained side by side, compared step by step;
``tiny_gpt()`` the seeded tiny GPT and batch the host-cost tests time and count.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import shutil
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["DistributedTestError", "cached_graph", "captures", "graph_of", "lockstep_adamw", "run_distributed"]


class DistributedTestError(RuntimeError):
    """A spawned rank raised, crashed or timed out; the message carries its traceback."""


_TORCH_SEED = 67280421310721
"""torch's default generator seed in a fresh process: every task starts from it, as a fresh spawn did."""


def _serve(rank: int, world_size: int, tmpdir: str, backend: str, threads: int, tasks: Any) -> None:
    """One rank of a :class:`_Pool`: join the gloo group once, then run each task the parent sends on `tasks`
    (a pipe) until it closes. A task's result goes to ``rank{r}.{task}.pkl`` in `tmpdir`."""
    # a segfault in native code (gloo) leaves no traceback: faulthandler writes every thread's Python stack
    # here, and the parent puts it in the failure message
    fault = open(os.path.join(tmpdir, f"rank{rank}.fault"), "w")  # noqa: SIM115 - open until the process dies
    faulthandler.enable(file=fault, all_threads=True)
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(tmpdir, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    while True:
        try:
            message = tasks.recv()
        except EOFError:  # the parent is gone
            break
        if message is None:
            break
        task, payload = message
        try:
            fn, args, kwargs, env, graphs = pickle.loads(payload)  # imports the test module that defines fn
            # what a fresh spawn gave the task: the parent's environment now, torch's initial random state, no
            # captures cached by an earlier task (``graph_of``'s keys name a model only within one test module),
            # those the parent made for this one
            os.environ.clear()
            os.environ.update(env)
            torch.manual_seed(_TORCH_SEED)
            _GRAPHS.clear()
            _GRAPHS.update(graphs)
            result = fn(*args, **kwargs)
            # Barrier so no rank reports (and the parent sends the next task) while a peer is still in this
            # one's collectives. On an error there is no barrier (peers may be stuck); the parent kills them.
            dist.barrier()
            out = ("ok", result)
        except BaseException:  # noqa: BLE001 - everything must reach the parent as text
            out = ("error", traceback.format_exc())
        path = os.path.join(tmpdir, f"rank{rank}.{task}.pkl")
        with open(path + ".tmp", "wb") as fh:
            pickle.dump(out, fh)
        os.replace(path + ".tmp", path)
        del out
        gc.collect()
        _trim_heap()  # an idle rank gives back what the task freed: a pool of each size stays up
    dist.destroy_process_group()


def _trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``; nothing elsewhere)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class _Pool:
    """`world_size` ranks in one gloo group, started once and given one task after another: the suite's
    multi-rank checks pay for the processes, ``import torch`` and the group once per world size, not once per
    test module (measured: 12.8 s of CPU to start 4 ranks that import the runtime and do nothing)."""

    def __init__(self, world_size: int, backend: str, threads: int) -> None:
        _log_pool_start(world_size)
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tmpdir = tempfile.mkdtemp(prefix="meshpilot-dist-")
        self.tasks = 0
        self.pipes = []
        self.procs = []
        for rank in range(world_size):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(rank, world_size, self.tmpdir, backend, threads, theirs))
            p.start()
            theirs.close()
            self.pipes.append(ours)
            self.procs.append(p)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float, graphs: dict) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank, with `graphs` in the ranks' capture cache; each rank's result.
        On any failure the pool is closed (a rank left in a collective cannot be reused) and
        :class:`DistributedTestError` raised."""
        self.tasks += 1
        task = self.tasks
        payload = pickle.dumps((fn, args, kwargs, dict(os.environ), graphs))
        for pipe in self.pipes:
            pipe.send((task, payload))
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failure: str | None = None
        crashed = False
        while len(results) < self.world_size and failure is None:
            # a rank that died first: its peers then fail in a collective, and the death is the news
            for rank, p in enumerate(self.procs):
                path = os.path.join(self.tmpdir, f"rank{rank}.{task}.pkl")
                if rank not in results and not p.is_alive() and not os.path.exists(path):
                    failure = f"rank {rank} exited with code {p.exitcode} without a result"
                    crashed = p.exitcode is not None and p.exitcode < 0
                    stack = _read(os.path.join(self.tmpdir, f"rank{rank}.fault"))
                    if stack:
                        failure += f"; its Python stacks when it died:\n{stack}"
                    break
            for rank in range(self.world_size):
                path = os.path.join(self.tmpdir, f"rank{rank}.{task}.pkl")
                if failure is not None or rank in results or not os.path.exists(path):
                    continue
                with open(path, "rb") as fh:
                    status, value = pickle.load(fh)
                os.remove(path)
                if status != "ok":
                    failure = f"rank {rank} raised:\n{value}"
                    break
                results[rank] = value
            if len(results) < self.world_size and failure is None:
                if time.monotonic() > deadline:
                    pending = sorted(set(range(self.world_size)) - set(results))
                    failure = f"timed out after {timeout:.0f}s; ranks still running: {pending}"
                    break
                time.sleep(0.05)
        if failure is not None:
            self.close(force=True)
            raise (_RankCrashed if crashed else DistributedTestError)(failure)
        return [results[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False) -> None:
        """Stop the ranks: asked to finish (they leave the group together), or terminated when `force` (a
        failed task may have left them in a collective)."""
        for pipe in self.pipes:
            try:
                if not force:
                    pipe.send(None)
                pipe.close()
            except OSError:
                pass
        for p in self.procs:
            if force and p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10 if not force else 5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        _POOLS.pop(next((k for k, v in _POOLS.items() if v is self), None), None)


def _log_pool_start(world_size: int) -> None:
    """With ``MESHPILOT_TEST_CPU=DIR`` (``tests/conftest.py``'s CPU log), one line per pool started in
    ``DIR/pools.<pid>.tsv``: the time, the world size and the pools then alive — every start after the first of
    a size is a restart the suite pays ``import torch`` and the first task's lazy imports for again."""
    out = os.environ.get("MESHPILOT_TEST_CPU")
    if not out or not os.path.isdir(out):
        return
    with open(os.path.join(out, f"pools.{os.getpid()}.tsv"), "a") as fh:
        fh.write(f"{time.strftime('%H:%M:%S')}\t{world_size}\t{sorted(k[0] for k in _POOLS)}\n")


_POOLS: dict[tuple[int, str, int], _Pool] = {}
"""The live pools, by (world size, backend, threads per rank), the most recently used last."""

MAX_POOLS = 2
"""Pools kept alive at once (4 and 8 ranks, the suite's two sizes); the least recently used one beyond
closes, so an idle pool does not hold its memory for the rest of the run."""


def _pool(world_size: int, backend: str, threads: int) -> _Pool:
    key = (world_size, backend, threads)
    pool = _POOLS.pop(key, None)
    if pool is not None and not pool.alive():
        pool.close(force=True)
        pool = None
    if pool is None:
        while len(_POOLS) >= MAX_POOLS:
            _POOLS[next(iter(_POOLS))].close()
        pool = _Pool(world_size, backend, threads)
    _POOLS[key] = pool
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


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
    timeout: float = 300.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    graphs: dict | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result, indexed by rank.

    ``timeout`` bounds the run (seconds); ``threads_per_rank`` sets ``torch.set_num_threads`` in each rank
    (keep 1 on shared CPUs). The ranks are a :class:`_Pool`'s, kept for the next call of the same size.
    ``graphs`` (:func:`captures`' keys and captures) are what :func:`graph_of` and :func:`cached_graph` find in
    each rank before they capture.

    A rank killed by a signal before it reported (seen once: a segfault in one of 8 ranks of a duplex run that
    passed on every rerun) is retried once on fresh ranks, with a warning that names it, so the crash is
    visible in the test report; a second crash, and every exception or timeout, fails the test.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    try:
        return _pool(world_size, backend, threads_per_rank).run(fn, args, kwargs, timeout, dict(graphs or {}))
    except _RankCrashed as crash:
        warnings.warn(f"{fn.__name__} on {world_size} ranks: {crash}; retried once", stacklevel=2)
        return _pool(world_size, backend, threads_per_rank).run(fn, args, kwargs, timeout, dict(graphs or {}))


_GRAPHS: dict = {}


def graph_of(key: str, model: Any, plan: Any) -> Any:
    """A capture of `model` at `plan`'s input shapes, made once per rank for each (key, shapes, precision):
    several plans of one model then run without tracing it again (``parallelize(..., graph=)``; the plan's
    fingerprint is still checked against it). `key` names the model build, `plan` is a ``StagePlan`` in
    float32 (``parallelize`` casts the model before it captures a lower-precision plan: None lets it). The
    capture is the one ``parallelize`` would make: on meta inputs, answering the plan's guards (the values the
    model's Python read from its inputs), which are part of the key. One the parent made (:func:`captures`,
    ``run_distributed(..., graphs=)``) is taken as it is."""
    key_, make = _graph_of(key, model, plan)
    return None if key_ is None else cached_graph(key_, make)


def captures(*builds: tuple[str, Any, Any], into: dict | None = None) -> dict:
    """For ``run_distributed(..., graphs=)``: each (key, model, plan)'s capture under the key :func:`graph_of`
    finds it by in the ranks, made here once (in the parent: not cached in this process, whose test modules
    may reuse a key for another model) — one trace for the task where every rank traced. `into` (returned):
    captures made already, by key; one of them is not made again."""
    out: dict = {} if into is None else into
    for key, model, plan in builds:
        key_, make = _graph_of(key, model, plan)
        if key_ is not None and key_ not in out:
            out[key_] = make()
    return out


def _graph_of(key: str, model: Any, plan: Any) -> tuple[tuple | None, Callable[[], Any]]:
    """:func:`graph_of`'s cache key and capture (None for a lower-precision plan)."""
    import torch

    from meshpilot.graph.capture import Precision, capture, dtype_from_name

    shapes = tuple((tuple(shape), dt) for shape, dt in plan.input_shapes)
    guards = tuple((name, tuple(values)) for name, values in plan.guards)

    def make() -> Any:
        examples = [torch.empty(shape, dtype=dtype_from_name(dt), device="meta") for shape, dt in shapes]
        return capture(model, examples, precision=plan.precision, guards=plan.guards)

    if Precision.of_label(plan.precision) not in (None, Precision.FP32):
        return None, make
    return (key, shapes, plan.precision, guards), make


def cached_graph(key: tuple, make: Callable[[], Any]) -> Any:
    """``make()`` (a capture), made once per rank under `key` and kept until the task ends: :func:`graph_of`'s,
    and captures ``graph_of`` does not make (a pipeline's, at one microbatch). One the parent passed under
    `key` (``run_distributed(..., graphs={key: capture})``) is taken as it is."""
    if key not in _GRAPHS:
        _GRAPHS[key] = make()
    return _GRAPHS[key]


def tiny_gpt() -> tuple:
    """A seeded tiny GPT (``gpt_tiny``, batch 2, sequence 16) and its (tokens, targets): the same weights and
    batch on every call."""
    import torch

    from meshpilot.models.gpt import GPT, gpt_tiny

    torch.manual_seed(0)
    model = GPT(gpt_tiny(batch=2, seq=16))
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (2, 17), generator=g)
    return model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())


def lockstep_adamw(
    ref: Any, pm: Any, inputs: Any, steps: int, lr: float = 1e-2, ref64: Any = None, at_own_weights: bool = False
) -> dict:
    """Train the single-device `ref` and the parallelized `pm` (a ``ParallelModule``) side by side with AdamW.

    Per step: ``loss`` (|loss difference|), ``grad`` (largest |gradient difference| over the parameters) and
    ``counts`` (the collectives `pm`'s forward and backward issued, ``CollectiveLog.counts()``); after
    the last step ``param`` (largest |parameter difference|). The last step's gradients are left in place.

    ``ref64``, a float64 copy of `ref` (the same initial weights), is the referee for a difference: it trains
    in lockstep and per step ``grad64_ref`` / ``grad64_par`` are how far the float32 single-device and the
    parallel gradients are from its. A parallel run no farther from float64 than the single device is as
    exact as float32 allows (another order of the same sums, amplified by AdamW where a gradient is near its
    eps), however far the two float32 runs are from each other.

    With ``at_own_weights`` the referee does not train: each step it is loaded with each float32 run's own
    weights in turn and its float64 gradient there is what that run's gradient is held to. The distances are
    then each step's rounding alone, not a trajectory's: after a few AdamW steps the two float32 runs sit at
    different weights (a near-zero gradient's sign flipped by rounding moves its weight by up to ``lr``), and how
    far each trajectory is from float64's differs from CPU to CPU (a sequence-parallel GPT's third step: 1.6e-4
    against the single device's 4.5e-5 on an AMD EPYC, within 2x on an Intel Xeon).
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
        if o_64 is not None and not at_own_weights:
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
        if o_64 is not None and at_own_weights:
            g_ref = _grads_at(ref64, [a for a, _ in pairs], inputs, 1000 + step)
            g_par = _grads_at(ref64, [_whole(p) for _, p in pairs], inputs, 1000 + step)
            out.setdefault("grad64_ref", []).append(max(_grad_difference(b, a.grad) for (a, _), b in zip(pairs, g_ref)))
            out.setdefault("grad64_par", []).append(max(_grad_difference(b, p.grad) for (_, p), b in zip(pairs, g_par)))
        elif o_64 is not None:
            g64 = [p.grad for p in ref64.parameters()]
            out.setdefault("grad64_ref", []).append(max(_grad_difference(b, a.grad) for (a, _), b in zip(pairs, g64)))
            out.setdefault("grad64_par", []).append(max(_grad_difference(b, p.grad) for (_, p), b in zip(pairs, g64)))
            o_64.step()
        o_ref.step()
        o_par.step()
    out["param"] = max(_largest((a - _whole(b)).abs()) for a, b in pairs)
    return out


def _grads_at(ref64: Any, weights: list, inputs: Any, seed: int) -> list:
    """The float64 `ref64`'s gradients (copies) at `weights` (float32 tensors in its parameters' order)."""
    import torch

    with torch.no_grad():
        for p, w in zip(ref64.parameters(), weights):
            p.copy_(w.detach().double())
    ref64.zero_grad()
    torch.manual_seed(seed)
    ref64(*[x.double() if torch.is_floating_point(x) else x for x in inputs]).backward()
    return [None if p.grad is None else p.grad.clone() for p in ref64.parameters()]


def _largest(x: Any) -> float:
    """``x.max()``, 0.0 for a tensor with no elements (a tiny config's zero-width weight: MobileBERT's)."""
    return x.max().item() if x.numel() else 0.0


def _grad_difference(ref: Any, got: Any) -> float:
    """Largest |difference| of one parameter's gradients; a parameter the loss does not read (BART's causal
    LM: the encoder-side weights) has None on both sides (0.0), on one side only infinity."""
    if ref is None or got is None:
        return 0.0 if ref is None and got is None else float("inf")
    full = _whole(got)
    return _largest((ref - full.to(ref.dtype)).abs())


def _whole(t: Any) -> Any:
    """`t`'s whole value: a DTensor's full tensor, a plain tensor itself (a plan that replicates every
    parameter keeps them plain: ``ParallelModule.plain``)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
