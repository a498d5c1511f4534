"""Frontier runs reproduced on paper (issue 32): each published row's configuration planned as published
(``planner.config_plan``), simulated at full scale, and its throughput held against the paper's.

    nice -n 10 python benchmarks/bench_frontier.py                        # every row
    nice -n 10 python benchmarks/bench_frontier.py --rows llama3-405b-16k --trace t.json --png t.png
    nice -n 10 python benchmarks/bench_frontier.py --json rows.json

Per row: the model built on the meta device (Hugging Face's ``LlamaForCausalLM`` at the paper's dimensions,
``use_cache=False``), one microbatch of the step (DP · micro-batch sequences) captured with 4 of its blocks
(``planner.stack.capture_stack``), the configuration's plan (``config_plan.plan_config``: Megatron-pinned
stages on Llama 3's rank order), its step simulated (``config_plan.simulate_config``: one stand-in rank per
pipeline group, the groups' sends at one rank's share) and split term by term (``config_plan.breakdown``).
TFLOP/s per GPU = tokens · (6 · N + 12 · L · h · s) / step / GPUs (``config_plan.model_flops_per_token``; the
"causal count" column, JSON ``simulated_causal_count``: 6 · L · h · s, the causal half, the paper not saying which);
tokens/s per GPU (torchtitan's unit) = global batch · sequence / step / GPUs; the error is simulated / published − 1.
A row whose configuration meshpilot cannot represent is printed with the reason and simulated as nothing.
torchtitan's rows ran Float8 linears: planned with ``float8=linears`` (``config_plan``, *Float8*: every block
linear's three products at the device profile's Float8 rate, measured on an H100, plus their operands' casts), each
beside the same plan with Float8 off (``…-bf16``, held against the same published number). ``--float8-cast-bytes``
prices their casts otherwise (a sensitivity; ``presets.FLOAT8_CAST_BYTES``).

meshpilot's own plan (``planner.config_search.search_configs``, what ``meshpilot plan --config auto`` runs): for
the same model, GPUs, global batch and sequence (not for a Float8 row: the search has no Float8 lever), the
configuration meshpilot chooses itself — TP / PP / DP,
schedule, microbatches and their size, recomputation, split — within the device's memory by Eq. 5 per pipeline
group, planned and simulated by the same path as the published one. Where the published configuration's own
plan needs more than the device's memory by that bound, the search is run a second time within that larger
figure, like for like. ``--no-search`` skips both.

``--json FILE``: a list of rows ``{name, unit, published, simulated_as_published, planned, planning_s, ...}``:
``planned`` the own plan's simulated throughput (the row's unit), ``planning_s`` its search's wall seconds (CPU
in ``planning_cpu_s``), ``planned_config`` the configuration it chose (``--config`` syntax), and the same three
``..._at_published_memory`` for the second search; null for a refused row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from meshpilot.cluster import presets
from meshpilot.errors import UserError
from meshpilot.models.sources import build_hf, pre_shifted_labels, unpacked_sequences
from meshpilot.planner.config_plan import (
    Breakdown,
    ConfigPlan,
    Float8,
    breakdown,
    group_memory,
    group_terms,
    model_flops_per_token,
    parse_config,
    plan_config,
    simulate_config,
    tflops_per_gpu,
)
from meshpilot.planner.config_search import SearchResult, config_string, search_configs
from meshpilot.planner.stack import Stack, capture_stack
from meshpilot.planner.stage import StagePlanner

LLAMA3_405B = dict(
    num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
    num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, use_cache=False,
    max_position_embeddings=131072,
)  # fmt: skip
"""Llama 3 405B (Llama 3 paper, Table 3); ``use_cache=False``: a training step keeps no KV cache."""

LLAMA3_CONFIG = "tp=8,schedule=interleaved-1f1b,virtual=8,split=ends,precision=bf16,zero=1"
"""What the Llama 3 paper's §3.3.2 states beside Table 4's degrees: interleaved 1F1B whose first chunk holds only the
embedding and last only the head (one chunk per layer: v = 128 / 16 = 8), no activation checkpointing at 8K, in
BF16; its FSDP shards the optimizer states and gradients over DP and keeps the parameters gathered after the
forward: ``zero=1`` (``config_plan``, *ZeRO*: AdamW's states and update over DP · CP; the gradients' sum over the
microbatches stays whole through the backward, as in Megatron's distributed optimizer). Micro-batch size 1 (not stated)
makes the microbatches the batch per DP. ``precision=bf16``: the step in bfloat16 as Megatron-style BF16 training
runs it (meshpilot's ``bf16-mixed`` is torch autocast, whose float32 residual stream doubles every send)."""


TORCHTITAN_CONFIG = "tp=8,pp=8,dp=8,microbatches=32,recompute=full,split=ends,precision=bf16"
"""torchtitan's Table 5 (benchmarks/llama3_h100_202412_torchtitan.md): 512 H100, FSDP 8, TP 8, PP 8, local batch 32
(micro-batch 1: 32 microbatches), global batch 256, full activation checkpointing, torch.compile, Float8 linears,
AsyncTP. Planned here as DP 8 (FSDP's sharding is not planned: ZeRO 0, its all-gathers and reduce-scatters priced as
an all-reduce), ``precision=bf16`` (FSDP's bf16 parameters: the step in bf16; the float32 master weights and
reduction are not modelled), ``split=ends`` (126 blocks do not cut evenly into 8 or 16 chunks; torchtitan's file
does not give its split points), TP without AsyncTP's overlap. The Float8 rows add ``float8=linears``; the bf16
rows beside them are the same plan with Float8 off, held against the same published (Float8) number: what Float8
is worth in the model."""


@dataclass(frozen=True)
class Row:
    """One published run."""

    name: str
    source: str
    unit: str
    published: float
    model: dict[str, Any]
    seq: int
    cluster: str
    config: str
    refused: str = ""
    """Why meshpilot cannot plan it as published (empty: it can)."""


ROWS = [
    Row("llama3-405b-8k", "Llama 3 Table 4", "TFLOP/s/GPU", 430.0, LLAMA3_405B, 8192, "llama3-h100",
        f"{LLAMA3_CONFIG},pp=16,dp=64,microbatches=32"),
    Row("llama3-405b-16k", "Llama 3 Table 4", "TFLOP/s/GPU", 400.0, LLAMA3_405B, 8192, "llama3-h100",
        f"{LLAMA3_CONFIG},pp=16,dp=128,microbatches=16"),
    Row("llama3-405b-16k-cp16", "Llama 3 Table 4", "TFLOP/s/GPU", 380.0, LLAMA3_405B, 131072, "llama3-h100",
        f"{LLAMA3_CONFIG},cp=16,pp=16,dp=8,microbatches=16"),
    Row("torchtitan-405b-1f1b", "torchtitan H100 Table 5", "tokens/s/GPU", 100.0, LLAMA3_405B, 8192,
        "torchtitan-h100:64", f"{TORCHTITAN_CONFIG},float8=linears"),
    Row("torchtitan-405b-1f1b-bf16", "torchtitan H100 Table 5, Float8 off", "tokens/s/GPU", 100.0, LLAMA3_405B,
        8192, "torchtitan-h100:64", TORCHTITAN_CONFIG),
    Row("torchtitan-405b-interleaved", "torchtitan H100 Table 5", "tokens/s/GPU", 128.0, LLAMA3_405B, 8192,
        "torchtitan-h100:64", f"{TORCHTITAN_CONFIG},schedule=interleaved-1f1b,virtual=2,float8=linears"),
    Row("torchtitan-405b-interleaved-bf16", "torchtitan H100 Table 5, Float8 off", "tokens/s/GPU", 128.0,
        LLAMA3_405B, 8192, "torchtitan-h100:64", f"{TORCHTITAN_CONFIG},schedule=interleaved-1f1b,virtual=2"),
]  # fmt: skip


@dataclass(frozen=True)
class Own:
    """meshpilot's own plan for a row: the search's answer, priced in the row's unit."""

    throughput: float
    config: str
    search: SearchResult

    def to_json(self, suffix: str) -> dict[str, Any]:
        s = self.search
        return {f"planned{suffix}": self.throughput, f"planning_s{suffix}": s.planning_s,
                f"planning_cpu_s{suffix}": s.cpu_s, f"planned_config{suffix}": self.config,
                f"planned_step_s{suffix}": s.best_step_s, f"planned_memory_gib{suffix}": group_memory(s.best) / 2**30,
                f"planned_memory_terms_gib{suffix}": memory_terms(s.best),
                f"search_capacity_gib{suffix}": s.capacity / 2**30}  # fmt: skip


def memory_terms(cp: ConfigPlan) -> dict[str, float]:
    """The fullest pipeline group's Eq. 5 term by term, GiB a GPU (``config_plan.group_terms``)."""
    t = group_terms(cp)
    keys = ("weights", "optimizer", "grads", "working", "in_flight", "update")
    return {"group": t.group, **{k: getattr(t, k) / 2**30 for k in keys}, "total": t.total / 2**30}


def _own_json(own: Own | None, suffix: str) -> dict[str, Any]:
    if own is not None:
        return own.to_json(suffix)
    return {f"planned{suffix}": None, f"planning_s{suffix}": None, f"planned_config{suffix}": None}


@dataclass
class Result:
    """What one row gave."""

    row: Row
    simulated: float | None = None
    simulated_causal_count: float | None = None
    """TFLOP/s rows: the same step with attention counted causally (``model_flops_per_token(causal=True)``)."""
    refused: str = ""
    capture_s: float = 0.0
    config_plan_s: float = 0.0
    simulate_s: float = 0.0
    step_s: float = 0.0
    eq2_step_s: float = 0.0
    peak_gib: float = 0.0
    peak_terms: dict[str, float] = field(default_factory=dict)
    """The published plan's :attr:`peak_gib` term by term (:func:`memory_terms`)."""
    layout: str = ""
    """With CP: the layout the plan takes (:func:`_layout`)."""
    terms: Breakdown | None = None
    own: Own | None = None
    """meshpilot's own plan within the device's memory."""
    own_same_memory: Own | None = None
    """…and within the published configuration's own Eq. 5, where that is larger."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> float | None:
        return None if self.simulated is None else self.simulated / self.row.published - 1

    def to_json(self) -> dict[str, Any]:
        r = self.row
        return {
            "name": r.name, "unit": r.unit, "published": r.published, "simulated_as_published": self.simulated,
            **_own_json(self.own, ""), **_own_json(self.own_same_memory, "_at_published_memory"),
            "error": self.error, "refused": self.refused or None,
            "simulated_causal_count": self.simulated_causal_count,
            "source": r.source, "cluster": r.cluster, "config": r.config, "step_s": self.step_s or None,
            "eq2_step_s": self.eq2_step_s or None, "capture_s": self.capture_s, "config_plan_s": self.config_plan_s,
            "simulate_s": self.simulate_s, "peak_memory_gib": self.peak_gib or None,
            "peak_memory_terms_gib": self.peak_terms or None,
            "terms_s": dict(self.terms.rows()) if self.terms else None, "cp_layout": self.layout or None,
        }  # fmt: skip


CONTIGUOUS_CP = False
"""``--cp-contiguous``: the CP rows captured with transformers' own labels shift (a pad and a slice along the
sequence), which refuses the zig-zag order: the contiguous CP layout, priced at its slowest rank, for comparison."""


def _row_model(row: Row, rows: int, cp: int) -> tuple[Any, tuple]:
    """`row`'s model and one microbatch's meta inputs (`rows` sequences); with CP the labels pre-shifted, as
    Megatron's loader gives them (``models.sources.pre_shifted_labels``), so that the plan can hold the sequence
    in Llama 3's balanced order (``config_plan``, *Balanced CP*), unless :data:`CONTIGUOUS_CP`."""
    built = build_hf("llama", row.model, batch=rows, seq=row.seq)
    if cp > 1 and not CONTIGUOUS_CP:
        return pre_shifted_labels(built.model, tuple(built.inputs))
    return built.model, tuple(built.inputs)


def _layout(cp) -> str:
    """The CP layout a configuration's plan takes: balanced (zig-zag), or contiguous and why; "" without CP."""
    if cp.config.cp == 1:
        return ""
    if cp.plan.sequence_order is not None:
        o = cp.plan.sequence_order
        return f"balanced: {2 * o.peers} chunks of {o.length // (2 * o.peers)} tokens, {o.causal} causal calls"
    return f"contiguous ({cp.contiguous_why})"


def run_row(
    row: Row, trace: str | None = None, png: str | None = None, terms: bool = True, search: bool = False
) -> Result:
    """Plan `row`'s configuration as published, simulate it, and price its throughput (module docstring)."""
    out = Result(row)
    if row.refused:
        out.refused = row.refused
        return out
    try:
        cfg = parse_config(row.config)
    except UserError as e:
        out.refused = str(e)
        return out
    t0 = time.perf_counter()
    model, inputs = _row_model(row, cfg.graph_batch, cfg.cp)
    with unpacked_sequences():  # is_causal, no mask tensor: what eager runs on whole sequences
        stack = capture_stack(model, inputs, precision=cfg.precision)
    if not isinstance(stack, Stack):
        raise UserError(f"{row.name}: the model is not a repeated stack of blocks; the frontier rows need one")
    out.capture_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sp = StagePlanner(stack.graph, row.cluster)
    cp = plan_config(model, inputs, stack, sp.cluster, cfg, planner=sp)
    out.layout = _layout(cp)
    out.config_plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    sim = simulate_config(cp)
    out.simulate_s = time.perf_counter() - t0
    out.step_s, out.eq2_step_s = sim.step_s, cp.plan.step_s
    out.peak_gib = group_memory(cp) / 2**30
    out.peak_terms = memory_terms(cp)
    layers, hidden = row.model["num_hidden_layers"], row.model["hidden_size"]
    per_token = model_flops_per_token(model, layers, hidden, row.seq)
    tokens = cfg.global_batch * row.seq
    if row.unit == "tokens/s/GPU":
        price = lambda step: tokens / step / cfg.devices if step > 0 else 0.0  # noqa: E731
    else:
        price = lambda step: tflops_per_gpu(per_token, tokens, step, cfg.devices)  # noqa: E731
    out.simulated = price(sim.step_s)
    if row.unit != "tokens/s/GPU":
        causal = model_flops_per_token(model, layers, hidden, row.seq, causal=True)
        out.simulated_causal_count = tflops_per_gpu(causal, tokens, sim.step_s, cfg.devices)
    if terms:
        out.terms = breakdown(cp, sim)
    if search and cfg.float8 is Float8.NONE:  # the search has no Float8 lever (module docstring)
        out.own = own_plan(row, cfg, sp.cluster, price)
        published_gib = group_memory(cp)
        if published_gib > out.own.search.capacity:
            out.own_same_memory = own_plan(row, cfg, sp.cluster, price, capacity=published_gib)
    if trace:
        sim.write_trace(trace)
    if png:
        sim.write_png(png)
    return out


def own_plan(row: Row, cfg, cluster, price, capacity: float | None = None) -> Own:
    """The search (module docstring) for `row`'s model, GPUs, batch and sequence, within `capacity` bytes a GPU
    (default: the device's)."""

    def build(rows: int):
        b = build_hf("llama", row.model, batch=rows, seq=row.seq)
        return b.model, b.inputs

    res = search_configs(build, cluster, cfg.devices, cfg.global_batch, precision=cfg.precision, capacity=capacity)
    return Own(price(res.best_step_s), config_string(res.best.config), res)


def show_own(r: Result) -> None:
    """Each search's leading candidates, its choice and its time."""
    for own in (r.own, r.own_same_memory):
        if own is None:
            continue
        s = own.search
        print(f"\n{r.row.name}: meshpilot's own plan within {s.capacity / 2**30:.1f} GiB a GPU (Eq. 5 per group): "
              f"{s.enumerated} configurations, {s.over_memory} of the leading estimates over memory; "
              f"{s.planning_s:.1f} s wall, {s.cpu_s:.1f} s CPU")  # fmt: skip
        print(f"  {'configuration':<58} {'estimate':>8} {'simulated':>9} {'bound GiB':>9} {'plan GiB':>8}")
        for c in s.leading:
            sim = f"{c.simulated_s:9.3f}" if c.simulated_s is not None else f"{'—':>9}"
            pm = f"{c.plan_memory_bytes / 2**30:8.1f}" if c.plan_memory_bytes is not None else f"{'—':>8}"
            cfg = f"{c.config.short()} m{c.config.micro_batch} {c.config.split.value} rc={c.config.recompute.value}"
            print(f"  {cfg:<58} {c.estimate_s:8.3f} {sim} {c.memory_bytes / 2**30:9.1f} {pm}")
        print(f"  chose {own.config}: {own.throughput:.1f} {r.row.unit}")


def show(results: list[Result]) -> None:
    """The table (published, simulated as published, meshpilot's own plan side by side), each row's terms,
    then each search's candidates."""
    head = (f"{'row':<28} {'unit':<13} {'published':>9} {'simulated':>9} {'error':>7} {'step s':>7} {'peak GiB':>8} "
            f"{'own plan':>8} {'vs pub.':>7} {'vs sim.':>7} {'same mem.':>9} {'causal count':>14}")  # fmt: skip
    print(head + "\n" + "-" * len(head))
    for r in results:
        if r.simulated is None:
            print(f"{r.row.name:<28} {r.row.unit:<13} {r.row.published:9.0f} {'—':>9}  refused: {r.refused}")
            continue
        own = (f"{r.own.throughput:8.1f} {r.own.throughput / r.row.published - 1:+7.1%} "
               f"{r.own.throughput / r.simulated - 1:+7.1%}" if r.own else f"{'—':>8} {'':>7} {'':>7}")  # fmt: skip
        same = f"{r.own_same_memory.throughput:9.1f}" if r.own_same_memory else f"{'—':>9}"
        c = r.simulated_causal_count
        causal = f"{c:6.1f} {c / r.row.published - 1:+7.1%}" if c else f"{'—':>14}"
        print(
            f"{r.row.name:<28} {r.row.unit:<13} {r.row.published:9.0f} {r.simulated:9.1f} {r.error:+7.1%} "
            f"{r.step_s:7.2f} {r.peak_gib:8.1f} {own} {same} {causal}"
        )
    for r in results:
        if r.terms is None:
            continue
        print(f"\n{r.row.name}: {r.row.config} on {r.row.cluster}")
        print(f"  capture {r.capture_s:.1f} s, config plan {r.config_plan_s:.1f} s, simulation {r.simulate_s:.2f} s")
        if r.layout:
            print(f"  CP layout: {r.layout}")
        if r.peak_terms:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in r.peak_terms.items() if k not in ("group", "total"))
            print(f"  Eq. 5 {r.peak_gib:.1f} GiB a GPU, group {r.peak_terms['group']:.0f}: {parts}")
        print(f"  Eq. 2 step {r.eq2_step_s:.3f} s, simulated {r.step_s:.3f} s; the busiest pipeline group:")
        for name, s in r.terms.rows():
            print(f"    {name:<24} {s:8.3f} s  {s / r.step_s:6.1%}")
    for r in results:
        show_own(r)


def block_plans(row: Row) -> None:
    """One block of `row`'s published configuration planned on its first pipeline group's mesh (``(DP, TP)``, or
    ``(DP, CP, TP)`` with context parallelism), with and without sequence parallelism (``config_plan.stage_setup``,
    the pins and stack ``plan_config`` uses; SP gathers each norm output again in the backward): one
    microbatch's compute, resharding (TP), other communication (the DP sync), saved activations, static bytes and
    live peak, the stage planner's numbers, and the collectives' seconds per mesh axis and phase."""
    from meshpilot.planner.config_plan import context_views, stage_mesh, stage_ranks, stage_setup
    from meshpilot.planner.zero import ZeroMode

    cfg = parse_config(row.config)
    model, inputs = _row_model(row, cfg.graph_batch, cfg.cp)
    with unpacked_sequences():
        stack = capture_stack(model, inputs, precision=cfg.precision)
    base = StagePlanner(stack.graph, row.cluster)
    mesh, ranks = stage_mesh(cfg), stage_ranks(cfg)[0]
    names = ("DP", "TP") if len(mesh) == 2 else ("DP", "CP", "TP")
    for sp in (0, 1):
        c = parse_config(f"{row.config},sp={sp}")
        st, planner, force = stage_setup(model, inputs, stack, base.cluster, c, base, mesh)
        kw = dict(microbatches=1, zero=ZeroMode.OFF, force=force)
        with context_views(c):
            cost, mem = planner.plan_with_memory(st.middle, st.middle + 1, ranks, mesh, **kw)
        t = cost.time
        print(f"{row.name} block, sp={sp}: compute {t.compute_s * 1e3:.2f} ms, resharding {t.resharding_s * 1e3:.2f} "
              f"ms, other comm. {t.communication_s * 1e3:.2f} ms, saved {mem.saved / 1e6:,.0f} MB, static "
              f"{mem.static / 1e9:.2f} GB, live peak {mem.live_peak / 1e9:.2f} GB")  # fmt: skip
        per: dict[tuple[str, str, str], list[float]] = {}
        for x in planner.last_collectives():
            got = per.setdefault((names[x.axis], x.phase, str(x.kind)), [0, 0.0])
            got[0], got[1] = got[0] + 1, got[1] + x.seconds
        for (axis, phase, kind), (n, secs) in sorted(per.items()):
            print(f"    {axis:<2} {phase:<3} {kind:<14} {n:3d} × → {secs * 1e3:8.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", choices=[r.name for r in ROWS], help="default: every row")
    ap.add_argument("--json", metavar="FILE", help="write the rows as a JSON list here")
    ap.add_argument("--trace", metavar="T.json", help="the --trace-row's Perfetto trace of one step")
    ap.add_argument("--png", metavar="T.png", help="the --trace-row's timeline of one step")
    ap.add_argument("--trace-row", default="llama3-405b-16k", help="the row --trace and --png draw")
    ap.add_argument("--no-terms", action="store_true", help="skip the term-by-term split")
    ap.add_argument("--no-search", action="store_true", help="skip meshpilot's own plan (the configuration search)")
    ap.add_argument("--blocks", action="store_true", help="only one block of each row, with and without SP")
    ap.add_argument("--cp-contiguous", action="store_true",
                    help="the CP rows in contiguous CP chunks (transformers' own labels shift refuses the zig-zag "
                    "order), not Llama 3's balanced 2·CP chunks")  # fmt: skip
    ap.add_argument("--float8-cast-bytes", type=float, metavar="B",
                    help="a sensitivity: price the Float8 rows' casts at B bytes an operand element, not the preset's "
                    "5 (15: the stand-alone casts measured on an H100; 0: the products alone)")  # fmt: skip
    args = ap.parse_args()
    if args.float8_cast_bytes is not None:
        if not args.float8_cast_bytes >= 0:
            ap.error(f"--float8-cast-bytes {args.float8_cast_bytes}: give zero or more bytes, e.g. 15")
        presets.FLOAT8_CAST_BYTES = args.float8_cast_bytes  # read when a preset cluster is built
    global CONTIGUOUS_CP
    CONTIGUOUS_CP = args.cp_contiguous
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{now}; load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    rows = [r for r in ROWS if not args.rows or r.name in args.rows]
    if args.blocks:
        for row in rows:
            if not row.refused:
                block_plans(row)
        return
    results = []
    for row in rows:
        drawn = row.name == args.trace_row
        trace, png = (args.trace, args.png) if drawn else (None, None)
        results.append(run_row(row, trace, png, not args.no_terms, not args.no_search))
    show(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_json() for r in results], f, indent=1)


if __name__ == "__main__":
    main()
