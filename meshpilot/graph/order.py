"""One model and its inputs, one graph in every process: the captured graph's order and names made independent of
the order Python happened to run independent work in.

A forward that iterates a set (transformers' ``for t in set(config.layer_types)``) runs its iterations in an
order that follows the process' hash seed (``PYTHONHASHSEED``, random per torchrun rank), so two processes
tracing the same model would name and order their nodes differently, and a plan made in one (it names its
nodes) would be refused by the others. :func:`meshpilot.graph.capture.capture` runs two passes after tracing:

* :func:`canonical_order`: a run of back-to-back iterations repeating one (op, source line) sequence, none
  reading another, each reading a parameter or buffer of its own, ordered by those leaves' places (its
  backward in reverse), ties by content;
* :func:`order_set_loops`: the iterations of a loop over a set whose elements run *different* code (each
  node stamped with its loop and element while tracing, ``compat.LOOP``), ordered the same way, then by the
  element.

Each reordered span gives its names out by position (the same set of names in every process), so names agree
too. Graphs without such loops are left as traced.
"""

from __future__ import annotations

import logging
import re

import torch
from torch.fx.node import map_arg

from meshpilot import compat

_log = logging.getLogger(__name__)


def canonical_order(gm: torch.fx.GraphModule) -> None:
    """Order (and name) the iterations of a loop over an unordered collection by what they compute, not by when
    the trace ran them, so that one model and its inputs give one graph in every process.

    A forward that iterates a set of strings (transformers' ``for t in set(config.layer_types)``) runs the same
    code once per element, in an order that follows the process' hash seed (``PYTHONHASHSEED``, random per
    torchrun rank). Each iteration is a contiguous run of nodes with the same (op, source line) sequence, none
    reading another (:func:`_independent_repeats`), and each reads state of its own: a parameter or buffer no
    other iteration reads (the element's rotary frequencies, its weight). Such a run is ordered by those
    leaves' places; the backward of an ordered run (iterations that read distinct iterations of it) by the
    reverse of theirs, as autograd runs the last forward first; ties by content (:func:`_iteration_key`). The
    node at each position keeps the name its position had: the names follow the (op, line) sequence, which
    the hash seed does not change. Other runs (a function called on two activations, ``repeat_kv(k)`` then
    ``repeat_kv(v)``) and every graph without such a loop keep the trace's order and names.
    """
    nodes = list(gm.graph.nodes)
    iteration_of: dict[torch.fx.Node, tuple[int, int]] = {}  # a node of an ordered run -> (run, iteration)
    at = {n: i for i, n in enumerate(nodes)}
    moved = False
    for start, period, count in _independent_repeats(nodes):
        end = start + period * count
        its = [nodes[start + b * period : start + (b + 1) * period] for b in range(count)]
        outside = [{a for n in it for a in n.all_input_nodes} - set(it) for it in its]
        own = _own_leaves(outside)
        follows = [frozenset(iteration_of[a] for a in r if a in iteration_of) for r in outside]
        if all(own):  # each iteration reads a parameter or buffer of its own: by their places
            firsts = [tuple(sorted(at[a] for a in o)) for o in own]
        elif all(follows) and len(set(follows)) == count:  # the backward of an ordered run: in reverse
            firsts = [tuple(sorted(-at[a] for a in r if a in iteration_of)) for r in outside]
        else:
            continue
        iteration_of.update((n, (start, b)) for b, it in enumerate(its) for n in it)
        keys = [(firsts[b], _iteration_key(its[b], at, end)) for b in range(count)]
        order = sorted(range(count), key=keys.__getitem__)
        if order == list(range(count)):
            continue
        new = [n for b in order for n in its[b]]
        names = [n.name for n in nodes[start:end]]
        _move_span(nodes, at, start, new)
        for n, name in zip(new, names):  # the position's name (a permutation: every name stays used once)
            _rename(gm, n, name)
        moved = True
        _log.debug(
            "ordered %d iterations of %d nodes at %s (%s)", count, period, names[0], compat.stamped_place(new[0])[1]
        )
    if moved:
        gm.graph.lint()
        gm.recompile()


def order_set_loops(gm: torch.fx.GraphModule) -> None:
    """Order (and name) the iterations of each loop over a set by the set's elements, where the iterations
    compute different things: ``for t in set(config.layer_types): masks[t] = make[t]()`` calls a different
    function per element (Llama-4's causal and chunked masks), so its iterations repeat no one op sequence and
    :func:`canonical_order` does not see them.

    Capture stamps each node the model's code made inside such a loop with the loop, its frame and the element
    (``capture._user_frame``, ``node.meta["custom"]``). One run of the loop is a contiguous span of nodes of one
    loop and frame, each element's nodes contiguous (:func:`_set_loop_runs`). Where no iteration reads
    another's nodes, the iterations are put in the order of (the places of the parameters and buffers each
    alone reads, its element's ``repr``): the first is :func:`canonical_order`'s, which a run it ordered
    keeps. Each node then takes, of the names its op's nodes (``index``, ``index_3``, …) had in the span, the
    one of its rank: the span holds the same names in every process, so the names come out the same too."""
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    moved = False
    for start, groups in _set_loop_runs(nodes):
        members = [set(g) for _, g in groups]
        inside = set().union(*members)
        outside = [{a for n in g for a in n.all_input_nodes} - m for (_, g), m in zip(groups, members)]
        if any(r & inside for r in outside):
            continue  # an iteration reads another's: the order is the program's
        keys = [(tuple(sorted(at[a] for a in o)), element) for o, (element, _) in zip(_own_leaves(outside), groups)]
        order = sorted(range(len(groups)), key=keys.__getitem__)
        if order == list(range(len(groups))):
            continue
        new = [n for b in order for n in groups[b][1]]
        _rename_by_rank(gm, nodes[start : start + len(new)], new)
        _move_span(nodes, at, start, new)
        moved = True
        _log.debug("ordered %d iterations of a loop over a set at %s", len(groups), compat.stamped_place(new[0])[1])
    if moved:
        gm.graph.lint()
        gm.recompile()


def _set_loop_runs(nodes: list[torch.fx.Node]) -> list[tuple[int, list[tuple[str, list[torch.fx.Node]]]]]:
    """(start, [(element, its nodes), …]) of each run of a loop over a set in `nodes`, in the trace's order: a
    contiguous span of forward nodes stamped with one loop and frame (``compat.LOOP``), cut where the element
    changes into iterations; an element seen again starts a new run (the same loop run again by a frame at the
    same address). Runs of one iteration are left out."""
    runs: list[tuple[int, list[tuple[str, list[torch.fx.Node]]]]] = []
    cur: tuple | None = None
    start, groups, seen = 0, [], set()

    def close() -> None:
        if len(groups) > 1:
            runs.append((start, list(groups)))

    for i, n in enumerate(nodes):
        custom = n.meta.get("custom")
        tag = custom.get(compat.LOOP) if isinstance(custom, dict) and n.op in ("call_function", "get_attr") else None
        if tag is None or n.meta.get("autograd_backward"):
            close()
            cur, groups, seen = None, [], set()
            continue
        loop, element = tag[:2], tag[2]
        if loop != cur or (element != groups[-1][0] and element in seen):
            close()
            cur, start, groups, seen = loop, i, [], set()
        if not groups or groups[-1][0] != element:
            groups.append((element, []))
            seen.add(element)
        groups[-1][1].append(n)
    close()
    return runs


_NAME = re.compile(r"(.*?)_?(\d*)")


def _rename_by_rank(gm: torch.fx.GraphModule, old: list[torch.fx.Node], new: list[torch.fx.Node]) -> None:
    """Rename the nodes of a reordered span: `old` in the trace's order, `new` the same nodes in the new one.
    The names of each stem (``index``, ``index_1``, … ``_tensor_constant0``, …) are given out in the new
    order by their number, so the result depends on the set of names only, not on which node had which."""

    def stem(name: str) -> tuple[str, int]:
        base, number = _NAME.fullmatch(name).groups()
        return base, int(number) if number else -1

    names: dict[str, list[tuple[int, str]]] = {}
    for n in old:
        base, number = stem(n.name)
        names.setdefault(base, []).append((number, n.name))
    for v in names.values():
        v.sort(reverse=True)
    for n in new:  # every name of the span given out once: a permutation of them
        _rename(gm, n, names[stem(n.name)[0]].pop()[1])


def _rename(gm: torch.fx.GraphModule, n: torch.fx.Node, name: str) -> None:
    """Give `n` a name of the graph's that another node of a reordered span had (so no clash is left behind)."""
    n.name = name
    gm.graph._graph_namespace._obj_to_name[n] = name


def _own_leaves(outside: list[set[torch.fx.Node]]) -> list[set[torch.fx.Node]]:
    """Per iteration (`outside`: the nodes each reads from outside itself), the parameters and buffers
    (placeholders) it reads and no other iteration does."""
    leaves = [{a for a in r if a.op == "placeholder"} for r in outside]
    return [leaves[b] - set().union(*(leaves[c] for c in range(len(leaves)) if c != b)) for b in range(len(leaves))]


def _move_span(nodes: list[torch.fx.Node], at: dict[torch.fx.Node, int], start: int, new: list[torch.fx.Node]) -> None:
    """Put the span of `nodes` from `start` in the graph in the order `new` (the same nodes); `nodes` and the
    positions `at` follow. The output node ends the graph, so a span never reaches it: its next node exists."""
    end = start + len(new)
    after = nodes[end]
    for n in new:  # each node moved before the span's next node: the span in its new order
        after.prepend(n)
    nodes[start:end] = new
    at.update((n, start + i) for i, n in enumerate(new))


_PERIOD_TRIES = 8
"""How many next nodes of the same (op, line) :func:`_independent_repeats` tries as the end of a repetition (a
loop body repeats one op several times: the first is not always the next iteration's start)."""


def _independent_repeats(nodes: list[torch.fx.Node]) -> list[tuple[int, int, int]]:
    """(start, period, count) of every run of `nodes` that repeats one (op, source line) sequence `count` ≥ 2
    times back to back, no repetition reading a node of another. Found left to right from each position's
    next nodes of the same (op, line); a run found is skipped over (its iterations are not searched inside)."""
    sig = [(n.op, n.target if n.op == "call_function" else None, compat.stamped_place(n)[1]) for n in nodes]
    sig = [s if s[0] in ("call_function", "get_attr") else (i,) for i, s in enumerate(sig)]  # leaves never repeat
    ids: dict[tuple, int] = {}
    sig = [ids.setdefault(s, len(ids)) for s in sig]  # equal signatures, equal ints: slices compare in C
    pos = {n: i for i, n in enumerate(nodes)}
    nxt, last = [-1] * len(nodes), {}
    for i in range(len(nodes) - 1, -1, -1):
        nxt[i] = last.get(sig[i], -1)
        last[sig[i]] = i
    ins = [[pos[a] for a in n.all_input_nodes] for n in nodes]
    latest = [max(r, default=-1) for r in ins]  # the latest node each reads (one before it)

    def reads(lo: int, hi: int, first: int) -> bool:
        """Whether a node in [lo, hi) reads one in [first, lo)."""
        return any(first <= p < lo for q in range(lo, hi) for p in ins[q])

    def period(i: int) -> int:
        """The least period (of the first few the next nodes of the same signature give) at which the run from
        `i` repeats once with no dependence between the two repetitions; 0 if none."""
        j = nxt[i]
        for _ in range(_PERIOD_TRIES):
            k = j - i
            if j < 0 or j + k > n:
                return 0
            # node j reading the span before it is a dependence: checked first, as in a stack of blocks (each
            # of its positions tries up to _PERIOD_TRIES periods, each span the same) node j reads its predecessor
            if latest[j] < i and sig[i:j] == sig[j : j + k] and not reads(j, j + k, i):
                return k
            j = nxt[j]
        return 0

    runs, i, n = [], 0, len(nodes)
    while i < n:
        k = period(i)
        if not k:
            i += 1
            continue
        j = i + k
        count = 2
        while i + (count + 1) * k <= n and sig[i:j] == sig[i + count * k : i + (count + 1) * k]:
            if reads(i + count * k, i + (count + 1) * k, i):
                break
            count += 1
        runs.append((i, k, count))
        i += count * k
    return runs


def _iteration_key(iteration: list[torch.fx.Node], at: dict[torch.fx.Node, int], end: int) -> tuple:
    """What one iteration of a run (:func:`_independent_repeats`) computes, independent of where the trace put
    it: per node, the positions (`at`) of the nodes it reads from before the run, its op, its operands inside
    the iteration (as offsets), its other arguments and its output's shape and dtype; then the first position
    that reads it after the run, which ends at `end` (two iterations computing the same differ only there)."""
    offset = {n: i for i, n in enumerate(iteration)}
    rows, first_user = [], len(at)
    for n in iteration:
        refs: list[tuple[int, int]] = []
        map_arg((n.args, n.kwargs), lambda a, refs=refs: refs.append((1, offset[a]) if a in offset else (0, at[a])))
        val = n.meta.get("val")
        out = repr((tuple(val.shape), val.dtype)) if isinstance(val, torch.Tensor) else type(val).__name__
        consts = repr(map_arg((n.args, n.kwargs), lambda _: None))
        rows.append((tuple(r for r in refs if r[0] == 0), str(n.target), tuple(refs), consts, out))
        first_user = min([first_user, *(at[u] for u in n.users if at[u] >= end)])
    return (tuple(rows), first_user)
