"""A published parallel configuration as a plan: "TP 8, PP 16, DP 64, interleaved 1F1B" in, a :class:`Plan` out.

Papers state their runs as degrees and switches, not as per-operator layouts. :func:`parse_config` reads them
(``tp=8,pp=16,dp=64,schedule=interleaved-1f1b,virtual=8,microbatches=32``; keys in :class:`ParallelConfig`)
and :func:`plan_config` builds the plan meshpilot would run for them — nothing is searched but each stage's
operators under the pinned layouts — so that ``Plan.simulate`` can be held against the paper's throughput.

The plan
--------
* **Ranks** (:func:`stage_ranks`): Llama 3's order ``[TP, CP, PP, DP]``, TP fastest (§3.3.2): rank
  ``t + TP · (c + CP · (p + PP · d))``; pipeline group p's ranks form a ``(DP, TP)`` logical mesh, or
  ``(DP, CP, TP)`` with context parallelism (:func:`stage_mesh`), TP on consecutive ranks (inside a server
  when TP ≤ 8); a CP group of 16 at TP 8 spans 16 servers.
* **Stages** (:func:`stage_bounds`): PP · V chunks (V = ``virtual``: the chunks each pipeline group holds,
  interleaved 1F1B when V > 1; chunk j on group j mod PP). ``split=even``: the blocks cut evenly, the
  embeddings with the first chunk and the head with the last. ``split=ends`` (Llama 3 §3.3.2 balances its
  pipeline by taking one layer off the first and the last stage): the embeddings alone in the first chunk, the
  final norm and head alone in the last, the blocks evenly over the PP · V − 2 between.
* **Each stage's operators**: Megatron-LM's layouts pinned on its ``(DP, TP)`` mesh (``planner.forced.
  megatron_tp``: column / row pairs, vocabulary-parallel embedding and head; without TP every weight replicated,
  ``forced.data_parallel``) and each piece's boundary rows over DP (:func:`boundary_pins`), the ILP choosing
  the operators' algorithms; a stage of k blocks composed from one block's plan (``planner.stack.compose_stage``).
* **Sequence parallelism** (``sp=1``, the default, when TP > 1; ``sp=0`` states a run without it): Megatron-LM's
  SP, as Llama 3 trains (``megatron_tp(..., sequence_parallel=True)``): each row linear's residual add is
  sequence-sharded over TP, so the residual stream, the norms and what they save hold 1/TP of the tokens, the
  row outputs are reduce-scattered and the column inputs all-gathered (the plan's own collectives, priced by
  the ILP), and every piece's ``[batch, seq, hidden]`` boundary (the hidden state and its gradient) is pinned
  sequence-sharded over TP too: a stage receives and keeps its TP rank's share of the sequence, and each TP
  rank sends its own share (``send_split`` = DP · TP). As Megatron's SP, the backward gathers each norm output
  again from its saved shard rather than keep the gathered copy (:func:`regathered_stack`: one more TP
  all-gather a column group, priced in the backward like any resharding). Memory is each piece's own plan's
  accounting.
* **ZeRO** (``zero=1``: Megatron's distributed optimizer; the part of Llama 3's FSDP that shards the optimizer
  states, §3.3.2): AdamW's states, the update's temporary and the update sharded over the ``Z = DP · CP`` ranks a
  gradient is reduced over (:func:`sharded_states`, applied to each chunk's cost). With ``T`` a chunk's update
  temporary per device — one parameter-sized tensor a trainable parameter (``accounting.state_bytes``), so its
  parameters' bytes, ``T = upd − resident`` of its ``PhasePeaks`` — ``O = ADAMW_STATES · T`` its states and
  ``cut = 1 − 1/Z``::

      fb' = fb − cut · O     resident' = resident − cut · O     upd' = upd − cut · (O + T)     act' = act
      optimizer_s' = optimizer_s − cut · ADAMW_PASSES · T / (membw · eff)   (``accounting.update_stream_seconds``)

  The gradient is reduce-scattered into the shard and the updated weights all-gathered once a step: a ring
  all-reduce's bytes (``CostModel.all_reduce`` takes Rabenseifner's reduce-scatter + all-gather where fastest), so
  it is priced as the all-reduce, unchanged. The gradients' sum over the microbatches stays whole through the
  backward (each microbatch's is added in place and the sum reduced once a step), as in Megatron's distributed
  optimizer; so ``zero=2`` (gradients sharded through the backward: a reduce-scatter every microbatch) is not
  this and is refused, and so is 3 (the pinned weights gathered at use is not modelled; the ZeRO post-pass,
  ``planner.zero``, leaves pinned weights alone).
* **The gradients' synchronisation, overlapped** (``Plan.sync_overlap``, set on every configuration's plan): as
  Megatron-LM runs it with ``overlap_grad_reduce`` (and Llama 3's FSDP, which overlaps its reduce-scatters with
  the backward), each chunk's sync — its ``grad:`` collectives, ``StageCost.sync_s``: the all-reduce over DP (and
  CP), or with ``zero=1`` the reduce-scatter and all-gather it is priced as — starts when that chunk's last
  backward ends, on the DP stream, and the compute stream goes on with the group's other chunks' backwards; the
  step waits for them before the update (``sim``, *Overlapped stage syncs*). Per group g (chunks j ≡ g mod p,
  in the order their last backwards end; ``R_j`` the group's compute after chunk j's last backward, read off the
  schedule's actions: :func:`exposed_sync`)::

      E = −∞;  for each j:  E = max(E, −R_j) + s_j         X_g = max(0, E)   (times from the group's last backward)

  ``X_g`` is the exposed sync (an upper bound of the simulator's, which also hides it in the drain's idle
  time). One chunk a group (1F1B, ZB-H1): nothing after its last backward, ``X_g = s_j`` (the sync after the
  last backward, exposed). Interleaved 1F1B drains chunk v − 1, …, 0, p backwards each: all but the last
  chunk's sync can hide. ``zero=1``'s all-gather runs here in the drain with its reduce-scatter, not in the next
  step's first forwards as Megatron's ``overlap_param_gather`` runs it: the exposed part is the same (the chunk
  finishing last is chunk 0, whose weights the next step needs first), the drain carries more. Not modelled:
  buckets (each chunk's sync is issued whole); the DP traffic slowing the compute it runs beside. meshpilot's
  runtime (``runtime.executor``) runs every stage's sync at ``G``; these plans are not run by it (their stages
  carry no operator plans).
* **Batch**: the global batch ``DP · microbatches · micro_batch`` sequences; one microbatch of the step is
  ``DP · micro_batch`` sequences (the graph ``plan_config`` is given).

* **Recomputation** (``recompute=full``, Megatron's full recompute): every block of the stack recomputed in the
  backward (``planner.recompute.apply`` on the captured blocks, the stack found again and expanded:
  :func:`recomputed_stack`), so each block keeps only its input from the forward and runs its forward (its TP
  collectives too) a second time; the pre and post layers run as captured. ``recompute=selective``: every
  block's selective region (``planner.recompute``, *Selective recomputation*): its matrix products' and
  attention's outputs kept, its norms, activations, rotary and copies run again in the backward.

* **Context parallelism** (``cp`` > 1; Llama 3's 131,072-token stage): each pipeline group a ``(DP, CP, TP)``
  mesh, the sequence on the CP axis of its own. Megatron's pins are made on ``(DP, TP)`` and each given a
  placement on CP (:func:`context_pins`), as TP's are pinned, so that the ILP's pieces on three axes stay
  within its budget: weights whole over CP, the token ids and labels, every pinned ``[batch, seq, …]`` value
  (the residual adds, the norm outputs) and the stage boundaries sharded on the sequence (``S(1)``; with SP the
  residual stream ``S(0)S(1)S(1)``: the sequence over CP, each CP shard over TP), every pinned ``[batch · seq,
  …]`` product on its rows. One sequence a replica's microbatch (``micro_batch=1``), so the rows of a product
  are the sequence: ``sharding.strategies.folded_views`` lets the reshapes between the two keep the CP shard
  (DTensor would gather it; :func:`context_views`). Attention is left to the ILP between its sequence-parallel
  methods (``ops.attention``: the ring, the all-gather method by query rows, Ulysses); a capture made under
  ``models.sources.unpacked_sequences`` calls it ``is_causal`` with no ``[b, 1, t, t]`` mask tensor. The
  gradients are reduced over DP and CP together; each rank sends its own share of a boundary
  (``send_split`` = DP · CP · TP with SP).

* **Balanced CP: Llama 3's 2 · CP chunks** (§3.3.2). Where the captured step can run on a permuted sequence
  (``planner.sequence_order.zigzag_order`` on the stack's graph, the CP axis: no op that mixes positions, the
  sequence cut into 2 · CP chunks; a Hugging Face decoder's labels given pre-shifted, ``models.sources.
  pre_shifted_labels``, as Megatron's loader gives them), the plan lays the sequence out zig-zag
  (:func:`context_order`, recorded as ``Plan.sequence_order``): rank c of CP holds chunks c and 2 · CP − 1 − c,
  so each rank's causal work by query rows (``ops.causal_rows``; the ring's too) is the average. Its attention
  calls are marked ``OpNode.zigzag`` (:func:`zigzag_stack`) and priced so (``CostModel.attention``'s balanced
  row: ``(2n − 1)/(4n)`` of a rank's share at the non-causal rate, ``1/(2n)`` at the causal one). Where the
  order cannot be taken the contiguous layout stays, priced at its slowest rank (the last, whose rows see every
  key), and :attr:`ConfigPlan.contiguous_why` says why.

* **Float8** (``float8=linears``, with ``precision=bf16``): torchtitan's Float8 training (torchao's ``Float8Linear``,
  tensorwise dynamic scaling) as the cost model sees it: every linear of the repeated blocks runs its three
  products — forward, input gradient, weight gradient (and a recomputed forward's) — as ``torch._scaled_mm``, each
  operand cast from bf16 just before (:func:`float8_stack` marks them ``OpNode.float8``;
  ``CostModel.float8_gemm`` prices each at the device's measured Float8 rate for its shape plus its operands'
  casts, ``DeviceProfile.float8_cast_bytes`` an element at the device's memory bandwidth). The embeddings and the
  head stay bf16 (torchtitan leaves its ``output`` projection out). Memory is the bf16 step's: weights,
  activations and what the backward saves stay bf16, the float8 copies are transient and not counted. Not
  modelled: FSDP's all-gather in float8 (``enable_fsdp_float8_all_gather``; ZeRO is not planned here, so there
  is no parameter all-gather to shrink), TP's collectives in float8, the amax all-reduces. A device without
  Float8 rates is refused.

Refused in one line, since the planner cannot represent them yet: ``ep > 1`` (expert parallelism; dense models
here), ``zero`` above 1 (and 1 with ``dp · cp = 1``: nothing to shard over); ``cp > 1`` with ``micro_batch``
above 1 or a sequence that ``cp · tp`` does not divide.

Throughput (:func:`model_flops_per_token`): a step's model FLOPs are ``tokens · (6 · N + 12 · L · h · s)``,
N the parameters without the input embedding table, L layers, h hidden, s sequence (PaLM's Appendix B count:
the ``QKᵀ`` and ``AV`` matmuls counted in full, causal or not); TFLOP/s per GPU = model FLOPs / step / GPUs. With
``causal=True`` the attention term is ``6 · L · h · s``: only the pairs a causal mask keeps, flash attention's own
benchmark convention. Which one a paper used is often unstated (Llama 3's Table 4 does not say).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch

from meshpilot.errors import UserError
from meshpilot.graph.capture import OpGraph
from meshpilot.planner import recompute, sequence_order
from meshpilot.planner.accounting import ADAMW_STATES, PhasePeaks, update_stream_seconds
from meshpilot.planner.forced import _exact, data_parallel, megatron_tp, sequence_gathers
from meshpilot.planner.pipeline import (
    Clustering,
    _groups,
    _held_per_stage,
    held_one_chunk,
    input_grad_share,
    received_bytes,
    stage_transfers,
)
from meshpilot.planner.plan import Plan, PlanStage, SequenceOrder
from meshpilot.planner.recompute import Recompute
from meshpilot.planner.schedule import ActionKind, PipelineKind, pipeline
from meshpilot.planner.stack import Stack, StageCosting, compose_stage, expand_stack, find_stack
from meshpilot.planner.stage import StageCost, StagePlanner, received_row_leaves, slice_graph
from meshpilot.planner.zero import ZeroMode

if TYPE_CHECKING:
    from meshpilot.cluster.topology import Cluster
    from meshpilot.sim.engine import SimResult


class Float8(StrEnum):
    """Which matrix products run in Float8 (``float8=``; module docstring, *Float8*)."""

    NONE = "none"
    LINEARS = "linears"
    """Every linear of the repeated blocks, torchtitan's Float8 training (tensorwise scaling)."""


class Split(StrEnum):
    """How layers are cut into a pipeline's chunks (module docstring, *Stages*)."""

    EVEN = "even"
    ENDS = "ends"


@dataclass(frozen=True)
class ParallelConfig:
    """A run's parallel configuration as papers state it (module docstring)."""

    tp: int = 1
    """Tensor-parallel degree (Megatron-LM's column / row pairs), inside a server."""
    cp: int = 1
    """Context-parallel degree: the sequence sharded over a mesh axis of its own (module docstring, *Context
    parallelism*)."""
    pp: int = 1
    """Pipeline groups."""
    dp: int = 1
    """Data-parallel replicas."""
    ep: int = 1
    """Expert-parallel degree; refused above 1."""
    schedule: PipelineKind = PipelineKind.ONE_F_ONE_B
    """The pipeline schedule; ``interleaved-1f1b`` needs ``virtual`` ≥ 2."""
    virtual: int = 1
    """Chunks per pipeline group (virtual stages)."""
    microbatches: int = 1
    """Microbatches per step (per replica: the paper's batch per DP over the micro-batch size)."""
    micro_batch: int = 1
    """Sequences in one replica's microbatch."""
    recompute: Recompute = Recompute.NONE
    zero: int = 0
    """ZeRO stage: 0 (every state replicated over DP) or 1 (AdamW's states and update sharded over DP · CP;
    module docstring, *ZeRO*)."""
    precision: str = "bf16-mixed"
    split: Split = Split.EVEN
    sp: int = 1
    """Megatron's sequence parallelism over the TP axis: 1 (on, where TP > 1) or 0 (module docstring)."""
    float8: Float8 = Float8.NONE
    """Float8 linears (module docstring, *Float8*); needs ``precision=bf16`` and a device with Float8 rates."""

    @property
    def sequence_parallel(self) -> bool:
        """Whether the plan shards the sequence over TP outside the TP regions."""
        return self.tp > 1 and self.sp == 1

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp * self.dp * self.ep

    @property
    def graph_batch(self) -> int:
        """Sequences of one microbatch of the whole step (what the captured graph takes)."""
        return self.dp * self.micro_batch

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * self.micro_batch

    def short(self) -> str:
        """``TP8 CP1 PP16 DP64 interleaved-1f1b v8 B32``."""
        v = f" v{self.virtual}" if self.virtual > 1 else ""
        sp = " SP" if self.sequence_parallel else ""
        f8 = " FP8" if self.float8 is Float8.LINEARS else ""
        return f"TP{self.tp}{sp} CP{self.cp} PP{self.pp} DP{self.dp} {self.schedule.value}{v} B{self.microbatches}{f8}"


_INT_KEYS = ("tp", "cp", "pp", "dp", "ep", "virtual", "microbatches", "micro_batch", "zero", "sp")
_ENUMS = {"schedule": PipelineKind, "recompute": Recompute, "split": Split, "float8": Float8}
_EXAMPLE = "e.g. tp=8,pp=16,dp=64,schedule=interleaved-1f1b,virtual=8,microbatches=32"


def parse_config(text: str) -> ParallelConfig:
    """``key=value`` pairs separated by commas (module docstring) as a checked :class:`ParallelConfig`."""
    keys = {f.name for f in dataclasses.fields(ParallelConfig)}
    values: dict[str, object] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        key, eq, raw = (s.strip() for s in item.partition("="))
        if not eq or key not in keys:
            raise UserError(f"--config {item!r}: not key=value of a known key; keys: {', '.join(sorted(keys))}")
        if key in values:
            raise UserError(f"--config: {key} given twice; give each key once")
        if key in _INT_KEYS:
            if not raw.isdigit():
                raise UserError(f"--config {key}={raw}: give a whole number; {_EXAMPLE}")
            values[key] = int(raw)
        elif key in _ENUMS:
            try:
                values[key] = _ENUMS[key](raw)
            except ValueError:
                names = ", ".join(e.value for e in _ENUMS[key])
                raise UserError(f"--config {key}={raw}: choose one of {names}") from None
        else:
            values[key] = raw
    return check_config(ParallelConfig(**values))  # type: ignore[arg-type]


def check_config(cfg: ParallelConfig) -> ParallelConfig:
    """`cfg` if meshpilot can plan it, else a UserError naming what it cannot represent."""
    for key in ("tp", "cp", "pp", "dp", "ep", "virtual", "microbatches", "micro_batch"):
        if getattr(cfg, key) < 1:
            raise UserError(f"--config {key}={getattr(cfg, key)}: give at least 1")
    if cfg.sp not in (0, 1):
        raise UserError(f"--config sp={cfg.sp}: sequence parallelism is on (1) or off (0); give sp=1 or sp=0")
    if cfg.cp > 1 and cfg.micro_batch != 1:
        raise UserError(
            f"--config cp={cfg.cp}, micro_batch={cfg.micro_batch}: context parallelism plans one sequence a "
            "replica's microbatch (its sequence split over CP); give micro_batch=1"
        )
    if cfg.float8 is Float8.LINEARS and cfg.precision != "bf16":
        raise UserError(
            f"--config float8=linears, precision={cfg.precision}: Float8 linears cast from bf16 weights and "
            "activations (torchtitan's recipe); give precision=bf16"
        )
    if cfg.ep > 1:
        raise UserError(f"--config ep={cfg.ep}: expert parallelism is not offered by --config yet; plan ep=1")
    if cfg.zero > 1:
        raise UserError(
            f"--config zero={cfg.zero}: only the optimizer states are sharded over pinned layouts (the gradients' sum "
            "stays whole through the backward, the weights are not gathered at use); give zero=1 or zero=0"
        )
    if cfg.zero and cfg.dp * cfg.cp == 1:
        raise UserError("--config zero=1: dp · cp = 1, no ranks to shard the optimizer states over; give zero=0")
    interleaved = cfg.schedule == PipelineKind.INTERLEAVED_1F1B
    if interleaved != (cfg.virtual > 1):
        raise UserError(
            f"--config schedule={cfg.schedule.value}, virtual={cfg.virtual}: interleaved-1f1b and virtual ≥ 2 go "
            "together; give both or neither"
        )
    if interleaved and cfg.microbatches % cfg.pp:
        raise UserError(
            f"--config microbatches={cfg.microbatches}: interleaved 1F1B runs a multiple of pp={cfg.pp}; give one"
        )
    return cfg


def stage_mesh(cfg: ParallelConfig) -> tuple[int, ...]:
    """The logical mesh of a pipeline group: ``(DP, TP)``, or ``(DP, CP, TP)`` with context parallelism."""
    return (cfg.dp, cfg.tp) if cfg.cp == 1 else (cfg.dp, cfg.cp, cfg.tp)


def stage_ranks(cfg: ParallelConfig) -> list[tuple[int, ...]]:
    """Per pipeline group p, its ranks as a row-major :func:`stage_mesh` (module docstring, *Ranks*)."""
    tp, cp, pp = cfg.tp, cfg.cp, cfg.pp
    return [
        tuple(t + tp * (c + cp * (p + pp * d)) for d in range(cfg.dp) for c in range(cp) for t in range(tp))
        for p in range(pp)
    ]


def stage_bounds(pre: int, blocks: int, post: int, chunks: int, split: Split) -> list[tuple[int, int]]:
    """Model layers ``[start, stop)`` of each of `chunks` chunks: `pre` layers, `blocks` blocks, `post` layers
    (module docstring, *Stages*)."""
    inner = chunks - 2 if split == Split.ENDS else chunks
    if split == Split.ENDS and (chunks < 3 or not pre or not post):
        raise UserError(f"--config split=ends: needs pre and post layers and at least 3 chunks, not {chunks}")
    if inner < 1 or blocks % inner:
        raise UserError(
            f"--config: {blocks} blocks do not split evenly into {inner} chunks (pp · virtual"
            f"{' − 2' if split == Split.ENDS else ''}); pick degrees that divide them"
        )
    per = blocks // inner
    cuts = [pre + per * j for j in range(1, inner)]
    if split == Split.ENDS:
        cuts = [pre, *cuts, pre + blocks]
    edges = [0, *cuts, pre + blocks + post]
    return list(zip(edges, edges[1:]))


@dataclass(frozen=True)
class ConfigPlan:
    """:func:`plan_config`'s result: the plan and what it was made from."""

    config: ParallelConfig
    plan: Plan
    costs: tuple[StageCost, ...]
    """Each chunk's cost on its group's ranks, at the plan's microbatches."""
    planning_s: float
    contiguous_why: str | None = None
    """With CP: why the sequence stays in contiguous CP chunks (None: balanced, ``plan.sequence_order``; or no
    CP)."""


def plan_config(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    stack: Stack,
    cluster: Cluster | str,
    cfg: ParallelConfig,
    *,
    planner: StagePlanner | None = None,
) -> ConfigPlan:
    """The plan of `cfg` (module docstring) for `model` whose captured repeated stack is `stack`
    (``planner.stack.capture_stack`` of one microbatch, ``cfg.graph_batch`` sequences) on `cluster`."""
    from meshpilot.cluster import load_cluster

    t0 = time.perf_counter()
    cfg = check_config(cfg)
    cl = planner.cluster if planner is not None else load_cluster(cluster)
    first = next(x for x in inputs if isinstance(x, torch.Tensor))
    if first.shape[0] != cfg.graph_batch:
        raise UserError(f"plan_config: inputs of {first.shape[0]} rows; one microbatch is dp · micro_batch rows")
    if cfg.cp > 1 and (first.dim() < 2 or first.shape[1] % (cfg.cp * cfg.tp)):
        seq = first.shape[1] if first.dim() >= 2 else 1
        raise UserError(
            f"--config cp={cfg.cp}: a sequence of {seq} tokens does not split into cp · tp = {cfg.cp * cfg.tp} "
            "even shares; give degrees that divide it"
        )
    if cfg.float8 is Float8.LINEARS and not cl.device.has_float8:
        raise UserError(
            f"--config float8=linears: cluster {cl.name!r}'s device ({cl.device.kind}) holds no measured Float8 GEMM "
            "rates to price them by; give a cluster whose device profile has float8_e4m3fn matmul entries"
        )
    if cfg.devices > cl.num_devices:
        raise UserError(
            f"--config {cfg.short()}: {cfg.devices:,} devices, cluster {cl.name!r} has {cl.num_devices:,}; "
            "give a larger cluster"
        )
    mesh = stage_mesh(cfg)
    stack, sp, force = stage_setup(model, inputs, stack, cl, cfg, planner, mesh)
    chunks = cfg.pp * cfg.virtual
    bounds = stage_bounds(stack.pre, stack.blocks, stack.post, chunks, cfg.split)
    groups = stage_ranks(cfg)
    ranks = [groups[j % cfg.pp] for j in range(chunks)]
    B = cfg.microbatches
    with context_views(cfg):
        costs = tuple(
            compose_stage(sp, stack, a, b, rk, mesh, microbatches=B, zero=ZeroMode.OFF, force=force)
            for (a, b), rk in zip(bounds, ranks)
        )
    if cfg.zero:
        costs = tuple(sharded_states(c, cfg.dp * cfg.cp, sp.cluster.device) for c in costs)
    order = context_order(stack, cfg)
    plan = _assemble(stack, sp, cfg, bounds, ranks, costs, t0)
    if isinstance(order, SequenceOrder):
        plan = dataclasses.replace(plan, sequence_order=order)
    why = order if isinstance(order, str) else None
    return ConfigPlan(cfg, plan, costs, time.perf_counter() - t0, why)


def state_cut(update_temp: float, shards: int) -> tuple[float, float]:
    """Bytes per device that sharding AdamW's states over `shards` ranks takes off a stage whose update temporary is
    `update_temp` (module docstring, *ZeRO*): (off every phase: ``cut · O``, off the update: ``cut · (O + T)``)."""
    cut = 1.0 - 1.0 / shards
    states = ADAMW_STATES * update_temp
    return cut * states, cut * (states + update_temp)


def update_cut_seconds(update_temp: float, shards: int, device: Any) -> float:
    """Seconds that sharding the update over `shards` ranks takes off a stage whose update temporary is
    `update_temp` (module docstring, *ZeRO*): ``cut · ADAMW_PASSES · T / (membw · eff)``."""
    return update_stream_seconds(update_temp, device) * (1.0 - 1.0 / shards)


def sharded_states(cost: StageCost, shards: int, device: Any) -> StageCost:
    """`cost`, a chunk composed by ``stack.compose_stage`` (without ``accumulated``: ``resident`` is ``W + O + I +
    G``, its memory's ``params`` the static ``W + O + I``), with AdamW's states, the update's temporary and the
    update sharded over `shards` ranks (module docstring, *ZeRO*): its peaks, its memory at its own peak (split as
    ``compose_stage`` splits it) and its update's seconds."""
    p = cost.peaks
    if p.resident is None:
        raise ValueError("sharded_states: a stage cost without resident bytes (a plan saved before them)")
    temp = p.update - p.resident
    held, update = state_cut(temp, shards)
    peaks = PhasePeaks(p.forward_backward - held, p.update - update, p.activations, p.resident - held)
    static = cost.memory.params - held
    grads = peaks.resident - static if peaks.update >= peaks.forward_backward else 0.0
    peak = max(peaks.forward_backward, peaks.update)
    mem = dataclasses.replace(cost.memory, params=static, grads=grads, temporaries=peak - static - grads)
    time_ = dataclasses.replace(cost.time, optimizer_s=cost.time.optimizer_s - update_cut_seconds(temp, shards, device))
    return dataclasses.replace(cost, peaks=peaks, memory=mem, time=time_)


def stage_setup(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    stack: Stack,
    cluster: Cluster | str,
    cfg: ParallelConfig,
    planner: StagePlanner | None,
    mesh: tuple[int, ...],
) -> tuple[Stack, StagePlanner, dict[str, str]]:
    """The stack a configuration's pieces are planned on, its planner and the pins (module docstring): `stack`
    recomputed (``recompute=full``), Megatron's pins on the `mesh` ``(DP, TP)`` (or data parallelism without
    TP), sequence parallelism's gathers re-gathered in the backward (:func:`regathered_stack`) and the
    boundary pins. `planner` is reused when it plans that stack's graph (one planner a derived stack, kept:
    :func:`_planner_of`)."""
    if cfg.recompute is not Recompute.NONE:
        base, mode = stack, cfg.recompute
        stack = _derived(("recompute", mode.value, id(base)), base, lambda: recomputed_stack(base, mode))
    if cfg.float8 is Float8.LINEARS:
        plain = stack
        stack = _derived(("float8", id(plain)), plain, lambda: float8_stack(plain))
    flat = (mesh[0], mesh[-1])  # (DP, TP): Megatron's pins, the CP axis put in after (context_pins)
    if cfg.tp > 1:
        force = megatron_tp(model, inputs, flat, graph=stack.graph, sequence_parallel=cfg.sequence_parallel)
    else:  # no TP: every weight replicated, the batch over DP (the search would otherwise shard what it likes)
        force = data_parallel(model, inputs, flat)
    if cfg.sequence_parallel:
        stack = regathered_stack(stack, sequence_gathers(stack.graph, force))
    if isinstance(context_order(stack, cfg), SequenceOrder):
        plain = stack
        stack = _derived(("zigzag", id(plain)), plain, lambda: zigzag_stack(plain))
    sp = planner if planner is not None and planner.graph is stack.graph else _planner_of(stack, cluster)
    boundaries = boundary_pins(sp, stack, cfg, force)
    if len(mesh) == 3:
        force = context_pins(stack.graph, model, inputs, force, cfg)
    force.update(boundaries)
    return stack, sp, force


CP_AXIS = 1
"""The CP axis of a pipeline group's ``(DP, CP, TP)`` mesh (:func:`stage_mesh`)."""


def context_order(stack: Stack, cfg: ParallelConfig) -> SequenceOrder | str | None:
    """The zig-zag order of the sequence on the CP axis that `stack`'s step takes (module docstring, *Balanced
    CP*), or why it cannot (one line: the contiguous layout stays); None without CP. Kept per stack."""
    if cfg.cp == 1:
        return None
    key = ("order", id(stack), cfg.cp)
    return _derived(key, stack, lambda: sequence_order.zigzag_order(stack.graph, CP_AXIS, cfg.cp))


def zigzag_stack(stack: Stack) -> Stack:
    """`stack` with its attention calls marked ``OpNode.zigzag`` (module docstring, *Balanced CP*): priced with
    each CP rank's rows its two zig-zag chunks."""
    from meshpilot.ops.attention import attention_kind

    nodes = [dataclasses.replace(n, zigzag=True) if attention_kind(n) is not None else n for n in stack.graph.nodes]
    small = find_stack(dataclasses.replace(stack.graph, nodes=nodes))
    if small is None or small.container != stack.container or small.blocks != stack.kept:
        raise UserError(f"--config cp: {stack.container}'s blocks differ once balanced; plan without CP")
    return expand_stack(small, stack.blocks)


def context_views(cfg: ParallelConfig):
    """The strategy space a configuration's stages are planned in: with context parallelism the reshapes of a
    batch sharded down to one sequence a replica keep the sequence's CP shard
    (``sharding.strategies.folded_batch_views``); otherwise DTensor's alone."""
    import contextlib

    from meshpilot.sharding.strategies import folded_batch_views

    return folded_batch_views() if cfg.cp > 1 else contextlib.nullcontext()


def context_pins(
    graph: OpGraph, model: torch.nn.Module, inputs: Sequence[torch.Tensor], force: dict[str, str], cfg: ParallelConfig
) -> dict[str, str]:
    """`force`, pins on the ``(DP, TP)`` mesh, on ``(DP, CP, TP)`` (module docstring, *Context parallelism*): each
    pin given a placement on the CP axis, as Megatron's TP pins are given on TP, so that the stage planner's
    pieces stay within its budget on three axes. Weights whole over CP; the inputs (ids, labels) and every
    pinned ``[batch, seq, …]`` value (the residual adds, the norm outputs, the stage boundaries) sharded on the
    sequence (``S(1)``); every pinned ``[batch · seq, …]`` product sharded on its rows (``S(0)``: one sequence a
    replica, so the rows are the sequence); a partial value (the loss) partial over CP too."""
    rows, seq = cfg.graph_batch, _sequence(inputs)
    params = {_exact(n) for n, _ in model.named_parameters()}
    shapes = {f"input:{i}": tuple(x.shape) for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)}
    out = {}
    for name, lay in force.items():
        dp, tp = _split_layout(lay)
        node = graph.by_name.get(name)
        shape = shapes.get(name) or (tuple(node.out.shape) if node is not None and node.out is not None else None)
        if name in params or shape is None:
            c = "R"
        elif dp == "P":
            c = "P"
        elif len(shape) >= 2 and shape[0] == rows and shape[1] == seq:
            c = "S(1)"
        elif shape and shape[0] == rows * seq:
            c = "S(0)"
        else:
            c = "R"
        out[name] = dp + c + tp
    return out


def _split_layout(lay: str) -> tuple[str, str]:
    """A two-axis layout string (``S(0)S(1)``, ``RP``) as its two placements."""
    first = lay[:4] if lay.startswith("S(") else lay[:1]
    return first, lay[len(first) :]


def _sequence(inputs: Sequence[torch.Tensor]) -> int:
    """The sequence length of a language model's inputs (dim 1 of its token ids)."""
    first = next(x for x in inputs if isinstance(x, torch.Tensor))
    return int(first.shape[1]) if first.dim() >= 2 else 1


_DERIVED: collections.OrderedDict[tuple, tuple[Stack, Any]] = collections.OrderedDict()
"""(kind, id of the stack, …) → (that stack, what was derived from it): the last :data:`_KEPT` derived stacks and
planners, so that the plans of one capture (a breakdown's second costing, a search's candidates) share them."""
_KEPT = 16


def _derived(key: tuple, stack: Stack, make: Any) -> Any:
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is stack:
        _DERIVED.move_to_end(key)
        return hit[1]
    got = make()
    _DERIVED[key] = (stack, got)
    while len(_DERIVED) > _KEPT:
        _DERIVED.popitem(last=False)
    return got


def _planner_of(stack: Stack, cluster: Cluster | str) -> StagePlanner:
    """One :class:`StagePlanner` of `stack`'s graph per cluster, kept (:data:`_DERIVED`)."""
    name = cluster if isinstance(cluster, str) else cluster.name
    return _derived(("planner", id(stack), name), stack, lambda: StagePlanner(stack.graph, cluster))


def regathered_stack(stack: Stack, gathers: Sequence[str]) -> Stack:
    """`stack` with the forward ops `gathers` (sequence parallelism's norm outputs, ``forced.sequence_gathers``)
    gathered again in the backward instead of saved, as Megatron-LM's SP does (``planner.recompute``,
    *Re-gathered values*): the stack found again and expanded as :func:`recomputed_stack`'s; `stack` itself
    when there are none (or a recomputed block re-gathers its own)."""
    names = tuple(recompute.REGATHER + x for x in gathers)
    if not names:
        return stack

    def make() -> Stack:
        graph = recompute.apply(stack.graph, names)
        if graph is stack.graph or not any(n.name.endswith(recompute.REGATHERED) for n in graph.nodes):
            return stack
        small = find_stack(graph)
        if small is None or small.container != stack.container or small.blocks != stack.kept:
            raise UserError(f"--config sp=1: {stack.container}'s blocks differ once re-gathered; plan sp=0")
        return expand_stack(small, stack.blocks)

    return _derived(("regather", id(stack), names), stack, make)


def float8_stack(stack: Stack) -> Stack:
    """`stack` with every linear's matrix product inside its blocks marked ``OpNode.float8`` (module docstring,
    *Float8*): each ``mm`` / ``addmm`` made by a module under the blocks' container — forward, input gradient,
    weight gradient, and a recomputed forward's copy. The embeddings and the head stay bf16."""
    prefix = stack.container + "."
    nodes = [
        dataclasses.replace(n, float8=True) if n.target in FLOAT8_TARGETS and (n.module or "").startswith(prefix) else n
        for n in stack.graph.nodes
    ]
    if not any(n.float8 for n in nodes):
        raise UserError(f"--config float8=linears: {stack.container}'s blocks make no matrix product; plan float8=none")
    small = find_stack(dataclasses.replace(stack.graph, nodes=nodes))
    if small is None or small.container != stack.container or small.blocks != stack.kept:
        raise UserError(f"--config float8=linears: {stack.container}'s blocks differ once marked; plan float8=none")
    return expand_stack(small, stack.blocks)


FLOAT8_TARGETS = ("aten.mm.default", "aten.addmm.default")
"""The products a linear layer makes (2-D: its input's rows flattened), what ``float8=linears`` runs in Float8."""


def recompute_of(stack: Stack) -> Recompute:
    """What `stack`'s graph recomputes (:func:`recomputed_stack`'s copies; a re-gathered value's copy is not
    one): full when a copy re-runs a matrix product or attention, which a selective region keeps."""
    copies = [n for n in stack.graph.nodes if n.name.endswith(recompute.SUFFIX)]
    if not copies:
        return Recompute.NONE
    return Recompute.FULL if any(recompute.is_kept(n) for n in copies) else Recompute.SELECTIVE


def is_recomputed(stack: Stack) -> bool:
    """Whether `stack`'s graph holds recomputed blocks, whole or selective (:func:`recompute_of`)."""
    return recompute_of(stack) is not Recompute.NONE


def recomputed_stack(stack: Stack, mode: Recompute = Recompute.FULL) -> Stack:
    """`stack` with every captured block recomputed in the backward, whole or (`mode` selective) all but its
    matrix products and attention (module docstring, *Recomputation*); `stack` itself when it already is."""
    if is_recomputed(stack):
        return stack
    selective = mode is Recompute.SELECTIVE
    prefix = (recompute.SELECTIVE if selective else "") + f"{stack.container}."
    names = [r.name for r in recompute.regions(stack.graph, selective=selective) if r.name.startswith(prefix)]
    small = find_stack(recompute.apply(stack.graph, names))
    if small is None or small.container != stack.container or small.blocks != stack.kept:
        raise UserError(
            f"--config recompute={mode.value}: {stack.container}'s blocks differ once recomputed; plan none"
        )
    return expand_stack(small, stack.blocks)


def boundary_pins(
    sp: StagePlanner, stack: Stack, cfg: ParallelConfig, force: dict[str, str] | None = None
) -> dict[str, str]:
    """Every stage piece's boundary inputs (``stage.slice_graph``'s ``boundary:`` leaves) whose dim 0 is the
    microbatch's rows, pinned batch-sharded over DP (``S(0)R``): each replica's stage receives its own rows, as the
    previous stage's replica sends them (:func:`send_shares`). Unpinned, the search may keep such an input
    replicated, which costs it nothing in time but holds every replica's rows on every rank. With sequence
    parallelism (`force`: ``megatron_tp``'s pins with it) a boundary of a residual add's shape — the hidden state
    between blocks and its gradient — is sharded on the sequence over TP too (``S(0)S(1)``; ``RS(1)`` at DP 1), as
    Megatron keeps it; the rotary tables and masks stay whole over TP."""
    residual = residual_shapes(stack.graph, force or {}) if cfg.sequence_parallel else set()
    if cfg.dp == 1 and cfg.cp == 1 and not residual:
        return {}  # an axis of one device is R
    p, end = stack.pre, len(sp.layers)
    pieces = [(stack.middle, stack.middle + 1)]
    pieces += [(a, b) for a in range(p) for b in range(a + 1, p + 1)]
    pieces += [(a, b) for a in range(end - stack.post, end) for b in range(a + 1, end + 1)]
    rows = "S(0)" if cfg.dp > 1 else "R"  # rows over DP (mesh axis 0)
    pins = {}
    for a, b in pieces:
        for name, n in received_row_leaves(slice_graph(stack.graph, a, b, sp.layers), cfg.graph_batch):
            shape = tuple(n.out.shape)
            # with context parallelism, a [batch, seq, …] boundary on the sequence over CP (the middle axis)
            cp = "" if cfg.cp == 1 else "S(1)" if len(shape) >= 2 and shape[1] % cfg.cp == 0 and shape[1] > 1 else "R"
            if shape in residual:
                pins[_exact(name)] = rows + cp + "S(1)"  # the sequence over TP
            elif cfg.dp > 1 or cfg.cp > 1:
                pins[_exact(name)] = rows + cp + "R"  # whole on every TP rank
    return pins


def residual_shapes(graph: OpGraph, force: dict[str, str]) -> set[tuple[int, ...]]:
    """Shapes of the residual adds `force` pins sequence-sharded (``forced.megatron_tp(sequence_parallel=True)``:
    operator nodes named exactly, sharded on dim 1 over the TP axis, the last)."""
    out = set()
    for name, lay in force.items():
        node = graph.by_name.get(name)
        if node is not None and node.target == "aten.add.Tensor" and lay.endswith("S(1)") and node.out is not None:
            out.add(tuple(node.out.shape))
    return out


def _assemble(stack: Stack, sp: StagePlanner, cfg: ParallelConfig, bounds, ranks, costs, t0: float) -> Plan:
    """The :class:`Plan` of chunks `bounds` on `ranks` costed as `costs` (as ``pipeline.fixed_pipeline``
    builds one, over the stack's model layers)."""
    kind, B = cfg.schedule, cfg.microbatches
    graph: OpGraph = stack.graph
    layers = list(stack.layers)
    C = stack.received(received_bytes(graph, sp.layers))
    held = _held_per_stage(kind, _groups(ranks, kind), len(bounds), B)
    stages = []
    for j, ((a, b), rk, c) in enumerate(zip(bounds, ranks, costs)):
        share = input_grad_share(graph, sp.layers, *stack.graph_range(a, b))
        stages.append(PlanStage.costed(layers, a, b, rk, c, B, held[j], C, share))
    flops = tuple(sum(x.flops for x in layers[a:b]) for a, b in bounds)
    clustering = Clustering(tuple(bounds), flops, tuple(float(C[a, b - 1]) for a, b in bounds), 0.0)
    plan = Plan(
        tuple(stages), B, cfg.devices, clustering, float(sp.cluster.device.memory_bytes), 0.0,
        time.perf_counter() - t0, 0, 0, kind, StageCosting.STACK,
        transfers=stage_transfers(graph, sp.layers, bounds, ranks, sp.cluster, stack), cluster=sp.cluster.name,
        send_split=cfg.dp * cfg.cp * (cfg.tp if cfg.sequence_parallel else 1), sync_overlap=True,
    )  # fmt: skip
    return dataclasses.replace(plan, dp_step_s=plan.step_s)


def group_memory(cp: ConfigPlan) -> float:
    """Bytes per GPU of the plan's fullest pipeline group by :func:`group_bound` over its chunks' costs."""
    cfg = cp.config
    fb = [c.peaks.forward_backward for c in cp.costs]
    upd = [c.peaks.update for c in cp.costs]
    act = [c.peaks.activations for c in cp.costs]
    resident = [c.peaks.resident for c in cp.costs]
    return group_bound(cfg.schedule, cfg.pp, cfg.virtual, cfg.microbatches, fb, upd, act, resident)


def group_bound(
    kind: PipelineKind,
    p: int,
    v: int,
    B: int,
    fb: Sequence[float],
    upd: Sequence[float],
    act: Sequence[float],
    resident: Sequence[float | None] | None = None,
) -> float:
    """Eq. 5 of the fullest of `p` pipeline groups, chunk j (of ``p · v``, on group j mod p) with forward +
    backward peak ``fb_j``, update peak ``upd_j``, one microbatch's saved activations ``act_j`` and, where
    known, ``r_j`` what it holds while another chunk computes (`resident`: weights, states, inputs, gradients):

        M_g = max( Σ_{j≡g} upd_j,  min(A_g, R_g) + max_t Σ_{j≡g} n_j(t) · act_j )
        A_g = Σ_{j≡g} (fb_j − act_j)             every chunk at its own forward + backward peak
        R_g = Σ_{j≡g} r_j + max_{j≡g} (fb_j − r_j)   one chunk computing, the others resident

    n_j(t) the microbatches chunk j has forwarded and not yet backwarded at step t of the group's own schedule
    (:func:`in_flight_peaks`: walked over the schedule's actions). Each chunk's own maximum h_j, summed
    (``Σ_j max(upd_j, fb_j + (h_j − 1) · act_j)``, what ``PlanStage.memory_bytes`` sum to), counts maxima
    reached at different times: under interleaved 1F1B with p = 16, v = 8 and 32 microbatches group 0's
    chunks hold at most 192 chunk-microbatches by that sum and 143 at once. One chunk per group (1F1B, ZB-H1)
    gives the same bound both ways.

    ``A_g`` counts every chunk's working set (its forward + backward's temporaries) at once, though a GPU runs
    one chunk at a time; ``R_g`` counts it once. Both bound the same memory: at any moment the computing chunk
    j holds at most ``fb_j`` (its live values include its gradients so far and the current microbatch's saved
    values, which the in-flight term counts again), every other chunk its resident bytes, and the in-flight
    microbatches their saved values. With one chunk a group ``A_g`` is the smaller (it does not count the
    current microbatch twice); with the 8 one-block chunks of Llama 3's groups ``R_g`` is."""
    return max(g.total for g in group_parts(kind, p, v, B, fb, upd, act, resident))


@dataclass(frozen=True)
class GroupMemory:
    """One pipeline group's :func:`group_bound`, term by term (bytes per GPU). Per chunk, ``u_j = upd_j − r_j`` is
    its update temporary (a chunk composed without ``accumulated``, as :func:`plan_config`'s: ``r_j = W + O + I +
    G``): one parameter-sized tensor a trainable parameter (``accounting.state_bytes``), so its parameters' bytes
    — over ``Z`` with the states sharded over ``Z`` ranks (:func:`sharded_states`). So its
    gradients take ``Z · u_j`` (whole: their sum over the microbatches), its AdamW states ``ADAMW_STATES · u_j``
    and its weights and input leaves the rest of ``r_j``."""

    group: int
    update: float
    """``Σ_j upd_j``: the optimizer step's peak."""
    weights: float
    """``Σ_j (r_j − (Z + ADAMW_STATES) · u_j)``: the weights (and input leaves) of the group's chunks."""
    optimizer: float
    """``Σ_j ADAMW_STATES · u_j``: AdamW's states (their shard)."""
    grads: float
    """``Σ_j Z · u_j``: the gradients' sum over the microbatches, held through the backward."""
    working: float
    """``min(A_g, R_g) − Σ_j r_j``: the computing chunk's live values beyond its resident bytes, one microbatch's
    saved values among them."""
    in_flight: float
    """``max_t Σ_j n_j(t) · act_j``: the microbatches' saved values the schedule keeps at once."""

    @property
    def total(self) -> float:
        """``M_g``."""
        return max(self.update, self.weights + self.optimizer + self.grads + self.working + self.in_flight)


def group_parts(
    kind: PipelineKind,
    p: int,
    v: int,
    B: int,
    fb: Sequence[float],
    upd: Sequence[float],
    act: Sequence[float],
    resident: Sequence[float | None] | None = None,
    shards: int = 1,
) -> list[GroupMemory]:
    """Each group's :class:`GroupMemory` (:func:`group_bound`), the chunks' AdamW states sharded over `shards`
    ranks. Without `resident` the static terms are not told apart (all in ``working``)."""
    peaks = in_flight_peaks(kind, p, v, B, tuple(act))
    out = []
    for g in range(p):
        js = range(g, p * v, p)
        update, held = sum(upd[j] for j in js), sum(fb[j] - act[j] for j in js)
        if resident is None or any(resident[j] is None for j in js):
            out.append(GroupMemory(g, update, 0.0, 0.0, 0.0, held, peaks[g]))
            continue
        r = [float(resident[j]) for j in js]  # type: ignore[index, arg-type]
        held = min(held, sum(r) + max(fb[j] - rj for j, rj in zip(js, r)))
        u = sum(upd[j] - rj for j, rj in zip(js, r))
        states, grads = ADAMW_STATES * u, shards * u
        out.append(GroupMemory(g, update, sum(r) - grads - states, states, grads, held - sum(r), peaks[g]))
    return out


def group_terms(cp: ConfigPlan) -> GroupMemory:
    """The fullest pipeline group's :class:`GroupMemory`: :func:`group_memory`'s bound, term by term."""
    cfg = cp.config
    peaks = [c.peaks for c in cp.costs]
    parts = group_parts(
        cfg.schedule, cfg.pp, cfg.virtual, cfg.microbatches,
        [x.forward_backward for x in peaks], [x.update for x in peaks], [x.activations for x in peaks],
        [x.resident for x in peaks], cfg.dp * cfg.cp if cfg.zero else 1,
    )  # fmt: skip
    return max(parts, key=lambda g: g.total)


@functools.lru_cache(maxsize=256)
def _chunk_actions(kind: PipelineKind, p: int, v: int, B: int) -> tuple[tuple[int, tuple[tuple[bool, int], ...]], ...]:
    """Per group: (group, its compute actions as (forward?, chunk)) of `kind` over p groups of v chunks."""
    sched = pipeline([[g] for g in range(p)], B, kind, v)
    ends = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
    out = []
    for c in sched.classes:
        acts = tuple(
            (a.kind == ActionKind.FORWARD, a.stage if a.stage is not None else c.ranks[0])
            for a in c.actions
            if a.kind == ActionKind.FORWARD or a.kind in ends
        )
        out.append((c.ranks[0], acts))
    return tuple(out)


def in_flight_peaks(kind: PipelineKind, p: int, v: int, B: int, act: tuple[float, ...]) -> list[float]:
    """Per group g: ``max_t Σ_j n_j(t) · act_j`` (:func:`group_bound`), walked over the schedule's actions: a
    forward of chunk j adds ``act_j``, its backward takes it away (interleaved 1F1B; one chunk a group: its
    :func:`held_one_chunk` count, the zero-bubble schedules' held until their weight gradients)."""
    if kind != PipelineKind.INTERLEAVED_1F1B:  # one chunk a group: its own maximum, as the stage DP counts it
        held = held_one_chunk(kind, p, B)
        return [held[g] * act[g] for g in range(p)]
    out = [0.0] * p
    for g, acts in _chunk_actions(kind, p, v, B):
        total = peak = 0.0
        for forward, j in acts:
            total += act[j] if forward else -act[j]
            peak = max(peak, total)
        out[g] = peak
    return out


_Drain = tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]


@functools.lru_cache(maxsize=1024)
def _drain(kind: PipelineKind, p: int, v: int, B: int, g: int) -> _Drain:
    """Group g's chunks in the order their last backward ends, each with the forwards and backwards the group
    runs after it, counted per chunk of the group (its k-th: chunk ``k · p + g``)."""
    acts = dict(_chunk_actions(kind, p, v, B))[g]
    last = {j: i for i, (forward, j) in enumerate(acts) if not forward}
    out = []
    for j, i in sorted(last.items(), key=lambda x: x[1]):
        fwd, bwd = [0] * v, [0] * v
        for forward, c in acts[i + 1 :]:
            (fwd if forward else bwd)[c // p] += 1
        out.append((j, tuple(fwd), tuple(bwd)))
    return tuple(out)


def exposed_sync(
    kind: PipelineKind,
    p: int,
    v: int,
    B: int,
    g: int,
    forward: Sequence[float],
    backward: Sequence[float],
    sync: Sequence[float],
) -> float:
    """``X_g`` (module docstring, *The gradients' synchronisation, overlapped*): group g's sync seconds left after
    its last backward, chunk j (of ``p · v``) taking ``forward[j]`` and ``backward[j]`` a microbatch and
    ``sync[j]`` once, each sync issued when its chunk's last backward ends, one at a time. The simulator's
    (``Plan.simulate`` with ``sync_overlap``) where the group's drain computes without idling; above it where it
    idles (the syncs hide there too)."""
    end = -math.inf
    for j, fwd, bwd in _drain(kind, p, v, B, g):
        after = sum(n * forward[k * p + g] + m * backward[k * p + g] for k, (n, m) in enumerate(zip(fwd, bwd)))
        end = max(end, -after) + sync[j]
    return max(0.0, end)


def send_shares(cp: ConfigPlan) -> dict[tuple[int, int], float]:
    """Bytes one rank sends per microbatch at each stage boundary: the transfer (the whole step's microbatch,
    every replica's rows) over DP, each replica's rows leaving its own ranks on their own NICs; without sequence
    parallelism the TP ranks of a replica each send its rows whole (no scatter / gather), as meshpilot's
    cross-mesh tiles move them; with it each sends its share of the sequence (over DP · TP)."""
    return {(x.src, x.dst): x.nbytes / cp.plan.send_split for x in cp.plan.transfers}


def simulate_config(cp: ConfigPlan, **kw: Any) -> SimResult:
    """``Plan.simulate`` of the configuration's plan: its ``send_split`` is DP, each send one rank's share
    (:func:`send_shares`)."""
    return cp.plan.simulate(**kw)


@dataclass(frozen=True)
class Breakdown:
    """One step of a configuration's plan, term by term, for the busiest pipeline group (seconds)."""

    step_s: float
    """The simulated step."""
    compute_s: float
    """The group's operators, every microbatch of every chunk."""
    tp_s: float
    """Its collectives and resharding issued every microbatch (none overlapped): TP's, and the few small ones
    besides (the loss' reduction over DP in the last stage)."""
    dp_s: float
    """Its gradient synchronisation over DP, once a step: what the simulation leaves exposed (the group's stage
    syncs not beside its compute: ``SimResult.exposed_s``)."""
    optimizer_s: float
    pipeline_s: float
    """The rest: the bubble (fill and drain) and the exposed sends between stages."""
    dp_hidden_s: float = 0.0
    """Of the gradient synchronisation, the seconds the simulation ran beside the group's compute."""

    def rows(self) -> list[tuple[str, float]]:
        return [("compute", self.compute_s), ("TP (per-microbatch) comm.", self.tp_s),
                ("DP gradient sync (exposed)", self.dp_s), ("DP gradient sync (hidden)", self.dp_hidden_s),
                ("optimizer", self.optimizer_s), ("bubble + exposed sends", self.pipeline_s)]  # fmt: skip


def breakdown(cp: ConfigPlan, sim: SimResult) -> Breakdown:
    """The terms of :class:`Breakdown` of `sim`, the plan's simulated step, for its busiest group (the most work
    a step). TP and DP communication are told apart by the chunks' own sync (``StageCost.sync_s``: the
    ``grad:`` collectives, once a step; every other collective runs every microbatch); of the sync, what the
    simulation left beside the group's compute is hidden, the rest exposed (``SimResult.exposed_s`` on the
    group's stand-in rank: ``Plan.simulate`` numbers them by group)."""
    cfg = cp.config
    busiest = max(range(cfg.pp), key=lambda g: sum(c.time.total_s for c in cp.costs[g :: cfg.pp]))
    one = cp.costs[busiest :: cfg.pp]
    sync = sum(c.sync_s for c in one)
    tp = sum(c.time.communication_s + c.time.resharding_s for c in one) - sync
    exposed, hidden = sim.exposed_s(busiest) if cp.plan.sync_overlap else (sync, 0.0)
    compute = sum(c.time.compute_s for c in one)
    opt = sum(c.time.optimizer_s for c in one)
    return Breakdown(sim.step_s, compute, tp, exposed, opt, sim.step_s - compute - tp - exposed - opt, hidden)


def model_flops_per_token(model: torch.nn.Module, layers: int, hidden: int, seq: int, causal: bool = False) -> float:
    """``6 · N + 12 · L · h · s`` (module docstring, *Throughput*), N without the input embedding table; with
    `causal`, ``6 · N + 6 · L · h · s`` (the causal half of the score square)."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is None and hasattr(model, "model"):
        embed = model.model.get_input_embeddings()
    n = sum(p.numel() for p in model.parameters())
    if embed is not None:
        n -= embed.weight.numel()
    return 6.0 * n + (6.0 if causal else 12.0) * layers * hidden * seq


def tflops_per_gpu(flops_per_token: float, tokens: int, step_s: float, gpus: int) -> float:
    """Model TFLOP/s per GPU of a step of `tokens` taking `step_s` on `gpus`."""
    if step_s <= 0 or not math.isfinite(step_s):
        return 0.0
    return flops_per_token * tokens / step_s / gpus / 1e12


__all__ = [
    "Breakdown",
    "ConfigPlan",
    "Float8",
    "ParallelConfig",
    "Recompute",
    "Split",
    "boundary_pins",
    "breakdown",
    "check_config",
    "context_order",
    "exposed_sync",
    "float8_stack",
    "group_bound",
    "GroupMemory",
    "group_memory",
    "group_parts",
    "group_terms",
    "in_flight_peaks",
    "is_recomputed",
    "model_flops_per_token",
    "parse_config",
    "plan_config",
    "recompute_of",
    "recomputed_stack",
    "regathered_stack",
    "residual_shapes",
    "send_shares",
    "sharded_states",
    "state_cut",
    "update_cut_seconds",
    "simulate_config",
    "stage_bounds",
    "stage_ranks",
    "stage_setup",
    "tflops_per_gpu",
    "zigzag_stack",
]
