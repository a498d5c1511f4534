"""Built-in models: the papers' benchmark models and small exact test models, meta-device constructible.

`builtin_models()` maps a name (`--model NAME`) to a :class:`ModelEntry`; `entry.build(device, batch)`
returns the module and example inputs ``(inputs..., targets)`` whose call gives the training loss.
GPT entries also carry a `GPTConfig` (layers, hidden, heads, batch, seq), which the ATP search reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from meshpilot.errors import UserError


@dataclass(frozen=True)
class ModelEntry:
    """A built-in model: its name, a one-line summary, its config (GPTs) and how to build it."""

    name: str
    summary: str
    build: Callable[[str, int | None], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    """build(device, batch) -> (module, example inputs); device "meta" allocates nothing."""
    config: Any = None
    devices: int | None = None
    """The device count the model is benchmarked on (Alpa's rows: the paper's GPUs), when it has one."""


def _gpt_builder(cfg: Any) -> Callable[[str, int | None], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def build(device: str = "cpu", batch: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        from meshpilot.models.gpt import GPT

        b = batch or cfg.batch
        with torch.device(device):
            model = GPT(cfg)
        if device == "meta":
            idx = torch.empty(b, cfg.seq, dtype=torch.long, device="meta")
            return model, (idx, idx)
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, cfg.vocab, (b, cfg.seq + 1), generator=g)
        return model, (idx[:, :-1].contiguous(), idx[:, 1:].contiguous())

    return build


def _zoo_builder(factory: Callable[[], nn.Module], default_batch: int):
    def build(device: str = "cpu", batch: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        from meshpilot.models.zoo import example_inputs

        with torch.device(device):
            model = factory()
        return model, example_inputs(type(model).__name__, model, batch or default_batch, device)

    return build


def builtin_models() -> dict[str, ModelEntry]:
    """Every built-in model by name."""
    from meshpilot.models import zoo
    from meshpilot.models.gpt import BUILTIN_GPTS, gpt_tiny

    gpts = dict(BUILTIN_GPTS)
    gpts["gpt-tiny"] = gpt_tiny()
    out = {
        name: ModelEntry(
            name,
            f"GPT, L={cfg.layers} h={cfg.hidden} heads={cfg.heads} b={cfg.batch} s={cfg.seq}",
            _gpt_builder(cfg),
            cfg,
        )
        for name, cfg in gpts.items()
    }
    zoo_entries = [
        ("mlp", "MLP 32-64-64-16, cross-entropy", zoo.MLPModel, 8),
        ("bert-tiny", "BERT-like post-LN encoder, 2 layers, h=32, 4 heads", zoo.BertEncoder, 4),
        ("wrn-tiny", "Wide-ResNet-like conv net, width 32, GroupNorm", zoo.WideResNet, 8),
        ("moe-tiny", "GShard top-2 MoE, 4 experts, h=32", zoo.MoEModel, 4),
        (
            "bench-transformer",
            "planning benchmark: 32 layers, h=4096, 32 heads, b=64 s=2048",
            zoo.PlanBenchTransformer,
            64,
        ),
    ]
    for base, (cls, kw) in zoo.HIDUP_MODELS.items():
        gate = "Sparsely-Gated top-2" if kw["top_k"] == 2 else "Switch top-1"
        arch = "BERT-Base-like" if cls is zoo.BertMoE else "ViT (BERT-Base-like encoder, 32x32 images)"
        zoo_entries.append(
            (
                base,
                f"HiDup {arch}, 8 layers, MoE every 2nd FFN, {gate}, {kw['experts']} experts",
                partial(zoo.hidup_model, base),
                64,
            )
        )
        zoo_entries.append(
            (
                f"{base}-tiny",
                f"{base} at toy size (h=32, 2 layers, 4 experts)",
                partial(zoo.hidup_model, f"{base}-tiny"),
                4,
            )
        )
    for name, summary, factory, batch in zoo_entries:
        out[name] = ModelEntry(name, summary, _zoo_builder(factory, batch))
    from meshpilot.models.gpt import GPT3_175B

    c = GPT3_175B
    out["gpt3-175b"] = ModelEntry(
        "gpt3-175b",
        f"GPT-3 175B, L={c.layers} h={c.hidden} heads={c.heads} b={c.batch} s={c.seq}, planned for 4,096 GPUs",
        _gpt_builder(c),
        c,
        4096,
    )
    for name, row in zoo.alpa_models().items():  # Alpa's Tables 6–8
        config = zoo.alpa_gpt_config(row) if row.family == zoo.AlpaFamily.GPT else None
        out[name] = ModelEntry(name, row.summary, _alpa_builder(row), config, row.devices)
    return out


def _alpa_builder(row: Any):
    def build(device: str = "cpu", batch: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        from meshpilot.models.zoo import alpa_build

        return alpa_build(row, device, batch)

    return build


def gpt_config(name: str | None, **overrides: Any) -> Any:
    """The GPTConfig of built-in `name` with `overrides` (None values ignored); 'gpt' = a 24-layer h=4096 base."""
    from meshpilot.models.gpt import GPTConfig

    given = {k: v for k, v in overrides.items() if v is not None}
    models = builtin_models()
    if name is None or name == "gpt":
        base = GPTConfig(vocab=51200, seq=2048, layers=24, hidden=4096, heads=32, batch=4)
    elif name in models and models[name].config is not None:
        base = models[name].config
    else:
        gpt_names = [k for k, v in models.items() if v.config is not None]
        raise UserError(
            f"--model {name!r}: not a GPT model; choose one of {', '.join(gpt_names)} (or 'gpt' with --hidden ...)"
        )
    try:
        return replace(base, **given)
    except ValueError as e:
        raise UserError(f"--model {name}: {e}") from None
