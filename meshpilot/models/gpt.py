"""Single-device GPT used as the numerical reference for meshpilot's parallel runtimes.

Pre-LayerNorm decoder blocks with a fused QKV projection whose output features are laid out
per head as ``[heads, 3, head_dim]``: slicing the ``3h`` output features into contiguous,
equal blocks therefore hands out whole heads together with their q, k and v, which is what
head-parallel attention (Megatron-LM, ATP) needs. The model is constructible on the meta device
(``with torch.device("meta"): GPT(cfg)``) for shape/FLOP analysis without allocating memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ATP_M1",
    "ATP_M2",
    "ATP_M3",
    "ATP_M4",
    "BUILTIN_GPTS",
    "GPT",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "MLP",
    "gpt_tiny",
]

_DTYPES = ("float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model and of the batch it is trained on."""

    vocab: int
    """Vocabulary size (rows of the token embedding, columns of the lm head)."""
    seq: int
    """Maximum sequence length (rows of the position embedding); the training sequence length."""
    layers: int
    """Number of transformer blocks."""
    hidden: int
    """Hidden size h (the width of the residual stream)."""
    heads: int
    """Attention heads; head_dim = hidden // heads."""
    mlp_ratio: int = 4
    """MLP inner width as a multiple of hidden (4 in GPT and in ATP's Eq. 2)."""
    batch: int = 4
    """Micro-batch size b used for planning and benchmarks (not enforced by the model)."""
    dtype: str = "float32"
    """Parameter/activation dtype name: float32, float16, bfloat16 or float64."""

    def __post_init__(self) -> None:
        for name in ("vocab", "seq", "layers", "hidden", "heads", "mlp_ratio", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(
                    f"GPTConfig.{name}={value!r} is invalid: it must be a positive integer; "
                    f"pass e.g. {name}=1 or larger"
                )
        if self.hidden % self.heads != 0:
            lo = (self.hidden // self.heads) * self.heads
            raise ValueError(
                f"GPTConfig.hidden={self.hidden} is not divisible by heads={self.heads}; "
                f"choose hidden as a multiple of heads (e.g. hidden={max(lo, self.heads)} or "
                f"{lo + self.heads}) or a heads count that divides hidden"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"GPTConfig.dtype={self.dtype!r} is not supported; use one of {_DTYPES}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def params_per_layer(self) -> int:
        """Parameters of one block: (4 + 2*mlp_ratio) h^2 weights + biases + 2 LayerNorms."""
        h, r = self.hidden, self.mlp_ratio
        return (4 + 2 * r) * h * h + (3 + 1 + r + 1) * h + 4 * h

    def num_params(self) -> int:
        """All parameters: embeddings, blocks, final LayerNorm and the untied lm head."""
        h = self.hidden
        return self.vocab * h + self.seq * h + self.layers * self.params_per_layer() + 2 * h + h * self.vocab


# ATP (Table 2) models. The paper gives hidden size and heads, per-layer parameters and per-layer
# TFLOPs only (batch 4, sequence 2048); its per-layer TFLOPs equal 72*b*s*h^2*(1 + s/(6h))
# counted in units of 2^40 FLOPs. The layer count (24) and the vocabulary (51200, the usual
# padded GPT-2 vocabulary) are our choice: the table does not fix them.
ATP_M1 = GPTConfig(vocab=51200, seq=2048, layers=24, hidden=2048, heads=16, batch=4)
ATP_M2 = GPTConfig(vocab=51200, seq=2048, layers=24, hidden=4096, heads=32, batch=4)
ATP_M3 = GPTConfig(vocab=51200, seq=2048, layers=24, hidden=8192, heads=64, batch=4)
ATP_M4 = GPTConfig(vocab=51200, seq=2048, layers=24, hidden=12288, heads=96, batch=4)

GPT3_175B = GPTConfig(vocab=51200, seq=2048, layers=96, hidden=12288, heads=96, batch=1536, dtype="float16")
"""GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, 96 heads, context 2048; batch 1536
sequences, the 3.2M tokens of the paper), fp16: issue 10's planning-speed target on ``dgx-h100:512``."""

BUILTIN_GPTS: dict[str, GPTConfig] = {
    "atp-m1": ATP_M1,
    "atp-m2": ATP_M2,
    "atp-m3": ATP_M3,
    "atp-m4": ATP_M4,
}


def gpt_tiny(**overrides: int | str) -> GPTConfig:
    """A tiny GPT for tests: 8 heads (divides 1..8-way head sharding), batch 4 (chunks 1, 2, 4)."""
    fields: dict[str, int | str] = dict(vocab=64, seq=16, layers=2, hidden=32, heads=8, batch=4)
    fields.update(overrides)
    return GPTConfig(**fields)  # type: ignore[arg-type]


class CausalSelfAttention(nn.Module):
    """Fused QKV (output laid out [heads, 3, head_dim]) -> causal SDPA -> output projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h, dt = cfg.hidden, cfg.torch_dtype
        self.heads = cfg.heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(h, 3 * h, dtype=dt)
        self.proj = nn.Linear(h, h, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        qkv = self.qkv(x).view(b, t, self.heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # [b, heads, t, head_dim]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class MLP(nn.Module):
    """Linear(h, r*h) -> GELU -> Linear(r*h, h)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        h, dt = cfg.hidden, cfg.torch_dtype
        self.fc = nn.Linear(h, cfg.mlp_ratio * h, dtype=dt)
        self.proj = nn.Linear(cfg.mlp_ratio * h, h, dtype=dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        dt = cfg.torch_dtype
        self.ln1 = nn.LayerNorm(cfg.hidden, dtype=dt)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, dtype=dt)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embedding, ``layers`` blocks, final LayerNorm, untied lm head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dt = cfg.torch_dtype
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden, dtype=dt)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden, dtype=dt)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden, dtype=dt)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False, dtype=dt)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02) weights and embeddings, zero biases, unit LayerNorms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx`` [b, t] token ids (t <= seq). Returns logits [b, t, vocab], or the mean
        cross-entropy over all b*t tokens when ``targets`` [b, t] is given."""
        b, t = idx.shape
        if t > self.cfg.seq:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq={self.cfg.seq}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(b * t, -1), targets.reshape(b * t))
