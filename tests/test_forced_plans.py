"""The forced plans' ``force=`` dicts (``meshpilot.planner.forced``): Megatron pairs found structurally on
any model, data-parallel and ZeRO-3-like layouts, and what the planner makes of them. Single process; the
runs of these plans on 4 and 8 ranks are in ``tests/test_models_parallel.py``."""

from __future__ import annotations

import pytest
import torch
from test_graph_capture import Tiny
from test_models_parallel import build

from meshpilot.errors import UserError
from meshpilot.graph.capture import capture
from meshpilot.planner.auto import plan
from meshpilot.planner.forced import data_parallel, forced, megatron_groups, megatron_tp, zero3


def _groups(name: str):
    model, inputs = build(name)
    return [g.names() for g in megatron_groups(capture(model, inputs))]


def test_megatron_pairs_are_found_structurally_in_every_model():
    assert _groups("gpt") == [
        pair
        for i in range(2)
        for pair in (
            ((f"blocks.{i}.attn.qkv.weight",), (f"blocks.{i}.attn.proj.weight",)),
            ((f"blocks.{i}.mlp.fc.weight",), (f"blocks.{i}.mlp.proj.weight",)),
        )
    ]
    # separate q, k, v meet in attention and reach o together
    assert _groups("bert") == [
        (("layers.0.q.weight", "layers.0.k.weight", "layers.0.v.weight"), ("layers.0.o.weight",)),
        (("layers.0.up.weight",), ("layers.0.down.weight",)),
    ]
    # fc1 -> fc2 -> fc3: one pair, a linear takes one role; the head feeding the loss stays replicated
    assert _groups("mlp") == [(("layers.0.weight",), ("layers.1.weight",))]
    # einsum expert weights [e, m, f] -> [e, f, m] through permutes and size-1 views
    assert _groups("moe") == [(("moes.0.w_in",), ("moes.0.w_out",))]
    # the fresh hybrid: fused qkv -> out, and a gated MLP's two columns (silu(gate) * up) -> down
    assert _groups("hybrid") == [(("qkv.weight",), ("out.weight",)), (("gate.weight", "up.weight"), ("down.weight",))]
    # convolutions and a classifier feeding the loss: nothing to pair
    assert _groups("wrn") == []


def test_a_column_feeding_a_non_linear_consumer_is_not_paired():
    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
            self.norm = torch.nn.LayerNorm(32)

        def forward(self, x):
            h = self.a(x)
            return (self.b(torch.relu(h)).sum() + self.norm(h).sum()) / 8  # h also reaches a LayerNorm

    assert megatron_groups(capture(Leaky(), (torch.randn(4, 16),))) == []


def test_megatron_dict_equals_the_hand_written_one_for_the_tiny_transformer():
    torch.manual_seed(0)
    m = Tiny(layers=2, h=32, heads=4, vocab=64)
    x = (torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)))
    f = megatron_tp(m, x, (2, 2))
    for i in range(2):
        assert f[f"blocks.{i}.qkv.weight"] == "RS(0)" and f[f"blocks.{i}.up.weight"] == "RS(0)"
        assert f[f"blocks.{i}.o.weight"] == "RS(1)" and f[f"blocks.{i}.down.weight"] == "RS(1)"
        assert f[f"blocks.{i}.ln.weight"] == "RR"
    # the head feeds the loss: no pair, but Megatron-LM's vocabulary-parallel head and cross-entropy (rows of
    # the log-softmax batch-sharded over axis 0, classes over the TP axis; the loss a partial sum over the TP
    # axis, replicated over the batch axis: its sum and count all-reduced together in the op)
    assert f["head.weight"] == "RS(0)"
    nodes = capture(m, x).nodes
    lsm = next(n for n in nodes if n.target == "aten._log_softmax.default")
    nll = next(n for n in nodes if n.target == "aten.nll_loss_forward.default")
    assert f[lsm.name] == "S(0)S(1)" and f[nll.name] == "RP"
    assert megatron_tp(m, x, (2, 2), vocab_loss=False)["head.weight"] == "RR"  # without it the head is replicated
    assert f["emb.weight"] == "RS(0)"  # vocabulary-parallel embedding over the TP axis
    lookup = next(n for n in nodes if n.target == "aten.embedding.default")
    assert f[lookup.name] == "S(0)P"  # batch over axis 0, partial sums over the TP axis
    assert f["input:0"] == f["input:1"] == "S(0)R"
    # tensor parallelism over axis 0 instead: the same pairs on the other axis, batch over axis 1
    f0 = megatron_tp(m, x, (2, 2), tp_axis=0)
    assert f0["blocks.0.qkv.weight"] == "S(0)R" and f0["blocks.0.o.weight"] == "S(1)R"
    assert f0["input:0"] == "RS(0)" and f0["emb.weight"] == "S(0)R"


def test_layouts_respect_size_one_axes_and_divisibility():
    model, inputs = build("mlp")  # layers [64, 32], [64, 64], [16, 64]; batch 8
    # on (4, 1) Megatron's TP axis has size 1: it is data parallelism
    assert megatron_tp(model, inputs, (4, 1)) == data_parallel(model, inputs, (4, 1))
    assert data_parallel(model, inputs, (1, 4))["input:0"] == "RS(0)"
    assert data_parallel(model, inputs, (2, 4))["input:1"] == "S(0)S(0)"
    z = zero3(model, inputs, (2, 4))
    assert z["layers.0.weight"] == "S(0)S(0)" and z["layers.2.weight"] == "S(0)S(0)"

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(6, 32))
            self.s = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return (x @ self.w.t()).sum() + self.s.sum()

    z = zero3(Odd(), (torch.randn(6, 32),), (2, 2))
    assert z["w"] == "S(0)S(1)"  # 6 divides by 2 but not by 4: the second axis shards dim 1
    assert z["s"] == "RR"  # nothing divides
    assert z["input:0"] == "S(0)R"  # batch 6 over the first axis only


def test_forced_plans_pin_every_parameter_and_input_and_communicate_as_their_kind():
    model, inputs = build("gpt")
    graph = capture(model, inputs)
    plans = {}
    for kind in ("data_parallel", "megatron_tp", "zero3"):
        f = forced(kind, model, inputs, (2, 2), **({"graph": graph} if kind == "megatron_tp" else {}))
        p = plans[kind] = plan(model, inputs, "atp-ic3", mesh_shape=(2, 2), force=f, graph=graph)
        names = {n for n, _ in model.named_parameters()}
        assert {n: "".join(lay) for n, lay in p.params} == {n: v for n, v in f.items() if n in names}
        assert ["".join(lay) for lay in p.inputs] == [f["input:0"], f["input:1"]]
        # anything else pinned is a node: Megatron's column / row products and its vocabulary-parallel lookup
        for node, lay in f.items():
            if node not in names and not node.startswith("input:"):
                assert kind == "megatron_tp" and "".join(p.node(node).outs[0]) == lay
    params = {n.name for n in graph.nodes if n.kind == "param"}
    kinds = {k: {(c.kind, c.phase, c.axis) for c in p.collectives} for k, p in plans.items()}
    from_params = {k: {(c.kind, c.phase) for c in p.collectives if c.src in params} for k, p in plans.items()}
    grads = {k: {(c.kind, c.axis) for c in p.collectives if c.dst.startswith("grad:")} for k, p in plans.items()}
    # data parallel: replicated weights are never moved; gradients are all-reduced over both axes (the
    # ILP still picks each op's algorithm: on these latency-bound sizes it gathers the small activations
    # of the final norm and loss instead of all-reducing their gradients)
    assert from_params["data_parallel"] == set()
    assert grads["data_parallel"] == {("all_reduce", 0), ("all_reduce", 1)}
    # Megatron: the row-parallel linears' partial sums are reduced over the TP axis in the forward pass
    assert kinds["megatron_tp"] & {("all_reduce", "fwd", 1), ("reduce_scatter", "fwd", 1)}
    # ZeRO-3: weight shards are gathered (or re-sharded) where they are used, in the forward and again in
    # the backward, never reduced; gradients are reduce-scattered into their shards
    assert ("all_gather", "fwd") in from_params["zero3"]
    assert {k for k, _ in from_params["zero3"]} <= {"all_gather", "all_to_all"}
    assert ("reduce_scatter", 0) in grads["zero3"] or ("reduce_scatter", 1) in grads["zero3"]
    assert not any(k == "all_reduce" for k, _ in grads["zero3"])


def test_bad_kind_and_mesh_are_user_errors():
    model, inputs = build("mlp")
    with pytest.raises(UserError, match="unknown forced plan 'fsdp'"):
        forced("fsdp", model, inputs, (2, 2))
    with pytest.raises(UserError, match="mesh_shape"):
        data_parallel(model, inputs, (2, 0))


def test_vocabulary_parallel_embedding_is_offered_and_runs_as_meshpilot_strategy():
    """meshpilot's own embedding strategies: a vocabulary-sharded table gives a partial lookup (forward) and
    a vocabulary-sharded gradient (backward); DTensor offers neither with plain layouts."""
    from meshpilot.sharding.placements import fmt
    from meshpilot.sharding.strategies import StrategyBuilder, fake_device_mesh

    model, inputs = build("gpt")
    g = capture(model, inputs)
    sb = StrategyBuilder(g, fake_device_mesh((2, 2)))
    strats = {}
    for n in g.nodes:
        strats[n.name] = sb.for_node(n, [StrategyBuilder.out_candidates(strats[s], i) for s, i in n.inputs])
    fwd = next(n for n in g.nodes if n.target == "aten.embedding.default")
    bwd = next(n for n in g.nodes if n.target == "aten.embedding_dense_backward.default")
    own_fwd = {s.short() for s in strats[fwd.name] if s.source == "meshpilot"}
    own_bwd = {s.short() for s in strats[bwd.name] if s.source == "meshpilot"}
    assert "RS(0) × RR → RP" in own_fwd and "S(0)S(0) × RR → PP" in own_fwd
    assert "RS(0) × S(0)R → S(0)P" in own_fwd  # vocabulary over axis 1, batch over axis 0
    assert "RR × RR → RS(0)" in own_bwd and "S(0)R × S(0)R → PS(0)" in own_bwd
    # DTensor's own strategies for these ops never shard the vocabulary with plain layouts
    dt_fwd = [s for s in strats[fwd.name] if s.source == "dtensor"]
    dt_bwd = [s for s in strats[bwd.name] if s.source == "dtensor"]
    assert dt_fwd and not any("S(0)" in fmt(s.ins[0]) for s in dt_fwd)
    assert dt_bwd and not any("S(0)" in fmt(s.outs[0]) for s in dt_bwd)
    assert not sb.fallbacks


# ------------------------------------------------------------------------------------------ force patterns


def _mlp_plan(force, shape=(2, 2)):
    import warnings

    model, inputs = build("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(model, inputs, "atp-ic3", mesh_shape=shape, force=force)
    return p, [str(w.message) for w in caught if "force pattern" in str(w.message)]


def test_plans_docstring_example_is_data_parallel_and_says_which_pattern_won():
    """``{"*": "RR", "input:*": "S(0)R"}`` (``plan``'s own docstring) was fully replicated: ``*`` came first and
    won the inputs, and it matched every operator too. The most specific pattern wins, whatever the order."""
    p, notes = _mlp_plan({"*": "RR", "input:*": "S(0)R"})
    assert [tuple(lay) for lay in p.inputs] == [("S(0)", "R"), ("S(0)", "R")]
    assert all(tuple(lay) == ("R", "R") for _, lay in p.params)
    grads = {(c.kind, c.axis) for c in p.collectives if c.dst.startswith("grad:")}
    assert ("all_reduce", 0) in grads  # data parallel: gradients all-reduced over the batch axis
    assert notes == ["force pattern 'input:*' (S(0)R) overrides '*' (RR) on input:0, input:1: the more specific "
                     "pattern wins"]  # fmt: skip
    q, _ = _mlp_plan({"input:*": "S(0)R", "*": "RR"})  # the order does not matter
    assert (q.inputs, q.params) == (p.inputs, p.params)


def test_precedence_exact_name_then_more_literal_characters():
    from meshpilot.planner.force import ForceSpec

    spec = ForceSpec({"*": "RR", "layers.*": "S(0)R", "layers.*.weight": "RS(0)", "layers.0.weight": "S(1)R"})
    assert spec.winner("layers.0.weight").pattern == "layers.0.weight"  # exact beats every wildcard
    assert spec.winner("layers.1.weight").pattern == "layers.*.weight"  # 14 literal characters beat 7
    assert spec.winner("layers.1.bias").pattern == "layers.*"
    assert spec.winner("input:0").pattern == "*"
    assert ForceSpec({"[*]x": "RR"}).winner("*x").exact == "*x"  # an escaped wildcard is a literal


def test_leaf_patterns_never_pin_operators_and_the_others_pin_operators_by_name():
    from meshpilot.planner.force import ForceSpec

    model, inputs = build("mlp")
    graph = capture(model, inputs)
    ops = [n for n in graph.nodes if n.kind == "op"]
    mm, relu = ops[0], next(n for n in ops if n.target.startswith("aten.relu"))
    pins = ForceSpec({"*": "RR", mm.name: "S(0)R", "relu*": "S(0)R"}).bind(graph)
    assert pins.rule_for(mm).pattern == mm.name
    assert pins.rule_for(relu).pattern == "relu*"  # it names no parameter or input: operators by name
    assert pins.rule_for(next(n for n in ops if n not in (mm, relu) and not n.name.startswith("relu"))) is None
    assert pins.rule_for(next(n for n in graph.nodes if n.kind == "param")).pattern == "*"


@pytest.mark.parametrize(
    "force, needles",
    [
        ({"zz": "XYZ"}, ("force['zz'] = 'XYZ'", "not a layout", "S(0)R")),  # checked though it matches nothing
        ({"input:0": "S(0)"}, ("1 placement(s)", "2-D mesh (2, 2)")),
        ({"zz": "S(7)R"}, ("S(7)", "more than 2 dim")),  # no tensor of the model has 8 dims
        ({"layers.0.bias": "RS(1)"}, ("layers.0.bias has 1 dim", "S(0) … S(0) or R")),
        ({"*": "RR", "?*": "S(0)R"}, ("equally specific", "exact pattern")),
        ({"a": "RR", "[a]": "S(0)R"}, ("both name 'a' exactly",)),
        ({"input:0": ["S(0)", "R"]}, ("layout string",)),
    ],
)
def test_bad_force_is_one_user_error(force, needles):
    with pytest.raises(UserError) as e:
        _mlp_plan(force)
    msg = str(e.value)
    assert "\n" not in msg and "; " in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


def test_a_pattern_that_pins_nothing_warns():
    _, notes = _mlp_plan({"layers.*": "RR", "layers.*.weight": "RS(0)", "layers.*.bias": "S(0)R"})
    assert any("pins nothing: more specific patterns win every name it matches" in n for n in notes), notes


def _probed_cpu_cluster():
    """The fields of the 4-rank cluster file `meshpilot probe` wrote on the 2-core box (docs/benchmarks.md,
    issue 30 item 4): a measured all-reduce curve whose every call from 64 B to 16 KiB costs 3.6 ms after pooling
    (1 MiB 10 ms; 4 B 0.8 ms) and 914 µs of host CPU a collective."""
    from meshpilot.cluster.loader import cluster_from_dict

    device = {
        "kind": "probed-cpu",
        "peak_tflops_fp32": 0.07475,
        "memory_GBps": 4.237,
        "memory_GiB": 5.885,
        "compute_efficiency": 1.0,
        "memory_efficiency": 1.0,
        "collective_overhead_us": 914.2,
    }
    layer = {"name": "device", "ranks": 4, "p2p_GBps": 2.0, "group_GBps": 2.0, "latency_us": 142.9}
    curve = [[4, 796.0], [64, 4068.0], [1024, 4894.0], [16384, 1821.0], [131072, 4999.0], [1048576, 12150.0]]
    curve += [[4194304, 7832.0]]
    busy = [[1024, 112100.0], [16384, 98540.0], [131072, 70450.0], [1048576, 38560.0], [4194304, 74940.0]]
    cal = {"mesh": [4, 1], "B1_GBps": 0.5885, "alpha1_us": 398.0, "curve1": curve, "busy1": busy}
    return cluster_from_dict(
        {"name": "probed-4", "device_profile": device, "layers": [layer], "calibration": [cal]}, "t"
    )


def test_zero3_on_a_cpu_cluster_with_a_costly_call_keeps_activations_batch_sharded():
    """Issue 30: on the probed CPU cluster the ILP priced each of the GPT's 53 gradient reduce-scatters as its
    own 3.6 ms+ call, though the runtime issues them in one bucket, and so chose to gather activations instead
    (column-parallel linears, 82 collectives a step, 71 all-gathers). Priced as their share of a bucket
    (``CostModel.coalesced``), the forced ZeRO-3 plan is ZeRO-3: every linear batch-sharded, and the step issues
    only the gather groups, the gradient buckets and the loss' one all-reduce (its sum and count together)."""
    from meshpilot.models.sources import build_model
    from meshpilot.planner.prefetch import active_gathers

    built = build_model("gpt-tiny", device="meta", layers=4, hidden=256, heads=8, batch=8, seq=128)
    model, inputs = built.model, built.inputs
    p = plan(model, inputs, _probed_cpu_cluster(), mesh_shape=(4,), force=zero3(model, inputs, (4,)))
    linears = [n for n in p.nodes if n.name.startswith("addmm")]
    assert linears and all(n.outs == (("S(0)",),) for n in linears), [n.outs for n in linears]
    assert not any(c.kind == "all_to_all" for c in p.collectives)
    counts = p.collective_counts(backend="gloo")
    gathers = sum(v for (kind, _, _), v in counts.items() if kind == "all_gather")
    assert gathers == len(active_gathers(p))
    assert sum(counts.values()) == len(active_gathers(p)) + len(p.grad_buckets) + 1


class _MaskedAttention(torch.nn.Module):
    """Attention given its causal mask written out as transformers writes it: booleans from token positions,
    expanded to the batch (``[b, 1, t, t]``), a chain whose only layout is the replica."""

    def __init__(self, d: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.qkv, self.o = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        pos = torch.arange(t)
        mask = (pos[None, :] <= pos[:, None])[None, None].expand(b, 1, t, t)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, t, d)).pow(2).mean()


def test_data_parallel_attention_slices_a_replicated_mask_by_batch():
    """The batch-parallel attention needs the mask's batch slice; the mask chain emits only the replica, so the
    slice must be offered as a free local one (``strategies.replica_sliced_operands``). Without it only the
    replicated and row strategies were reachable and data parallelism gathered q, k, v around the attention
    (4 all-gathers on this module, as under transformers 5.17's Llama)."""
    model, inputs = _MaskedAttention(), (torch.randn(8, 128, 256),)
    p = plan(model, inputs, "dgx-h100", mesh_shape=(4,), force=data_parallel(model, inputs, (4,)))
    assert "".join(p.node("sdpa").ins[0]) == "S(0)" and "".join(p.node("sdpa").ins[3]) == "S(0)"
    assert {c.kind for c in p.collectives} == {"all_reduce"}
