"""HiDup's duplex at run time: one phase of two microbatches as one program, interleaved stage by stage.

A duplex schedule (``meshpilot.planner.schedule.duplex``) alternates ``F0[s_k:s_k+1]`` and ``F1[s_k:s_k+1]``,
each stage ending where a collective is issued for the next. The runtime does not run these ranges as
separate calls: a phase's recorded program (``meshpilot.runtime.program``, one microbatch) is copied twice
into one ``fx`` graph, and the copies' ops are ordered by

    (stage, microbatch, position in the recorded program)

under their data dependences (a topological sort that always takes the ready op with the smallest key).
An op's stage is that of the plan node it was recorded for (``meshpilot_tag``); the first collective of a
resharding edge consumed at a stage start ``s_k+1``, with the ops that prepare its input, belongs to stage
``k`` — so microbatch 0's collective is issued at the end of its stage ``k``, microbatch 1's compute of stage
``k`` follows, and the ``wait_tensor`` (an op of the consumer's stage) comes only after it. Functional
collectives run on the backend's own threads (gloo) or stream (NCCL), so that compute overlaps them.

An own op that runs in steps (``meshpilot.ops.OpPart``: the expert-parallel MoE, whose collectives the
schedule cuts around it) is placed the same way: its lead (routing, the dispatch issued) in the stage before
the op's when the op starts a stage, its body (the dispatch's wait, the experts, the combine issued) in the
op's, its tail (the combine's wait, the weighted sum) in the stage of the node after it. So microbatch 1's
dispatch is in flight while microbatch 0's experts run, and microbatch 0's combine while microbatch 1's do.

Why one program instead of running each node range as its own call: a recorded program has no seams at the
stage boundaries (values cross them freely: residuals, saved activations), and an in-flight collective's
``wait_tensor`` must sit in the same program as its issue; one graph keeps both, adds no Python per stage,
and the order is checked by fx's lint like any program.

The ops are exactly the two microbatches' recorded ops, on the same values: results equal running the
microbatches one after the other (:func:`meshpilot.planner.schedule.accumulate`). Parameters are shared
placeholders; `chain` maps a placeholder of microbatch 1 to an output of microbatch 0 (the forward's
buffers: microbatch 1 reads the running statistics microbatch 0 updated, as in accumulation).
"""

from __future__ import annotations

import bisect
import copy
import heapq
import time
from collections.abc import Sequence

import torch
import torch.fx

from meshpilot.ops import OpPart
from meshpilot.runtime.overlap import is_collective, preparation
from meshpilot.runtime.record import PART

MICROBATCH = "meshpilot_microbatch"
"""``node.meta`` key: which microbatch's copy an op of an interleaved program is."""


def overlapped_collectives(gm: torch.fx.GraphModule) -> int:
    """How many collectives of an interleaved program have ops of the other microbatch between their issue
    and their ``wait_tensor``: the ones duplex overlaps with compute."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    nodes = list(gm.graph.nodes)
    count = 0
    for n in nodes:
        if not is_collective(n):
            continue
        end = min((order[w] for w in waits_of(n)), default=len(nodes))
        m = n.meta.get(MICROBATCH)
        between = nodes[order[n] + 1 : end]
        if any(b.meta.get(MICROBATCH) not in (None, m) and b.op == "call_function" for b in between):
            count += 1
    return count


def _stages(gm: torch.fx.GraphModule, starts: Sequence[int], leaves: set[int]) -> dict[torch.fx.Node, int]:
    """Each op's stage (module docstring); untagged ops and the leaves' ops take the stage of the op before."""

    def stage_of(index: int) -> int:
        return max(0, bisect.bisect_right(starts, index) - 1)

    starts_set = set(starts)
    out: dict[torch.fx.Node, int] = {}
    groups: dict[tuple, list[torch.fx.Node]] = {}
    current = 0
    for n in gm.graph.nodes:
        tag = n.meta.get("meshpilot_tag")
        if n.op == "placeholder" or n.op == "get_attr":
            out[n] = 0
            continue
        if isinstance(tag, tuple) and isinstance(tag[0], int) and tag[0] not in leaves:
            part = n.meta.get(PART)
            if part == OpPart.LEAD:  # an own op's lead (its dispatch issued): the stage before the op's
                s = stage_of(tag[0])
                out[n] = s - 1 if tag[0] in starts_set and s > 0 else s
                continue
            # an own op's tail (after its combine's wait) belongs to the stage of the node after it
            current = max(current, stage_of(tag[0] + 1 if part == OpPart.TAIL else tag[0]))
            if tag[1] >= 0:
                groups.setdefault(tag, []).append(n)
        out[n] = current
    for (index, _), group in groups.items():  # an edge consumed at a stage start: issue it a stage earlier
        if index not in starts_set or stage_of(index) == 0:
            continue
        coll = next((n for n in group if is_collective(n)), None)
        if coll is not None:
            for n in preparation(coll, set(group)):
                out[n] = stage_of(index) - 1
    return out


def interleave(
    gm: torch.fx.GraphModule,
    starts: Sequence[int],
    leaves: set[int],
    shared: int = 0,
    chain: dict[int, int] | None = None,
) -> torch.fx.GraphModule:
    """Two copies of `gm` (one microbatch's phase program) as one program ``(*shared placeholders, *the rest
    for microbatch 0, *the rest for microbatch 1) -> (*outputs of 0, *outputs of 1)``, interleaved by the
    stages starting at plan nodes `starts` (module docstring). The first `shared` placeholders are common;
    ``chain[p] = o``: microbatch 1's placeholder ``p`` is microbatch 0's output ``o``; `leaves`: plan node
    indices of leaves (their ops belong to the first stage)."""
    chain = chain or {}
    stage = _stages(gm, sorted(starts), leaves)
    nodes = list(gm.graph.nodes)
    pos = {n: k for k, n in enumerate(nodes)}
    places = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    outs = list(output.args[0])
    body = [n for n in nodes if n.op not in ("placeholder", "output")]

    g = torch.fx.Graph()
    env: list[dict[torch.fx.Node, torch.fx.Node]] = [{}, {}]
    for p in places[:shared]:
        env[0][p] = env[1][p] = g.placeholder(p.name)
    for m in (0, 1):
        for k, p in enumerate(places[shared:], start=shared):
            if m == 1 and k in chain:
                continue
            env[m][p] = g.placeholder(f"{p.name}_mb{m}")
    consts = [n for n in body if n.op == "get_attr"]
    for n in consts:
        env[0][n] = env[1][n] = g.node_copy(n, lambda a: env[0][a])
    ops = [n for n in body if n.op != "get_attr"]

    # microbatch 1's chained placeholders read microbatch 0's outputs: those that are ops are dependences
    chain_env = {places[k]: outs[o] for k, o in chain.items()}
    chained_users: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for p, src in chain_env.items():
        if isinstance(src, torch.fx.Node) and src.op not in ("placeholder", "get_attr"):
            for u in p.users:
                if u.op != "output":
                    chained_users.setdefault(src, []).append(u)
    extra: dict[torch.fx.Node, int] = {}
    for us in chained_users.values():
        for u in us:
            extra[u] = extra.get(u, 0) + 1

    # Kahn's topological sort over both copies, smallest (stage, microbatch, position) first
    users = {n: [u for u in n.users if u.op != "output"] for n in ops}
    waiting: dict[tuple[int, torch.fx.Node], int] = {}
    ready: list[tuple[int, int, int, int]] = []
    for m in (0, 1):
        for n in ops:
            deps = sum(1 for i in n.all_input_nodes if i.op not in ("placeholder", "get_attr"))
            deps += extra.get(n, 0) if m == 1 else 0
            waiting[(m, n)] = deps
            if not deps:
                heapq.heappush(ready, (stage[n], m, pos[n], id(n)))
    by_id = {id(n): n for n in ops}

    def value(m: int, a):
        if not isinstance(a, torch.fx.Node):
            return a
        if m == 1 and a in chain_env:
            return value(0, chain_env[a])
        return env[m][a]

    while ready:
        _, m, _, key = heapq.heappop(ready)
        n = by_id[key]
        env[m][n] = g.node_copy(n, lambda a, m=m: value(m, a))
        env[m][n].meta[MICROBATCH] = m
        nxt = [(m, u) for u in users[n]]
        if m == 0:
            nxt += [(1, u) for u in chained_users.get(n, ())]
        for mu, u in nxt:
            waiting[(mu, u)] -= 1
            if waiting[(mu, u)] == 0:
                heapq.heappush(ready, (stage[u], mu, pos[u], id(u)))
    if any(n not in env[m] for m in (0, 1) for n in ops):
        raise RuntimeError("duplex: the two microbatches' programs could not be ordered (a dependence cycle)")
    g.output(tuple(value(m, o) for m in (0, 1) for o in outs))
    g.lint()
    check_in_flight(g)
    out = torch.fx.GraphModule(gm, g)
    out.recompile()
    return out


_PASSIVE = ("wait_tensor", "_wrap_tensor_autograd")  # ops that may touch an in-flight collective's output


def check_in_flight(g: torch.fx.Graph) -> None:
    """Refuse (``RuntimeError``) a program in which the backend's threads could race the program's own ops
    on an in-flight collective's buffers. Between a collective's issue and its ``wait_tensor`` gloo reads
    its input and writes its output from its own threads (NCCL: from its stream), so:

    * every collective has a ``wait_tensor`` (on its output or a view of it: the wait finds the work by
      storage) in the program: a work dropped unwaited keeps writing into an output the program has returned;
    * nothing but views, the wait and DTensor's ``_wrap_tensor_autograd`` (which only wraps it) touches the
      output (or a view of it) before the wait;
    * no op writes, in place, into the collective's input or output before the wait.

    Interleaving reorders ops only along data dependences, so a recorded program that satisfies this keeps
    satisfying it; the check makes a violation (a future op or recording change) a clear error instead of a
    rare crash or wrong numbers on one rank."""
    nodes = list(g.nodes)
    order = {n: k for k, n in enumerate(nodes)}
    for n in nodes:
        if not is_collective(n):
            continue
        views = _views(n)  # DTensor may view the output before waiting (the wait finds the work by storage)
        users = {u for v in views for u in v.users if u not in views}
        waits = waits_of(n)
        if not waits:
            raise RuntimeError(f"duplex: collective {n.name} has no wait_tensor in the program")
        end = min(order[w] for w in waits)
        early = [u.name for u in users if order[u] < end and not any(p in str(u.target) for p in _PASSIVE)]
        if early:
            raise RuntimeError(f"duplex: {', '.join(sorted(early))} read(s) {n.name}'s output before its wait_tensor")
        buffers = views | {a for a in n.args if isinstance(a, torch.fx.Node)}
        for b in nodes[order[n] + 1 : end]:
            if _writes_into(b) & buffers:
                raise RuntimeError(f"duplex: {b.name} writes into a buffer of {n.name} while it is in flight")


def waits_of(collective: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``wait_tensor`` ops on a collective's output or on a view of it (DTensor views some outputs
    before waiting; the wait finds the work by the storage)."""
    views = _views(collective)
    return [u for v in views for u in v.users if u not in views and "wait_tensor" in str(u.target)]


def _views(n: torch.fx.Node) -> set[torch.fx.Node]:
    """`n` and the views of it (ops whose result aliases their input without writing), transitively."""
    out, todo = {n}, [n]
    while todo:
        for u in todo.pop().users:
            schema = getattr(u.target, "_schema", None)
            if u.op != "call_function" or schema is None or not schema.returns or u in out:
                continue
            alias = schema.returns[0].alias_info
            if alias is not None and not alias.is_write:
                out.add(u)
                todo.append(u)
    return out


def _writes_into(n: torch.fx.Node) -> set[torch.fx.Node]:
    """The argument nodes an op writes into in place (its schema's mutable arguments)."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None or not schema.is_mutable:
        return set()
    out = set()
    for k, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = n.args[k] if k < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            out.add(value)
    return out


# ------------------------------------------------------------------------------------------- per-rank trace

TRACE: list[tuple[str, int, float]] = []
"""Events ``(what, collective, perf_counter seconds)`` that programs made by :func:`traced` append while run:
``issue`` (a collective returned), ``wait`` / ``waited`` (before / after its ``wait_tensor``), ``begin`` /
``end`` of the program."""


def _stamp(what: str, key: int) -> None:
    TRACE.append((what, key, time.perf_counter()))


def traced(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm` that time-stamps into :data:`TRACE` each collective's issue and its wait's start and
    end (the same ops otherwise), for :func:`trace_overlap`."""
    out = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    g = out.graph
    nodes = list(g.nodes)
    ids: dict[torch.fx.Node, int] = {}
    for n in nodes:
        if is_collective(n):
            ids[n] = len(ids)
            with g.inserting_after(n):
                g.call_function(_stamp, ("issue", ids[n]))
    for n, key in list(ids.items()):
        for w in waits_of(n)[:1]:
            with g.inserting_before(w):
                g.call_function(_stamp, ("wait", key))
            with g.inserting_after(w):
                g.call_function(_stamp, ("waited", key))
    first = next(n for n in g.nodes if n.op != "placeholder")
    with g.inserting_before(first):
        g.call_function(_stamp, ("begin", -1))
    with g.inserting_before(next(n for n in g.nodes if n.op == "output")):
        g.call_function(_stamp, ("end", -1))
    out.recompile()
    return out


def trace_overlap(events: Sequence[tuple[str, int, float]], blocked_s: float = 50e-6) -> dict[str, float]:
    """Compute, communication and their overlap (seconds) of one rank from a :data:`TRACE` of one or more
    programs run back to back (each ``begin`` … ``end``; collective ids are per program).

    A collective is in flight from its issue until its wait returns if the wait blocked (longer than
    `blocked_s`), else at most until the wait began (an upper bound: ``bounded`` counts those). Compute is
    the programs' time less the blocked waits; overlap is the communication time the compute stream was not
    blocked, i.e. ``comm - blocked waits``; ``ratio`` = overlap ÷ min(compute, comm) (HiDup Table 4).

    ``comm``, ``overlap`` and ``ratio`` are upper bounds where some waits did not block (the collective ended
    somewhere between its issue and its wait). ``overlap_low_s`` counts only the collectives whose wait
    blocked (their end is known), and ``ratio_low`` = overlap_low ÷ min(compute, comm) is a lower bound of
    the ratio: the true one lies in [``ratio_low``, ``ratio``]."""
    spans: list[tuple[float, float]] = []
    known: list[tuple[float, float]] = []
    blocked: list[tuple[float, float]] = []
    busy = 0.0
    bounded = 0
    issue: dict[int, float] = {}
    wait: dict[int, float] = {}
    begin = 0.0
    for what, key, t in events:
        if what == "begin":
            begin, issue, wait = t, {}, {}
        elif what == "end":
            busy += t - begin
        elif what == "issue":
            issue[key] = t
        elif what == "wait":
            wait[key] = t
        elif what == "waited" and key in issue:
            if t - wait[key] > blocked_s:
                spans.append((issue[key], t))
                known.append((issue[key], t))
                blocked.append((wait[key], t))
            else:
                spans.append((issue[key], wait[key]))
                bounded += 1
    comm = _measure(spans)
    stalled = _measure(blocked)
    compute = busy - stalled
    overlap = max(comm - stalled, 0.0)
    overlap_low = max(_measure(known) - stalled, 0.0)
    low = min(compute, comm)
    return {
        "compute_s": compute,
        "comm_s": comm,
        "overlap_s": overlap,
        "ratio": overlap / low if low > 0 else 0.0,
        "overlap_low_s": overlap_low,
        "ratio_low": overlap_low / low if low > 0 else 0.0,
        "bounded": float(bounded),
    }


def _measure(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
