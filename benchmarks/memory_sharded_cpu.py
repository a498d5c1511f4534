"""Predicted vs measured peak memory of sharded plans, on gloo CPU ranks (the accounting beyond one device).

    torchrun --standalone --nproc-per-node 4 benchmarks/memory_sharded_cpu.py

A tiny GPT (2 layers, h 64, vocab 256, batch 8 x 32, fp32) under the forced plans of
``meshpilot.planner.forced`` (data parallel, Megatron TP, ZeRO-3) on every 2D mesh of the world, run by
``meshpilot.parallelize`` with foreach AdamW: one warm-up step, then every rank's peak storage bytes over two
full steps (``StorageTracker``: its parameter shards, AdamW states and inputs, plus everything the steps
allocate) against the plan's predicted peak (``meshpilot.planner.accounting``). Rank 0 prints one line per
(plan, mesh): predicted, the ranks' measured peaks, and predicted / the largest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import meshpilot  # noqa: E402
from meshpilot.cluster.memtrack import StorageTracker  # noqa: E402
from meshpilot.cluster.mesh import mesh_shapes_2d  # noqa: E402
from meshpilot.models.gpt import GPT, GPTConfig  # noqa: E402
from meshpilot.planner import forced  # noqa: E402


def measure(kind: str, shape: tuple[int, int]) -> tuple[float, list[int]]:
    cfg = GPTConfig(vocab=256, seq=32, layers=2, hidden=64, heads=4, batch=8)
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g) for _ in range(2))
    force = getattr(forced, kind)(model, (x, y), shape)
    plan = meshpilot.plan(model, (x, y), "atp-ic3", mesh_shape=shape, force=force).only
    pm = meshpilot.parallelize(model, plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)

    def step() -> None:
        pm(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    with StorageTracker(existing=[*pm.parameters(), *state, x, y]) as tracker:
        step()
        step()
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, tracker.peak)
    return plan.memory.total, peaks


def main() -> None:
    dist.init_process_group("gloo")
    for kind in ("data_parallel", "megatron_tp", "zero3"):
        for shape in mesh_shapes_2d(dist.get_world_size()):
            predicted, peaks = measure(kind, tuple(shape))
            if dist.get_rank() == 0:
                print(
                    f"{kind:14s} mesh {tuple(shape)}: predicted {predicted / 2**20:.3f} MiB, measured "
                    f"{', '.join(f'{p / 2**20:.3f}' for p in peaks)} MiB; predicted / largest "
                    f"{predicted / max(peaks):.3f}",
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
