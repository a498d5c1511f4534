"""GPU check (not in CI): meshpilot on one GPU against eager PyTorch, and its cost model against the GPU.

One command, one GPU, under torchrun with NCCL::

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py --json-out gpu_check.json

and its smoke mode on CPU (gloo, tiny sizes; what this repository's CPU-only machines run)::

    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py --device cpu --tiny --json-out /tmp/c.json

What it does, in order:

1. **Probe.** ``meshpilot.cluster.probe.probe`` measures the device (matmul at 2048..8192 squares, copy
   bandwidth, capacity) and every GEMM shape of the models below (``meshpilot.graph.gemms``), and writes
   the cluster file (``--out-dir``/cluster.toml) the plans below are made for.
2. **Models** (``MODELS``): meshpilot's GPT (fp32, bf16, bf16-mixed), bert-tiny, HF ``GPT2LMHeadModel`` and
   ``LlamaForCausalLM`` (``attn_implementation="sdpa"``, fp32 and bf16), the Wide-ResNet conv net and
   moe-tiny. Each: ``meshpilot.plan`` for the world size on the probed cluster, ``meshpilot.parallelize`` of
   a copy on the device, then 3 AdamW steps of both in lockstep: loss and every gradient within 1e-5
   relative (fp32) or 1e-2 (bf16, bf16-mixed) of eager — beside it the first step's gradient difference and a
   second eager copy's against the first (the device's own run-to-run noise: CUDA kernels that add with
   atomics differ between runs, and AdamW's normalised steps amplify it); then the median step time of each (ratio
   parallel / eager), and for each the peak memory of a step (CUDA: ``max_memory_allocated``; CPU:
   ``StorageTracker``) less what the other model holds, and the median forward + backward time, against
   the plan's predicted peak and compute.
3. **GPT shapes** (``GPT_SHAPES``: ``../shared/gpu/h100-gpt-steps.json``'s three rows, 12 layers h 768 bf16
   and 4 layers h 1024 fp32), measured as that json's "how" says: the model alone on the device in its
   dtype, AdamW(lr=1e-5; foreach, CUDA's default, on CPU too), peak statistics reset, 3 warm-up and 10
   full steps (forward, backward, step, ``zero_grad(set_to_none=True)``), then 5 forward + backward steps
   (grads set to None between them); the peak over all and the median forward + backward time, against a
   1-device plan's predictions; then the model parallelized by that plan, its step and forward + backward
   timed alternately with eager's (the interpreter tax: issue 14 wants ≤ 1.05×).

It prints the tables with rich and writes everything (probe, per model, per shape, environment) as JSON to
``--json-out``. A model that fails (capture, plan, run) gets its error in its row; the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import meshpilot  # noqa: E402
from meshpilot.cluster.memtrack import StorageTracker  # noqa: E402
from meshpilot.graph.capture import capture  # noqa: E402
from meshpilot.graph.gemms import graph_gemms  # noqa: E402
from meshpilot.models.sources import HFLoss  # noqa: E402  (the `--model hf:` wrapper: HF's own loss)

GiB = 2**30
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "bf16-mixed": 1e-2}


# ----------------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One model to check: how to build it (on a device, in a dtype) and how it trains."""

    name: str
    build: Callable[[str], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    """build(device) -> (model in its dtype on `device`, example inputs on `device`); same seed every call."""
    precision: str
    """``fp32``, ``bf16`` (the parameters' dtype) or ``bf16-mixed`` (autocast over fp32 parameters)."""


def _tokens(vocab: int, batch: int, seq: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)


def gpt_case(name: str, tiny: bool, dtype: str, precision: str) -> Case:
    from meshpilot.models.gpt import GPT, GPTConfig

    size = dict(vocab=512, seq=32, layers=2, hidden=64, heads=4, batch=4) if tiny else {}
    cfg = GPTConfig(**(size or dict(vocab=8192, seq=512, layers=4, hidden=1024, heads=16, batch=8)), dtype=dtype)

    def build(device: str):
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(cfg)
        return model, _tokens(cfg.vocab, cfg.batch, cfg.seq, device)

    return Case(name, build, precision)


def zoo_case(name: str, tiny: bool) -> Case:
    from meshpilot.models import builtin_models

    entry = builtin_models()[name]

    def build(device: str):
        torch.manual_seed(0)
        return entry.build(device, None)

    return Case(name, build, "fp32")


def hf_case(name: str, tiny: bool, dtype: str) -> Case:
    def build(device: str):
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        vocab, h, layers, heads, seq, batch = (256, 64, 2, 4, 32, 2) if tiny else (8192, 768, 4, 12, 512, 8)
        torch.manual_seed(0)
        if name == "hf-gpt2":
            cfg = GPT2Config(
                vocab_size=vocab, n_positions=seq, n_embd=h, n_layer=layers, n_head=heads,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
            )  # fmt: skip
            lm = GPT2LMHeadModel(cfg)
        else:
            cfg = LlamaConfig(
                vocab_size=vocab, hidden_size=h, intermediate_size=4 * h, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=seq,
                attn_implementation="sdpa",
            )  # fmt: skip
            lm = LlamaForCausalLM(cfg)
        model = HFLoss(lm).to(device=device, dtype=getattr(torch, dtype))
        ids, _ = _tokens(vocab, batch, seq, device)
        return model, (ids, ids)

    return Case(f"{name}", build, "bf16" if dtype == "bfloat16" else "fp32")


def model_cases(tiny: bool) -> list[Case]:
    """The models of step 2 (module docstring)."""
    return [
        gpt_case("gpt", tiny, "float32", "fp32"),
        gpt_case("gpt", tiny, "bfloat16", "bf16"),
        gpt_case("gpt", tiny, "float32", "bf16-mixed"),
        zoo_case("bert-tiny", tiny),
        hf_case("hf-gpt2", tiny, "float32"),
        hf_case("hf-gpt2", tiny, "bfloat16"),
        hf_case("hf-llama", tiny, "float32"),
        hf_case("hf-llama", tiny, "bfloat16"),
        zoo_case("wrn-tiny", tiny),
        zoo_case("moe-tiny", tiny),
    ]


GPT_SHAPES = [
    # ../shared/gpu/h100-gpt-steps.json's rows, then the two other shapes (heads, vocab, batch and
    # seq of the 12-layer one are GPT-2 small's: our choice, the issue gives layers, hidden and dtype only)
    dict(vocab=51200, layers=8, hidden=1024, heads=16, batch=16, seq=512, dtype="bfloat16"),
    dict(vocab=51200, layers=4, hidden=2048, heads=16, batch=8, seq=1024, dtype="bfloat16"),
    dict(vocab=51200, layers=4, hidden=4096, heads=32, batch=4, seq=2048, dtype="bfloat16"),
    dict(vocab=50304, layers=12, hidden=768, heads=12, batch=8, seq=1024, dtype="bfloat16"),
    dict(vocab=51200, layers=4, hidden=1024, heads=16, batch=4, seq=512, dtype="float32"),
]


def tiny_shape(s: dict) -> dict:
    """A GPT shape cut down for the CPU smoke run (same layers and dtype, h / 16, vocab 512, seq 64)."""
    h = max(32, s["hidden"] // 16)
    return dict(s, vocab=512, hidden=h, heads=max(2, s["heads"] // 4), batch=2, seq=64)


# ------------------------------------------------------------------------------------------- the device


@dataclass
class Device:
    """Where the check runs and how it synchronises, times and measures memory there."""

    type: str
    index: int = 0

    @property
    def name(self) -> str:
        return f"cuda:{self.index}" if self.type == "cuda" else "cpu"

    def sync(self) -> None:
        if self.type == "cuda":
            torch.cuda.synchronize(self.index)

    def time(self, fn: Callable[[], Any]) -> float:
        """Seconds `fn` takes on the device (CUDA events on a GPU)."""
        if self.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    @contextlib.contextmanager
    def peak(self, own: list[torch.Tensor], out: dict[str, float]):
        """Measure the peak bytes of the block, counting of what exists before it only the tensors `own`
        (a model's parameters, optimizer state and inputs): ``out["peak"]``."""
        if self.type == "cuda":
            self.sync()
            others = torch.cuda.memory_allocated(self.index) - _storage_bytes(own)
            torch.cuda.reset_peak_memory_stats(self.index)
            yield
            self.sync()
            out["peak"] = torch.cuda.max_memory_allocated(self.index) - others
        else:
            with StorageTracker(existing=own) as tracker:
                yield
            out["peak"] = tracker.peak


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        s = t.untyped_storage()
        seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def adamw(params: Any, lr: float) -> torch.optim.Optimizer:
    """AdamW as CUDA runs it by default (foreach), on CPU too, where torch's default is the per-tensor loop:
    the accounting models the foreach update's temporary."""
    return torch.optim.AdamW(params, lr=lr, foreach=True)


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


# ------------------------------------------------------------------------------------------- one model


@dataclass
class Trainer:
    """A model, its AdamW and how one step runs (autocast for bf16-mixed eager)."""

    model: nn.Module
    opt: torch.optim.Optimizer
    inputs: tuple[torch.Tensor, ...]
    autocast: bool = False
    device: str = "cpu"

    def loss(self) -> torch.Tensor:
        ctx = torch.autocast(self.device, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            return self.model(*self.inputs)

    def forward_backward(self) -> float:
        loss = self.loss()
        loss.backward()
        return float(loss.detach().float())

    def step(self) -> float:
        value = self.forward_backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return value

    def own(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *_state_tensors(self.opt), *self.inputs]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    a, b = _full(a).detach().float(), _full(b).detach().float()
    scale = float(b.abs().max()) if b.numel() else 0.0
    diff = float((a - b).abs().max()) if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


@dataclass
class ModelResult:
    """One row of the models table (seconds, bytes)."""

    name: str
    precision: str
    mesh: list[int] = field(default_factory=list)
    max_loss_rel: float | None = None
    max_grad_rel: float | None = None
    first_grad_rel: float | None = None
    """The gradients' difference at the first step, before AdamW's steps amplify it."""
    floor_grad_rel: float | None = None
    """The same 3 steps of a second eager copy against the first: what the device's own run-to-run
    differences (atomics in CUDA kernels) give; 0 where the kernels are deterministic."""
    tolerance: float | None = None
    ok: bool | None = None
    eager_step_s: float | None = None
    parallel_step_s: float | None = None
    eager_fwd_bwd_s: float | None = None
    parallel_fwd_bwd_s: float | None = None
    predicted_compute_s: float | None = None
    eager_peak: float | None = None
    parallel_peak: float | None = None
    predicted_peak: float | None = None
    predicted_peak_at: str = ""
    plan_warnings: list[str] = field(default_factory=list)
    error: str = ""


def check_model(case: Case, dev: Device, cluster: Any, steps: int, timed: int, recompute: str = "auto") -> ModelResult:
    """Plan, parallelize and compare one model with eager (module docstring, step 2); `recompute` as
    ``meshpilot plan --recompute`` (``full``: every block recomputed, the predicted peak against the measured)."""
    res = ModelResult(case.name, case.precision, tolerance=TOLERANCE[case.precision])
    ref, inputs = case.build(dev.name)
    par = copy.deepcopy(ref)
    graph = capture(par, inputs, precision=case.precision)
    world = dist.get_world_size()
    plan = meshpilot.plan(
        par, inputs, cluster, num_devices=world, graph=graph, precision=case.precision, recompute=recompute
    ).only
    res.mesh = list(plan.mesh_shape)
    res.predicted_peak, res.predicted_peak_at = plan.memory.total, plan.memory.peak_at
    res.predicted_compute_s = plan.time.compute_s
    res.plan_warnings = list(plan.warnings)
    pm = meshpilot.parallelize(par, plan, graph=graph)
    mixed = case.precision == "bf16-mixed"
    eager = Trainer(ref, adamw(ref.parameters(), 1e-3), inputs, mixed, dev.type)
    parallel = Trainer(pm, adamw(pm.parameters(), 1e-3), inputs, False, dev.type)
    twin_model = copy.deepcopy(ref)
    twin = Trainer(twin_model, adamw(twin_model.parameters(), 1e-3), inputs, mixed, dev.type)
    loss_rel = grad_rel = floor = 0.0
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    for step in range(steps):
        le, lp, lt = eager.loss(), parallel.loss(), twin.loss()
        for loss in (le, lp, lt):
            loss.backward()
        loss_rel = max(loss_rel, _rel(lp, le))
        for n in names:  # parallelize replaced `par`'s parameters by its DTensor ones, in place
            ge, gp = ref.get_parameter(n).grad, par.get_parameter(n).grad
            if (ge is None) != (gp is None):
                raise AssertionError(f"{n}: gradient only in {'eager' if gp is None else 'parallel'}")
            if ge is not None:
                grad_rel = max(grad_rel, _rel(gp, ge))
                floor = max(floor, _rel(twin_model.get_parameter(n).grad, ge))
        if step == 0:
            res.first_grad_rel = grad_rel
        for t in (eager, parallel, twin):
            t.opt.step()
            t.opt.zero_grad(set_to_none=True)
    del twin, twin_model
    res.max_loss_rel, res.max_grad_rel, res.floor_grad_rel = loss_rel, grad_rel, floor
    res.ok = loss_rel <= res.tolerance and grad_rel <= res.tolerance
    res.eager_step_s, res.parallel_step_s = (_median_time(dev, t.step, timed) for t in (eager, parallel))
    res.eager_fwd_bwd_s, res.parallel_fwd_bwd_s = (_median_fwd_bwd(dev, t, timed) for t in (eager, parallel))
    res.eager_peak, res.parallel_peak = (_peak_of_steps(dev, t, 2) for t in (eager, parallel))
    return res


def _median_time(dev: Device, fn: Callable[[], Any], n: int) -> float:
    fn()  # warm-up
    return statistics.median(dev.time(fn) for _ in range(n))


def _median_fwd_bwd(dev: Device, t: Trainer, n: int) -> float:
    times = []
    for _ in range(n + 1):
        times.append(dev.time(t.forward_backward))
        t.opt.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _peak_of_steps(dev: Device, t: Trainer, n: int) -> float:
    out: dict[str, float] = {}
    with dev.peak(t.own(), out):
        for _ in range(n):
            t.step()
    return out["peak"]


# ------------------------------------------------------------------------------------------- GPT shapes


@dataclass
class ShapeResult:
    """One row of the GPT shapes table (seconds, bytes)."""

    shape: dict
    params: int = 0
    measured_peak: float | None = None
    measured_fwd_bwd_s: float | None = None
    predicted_peak: float | None = None
    predicted_peak_at: str = ""
    predicted_compute_s: float | None = None
    eager_step_s: float | None = None
    parallel_step_s: float | None = None
    parallel_fwd_bwd_s: float | None = None
    """The same model parallelized by the 1-device plan: median full step and forward + backward, timed
    alternately with the eager model's (``eager_step_s``; forward + backward: ``measured_fwd_bwd_s``)."""
    error: str = ""


def check_shape(shape: dict, dev: Device, cluster: Any, tiny: bool) -> ShapeResult:
    """The json's protocol on one GPT shape (module docstring, step 3), and a 1-device plan's predictions."""
    from meshpilot.models.gpt import GPT, GPTConfig

    res = ShapeResult(shape)
    cfg = GPTConfig(**shape)
    with torch.device("meta"):
        meta = GPT(cfg)
    idx = torch.empty(cfg.batch, cfg.seq, dtype=torch.long, device="meta")
    graph = capture(meta, (idx, idx))  # shapes only: the device model below runs this graph and plan too
    plan = meshpilot.plan(meta, (idx, idx), cluster, num_devices=1, graph=graph).only
    res.predicted_peak, res.predicted_peak_at = plan.memory.total, plan.memory.peak_at
    res.predicted_compute_s = plan.time.compute_s
    res.params = sum(p.numel() for p in meta.parameters())
    del meta
    torch.manual_seed(0)
    with torch.device(dev.name):
        model = GPT(cfg)
    t = Trainer(model, adamw(model.parameters(), 1e-5), _tokens(cfg.vocab, cfg.batch, cfg.seq, dev.name))
    warm, full, fb = (1, 2, 3) if tiny else (3, 10, 5)
    out: dict[str, float] = {}
    with dev.peak(t.own(), out):
        for _ in range(warm + full):
            t.step()
        times = []
        for _ in range(fb):
            times.append(dev.time(t.forward_backward))
            t.opt.zero_grad(set_to_none=True)
    res.measured_peak, res.measured_fwd_bwd_s = out["peak"], statistics.median(times)
    # the interpreter tax (issue 14, point 4): the planned program against eager on the same weights, timed in
    # alternation so that clocks and other load drift alike for both
    par_model = copy.deepcopy(model)
    pm = meshpilot.parallelize(par_model, plan, graph=graph)
    p = Trainer(pm, adamw(pm.parameters(), 1e-5), t.inputs)
    steps: dict[str, list[float]] = {"eager": [], "par": [], "par_fb": []}
    p.step()  # the first call records the program
    for _ in range(full):
        steps["eager"].append(dev.time(t.step))
        steps["par"].append(dev.time(p.step))
    for _ in range(fb):
        steps["par_fb"].append(dev.time(p.forward_backward))
        p.opt.zero_grad(set_to_none=True)
    res.eager_step_s, res.parallel_step_s, res.parallel_fwd_bwd_s = (statistics.median(v) for v in steps.values())
    del t, model, p, pm, par_model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------- probe


def gemm_shapes(cases: list[Case], shapes: list[dict]) -> tuple[tuple[int, int, int, str], ...]:
    """Every distinct GEMM of the models and shapes to check (captured on meta)."""
    from meshpilot.models.gpt import GPT, GPTConfig

    found: dict[tuple, None] = {}
    graphs = []
    for case in cases:
        try:
            model, inputs = case.build("meta")
            graphs.append(capture(model, inputs, precision=case.precision))
        except Exception:  # noqa: BLE001 - its own row reports the failure
            continue
    for s in shapes:
        with torch.device("meta"):
            model = GPT(GPTConfig(**s))
        idx = torch.empty(s["batch"], s["seq"], dtype=torch.long, device="meta")
        graphs.append(capture(model, (idx, idx)))
    for g in graphs:
        for gemm in graph_gemms(g):
            found.setdefault((gemm.m, gemm.n, gemm.k, gemm.dtype), None)
    return tuple(found)


def run_probe(dev: Device, tiny: bool, shapes: tuple, out_dir: Path) -> tuple[Any, dict]:
    """Probe the group (module docstring, step 1); rank 0 writes the cluster file, every rank loads it."""
    from meshpilot.cluster.probe import ProbeOptions, build_cluster, probe, write_cluster_toml

    # the full device measurement even for --tiny: the quick one's 64/128 squares and 2 repeats mostly time
    # first-call overheads on a CPU (it measured 0.26 GFLOP/s on a 50 GFLOP/s core)
    opts = dataclasses.replace(ProbeOptions.for_device(dev.type == "cuda"), matmul_shapes=shapes)
    t0 = time.perf_counter()
    m = probe(opts, progress=lambda msg: print(f"probe: {msg}", file=sys.stderr, flush=True))
    path = out_dir / "cluster.toml"
    info: dict[str, Any] = {}
    if m is not None:
        cluster = build_cluster(m, name=f"gpu-check-{dev.type}", source=str(path))
        write_cluster_toml(cluster, path, f"Written by benchmarks/gpu_check.py on {_now()}")
        d = cluster.device
        info = {
            "file": str(path),
            "seconds": time.perf_counter() - t0,
            "tflops": {k: v / 1e12 for k, v in d.peak_flops.items()},
            "copy_GBps": d.memory_bandwidth / 1e9,
            "memory_GiB": d.memory_bytes / GiB,
            "gemms": [dataclasses.asdict(r) for r in d.matmul],
        }
    dist.barrier()
    return meshpilot.load_cluster(str(path)), info


# ------------------------------------------------------------------------------------------- report


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a is not None and b else "—"


def _gib(x: float | None) -> str:
    return f"{x / GiB:.3f}" if x is not None else "—"


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.2f}" if x is not None else "—"


def print_tables(models: list[ModelResult], shapes: list[ShapeResult], probe_info: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=200)
    tf = ", ".join(f"{k} {v:.4g}" for k, v in probe_info.get("tflops", {}).items())
    con.print(
        f"probe: matmul TFLOP/s {tf}; copy {probe_info.get('copy_GBps', 0):.4g} GB/s; "
        f"{len(probe_info.get('gemms', []))} GEMM shapes measured; {probe_info.get('file', '')}"
    )
    t = Table(title="Models: meshpilot.parallelize vs eager (3 AdamW steps), predictions vs measurements")
    cols = ["model", "precision", "mesh", "loss rel", "grad rel", "step 1", "eager twin", "ok", "step par/eager"]
    cols += ["peak pred GiB"]
    cols += ["peak eager GiB", "pred/eager", "peak par GiB", "f+b pred ms", "f+b eager ms", "pred/eager", "error"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("model", "precision", "error") else "right")
    for r in models:
        t.add_row(
            r.name,
            r.precision,
            "x".join(map(str, r.mesh)) or "—",
            f"{r.max_loss_rel:.1e}" if r.max_loss_rel is not None else "—",
            f"{r.max_grad_rel:.1e}" if r.max_grad_rel is not None else "—",
            f"{r.first_grad_rel:.1e}" if r.first_grad_rel is not None else "—",
            f"{r.floor_grad_rel:.1e}" if r.floor_grad_rel is not None else "—",
            {True: "yes", False: "NO", None: "—"}[r.ok],
            _ratio(r.parallel_step_s, r.eager_step_s),
            _gib(r.predicted_peak),
            _gib(r.eager_peak),
            _ratio(r.predicted_peak, r.eager_peak),
            _gib(r.parallel_peak),
            _ms(r.predicted_compute_s),
            _ms(r.eager_fwd_bwd_s),
            _ratio(r.predicted_compute_s, r.eager_fwd_bwd_s),
            r.error[:60],
        )
    con.print(t)
    s = Table(title="GPT shapes (the json's protocol): predicted / measured")
    cols = ["shape", "params", "peak pred GiB", "peak meas GiB", "ratio", "f+b pred ms", "f+b meas ms", "ratio"]
    cols += ["step eager ms", "step par/eager", "f+b par/eager"]
    for c in [*cols, "error"]:
        s.add_column(c, justify="left" if c in ("shape", "error") else "right")
    for r in shapes:
        sh = r.shape
        label = f"L{sh['layers']} h{sh['hidden']} {sh['batch']}x{sh['seq']} {sh['dtype']}"
        s.add_row(
            label,
            f"{r.params / 1e6:.1f}M",
            _gib(r.predicted_peak),
            _gib(r.measured_peak),
            _ratio(r.predicted_peak, r.measured_peak),
            _ms(r.predicted_compute_s),
            _ms(r.measured_fwd_bwd_s),
            _ratio(r.predicted_compute_s, r.measured_fwd_bwd_s),
            _ms(r.eager_step_s),
            _ratio(r.parallel_step_s, r.eager_step_s),
            _ratio(r.parallel_fwd_bwd_s, r.measured_fwd_bwd_s),
            r.error[:60],
        )
    con.print(s)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _error(e: BaseException) -> str:
    last = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" ({Path(last.filename).name}:{last.lineno})" if last else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (NCCL; default) or cpu (gloo)")
    ap.add_argument("--tiny", action="store_true", help="tiny models and shapes, few repeats (the CPU smoke run)")
    ap.add_argument("--json-out", default="gpu_check.json", help="where rank 0 writes the results")
    ap.add_argument("--out-dir", default=".", help="where the probed cluster file goes")
    ap.add_argument("--only", nargs="*", help="model names to check (default: all); 'none' skips the models")
    ap.add_argument("--no-shapes", action="store_true", help="skip the GPT shapes")
    ap.add_argument("--steps", type=int, default=3, help="lockstep AdamW steps compared with eager (default 3)")
    ap.add_argument(
        "--recompute",
        choices=("auto", "none", "full"),
        default="auto",
        help="the models' plans recompute as `meshpilot plan --recompute` says (default auto)",
    )
    ap.add_argument("--timed", type=int, help="timed repeats for medians (default 10; 2 with --tiny)")
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: this torch has no CUDA; use --device cpu --tiny for the smoke run", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = Device(args.device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank()
    timed = args.timed or (2 if args.tiny else 10)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    try:
        cases = [c for c in model_cases(args.tiny) if not args.only or c.name in args.only]
        shapes = [] if args.no_shapes else [tiny_shape(s) if args.tiny else s for s in GPT_SHAPES]
        cluster, probe_info = run_probe(dev, args.tiny, gemm_shapes(cases, shapes), out_dir)
        models = []
        for case in cases:
            try:
                models.append(check_model(case, dev, cluster, args.steps, timed, args.recompute))
            except Exception as e:  # noqa: BLE001 - the row says what failed; the others still run
                models.append(ModelResult(case.name, case.precision, error=_error(e)))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        shape_results = []
        for s in shapes:
            try:
                shape_results.append(check_shape(s, dev, cluster, args.tiny))
            except Exception as e:  # noqa: BLE001
                shape_results.append(ShapeResult(s, error=_error(e)))
        if rank == 0:
            print_tables(models, shape_results, probe_info)
            report = {
                "when": _now(),
                "seconds": time.perf_counter() - t_start,
                "command": " ".join(sys.argv),
                "device": torch.cuda.get_device_name(local) if dev.type == "cuda" else platform.processor(),
                "torch": torch.__version__,
                "world_size": dist.get_world_size(),
                "tiny": args.tiny,
                "probe": probe_info,
                "models": [dataclasses.asdict(r) for r in models],
                "gpt_shapes": [dataclasses.asdict(r) for r in shape_results],
            }
            Path(args.json_out).write_text(json.dumps(report, indent=1))
            print(f"wrote {args.json_out}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
