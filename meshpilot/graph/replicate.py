"""Capture a stack of L identical blocks by tracing three or :data:`KEEP` of them and copying a middle one.

The joint trace costs time in proportion to the ops it records, and a transformer's ops are almost all its
blocks': tracing 4 of 32 blocks and laying out the other 28 as copies of the graph's nodes is the capture at a
fraction of the price (``docs/benchmarks.md``, "Capture speed"). :func:`capture_stacked` is the whole path:

1. **The stack** (:func:`find_container`): the longest ``ModuleList`` of more than :data:`KEEP` children of
   one type with the same parameter and buffer shapes, inside no numbered child — ``planner.stack``'s rule —
   whose blocks' plain attributes are alike but for a block counter (:func:`_same_settings`).
2. **The trace**: the model with the list cut to its first :data:`KEEP` blocks (first ``0``, middles ``1``,
   ``2``, last ``3``; restored afterwards), traced as usual. Block 3 stands for the model's last block, L − 1.
3. **The spans** (:class:`_Spans`): nodes belong to a block by the module path the trace stamped on them (the
   backward's by their forward op's); the root's nodes (the backward's sums of the residual stream's
   gradients) by position. Block j's forward span runs from its first node to block j + 1's first; its
   backward span from its first backward node to block j − 1's first backward node.
4. **The check** (:func:`_template`, template 2, reference 1): block 2's spans must be block 1's shifted by
   one block — the same ops with the same constants, where block 2 reads its own node, block 1 reads its own
   at the same place; where block 2 reads block 1 (its input), block 1 reads block 0; where block 2 reads the
   last block (the gradient coming back), block 1 reads block 2; where block 2 reads a parameter, block 1
   reads its own of the same name; anything else (inputs, masks, positions) both read alike. Nothing but the
   blocks after block 2 may read block 2's nodes, nothing but block 0's backward block 1's. No buffer of a
   block updated in place, no parameter shared between blocks; a constant the trace made in a block
   (``get_attr``) holds block 1's value (a copy gets its own constant of that value). Otherwise None, and the
   caller traces the whole model.
5. **The copies** (:func:`_emit`): the L-block graph in the order the whole trace records it — blocks 0, 1,
   2, copies 3 … L − 2, then the last block, its backward, the copies' backward L − 2 … 3, block 2's, 1's
   and 0's. A copy reads its predecessor where block 2 reads block 1, its successor where block 2 reads the
   last block, its own parameters (placeholders in the whole model's order); the last block reads copy
   L − 2 where it read block 2. Module paths are renamed (``blocks.2.attn`` → ``blocks.7.attn``); fake
   values are shared with the template. Names are renumbered in order (``compat.GraphCopy``), as the whole
   trace's are: the tests hold the result to the whole trace node for node.

6. **Three blocks first** (:data:`TRIES`): the model cut to blocks 0, 1 and the last (``2``) is traced, and
   block 1 is the template, checked against the last block shifted back by one — where block 1 reads block 0
   (its input), the last block reads block 1 at the same place; where block 1 reads the last block (the
   gradient coming back), the last block reads a node of neither (the head's); parameters by name, anything
   else alike (:func:`_template`, template 1, reference 2, the gradient read from the reference). The last
   block's forward span is as long as block 1's, its backward span runs from its first backward node to block
   1's. Nothing but blocks 1 and 2, block 0's backward and the outputs may read block 1's nodes, nothing but
   blocks 1 and 2, the head and the outputs the last block's. The copies 2 … L − 2 are then made of block 1 as
   above (2 → 1, 3 → 2: :func:`_emit` with ``keep=3``). A model whose last block differs from a middle one
   fails these checks and is traced with four blocks as above (a second trace, of four blocks), and failing
   those, whole. One block less traced is a quarter of the blocks' trace saved on the planning benchmark
   (issue 33 item 4).

What a trace of 4 blocks cannot see: a forward whose code reads the number of blocks (a scale of 1/√L
inside a block) traces 4's, and a block that behaves apart by its index without an attribute saying so
(``config.layer_types[self.layer_idx]`` read in the forward) is copied as a middle one.
``capture(..., stacked=False)`` traces every block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils import _pytree as pytree

from meshpilot import compat

KEEP = 4
"""Blocks traced: the first, two middles (the template and the one it is checked against), the last."""

THREE = 3
"""Blocks traced first: the first, one middle (the template), the last, which the template is checked against
(module docstring, 6)."""

TRIES = (THREE, KEEP)
"""The cuts traced in turn until one passes the checks; none passes: the whole model is traced."""


@dataclass(frozen=True)
class Site:
    """The repeated stack: the ``ModuleList`` at ``name`` with ``blocks`` children."""

    name: str
    blocks: int


def find_container(model: torch.nn.Module, keep: int = KEEP) -> Site | None:
    """The longest list of more than `keep` identical blocks (module docstring, 1), or None."""

    def sig(m: torch.nn.Module) -> tuple:
        return type(m), tuple((k, tuple(v.shape), v.dtype) for k, v in m.state_dict(keep_vars=True).items())

    best: Site | None = None
    for name, child in model.named_modules():
        outer = bool(name) and not any(part.isdigit() for part in name.split("."))
        if not (outer and isinstance(child, torch.nn.ModuleList) and len(child) > keep):
            continue
        alike = len({sig(b) for b in child}) == 1 and _same_settings(list(child))
        if alike and (best is None or len(child) > best.blocks):
            best = Site(name, len(child))
    return best


_SETTING = (bool, int, float, str, type(None))


def _same_settings(blocks: list[torch.nn.Module]) -> bool:
    """Every block's plain attributes (of it and its submodules: flags, sizes, names) are alike, but for a
    number that counts the blocks (Hugging Face's ``layer_idx``). A block set apart by a flag (a sliding-window
    or a global-attention layer every few, ``attention_type``) is not a copy of a middle block: the stack is
    traced whole, as the four traced blocks could not show it."""
    seen: dict[tuple[str, str], list] = {}
    for block in blocks:
        for path, m in block.named_modules():
            for attr, value in vars(m).items():
                if not attr.startswith("_") and isinstance(value, _SETTING):
                    seen.setdefault((path, attr), []).append(value)
    for values in seen.values():
        if len(values) != len(blocks):
            return False
        if len(set(values)) == 1:
            continue
        ints = all(type(v) is int for v in values)
        if not (ints and all(v - values[0] == j for j, v in enumerate(values))):
            return False
    return True


@contextlib.contextmanager
def cut(model: torch.nn.Module, site: Site, keep: int = KEEP) -> Iterator[None]:
    """The model with the stack's list holding its first `keep` blocks only, restored on leaving."""
    parent_name, _, attr = site.name.rpartition(".")
    parent = model.get_submodule(parent_name)
    full = getattr(parent, attr)
    setattr(parent, attr, torch.nn.ModuleList(list(full)[:keep]))
    try:
        yield
    finally:
        setattr(parent, attr, full)


def _block_of(path: str | None, prefix: str) -> int | None:
    """``blocks.3.attn`` -> 3 for prefix ``blocks.``; None outside the stack."""
    if not path or not path.startswith(prefix):
        return None
    head = path[len(prefix) :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _module(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if isinstance(stack, dict) and stack else None


def _renamed(meta: dict, prefix: str, old: int, new: int) -> dict:
    """`meta` with module paths of block `old` moved to block `new`."""
    stack = meta.get("nn_module_stack")
    if not isinstance(stack, dict) or not stack:
        return dict(meta)
    src, dst = f"{prefix}{old}", f"{prefix}{new}"

    def move(path: str) -> str:
        return dst + path[len(src) :] if path == src or path.startswith(src + ".") else path

    return {**meta, "nn_module_stack": {k: (move(v[0]), *v[1:]) for k, v in stack.items()}}


@dataclass
class _Spans:
    """Block 1's and 2's forward and backward spans in the traced graph's op order (module docstring, 3)."""

    ops: list[torch.fx.Node]
    f1: range
    f2: range
    b2: range
    b1: range
    label: dict[torch.fx.Node, int | None]

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, prefix: str, keep: int) -> _Spans | None:
        ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        label = {n: _block_of(_module(n), prefix) for n in ops}
        first = [next((i for i, n in enumerate(ops) if label[n] == j), None) for j in range(keep)]
        if None in first or first != sorted(first):
            return None
        back = [next((i for i in range(first[-1], len(ops)) if label[ops[i]] == j), None) for j in range(3)]
        if None in back or not back[2] < back[1] < back[0]:
            return None
        return cls(ops, range(first[1], first[2]), range(first[2], first[3]), range(back[2], back[1]),
                   range(back[1], back[0]), label)  # fmt: skip

    @classmethod
    def of_three(cls, gm: torch.fx.GraphModule, prefix: str) -> _Spans | None:
        """Block 1's spans (the template) and the last block's (block 2), of a trace of three blocks: the last
        block's forward span as long as block 1's, its backward from its first backward node to block 1's."""
        ops = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
        label = {n: _block_of(_module(n), prefix) for n in ops}
        first = [next((i for i, n in enumerate(ops) if label[n] == j), None) for j in range(3)]
        if None in first or first != sorted(first):
            return None
        f1 = range(first[1], first[2])
        f2 = range(first[2], first[2] + len(f1))
        back = [next((i for i in range(f2.stop, len(ops)) if label[ops[i]] == j), None) for j in range(3)]
        if None in back or not back[2] < back[1] < back[0]:
            return None
        return cls(ops, f1, f2, range(back[2], back[1]), range(back[1], back[0]), label)

    def members(self, j: int) -> list[torch.fx.Node]:
        fwd, bwd = (self.f1, self.b1) if j == 1 else (self.f2, self.b2)
        return [self.ops[i] for i in (*fwd, *bwd)]

    def sound(self, root_paths: set[str | None]) -> bool:
        """Each span holds its block's nodes and the root's only, all of the block's, ops and traced constants."""
        for j in (1, 2):
            inside = self.members(j)
            if len([n for n in self.ops if self.label[n] == j]) != sum(self.label[n] == j for n in inside):
                return False
            for n in inside:
                if self.label[n] != j and _module(n) not in root_paths:
                    return False
                if n.op != "call_function" and not (n.op == "get_attr" and n.target.startswith(compat._CONSTANT)):
                    return False
        return len(self.f1) == len(self.f2) and len(self.b1) == len(self.b2)


@dataclass
class _Template:
    """Block 2 as the pattern of every middle block: for each of its nodes' node arguments, what it reads."""

    nodes: list[torch.fx.Node]
    """Block 2's span nodes in order (forward then backward)."""
    pos: dict[torch.fx.Node, int]
    """Block 2's node -> its place in :attr:`nodes`."""
    prev: dict[torch.fx.Node, int]
    """Block 1's node block 2 reads -> the place of the node at the same place in block 2."""
    nxt: dict[torch.fx.Node, int]
    """The last block's node block 2 reads -> the place in block 2 of what block 1 reads there."""
    params: dict[str, str]
    """Block 2's parameter or buffer name -> its suffix (``attn.q.weight``)."""


def _same_constant(gm: torch.fx.GraphModule, a: torch.fx.Node, b: torch.fx.Node) -> bool:
    x, y = getattr(gm, a.target), getattr(gm, b.target)
    return x.dtype == y.dtype and x.shape == y.shape and bool(torch.equal(x, y))


def _template(
    gm: torch.fx.GraphModule,
    spans: _Spans,
    names: dict[torch.fx.Node, str],
    prefix: str,
    tmpl: int,
    ref: int,
    grad_from_ref: bool,
) -> _Template | None:
    """Block `tmpl` checked against block `ref` node for node (module docstring, 4 and 6), or None.

    Two reads cross between the checked blocks: the template reads a node of the reference block where the
    reference reads a node of neither (A), and the reference reads a node of the template where the template
    reads one of neither (B). One is the template's input (its predecessor's node, :attr:`_Template.prev`),
    the other the gradient coming back (its successor's, :attr:`_Template.nxt`). Of four traced blocks
    (template 2, reference 1) A is the input and B the gradient; of three (template 1, reference the last
    block, 2) A is the gradient (`grad_from_ref`) and B the input."""
    mine, other = spans.members(tmpl), spans.members(ref)
    pos = {n: k for k, n in enumerate(mine)}
    pos_ref = {n: k for k, n in enumerate(other)}
    prev: dict[torch.fx.Node, int] = {}
    nxt: dict[torch.fx.Node, int] = {}
    read_a, read_b = (nxt, prev) if grad_from_ref else (prev, nxt)
    params: dict[str, str] = {}
    for n, r in zip(mine, other):
        if n.op != r.op or (n.target != r.target if n.op != "get_attr" else not _same_constant(gm, n, r)):
            return None
        leaves, spec = pytree.tree_flatten((n.args, n.kwargs))
        leaves_ref, spec_ref = pytree.tree_flatten((r.args, r.kwargs))
        if spec != spec_ref:
            return None
        for a, b in zip(leaves, leaves_ref):
            if not isinstance(a, torch.fx.Node):
                if isinstance(b, torch.fx.Node) or type(b) is not type(a) or b != a:
                    return None
            elif a in pos:  # its own node
                if pos_ref.get(b) != pos[a]:
                    return None
            elif a in pos_ref:  # A
                if not isinstance(b, torch.fx.Node) or b.op == "placeholder" or b in pos_ref or b in pos:
                    return None
                read_a[a] = pos_ref[a]
            elif isinstance(b, torch.fx.Node) and b in pos:  # B
                if a.op == "placeholder" or read_b.setdefault(a, pos[b]) != pos[b]:
                    return None
            elif a.op == "placeholder" and _block_of(names.get(a), prefix) == tmpl:
                suffix = names[a][len(f"{prefix}{tmpl}.") :]
                if names.get(b) != f"{prefix}{ref}.{suffix}":
                    return None
                params[names[a]] = suffix
            elif a is not b or (a.op == "placeholder" and _block_of(names.get(a), prefix) is not None):
                return None
    return _Template(mine, pos, prev, nxt, params)


def _local(spans: _Spans) -> bool:
    """Block 2's nodes are read by blocks 1 and 2, what lies between block 2's forward and backward spans (of
    four traced blocks the last block, of three the head) and the outputs only; block 1's by blocks 1 and 2,
    block 0's backward and the outputs (module docstring, 4 and 6)."""
    where = {n: i for i, n in enumerate(spans.ops)}
    inside = set(spans.members(1)) | set(spans.members(2))
    last = range(spans.f2.stop, spans.b2.start)
    for j, allowed in ((2, lambda i: i in last), (1, lambda i: i >= spans.b1.stop)):
        for n in spans.members(j):
            for user in n.users:
                if user.op != "output" and user not in inside and not allowed(where[user]):
                    return False
    return True


@dataclass
class _Flat:
    """The traced graph's flat arguments and outputs: argument names, which receive a gradient, how many
    forward outputs come before the gradients."""

    names: list[str]
    has_grad: list[bool]
    n_forward: int


def _emit(
    gm: torch.fx.GraphModule,
    spans: _Spans,
    t: _Template,
    flat: _Flat,
    full_names: list[str],
    prefix: str,
    blocks: int,
    keep: int = KEEP,
) -> tuple[torch.fx.GraphModule, list[bool]] | None:
    """The `blocks`-block graph from the one traced with `keep` blocks (module docstring, 5 and 6) and which of
    `full_names` receive a gradient; None when a gradient of the template block is not made inside it."""
    L, out = blocks, compat.GraphCopy(gm)
    T, LB = keep - 2, keep - 1  # the template block and the traced last block
    if keep == KEEP:  # the template's spans; what reads it and is rewired to copy L - 2 (the last block)
        tf, tb, rewired = spans.f2, spans.b2, range(spans.f2.stop, spans.b2.start)
    else:
        tf, tb, rewired = spans.f1, spans.b1, range(spans.f2.start, spans.b2.stop)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = dict(zip(flat.names, placeholders))
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    new_ph: dict[str, torch.fx.Node] = {}
    source: dict[str, str] = {}
    for i, name in enumerate(full_names):
        b = _block_of(name, prefix)
        rest = name[len(f"{prefix}{b}.") :] if b is not None else ""
        src = name if b is None or b <= T else f"{prefix}{LB if b == L - 1 else T}.{rest}"
        source[name] = src
        new_ph[name] = out.placeholder(f"arg{i}_1", by_name[src].meta)
        if b is None or b <= T or b == L - 1:
            env[by_name[src]] = new_ph[name]
    copies = {m: [None] * len(t.nodes) for m in range(T + 1, L - 1)}
    n_fwd = len(tf)

    def emit_copy(m: int, part: range) -> None:
        def arg(a: torch.fx.Node) -> torch.fx.Node:
            if a in t.pos:
                return copies[m][t.pos[a]]
            if a in t.prev:
                return env[t.nodes[t.prev[a]]] if m == T + 1 else copies[m - 1][t.prev[a]]
            if a in t.nxt:
                return env[a] if m == L - 2 else copies[m + 1][t.nxt[a]]
            if a.op == "placeholder" and by_name_of.get(a) in t.params:
                return new_ph[f"{prefix}{m}.{t.params[by_name_of[a]]}"]
            return env[a]

        for k in part:
            node = t.nodes[k]
            copies[m][k] = out.copy(node, arg, _renamed(node.meta, prefix, T, m))

    by_name_of = {ph: name for name, ph in by_name.items()}
    for i, n in enumerate(spans.ops):
        if i == tb.start:
            for m in range(L - 2, T, -1):
                emit_copy(m, range(n_fwd, len(t.nodes)))
        if n in t.pos:
            env[n] = out.copy(n, lambda a: copies[T + 1][t.nxt[a]] if a in t.nxt else env[a])
        else:
            rewire = i in rewired
            meta = _renamed(n.meta, prefix, LB, L - 1) if spans.label[n] == LB else None
            env[n] = out.copy(
                n, lambda a, rewire=rewire: copies[L - 2][t.pos[a]] if rewire and a in t.pos else env[a], meta
            )
        if i == tf.stop - 1:
            for m in range(T + 1, L - 1):
                emit_copy(m, range(n_fwd))
    outs = list(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    grads = dict(zip([name for name, g in zip(flat.names, flat.has_grad) if g], outs[flat.n_forward :]))
    result = [env[o] for o in outs[: flat.n_forward]]
    has_grad = []
    for name in full_names:
        g = grads.get(source[name])
        has_grad.append(g is not None)
        if g is None:
            continue
        b = _block_of(name, prefix)
        if b is not None and T + 1 <= b <= L - 2:
            if g not in t.pos:
                return None
            result.append(copies[b][t.pos[g]])
        else:
            result.append(env[g])
    out.graph.output(tuple(result))
    return out.module(), has_grad


def extend(
    joint: compat.JointExport, flat_names: list[str], full_names: list[str], site: Site, keep: int = KEEP
) -> compat.JointExport | None:
    """The joint export of the whole model (`full_names` its flat arguments) from that of its first `keep`
    blocks (`flat_names`), or None when the traced blocks do not pass the checks of the module docstring."""
    prefix = site.name + "."
    gm = joint.gm
    three = keep == THREE
    spans = _Spans.of_three(gm, prefix) if three else _Spans.of(gm, prefix, keep)
    parts = site.name.split(".")
    roots = {None, "", *(".".join(parts[:k]) for k in range(1, len(parts)))}
    if spans is None or not spans.sound(roots):
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = dict(zip(placeholders, flat_names))
    t = _template(gm, spans, names, prefix, *((1, 2, True) if three else (2, 1, False)))
    if t is None or not _local(spans):
        return None
    if any(_block_of(flat_names[i], prefix) is not None for i in joint.mutated_inputs):
        return None  # a block's buffer updated in place (BatchNorm's statistics): traced whole
    flat = _Flat(flat_names, joint.has_grad, len(joint.mutated_inputs) + 1)
    if not _grads_match(joint, flat, spans, t, prefix, keep):
        return None
    made = _emit(gm, spans, t, flat, full_names, prefix, site.blocks, keep)
    if made is None:
        return None
    index = {name: i for i, name in enumerate(full_names)}
    mutated = [index[flat_names[i]] for i in joint.mutated_inputs]
    return compat.JointExport(made[0], mutated, made[1])


def _grads_match(
    joint: compat.JointExport, flat: _Flat, spans: _Spans, t: _Template, prefix: str, keep: int = KEEP
) -> bool:
    """The template's parameters' gradients are made in its span, the other checked block's at the same places
    in its own (blocks 2 and 1; of three traced, 1 and 2)."""
    outs = list(next(n for n in joint.gm.graph.nodes if n.op == "output").args[0])
    grads = dict(zip([name for name, g in zip(flat.names, flat.has_grad) if g], outs[flat.n_forward :]))
    mine, other = (2, 1) if keep == KEEP else (1, 2)
    twins = spans.members(other)
    for name, g in grads.items():
        if _block_of(name, prefix) != mine:
            continue
        twin = grads.get(f"{prefix}{other}.{name[len(prefix) + 2 :]}")
        if g not in t.pos or twin is None or twins[t.pos[g]] is not twin:
            return False
    return True


def capture_stacked(trace: Callable[[], tuple], model: torch.nn.Module, full_names: list[str]):
    """``trace()`` of the model cut to :data:`KEEP` blocks, extended to the whole stack; None when the model
    has no stack of more than :data:`KEEP` blocks, the cut model fails to trace, or the checks fail.
    ``trace`` returns ``(joint export, flat argument names, ...)``: so does this, for the whole model."""
    site = find_container(model)
    if site is None:
        return None
    for keep in TRIES:
        with cut(model, site, keep):
            try:
                traced = trace()
            except Exception:  # noqa: BLE001 - a forward that needs all its blocks: the caller traces them all
                return None
        joint = extend(traced[0], traced[1], full_names, site, keep)
        if joint is not None:
            return (joint, full_names, *traced[2:])
    return None
