"""HiDup's duplex schedule run for real on 4 and 8 gloo ranks (issue 11).

The plan of each model is made with ``microbatches=2, duplex=True``; its step runs both microbatches'
forward (and then backward) as one program interleaved stage by stage (``meshpilot.runtime.duplex``).
Semantics are gradient accumulation over the two microbatches: BatchNorm normalises each microbatch by its
own batch statistics and updates the running statistics once per microbatch, in order; an MoE's capacity
applies to each microbatch's tokens. The single-device reference runs the same two microbatches one after
the other with ``loss / 2`` each (``test_models_parallel._reference``'s semantics), and every rank checks at
each of 2 AdamW steps (the first records, the second runs the interleaved programs): loss, gradients,
parameters (and BatchNorm's buffers) within 1e-5; the collectives issued equal the plan's; the interleaved
program holds collectives with the other microbatch's compute between issue and wait. Duplex off (the same
strategies under ``accumulate``) runs too for the BatchNorm net: equal to duplex. Hugging Face's Mixtral
(dropless experts, expert-parallel) runs on 4 ranks: without capacity its microbatches change nothing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import cached_graph, run_distributed
from test_models_parallel import ADAMW, TOL, _max_err
from test_models_parallel import build as zoo_build
from test_moe_dropless import _check_counts as check_routed_counts
from tiers import params
from torch import nn

STEPS = 2  # step 1 records the one-microbatch programs, step 2 runs the interleaved ones (after an AdamW step)
MESH = {4: (2, 2), 8: (2, 4)}
# mixtral: HF Mixtral's dropless experts, expert-parallel on (2, 2) (test_moe_dropless's BIG sizes): no capacity,
# so its two microbatches give what the whole batch gives; on 4 ranks only (the suite's time)
# on 8 ranks the GPT alone (heads over a (2, 4) mesh): the MoE's duplex on 8 ranks is its 4-rank schedule with
# more experts a group, and an 8-rank run costs about 4x a 4-rank one on 2 cores
MODELS = {4: ("gpt", "moe", "bn", "mixtral"), 8: ("gpt",)}
# duplex off (accumulate, same strategies) beside duplex on: the BatchNorm net and Mixtral, whose expert-parallel MoE
# runs in the same steps either way (test_models_parallel runs the GPT and the MoE under accumulate already)
OFF = {4: ("bn", "mixtral"), 8: ()}
# BatchNorm's plan counts an all-gather into the BatchNorm and one into the mean after it that the runtime issues
# once (with any schedule, one microbatch too: a planner-side count, not duplex's); its duplex run is checked to
# issue what duplex off issues
COUNT_AS_OFF = ("bn",)
# the experts' all-to-alls move as many rows as the routing sends: compared by count per rank and by bytes over
# all ranks (test_moe_dropless's check)
ROUTED = ("mixtral",)


class BNNet(nn.Module):
    """conv -> BatchNorm -> ReLU -> conv -> BatchNorm -> mean pool -> classifier: batch statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return nn.functional.cross_entropy(self.head(x.mean(dim=(2, 3))), labels)


def build(name: str):
    if name == "bn":
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        return BNNet(), (torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 8, (8,), generator=g))
    if name == "mixtral":
        from test_moe_dropless import BIG
        from test_moe_dropless import build as mixtral_build

        return mixtral_build(BIG)
    return zoo_build(name)


def _capture(model, inputs):
    """The capture a model's plans are made and run on: at one of its two microbatches."""
    from meshpilot.graph.capture import capture

    return capture(model, [x.chunk(2)[0] for x in inputs])


def make_plans(world: int, graphs: dict | None = None) -> dict:
    """Each model's duplex plan (and the accumulating one of OFF); `graphs` gets the captures they were made on,
    by :func:`_worker`'s ``cached_graph`` keys."""
    from meshpilot.planner.auto import plan
    from meshpilot.planner.schedule import accumulate

    plans = {}
    for name in MODELS[world]:
        model, inputs = build(name)
        graph = _capture(model, inputs)
        if graphs is not None:
            graphs[("duplex", name)] = graph
        p = plan(model, inputs, "atp-ic3", mesh_shape=MESH[world], graph=graph, microbatches=2, duplex=True)
        plans[(name, "on")] = p
        if name in OFF[world]:
            plans[(name, "off")] = dataclasses.replace(p, schedule=accumulate(world, 2))
    return plans


def _reference(name: str) -> list[dict]:
    """Single device, the two microbatches one after the other (module docstring)."""
    model, inputs = build(name)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    chunks = [x.chunk(2) for x in inputs]
    out = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        losses = []
        for m in range(2):
            part = model(*[c[m] for c in chunks])
            (part / 2).backward()
            losses.append(part.detach())
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append(
            {
                "loss": torch.stack(losses).mean().item(),
                "grads": grads,
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
            }
        )
    return out


def _worker(jobs: list[tuple[str, str, str]]) -> dict:
    from meshpilot.graph.capture import Phase
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.collective_log import record_collectives
    from meshpilot.runtime.duplex import overlapped_collectives
    from meshpilot.runtime.spmd import parallelize

    out: dict = {}
    refs: dict = {}
    for job, name, plan_json in jobs:
        plan = StagePlan.from_json(plan_json)
        ref = refs.setdefault(name, _reference(name))
        model, inputs = build(name)
        # one capture per model, its duplex plan's and its accumulating one's: the parent's (make_plans)
        graph = cached_graph(("duplex", name), lambda: _capture(model, inputs))  # noqa: B023 - called here
        pm = parallelize(model, plan, graph=graph)
        names = [n for n, _ in model.named_parameters()]
        opt = torch.optim.AdamW(pm.parameters(), **ADAMW)
        res: dict = {"loss": [], "grad": [], "param": [], "buffer": [], "counts": [], "losses": []}
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            with record_collectives(pm.mesh) as log:
                loss = pm(*inputs)
                loss.backward()
            res["counts"].append({ph: log.counts(ph) for ph in (Phase.FWD, Phase.BWD)})
            params = dict(zip(names, pm.parameters()))
            res["losses"].append(loss.item())
            res["loss"].append(abs(loss.item() - ref[step]["loss"]))
            res["grad"].append(_max_err((n, ref[step]["grads"][n], p.grad) for n, p in params.items())[0])
            opt.step()
            res["param"].append(_max_err((n, ref[step]["params"][n], p.detach()) for n, p in params.items())[0])
            res["buffer"].append(
                max(
                    [(b.float() - ref[step]["buffers"][n].float()).abs().max().item() for n, b in model.named_buffers()]
                    or [0.0]
                )
            )
        prog = pm.program
        res["overlapped"] = {
            "fwd": overlapped_collectives(prog.forward_pair_gm) if prog.forward_pair_gm is not None else -1,
            "bwd": overlapped_collectives(prog.backward_pair_gm) if prog.backward_pair_gm is not None else -1,
        }
        res["moe_order"] = {"fwd": _moe_order(prog.forward_pair_gm), "bwd": _moe_order(prog.backward_pair_gm)}
        out[job] = res
    out["groups"] = _group_order(pm.mesh)
    return out


def _group_order(mesh) -> dict:
    """Per mesh axis: the gloo worker threads of this rank's group, and whether collectives issued on it
    complete in issue order — a 16 MiB all-reduce, then a 4-byte one right after it, both asynchronous: when
    the small one has completed, has the large one? (gloo's default pool of two threads runs both at once,
    and the small one ends first; ``runtime.groups``)."""
    import torch.distributed as dist

    out: dict = {}
    for axis in range(mesh.ndim):
        pg = mesh.get_group(axis)
        backend = pg._get_backend(torch.device("cpu"))
        in_order = None
        if dist.get_world_size(pg) > 1:
            big, small = torch.ones(4 << 20), torch.ones(1)
            first = dist.all_reduce(big, group=pg, async_op=True)
            second = dist.all_reduce(small, group=pg, async_op=True)
            second.wait()
            in_order = first.is_completed()
            first.wait()
        out[axis] = {"threads": backend.options._threads, "in_order": in_order}
    return out


def _moe_order(gm) -> list[tuple[str, int]]:
    """``(step, microbatch)`` of the expert-parallel MoE's kernels (``meshpilot.ops.moe``: ``dispatch``,
    ``experts``, ``combine``, …) and of the waits on its all-to-alls (``wait_dispatch``, ``wait_combine``), in
    the order of an interleaved program (empty without one)."""
    from meshpilot.runtime.duplex import MICROBATCH

    out: list[tuple[str, int]] = []
    for n in gm.graph.nodes if gm is not None else ():
        target = str(n.target)
        if target.startswith("meshpilot.moe_ep_"):
            out.append((target.split(".")[1].removeprefix("moe_ep_"), n.meta.get(MICROBATCH)))
        elif "wait_tensor" in target and str(n.args[0].target).startswith("meshpilot.moe_ep_"):
            out.append(("wait_" + str(n.args[0].target).split(".")[1].removeprefix("moe_ep_"), n.meta.get(MICROBATCH)))
    return out


# 8 ranks (the GPT on (2, 4): 65 CPU s on a 2-core AMD EPYC) in the full matrix only (tests/tiers.py)
@pytest.fixture(scope="module", params=params(sorted(MESH), default=[4]), ids=lambda w: f"world{w}")
def runs(request):
    world = request.param
    graphs: dict = {}  # the planning's captures, for the ranks: each traced every model again (~1-3 CPU s each)
    plans = make_plans(world, graphs)
    jobs = [(f"{k[0]}-{k[1]}", k[0], p.to_json()) for k, p in plans.items()]
    return world, plans, run_distributed(_worker, world, jobs, timeout=600, graphs=graphs)


def test_duplex_equals_single_device_with_microbatch_semantics(runs):
    world, plans, results = runs
    for rank, res in enumerate(results):
        for (name, mode), plan in plans.items():
            r = res[f"{name}-{mode}"]
            where = f"rank {rank}/{world} {name} duplex {mode}"
            for key in ("loss", "grad", "param", "buffer"):
                assert max(r[key]) <= TOL, f"{where}: {key} differs by {max(r[key]):.2e}"
            for step, counts in enumerate(r["counts"]):
                for ph, got in counts.items():
                    if name in ROUTED:
                        continue  # below: over all ranks
                    if name in COUNT_AS_OFF:
                        assert got == res[f"{name}-off"]["counts"][step][ph], f"{where} step {step} {ph}"
                    else:
                        assert got == plan.collective_counts(str(ph), backend="gloo"), f"{where} step {step} {ph}"

    for (name, mode), plan in plans.items():
        if name not in ROUTED:
            continue
        job = f"{name}-{mode}"
        for step in range(STEPS):
            for ph in results[0][job]["counts"][step]:
                per_rank = [list(res[job]["counts"][step][ph].items()) for res in results]
                check_routed_counts(per_rank, plan.collective_counts(str(ph), backend="gloo"))


def test_duplex_runs_interleaved_and_overlaps_collectives(runs):
    """The step ran the two-microbatch program (recorded on step 1), in which collectives of one microbatch
    have the other's compute between issue and wait, in the forward and the backward (where the schedule
    interleaves it: a backward without resharding edges, as the BatchNorm net's, is one stage)."""
    from meshpilot.planner.schedule import ActionKind, interleaved

    world, plans, results = runs
    for (name, mode), plan in plans.items():
        r = results[0][f"{name}-{mode}"]
        if mode == "off":
            assert r["overlapped"] == {"fwd": -1, "bwd": -1}
            continue
        acts = plan.step_schedule().actions(0)
        assert plan.step_schedule().name == "duplex"
        # every forward has collectives to interleave: Mixtral's too, since the expert-parallel MoE runs in steps
        # with its all-to-alls between them (docs/moe.md, "Under duplex")
        assert interleaved(acts, ActionKind.FORWARD), f"{name} on {world}"
        assert r["overlapped"]["fwd"] > 0, f"{name} on {world}: {r['overlapped']}"
        if interleaved(acts, ActionKind.BACKWARD):
            assert r["overlapped"]["bwd"] > 0, f"{name} on {world}: {r['overlapped']}"
        else:
            assert r["overlapped"]["bwd"] == -1 and name == "bn", f"{name} on {world}: {r['overlapped']}"


def test_duplex_issues_one_microbatchs_all_to_all_before_the_others_experts(runs):
    """The expert-parallel MoE under duplex, in the order of the interleaved programs each rank ran: microbatch
    1's dispatch is issued before microbatch 0's experts compute and waited only after them; microbatch 0's
    combine is issued before microbatch 1's experts and waited after them (forward and backward)."""
    world, plans, results = runs
    checked = 0
    for name, mode in plans:
        if name not in ROUTED or mode != "on":
            continue
        for rank, res in enumerate(results):
            for ph, experts in (("fwd", "experts"), ("bwd", "experts_backward")):
                order = res[f"{name}-{mode}"]["moe_order"][ph]
                at = {step: k for k, step in enumerate(order)}
                assert len(at) == len(order) == 14, f"rank {rank} {ph}: {order}"  # one MoE layer, 7 kernels per mb
                where = f"rank {rank}/{world} {name} {ph}: {order}"
                assert at[("dispatch", 1)] < at[(experts, 0)] < at[("wait_dispatch", 1)], where
                assert at[("combine", 0)] < at[(experts, 1)] < at[("wait_combine", 0)], where
                checked += 1
    assert checked == (2 * world if "mixtral" in MODELS[world] else 0)


def test_mesh_groups_run_one_collective_at_a_time(runs):
    """The plan's mesh groups on gloo have one worker thread, so a collective issued after another on the same
    group completes after it (the order the simulator and duplex's schedule assume; ``runtime.groups``)."""
    world, plans, results = runs
    for rank, res in enumerate(results):
        for axis, g in res["groups"].items():
            assert g["threads"] == 1, f"rank {rank} axis {axis}: {g}"
            assert g["in_order"] in (True, None), f"rank {rank} axis {axis}: the later collective ended first"
        assert any(g["in_order"] for g in res["groups"].values()), f"rank {rank}: no axis with 2+ ranks checked"


def test_gloo_threads_setting(monkeypatch):
    from meshpilot.errors import UserError
    from meshpilot.runtime import groups

    monkeypatch.delenv(groups.THREADS_ENV, raising=False)
    assert groups._threads() == 1
    monkeypatch.setenv(groups.THREADS_ENV, "2")
    assert groups._threads() == 2
    for bad in ("two", "0"):
        monkeypatch.setenv(groups.THREADS_ENV, bad)
        with pytest.raises(UserError, match=f"MESHPILOT_GLOO_THREADS={bad!r}: give a whole number"):
            groups._threads()


def test_duplex_off_gives_the_same_step(runs):
    world, plans, results = runs
    for name, mode in plans:
        if mode == "off":
            on, off = results[0][f"{name}-on"], results[0][f"{name}-off"]
            assert max(abs(a - b) for a, b in zip(on["losses"], off["losses"])) <= 1e-6


def test_trace_overlap_by_hand():
    """One program: compute 0-0.1, a collective issued at 0.1, compute until its wait at 0.3, blocked until
    0.5, compute until 0.6; a second collective whose wait does not block (in flight at most 0.55-0.58)."""
    from meshpilot.runtime.duplex import trace_overlap

    events = [
        ("begin", -1, 0.0),
        ("issue", 0, 0.1),
        ("wait", 0, 0.3),
        ("waited", 0, 0.5),
        ("issue", 1, 0.55),
        ("wait", 1, 0.58),
        ("waited", 1, 0.58),
        ("end", -1, 0.6),
    ]
    split = trace_overlap(events)
    assert split["compute_s"] == pytest.approx(0.4) and split["comm_s"] == pytest.approx(0.43)
    assert split["overlap_s"] == pytest.approx(0.23) and split["ratio"] == pytest.approx(0.23 / 0.4)
    assert split["bounded"] == 1
    # the lower bound: the second collective may have ended at once; the first was in flight 0.1-0.5
    assert split["overlap_low_s"] == pytest.approx(0.2) and split["ratio_low"] == pytest.approx(0.2 / 0.4)


def _program(body):
    """A hand-built program ``x -> ...`` (never run: fx nodes only) around one all-reduce of ``x + 1``."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.add.Tensor, (x, 1))
    c = g.call_function(torch.ops._c10d_functional.all_reduce.default, (y, "sum", "0"))
    g.output(body(g, y, c))
    return g, c


def test_check_in_flight_refuses_races_with_the_backend():
    """What gloo's threads could race (``duplex.check_in_flight``): a collective never waited, its output read
    before the wait, its input written in place while in flight; a wait on a view of the output (DTensor's
    pattern) and DTensor's ``_wrap_tensor_autograd`` are fine, and neither counts as a collective."""
    import torch.distributed._functional_collectives  # noqa: F401 - registers _wrap_tensor_autograd

    from meshpilot.runtime.duplex import check_in_flight, waits_of
    from meshpilot.runtime.overlap import is_collective

    ops = torch.ops.aten
    fc = torch.ops._c10d_functional

    def fine(g, y, c):
        g.call_function(fc._wrap_tensor_autograd.default, (c,))
        v = g.call_function(ops.view.default, (c, [-1]))
        return g.call_function(ops.mul.Tensor, (g.call_function(fc.wait_tensor.default, (v,)), 2))

    g, c = _program(fine)
    check_in_flight(g)
    assert [w.target for w in waits_of(c)] == [fc.wait_tensor.default]
    assert [n.name for n in g.nodes if is_collective(n)] == [c.name]

    cases = {
        "no wait_tensor": lambda g, y, c: c,
        "before its wait_tensor": lambda g, y, c: (
            g.call_function(ops.mul.Tensor, (c, 2)),
            g.call_function(fc.wait_tensor.default, (c,)),
        ),
        "writes into a buffer": lambda g, y, c: (
            g.call_function(ops.add_.Tensor, (y, 1)),
            g.call_function(fc.wait_tensor.default, (c,)),
        ),
    }
    for what, body in cases.items():
        g, _ = _program(body)
        with pytest.raises(RuntimeError, match=what):
            check_in_flight(g)


def test_moe_in_flight_kernels_are_collectives_to_the_reordering_passes():
    """The expert-parallel MoE's dispatch and combine kernels return an all-to-all in flight
    (``OwnOp.in_flight``): ``is_collective`` counts them, ``check_in_flight`` wants their ``wait_tensor`` and
    refuses a read before it, like a functional collective's; the other MoE kernels are not collectives."""
    import meshpilot.ops.moe  # noqa: F401 - registers the kernels
    from meshpilot.runtime.duplex import check_in_flight, waits_of
    from meshpilot.runtime.overlap import is_collective

    mp, fc, ops = torch.ops.meshpilot, torch.ops._c10d_functional, torch.ops.aten

    def program(read_early: bool):
        g = torch.fx.Graph()
        x, idx = g.placeholder("x"), g.placeholder("idx")
        got = g.call_function(mp.moe_ep_counts.default, (idx, 4, "0\tep\t2"))
        sent = g.call_function(mp.moe_ep_dispatch.default, (x, idx, None, got, 4, "0\tep\t2"))
        if read_early:
            g.call_function(ops.mul.Tensor, (sent, 2))
        rows = g.call_function(fc.wait_tensor.default, (sent,))
        g.output(rows)
        return g, got, sent

    g, got, sent = program(False)
    check_in_flight(g)
    assert is_collective(sent) and not is_collective(got)
    assert [w.target for w in waits_of(sent)] == [fc.wait_tensor.default]
    with pytest.raises(RuntimeError, match="before its wait_tensor"):
        check_in_flight(program(True)[0])
