"""Gradient accumulation's memory: the uncapped plans of ``bench_zero.py`` at M microbatches, and a census of
what each rank holds at its peak.

    python benchmarks/bench_accumulate.py plan 2 /tmp/acc2.json      # zero off, every candidate at stage 2, 3
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_zero.py measure /tmp/acc2.json
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_accumulate.py census /tmp/acc2.json

``census`` runs each plan as ``bench_zero.py measure`` does (one warm-up step, then two full foreach AdamW
steps under ``cluster.memtrack.StorageTracker``) and prints, for rank 0's peak, the bytes live there grouped
by where each storage was made: ``param`` / ``adam`` / ``copy`` (ZeRO-2 full copies) / ``input`` for what
exists before the steps, else the executor action running (``_backward[BACKWARD 1]``: microbatch 1's
backward; ``accumulate``: inside ``StepRun._accumulate``) and the ATen op that made it.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_zero as bz  # noqa: E402

from meshpilot.cluster.memtrack import StorageTracker  # noqa: E402
from meshpilot.planner.plan import StagePlan  # noqa: E402
from meshpilot.runtime import executor  # noqa: E402

WHERE = ["setup"]
"""The executor action running now (set by the wrapped handlers)."""


class Census(StorageTracker):
    """A StorageTracker that remembers where each storage was made and what was live at the peak."""

    def __init__(self, existing: list, labels: dict[int, str]) -> None:
        self.origin: dict[int, str] = {}
        self.labels, self.current_op = labels, "existing"
        super().__init__(existing)
        self.snapshot: list[tuple[int, str]] = []
        self.where = ""

    def _add(self, t: torch.Tensor) -> None:
        t = getattr(t, "_local_tensor", t)
        key = t.untyped_storage()._cdata
        if key not in self._live:
            self.origin[key] = self.labels.get(key, self.current_op)
        super()._add(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.current_op, before = f"{WHERE[0]}:{func}", self.peak
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.peak > before:
            self.snapshot = [(n, self.origin.get(k, "?")) for k, n in self._live.items()]
            self.where = WHERE[0]
        return out


def _label_handlers() -> None:
    """Wrap the executor's forward / backward / G handlers (and the sum) so storages know their action."""

    def wrap(kind: Any, f: Any) -> Any:
        def g(self: Any, a: Any, s: int, *rest: Any) -> Any:
            WHERE[0] = f"{f.__name__}[{a.kind.name} {a.microbatch}]"
            try:
                return f(self, a, s, *rest)
            finally:
                WHERE[0] = f"after {f.__name__}[{a.kind.name} {a.microbatch}]"

        executor._HANDLERS[kind] = g

    K = executor.ActionKind
    for kind, f in ((K.FORWARD, executor.StepRun._forward), (K.BACKWARD, executor.StepRun._backward)):
        wrap(kind, f)
    acc = executor.StepRun._accumulate

    def accumulate(self: Any, s: int, gs: list) -> None:
        old, WHERE[0] = WHERE[0], WHERE[0] + " accumulate"
        try:
            acc(self, s, gs)
        finally:
            WHERE[0] = old

    executor.StepRun._accumulate = accumulate


def census(p: StagePlan) -> Census:
    import meshpilot

    model, inputs = bz._model("cpu")
    pm = meshpilot.parallelize(model, p)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)

    def step() -> None:
        WHERE[0] = "model"
        pm(*inputs).backward()
        WHERE[0] = "opt.step"
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    copies = [c for c in pm._copies.copies.values() if c is not None]
    named = [("param", list(pm.parameters())), ("adam", state), ("copy", copies), ("input", list(inputs))]
    labels = {getattr(t, "_local_tensor", t).untyped_storage()._cdata: n for n, ts in named for t in ts}
    with Census([t for _, ts in named for t in ts], labels) as tracker:
        step()
        step()
    return tracker


def run_census(paths: list[str]) -> None:
    import torch.distributed as dist

    _label_handlers()
    dist.init_process_group("gloo")
    for path in paths:
        for k, text in json.loads(Path(path).read_text()).items():
            p = StagePlan.from_json(text)
            tr = census(p)
            if dist.get_rank() == 0:
                print(f"\n{k}: predicted {p.memory.total / 2**20:.2f} MiB, rank 0 peak {tr.peak / 2**20:.2f} MiB "
                      f"in {tr.where} ({tr.peak_op})\n  predicted parts: {p.memory}")  # fmt: skip
                size, count = Counter(), Counter()
                for n, origin in tr.snapshot:
                    size[origin] += n
                    count[origin] += 1
                for origin, n in size.most_common(12):
                    print(f"  {n / 2**20:7.3f} MiB  x{count[origin]:3d}  {origin}")
    dist.destroy_process_group()


def run_plan(microbatches: int, out: Path) -> None:
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import plan

    model, inputs = bz._model("meta")
    graph = capture(model, tuple(x[: x.shape[0] // microbatches] for x in inputs))
    kw = dict(mesh_shape=bz.MESH, graph=graph, microbatches=microbatches)
    plans = {
        f"M={microbatches} zero {z}": plan(None, (), bz.CLUSTER, zero=z, recompute="none", **kw)
        for z in ("off", "2", "3")
    }
    out.write_text(json.dumps({k: p.to_json() for k, p in plans.items()}))
    for k, p in plans.items():
        print(f"{k}: predicted {p.memory.total / 2**20:.2f} MiB ({p.memory.peak_at})")


if __name__ == "__main__":
    if sys.argv[1] == "plan":
        run_plan(int(sys.argv[2]), Path(sys.argv[3]))
    else:
        run_census(sys.argv[2:])
