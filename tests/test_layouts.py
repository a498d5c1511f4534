"""Layout changes the trace never saw: views on whatever layout a plan leaves, and BatchNorm's statistics.

* **Views.** The captured graph records ``reshape``/``contiguous`` as views with the strides fake tensors had;
  a plan that gathers or reshards a tensor changes the strides its shards really have. :class:`ViewStress`
  transposes, reshapes, permutes, ``contiguous()``s, splits, expands, slices, selects and squeezes between
  linears; every view-like op the zoo and the Hugging Face models use is among them (checked on their
  graphs), and the plans below put different layouts around every one of those views (checked too). Each
  plan must run exactly (loss and gradients within 1e-5 of one device over 3 AdamW steps) with the planned
  collectives. Then every strict view of every plan runs once more on its planned layout with the shard
  stored in other strides than the trace saw: the result must equal one device's view, which for some views
  takes a contiguous copy (reshape semantics; the graph is functional, so nothing writes through views).
* **BatchNorm.** A conv net with ``BatchNorm2d`` in train mode, its batch sharded on 2×2, 4×1 and 1×4 (data
  parallel, ZeRO-3 and the solver's plan): the running statistics and ``num_batches_tracked`` equal the
  single device's after each of 3 steps, with the batch statistics' all-reduces planned and counted.

One spawn of 4 gloo processes runs both. That is the full matrix (``MESHPILOT_TEST_FULL=1``); the default tier
plans and runs both on (2, 2) alone (``MESHES``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from dist_utils import cached_graph, run_distributed
from tiers import matrix
from torch import nn

TOL = 1e-5
STEPS = 3
# The tiers (tests/tiers.py): the default plans and runs both models on the mixed (2, 2) mesh alone (every kind
# of plan, the three shuffled layouts, BatchNorm's statistics reduced over both axes); the full matrix adds the
# pure meshes (4, 1) and (1, 4). CPU s of the file (ranks included, 2-core AMD EPYC): 327 in the last full-matrix
# run, 58 in the default tier (5 passed).
MESHES = matrix([(2, 2)], [(4, 1), (2, 2), (1, 4)])
CLUSTER = "atp-ic3"
VIEW_OPS = {
    "aten.view.default",
    "aten._unsafe_view.default",
    "aten.transpose.int",
    "aten.permute.default",
    "aten.t.default",
    "aten.expand.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.split.Tensor",
    "aten.alias.default",
    "aten.detach.default",
}


class ViewStress(nn.Module):
    """Linears with every kind of view between them (shape comments: b=8 batch, s=4 tokens, h=16 features)."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(h, 2 * h)
        self.b = nn.Linear(h, h)
        self.c = nn.Linear(4 * h, h)
        self.d = nn.Linear(h, h, bias=False)
        self.scale = nn.Parameter(torch.ones(1, h))
        self.head = nn.Linear(h, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        bsz, s, h = x.shape  # [8, 4, 16]
        u, v = self.a(x).split(h, dim=-1)  # [8, 4, 16] each
        t = u.transpose(1, 2).contiguous().view(bsz, h, s)  # [8, 16, 4]
        w = self.b(t.permute(0, 2, 1).reshape(bsz * s, h)).view(bsz, s, h)  # [8, 4, 16]
        z = (w + v).unsqueeze(2).expand(bsz, s, 2, h).reshape(bsz, s, 2 * h)  # [8, 4, 32]
        z = torch.cat([z, z.flip(-1)], dim=-1).reshape(bsz * s, 4 * h)  # [32, 64]
        r = self.c(z).view(bsz, s, h)[:, 1:, :]  # [8, 3, 16]
        q = self.d(r.transpose(0, 1).reshape(-1, h)).view(s - 1, bsz, h).transpose(0, 1)  # [8, 3, 16]
        first = q.select(1, 0)[:, :] * self.scale.squeeze(0)  # [8, 16] (a full slice is an alias)
        pooled = first + q.mean(1).view(bsz, 1, h).squeeze(1)  # [8, 16]
        return F.cross_entropy(self.head(pooled.t().contiguous().t()), y)


class BNNet(nn.Module):
    """conv → BatchNorm2d → ReLU → conv → BatchNorm2d → ReLU → mean pool → linear."""

    def __init__(self, c: int = 16, classes: int = 8) -> None:
        super().__init__()
        # no bias before BatchNorm (it cancels; its gradient is float noise, which Adam would amplify)
        self.conv1, self.bn1 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, img: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(img)))
        x = F.relu(self.bn2(self.conv2(x)))
        return F.cross_entropy(self.fc(x.mean((2, 3))), y)


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "views":
        return ViewStress(), (torch.randn(8, 4, 16, generator=g), torch.randint(0, 8, (8,), generator=g))
    return BNNet(), (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 8, (8,), generator=g))


# ------------------------------------------------------------------------------------------ planning


def _shuffled_layouts(model: nn.Module, shape: tuple[int, int], seed: int) -> dict[str, str]:
    """Every parameter pinned to a layout drawn at random from its even layouts on `shape` (inputs free)."""
    from meshpilot.sharding.placements import candidate_placements, fmt

    rng = torch.Generator().manual_seed(seed)
    force = {}
    for name, p in model.named_parameters():
        options = candidate_placements(tuple(p.shape), shape)
        force[name] = fmt(options[int(torch.randint(len(options), (1,), generator=rng))])
    return force


def make_plans(graphs: dict | None = None) -> dict:
    """Every plan of the module; `graphs` gets the captures they were made on, under :func:`_worker`'s keys."""
    from meshpilot.graph.capture import capture
    from meshpilot.planner.auto import plan
    from meshpilot.planner.forced import forced

    plans = {}
    for name, kinds in (("views", ("solver", "data_parallel", "megatron_tp", "zero3", "shuffled")),):
        model, inputs = build(name)
        graph = capture(model, inputs)
        if graphs is not None:
            graphs[("layouts", name)] = graph
        for shape in MESHES:
            for kind in kinds:
                seeds = range(3) if kind == "shuffled" else [None]
                for seed in seeds:
                    if kind == "solver":
                        force = None
                    elif kind == "shuffled":
                        force = _shuffled_layouts(model, shape, seed + 10 * shape[0])
                    else:
                        force = forced(
                            kind, model, inputs, shape, **({"graph": graph} if kind == "megatron_tp" else {})
                        )
                    key = (name, shape, kind if seed is None else f"{kind}{seed}")
                    plans[key] = plan(model, inputs, CLUSTER, mesh_shape=shape, force=force, graph=graph)
    model, inputs = build("bn")
    graph = capture(model, inputs)
    if graphs is not None:
        graphs[("layouts", "bn")] = graph
    for shape in MESHES:
        # on fast links the solver may rather gather the batch around BatchNorm (exact too); the forced plans
        # also pin BatchNorm to the sharded batch, so its statistics are reduced across ranks
        batch = "".join("S(0)" if n > 1 else "R" for n in shape)
        for kind in ("solver", "data_parallel", "zero3"):
            force = None
            if kind != "solver":
                force = {**forced(kind, model, inputs, shape), "_native_batch_norm_legit_functional*": batch}
            plans[("bn", shape, kind)] = plan(model, inputs, CLUSTER, mesh_shape=shape, force=force, graph=graph)
    return plans


@pytest.fixture(scope="module")
def planned() -> tuple[dict, dict]:
    """The plans and the captures they were made on (the ranks run on these: each traced the models again)."""
    graphs: dict = {}
    return make_plans(graphs), graphs


@pytest.fixture(scope="module")
def plans(planned):
    return planned[0]


def test_the_stress_model_has_every_view_the_zoo_and_hf_models_use():
    """The view-like ops of the zoo's and the HF models' graphs all occur in ViewStress."""
    from meshpilot.graph.capture import capture
    from meshpilot.models import zoo
    from meshpilot.models.gpt import GPT, gpt_tiny

    used: set[str] = set()
    graphs = [capture(GPT(gpt_tiny(batch=4, seq=8)), (torch.zeros(4, 8, dtype=torch.long),) * 2)]
    bert = zoo.BertEncoder(vocab=64, seq=8, hidden=32, heads=8, layers=1)
    graphs.append(capture(bert, (torch.zeros(4, 8, dtype=torch.long),) * 2))
    try:
        from test_hf_models import ALL_MODELS as MODELS  # every HF model, in both tiers: captures only
        from test_hf_models import build as build_hf
    except ImportError:  # transformers missing: the zoo alone
        MODELS = ()
    graphs += [capture(*build_hf(name)) for name in MODELS]
    for g in graphs:
        used |= {n.target for n in g.nodes if n.is_view and n.kind == "op"}
    stress = {n.target for n in capture(*build("views")).nodes if n.is_view}
    assert used <= VIEW_OPS | {"aten.lift_fresh.default"}, used - VIEW_OPS
    assert (used & VIEW_OPS) - {"aten.lift_fresh.default"} <= stress, (used & VIEW_OPS) - stress


def test_plans_put_different_layouts_around_every_view(plans):
    """For every kind of view in ViewStress, its operand arrives in several layouts across the plans, at least
    one of them sharded."""
    seen: dict[str, set] = {}
    for (name, _, _), p in plans.items():
        if name != "views":
            continue
        for n in p.nodes:
            if n.kind == "op" and n.target in VIEW_OPS and n.ins:
                seen.setdefault(n.target, set()).add((p.mesh_shape, n.ins[0]))
    assert set(seen) >= VIEW_OPS - {"aten.detach.default"}, VIEW_OPS - set(seen)
    few = {t: v for t, v in seen.items() if len({lay for _, lay in v}) < 2 or all(set(lay) == {"R"} for _, lay in v)}
    assert not few, few


def test_batchnorm_is_batch_sharded_with_its_statistics_reduced(plans):
    for shape, kind in itertools.product(MESHES, ("data_parallel", "zero3")):
        p = plans[("bn", shape, kind)]
        bn = [n for n in p.nodes if n.target == "aten._native_batch_norm_legit_functional.default"]
        assert bn and all(n.source == "meshpilot" for n in bn)
        assert all("S(0)" in "".join(n.ins[0]) for n in bn)  # the batch is sharded through BatchNorm
        in_op = [c for c in p.collectives if c.src == c.dst and c.src in {n.name for n in bn}]
        axes = [a for a, k in enumerate(shape) if k > 1]
        assert len(in_op) == 2 * len(bn) * len(axes)  # mean, then centred sum of squares, per sharding axis


# ------------------------------------------------------------------------------------------ 4 ranks


def _run(name: str, plan_json: str, graph) -> dict:
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.spmd import parallelize

    plan = StagePlan.from_json(plan_json)
    ref, inputs = build(name)
    model, _ = build(name)
    pm = parallelize(model, plan, graph=graph)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
    o_par = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
    planned = plan.collective_counts(backend="gloo")
    res: dict = {"loss": [], "grad": [], "buffer": [], "counts_equal": []}
    for _ in range(STEPS):
        o_ref.zero_grad()
        o_par.zero_grad()
        l_ref = ref(*inputs)
        l_ref.backward()
        with record_collectives(pm.mesh) as log:
            loss = pm(*inputs)
            loss.backward()
        res["loss"].append(abs(loss.item() - l_ref.item()))
        pairs = zip(ref.parameters(), model.parameters())
        whole = [(a.grad, b.grad.full_tensor() if hasattr(b.grad, "full_tensor") else b.grad) for a, b in pairs]
        res["grad"].append(max((x - y).abs().max().item() for x, y in whole))  # a DP plan's are plain
        bufs = [(a.float() - b.float()).abs().max().item() for a, b in zip(ref.buffers(), model.buffers())]
        res["buffer"].append(max(bufs or [0.0]))
        res["counts_equal"].append(log.counts() == planned)
        o_ref.step()
        o_par.step()
    res["mismatches"] = list(pm.mismatches)
    if name == "views":
        res["strict_views"] = _strict_views_on_other_strides(pm)
    return res


def _strict_views_on_other_strides(pm) -> tuple[int, int, float]:
    """Every ``view`` / ``_unsafe_view`` node of the plan run on its planned operand layout but with the local
    shard stored column-major (strides the trace never saw): (views run, views that needed a contiguous copy,
    largest difference from the single-device view)."""
    from torch.distributed.tensor import DTensor

    from meshpilot.runtime.interpret import to_dtensor

    interp = pm.interpreter
    ran, worst = 0, 0.0
    before = interp.copied_views
    for node in pm.graph.nodes:
        if node.target not in ("aten.view.default", "aten._unsafe_view.default"):
            continue
        src, i = node.inputs[0]
        info = pm.graph[src].outputs[i]
        if info is None or len(info.shape) < 2 or not info.dtype.startswith("float"):
            continue
        x = torch.randn(info.shape, generator=torch.Generator().manual_seed(node.index))
        held = to_dtensor(x, pm.mesh, pm.plan.node(node.name).in_placements(0))
        local = held._local_tensor
        odd = local.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
        env = {src: tuple(DTensor(odd, held._spec, requires_grad=False) if k == i else None for k in range(i + 1))}
        out = interp.call(node, env)[0]
        want = x.view(node.fx_node.meta["val"].shape)
        worst = max(worst, (out.full_tensor() - want).abs().max().item())
        ran += 1
    return ran, interp.copied_views - before, worst


def _worker(jobs: list[tuple[str, str, str]]) -> dict:
    from meshpilot.graph.capture import capture

    out = {}
    for job, name, plan_json in jobs:
        # one capture per model, the parent's (make_plans: the same call on the same build)
        graph = cached_graph(("layouts", name), lambda: capture(*build(name)))  # noqa: B023 - called here
        out[job] = _run(name, plan_json, graph)
    return out


@pytest.fixture(scope="module")
def runs(planned):
    plans, graphs = planned
    jobs = [(repr(k), k[0], p.to_json()) for k, p in plans.items()]
    return run_distributed(_worker, 4, jobs, timeout=900, graphs=graphs)


def _results(runs, name: str):
    for rank in runs:
        for job, r in rank.items():
            if job.startswith(f"('{name}'"):
                yield job, r


@pytest.mark.dist
@pytest.mark.slow
def test_views_run_exactly_under_every_layout(runs):
    copied = 0
    for job, r in _results(runs, "views"):
        assert max(r["loss"]) <= TOL, (job, r["loss"])
        assert max(r["grad"]) <= TOL, (job, r["grad"])
        assert all(r["counts_equal"]), job
        assert not r["mismatches"], (job, r["mismatches"][:3])
        ran, copies, worst = r["strict_views"]
        assert ran >= 4 and worst == 0.0, (job, r["strict_views"])
        copied += copies
    assert copied > 0  # some views could not be served by the strides held: they ran on a contiguous copy


@pytest.mark.dist
@pytest.mark.slow
def test_batchnorm_running_statistics_equal_single_device(runs):
    jobs = list(_results(runs, "bn"))
    assert len(jobs) == 4 * len(MESHES) * 3
    for job, r in jobs:
        assert max(r["loss"]) <= TOL, (job, r["loss"])
        assert max(r["grad"]) <= TOL, (job, r["grad"])
        assert max(r["buffer"]) <= TOL, (job, r["buffer"])  # running_mean, running_var, num_batches_tracked
        assert all(r["counts_equal"]), job
