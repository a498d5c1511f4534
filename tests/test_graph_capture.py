"""Capture of the joint forward + backward graph on fake tensors, and repeated-layer detection."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshpilot.graph.capture import capture


class MLP(nn.Module):
    def __init__(self, d: int = 16, h: int = 32, c: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, c)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(F.relu(self.fc1(x))), y)


class Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.up, self.down = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.o(a)
        return x + self.down(F.relu(self.up(x)))


class Tiny(nn.Module):
    def __init__(self, layers: int = 4, h: int = 32, heads: int = 4, vocab: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, idx, tgt):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), tgt.flatten())


def test_mlp_graph_has_params_flops_and_phases():
    m = MLP()
    g = capture(m, (torch.randn(4, 16), torch.randint(0, 8, (4,))))
    params = [n for n in g.nodes if n.is_param]
    assert [n.fqn for n in params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert set(g.grads) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    mms = [n for n in g.nodes if n.target in ("aten.addmm.default", "aten.mm.default")]
    fwd = [n for n in mms if n.phase == "fwd"]
    assert sorted(n.flops for n in fwd) == [2 * 4 * 32 * 8, 2 * 4 * 16 * 32]
    assert any(n.phase == "bwd" for n in mms)
    assert g.loss[0] in g.by_name and g[g.loss[0]].out.shape == ()
    # the relu output is kept for the backward
    assert any(n.saved_for_backward and n.target == "aten.relu.default" for n in g.nodes)
    # views cost nothing
    assert all(n.flops == 0 and n.bytes_read == 0 for n in g.nodes if n.is_view)
    # the forward matmuls read each weight through a transpose: view_chain walks back to the parameter
    for mm in fwd:
        weight = mm.inputs[-1][0]  # addmm(bias, x, w.t())
        chain = g.view_chain(weight)
        assert g[weight].is_view and len(chain) == 2 and g[chain[-1]].fqn in ("fc1.weight", "fc2.weight"), chain
        assert g.view_chain(weight, max_hops=0) == [weight]
    assert g.view_chain(params[0].name) == [params[0].name]  # not a view: itself


def test_meta_model_is_captured_without_allocating():
    with torch.device("meta"):
        m = Tiny(layers=2, h=1024, heads=8, vocab=50000)
    idx = torch.empty(8, 512, dtype=torch.long, device="meta")
    g = capture(m, (idx, idx))
    assert g.param_bytes == sum(p.numel() * 4 for p in m.parameters())
    assert all(p.device.type == "meta" for p in m.parameters())
    # attention is one device-generic node forward and backward, never a CPU kernel
    assert {"meshpilot.sdpa.default", "meshpilot.sdpa_backward.default"} <= {n.target for n in g.nodes}
    assert not any("_for_cpu" in n.target or "mkldnn" in n.target for n in g.nodes)


def test_repeated_layers_share_canonical_nodes_and_params():
    g = capture(Tiny(layers=4), (torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))))
    assert g.repeats, "no repeated layers found"
    start, period, count = max(g.repeats, key=lambda r: r[1] * r[2])
    assert count >= 3
    tied = {k: v for k, v in g.canonical.items() if k != v}
    assert len(tied) > 100
    # layer 3's up-projection weight is decided with layer 0's
    by_fqn = {n.fqn: n.name for n in g.nodes if n.is_param}
    assert g.canonical[by_fqn["blocks.3.up.weight"]] == g.canonical[by_fqn["blocks.0.up.weight"]]
    # tied nodes are the same op on the same shapes
    for k, v in tied.items():
        assert g[k].target == g[v].target and g[k].outputs == g[v].outputs


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_op_is_eager_attention_bit_for_bit_on_cpu(kv_heads):
    """``meshpilot::sdpa`` and its backward equal ``F.scaled_dot_product_attention`` exactly on CPU (the same
    kernel call), grouped-query attention included: fewer key/value heads are passed to the kernel as eager
    passes them, not repeated and summed back."""
    from meshpilot.ops import attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 16, 8, generator=g, requires_grad=True) for _ in range(2))
    gqa = kv_heads != 4
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    grad = torch.randn(want.shape, generator=g)
    dq, dk, dv = torch.autograd.grad(want, (q, k, v), grad)
    with torch.no_grad():
        out, lse = attention.sdpa(q, k, v, None, True, None, gqa)
        got = attention.sdpa_backward(grad, q, k, v, out, lse, None, True, None, gqa)
    assert attention._grouped(q, k, v, None, True, 8**-0.5) == gqa  # the kernel takes the fewer heads
    assert torch.equal(out, want)
    for a, b in zip(got, (dq, dk, dv)):
        assert a.shape == b.shape and torch.equal(a, b)


def test_attention_with_dropout_and_a_boolean_mask_is_eager_attention():
    """With dropout the captured call is the math composite, which adds its mask as it is: a boolean mask
    (True = attend, what Hugging Face passes while traced) must reach it as 0 / -inf, as the public
    ``F.scaled_dot_product_attention`` converts it — added as 0 / 1 it masked nothing (found on HF GPT-2)."""
    from meshpilot.ops.attention import captured_sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    torch.manual_seed(3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.25)
    torch.manual_seed(3)
    got = captured_sdpa(q, k, v, mask, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.manual_seed(3)
    unmasked = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    assert not torch.allclose(got, unmasked, atol=1e-3)  # the mask mattered


SET_LOOP = """
import sys, torch
from meshpilot.graph.capture import capture

KEYS = ["alpha", "beta", "gamma", "delta", "eps"]


class SetLoop(torch.nn.Module):
    # each key of a set of strings builds its own op: a product with its own weight, of its own width
    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.randn(8, 4 + i)) for i, k in enumerate(KEYS)})

    def forward(self, x):
        outs = {k: (x @ self.w[k]).sin() * (len(k) + 1.0) for k in set(KEYS)}
        return sum(outs[k].sum() for k in KEYS)


MAKE = {
    "alpha": lambda x: x.cumsum(-1),
    "beta": lambda x: (x > 0).float() * x,
    "gamma": lambda x: x.flip(-1) * 2.0,
    "delta": lambda x: torch.tanh(x),
    "eps": lambda x: x.softmax(-1),
}


class Made(torch.nn.Module):
    # each key of a set of strings runs its own function on the input; a weight reads them in the list's order
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        made = {}
        for k in set(KEYS):
            made[k] = MAKE[k](x)
        return sum((made[k] @ self.w).sum() for k in KEYS)


class Named(Made):
    # the set held in a variable first (transformers' create_masks_for_generate: patterns = set(...))
    def forward(self, x):
        made, kinds = {}, set(KEYS)
        for k in kinds:
            made[k] = MAKE[k](x)
        return sum((made[k] @ self.w).sum() for k in KEYS)


torch.manual_seed(0)
print(",".join(set(KEYS)))
for model in (SetLoop(), Made(), Named()):
    g = capture(model, [torch.randn(2, 8)], stacked=False)
    print(g.fingerprint())
    print(" ".join(n.name for n in g.nodes))
"""


def test_a_loop_over_a_set_of_strings_captures_the_same_graph_under_every_hash_seed(tmp_path):
    """The set's order follows the process' hash seed (random per torchrun rank): two processes with seeds 0
    and 1 iterate it in different orders, and capture the same graph, node for node and name for name — a
    loop running one function per element (its own weight), and one running a different function per element
    (Llama-4's masks: ``masks[t] = make[t]()``), whose iterations repeat no one op sequence, also over a set
    held in a variable first (Gemma-4's masks, by transformers' ``create_masks_for_generate``)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    script = tmp_path / "set_loop.py"  # a file: capture reads the loop from the model's source
    script.write_text(SET_LOOP)
    outs = []
    for seed in ("0", "1"):
        env = {
            **os.environ,
            "PYTHONHASHSEED": seed,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        outs.append(done.stdout.splitlines())
    (order0, *graphs0), (order1, *graphs1) = outs
    assert order0 != order1  # the two processes did iterate the set differently
    assert graphs0[:2] == graphs1[:2]  # one function per element
    assert graphs0[2:4] == graphs1[2:4]  # a different function per element
    assert graphs0[4:] == graphs1[4:]  # ... over a set held in a variable


class _SlidingChunks(nn.Module):
    """Longformer's sliding-window scores: the sequence cut into overlapping chunks of 2w (overlap w) with
    ``as_strided``, the values into chunks of 3w, from a tensor transposed for the heads."""

    def __init__(self, d: int = 8, heads: int = 2, w: int = 2) -> None:
        super().__init__()
        self.q, self.v, self.heads, self.w = nn.Linear(d, d), nn.Linear(d, d), heads, w

    def forward(self, x):
        (b, s, d), w, h = x.shape, self.w, self.heads
        q = self.q(x).view(b, s, h, d // h).transpose(1, 2)  # (b, h, s, hd): strides of a transpose
        n = b * h * s * (d // h)
        chunks = q.as_strided((b, h, s // w - 1, 2 * w, d // h), (n // b, d // h, w * d, d, 1))
        scores = torch.einsum("bhcxd,bhcyd->bhcxy", chunks, chunks)
        v = F.pad(self.v(x), (0, 0, w, w)).contiguous()  # (b, s + 2w, d)
        values = v.as_strided((b, s // w, 3 * w, d), ((s + 2 * w) * d, w * d, d, 1))
        return scores.square().mean() + values.tanh().mean()


def test_an_overlapping_as_strided_is_captured_as_unfold_and_shards_off_its_window():
    """An ``as_strided`` that reads sliding windows (Longformer's chunks) is the views it is (``unfold`` of
    the sequence, reshapes, a permute): the same elements and gradients as ``as_strided``, and a plan on
    (2, 2) with no fallback, the windows sharded on the dims they do not cross. Forms with no such view (two
    dims of one stride, a slice's storage) are left as ``as_strided``."""
    from meshpilot.api import plan
    from meshpilot.graph.strided import as_views

    torch.manual_seed(0)
    x = torch.randn(2, 8, 2, 4).transpose(1, 2)  # (b, h, s, hd) of a (b, s, h, hd)
    for size, stride, offset in (
        ((2, 2, 3, 4, 4), (64, 4, 16, 8, 1), None),  # Longformer's query chunks, w = 2
        ((2, 2, 2, 3), (64, 4, 16, 8), 1),  # windows of 3 by 2 of one element of each head
        ((2, 8, 2), (64, 8, 4), 2),  # no window: one element of each head
    ):
        leaf = x.detach().clone().requires_grad_()
        views, strided = as_views(leaf, size, stride, offset), leaf.as_strided(size, stride, offset)
        assert views is not None and torch.equal(views, strided), (size, stride)
        weight = torch.randn(size)
        (g_views,) = torch.autograd.grad((views * weight).sum(), leaf)
        (g_strided,) = torch.autograd.grad((strided * weight).sum(), leaf)
        torch.testing.assert_close(g_views, g_strided)
    assert as_views(x, (3, 3), (1, 1)) is None  # two dims of one stride
    assert as_views(torch.randn(4, 6)[:, 1:], (2, 2), (1, 1)) is None  # a slice: no order of its dims is contiguous

    model, inputs = _SlidingChunks(), (torch.randn(4, 8, 8),)
    targets = {n.target for n in capture(model, inputs).nodes}
    assert "aten.unfold.default" in targets and "aten.unfold_backward.default" in targets
    assert not {t for t in targets if "as_strided" in t}, targets
    sp = plan(model, inputs, "dgx-h100", mesh_shape=(2, 2), mappings=("row",)).only
    assert not sp.fallbacks, [f.line() for f in sp.fallbacks]
    unfolds = [c for c in sp.nodes if c.target == "aten.unfold.default"]
    assert unfolds and all(any(p.startswith("S") for p in c.ins[0]) for c in unfolds), [c.short() for c in unfolds]


class _Branches(nn.Module):
    """Three independent copies of one computation of x, then a chain of that computation, each reading the last."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = (torch.relu(x) * 2 for _ in range(3))
        y = a + b + c
        for _ in range(4):
            y = torch.relu(y) * 2
        return y


def test_independent_repeats_finds_the_branches_and_not_the_chain():
    """``order._independent_repeats``: the three branches are one run (period 2: relu, mul), the chain none —
    each of its repetitions reads the one before (the first node of the next span reads the span)."""
    from meshpilot.graph.order import _independent_repeats

    nodes = list(torch.fx.symbolic_trace(_Branches()).graph.nodes)
    ops = [str(n.target.__name__) if callable(n.target) else str(n.target) for n in nodes]
    assert ops[1:7] == ["relu", "mul"] * 3
    assert _independent_repeats(nodes) == [(1, 2, 3)]
