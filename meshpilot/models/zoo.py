"""Small, exact reference models for the planners and runtimes, beside the GPT of `models/gpt.py`.

Each model computes its own training loss from `(inputs, targets)` so a plan's loss can be compared with
the single-device loss. None of them depends on the batch as a whole (no BatchNorm: the Wide-ResNet uses
GroupNorm), so data parallelism is exact. All are constructible on the meta device.

- :class:`MLPModel`: Linear/ReLU stack with a cross-entropy head.
- :class:`BertEncoder`: BERT-like post-LayerNorm encoder (separate q/k/v, bidirectional attention, GELU MLP)
  with a masked-LM style head over every position.
- :class:`WideResNet`: a small Wide-ResNet-like conv net (3x3 convs, residual blocks widened by `k`).
- :class:`MoEModel`: embedding -> transformer-style blocks whose MLP is a GShard top-2 mixture of experts
  written as dispatch / expert / combine einsums (expert parallelism shards the expert dim `e`).
- :class:`BertMoE`, :class:`ViTMoE`: HiDup §6.1's BERT-SGMoE / BERT-Switch / ViT-SGMoE / ViT-Switch (an MoE
  feed-forward in every second layer, top-2 or top-1 gating with capacity and the load-balancing loss).
- :class:`PlanBenchTransformer`: the planning benchmark's transformer (pre-LN, bias-free q/k/v/o, ReLU MLP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import nn


class MLPModel(nn.Module):
    """dims[0] -> dims[1] -> ... -> dims[-1] classes, ReLU between layers; loss = cross-entropy."""

    def __init__(self, dims: tuple[int, ...] = (32, 64, 64, 16)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return F.cross_entropy(x, targets)


class _EncoderLayer(nn.Module):
    def __init__(self, h: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.up, self.down = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """The attention half: ``ln1(x + attention(x))`` (post-LN, as BERT)."""
        b, s, h = x.shape
        d = h // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, heads, s, d]
            return t.view(b, s, self.heads, d).transpose(1, 2)

        att = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.ln1(x + self.o(att.transpose(1, 2).reshape(b, s, h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attend(x)
        return self.ln2(x + self.down(F.gelu(self.up(x))))


class BertEncoder(nn.Module):
    """BERT-like encoder: token + position embeddings, post-LN layers, a vocabulary head on every position."""

    def __init__(self, vocab: int = 64, seq: int = 16, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.layers = nn.ModuleList(_EncoderLayer(hidden, heads, 4 * hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        x = self.ln(self.tok(idx) + self.pos(torch.arange(s, device=idx.device)))  # [b, s, h]
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)  # [b, s, vocab]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _WideBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.n2, self.c2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.skip = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(F.relu(self.n1(x)))
        y = self.c2(F.relu(self.n2(y)))
        return y + (x if self.skip is None else self.skip(x))


class WideResNet(nn.Module):
    """A small Wide-ResNet-like net: stem conv, `blocks` residual blocks of width 16*k, pooled classifier."""

    def __init__(self, k: int = 2, blocks: int = 2, classes: int = 10, channels: int = 3) -> None:
        super().__init__()
        w = 16 * k
        self.stem = nn.Conv2d(channels, w, 3, padding=1, bias=False)
        self.blocks = nn.ModuleList(_WideBlock(w, w, 4) for _ in range(blocks))
        self.norm = nn.GroupNorm(4, w)
        self.fc = nn.Linear(w, classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # [b, w, H, W]
        for block in self.blocks:
            x = block(x)
        x = F.relu(self.norm(x)).mean(dim=(2, 3))  # [b, w]
        return F.cross_entropy(self.fc(x), targets)


class MoELayer(nn.Module):
    """GShard mixture of experts, top-`top_k` gating with capacity `c` per expert, on tokens [s, m] or on
    groups of tokens [g, s, m] (GShard's groups: each group routes its own tokens into `capacity` slots).

    gates [.., s, e] = softmax(x W_g); the top-k experts of each token get a slot in their expert's buffer of
    `capacity` slots in token order, the first choices before the second (tokens past capacity are dropped
    for that expert), giving dispatch [.., s, e, c] (0/1) and combine [.., s, e, c] (gate weights). Then
    (GShard's einsums; ``..`` is the group dim g when there is one):
        expert_in  [e, .., c, m] = einsum("..sec,..sm->e..cm", dispatch, x)
        hidden     [e, .., c, f] = act(einsum("e..cm,emf->e..cf", expert_in, w_in))
        expert_out [e, .., c, m] = einsum("e..cf,efm->e..cm", hidden, w_out)
        y          [.., s, m]    = einsum("..sec,e..cm->..sm", combine, expert_out)
    Sharding `e` over a mesh axis is expert parallelism; the reshard of `x` into expert_in is its all-to-all.
    `top_k` = 2 is the Sparsely-Gated MoE (Shazeer et al.) / GShard, 1 is the Switch Transformer.

    :meth:`moe` also returns the load-balancing loss (Switch / GShard): ``e · Σ_e f_e · P_e`` with ``f_e``
    the fraction of tokens whose first choice is expert e and ``P_e`` the mean gate probability of e.
    """

    def __init__(self, m: int, f: int, experts: int, capacity: int, top_k: int = 2, act: str = "relu") -> None:
        super().__init__()
        self.experts, self.capacity, self.top_k, self.act = experts, capacity, top_k, act
        self.gate = nn.Linear(m, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, m, f) / math.sqrt(m))
        self.w_out = nn.Parameter(torch.randn(experts, f, m) / math.sqrt(f))

    def _route(self, x: torch.Tensor, aux: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        probs = F.softmax(self.gate(x), dim=-1)  # [.., s, e]
        top = probs.topk(self.top_k, dim=-1)
        combine = x.new_zeros(*x.shape[:-1], self.experts, self.capacity)  # [.., s, e, c]
        tokens = x.dim() - 2  # the token dim of [.., s, m]
        for k in range(self.top_k):
            onehot = F.one_hot(top.indices[..., k], self.experts).to(x.dtype)  # [.., s, e]
            prior = combine.sum(dim=-1).gt(0).to(x.dtype).sum(dim=tokens, keepdim=True) if k else 0
            pos = (torch.cumsum(onehot, dim=tokens) - 1 + prior) * onehot  # slot of each token in its expert
            keep = onehot * (pos < self.capacity).to(x.dtype)
            slot = F.one_hot(pos.long().clamp(max=self.capacity - 1), self.capacity).to(x.dtype)  # [.., s, e, c]
            combine = combine + (keep * top.values[..., k : k + 1]).unsqueeze(-1) * slot
        balance = None
        if aux:
            first = F.one_hot(top.indices[..., 0], self.experts).to(x.dtype)
            dims = tuple(range(x.dim() - 1))
            balance = self.experts * (first.mean(dim=dims) * probs.mean(dim=dims)).sum()
        return combine.gt(0).to(x.dtype), combine, balance

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dispatch and combine masks [.., s, e, c] for tokens x [.., s, m]."""
        dispatch, combine, _ = self._route(x, aux=False)
        return dispatch, combine

    def _experts(self, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        act = F.gelu if self.act == "gelu" else F.relu
        expert_in = torch.einsum("...sec,...sm->e...cm", dispatch, x)
        hidden = act(torch.einsum("e...cm,emf->e...cf", expert_in, self.w_in))
        expert_out = torch.einsum("e...cf,efm->e...cm", hidden, self.w_out)
        # the combine contracts (e, c) with e outer, so an expert-sharded expert_out is a shard of the flattened
        # contraction dim (torch.einsum flattens it as (c, e): resharding expert_out for any expert-sharded
        # combine; docs/hidup.md, "Fig. 11 and Fig. 12")
        by_group = expert_out.movedim(0, -3).flatten(-3, -2)  # [.., e·c, m]
        return combine.flatten(-2) @ by_group

    def moe(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output and its load-balancing loss."""
        dispatch, combine, balance = self._route(x, aux=True)
        assert balance is not None
        return self._experts(x, dispatch, combine), balance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dispatch, combine = self.routing(x)
        return self._experts(x, dispatch, combine)


class MoEModel(nn.Module):
    """Embedding -> [LayerNorm -> MoE] residual blocks -> vocabulary head; loss = cross-entropy."""

    def __init__(
        self, vocab: int = 64, hidden: int = 32, experts: int = 4, ffn: int = 64, layers: int = 1, capacity: int = 16
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        self.moes = nn.ModuleList(MoELayer(hidden, ffn, experts, capacity) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx).reshape(-1, self.tok.embedding_dim)  # [s = b*t, m]
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return F.cross_entropy(self.head(x), targets.reshape(-1))


class _MoEEncoderLayer(_EncoderLayer):
    """An encoder layer whose feed-forward is a :class:`MoELayer` over groups of tokens (one group per sequence
    or image); ``forward`` returns the output and the layer's load-balancing loss."""

    def __init__(self, h: int, heads: int, ffn: int, experts: int, capacity: int, top_k: int) -> None:
        nn.Module.__init__(self)
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.moe = MoELayer(h, ffn, experts, capacity, top_k=top_k, act="gelu")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x = self.attend(x)
        y, balance = self.moe.moe(x)  # groups = sequences: [b, s, h]
        return self.ln2(x + y), balance


class _MoEEncoder(nn.Module):
    """HiDup §6.1's MoE encoder: `layers` post-LN BERT layers, every second one's feed-forward a mixture of
    `experts` experts (top-`top_k` gating, GShard's capacity ``ceil(top_k · s / experts · capacity_factor)`` per
    sequence, overflow dropped); the loss adds `balance_weight` × each MoE layer's load-balancing loss."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn: int,
        layers: int,
        experts: int,
        top_k: int,
        tokens: int,
        capacity_factor: float,
        balance_weight: float,
    ) -> None:
        super().__init__()
        capacity = max(1, math.ceil(top_k * tokens / experts * capacity_factor))
        self.balance_weight = balance_weight
        self.layers = nn.ModuleList(
            _MoEEncoderLayer(hidden, heads, ffn, experts, capacity, top_k)
            if i % 2
            else _EncoderLayer(hidden, heads, ffn)
            for i in range(layers)
        )

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        balance = x.new_zeros(())
        for layer in self.layers:
            if isinstance(layer, _MoEEncoderLayer):
                x, b = layer(x)
                balance = balance + b
            else:
                x = layer(x)
        return x, self.balance_weight * balance


class BertMoE(_MoEEncoder):
    """BERT-SGMoE / BERT-Switch (HiDup §6.1): BERT-Base-like (token + position embeddings, post-LN encoder,
    GELU), `layers` layers with an MoE feed-forward in every second one, a vocabulary head on every position;
    loss = cross-entropy + the load-balancing loss."""

    def __init__(
        self,
        vocab: int = 30522,
        seq: int = 128,
        hidden: int = 768,
        heads: int = 12,
        ffn: int = 3072,
        layers: int = 8,
        experts: int = 8,
        top_k: int = 2,
        capacity_factor: float = 1.0,
        balance_weight: float = 0.01,
    ) -> None:
        super().__init__(hidden, heads, ffn, layers, experts, top_k, seq, capacity_factor, balance_weight)
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = idx.shape[1]
        x = self.ln(self.tok(idx) + self.pos(torch.arange(s, device=idx.device)))  # [b, s, h]
        x, balance = self.encode(x)
        logits = self.head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)) + balance


class ViTMoE(_MoEEncoder):
    """ViT-SGMoE / ViT-Switch (HiDup §6.1): images cut into `patch`×`patch` patches, a linear patch embedding
    plus position embeddings, the same MoE encoder (BERT-Base-like, post-LN), mean-pooled into a classifier;
    loss = cross-entropy + the load-balancing loss."""

    def __init__(
        self,
        image: int = 32,
        patch: int = 4,
        channels: int = 3,
        classes: int = 10,
        hidden: int = 768,
        heads: int = 12,
        ffn: int = 3072,
        layers: int = 8,
        experts: int = 16,
        top_k: int = 2,
        capacity_factor: float = 1.0,
        balance_weight: float = 0.01,
    ) -> None:
        tokens = (image // patch) ** 2
        super().__init__(hidden, heads, ffn, layers, experts, top_k, tokens, capacity_factor, balance_weight)
        self.image, self.patch, self.channels = image, patch, channels
        self.embed = nn.Linear(channels * patch * patch, hidden)
        self.pos = nn.Parameter(torch.randn(tokens, hidden) * 0.02)
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, c, hw, p = images.shape[0], self.channels, self.image, self.patch
        n = hw // p
        patches = images.reshape(b, c, n, p, n, p).permute(0, 2, 4, 1, 3, 5).reshape(b, n * n, c * p * p)
        x = self.ln(self.embed(patches) + self.pos)  # [b, tokens, h]
        x, balance = self.encode(x)
        return F.cross_entropy(self.head(x.mean(dim=1)), targets) + balance


HIDUP_MODELS = {
    # name: (class, top_k, paper size?) — experts proportional to devices: 1 per GPU (BERT), 2 per GPU (ViT),
    # for the 8 GPUs of HiDup's 2 x 4 clusters
    "bert-sgmoe": (BertMoE, dict(top_k=2, experts=8)),
    "bert-switch": (BertMoE, dict(top_k=1, experts=8)),
    "vit-sgmoe": (ViTMoE, dict(top_k=2, experts=16)),
    "vit-switch": (ViTMoE, dict(top_k=1, experts=16)),
}
"""HiDup §6.1's four benchmark models at paper size (BERT-Base-like, 8 layers; 8 GPUs' worth of experts)."""

HIDUP_TINY = {
    "bert": dict(vocab=64, seq=16, hidden=32, heads=4, ffn=64, layers=2, experts=4),
    "vit": dict(image=8, patch=4, hidden=32, heads=4, ffn=64, layers=2, experts=4),
}
"""The tiny variants (``bert-sgmoe-tiny`` …) for runs: the same code at toy sizes."""


def hidup_model(name: str) -> nn.Module:
    """The HiDup model `name` (``bert-sgmoe``, ``vit-switch-tiny``, …; :data:`HIDUP_MODELS`)."""
    base = name.removesuffix("-tiny")
    cls, kw = HIDUP_MODELS[base]
    kw = dict(kw)
    if name.endswith("-tiny"):
        kw.update(HIDUP_TINY[base.split("-")[0]])
    return cls(**kw)


class _BenchBlock(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.ln1(x)

        def split(t: torch.Tensor) -> torch.Tensor:  # [b, s, h] -> [b, heads, s, h/heads]
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(split(self.q(y)), split(self.k(y)), split(self.v(y)), is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.relu(self.up(self.ln2(x))))


class PlanBenchTransformer(nn.Module):
    """The planning benchmark: `layers` pre-LN blocks, causal attention with bias-free q/k/v/o, bias-free ReLU
    MLP of 4h; input [b, s, h] activations, loss = mean of the output (the planner needs a scalar)."""

    def __init__(self, layers: int = 32, hidden: int = 4096, heads: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_BenchBlock(hidden, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()


@dataclass(frozen=True)
class Example:
    """A model plus example inputs of the right shapes (meta tensors when built on the meta device)."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]


def example_inputs(name: str, model: nn.Module, batch: int, device: str | torch.device = "cpu") -> tuple:
    """Deterministic example inputs for the zoo model `name` (random data from a fixed seed)."""
    g = torch.Generator().manual_seed(0)
    dev = torch.device(device)

    def ints(high: int, *shape: int) -> torch.Tensor:
        t = torch.randint(0, high, shape, generator=g)
        return t.to(dev) if dev.type != "meta" else torch.empty(shape, dtype=torch.long, device="meta")

    def floats(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, generator=g)
        return t.to(dev) if dev.type != "meta" else torch.empty(shape, device="meta")

    if isinstance(model, MLPModel):
        first, last = model.layers[0].in_features, model.layers[-1].out_features
        return floats(batch, first), ints(last, batch)
    if isinstance(model, BertEncoder):
        vocab, seq = model.tok.num_embeddings, model.pos.num_embeddings
        return ints(vocab, batch, seq), ints(vocab, batch, seq)
    if isinstance(model, WideResNet):
        return floats(batch, model.stem.in_channels, 8, 8), ints(model.fc.out_features, batch)
    if isinstance(model, MoEModel):
        vocab = model.tok.num_embeddings
        return ints(vocab, batch, 8), ints(vocab, batch, 8)
    if isinstance(model, BertMoE):
        vocab, seq = model.tok.num_embeddings, model.pos.num_embeddings
        return ints(vocab, batch, seq), ints(vocab, batch, seq)
    if isinstance(model, ViTMoE):
        return floats(batch, model.channels, model.image, model.image), ints(model.head.out_features, batch)
    if isinstance(model, PlanBenchTransformer):
        h = model.blocks[0].q.in_features
        return (floats(batch, 2048 if dev.type == "meta" else 8, h),)
    raise ValueError(f"no example inputs for model {name!r}")


# -------------------------------------------------------------------------------- Alpa's benchmark models
# Alpa §8.1 and Appendix B (Tables 6–8): GPT-3, GShard MoE and Wide-ResNet at the paper's sizes, each with the
# number of GPUs the paper trains it on. `alpa_models()` lists them; `models.builtin_models()` serves them by
# name (`--model gpt3-39b`). GPTs are the zoo's GPT (`models/gpt.py`) with the table's shape.


class AlpaFamily(StrEnum):
    """Which of Alpa's three benchmark families a model is (§8.1)."""

    GPT = "gpt"
    MOE = "moe"
    WRESNET = "wresnet"


ALPA_GPT_BATCH = 1024
"""Global batch of every GPT-3 and MoE row (Alpa §8.1: sequences of 1024 tokens)."""

ALPA_DTYPE = torch.float16
"""Parameters and activations of every row (Alpa §9: mixed-precision training; the GPT rows' ``GPTConfig.dtype``):
with the accounting's AdamW states in the parameter's dtype, 8 bytes a parameter, so GShard 70B's 560 GB fit
its 64 GPUs of 16 GB (in float32, 1.1 TB would not)."""

ALPA_WRESNET_BATCH = 1536
"""Global batch of the Wide-ResNet rows (Alpa Table 4)."""


@dataclass(frozen=True)
class AlpaModel:
    """One row of Alpa's Tables 6–8: the model's shape, its global batch and the paper's GPU count."""

    name: str
    family: AlpaFamily
    params: str
    """The table's parameter count, as printed (``39B``)."""
    devices: int
    """GPUs the paper trains it on (its default device count here)."""
    global_batch: int
    shape: dict
    """The table's columns: GPT ``layers, hidden, heads``; MoE the same and ``experts``; Wide-ResNet ``layers,
    channels, width``."""

    @property
    def summary(self) -> str:
        cols = " ".join(f"{k}={v}" for k, v in self.shape.items())
        return f"Alpa {self.family.value} {self.params} ({cols}), {self.devices} GPUs in the paper"


_TABLE_6 = [("350m", 24, 1024, 16, 1), ("1.3b", 24, 2048, 32, 4), ("2.6b", 32, 2560, 32, 8),
            ("6.7b", 32, 4096, 32, 16), ("15b", 48, 5120, 32, 32), ("39b", 48, 8192, 64, 64)]  # fmt: skip
_TABLE_7 = [("380m", 8, 768, 16, 8, 1), ("1.3b", 16, 768, 16, 16, 4), ("2.4b", 16, 1024, 16, 16, 8),
            ("10b", 16, 1536, 16, 32, 16), ("27b", 16, 2048, 32, 48, 32), ("70b", 32, 2048, 32, 64, 64)]  # fmt: skip
_TABLE_8 = [("250m", 50, 160, 2, 1), ("1b", 50, 320, 2, 4), ("2b", 50, 448, 2, 8), ("4b", 50, 640, 2, 16),
            ("6.8b", 50, 320, 16, 32), ("13b", 101, 320, 16, 64)]  # fmt: skip


def alpa_models() -> dict[str, AlpaModel]:
    """Every row of Alpa's Tables 6–8 by name: ``gpt3-350m`` … ``gpt3-39b``, ``gshard-moe-380m`` …
    ``gshard-moe-70b``, ``wresnet-250m`` … ``wresnet-13b``."""
    out = [AlpaModel(f"gpt3-{p}", AlpaFamily.GPT, p.upper(), n, ALPA_GPT_BATCH, dict(layers=L, hidden=h, heads=a))
           for p, L, h, a, n in _TABLE_6]  # fmt: skip
    out += [AlpaModel(f"gshard-moe-{p}", AlpaFamily.MOE, p.upper(), n, ALPA_GPT_BATCH,
                      dict(layers=L, hidden=h, heads=a, experts=e)) for p, L, h, a, e, n in _TABLE_7]  # fmt: skip
    out += [AlpaModel(f"wresnet-{p}", AlpaFamily.WRESNET, p.upper(), n, ALPA_WRESNET_BATCH,
                      dict(layers=L, channels=c, width=w)) for p, L, c, w, n in _TABLE_8]  # fmt: skip
    return {m.name: m for m in out}


def alpa_gpt_config(row: AlpaModel):
    """The GPTConfig of a Table 6 row: vocabulary 51200, sequence 1024, :data:`ALPA_DTYPE`, batch = the global
    batch."""
    from meshpilot.models.gpt import GPTConfig

    s = row.shape
    return GPTConfig(vocab=51200, seq=1024, layers=s["layers"], hidden=s["hidden"], heads=s["heads"],
                     batch=row.global_batch, dtype=str(ALPA_DTYPE).removeprefix("torch."))  # fmt: skip


GSHARD_GROUP = 2048
"""Tokens per routing group of :class:`GShardMoE` (Alpa's MoE benchmarks: ``expert_group_size`` 2048)."""


def _routing_group(tokens: int, group: int) -> int:
    """Tokens per routing group for `tokens` in groups of at most `group`: all of them when fewer."""
    g = min(group, tokens)
    if tokens % g:
        raise ValueError(f"GShardMoE: {tokens} tokens do not split into groups of {g}; give a batch whose tokens "
                         f"are a multiple of {g}")  # fmt: skip
    return g


class _GShardBlock(nn.Module):
    """Pre-LN transformer layer of GShard: attention, then the zoo's top-2 :class:`MoELayer` over the batch's
    tokens in groups of `group` (or the GPT MLP when `moe` is None)."""

    def __init__(self, cfg, moe: MoELayer | None, group: int) -> None:
        from meshpilot.models.gpt import MLP, CausalSelfAttention

        super().__init__()
        self.group = group
        self.ln1, self.ln2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ffn = moe if moe is not None else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        y = self.ln2(x)
        if isinstance(self.ffn, MoELayer):
            b, s, h = y.shape
            group = _routing_group(b * s, self.group)
            return x + self.ffn(y.reshape(b * s // group, group, h)).view(b, s, h)  # [groups, group, h]
        return x + self.ffn(y)


class GShardMoE(nn.Module):
    """GShard MoE language model (Alpa §8.1): token + position embedding, `layers` transformer layers whose
    MLP is a top-2 mixture of `experts` experts of width 4h, final LayerNorm, vocabulary head. Every layer has
    experts: Table 7's parameter counts are those (380M: 8 layers of 8 experts at h=768), though §8.1's text
    says every second layer. Tokens are routed in GShard's groups of :data:`GSHARD_GROUP` (Alpa's benchmark
    sets ``expert_group_size`` 2048), or all of them when the batch has fewer: each group fills its own
    ``2 · group / experts`` slots per expert (capacity factor 1 for top-2), so the dispatch and combine
    masks grow with the batch, not with its square."""

    def __init__(self, vocab: int, seq: int, layers: int, hidden: int, heads: int, experts: int, tokens: int) -> None:
        from meshpilot.models.gpt import GPTConfig

        super().__init__()
        cfg = GPTConfig(vocab=vocab, seq=seq, layers=layers, hidden=hidden, heads=heads)
        group = _routing_group(tokens, GSHARD_GROUP)
        capacity = max(1, math.ceil(2 * group / experts))
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(
            _GShardBlock(cfg, MoELayer(hidden, 4 * hidden, experts, capacity), group) for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _Bottleneck(nn.Module):
    """ResNet bottleneck: 1x1 to `inner`, 3x3 (stride), 1x1 to `out`, each after GroupNorm + ReLU (pre-act)."""

    def __init__(self, cin: int, inner: int, out: int, stride: int) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(_groups(cin), cin), nn.Conv2d(cin, inner, 1, bias=False)
        self.n2, self.c2 = nn.GroupNorm(_groups(inner), inner), nn.Conv2d(inner, inner, 3, stride, 1, bias=False)
        self.n3, self.c3 = nn.GroupNorm(_groups(inner), inner), nn.Conv2d(inner, out, 1, bias=False)
        self.skip = nn.Conv2d(cin, out, 1, stride, bias=False) if (cin, stride) != (out, 1) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c1(F.relu(self.n1(x)))
        y = self.c2(F.relu(self.n2(y)))
        y = self.c3(F.relu(self.n3(y)))
        return y + (x if self.skip is None else self.skip(x))


def _groups(c: int) -> int:
    return math.gcd(c, 32)


class WideBottleneckResNet(nn.Module):
    """Wide-ResNet of Alpa's Table 8: a 7x7 stem of `channels`, four stages of bottleneck blocks (3, 4, 6, 3
    for 50 layers; 3, 4, 23, 3 for 101) of inner width ``channels · 2^i`` and output ``2 · width · channels ·
    2^i`` (the paper does not define its layers; this reading gives Table 8's 6.8B row 6.65B, its w=2 rows
    0.6x and its 13B row 8.7B), pooled classifier. GroupNorm instead of BatchNorm, as the zoo's other WRN
    (data parallelism stays exact)."""

    def __init__(self, layers: int = 50, channels: int = 64, width: int = 2, classes: int = 1024) -> None:
        super().__init__()
        stages = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}.get(layers)
        if stages is None:
            raise ValueError(f"WideBottleneckResNet: layers={layers}; give 50 or 101")
        self.stem = nn.Conv2d(3, channels, 7, 2, 3, bias=False)
        blocks, cin = [], channels
        for i, count in enumerate(stages):
            inner, out = channels * 2**i, 2 * width * channels * 2**i
            for j in range(count):
                blocks.append(_Bottleneck(cin, inner, out, 2 if j == 0 and i > 0 else 1))
                cin = out
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.GroupNorm(_groups(cin), cin)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(self.stem(x), 3, 2, 1)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.fc(F.relu(self.norm(x)).mean(dim=(2, 3))), targets)


def alpa_build(row: AlpaModel, device: str | torch.device = "meta", batch: int | None = None) -> tuple:
    """(module, example inputs) of an Alpa row for a batch of `batch` (default: the global batch) on `device`."""
    from meshpilot.models import _gpt_builder

    b = batch or row.global_batch
    s = row.shape
    if row.family == AlpaFamily.GPT:
        return _gpt_builder(alpa_gpt_config(row))(str(device), b)
    g = torch.Generator().manual_seed(0)
    dev = torch.device(device)

    def data(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev) if dev.type != "meta" else torch.empty(t.shape, dtype=t.dtype, device="meta")

    with torch.device(device):
        if row.family == AlpaFamily.MOE:
            model = GShardMoE(32000, 1024, s["layers"], s["hidden"], s["heads"], s["experts"], b * 1024)
        else:
            model = WideBottleneckResNet(s["layers"], s["channels"], s["width"], 1024)
    model = model.to(ALPA_DTYPE)
    if row.family == AlpaFamily.MOE:
        shape = (b, 1024)
        return model, (
            data(torch.randint(0, 32000, shape, generator=g)),
            data(torch.randint(0, 32000, shape, generator=g)),
        )
    img = torch.empty(b, 3, 224, 224, device="meta") if dev.type == "meta" else torch.randn(b, 3, 224, 224, generator=g)
    img = img.to(ALPA_DTYPE)
    return model, (data(img) if dev.type != "meta" else img, data(torch.randint(0, 1024, (b,), generator=g)))
