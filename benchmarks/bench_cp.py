"""Context parallelism chosen by the planner: a tiny Llama at several sequence lengths and memory caps.

``plan``: for each sequence length, the plan with no cap and under tightening caps (mesh (4, 1) of
``alpa-p3x8``, recomputation ``auto``): which mesh, whether attention is sequence-parallel
(and over which axis), which blocks recompute, the predicted step and peak memory; the plans are saved.
``measure`` (under ``torchrun --nproc-per-node 4``): each saved plan's peak storage per rank over two AdamW
steps (``bench_recompute.step_peaks``) against its prediction.
``methods``: planning only, the two methods side by side as the sequence grows, for the tiny Llama with 8 heads
(transformers' masked attention) and meshpilot's GPT (``is_causal``) at batch 1 on (4, 1): the ILP's plan
uncapped and under a cap of 80 % of its peak, and each method pinned (all-gather: the inputs sequence-sharded;
Ulysses: ``attention.ulysses_pins``; ring: ``attention.ring_pins``); which method each plan uses, its predicted
step and peak. ``--models`` picks the models (default both).
``zigzag``: causal ring attention's balance, meshpilot's GPT (``is_causal``) at batch 1 on (4, 1), its forward
and backward pinned to the ring (``ring_pins(graph, backward=True)``): the plan (zig-zag where
``planner.sequence_order`` allows it), each rank's share of the causal score square contiguous and zig-zag
(``ring.causal_shares``), the predicted step with attention's compute priced by the slowest rank either way
(the plan's attention seconds, which price the whole square split evenly, times ``P`` times that share), and
each rank's causal attention kernels timed (forward and backward, one process, one rank's blocks at a time:
``ring._blocks``, the kernel calls the ring makes; the least of ``--repeats`` rounds over the ranks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from meshpilot.graph.capture import capture
from meshpilot.io import fmt_size
from meshpilot.models.sources import build_model, hf_model
from meshpilot.ops.attention import context_axes, ring_pins, ulysses_pins
from meshpilot.planner.auto import plan
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.plan import StagePlan

sys.path.insert(0, str(Path(__file__).parent))
from bench_recompute import measure_saved  # noqa: E402

CLUSTER = "alpa-p3x8"
MESH = (4, 1)
LLAMA = dict(
    num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, use_cache=False,
)  # fmt: skip
SEQS = (1024, 2048)
CAPS = (None, 0.6, 0.35)
"""Caps as fractions of the uncapped plan's predicted peak (None: the device's own memory)."""


METHOD_SEQS = (512, 1024, 2048, 4096)
MHA = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=8)
"""The Llama of ``methods``: 8 heads (Ulysses needs the 4-way axis to divide them), 8 key/value heads."""
GPT = dict(layers=2, hidden=64, heads=8)


def llama_batch(config: dict, batch: int, seq: int, device: str = "meta") -> tuple[torch.nn.Module, tuple]:
    """HF's Llama of `config` (seeded) and `batch` x `seq` random token ids and labels, as the CLI's ``hf:llama``
    builds it; on a device other than meta the model is moved there (the inputs stay on the CPU)."""
    torch.manual_seed(0)
    model = hf_model("llama", dict(config))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=g)
    labels = torch.randint(0, config["vocab_size"], (batch, seq), generator=g)
    return (model.to(device) if device != "meta" else model), (ids, labels)


def _model(seq: int, device: str = "meta", **over) -> tuple[torch.nn.Module, tuple]:
    return llama_batch({**LLAMA, **over}, 1, seq, device)


def _cp(p: StagePlan) -> str:
    """The plan's context parallelism: ``gpu (4, all-gather)`` per axis and method, or ``no``."""
    found = context_axes(p.nodes, p.mesh_axes, p.collectives)
    return ", ".join(f"{c.axis} ({p.mesh_shape[p.mesh_axes.index(c.axis)]}, {c.method})" for c in found) or "no"


def _row(seq: int, cap: float | None, p: StagePlan | None, error: str = "") -> str:
    cap_s = fmt_size(cap) if cap else "none"
    if p is None:
        return f"| {seq} | {cap_s} | no plan: {error} | | | | |"
    cp_s = _cp(p)
    rc = ", ".join(p.recompute.regions) if p.recompute and p.recompute.regions else "none"
    return (
        f"| {seq} | {cap_s} | {p.mesh_shape} | {cp_s} | {rc} | {p.time.total_s * 1e3:.3f} ms "
        f"| {fmt_size(p.memory.total)} |"
    )


def run_plan(out: Path) -> None:
    saved: dict[str, str] = {}
    print(
        "| seq | cap per device | mesh | attention sequence-parallel over | recompute | predicted step "
        "| predicted peak |"
    )
    print("| ---: | ---: | --- | --- | --- | ---: | ---: |")
    for seq in SEQS:
        model, inputs = _model(seq)
        free = plan(model, inputs, CLUSTER, mesh_shape=MESH)
        print(_row(seq, None, free), flush=True)
        saved[f"{seq}/none"] = free.to_json()
        for frac in CAPS[1:]:
            cap = frac * free.memory.total
            try:
                p = plan(model, inputs, CLUSTER, mesh_shape=MESH, memory_bytes=cap)
            except PlanError as e:
                print(_row(seq, cap, None, str(e).split(";")[0]), flush=True)
                continue
            print(_row(seq, cap, p), flush=True)
            saved[f"{seq}/{frac}"] = p.to_json()
    out.write_text(json.dumps(saved))


def _method_row(model: str, seq: int, what: str, p: StagePlan | None, error: str = "") -> str:
    if p is None:
        return f"| {model} | {seq} | {what} | no plan: {error} | | |"
    return f"| {model} | {seq} | {what} | {_cp(p)} | {p.time.total_s * 1e3:.3f} ms | {fmt_size(p.memory.total)} |"


def _method_model(name: str, seq: int, device: str = "meta") -> tuple[torch.nn.Module, tuple]:
    """``methods``' models: the 8-head Llama (``llama``) or meshpilot's GPT (``gpt``) at batch 1."""
    if name == "llama":
        return _model(seq, device, **MHA)
    torch.manual_seed(0)
    built = build_model("gpt-tiny", batch=1, seq=seq, device=device, **GPT)
    return built.model, tuple(built.inputs)


def _methods_of(name: str, seq: int, saved: dict[str, str]) -> list[str]:
    """One model at one sequence length: the ILP's plan, capped, and each method pinned; each plan found is
    saved in `saved` as ``name/seq/what``."""
    model, inputs = _method_model(name, seq)
    graph = capture(model, inputs)
    kw = dict(mesh_shape=MESH, graph=graph, mappings=("row",), recompute="none")
    free = plan(model, inputs, CLUSTER, **kw)
    saved[f"{name}/{seq}/ILP"] = free.to_json()
    rows = [_method_row(name, seq, "ILP", free)]
    cap = 0.8 * free.memory.total
    runs = (  # (saved key, row label, planner arguments)
        ("ILP capped", f"ILP, cap {fmt_size(cap)}", dict(memory_bytes=cap)),
        ("all-gather pinned", "all-gather pinned", dict(force={"input:*": "S(1)R"})),
        ("Ulysses pinned", "Ulysses pinned", dict(force=ulysses_pins(graph))),
        ("ring pinned", "ring pinned", dict(force=ring_pins(graph))),
    )
    for key, what, extra in runs:
        try:
            p = plan(model, inputs, CLUSTER, **kw, **extra)
        except PlanError as e:
            rows.append(_method_row(name, seq, what, None, str(e).split(";")[0]))
            continue
        rows.append(_method_row(name, seq, what, p))
        saved[f"{name}/{seq}/{key}"] = p.to_json()
    return rows


def run_methods(out: Path, seqs: tuple[int, ...], models: tuple[str, ...] = ("llama", "gpt")) -> None:
    saved: dict[str, str] = {}
    print("| model | seq | plan | context parallel over (method) | predicted step | predicted peak |")
    print("| --- | ---: | --- | --- | ---: | ---: |")
    for name in models:
        for seq in seqs:
            for row in _methods_of(name, seq, saved):
                print(row, flush=True)
    out.write_text(json.dumps(saved))


def _rank_kernels_s(peers: int, rank: int, order: tuple[int, ...], seq: int, heads: int, dim: int) -> float:
    """Seconds of rank `rank`'s causal attention kernels in the ring of `order` (forward then backward, every
    block pair it computes, on random values of its shard's shapes): the compute the ring's step waits for."""
    import time

    from meshpilot.ops import ring

    layout = ring._Ring("", "gpu", peers, rank, order)
    rows = seq // peers
    g = torch.Generator().manual_seed(rank)
    q, k, v, grad = (torch.randn(1, heads, rows, dim, generator=g) for _ in range(4))
    fwd, bwd = ring._kernels(q)
    scale = dim**-0.5
    t0 = time.perf_counter()
    for src in range(peers):
        for qs, ks, _, diag in ring._blocks(layout, src, q, k, None, True):
            qb, kb, vb = q[:, :, qs], k[:, :, ks].contiguous(), v[:, :, ks].contiguous()
            o, lse = fwd(qb, kb, vb, None, diag, scale)
            bwd(grad[:, :, qs].contiguous(), qb, kb, vb, o, lse, None, diag, scale)
    return time.perf_counter() - t0


def run_zigzag(seqs: tuple[int, ...], repeats: int = 3) -> None:
    """``zigzag``'s tables (module docstring)."""
    from meshpilot.ops import ring

    peers = MESH[0]
    print("| seq | plan's order | ranks' shares of the causal square, contiguous | zig-zag | "
          "predicted step, contiguous | zig-zag | plan's own (whole square) |")  # fmt: skip
    print("| ---: | --- | --- | --- | ---: | ---: | ---: |")
    timed = []
    for seq in seqs:
        model, inputs = _method_model("gpt", seq)
        graph = capture(model, inputs)
        p = plan(model, inputs, CLUSTER, mesh_shape=MESH, graph=graph, mappings=("row",), recompute="none",
                 force=ring_pins(graph, backward=True))  # fmt: skip
        attn = sum(n.seconds for n in p.nodes if n.target.startswith("meshpilot.sdpa"))
        plain, zig = ring.causal_shares(peers, False), ring.causal_shares(peers, True)
        step = {z: p.time.total_s - attn + attn * peers * max(sh) for z, sh in ((False, plain), (True, zig))}
        order = p.sequence_order.order if p.sequence_order is not None else "contiguous"
        print(
            f"| {seq} | {order} | {', '.join(f'{x:.4f}' for x in plain)} | {', '.join(f'{x:.4f}' for x in zig)} "
            f"| {step[False] * 1e3:.3f} ms | {step[True] * 1e3:.3f} ms | {p.time.total_s * 1e3:.3f} ms |",
            flush=True,
        )
        timed.append(seq)
    print()
    print("| seq | order | rank 0 | rank 1 | rank 2 | rank 3 | slowest / mean |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for seq in timed:
        for name, order in (("contiguous", tuple(range(peers))), ("zig-zag", ring.zigzag(peers))):
            per = [float("inf")] * peers
            for _ in range(repeats):  # rounds over the ranks: a load spike hits one round, the least is kept
                for r in range(peers):
                    dim = GPT["hidden"] // GPT["heads"]
                    per[r] = min(per[r], _rank_kernels_s(peers, r, order, seq, GPT["heads"], dim))
            cells = " | ".join(f"{x * 1e3:.1f} ms" for x in per)
            print(f"| {seq} | {name} | {cells} | {max(per) / (sum(per) / peers):.2f} |", flush=True)


def _saved_model(key: str) -> tuple[torch.nn.Module, tuple]:
    """The CPU model of a saved key: ``seq/cap`` (``plan``) or ``name/seq/what`` (``methods``)."""
    parts = key.split("/")
    if len(parts) == 3:
        return _method_model(parts[0], int(parts[1]), "cpu")
    return _model(int(parts[0]), "cpu")


def run_measure(path: Path, keys: list[str]) -> None:
    def label(k: str, p: StagePlan) -> str:
        return f"{k}: mesh {p.mesh_shape}, context parallel {_cp(p)}"

    measure_saved(path, _saved_model, label, keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("plan").add_argument("--out", type=Path, default=Path("/tmp/cp_caps.json"))
    m = sub.add_parser("measure")
    m.add_argument("plans", type=Path)
    m.add_argument("keys", nargs="*", help="which saved plans (seq/cap or name/seq/what), default all")
    me = sub.add_parser("methods")
    me.add_argument("--out", type=Path, default=Path("/tmp/cp_methods.json"))
    me.add_argument("--seqs", type=int, nargs="*", default=list(METHOD_SEQS))
    me.add_argument("--models", nargs="*", choices=("llama", "gpt"), default=["llama", "gpt"])
    zz = sub.add_parser("zigzag")
    zz.add_argument("--seqs", type=int, nargs="*", default=[8192])
    zz.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.cmd == "plan":
        run_plan(args.out)
    elif args.cmd == "methods":
        run_methods(args.out, tuple(args.seqs), tuple(args.models))
    elif args.cmd == "zigzag":
        run_zigzag(tuple(args.seqs), args.repeats)
    else:
        run_measure(args.plans, args.keys)


if __name__ == "__main__":
    main()
