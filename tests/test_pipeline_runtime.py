"""The pipeline runtime on 4 gloo ranks against the single device: plans without their stages' plans (data-parallel
stage plans made at the start): 2 stages x 2 ranks under GPipe and 1F1B, and
stages on submeshes of 1 and 3 ranks under 1F1B (tile sends between them), 4 microbatches of the tiny GPT: loss
and gradients over 3 AdamW steps, and the sends, receives and all-reduces counted against the schedule's. Then
stages running their own intra-operator plans (``Plan.with_intra``): Megatron tensor parallelism on one
submesh beside data parallelism on the other (a replicated boundary resharded to batch rows and back), and the
searched plans of a 1-rank and a 3-rank mesh (GPipe), 3 stages with a Megatron stage in the middle (1F1B and
ZB-H1), Interleaved1F1B (2 chunks on each of 2 groups), and the first pipeline again with Alpa's local
all-gather; loss and gradients against the single device, every collective, send and receive counted against
the plans' and the schedule's, the bytes crossing meshes with and without the local all-gather; and the
planner's pipelines of two models nobody here wrote, Hugging Face's Llama and Mixtral. Two 4-rank spawns; every
check inside it. And one 8-rank spawn (EIGHT): 4 stages of 2 ranks under 1F1B, and
Interleaved1F1B on 2 groups of 4 ranks on meshes (2, 2) and (1, 4). The default tier (``tests/tiers.py``) runs a
part of each spawn (DP_RUNS, FOUR_RUNS, INTRA_RUNS) and not the 8-rank one; the full matrix runs all of it."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
from dist_utils import cached_graph, captures, graph_of, run_distributed
from tiers import FULL, matrix, params

from meshpilot.planner.schedule import PipelineKind

STEPS = 3


CONFIGS = {  # name: (stage ranks, schedule, global batch)
    "gpipe": ([[0, 1], [2, 3]], "gpipe", 8),
    "1f1b": ([[0, 1], [2, 3]], "1f1b", 8),
    "1f1b-1+3": ([[0], [1, 2, 3]], "1f1b", 12),  # submeshes of different sizes: tile sends of 1 row
}
DP_DEFAULT = ("gpipe", "1f1b-1+3")
DP_RUNS = matrix(DP_DEFAULT, tuple(CONFIGS))
"""The dp spawn's plans. Default: GPipe on 2x2 ranks and 1F1B on submeshes of 1 and 3; full only: 1F1B on 2x2
(1F1B's counts are checked in the default tier by the 1+3 plan and INTRA's tp|dp). Before/after: see FOUR_RUNS."""


def _dp_worker(configs: dict) -> dict:
    """CONFIGS (plans without their stages' plans: data-parallel stage plans made at the start) beside the
    single device, and the pipeline's bad inputs."""
    import torch

    from meshpilot.errors import UserError
    from meshpilot.models.gpt import GPT, gpt_tiny
    from meshpilot.planner.plan import Plan
    from meshpilot.planner.schedule import parse_schedule
    from meshpilot.runtime.pipeline import pipeline_parallelize

    cfg = gpt_tiny(layers=4)
    out: dict = {}
    for name, text in configs.items():  # plans without stage plans: data-parallel stages made at the start
        plan = Plan.from_json(text)
        torch.manual_seed(0)
        batch = CONFIGS[name][2]
        idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        tgt = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        torch.manual_seed(1)
        ref = GPT(cfg)
        torch.manual_seed(1)
        pm = pipeline_parallelize(GPT(cfg), (idx, tgt), plan, graph=_gpt_graph(batch // plan.microbatches))
        out[name] = _beside_single_device(pm, ref, (idx, tgt))
        out[name]["own_plans"] = type(pm).__name__
    uneven = Plan.from_json(configs["1f1b-1+3"])
    odd = "schedule odd, 4 microbatches\nranks 0: F0 +3.0 B0 G\nranks 1-3: F0 B0 G"
    bad = {  # 8 / 4 microbatches = 2 rows: no equal shards over 3 ranks; an action the runtime does not run
        "uneven": lambda: pipeline_parallelize(GPT(cfg), (idx[:8], tgt[:8]), uneven, graph=_gpt_graph(8 // 4)),
        "action": lambda: pipeline_parallelize(GPT(cfg), (idx, tgt), uneven, parse_schedule(odd)),
        "split": lambda: pipeline_parallelize(GPT(cfg), (idx, tgt), ["blocks.2"]),
    }
    for key, call in bad.items():
        try:
            call()
        except UserError as e:
            out[key] = str(e)
    return out


FOUR_DEFAULT = ("planned-mlp", "hf-mixtral", "resumes-tied", "hf-gpt2-tied", "tied-accumulated")
FOUR_RUNS = matrix(
    FOUR_DEFAULT,
    ("planned-mlp", "hf-llama", "hf-mixtral", "resumes", "resumes-tied", "hf-gpt2-tied", "tied-accumulated"),
)
"""The 4-rank spawn's runs besides INTRA's. Default: the MLP's saved plan; HF Mixtral (nested decoder layers,
rotary embeddings read by every layer, the MoE op) and HF GPT-2 (tied embedding: run, accumulated, resumed);
full only: HF Llama's pipeline and its checkpoint resumes (the same mechanisms as Mixtral's and GPT-2's on
another HF model). With INTRA_RUNS, DP_RUNS and the 8-rank spawn (full only), the file's CPU s (ranks
included): 897 before (the last full run, load ~20), 246 after (default tier, load ~7: 22 passed, 8 full only)."""


def _worker(mlp_plan: str, intra_plans: dict, hf_plan: str | None, moe_plan: str, extra: tuple) -> dict:
    out: dict = {}
    one_plan, root, tied_plan, tied_one_plan = extra
    runs = {
        "planned-mlp": lambda: _run_planned_mlp(mlp_plan),
        "hf-llama": lambda: _run_planned_hf(hf_plan),
        "hf-mixtral": lambda: _run_planned_hf(moe_plan, "hf:mixtral", HF_MIXTRAL, seq=4),
        "resumes": lambda: _resumes(hf_plan, one_plan, f"{root}/llama"),
        "resumes-tied": lambda: _resumes(tied_plan, tied_one_plan, f"{root}/gpt2", "hf:gpt2", HF_GPT2, seq=8),
        "hf-gpt2-tied": lambda: _run_planned_hf(tied_plan, "hf:gpt2", HF_GPT2, seq=8),
        "tied-accumulated": lambda: _accumulated(tied_plan),
    }
    for key in FOUR_RUNS:
        out[key] = runs[key]()
    out.update(_run_intra(intra_plans, INTRA_RUNS))
    return out


def _run_planned_mlp(text: str) -> dict:
    """The planner's pipeline of the MLP (JSON, as `meshpilot plan --pipeline --out` saves it) run as planned."""
    import torch

    from meshpilot.models.zoo import MLPModel
    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.pipeline import pipeline_parallelize

    plan = Plan.from_json(text)
    torch.manual_seed(2)
    x, y = torch.randn(16, 32), torch.randint(0, 16, (16,))
    torch.manual_seed(3)
    ref = MLPModel()
    torch.manual_seed(3)
    pm = pipeline_parallelize(MLPModel(), (x, y), plan)
    ref(x, y).backward()
    with record_collectives(pm.mesh) as log:
        pm.step(x, y)
    params = dict(ref.named_parameters())
    grad = max((params[n].grad - p.grad.full_tensor()).abs().max().item() for n, p in pm.named_parameters())
    counts = log.counts() == pm.planned_counts()
    return {"grad": grad, "equal_counts": counts, "stage": pm.stage, "own_plans": type(pm).__name__}


HF_LLAMA = ["num_hidden_layers=4", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4"]
HF_LLAMA += ["num_key_value_heads=2", "vocab_size=256"]
"""A tiny Hugging Face Llama (``hf:llama``): its layers nested in ``model.model.layers``, rotary embeddings
computed once in ``LlamaModel.forward`` and read by every layer, untied embeddings."""


HF_GPT2 = ["n_layer=2", "n_embd=32", "n_head=2", "vocab_size=128", "n_positions=16"]
HF_GPT2 += ["resid_pdrop=0", "embd_pdrop=0", "attn_pdrop=0"]
"""A tiny Hugging Face GPT-2 (``hf:gpt2``) with its default tied embedding and LM head, dropout off."""

HF_MIXTRAL = ["num_hidden_layers=4", "hidden_size=32", "intermediate_size=48", "num_local_experts=4"]
HF_MIXTRAL += ["num_attention_heads=4", "num_key_value_heads=2", "num_experts_per_tok=2", "vocab_size=64"]
HF_MIXTRAL += ["max_position_embeddings=32"]
"""A tiny Hugging Face Mixtral (``hf:mixtral``): dropless top-2 MoE layers, run by meshpilot's own MoE op."""


def _hf_graph(plan, model: str, config: list, seq: int, into: dict | None = None):
    """The capture `plan` runs the Hugging Face `model` (batch 8, `seq`) on, made once per rank for every run of
    it: a pipeline's at one microbatch of the global batch (what ``pipeline_parallelize`` captures), a one-stage
    plan's as ``parallelize`` captures it (``graph_of``). With `into` (in the parent, for ``run_distributed(...,
    graphs=)``): made by the same call and put there under the key the ranks find it by."""
    from meshpilot.graph.capture import capture
    from meshpilot.models.sources import build_model
    from meshpilot.runtime.pipeline import microbatch_examples

    def built(device):
        return build_model(model, hf_config=config, batch=8, seq=seq, device=device, seed=0)

    if plan.is_single:
        if into is not None:
            return captures((f"{model}-{seq}", built("meta").model, plan.only), into=into)
        return graph_of(f"{model}-{seq}", built("meta").model, plan.only)

    def make():
        b = built("cpu")
        return capture(b.model, microbatch_examples(b.inputs, plan.microbatches), precision=plan.precision)

    key = ("pipeline", model, seq, plan.microbatches, plan.precision)
    if into is not None:
        if key not in into:
            into[key] = make()
        return into
    return cached_graph(key, make)


def _run_planned_hf(text: str, model: str = "hf:llama", config: list | None = None, seq: int = 16) -> dict:
    """The planner's pipeline of a Hugging Face model (``meshpilot plan --pipeline --out``; Llama by default)
    run as planned, 3 AdamW steps beside the single device: HF's own loss and every gradient, the
    collectives, sends and receives against the plans' and the schedule's."""
    from meshpilot.models.sources import build_model
    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.pipeline import pipeline_parallelize

    plan = Plan.from_json(text)
    config = HF_LLAMA if config is None else config
    ref = build_model(model, hf_config=config, batch=8, seq=seq, device="cpu", seed=0).model
    mine = build_model(model, hf_config=config, batch=8, seq=seq, device="cpu", seed=0)
    inputs, M = mine.inputs, plan.microbatches
    pm = pipeline_parallelize(mine.model, inputs, plan, graph=_hf_graph(plan, model, config, seq))

    def ref_loss():  # HF's mean loss over the global batch, as gradient accumulation's mean of the microbatches'
        return sum(ref(*(x.chunk(M)[m] for x in inputs)) for m in range(M)) / M  # (equal ones, no padding)

    return _beside_single_device(pm, ref, inputs, ref_loss)


def _accumulated(text: str) -> float:
    """The tied GPT-2 pipeline stepped twice with no ``zero_grad`` between (gradients accumulated over steps,
    the tied sync adding each step's parts once) beside the single device: the largest gradient difference."""
    from meshpilot.models.sources import build_model
    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.pipeline import pipeline_parallelize

    plan = Plan.from_json(text)
    ref = build_model("hf:gpt2", hf_config=HF_GPT2, batch=8, seq=8, device="cpu", seed=0).model
    mine = build_model("hf:gpt2", hf_config=HF_GPT2, batch=8, seq=8, device="cpu", seed=0)
    inputs, M = mine.inputs, plan.microbatches
    pm = pipeline_parallelize(mine.model, inputs, plan, graph=_hf_graph(plan, "hf:gpt2", HF_GPT2, 8))
    for _ in range(2):
        (sum(ref(*(x.chunk(M)[m] for x in inputs)) for m in range(M)) / M).backward()
        pm.step(*inputs)
    params = dict(ref.named_parameters())
    return max((params[n].grad - p.grad.full_tensor()).abs().max().item() for n, p in pm.named_parameters())


def _resumes(
    pipeline_text: str, one_text: str, root: str, model: str = "hf:llama", config: list | None = None, seq: int = 16
) -> dict[str, list[float]]:
    """Checkpoints of an HF model's pipeline (Llama's by default; ``meshpilot train --plan pp.json
    --checkpoint-dir``'s path): the losses of 3 AdamW steps straight through, saving after step 2 (and at the
    end), and of runs that resume from step 2 for step 3 under the same pipeline, from the pipeline's checkpoint
    under a one-stage plan on the same 4 ranks, and from that plan's checkpoint under the pipeline."""
    import torch.distributed as dist

    from meshpilot.models.sources import build_model
    from meshpilot.planner.plan import Plan
    from meshpilot.runtime.checkpoint import Checkpointing, complete
    from meshpilot.runtime.train import train_model

    pp, one = Plan.from_json(pipeline_text), Plan.from_json(one_text)

    def build(device):
        return build_model(model, hf_config=config or HF_LLAMA, batch=8, seq=seq, device=device, seed=0)

    def run(plan, steps: int, directory: str | None = None, resume_from: str | None = None) -> list[float]:
        ck = None
        if directory is not None:
            at_2 = [c for c in complete(f"{root}/{resume_from}") if c.step == 2] if resume_from else [None]
            ck = Checkpointing(f"{root}/{directory}", every=2, resume=at_2[0])
        graph = _hf_graph(plan, model, config or HF_LLAMA, seq)  # each plan's capture made once
        logs = train_model(build, steps, plan=plan, graph=graph, checkpoint=ck)  # one path for either plan
        dist.barrier()
        return [x.loss for x in logs]

    out = {"straight": run(pp, 3, "pp"), "one saved": run(one, 2, "one")}
    out["same plan"] = run(pp, 3, "pp-again", "pp")
    out["pipeline to one"] = run(one, 3, "pp-to-one", "pp")
    out["one to pipeline"] = run(pp, 3, "one-to-pp", "one")
    return out


INTRA = {  # name: (stages as (layers, ranks, logical mesh), forced layouts per stage, schedule)
    "tp|dp": ([((0, 4), (0, 1), (1, 2)), ((4, 8), (2, 3), (1, 2))], ("megatron_tp", "data_parallel"), "1f1b"),
    "1|3": ([((0, 4), (0,), (1, 1)), ((4, 8), (1, 2, 3), (1, 3))], (None, None), "gpipe"),
    "1|tp|1": (
        [((0, 3), (0,), (1, 1)), ((3, 6), (1, 2), (1, 2)), ((6, 8), (3,), (1, 1))],
        (None, "megatron_tp", None),
        "1f1b",
    ),
    "interleaved": (  # 2 chunks per group, the groups' logical meshes transposed: 3 boundaries, each both ways
        [((0, 2), (0, 1), (1, 2)), ((2, 4), (2, 3), (2, 1)), ((4, 6), (0, 1), (1, 2)), ((6, 8), (2, 3), (2, 1))],
        (None, None, None, None),
        "interleaved-1f1b",
    ),
}
ZB = ("1|tp|1",)
"""Configurations also run under the zero-bubble schedule (``planner.schedule.zero_bubble``: I and W)."""
_ALL_INTRA_RUNS = [(name, name, False, False) for name in INTRA]
_ALL_INTRA_RUNS += [("tp|dp+gather", "tp|dp", True, False)]
_ALL_INTRA_RUNS += [(f"{name}+zb", name, False, "kind") for name in ZB]
INTRA_DEFAULT = ("tp|dp", "interleaved", "tp|dp+gather", "1|tp|1+zb")
INTRA_RUNS = matrix([run for run in _ALL_INTRA_RUNS if run[0] in INTRA_DEFAULT], _ALL_INTRA_RUNS)
"""(result, plan, local all-gather?, zero bubble?) of the 4-rank spawn. Default: Megatron | data parallel under
1F1B (with and without the local all-gather), Interleaved1F1B on transposed meshes, and 3 stages under ZB-H1;
full only: 1|3 under GPipe (GPipe's counts are checked by the dp spawn's) and 1|tp|1 under 1F1B (the same
stages as ZB-H1's)."""
INTRA_PLANNED = {run[1] for run in INTRA_RUNS}
"""The INTRA plans the runs need (planned in the parent)."""
MICRO = 2
"""Rows of one microbatch in the intra-plan configurations (a global batch of 4 microbatches: 8)."""


def _tiny_gpt_graph(rows: int = MICRO):
    """The 4-layer tiny GPT on the meta device, a microbatch of `rows` rows and its capture, made once a process
    for each `rows`."""
    return _tiny_gpt_at(rows)


@functools.cache
def _tiny_gpt_at(rows: int):
    import warnings

    import torch

    from meshpilot.graph.capture import capture
    from meshpilot.models.gpt import GPT, gpt_tiny

    cfg = gpt_tiny(layers=4)
    model = GPT(cfg).to("meta")
    idx = torch.zeros((rows, cfg.seq), dtype=torch.long, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, (idx, idx), capture(model, (idx, idx))


def _gpt_graph(rows: int):
    """In a rank: :func:`_tiny_gpt_graph`'s capture at `rows` rows, the parent's (:func:`_gpt_graphs`)."""
    return cached_graph(("tiny-gpt", rows), lambda: _tiny_gpt_graph(rows)[2])


def _gpt_graphs(*rows: int) -> dict:
    """For ``run_distributed(..., graphs=)``: :func:`_tiny_gpt_graph`'s captures at `rows`, the ones the parent
    planned on (each rank traced them again: ~0.7 CPU s each)."""
    return {("tiny-gpt", r): _tiny_gpt_graph(r)[2] for r in rows}


def _run_intra(plans: dict[str, str], runs: list | None = None) -> dict:
    """Each pipeline plan with its stages' own plans, 3 AdamW steps beside the single device; `runs`: (result
    name, plan name, local all-gather?, zero-bubble schedule? — True: given to ``pipeline_parallelize``,
    "kind": the plan's own, of kind zb-h1) each, by default every plan as saved, the Megatron | data-parallel
    one with the local all-gather, and those of ZB as plans of kind zb-h1."""
    import dataclasses

    from meshpilot.planner.plan import Plan
    from meshpilot.planner.schedule import PipelineKind, zero_bubble
    from meshpilot.runtime.pipeline import pipeline_parallelize

    graph = _gpt_graph(MICRO)  # one capture for every configuration (same model, same microbatch)
    out = {}
    if runs is None:
        runs = _ALL_INTRA_RUNS
    for name, key, gather, zb in runs:
        plan = Plan.from_json(plans[key])
        sched = zero_bubble([st.ranks for st in plan.stages], plan.microbatches) if zb else None
        if zb == "kind":  # the plan's own kind, saved and loaded as `meshpilot train --plan` reads it
            plan = Plan.from_json(dataclasses.replace(plan, schedule=PipelineKind.ZERO_BUBBLE).to_json())
            assert plan.step_schedule() == sched
            sched = None
        batch, ref, model = _tiny_gpt_run()
        pm = pipeline_parallelize(model, batch, plan, sched, graph=graph, local_gather=gather)
        out[name] = _beside_single_device(pm, ref, batch)
    return out


def _tiny_gpt_run() -> tuple[tuple, object, object]:
    """The intra-plan runs' global batch (4 microbatches of ``MICRO`` rows) and two identically seeded tiny GPTs:
    the single-device reference and the copy a pipeline takes."""
    import torch

    from meshpilot.models.gpt import GPT, gpt_tiny

    cfg = gpt_tiny(layers=4)
    torch.manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (4 * MICRO, cfg.seq))
    tgt = torch.randint(0, cfg.vocab, (4 * MICRO, cfg.seq))
    torch.manual_seed(1)
    ref = GPT(cfg)
    torch.manual_seed(1)
    return (idx, tgt), ref, GPT(cfg)


def _beside_single_device(pm, ref, inputs: tuple, ref_loss=None) -> dict:
    """STEPS AdamW steps of the pipeline `pm` on `inputs` beside the single-device model `ref` (its loss
    ``ref(*inputs)``, or ``ref_loss()``): per step |Δ loss| (on the last stage) and the largest gradient
    difference, the recorded collectives; the plans' counts, the schedule's sends and receives, the plans'
    mismatches."""
    import torch

    from meshpilot.runtime.collective_log import record_collectives

    params = dict(ref.named_parameters())
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_pp = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    res: dict = {"loss": [], "grad": [], "counts": [], "planned": pm.planned_counts(), "stage": pm.stage}
    res["names"], res["last"], res["p2p"] = len(pm.named_parameters()), pm.last, pm.scheduled_p2p()
    for _ in range(STEPS):
        o_ref.zero_grad()
        o_pp.zero_grad()
        l_ref = ref(*inputs) if ref_loss is None else ref_loss()
        l_ref.backward()
        with record_collectives(pm.mesh) as log:
            loss = pm.step(*inputs)
        if loss is not None:
            res["loss"].append(abs(loss.item() - l_ref.item()))
        res["grad"].append(
            max((params[n].grad - p.grad.full_tensor()).abs().max().item() for n, p in pm.named_parameters())
        )
        res["counts"].append(log.counts())
        o_ref.step()
        o_pp.step()
    res["mismatches"] = len(pm.mismatches)
    return res


EIGHT = {  # on 8 ranks, as INTRA
    "4 stages": (  # Megatron | data parallel | Megatron | searched, on meshes (1, 2), (2, 1), (1, 2), (1, 2)
        [((0, 3), (0, 1), (1, 2)), ((3, 4), (2, 3), (2, 1)), ((4, 5), (4, 5), (1, 2)), ((5, 8), (6, 7), (1, 2))],
        ("megatron_tp", "data_parallel", "megatron_tp", None),
        "1f1b",
    ),
    "2 stages interleaved": (  # 2 groups of 4 ranks on meshes (2, 2) and (1, 4), 2 chunks each
        [((0, 2), (0, 1, 2, 3), (2, 2)), ((2, 4), (4, 5, 6, 7), (1, 4))]
        + [((4, 6), (0, 1, 2, 3), (2, 2)), ((6, 8), (4, 5, 6, 7), (1, 4))],
        (None, None, None, None),
        "interleaved-1f1b",
    ),
}
EIGHT_RUNS = [("4 stages", "4 stages", False, False), ("2 stages interleaved", "2 stages interleaved", False, False)]
"""(result, plan, local all-gather?, zero bubble?): 1F1B on 4 stages, Interleaved1F1B on 2 groups (the local
all-gather and ZB-H1 are checked on 4 ranks: ``ZB``; an 8-rank run costs about 4x a 4-rank one on 2 cores).
Full only (212 CPU s in the last full run): what no 4-rank run has is a stage on a 2-D mesh, (2, 2), and 4
stages; the 4-rank runs have 3 stages, Interleaved1F1B's 4 chunks and the (2, 1) / (1, 2) meshes."""


def _plans(configs: dict) -> dict[str, str]:
    """`configs`' pipelines as saved JSON, each stage's intra-operator plan inside (planned in the parent)."""
    from meshpilot.planner import forced
    from meshpilot.planner.pipeline import fixed_pipeline

    model, inputs, graph = _tiny_gpt_graph()
    out = {}
    for name, (stages, kinds, kind) in configs.items():
        pp = fixed_pipeline(graph, "atp-ic3", stages, microbatches=4, schedule=kind)
        force = [
            getattr(forced, k)(model, inputs, shape, **({"graph": graph} if k == "megatron_tp" else {})) if k else None
            for k, (_, _, shape) in zip(kinds, stages)
        ]
        out[name] = pp.with_intra(graph, "atp-ic3", force=force).to_json()
    return out


def _bare_plans() -> dict[str, str]:
    """CONFIGS as saved pipeline plans without their stages' plans (``fixed_pipeline``; blocks 2 and 3, the
    final norm and the head in stage 1), which the runtime runs with data-parallel stage plans."""
    from meshpilot.planner.pipeline import fixed_pipeline

    out = {}
    for name in DP_RUNS:
        stage_ranks, kind, batch = CONFIGS[name]
        _, _, graph = _tiny_gpt_graph(batch // 4)
        stages = [((0, 4), tuple(stage_ranks[0]), (1, len(stage_ranks[0])))]
        stages += [((4, 8), tuple(stage_ranks[1]), (1, len(stage_ranks[1])))]
        out[name] = fixed_pipeline(graph, "atp-ic3", stages, microbatches=4, schedule=kind).to_json()
    return out


@pytest.fixture(scope="module")
def intra_plans() -> dict[str, str]:
    return _plans({name: cfg for name, cfg in INTRA.items() if name in INTRA_PLANNED})


@pytest.fixture(scope="module")
def eight_ranks() -> list[dict]:
    """The one 8-rank spawn: every EIGHT_RUNS pipeline, 3 steps each beside the single device."""
    return run_distributed(_run_intra, 8, _plans(EIGHT), EIGHT_RUNS, timeout=600, graphs=_gpt_graphs(MICRO))


def _saved_pipeline(tmp_path_factory, *args: str, stages: int = 2) -> str:
    """`meshpilot plan --pipeline -n 4 --stages STAGES ARGS --out pp.json`'s file: each stage's own plan inside."""
    from meshpilot.cli.main import main

    path = tmp_path_factory.mktemp("pp") / "pp.json"
    assert main(["plan", "--pipeline", "-n", "4", "--stages", str(stages), *args, "--out", str(path)]) == 0
    return path.read_text()


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory) -> str:
    """The MLP's pipeline of 2 stages on 4 devices."""
    return _saved_pipeline(tmp_path_factory, "-m", "mlp", "-c", "atp-ic3", "--microbatches", "4", "--batch", "16")


@pytest.fixture(scope="module")
def hf_plan(tmp_path_factory) -> str:
    """Hugging Face Llama's pipeline of 2 stages on 4 devices."""
    args = ["-m", "hf:llama", "--hf-config", *HF_LLAMA, "-c", "atp-ic3", "--batch", "8", "--seq", "16"]
    return _saved_pipeline(tmp_path_factory, *args)


@pytest.fixture(scope="module")
def moe_plan(tmp_path_factory) -> str:
    """Hugging Face Mixtral's pipeline of 2 stages on 4 devices."""
    args = ["-m", "hf:mixtral", "--hf-config", *HF_MIXTRAL, "-c", "atp-ic2", "--batch", "8", "--seq", "4"]
    return _saved_pipeline(tmp_path_factory, *args)


@pytest.fixture(scope="module")
def tied_plan(tmp_path_factory) -> str:
    """Hugging Face GPT-2's pipeline of 3 stages on 4 devices, its embedding tied to its LM head (the default)."""
    args = ["-m", "hf:gpt2", "--hf-config", *HF_GPT2, "-c", "atp-ic3", "--batch", "8", "--seq", "8"]
    return _saved_pipeline(tmp_path_factory, *args, stages=3)


def _one_stage(tmp_path_factory, model: str, config: list, seq: int) -> str:
    """`meshpilot plan -m MODEL -n 4 --mesh 2x2 --out one.json`'s file: a one-stage plan on the same 4 devices."""
    from meshpilot.cli.main import main

    path = tmp_path_factory.mktemp("one") / "one.json"
    args = ["plan", "-m", model, "--hf-config", *config, "-c", "atp-ic3", "-n", "4", "--mesh", "2x2"]
    assert main([*args, "--batch", "8", "--seq", str(seq), "--ops", "none", "--out", str(path)]) == 0
    return path.read_text()


@pytest.fixture(scope="module")
def hf_one_plan(tmp_path_factory) -> str:
    """Hugging Face Llama's one-stage plan on the same 4 devices (mesh 2x2)."""
    return _one_stage(tmp_path_factory, "hf:llama", HF_LLAMA, 16)


@pytest.fixture(scope="module")
def tied_one_plan(tmp_path_factory) -> str:
    """Hugging Face GPT-2's (tied) one-stage plan on the same 4 devices (mesh 2x2)."""
    return _one_stage(tmp_path_factory, "hf:gpt2", HF_GPT2, 8)


@pytest.fixture(scope="module")
def four_ranks(mlp_plan, intra_plans, moe_plan, tied_plan, tied_one_plan, tmp_path_factory, request):
    # Llama's plans only where its runs are (FOUR_RUNS: the full matrix)
    hf_plan = request.getfixturevalue("hf_plan") if FULL else None
    hf_one_plan = request.getfixturevalue("hf_one_plan") if FULL else None
    extra = (hf_one_plan, str(tmp_path_factory.mktemp("resumes")), tied_plan, tied_one_plan)
    graphs = _four_graphs(hf_plan, moe_plan, tied_plan, extra)
    return run_distributed(_worker, 4, mlp_plan, intra_plans, hf_plan, moe_plan, extra, timeout=900, graphs=graphs)


def _four_graphs(hf_plan: str | None, moe_plan: str, tied_plan: str, extra: tuple) -> dict:
    """The captures :func:`_worker`'s runs of FOUR_RUNS and INTRA_RUNS find in their rank, made here once (each
    rank traced each model: ~1-3 CPU s a model): the tiny GPT's, and each Hugging Face plan's by
    :func:`_hf_graph`'s own call. The MLP's pipeline still captures on its ranks (``pipeline_parallelize``
    without a graph: its own path)."""
    from meshpilot.planner.plan import Plan

    one_plan, _, _, tied_one_plan = extra
    hf = {  # run: (plans, model, config, seq), as _worker's runs call _hf_graph
        "hf-llama": ((hf_plan,), "hf:llama", HF_LLAMA, 16),
        "hf-mixtral": ((moe_plan,), "hf:mixtral", HF_MIXTRAL, 4),
        "resumes": ((hf_plan, one_plan), "hf:llama", HF_LLAMA, 16),
        "resumes-tied": ((tied_plan, tied_one_plan), "hf:gpt2", HF_GPT2, 8),
        "hf-gpt2-tied": ((tied_plan,), "hf:gpt2", HF_GPT2, 8),
        "tied-accumulated": ((tied_plan,), "hf:gpt2", HF_GPT2, 8),
    }
    graphs = _gpt_graphs(MICRO)
    for key in FOUR_RUNS:
        if key in hf:
            texts, model, config, seq = hf[key]
            for text in texts:
                _hf_graph(Plan.from_json(text), model, config, seq, into=graphs)
    return graphs


@pytest.fixture(scope="module")
def dp_ranks() -> list[dict]:
    """The 4-rank spawn of the plans without their stages' plans (CONFIGS) and the bad inputs."""
    rows = {CONFIGS[name][2] // 4 for name in DP_RUNS} | {8 // 4}  # the plans' microbatches, the uneven input's
    return run_distributed(_dp_worker, 4, _bare_plans(), timeout=900, graphs=_gpt_graphs(*sorted(rows)))


@pytest.mark.parametrize("name", params(CONFIGS, default=DP_DEFAULT))
def test_data_parallel_stages_equal_the_single_device(dp_ranks, name):
    """A plan without its stages' plans runs data-parallel stage plans made at the start, by the same runtime."""
    for rank, out in enumerate(dp_ranks):
        res = out[name]
        assert res["names"] > 0 and res["own_plans"] == "PlannedPipelineModule"
        assert max(res["grad"]) < 1e-5, (rank, res["grad"])
        if res["last"]:  # the last stage holds the loss
            assert len(res["loss"]) == STEPS and max(res["loss"]) < 1e-5, res["loss"]


@pytest.mark.parametrize(
    "kind", params([k.value for k in (PipelineKind.GPIPE, PipelineKind.ONE_F_ONE_B)], default=DP_DEFAULT)
)
def test_sends_receives_and_all_reduces_counted_equal_to_the_plans(dp_ranks, kind):
    from meshpilot.sharding.reshard import CollectiveKind

    boundary = 1 * 16 * 32 * 4  # batch 8 / 4 microbatches / 2 ranks: 1 sequence of 16 tokens x hidden 32, float32
    for out in dp_ranks:
        res = out[kind]
        for counts in res["counts"]:
            assert counts == res["planned"]
        assert res["p2p"] == {k: c for k, c in res["planned"].items() if k[1] == "pp"}
        got = res["counts"][0]
        assert got[(CollectiveKind.SEND, "pp", boundary)] == 4  # 4 microbatches cross the one boundary
        assert got[(CollectiveKind.RECV, "pp", boundary)] == 4
        n_reduce = sum(c for (k, a, _), c in got.items() if k == CollectiveKind.ALL_REDUCE and a != "pp")
        # the stage's gradients all-reduced once a step, a bucket (planner.buckets) at a time: at most one
        # all-reduce per parameter, at least one (the exact count is the plan's, checked above)
        assert 1 <= n_reduce <= res["names"]


def test_submeshes_of_different_sizes_exchange_tiles(dp_ranks):
    from meshpilot.sharding.reshard import CollectiveKind

    row = 16 * 32 * 4  # one sequence of 16 tokens x hidden 32, float32
    first, *rest = [out["1f1b-1+3"] for out in dp_ranks]
    for res in [first, *rest]:
        assert all(counts == res["planned"] for counts in res["counts"])
    # stage 0 (1 rank, 3 rows a microbatch) sends each of the 3 ranks of stage 1 its row, 4 microbatches
    assert first["counts"][0][(CollectiveKind.SEND, "pp", row)] == 12
    assert first["counts"][0][(CollectiveKind.RECV, "pp", row)] == 12
    assert not any(k == CollectiveKind.ALL_REDUCE for k, _, _ in first["counts"][0])  # one rank: nothing to sum
    for res in rest:
        assert res["counts"][0][(CollectiveKind.SEND, "pp", row)] == 4


def test_bad_input_is_refused_in_one_line(dp_ranks):
    out = dp_ranks[0]
    assert "equal shards" in out["uneven"] and "divisible by 4" in out["uneven"]
    assert "runs a Plan of stages, not a list" in out["split"]
    assert "+3.0" in out["action"] and "F, B, I, W, S, R and G" in out["action"]


def test_a_saved_pipeline_plan_runs_as_planned(four_ranks, mlp_plan):
    from meshpilot.planner.plan import Plan

    plan = Plan.from_json(mlp_plan)
    assert len(plan.stages) == 2 and len(plan.intra) == 2  # saved with each stage's own plan, run with it
    stage_of = {r: j for j, s in enumerate(plan.stages) for r in s.ranks}
    for rank, out in enumerate(four_ranks):
        res = out["planned-mlp"]
        assert res["stage"] == stage_of[rank]
        assert res["grad"] < 1e-5 and res["equal_counts"] and res["own_plans"] == "PlannedPipelineModule"


@pytest.mark.parametrize("name", params([run[0] for run in _ALL_INTRA_RUNS], default=INTRA_DEFAULT))
def test_stages_with_their_own_intra_plans_equal_the_single_device(four_ranks, name):
    _check_intra(four_ranks, INTRA[name.split("+")[0]][0], name)


@pytest.mark.full  # the 8-rank spawn: see EIGHT_RUNS
@pytest.mark.parametrize("name", [run[0] for run in EIGHT_RUNS])
def test_on_eight_ranks_stages_with_their_own_plans_equal_the_single_device(eight_ranks, name):
    """2 and 4 stages on meshes of 2 and 4 ranks of different shapes, under 1F1B and Interleaved1F1B:
    loss and gradients within 1e-5 over 3 steps, every collective as the plans say and every send and receive
    as the schedule's actions say."""
    _check_intra(eight_ranks, EIGHT[name.split("+")[0]][0], name)


def _check_intra(outs: list[dict], stages: list, name: str) -> None:
    for rank, out in enumerate(outs):
        res = out[name]
        assert res["stage"] == next(j for j, (_, ranks, _) in enumerate(stages) if rank in ranks)
        assert res["names"] > 0 and res["mismatches"] == 0
        assert max(res["grad"]) < 1e-5, (rank, res["grad"])
        assert res["last"] == (rank in stages[-1][1])
        if res["last"]:
            assert len(res["loss"]) == STEPS and max(res["loss"]) < 1e-5, res["loss"]
        for counts in res["counts"]:  # every collective, send and receive as the plans say, every step
            assert counts == res["planned"], (rank, counts - res["planned"], res["planned"] - counts)
            # and every send and receive as the schedule's S and R actions say
            assert +Counter({k: c for k, c in counts.items() if k[1] == "pp"}) == res["p2p"], rank


@pytest.mark.full  # Llama's runs: see FOUR_RUNS
def test_a_hugging_face_llama_pipeline_as_planned_equals_the_single_device(four_ranks, hf_plan):
    """A model nobody here wrote: HF's Llama, split by the planner (its layers found inside
    ``model.model.layers``, the cut before a decoder layer), each stage its own plan: HF's loss and every
    gradient within 1e-5 of the single device over 3 steps, every collective, send and receive as planned."""
    from meshpilot.planner.plan import Plan

    plan = Plan.from_json(hf_plan)
    assert len(plan.stages) == 2 and plan.stages[0].layers[0] == 0
    stages = [(st.layers, st.ranks, st.mesh_shape) for st in plan.stages]
    _check_intra(four_ranks, stages, "hf-llama")


def test_a_tied_embedding_and_head_in_stages_apart_equal_the_single_device(four_ranks, tied_plan):
    """HF GPT-2 (embedding tied to the LM head) in 3 stages: the first and the last hold a copy each, the
    head's part of the gradient stays in the last stage, and the parts are summed across the two after the
    step (an all-reduce over their ranks, counted with the full-tensor gathers it needs): loss and every
    gradient, the copies' included, within 1e-5 of one device over 3 steps, every collective as planned."""
    from meshpilot.planner.plan import Plan

    plan = Plan.from_json(tied_plan)
    assert len(plan.stages) == 3
    wte = "model.transformer.wte.weight"
    assert [any(name == wte for name, _ in p.params) for p in plan.intra] == [True, False, True]  # two copies
    _check_intra(four_ranks, [(st.layers, st.ranks, st.mesh_shape) for st in plan.stages], "hf-gpt2-tied")
    # two steps' gradients accumulated (no zero_grad between): each step's parts are summed once
    assert max(out["tied-accumulated"] for out in four_ranks) < 1e-5


def test_a_hugging_face_mixtral_pipeline_as_planned_equals_the_single_device(four_ranks, moe_plan):
    """HF's Mixtral (dropless top-2 MoE, meshpilot's MoE op) split into 2 stages by the planner: loss and every
    gradient within 1e-5 of the single device over 3 steps, every collective, send and receive as planned."""
    from meshpilot.planner.plan import Plan

    plan = Plan.from_json(moe_plan)
    assert len(plan.stages) == 2
    _check_intra(four_ranks, [(st.layers, st.ranks, st.mesh_shape) for st in plan.stages], "hf-mixtral")


@pytest.mark.parametrize("key", params(("resumes", "resumes-tied"), default=FOUR_DEFAULT))
def test_a_pipeline_checkpoint_resumes_under_the_same_plan_and_across_pipeline_and_one_stage(four_ranks, key):
    """HF Llama's pipeline (and GPT-2's of 3 stages, two of them holding the tied embedding: one copy is
    written, under both of its names as a one-stage run writes it) saves after step 2 — each rank its stages'
    DTensors and AdamW states, by the model's parameter names — and resumes for step 3: under the same
    pipeline, under a one-stage plan on the same ranks (the checkpoint of a pipeline read as one module's), and
    the one-stage plan's checkpoint under the pipeline; every rank sees the same losses, the resumed steps
    equal the run straight through."""
    for out in four_ranks:
        got = out[key]
        assert got == four_ranks[0][key]
        straight = got["straight"]
        assert len(straight) == 3
        assert max(abs(a - b) for a, b in zip(got["one saved"], straight)) < 1e-5
        saved = {"same plan": straight[:2], "pipeline to one": straight[:2], "one to pipeline": got["one saved"]}
        for run, source in saved.items():
            assert len(got[run]) == 3 and got[run][:2] == source, run  # steps 0-1: the step-2 checkpoint's logs
            assert abs(got[run][2] - straight[2]) < 1e-5, (run, got[run], straight)
        assert got["same plan"] == straight  # the same plan, the same state: the same numbers


def test_a_megatron_stage_beside_a_data_parallel_one(four_ranks, intra_plans):
    from meshpilot.planner.plan import Plan
    from meshpilot.sharding.reshard import CollectiveKind

    tp, dp = Plan.from_json(intra_plans["tp|dp"]).intra
    assert any("S(0)" in "".join(layout) for _, layout in tp.params)  # column-parallel weights: not data parallel
    assert all(set(layout) == {"R"} for _, layout in dp.params)
    row = 16 * 32 * 4  # one sequence of 16 tokens x hidden 32, float32
    for rank, out in enumerate(four_ranks):
        got = out["tp|dp"]["counts"][0]
        sends = {k: c for k, c in got.items() if k[0] == CollectiveKind.SEND}
        recvs = {k: c for k, c in got.items() if k[0] == CollectiveKind.RECV}
        if rank < 2:  # Megatron stage: replicated activations, each replica sends one of the 2 rows, 4 microbatches;
            # the gradients come back as batch rows from both data-parallel ranks
            assert sends == {(CollectiveKind.SEND, "pp", row): 4}
            assert recvs == {(CollectiveKind.RECV, "pp", row): 8}
            assert any(k[0] == CollectiveKind.ALL_REDUCE and k[1] != "pp" for k in got)  # row-parallel sums
        else:
            assert recvs == {(CollectiveKind.RECV, "pp", row): 4}
            assert sends == {(CollectiveKind.SEND, "pp", row): 8}


def test_train_refuses_what_it_cannot_run_for_a_pipeline_plan(intra_plans, tmp_path, capsys, monkeypatch):
    """`meshpilot train --plan pp.json`: the checks before any process group, one line each (no spawn)."""
    import json

    from meshpilot.cli.main import main

    path = tmp_path / "pp.json"
    path.write_text(intra_plans["tp|dp"])  # planned for a global batch of 8 in 4 microbatches of gpt_tiny(4)
    bare = tmp_path / "bare.json"  # the same stages without their plans: data-parallel stages
    doc = json.loads(intra_plans["tp|dp"])
    bare.write_text(json.dumps({**doc, "stages": [{**st, "plan": None} for st in doc["stages"]]}))
    other_model = ("stage 0", "different model or input shapes")  # the batch and sequence come from the plan;
    # the model does not: a wider one is not the one it was made for
    cases = [
        ("3", [], ("4 devices", "world size is 3", "--nproc-per-node 4")),
        ("4", ["--hidden", "64"], other_model),
        ("4", ["--plan", str(bare)], ("no stage plans", "microbatch of 1 rows", "stages of [2] ranks")),
    ]
    for world, extra, needles in cases:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", world)
        rc = main(["train", "--model", "gpt-tiny", "--layers", "4", "--plan", str(path), *extra])
        err = capsys.readouterr().err.strip()
        assert rc != 0 and len(err.splitlines()) == 1, err
        assert all(n in err for n in needles), err


def test_train_refuses_in_one_line_what_a_hugging_face_pipeline_cannot_run(hf_plan, tmp_path, capsys, monkeypatch):
    """`meshpilot train --plan pp.json --model hf:…`, before any process group: the Llama plan under another
    world size, the plan given another model, and a GPT-2 with dropout (HF's
    default 0.1), whose stages would draw random numbers in another order than one device."""
    from meshpilot.cli.main import main

    llama = tmp_path / "llama.json"
    llama.write_text(hf_plan)
    gpt2 = tmp_path / "gpt2.json"
    small = ["n_layer=2", "n_embd=32", "n_head=2", "vocab_size=128", "n_positions=16"]
    args = ["plan", "-m", "hf:gpt2", "--hf-config", *small, "-c", "atp-ic3", "-n", "4", "--pipeline"]
    assert main([*args, "--batch", "8", "--seq", "8", "--out", str(gpt2)]) == 0
    capsys.readouterr()
    llama_args = ["--model", "hf:llama", "--hf-config", *HF_LLAMA, "--plan", str(llama)]
    cases = [
        ("2", llama_args, ("4 devices", "world size is 2")),
        ("4", ["--model", "hf:llama", "--hf-config", *HF_LLAMA[:-1], "--plan", str(llama)], ("stage 0",)),
        ("4", ["--model", "hf:gpt2", "--hf-config", *small, "--plan", str(gpt2)], ("native_dropout", "dropout to 0")),
    ]
    for world, argv, needles in cases:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", world)
        rc = main(["train", *argv])
        err = capsys.readouterr().err.strip()
        assert rc != 0 and len(err.splitlines()) == 1, err
        assert all(n in err for n in needles), err


def test_train_takes_a_pipeline_plans_batch_and_sequence_from_the_plan(intra_plans):
    """As for a one-stage plan, `meshpilot train --plan pp.json` runs the shapes the plan was made for (stage 0's
    microbatch times the microbatches), not the built-in model's own batch of 4 (checked before any spawn)."""
    import argparse

    from meshpilot.cli.train import _prepare_gpt_plan
    from meshpilot.errors import UserError
    from meshpilot.models import gpt_config
    from meshpilot.planner.plan import Plan

    plan = Plan.from_json(intra_plans["tp|dp"])
    (b, t), _ = plan.intra[0].input_shapes[0]
    cfg = gpt_config("gpt-tiny", layers=4)
    assert cfg.batch == 4  # the built-in model's own
    for batch, seq in ((None, None), (8, 16)):  # --batch / --seq left out, or given as the plan has them
        args = argparse.Namespace(
            plan="pp.json", model="gpt-tiny", checkpoint_dir=None, precision=None, batch=batch, seq=seq
        )
        got = _prepare_gpt_plan(args, plan, cfg, plan.num_devices)["cfg"]
        assert (got.batch, got.seq) == (8, 16) == (b * plan.microbatches, t)
    args = argparse.Namespace(plan="pp.json", model="gpt-tiny", checkpoint_dir=None, precision=None, batch=4, seq=None)
    with pytest.raises(UserError, match=r"^--batch 4: --plan pp\.json was made for 8; leave --batch out"):
        _prepare_gpt_plan(args, plan, cfg, plan.num_devices)


def test_local_all_gather_halves_the_gradient_rows_crossing_meshes(four_ranks):
    """Alpa's local all-gather on the Megatron | data-parallel pipeline: the gradient boundary, replicated on
    the Megatron stage's 2 ranks, crosses once (each row to one of them) and is all-gathered there; the
    activations (batch rows on the receiving side) cross as before."""
    from meshpilot.sharding.reshard import CollectiveKind

    def sent(key: str) -> int:
        return sum(
            n * c for out in four_ranks for (k, _, n), c in out[key]["counts"][0].items() if k == CollectiveKind.SEND
        )

    row = 16 * 32 * 4
    plain, gathered = sent("tp|dp"), sent("tp|dp+gather")
    # per microbatch: 2 activation rows forward either way; gradients 2 rows x 2 replicas, or 2 rows once
    assert plain == 4 * (2 + 4) * row and gathered == 4 * (2 + 2) * row
    for rank in (0, 1):
        got = four_ranks[rank]["tp|dp+gather"]["counts"][0]
        assert got[(CollectiveKind.ALL_GATHER, "local", 2 * row)] == 4  # the 2 rows, gathered once a microbatch
        assert got[(CollectiveKind.RECV, "pp", row)] == 4


def test_tiles_and_the_local_all_gather_plan():
    """Pure: which rows each rank holds and which tiles cross, with and without the local all-gather."""
    from torch.distributed.tensor import Replicate, Shard

    from meshpilot.runtime.crossmesh import MeshSide, Tile, cross_bytes, gather_plan, rows_of, tiles

    R, S0 = Replicate(), Shard(0)
    assert rows_of(8, (2, 2), (S0, S0), (1, 0)) == (4, 6)  # nested: axis 0 halves, axis 1 halves again
    assert rows_of(8, (2, 2), (R, S0), (1, 1)) == (4, 8)
    one = MeshSide((0,), (1, 1), (R, R))
    three = MeshSide((1, 2, 3), (1, 3), (R, S0))
    assert tiles(6, one, three) == [Tile(0, 1, 0, 2), Tile(0, 2, 2, 4), Tile(0, 3, 4, 6)]
    # 2 replicas send to 4 receivers replicating over axis 0 and splitting rows over axis 1
    src = MeshSide((0, 1), (1, 2), (R, R))
    dst = MeshSide((2, 3, 4, 5), (2, 2), (R, S0))
    plain = tiles(4, src, dst)
    assert len(plain) == 4 and cross_bytes(plain, 1) == 8  # every receiver gets its 2 rows over the link
    gp = gather_plan(4, src, dst)
    assert gp.groups == ((2, 4), (3, 5))  # receivers holding the same rows
    assert cross_bytes(gp.tiles, 1) == 4  # each row crosses once
    assert {(t.dst, t.lo, t.hi) for t in gp.tiles} == {(2, 0, 1), (4, 1, 2), (3, 2, 3), (5, 3, 4)}


def test_the_zero_bubble_schedule_splits_each_backward_into_input_and_weight_work():
    """Pure: every stage runs I m before W m, sends its input gradient right after I, and the first stage runs
    each W at once while later stages delay theirs by their index (ZB-H1: the drain's I pass unblocked); in
    flight until I as under 1F1B, until W min(B, S) on every stage."""
    from meshpilot.planner.schedule import ActionKind, PipelineKind, held_until_weight, in_flight, pipeline, zero_bubble

    zb = zero_bubble([[0], [1, 2], [3]], 4)
    assert in_flight(zb) == in_flight(pipeline([[0], [1, 2], [3]], 4, PipelineKind.ONE_F_ONE_B))
    assert set(held_until_weight(zb).values()) == {3}
    for s, rc in enumerate(zb.classes):
        acts = list(rc.actions)
        kinds = [a.kind for a in acts]
        assert ActionKind.BACKWARD not in kinds and kinds[-1] == ActionKind.GRAD_SYNC
        for m in range(4):
            i = acts.index(next(a for a in acts if a.kind == ActionKind.BACKWARD_INPUT and a.microbatch == m))
            w = acts.index(next(a for a in acts if a.kind == ActionKind.BACKWARD_WEIGHT and a.microbatch == m))
            assert i < w
            if s > 0:
                assert acts[i + 1].kind == ActionKind.SEND  # the previous stage waits for it: sent before any W
        if s == 0:
            assert str(zb).splitlines()[1].startswith("ranks 0: F0 S0>1 F1 S1>1 F2 S2>1 R0<1 I0 W0 F3")
    assert "W0" in str(zb).splitlines()[3].split("I2")[1]  # the last stage holds its first W back two backwards


def test_runnable_layers_let_every_cut_of_the_gpt_pass_values_one_way():
    """Pure: at every cut of the tiny GPT's 8 layers the runtime's slices (``runnable_layers``) exchange forward
    values from stage 0 to 1 and gradients from 1 to 0 only; the planner's ``stage.layers`` puts the backward's
    running sum of the residual gradient in the last layer, which no pipeline can run, so the stage DP costs
    ``runnable_layers`` too."""
    from meshpilot.errors import UserError
    from meshpilot.planner.pipeline import runnable_layers
    from meshpilot.planner.stage import StagePlanner, layers, slice_graph
    from meshpilot.runtime.pipeline_stages import find_transfers

    _, _, graph = _tiny_gpt_graph()

    def transfers(all_layers, cut):
        slices = [slice_graph(graph, 0, cut, all_layers), slice_graph(graph, cut, len(all_layers), all_layers)]
        stage_of = {x: int(j >= cut) for j, layer in enumerate(all_layers) for x in layer.nodes}
        return find_transfers(graph, slices, stage_of)

    run = runnable_layers(graph)
    assert [x.name for x in run] == [x.name for x in layers(graph)]
    # the stage DP costs the slices the runtime runs: one function gives both their layers
    assert StagePlanner(graph, "atp-ic3").layers == run
    for cut in range(1, len(run)):
        found = transfers(run, cut)
        assert any(t.forward for t in found) and any(not t.forward for t in found), cut
        assert all((t.src, t.dst) == ((0, 1) if t.forward else (1, 0)) for t in found), cut
    with pytest.raises(UserError, match="reads .* of stage"):
        transfers(layers(graph), 3)


def test_forced_stages_receive_the_microbatch_rows_sharded():
    """Pure: a forced stage's received values carrying the microbatch's rows (``boundary:`` leaves) take the
    layout its force gives the model's inputs (``plan.received_rows_pins``): the data-parallel stages the runtime
    makes receive their batch rows sharded, not whole on each rank (a tie for the stage's ILP: replicated, the
    sender sends every row to both ranks, twice the bytes); a pattern naming the leaf keeps its layout."""
    from torch.distributed.tensor import Replicate, Shard

    from meshpilot.planner.plan import Plan, received_rows_pins
    from meshpilot.planner.stage import runnable_layers, slice_graph
    from meshpilot.runtime.pipeline import data_parallel_stages

    model, microbatch, graph = _tiny_gpt_graph()  # a microbatch of the gpipe configuration: 8 rows / 4
    dp = data_parallel_stages(Plan.from_json(_bare_plans()["gpipe"]), model, microbatch, graph, "atp-ic5:4")
    assert len(dp.transfers) == 2
    for x in dp.transfers:
        (value,) = x.values
        assert dp.intra[x.dst].node(f"boundary:{value}").out_placements(0) == (Replicate(), Shard(0)), x
    sub = slice_graph(graph, 4, 8, runnable_layers(graph))
    assert received_rows_pins(graph, sub, {"input:*": "RS(0)"}) == {"boundary:add_4:0": "RS(0)"}
    assert received_rows_pins(graph, sub, {"input:*": "RS(0)", "boundary:*": "RR"}) == {}
    for other in ("RS(1)", "RR"):  # inputs not pinned as batch rows: nothing to follow
        assert received_rows_pins(graph, sub, {"input:*": other}) == {}
