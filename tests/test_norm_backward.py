"""LayerNorm's backward planned and run exactly on a torch whose DTensor rule is not exact (``ops.norm_backward``).

torch 2.11 registers an op strategy for ``native_layer_norm_backward`` that takes ``mean``, ``rstd``, ``weight``
and ``bias`` in whatever layout they arrive, at no cost; the planner, which offers every layout a producer can
emit, planned a ZeRO-3 GPT's norm weights read as their 1/N shards (no all-gather) and a 4-rank run failed in
the kernel (docs/benchmarks.md, t211). The captured graphs are the same on 2.11 and 2.13; only the rule differs.
Here, on the torch of the tests (2.13, which has the exact single-dim rule), :func:`torch_211_rule` puts back
2.11's rule (the single-dim one removed, a replica of 2.11's op strategy in its place) in the process and in
every rank, and meshpilot's registration (``ops.norm_backward.register``) is run on it:

* without that registration the forced ZeRO-3 plan reads the weight shards (the failure, reproduced here);
* with it, every norm backward reads its weight and bias replicated and its statistics in the input's layout,
  the plan issues as many collectives as under torch's own rule, and on 4 gloo ranks it trains equal to one
  device (loss and gradients within 1e-5) issuing exactly the plan's collectives.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from dist_utils import captures, graph_of, lockstep_adamw, run_distributed
from torch.distributed.tensor import Partial, Replicate, Shard

from meshpilot import compat
from meshpilot.graph.capture import capture
from meshpilot.models.gpt import GPT, GPTConfig
from meshpilot.ops import norm_backward
from meshpilot.planner import forced
from meshpilot.planner.auto import plan
from meshpilot.planner.plan import Plan
from meshpilot.sharding import strategies
from meshpilot.sharding.placements import from_json

CFG = GPTConfig(vocab=64, seq=16, layers=2, hidden=32, heads=4, batch=8)
WORLD = 4
OP = norm_backward.LAYER_NORM


def _model_inputs(device: str = "meta"):
    with torch.device(device):
        torch.manual_seed(0)
        model = GPT(CFG)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, CFG.vocab, (CFG.batch, CFG.seq + 1), generator=g)
    return model, (tok[:, :-1].contiguous(), tok[:, 1:].contiguous())


def _torch_211_strategy(op_schema):
    """torch 2.11's ``_common_norm_backward_strategy`` for LayerNorm, as it behaves: per layout of ``input``,
    ``grad_out`` and ``input`` in it made whole on the normalized dims, ``mean``, ``rstd``, ``weight`` and
    ``bias`` taken as their same-numbered layout arrives, at no cost; ``d_input`` as ``grad_out``, ``d_weight``
    and ``d_bias`` summed over the outer dims (partial where the input is sharded on one)."""
    from torch.distributed.tensor._ops import utils

    spec_cls, _ = compat.dtensor_spec()
    osm = compat.op_schema()
    grad_out, inp, normalized, mean, rstd, weight, bias, mask = op_schema.args_schema
    axis = inp.ndim - len(normalized)
    out = osm.OpStrategy([])
    for idx, s in enumerate(inp.strategies):
        src = s.output_spec
        pl = tuple(Replicate() if isinstance(p, Shard) and p.dim >= axis else p for p in src.placements)
        target = spec_cls(src.mesh, pl, tensor_meta=src.tensor_meta)
        as_is = [x.strategies[idx].output_spec for x in (mean, rstd, weight, bias) if x is not None]
        costs = [utils.generate_redistribute_costs(x, target) for x in (grad_out, inp)]
        costs += [[0.0] * len(x.strategies) for x in (mean, rstd, weight, bias) if x is not None]
        summed = tuple(Partial("sum") if isinstance(p, Shard) else p for p in pl)
        outs = [target if mask[0] else None]
        for x, m in ((weight, mask[1]), (bias, mask[2])):
            meta = x.strategies[idx].output_spec.tensor_meta if x is not None else None
            outs.append(spec_cls(src.mesh, summed, tensor_meta=meta) if x is not None and m else None)
        out.strategies.append(osm.OpSpec(tuple(outs), [target, target, *as_is], redistribute_cost=costs))
    return out


@contextlib.contextmanager
def torch_211_rule(fix: bool):
    """DTensor's LayerNorm backward rule as torch 2.11 has it (no single-dim strategy, :func:`_torch_211_strategy`)
    while inside, then meshpilot's registration on it when `fix`; torch's own put back on leaving. The strategy
    caches (meshpilot's and DTensor's) are emptied both ways: they are keyed by op and layouts, not by rule."""
    prop = compat.sharding_propagator()
    singles, infos = compat.single_dim_registry()
    saved = (singles.pop(OP, None), infos.pop(OP, None), prop.op_strategy_funcs.get(OP))

    def forget() -> None:
        strategies._STRATEGY_CACHE.clear()
        strategies._SINGLE_DIM_CACHE.clear()
        prop.propagate_op_sharding.cache_clear()

    forget()
    prop.op_strategy_funcs[OP] = _torch_211_strategy
    try:
        if fix:
            assert norm_backward.register() == [str(OP)]  # what meshpilot's start does on torch 2.11
        yield
    finally:
        singles.pop(OP, None)
        infos.pop(OP, None)
        for registry, value in zip((singles, infos, prop.op_strategy_funcs), saved):
            if value is not None:
                registry[OP] = value
            else:
                registry.pop(OP, None)
        forget()


def _zero3() -> Plan:
    """The forced ZeRO-3 plan on the probed CPU cluster, which keeps the activations batch-sharded (so the norm
    backwards run on row shards: ``test_grad_buckets``' ZeRO-3 run)."""
    from test_forced_plans import _probed_cpu_cluster

    model, inputs = _model_inputs()
    force = forced.zero3(model, inputs, (WORLD,))
    return plan(model, inputs, _probed_cpu_cluster(), mesh_shape=(WORLD,), force=force, graph=capture(model, inputs))


def _norm_reads(p) -> list[tuple[str, ...]]:
    """Each LayerNorm backward's planned operand layouts (grad_out, input, mean, rstd, weight, bias)."""
    return [tuple(n.ins) for n in p.nodes if n.name.startswith("native_layer_norm_backward")]


def test_the_211_rule_plans_weight_shards_and_the_registration_plans_them_whole():
    """The replica of 2.11's rule reproduces the failure's plan (weight and bias read as shards: fewer
    collectives), and meshpilot's registration on it gives back the plan of torch's own rule."""
    own = _zero3()
    with torch_211_rule(fix=False):
        broken = _zero3()
    with torch_211_rule(fix=True):
        fixed = _zero3()
    reads = _norm_reads(own)
    assert len(reads) == 2 * CFG.layers + 1
    assert all(r == (("S(0)",),) * 4 + (("R",),) * 2 for r in reads), reads
    assert all(r[4:] == (("S(0)",),) * 2 for r in _norm_reads(broken)), _norm_reads(broken)
    assert len(broken.collectives) < len(own.collectives)
    assert _norm_reads(fixed) == reads
    assert len(fixed.collectives) == len(own.collectives)


@pytest.mark.parametrize("op", [norm_backward.LAYER_NORM, norm_backward.RMS_NORM])
def test_registered_rule_keeps_weight_whole_and_statistics_with_the_input(op):
    """Per mesh axis, the registered rule reads the weight (and bias) replicated and the statistics sharded as the
    input, on one of its outer dims (one rule each), and makes partial sums of the weight's (and bias') gradient;
    DTensor expands it to the mesh (the plans above)."""
    singles, infos = compat.single_dim_registry()
    saved = (singles.pop(op, None), infos.pop(op, None))
    try:
        assert norm_backward.register() == [str(op)]
        fn = singles[op]
        _, meta_cls = compat.dtensor_spec()
        x = meta_cls(torch.Size([4, 8, 16]), (128, 16, 1), torch.float32)
        stat = meta_cls(torch.Size([4, 8, 1]), (8, 1, 1), torch.float32)
        w = meta_cls(torch.Size([16]), (1,), torch.float32)
        if op == norm_backward.LAYER_NORM:
            rules = fn(op, (x, x, [16], stat, stat, w, w, [True, True, True]), {})
            n_stats, n_affine = 2, 2
        else:
            rules = fn(op, (x, x, [16], stat, w, [True, True]), {})
            n_stats, n_affine = 1, 1
        assert len(rules) == 2  # one per outer dim
        for dim, r in enumerate(rules):
            outs, ins = r[: 1 + n_affine], r[1 + n_affine :]
            assert all(p == Partial("sum") for p in outs[1:])
            assert len({repr(p) for p in ins[: 2 + n_stats]}) == 1 and ins[0].dim == dim
            assert ins[2 + n_stats :] == [Replicate()] * n_affine
    finally:
        singles.pop(op, None)
        infos.pop(op, None)
        for registry, value in zip((singles, infos), saved):
            if value is not None:
                registry[op] = value
        compat.sharding_propagator().propagate_op_sharding.cache_clear()


def _worker(text: str) -> dict:
    """The plan trained beside the single device for 2 AdamW steps with 2.11's rule and meshpilot's registration
    in this rank (torch's own rule put back after)."""
    from meshpilot.runtime.spmd import parallelize

    p = Plan.from_json(text).only
    with torch_211_rule(fix=True):
        ref, inputs = _model_inputs("cpu")
        model = _model_inputs("cpu")[0]
        pm = parallelize(model, p, graph=graph_of("norm_backward_gpt", model, p))
        got = lockstep_adamw(ref, pm, inputs, steps=2)
    planned = p.collective_counts(backend="gloo")
    return {"loss": max(got["loss"]), "grad": max(got["grad"]), "same": all(c == planned for c in got["counts"])}


@pytest.mark.dist
@pytest.mark.slow
def test_zero3_under_the_211_rule_runs_equal_to_one_device():
    """The ZeRO-3 plan made under 2.11's rule with meshpilot's registration, run on 4 gloo ranks under the same
    rule: equal to one device (without the registration this is the failure: the kernel handed a weight shard),
    every step's collectives the plan's."""
    with torch_211_rule(fix=True):
        p = _zero3()
    text = p.to_json()
    graphs = captures(("norm_backward_gpt", _model_inputs("cpu")[0], p))
    for r in run_distributed(_worker, WORLD, text, timeout=600, graphs=graphs):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["same"], r
    assert all(from_json(x[4])[0] == Replicate() for x in _norm_reads(p))
