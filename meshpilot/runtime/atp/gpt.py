"""A GPT on a 2D ATP mesh (Fig. 6), numerically equal to :class:`meshpilot.models.gpt.GPT`.

What is parallel
----------------
- Transformer blocks: fully. QKV and MLP-up are column-first, out-proj and MLP-down row-first;
  the attention core runs on ``heads / (d1 * d2)`` local heads (scatter over atp1 before it,
  all-gather over atp1 after it); LayerNorms are exact on the atp1-sharded hidden dim.
- Embeddings: token and position tables are split on the hidden dim over atp1
  (``[Replicate, Shard(1)]``), so the lookup yields the ``[Replicate, Shard(-1)]`` residual
  stream directly; no communication, but replicated over atp0 (memory ``V*h/d2`` per rank).
- Final LayerNorm: as in the blocks. LM head: a column-first ``ATPLinear(h, vocab)`` without
  bias (vocab split over atp0), followed by Megatron-style vocab-parallel cross-entropy over
  atp0 (an all-reduce MAX and an all-reduce SUM of ``[sum exp, target logit]`` per token; no
  backward comm). Its forward all-reduce over atp1 carries ``b*s*V/d1`` elements, which for
  d2 > 1 is more than an all-gather of the hidden state would be; kept for simplicity.
- ``forward(idx)`` without targets all-gathers the logits over atp0 and returns the full
  ``[b, t, V]`` on every rank (inference/debug path).

What is not parallel: the token ids and targets (every TP rank gets the same batch; data
parallel ranks get different ones), the loss value (replicated on all TP ranks) and the
optimizer (each rank steps its own shards).

Data parallelism: with a ``dp`` mesh (see :func:`meshpilot.runtime.atp.mesh.init_meshes`)
every replica computes the loss of its own batch; call :meth:`ATPGPT.sync_gradients` after
``backward()`` to average gradients over ``dp`` (the loss is then the mean over the global
batch when the per-replica batches are the same size).

Chunk-based overlap: ``chunks=k`` splits the batch into k chunks (``torch.chunk`` on dim 0)
that run through the model as a wavefront: at every layer chunk i's collective is launched
asynchronously and waited on only when chunk i reaches the next layer, i.e. after chunks
i+1..k-1 have done this layer's compute. Results equal ``chunks=1`` up to float summation order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpilot.graph.capture import Phase
from meshpilot.models.gpt import GPT, GPTConfig
from meshpilot.runtime import collective_log
from meshpilot.runtime.atp.comm import (
    GatherLastDim,
    MeshAxis,
    Pending,
    ScatterLastDim,
    VocabParallelCrossEntropy,
    all_reduce,
    blocks_to_last_dim,
)
from meshpilot.runtime.atp.layers import (
    COLUMN_FIRST,
    ROW_FIRST,
    ATPLinear,
    ShardedEmbedding,
    ShardedLayerNorm,
    local_of,
)
from meshpilot.runtime.atp.mesh import dp_mesh_of

__all__ = ["ATPGPT", "ATPAttention", "ATPBlock", "ATPMLP", "Stage", "run_stages"]

Stage = Callable[[Any], Pending[Any]]
"""One layer applied to one chunk: takes the chunk's value, returns it with comm in flight."""

_AUTO: Any = object()


def run_stages(xs: Sequence[Any], stages: Sequence[Stage]) -> list[Any]:
    """Run every chunk of ``xs`` through ``stages`` as a wavefront (chunk-based overlap).

    For each stage, chunk i waits on its previous collective, computes, and launches its next
    collective before chunk i+1 computes the same stage.
    """
    pending: list[Pending[Any]] = [Pending.ready(x) for x in xs]
    for stage in stages:
        pending = [stage(p.wait()) for p in pending]
    return [p.wait() for p in pending]


def _check_cfg_mesh(cfg: GPTConfig, mesh: DeviceMesh) -> None:
    if mesh.ndim != 2:
        raise ValueError(f"ATPGPT needs a 2D DeviceMesh(d1, d2), got shape {tuple(mesh.shape)}")
    d1, d2 = mesh.size(0), mesh.size(1)
    if cfg.heads % (d1 * d2):
        raise ValueError(
            f"GPTConfig.heads={cfg.heads} is not divisible by d1*d2={d1 * d2} of DeviceMesh({d1}, {d2}): "
            f"the attention core is sharded on heads over both mesh axes; pick a mesh whose size "
            f"divides {cfg.heads}"
        )
    if cfg.vocab % d1:
        raise ValueError(
            f"GPTConfig.vocab={cfg.vocab} is not divisible by d1={d1}: the lm head splits the "
            f"vocabulary over mesh axis 0; pad the vocabulary to a multiple of {d1}"
        )


class ATPAttention(nn.Module):
    """QKV column-first -> scatter heads over atp1 -> causal SDPA -> gather -> out-proj row-first."""

    def __init__(self, cfg: GPTConfig, mesh: DeviceMesh) -> None:
        super().__init__()
        h, dt = cfg.hidden, cfg.torch_dtype
        self.qkv = ATPLinear(h, 3 * h, mesh, COLUMN_FIRST, dtype=dt)
        self.proj = ATPLinear(h, h, mesh, ROW_FIRST, dtype=dt)
        self.axis1 = MeshAxis(mesh, 1)
        self.local_heads = cfg.heads // (mesh.size(0) * mesh.size(1))
        self.head_dim = cfg.head_dim

    def core(self, qkv: torch.Tensor) -> torch.Tensor:
        """[b, s, 3h/d1] (heads of this atp0 block, replicated on atp1) -> [b, s, h/(d1 d2)]."""
        if self.axis1.size > 1:
            qkv = ScatterLastDim.apply(qkv, self.axis1)
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)

    def gather_start(self, y: torch.Tensor) -> Pending[torch.Tensor]:
        """Launch the all-gather over atp1: [b, s, h/(d1 d2)] -> [b, s, h/d1]."""
        n = self.axis1.size
        if n == 1:
            return Pending.ready(y)
        works: list[dist.Work] = []
        buf = GatherLastDim.apply(y, self.axis1, works)
        return Pending(works, lambda: blocks_to_last_dim(buf, n))


class ATPMLP(nn.Module):
    """MLP-up column-first -> GELU -> MLP-down row-first (Fig. 6b)."""

    def __init__(self, cfg: GPTConfig, mesh: DeviceMesh) -> None:
        super().__init__()
        h, r, dt = cfg.hidden, cfg.mlp_ratio, cfg.torch_dtype
        self.fc = ATPLinear(h, r * h, mesh, COLUMN_FIRST, dtype=dt)
        self.proj = ATPLinear(r * h, h, mesh, ROW_FIRST, dtype=dt)


class ATPBlock(nn.Module):
    """Pre-LN block on local ``[Replicate, Shard(-1)]`` residual-stream shards ``[b, s, h/d2]``."""

    def __init__(self, cfg: GPTConfig, mesh: DeviceMesh, chunks: int = 1) -> None:
        super().__init__()
        _check_cfg_mesh(cfg, mesh)
        dt = cfg.torch_dtype
        self.chunks = chunks
        self.ln1 = ShardedLayerNorm(cfg.hidden, mesh, dtype=dt)
        self.attn = ATPAttention(cfg, mesh)
        self.ln2 = ShardedLayerNorm(cfg.hidden, mesh, dtype=dt)
        self.mlp = ATPMLP(cfg, mesh)

    def stages(self) -> list[Stage]:
        """The block as 7 stages, each ending in (at most) one collective launch."""
        attn, mlp = self.attn, self.mlp

        def ln1(x: torch.Tensor) -> Pending[Any]:
            return self.ln1.start(x).then(lambda h: (x, h))

        def qkv(c: tuple[torch.Tensor, torch.Tensor]) -> Pending[Any]:
            x, h = c
            return attn.qkv.start(h).then(lambda y: (x, y))

        def core(c: tuple[torch.Tensor, torch.Tensor]) -> Pending[Any]:
            x, y = c
            return attn.gather_start(attn.core(y)).then(lambda g: (x, g))

        def proj(c: tuple[torch.Tensor, torch.Tensor]) -> Pending[Any]:
            x, g = c
            return attn.proj.start(g).then(lambda y: x + y)

        def ln2(x: torch.Tensor) -> Pending[Any]:
            return self.ln2.start(x).then(lambda h: (x, h))

        def fc(c: tuple[torch.Tensor, torch.Tensor]) -> Pending[Any]:
            x, h = c
            return mlp.fc.start(h).then(lambda u: (x, u))

        def down(c: tuple[torch.Tensor, torch.Tensor]) -> Pending[Any]:
            x, u = c
            return mlp.proj.start(F.gelu(u)).then(lambda y: x + y)

        return [ln1, qkv, core, proj, ln2, fc, down]

    def forward_chunks(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return run_stages(xs, self.stages())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.forward_chunks(x.chunk(self.chunks, dim=0)), dim=0)


class ATPGPT(nn.Module):
    """:class:`~meshpilot.models.gpt.GPT` on DeviceMesh(d1, d2); see the module docstring."""

    def __init__(self, cfg: GPTConfig, mesh: DeviceMesh, chunks: int = 1, dp_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        _check_cfg_mesh(cfg, mesh)
        if chunks < 1:
            raise ValueError(f"chunks={chunks} must be >= 1 (1 disables chunk overlap)")
        dt = cfg.torch_dtype
        self.cfg = cfg
        self.mesh = mesh
        self.chunks = chunks
        self.dp_mesh = dp_mesh
        self.axis0 = MeshAxis(mesh, 0)
        self.wte = ShardedEmbedding(cfg.vocab, cfg.hidden, mesh, dtype=dt)
        self.wpe = ShardedEmbedding(cfg.seq, cfg.hidden, mesh, dtype=dt)
        self.blocks = nn.ModuleList(ATPBlock(cfg, mesh, chunks) for _ in range(cfg.layers))
        self.ln_f = ShardedLayerNorm(cfg.hidden, mesh, dtype=dt)
        self.lm_head = ATPLinear(cfg.hidden, cfg.vocab, mesh, COLUMN_FIRST, bias=False, dtype=dt)

    @classmethod
    def from_gpt(cls, gpt: GPT, mesh: DeviceMesh, chunks: int = 1, dp_mesh: DeviceMesh | None = _AUTO) -> ATPGPT:
        """Shard a single-device ``GPT`` exactly (it must be identical on every rank).

        ``dp_mesh`` defaults to the "dp" sibling of ``mesh`` made by ``init_meshes``/``init_mesh``.
        """
        if dp_mesh is _AUTO:
            dp_mesh = dp_mesh_of(mesh)
        model = cls(gpt.cfg, mesh, chunks, dp_mesh)
        model.load_gpt_(gpt)
        return model

    @torch.no_grad()
    def load_gpt_(self, gpt: GPT) -> None:
        """Copy this rank's shards of every parameter of ``gpt``."""
        for name, mod in self.named_modules():
            if isinstance(mod, ATPLinear):
                ref = gpt.get_submodule(name)
                mod.load_full_(ref.weight.t(), None if ref.bias is None else ref.bias)
            elif isinstance(mod, ShardedLayerNorm):
                ref = gpt.get_submodule(name)
                mod.load_full_(ref.weight, ref.bias)
            elif isinstance(mod, ShardedEmbedding):
                mod.load_full_(gpt.get_submodule(name).weight)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """All parameters gathered to full tensors in ``GPT``'s layout and names (collective:
        every rank of the mesh must call it)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            mod = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(mod, ATPLinear) and name.endswith(".weight"):
                full = full.t().contiguous()
            out[name] = full.detach()
        return out

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``idx`` [b, t] (the same on every TP rank). Returns the mean cross-entropy over the
        b*t tokens (replicated on every TP rank), or the full logits [b, t, V] if no targets."""
        b, t = idx.shape
        if t > self.cfg.seq:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq={self.cfg.seq}")
        # One lookup for the whole batch (no comm; modules called once keep CommDebugMode's
        # module tracker happy), then chunks.
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        xs = x.chunk(self.chunks, dim=0)
        stages: list[Stage] = [s for blk in self.blocks for s in blk.stages()]
        stages.append(self.ln_f.start)
        stages.append(self.lm_head.start)
        logits = run_stages(xs, stages)  # each [b_c, t, V/d1]: [Shard(-1), Replicate]
        if targets is None:
            return torch.cat([self._gather_vocab(lg) for lg in logits], dim=0)
        total = None
        for lg, tg in zip(logits, targets.chunk(self.chunks, dim=0)):
            per_token = VocabParallelCrossEntropy.apply(lg.reshape(-1, lg.shape[-1]), tg.reshape(-1), self.axis0)
            total = per_token.sum() if total is None else total + per_token.sum()
        assert total is not None
        return total / (b * t)

    def _gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.axis0.size == 1:
            return logits
        buf = GatherLastDim.apply(logits, self.axis0, None)
        return blocks_to_last_dim(buf, self.axis0.size)

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """Average gradients over the data-parallel mesh (no-op without one or with dp == 1).

        All all-reduces are launched asynchronously, then waited; recorded as axis "dp",
        phase ``Phase.BWD``.
        """
        if self.dp_mesh is None or self.dp_mesh.size() == 1:
            return
        axis = MeshAxis(self.dp_mesh, 0)
        grads = [local_of(p.grad) for p in self.parameters() if p.grad is not None]
        with collective_log.phase_scope(Phase.BWD):
            works = [all_reduce(g, axis, async_op=True) for g in grads]
        for w in works:
            if w is not None:
                w.wait()
        for g in grads:
            g.div_(axis.size)
