"""A capture pickles and comes back the same graph (``meshpilot.graph.portable``): what lets one process's capture
serve a launch's or a test's ranks (``tests/dist_utils.py``'s ``graphs=``) instead of each tracing the model.

Pure: the captures of the tiny GPT, Hugging Face GPT-2 and Llama (``use_cache=False``), Mixtral (meshpilot's
experts op, its module not imported where the graph is loaded) and the GPT at a sequence a ring plan shards,
pickled and loaded: every node, fx node (op, name, target, arguments) and ``meta`` key equal, fake values of the
same shapes, strides, offsets and dtypes (one fake per value the capture shared), and the plans made on the loaded
graph are the plans made on the captured one (the ring's pins included: the ring op reads its operands' fake
values). On 4 gloo ranks (the suite's pool of that size, up already for its other multi-rank files: a pool of 2
cost this test ~10 CPU s to start, and evicted one the suite then started again): a plan run on the loaded graph
records the program a fresh capture records, computes the single device's loss and gradients and issues the
plan's collectives.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys

import pytest
import torch
from dist_utils import lockstep_adamw, run_distributed, tiny_gpt

from meshpilot.graph.capture import OpGraph, capture
from meshpilot.planner.auto import plan

CLUSTER = "atp-ic3"
KW = dict(mesh_shape=(2, 1), mappings=("row",), recompute="none")
HF = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, n_positions=32, vocab_size=64, bos_token_id=0, eos_token_id=0),
    "llama": dict(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, vocab_size=64,
    ),
    "mixtral": dict(
        num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_local_experts=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=32, vocab_size=64,
    ),
}  # fmt: skip


def build(name: str):
    """Model `name` (seeded) and its inputs."""
    if name == "gpt":
        return tiny_gpt()
    if name == "ring":  # the GPT at a sequence the ring's pins shard on 2 ranks
        from meshpilot.models.sources import build_model

        torch.manual_seed(0)
        built = build_model("gpt-tiny", batch=1, seq=64, layers=1, hidden=32, heads=4)
        return built.model, tuple(built.inputs)
    from meshpilot.models.sources import hf_model

    torch.manual_seed(0)
    model = hf_model(name, {**HF[name], "use_cache": False})
    g = torch.Generator().manual_seed(1)
    return model, tuple(torch.randint(0, 64, (4, 8), generator=g) for _ in range(2))


def _fake(v):
    """`v` with each fake tensor its metadata, each operator its name (``original_aten`` may hold another object
    of the same operator than ``torch.ops`` gives)."""
    if isinstance(v, torch._ops.OpOverload):
        return ("op", str(v))
    if isinstance(v, torch.Tensor):
        return ("fake", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, str(v.device), v.requires_grad)
    if isinstance(v, (tuple, list)):
        return _same_kind(v, [_fake(x) for x in v])
    if isinstance(v, dict):
        return {k: _fake(x) for k, x in v.items()}
    return v


def _fx(a):
    return torch.fx.node.map_arg(a, lambda n: ("node", n.name))


def assert_same(g: OpGraph, h: OpGraph) -> None:
    """`h` (`g` pickled and loaded) is `g`: its nodes, fields, fx graph and every node's ``meta``."""
    assert h.nodes == g.nodes and h.fingerprint() == g.fingerprint()
    for f in ("param_names", "buffer_names", "num_inputs", "loss", "grads", "input_infos", "buffer_updates"):
        assert getattr(h, f) == getattr(g, f), f
    assert (h.precision, h.canonical, h.repeats, h.guards) == (g.precision, g.canonical, g.repeats, g.guards)
    assert h.consts.keys() == g.consts.keys() and all(torch.equal(h.consts[k], g.consts[k]) for k in g.consts)
    assert h.users == g.users
    mine, theirs = list(h.gm.graph.nodes), list(g.gm.graph.nodes)
    assert len(mine) == len(theirs)
    shared_g: dict[int, int] = {}
    shared_h: dict[int, int] = {}
    for a, b in zip(mine, theirs):
        where = b.name
        assert (a.op, a.name, a.target, a.type) == (b.op, b.name, b.target, b.type), where
        assert _fx((a.args, a.kwargs)) == _fx((b.args, b.kwargs)), where
        assert a.meta.keys() == b.meta.keys(), (where, a.meta.keys() ^ b.meta.keys())
        for k in b.meta:
            assert _fake(a.meta[k]) == _fake(b.meta[k]), (where, k)
        for v, w in zip(
            torch.utils._pytree.tree_leaves(a.meta.get("val")), torch.utils._pytree.tree_leaves(b.meta.get("val"))
        ):
            if isinstance(w, torch.Tensor):  # one fake for each value the capture shared, and no more
                assert type(v) is type(w)
                assert shared_h.setdefault(id(v), id(w)) == id(w) and shared_g.setdefault(id(w), id(v)) == id(v)
    for n in h.nodes:
        if n.fx_node is not None:
            assert n.fx_node.graph is h.gm.graph and n.fx_node.name == g[n.name].fx_node.name


@pytest.fixture(scope="module")
def graphs():
    """Name -> (model, inputs, the capture, the capture pickled and loaded)."""
    return {}


def _captured(graphs, name):
    if name not in graphs:
        model, inputs = build(name)
        g = capture(model, inputs)
        graphs[name] = (model, inputs, g, pickle.loads(pickle.dumps(g)))
    return graphs[name]


@pytest.mark.parametrize("name", ["gpt", "gpt2", "llama", "mixtral"])
def test_a_capture_pickles_and_loads_node_for_node(graphs, name):
    model, inputs, g, h = _captured(graphs, name)
    assert_same(g, h)
    if name == "mixtral":
        assert any(n.target.startswith("meshpilot.moe_experts") for n in h.nodes)
    assert_same(g, pickle.loads(pickle.dumps(h)))  # and again: what a loaded graph pickles is the same


def test_the_plans_made_on_a_loaded_capture_are_the_captures_own(graphs):
    from meshpilot.ops.attention import ContextMethod, context_axes, ring_pins

    for name in ("gpt", "ring"):
        model, inputs, g, h = _captured(graphs, name)
        force = ring_pins(g) if name == "ring" else None
        mine = plan(model, inputs, CLUSTER, graph=h, force=force, **KW)
        theirs = plan(model, inputs, CLUSTER, graph=g, force=force, **KW)
        assert mine.run_digest() == theirs.run_digest(), name
        assert _untimed(mine.to_json()) == _untimed(theirs.to_json()), name  # the predictions too
    axes = context_axes(mine.nodes, mine.mesh_axes, mine.collectives)
    assert [a.method for a in axes] == [ContextMethod.RING]


def _untimed(text: str) -> str:
    """A plan's JSON without how long its searches took."""
    return re.sub(r'"[a-z_]*_s": [0-9.e-]+', "", text)


def test_a_loaded_capture_defines_meshpilots_own_ops_it_names(graphs):
    """In a process that never imported ``meshpilot.ops.moe``, a loaded Mixtral capture names its experts op."""
    code = (
        "import pickle, sys\n"
        "g = pickle.load(sys.stdin.buffer)\n"
        "assert 'meshpilot.ops.moe' in sys.modules\n"
        "print(sorted({n.target for n in g.nodes if n.target.startswith('meshpilot.')})[0])\n"
    )
    blob = pickle.dumps(_captured(graphs, "mixtral")[2])
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().startswith("meshpilot.moe_experts")


def _run_loaded(plan_json: str, graph: OpGraph) -> dict:
    from meshpilot.planner.plan import StagePlan
    from meshpilot.runtime.spmd import parallelize

    p = StagePlan.from_json(plan_json)
    ref, inputs = tiny_gpt()
    pm = parallelize(tiny_gpt()[0], p, graph=graph)
    res = lockstep_adamw(ref, pm, inputs, 1)  # one step: AdamW's next would turn rounding into steps of lr
    res["counts_equal"] = [c == p.collective_counts(backend="gloo") for c in res["counts"]]
    fresh = parallelize(tiny_gpt()[0], p)  # captures itself
    fresh(*inputs).backward()
    res["programs"] = [
        (pm.program.forward_gm.code == fresh.program.forward_gm.code),
        (pm.program.backward_gm.code == fresh.program.backward_gm.code),
    ]
    return res


@pytest.mark.dist
def test_a_plan_runs_on_a_loaded_capture_as_on_its_own_on_4_ranks(graphs):
    model, inputs, g, h = _captured(graphs, "gpt")
    p = plan(model, inputs, CLUSTER, graph=g, **{**KW, "mesh_shape": (2, 2)})
    assert p.collective_counts(backend="gloo")  # the plan communicates
    for rank, r in enumerate(run_distributed(_run_loaded, 4, p.to_json(), g)):
        assert r["loss"][0] < 1e-5 and r["grad"][0] < 1e-5, (rank, r)
        assert all(r["counts_equal"]), rank
        assert r["programs"] == [True, True], rank


def _same_kind(seq, items: list):
    """`items` in a sequence of `seq`'s type (a named tuple's, too)."""
    return type(seq)(*items) if hasattr(seq, "_fields") else type(seq)(items)


def test_a_pipeline_stages_slice_pickles_with_its_boundary_leaves(graphs):
    """A stage's graph (``planner.stage.slice_graph``) shares the capture's fx graph and adds leaves of its own
    (no fx node): loaded, every node is linked as it was."""
    from meshpilot.planner.stage import layers, slice_graph

    g = _captured(graphs, "gpt")[2]
    all_layers = layers(g)
    sub = slice_graph(g, 1, len(all_layers) - 1, all_layers)
    h = pickle.loads(pickle.dumps(sub))
    assert h.nodes == sub.nodes and h.fingerprint() == sub.fingerprint() and h.grads == sub.grads
    linked = [None if n.fx_node is None else n.fx_node.name for n in sub.nodes]
    assert [None if n.fx_node is None else n.fx_node.name for n in h.nodes] == linked
    assert None in linked  # the boundary leaves
