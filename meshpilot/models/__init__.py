"""Built-in models: the papers' benchmark models, constructible on the meta device at full size.

`builtin_models()` maps a name (`--model NAME`) to a :class:`ModelEntry`. GPT-like entries carry a
`GPTConfig` (layers, hidden, heads, batch, seq), which the ATP search needs and the planners build from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from meshpilot.errors import UserError


@dataclass(frozen=True)
class ModelEntry:
    """A built-in model: its name, a one-line summary and its config."""

    name: str
    summary: str
    config: Any


def builtin_models() -> dict[str, ModelEntry]:
    """Every built-in model by name."""
    from meshpilot.models.gpt import BUILTIN_GPTS

    out = {}
    for name, cfg in BUILTIN_GPTS.items():
        out[name] = ModelEntry(
            name, f"GPT, L={cfg.layers} h={cfg.hidden} heads={cfg.heads} b={cfg.batch} s={cfg.seq}", cfg
        )
    return out


def gpt_config(name: str | None, **overrides: Any) -> Any:
    """The GPTConfig of built-in `name` with `overrides` (None values ignored); name None = only overrides."""
    from meshpilot.models.gpt import GPTConfig

    given = {k: v for k, v in overrides.items() if v is not None}
    if name is None or name == "gpt":
        base = GPTConfig(vocab=51200, seq=2048, layers=24, hidden=4096, heads=32, batch=4)
    else:
        models = builtin_models()
        if name not in models:
            raise UserError(
                f"--model {name!r}: unknown model; choose one of {', '.join(models)} (or 'gpt' with --hidden ...)"
            )
        base = models[name].config
    try:
        return replace(base, **given)
    except ValueError as e:
        raise UserError(f"--model {name}: {e}") from None
