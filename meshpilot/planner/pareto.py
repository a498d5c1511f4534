"""HiDup's duplex-aware SPMD search (§4): a Pareto dynamic program over graph cuts, as a second searcher.

The ILP (``meshpilot.planner.ilp``) minimises the *sum* of compute and communication: it cannot see that
under HiDup's duplex schedule (``meshpilot.planner.schedule.duplex``) one microbatch's communication runs
while the other microbatch computes. This searcher minimises the duplex step instead, with the paper's
recursion, and returns the candidate priced by the one accounting (``meshpilot.planner.accounting``) like
every searcher, its duplex time reported beside it.

Terms of §4.1 and where they are
--------------------------------
* **Tensor forms.** HiDup's forms of a tensor — *Full* (a whole copy), *Gather(i)* (sharded on dim ``i``:
  an all-gather makes it Full), *Reduce* (partial sums: an all-reduce makes it Full) — are, per mesh axis,
  DTensor's ``Replicate()``, ``Shard(i)`` and ``Partial()``. A value's form on the mesh is its layout
  (``Placements``, interned as an integer id by ``sharding.placements.pid``): ``_State.lay`` maps every value
  on the current cut to its layout id. Changing a form is a collective (Reduce → Full all-reduce, Reduce →
  Gather(i) reduce-scatter, Gather(i) → Gather(j) all-to-all, Gather(i) → Full all-gather): DTensor's
  transform steps, priced by the mapping's ``CostModel`` through ``ilp.Pricer`` (the same prices the ILP
  and the accounting use).
* **Operator signatures.** A signature is one way to run an operator: the forms its operands must have and
  the forms of its outputs — a ``Strategy`` (``ins`` → ``outs``, ``sharding.strategies``; the ILP's
  structure holds them per node, ``Structure.strategies``, and as layout ids ``Structure.in_ids`` /
  ``out_ids``).
* **Stages.** A stage is a communication step (the collectives that bring operands into the forms the
  stage's signatures need) followed by a computation step (the operators). Stages are cut exactly where
  the duplex schedule cuts them: before every node that consumes a resharding collective
  (``schedule.duplex``). In the DP a node whose chosen signature needs operand collectives of ``comm > 0``
  seconds opens a new stage with communication step ``comm`` and computation step its compute; a node that
  needs none adds its compute to the open stage (:func:`_advance`). An op's own collectives
  (``Strategy.colls``, e.g. a vocabulary-parallel softmax) run inside its computation step — unless the op
  issues its first ones before its computation and the rest after (``OwnOp.leading``: the expert-parallel
  MoE's counts and dispatch, then its combine), where the duplex schedule cuts around it: the leading ones
  join the communication step of the op's stage and the trailing ones open the next stage
  (:func:`_advance_op`), as the schedule and the simulator place them.
* **Costs ψ and φ (Eq. 4–5).** For a strategy ``Q`` of stages ``1..i``, with ``comm⁽ⁱ⁾`` and ``comp⁽ⁱ⁾``
  one microbatch's communication and computation of stage ``i``::

      φ_Q⁽ⁱ⁾ = −comp⁽ⁱ⁾                                                                       (4)
      ψ_Q⁽ⁱ⁾ = ψ_Q⁽ⁱ⁻¹⁾ + φ_Q⁽ⁱ⁻¹⁾ + max(−φ_Q⁽ⁱ⁻¹⁾, comm⁽ⁱ⁾) + max(comm⁽ⁱ⁾, comp⁽ⁱ⁾) − φ_Q⁽ⁱ⁾      (5)

  microbatch 2's computation of stage ``i−1`` beside microbatch 1's communication of stage ``i``, then
  microbatch 1's computation beside microbatch 2's communication, then microbatch 2's computation. The DP
  keeps the stage that is still growing open, so a state holds ``(base, p, c, x)`` with
  ``base = ψ⁽ⁱ⁻¹⁾ + φ⁽ⁱ⁻¹⁾`` (the time both microbatches reach the cut but for microbatch 2's last
  computation), ``p = −φ⁽ⁱ⁻¹⁾ = comp⁽ⁱ⁻¹⁾``, ``c = comm⁽ⁱ⁾`` and ``x = comp⁽ⁱ⁾`` so far. Closing the open
  stage is Eq. 5 (:func:`_advance`: ``base' = base + max(p, c) + max(c, x)``, ``p' = x``) and
  ``ψ = base + max(p, c) + max(c, x) + x`` (:func:`_psi`). What the duplex schedule does not overlap is
  added once: gradients are accumulated over the two microbatches and synchronised once at the end of the
  step (``G``: every gradient edge, into its parameter's layout), the loss made replicated and buffer
  updates once per microbatch (``_State.tail``).
* **States and dominance.** A state ``T = (C, F)`` is a cut ``C`` of the graph and the forms ``F`` of the
  values on it. The DP walks the captured graph in its execution order (a topological order of the joint
  forward + backward graph); after node ``k`` the cut is every value produced at or before ``k`` that a later
  node (or a later gradient edge) still reads, plus the layouts of the parameters and inputs already decided
  (a leaf is decided lazily, at its first reader, among the layouts that equal the form that reader wants or
  shard it further on axes the reader replicates — HiDup's *replicated* or *sharded* parameter placement;
  :meth:`_Leaves.options`). ``_State.key`` hashes ``(C, F)``. ``Q₁`` dominates ``Q₂`` when they reach the
  same state and ``ψ_Q₁ ≤ ψ_Q₂``, ``φ_Q₁ ≤ φ_Q₂``, one strictly (§4.2: the paper's pair, for closed stages).
  With the last stage kept open the DP's test is in its own coordinates: componentwise ``≤`` on
  ``(base, p, c, x, tail)`` (``_State.dominates``, :func:`_prune`) — everything after the cut adds only maxima
  and sums of these, nondecreasing in each, so a dominated state can never end faster (Theorem 1's argument).
* **The DP (Fig. 4).** For each cut in order (each node ``k``), every kept strategy ``Q`` is extended by every
  signature of node ``k`` (and the options of leaves it decides), giving ``Q ⊕ (O, S)``; dominated ones are
  dropped, the rest kept. The answer is the complete strategy of least ψ.

Bounds that make it fast (not in the paper)
-------------------------------------------
The paper's cuts grow exponentially with the graph's width; a joint forward + backward graph keeps every
activation the backward reads on the cut, so exact enumeration is out of reach. This searcher is a *beam*
over the Pareto DP: after dominance, at most ``beam`` states (:data:`BEAM`) survive each node, ranked by
``ψ`` so far plus an estimate of the gradient synchronisation each decided parameter will still cost
(``_State.pending``, :meth:`_Leaves.pending`: its gradient, a partial sum on the axes where it is replicated
and its first reader's output sharded, reduced into its layout). Elementwise and view nodes
(``ilp.is_trivial``) do not branch: each state takes the signature that reads its operands' forms cheapest,
as the ILP's merge of trivial nodes does. Costs per node are numpy vectors over its signatures. The result is
a heuristic upper bound of the DP's optimum, not guaranteed to match the ILP on the serial (no-overlap) step,
which the ILP minimises exactly. A beam alone is myopic on a joint graph (a forward choice's gradient cost
shows only in the backward), so the searcher seeds it with an *incumbent*: the ILP's plan, whose path is
kept beside the beam at every node (``_State.inc``). Its ψ is then never above the ILP plan's ψ, and every
state that beats the incumbent's path locally (a parameter sharded rather than replicated, a layer's
signature that overlaps better) is explored around it. ``ParetoSearcher(seed=False)`` is the pure beam.

Memory is not a term of the DP (HiDup's neither); a candidate whose liveness peak exceeds the device
capacity is rejected with a ``PlanError`` (the mesh search then keeps another mesh).

:func:`duplex_time` evaluates Eq. 4–5 on any fixed choice of strategies (the ILP's too), so the two searchers
are compared on the same duplex cost; ``BestSearcher`` (``best``) runs both and keeps the faster by the one
accounting (``Candidate.time_s``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Partial

from meshpilot.graph.capture import NodeKind, OpGraph, OpNode, Phase
from meshpilot.graph.gemms import node_gemm
from meshpilot.io import fmt_size
from meshpilot.ops import leading_collectives
from meshpilot.planner.accounting import ComputeCost, account, memory_use
from meshpilot.planner.ilp import PlanError, Pricer, Structure, is_trivial
from meshpilot.sharding.placements import by_id, pid, replicated
from meshpilot.sharding.strategies import Strategy

BEAM = 8
"""States kept after each node (after dominance)."""
POOL = 4
"""Children materialised per kept state before dominance (the best ``POOL · beam`` by score)."""
EPS = 1e-12
_LEAVES = (NodeKind.PARAM, NodeKind.BUFFER, NodeKind.INPUT, NodeKind.CONST)
_MASK = (1 << 61) - 1


_M64 = (1 << 64) - 1


def _h(value: tuple[str, int], lid: int) -> int:
    """A value-in-layout's share of a cut's key (keys are sums of these, so a state's key follows its
    cut as values come and go). Mixed by splitmix64's finaliser: Python's tuple hash is close to linear in
    a small int, so ``hash((v, 2)) + hash((w, 3))`` and ``hash((v, 1)) + hash((w, 4))`` collided for some
    hash seeds — distinct cuts shared a key, ``_prune`` compared them as one, and the plan depended on
    ``PYTHONHASHSEED``."""
    z = ((hash(value) & _M64) * 0x9E3779B97F4A7C15 + lid + 1) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) & _MASK


# ------------------------------------------------------------------------------------------ Eq. 4–5


def _advance(base: float, p: float, c: float, x: float, comm: float, comp: float) -> tuple[float, ...]:
    """One node of ``comm`` operand communication and ``comp`` computation appended (module docstring)."""
    if comm > 0.0:  # a new stage: close the open one (Eq. 5), open (comm, comp)
        return base + max(p, c) + max(c, x), x, comm, comp
    return base, p, c, x + comp


def _advance_op(base: float, p: float, c: float, x: float, comm: float, comp: float, after: float) -> tuple:
    """An op appended (:func:`_advance`), then, if it leaves ``after`` seconds of its own collectives in flight
    after its computation (``OwnOp.leading`` > 0), a new stage that starts with them."""
    state = _advance(base, p, c, x, comm, comp)
    return _advance(*state, after, 0.0) if after > 0.0 else state


def _own_steps(leading: int, own: Sequence[float]) -> tuple[float, float, float]:
    """An op's own collectives' seconds `own` (in ``Strategy.colls`` order) as (before its computation, inside
    it, after it): an op with `leading` > 0 (``OwnOp.leading``) issues its first `leading` before and the rest
    after; any other runs them all inside its computation step (module docstring)."""
    if leading:
        return sum(own[:leading]), 0.0, sum(own[leading:])
    return 0.0, sum(own), 0.0


def _advance_all(base, p, c, x, comm: np.ndarray, comp: np.ndarray | float) -> tuple[np.ndarray, ...]:
    """:func:`_advance` over arrays of candidates (one per strategy)."""
    new = comm > 0
    return (
        np.where(new, base + np.maximum(p, c) + np.maximum(c, x), base),
        np.where(new, x, p),
        np.where(new, comm, c),
        np.where(new, comp, x + comp),
    )


def _psi(base: float, p: float, c: float, x: float) -> float:
    """ψ of the strategy with its open stage closed (Eq. 5 with nothing appended)."""
    return base + max(p, c) + max(c, x) + x


# ------------------------------------------------------------------------------------------ the graph's data


@dataclass(frozen=True)
class _Tail:
    """An edge priced at its producer and not overlapped: a gradient (once), the loss, a buffer update."""

    index: int
    """Output of the producer."""
    leaf: str | None
    """The parameter / buffer node whose layout it must reach (None: the loss, replicated)."""
    runs: int


class _Costs:
    """Per-node cost vectors over the node's strategies, cached (compute, own collectives, resharding)."""

    def __init__(self, graph: OpGraph, struct: Structure, pricer: Pricer, compute: ComputeCost):
        self.graph, self.struct, self.pricer, self.compute = graph, struct, pricer, compute
        self._comp: dict[tuple, np.ndarray] = {}
        self._steps: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._labs: dict[tuple[str, int], tuple[np.ndarray, tuple[int, ...]]] = {}
        self._row: dict[tuple, np.ndarray] = {}

    def comp(self, node: OpNode) -> np.ndarray:
        """Compute seconds of `node` under each strategy (one microbatch)."""
        r = self.struct.rep[node.name]
        sts = self.struct.strategies[node.name]
        if node.kind != NodeKind.OP:
            return np.zeros(len(sts))
        key = (r, node.flops, node.bytes_read + node.bytes_written, node.out.dtype if node.out else None)
        key += (node_gemm(self.graph, node), node.float8)
        v = self._comp.get(key)
        if v is None:
            v = self._comp[key] = np.array([self.compute.node(node, s) for s in sts], dtype=float)
        return v

    def own_steps(self, node: OpNode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Seconds of the collectives each strategy issues inside the op (``Strategy.colls``, issued by the op
        itself, as :func:`duplex_time` prices them), split by :func:`_own_steps` into those before its
        computation, inside it and after it."""
        r = self.struct.rep[node.name]
        v = self._steps.get(r)
        if v is None:
            n, cc = leading_collectives(str(node.target)), self.pricer.resharder.op_collective_cost
            rows = [_own_steps(n, [cc(c) for c in s.colls]) for s in self.struct.strategies[node.name]]
            v = self._steps[r] = tuple(np.array(col, dtype=float) for col in zip(*rows))
        return v

    def _labels(self, r: str, slot: int, ids: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
        hit = self._labs.get((r, slot))
        if hit is None:
            q, lab = np.unique(ids, return_inverse=True)
            hit = self._labs[(r, slot)] = (lab.reshape(-1), tuple(int(i) for i in q))
        return hit

    def reshard_in(self, node: OpNode, a: int, have: int) -> np.ndarray:
        """Seconds to bring operand `a` from layout id `have` into each strategy's operand layout."""
        r = self.struct.rep[node.name]
        src, i = node.inputs[a]
        info = self.graph[src].outputs[i]
        ids = self.struct.in_ids[r][:, a]
        lab, q = self._labels(r, a, ids)
        if have < 0 or info is None:
            return np.zeros(len(ids))
        key = (have, q, info)
        row = self._row.get(key)
        if row is None:
            row = self._row[key] = self.pricer.matrix((have,), q, info)[0]
        return row[lab]

    def reshard_out(self, node: OpNode, i: int, want: int) -> np.ndarray:
        """Seconds to bring output `i` of each strategy into layout id `want`."""
        r = self.struct.rep[node.name]
        info = node.outputs[i]
        ids = self.struct.out_ids[r][:, i]
        lab, p = self._labels(r, -1 - i, ids)
        if want < 0 or info is None:
            return np.zeros(len(ids))
        key = ("out", p, want, info)
        col = self._row.get(key)
        if col is None:
            col = self._row[key] = self.pricer.matrix(p, (want,), info)[:, 0]
        return col[lab]

    def pair(self, have: int, want: int, info) -> float:
        if have < 0 or want < 0 or have == want or info is None:
            return 0.0
        return float(self.pricer.matrix((have,), (want,), info)[0, 0])


class _Leaves:
    """Parameters, buffers, inputs and constants: decided at their first reader (module docstring)."""

    def __init__(self, graph: OpGraph, struct: Structure, costs: _Costs):
        self.graph, self.struct, self.costs = graph, struct, costs
        self.mesh_shape = tuple(struct.mesh_shape)
        self._opts: dict[tuple[str, int], tuple[int, ...]] = {}
        self._pending: dict[tuple[str, int, int], float] = {}

    def index_of(self, leaf: str, lid: int) -> int:
        ids = self.struct.out_ids[self.struct.rep[leaf]][:, 0]
        hit = np.flatnonzero(ids == lid)
        return int(hit[0]) if hit.size else 0

    def options(self, leaf: str, want: int) -> tuple[int, ...]:
        """Layouts the leaf may be stored in when its first reader wants `want`: `want` itself, and per set of
        mesh axes `want` replicates, one layout of the leaf that equals `want` elsewhere and shards those axes."""
        hit = self._opts.get((leaf, want))
        if hit is not None:
            return hit
        ids = [int(i) for i in self.struct.out_ids[self.struct.rep[leaf]][:, 0]]
        node = self.graph[leaf]
        q = by_id(want)
        out: dict[tuple[int, ...], int] = {}
        if want in ids or q is None:
            out[()] = want
        if q is not None and node.kind == NodeKind.PARAM:
            for lid in ids:
                pl = by_id(lid)
                if pl is None or lid == want:
                    continue
                extra = []
                ok = True
                for ax, (a, b) in enumerate(zip(pl, q)):
                    if a == b or self.mesh_shape[ax] == 1:
                        continue
                    if b.is_replicate() and a.is_shard():
                        extra.append(ax)
                    else:
                        ok = False
                        break
                if ok and extra:
                    out.setdefault(tuple(extra), lid)
        if not out:
            out[()] = ids[0]
        hit = self._opts[(leaf, want)] = tuple(out.values())
        return hit

    def pending(self, leaf: str, stored: int, reader_out: int) -> float:
        """Estimated seconds of the parameter's gradient synchronisation (the beam's score only): its gradient
        is a partial sum on every mesh axis where the stored layout replicates it and its first reader's
        output is sharded (the batch split over that axis: data parallelism), reduced into the stored layout."""
        key = (leaf, stored, reader_out)
        hit = self._pending.get(key)
        if hit is not None:
            return hit
        node = self.graph[leaf]
        q, out = by_id(stored), by_id(reader_out)
        val = 0.0
        if node.kind == NodeKind.PARAM and q is not None and self.graph.grads.get(node.fqn) is not None:
            part = tuple(
                Partial() if (p.is_replicate() and n > 1 and out is not None and out[ax].is_shard()) else p
                for ax, (p, n) in enumerate(zip(q, self.mesh_shape))
            )
            val = self.costs.pair(pid(part), stored, node.out)
        self._pending[key] = val
        return val


# ------------------------------------------------------------------------------------------ the DP


class _State:
    """One strategy Q of the DP: the forms on its cut, its costs, how it was reached."""

    __slots__ = ("lay", "key", "base", "p", "c", "x", "tail", "pending", "est", "hist", "inc")

    def __init__(self, lay, key, base, p, c, x, tail, pending, est, hist, inc=False):
        self.inc: bool = inc
        """On the incumbent's path (kept whatever its score)."""
        self.est: dict[str, float] = est
        """Each decided parameter's pending gradient estimate (copy on write)."""
        self.lay: dict[tuple[str, int], int] = lay
        self.key: int = key
        self.base, self.p, self.c, self.x, self.tail, self.pending = base, p, c, x, tail, pending
        self.hist = hist
        """Linked list ``(parent hist, node, strategy index, ((leaf, strategy index), …))``."""

    @property
    def psi(self) -> float:
        return _psi(self.base, self.p, self.c, self.x) + self.tail

    @property
    def score(self) -> float:
        return self.psi + self.pending

    def dominates(self, o: _State) -> bool:
        return (
            self.base <= o.base + EPS
            and self.p <= o.p + EPS
            and self.c <= o.c + EPS
            and self.x <= o.x + EPS
            and self.tail <= o.tail + EPS
        )


def _prune(children: list[_State], beam: int) -> list[_State]:
    """Drop dominated states (same cut and forms, no better in any cost), keep the `beam` best by score."""
    children.sort(key=lambda s: s.score)
    kept: list[_State] = [s for s in children if s.inc]
    by_key: dict[int, list[_State]] = {s.key: [s] for s in kept}
    free = 0
    for s in children:
        if s.inc:
            continue
        same = by_key.setdefault(s.key, [])
        if any(o.dominates(s) for o in same):
            continue
        same.append(s)
        kept.append(s)
        free += 1
        if free >= beam:
            break
    return kept


def _combos(
    j: int,
    undecided: list[tuple[tuple[str, int], int]],
    out_ids: np.ndarray,
    in_ids: np.ndarray,
    graph: OpGraph,
    costs: _Costs,
    leaves: _Leaves,
    trivial: bool,
    forced: dict[str, int] | None,
) -> list[tuple[tuple, float, float]]:
    """The leaf decisions a node's strategy `j` can come with: ``((leaf, layout id, estimate), …)``, the seconds
    to bring each leaf from that layout into the one `j` reads, and the summed gradient estimates. `forced`
    fixes each leaf's layout (the incumbent's)."""
    reader_out = int(out_ids[j, 0])
    combos: list[tuple[tuple, float, float]] = [((), 0.0, 0.0)]
    for src, a in undecided:
        want = int(in_ids[j, a])
        info = graph[src[0]].outputs[src[1]]
        if any(d[0] == src[0] for d in combos[0][0]):  # a leaf read twice: already chosen here
            combos = [
                (dec, c0 + costs.pair(next(d[1] for d in dec if d[0] == src[0]), want, info), p0)
                for dec, c0, p0 in combos
            ]
            continue
        if forced is not None:
            opts: tuple[int, ...] = (forced[src[0]],)
        else:
            opts = leaves.options(src[0], want)
            opts = opts[:1] if trivial else opts
        combos = [
            (dec + ((src[0], lid, e),), c0 + costs.pair(lid, want, info), p0 + e)
            for dec, c0, p0 in combos
            for lid in opts
            for e in (leaves.pending(src[0], lid, reader_out),)
        ]
    return combos


def _indices(struct: Structure, chosen: dict[str, Strategy]) -> dict[str, int] | None:
    """Each node's index of its chosen strategy among ``struct``'s (None when one is not there)."""
    out: dict[str, int] = {}
    for name, st in chosen.items():
        sts = struct.strategies[name]
        try:
            out[name] = sts.index(st)
        except ValueError:
            ids = (st.out_ids, st.in_ids)
            hit = next((j for j, s in enumerate(sts) if (s.out_ids, s.in_ids) == ids), None)
            if hit is None:
                return None
            out[name] = hit
    return out


@dataclass(frozen=True)
class ParetoResult:
    """The DP's answer on one mesh candidate."""

    chosen: dict[str, Strategy]
    psi_s: float
    """ψ of the chosen strategy: the duplex step of two microbatches of the captured graph (Eq. 5, module
    docstring), gradients synchronised once."""
    states: int
    """States expanded over the whole graph."""
    search_s: float
    seeded: bool = False
    """Whether an incumbent's path was kept (False also when its strategies were not all among the node's)."""


def pareto_search(
    graph: OpGraph,
    struct: Structure,
    pricer: Pricer,
    compute: ComputeCost,
    beam: int = BEAM,
    incumbent: dict[str, Strategy] | None = None,
) -> ParetoResult:
    """The beam-bounded Pareto DP of the module docstring over `graph` on `struct`'s mesh shape. With an
    `incumbent` (a complete choice, e.g. the ILP's), its path is kept beside the beam, so the answer's ψ is at
    most the incumbent's (:func:`duplex_time`)."""
    t0 = time.perf_counter()
    dp = _ParetoDP(graph, struct, _Costs(graph, struct, pricer, compute), beam)
    inc_index = _indices(struct, incumbent) if incumbent is not None else None
    if inc_index is not None:
        dp.keep_incumbent(inc_index)
    states = [_State({}, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, {}, None, inc_index is not None)]
    for node in graph.nodes:
        if node.kind not in _LEAVES:
            ns = _NodeStep.of(node, dp)  # once per node, shared by every state it extends
            states = _prune([c for st in states for c in dp.expand(st, ns)], beam)
    best = min(states, key=lambda s: s.psi)
    return ParetoResult(dp.chosen(best), best.psi, dp.expanded, time.perf_counter() - t0, inc_index is not None)


@dataclass(frozen=True)
class _Pick:
    """One extension of a state by a strategy of the node: its score, strategy index, the leaves it decides
    (``(leaf, layout id, estimate)``), their pending estimate, the four running sums and whether it is the
    incumbent's own."""

    score: float
    j: int
    decisions: tuple
    pending: float
    sums: tuple[float, float, float, float]
    incumbent: bool


@dataclass(frozen=True)
class _NodeStep:
    """What the DP needs of one operator, the same for every state it extends."""

    node: OpNode
    strategies: list
    lead: np.ndarray
    comp: np.ndarray
    after: np.ndarray
    out_ids: np.ndarray
    in_ids: np.ndarray
    dying: list
    produced: list[int]
    trivial: bool

    @staticmethod
    def of(node: OpNode, dp: _ParetoDP) -> _NodeStep:
        name, k = node.name, node.index
        sts = dp.struct.strategies[name]
        lead, inside, after = dp.costs.own_steps(node)
        last = dp.last
        dying = [src for src in set(node.inputs) if last.get(src, -1) <= k]
        dying += [(t.leaf, 0) for t in dp.tails.get(name, ()) if t.leaf is not None and last.get((t.leaf, 0), -1) <= k]
        return _NodeStep(
            node,
            sts,
            lead,
            dp.costs.comp(node) + inside,
            after,
            dp.struct.out_ids[dp.struct.rep[name]],
            dp.struct.in_ids[dp.struct.rep[name]],
            dying,
            [i for i, info in enumerate(node.outputs) if info is not None and last.get((name, i), -1) > k],
            len(sts) > 1 and is_trivial(node),
        )


class _ParetoDP:
    """The DP's fixed context: each value's lifetime on the cut (its last reader, or the producer of a tail
    edge into it), the tail edges (gradients into parameters, buffer updates, the loss), the incumbent."""

    def __init__(self, graph: OpGraph, struct: Structure, costs: _Costs, beam: int) -> None:
        self.graph, self.struct, self.costs, self.beam = graph, struct, costs, beam
        self.leaves = _Leaves(graph, struct, costs)
        self.rep_loss = pid(replicated(len(struct.mesh_shape)))
        self.incumbent: dict[str, int] | None = None
        self.inc_leaf: dict[str, int] = {}
        self.expanded = 0
        self.last: dict[tuple[str, int], int] = {}
        self.tails: dict[str, list[_Tail]] = {}
        self._lifetimes()

    def _lifetimes(self) -> None:
        graph, last, tails = self.graph, self.last, self.tails
        for n in graph.nodes:
            for src in n.inputs:
                last[src] = max(last.get(src, -1), n.index)
        pnode = {n.fqn: n.name for n in graph.nodes if n.kind == NodeKind.PARAM}
        bnode = {n.fqn: n.name for n in graph.nodes if n.kind == NodeKind.BUFFER}
        for fqn, g in graph.grads.items():
            if g is not None and fqn in pnode:
                tails.setdefault(g[0], []).append(_Tail(g[1], pnode[fqn], 1))
                key = (pnode[fqn], 0)
                last[key] = max(last.get(key, -1), graph[g[0]].index)
        for fqn, (src, i) in graph.buffer_updates.items():
            tails.setdefault(src, []).append(_Tail(i, bnode[fqn], 2))
            key = (bnode[fqn], 0)
            last[key] = max(last.get(key, -1), graph[src].index)
        if graph.loss is not None:
            tails.setdefault(graph.loss[0], []).append(_Tail(graph.loss[1], None, 2))

    def keep_incumbent(self, inc_index: dict[str, int]) -> None:
        """Keep the path of the complete choice `inc_index` (strategy index per node) beside the beam."""
        self.incumbent = inc_index
        self.inc_leaf = {
            n.name: int(self.struct.out_ids[self.struct.rep[n.name]][inc_index[n.name], 0])
            for n in self.graph.nodes
            if n.kind in _LEAVES
        }

    def expand(self, st: _State, ns: _NodeStep) -> list[_State]:
        """Every kept extension of state `st` by a strategy of `ns`'s node."""
        self.expanded += 1
        costs, graph, node = self.costs, self.graph, ns.node
        undecided: list[tuple[tuple[str, int], int]] = []
        comm = np.zeros(len(ns.strategies))
        for a, src in enumerate(node.inputs):
            have = st.lay.get(src)
            if have is None and graph[src[0]].kind in _LEAVES:
                undecided.append((src, a))
                continue
            comm = comm + costs.reshard_in(node, a, -1 if have is None else have)
        tail = np.zeros(len(ns.strategies))
        tail_fixed = []  # tails into leaves not yet decided: decided as the producer emits
        for t in self.tails.get(node.name, ()):
            if t.leaf is None:
                tail = tail + t.runs * costs.reshard_out(node, t.index, self.rep_loss)
                continue
            want = st.lay.get((t.leaf, 0))
            if want is None:
                tail_fixed.append(t)
                continue
            tail = tail + t.runs * costs.reshard_out(node, t.index, want)
        picks = self._picks(st, ns, comm, tail, undecided)
        return [self._child(st, ns, pick, float(tail[pick.j]), tail_fixed) for pick in picks]

    def _picks(self, st: _State, ns: _NodeStep, comm: np.ndarray, tail: np.ndarray, undecided: list) -> list[_Pick]:
        """The best ``POOL · beam`` strategies of the node after `st` (with the leaves they decide), and the
        incumbent's own extension when `st` is on its path."""
        lead, comp, after = ns.lead, ns.comp, ns.after
        picks: list[_Pick] = []
        if undecided:
            js = range(len(ns.strategies)) if not ns.trivial else [int(np.argmin(comm + comp))]
            for j in js:
                for dec, c0, p0 in self._combos(j, undecided, ns, None):
                    sums = _advance_op(st.base, st.p, st.c, st.x, comm[j] + c0 + lead[j], comp[j], after[j])
                    sc = _psi(*sums) + st.tail + tail[j] + st.pending + p0
                    picks.append(_Pick(sc, j, dec, p0, sums, False))
            picks.sort(key=lambda t: t.score)
            picks = picks[: POOL * self.beam]
        else:
            js = np.array([int(np.argmin(comm + comp))]) if ns.trivial else np.arange(len(ns.strategies))
            base, p, c, x = _advance_all(st.base, st.p, st.c, st.x, comm[js] + lead[js], comp[js])
            if after[js].any():  # _advance_op's second stage, where the op leaves collectives in flight
                base, p, c, x = _advance_all(base, p, c, x, after[js], 0.0)
            sc = base + np.maximum(p, c) + np.maximum(c, x) + x + st.tail + tail[js] + st.pending
            order = np.argsort(sc, kind="stable")[: POOL * self.beam]
            picks = [
                _Pick(float(sc[o]), int(js[o]), (), 0.0, (float(base[o]), float(p[o]), float(c[o]), float(x[o])), False)
                for o in order
            ]
        if st.inc and self.incumbent is not None:  # the incumbent's own extension, always kept
            j = self.incumbent[ns.node.name]
            forced = {src[0]: self.inc_leaf[src[0]] for src, _ in undecided}
            (dec, c0, p0), *_ = self._combos(j, undecided, ns, forced)
            sums = _advance_op(st.base, st.p, st.c, st.x, comm[j] + c0 + lead[j], comp[j], after[j])
            picks.append(_Pick(0.0, j, dec, p0, sums, True))
        return picks

    def _combos(self, j: int, undecided: list, ns: _NodeStep, forced: dict | None) -> list:
        return _combos(j, undecided, ns.out_ids, ns.in_ids, self.graph, self.costs, self.leaves, ns.trivial, forced)

    def _child(self, st: _State, ns: _NodeStep, pick: _Pick, tail_j: float, tail_fixed: list) -> _State:
        """The state `pick` makes of `st`: the cut's layouts (hashed in `key`), the leaves decided, the
        pending estimates, the tails priced."""
        name, k, j = ns.node.name, ns.node.index, pick.j
        last = self.last
        lay = dict(st.lay)
        key = st.key
        decisions = []
        est = dict(st.est) if pick.decisions else st.est
        for leaf, lid, e in pick.decisions:
            est[leaf] = e
            decisions.append((leaf, self.leaves.index_of(leaf, lid)))
            if last.get((leaf, 0), -1) > k:
                lay[(leaf, 0)] = lid
                key = (key + _h((leaf, 0), lid)) & _MASK
        extra_tail = 0.0
        for t in tail_fixed:  # a tail into a leaf nobody read before: the leaf takes the emitted layout
            lid = int(ns.out_ids[j, t.index])
            inc = pick.incumbent and self.incumbent is not None
            jl = self.incumbent[t.leaf] if inc else self.leaves.index_of(t.leaf, lid)
            decisions.append((t.leaf, jl))
            stored = int(self.struct.out_ids[self.struct.rep[t.leaf]][jl, 0])
            extra_tail += t.runs * self.costs.pair(lid, stored, ns.node.outputs[t.index])
        for src in ns.dying:
            lid = lay.pop(src, None)
            if lid is not None:
                key = (key - _h(src, lid)) & _MASK
        for i in ns.produced:
            lid = int(ns.out_ids[j, i])
            lay[(name, i)] = lid
            key = (key + _h((name, i), lid)) & _MASK
        pend = st.pending + pick.pending
        for t in self.tails.get(name, ()):  # gradients priced now: their estimates leave the score
            if t.leaf is not None and t.runs == 1 and t.leaf in est:
                est = dict(est) if est is st.est else est
                pend -= est.pop(t.leaf)
        base, p, c, x = pick.sums
        hist = (st.hist, name, j, tuple(decisions))
        return _State(lay, key, base, p, c, x, st.tail + tail_j + extra_tail, max(pend, 0.0), est, hist, pick.incumbent)

    def chosen(self, best: _State) -> dict[str, Strategy]:
        """The strategies along `best`'s history; leaves nothing read take their first strategy."""
        chosen: dict[str, Strategy] = {}
        h = best.hist
        while h is not None:
            parent, name, j, decisions = h
            chosen[name] = self.struct.strategies[name][j]
            for leaf, jl in decisions:
                chosen.setdefault(leaf, self.struct.strategies[leaf][jl])
            h = parent
        for n in self.graph.nodes:
            chosen.setdefault(n.name, self.struct.strategies[n.name][0])
        return chosen


# ------------------------------------------------------------------------------------------ evaluation


def duplex_time(graph: OpGraph, chosen: dict[str, Strategy], resharder, compute: ComputeCost) -> float:
    """ψ (Eq. 4–5) of a fixed choice of strategies: the duplex step of two microbatches of `graph`, stages cut
    where ``schedule.duplex`` cuts them, gradients synchronised once, the loss and buffer updates not
    overlapped (module docstring). The same cost the DP minimises, for any searcher's plan."""
    return sum(duplex_parts(graph, chosen, resharder, compute))


def duplex_parts(graph: OpGraph, chosen: dict[str, Strategy], resharder, compute: ComputeCost) -> tuple[float, float]:
    """:func:`duplex_time` in two parts: (the stages' ψ, the exposed tail after them — the gradients'
    synchronisation, the loss's and the buffer updates' resharding)."""
    nd = len(resharder.mesh_shape)
    base = p = c = x = tail = 0.0
    grads = {g: fqn for fqn, g in graph.grads.items() if g is not None}
    pnode = {n.fqn: n.name for n in graph.nodes if n.kind == NodeKind.PARAM}
    bsrc = {v: fqn for fqn, v in graph.buffer_updates.items()}
    bnode = {n.fqn: n.name for n in graph.nodes if n.kind == NodeKind.BUFFER}

    def cost(have, want, info) -> float:
        if have is None or want is None or info is None:
            return 0.0
        return resharder.cost(have, want, info)

    for node in graph.nodes:
        if node.kind in _LEAVES:
            continue
        st = chosen[node.name]
        comm = 0.0
        for a, (src, i) in enumerate(node.inputs):
            comm += cost(chosen[src].outs[i], st.ins[a], graph[src].outputs[i])
        own = [resharder.op_collective_cost(col) for col in st.colls]
        lead, inside, after = _own_steps(leading_collectives(str(node.target)), own)
        base, p, c, x = _advance_op(base, p, c, x, comm + lead, compute.node(node, st) + inside, after)
        for i, info in enumerate(node.outputs):
            v = (node.name, i)
            if v in grads:
                tail += cost(st.outs[i], chosen[pnode[grads[v]]].outs[0], info)
            if v in bsrc:
                tail += 2 * cost(st.outs[i], chosen[bnode[bsrc[v]]].outs[0], info)
            if graph.loss is not None and v == tuple(graph.loss):
                tail += 2 * cost(st.outs[i], replicated(nd), info)
    return _psi(base, p, c, x), tail


def hidup_moe_force(graph: OpGraph) -> dict[str, str]:
    """HiDup Fig. 12 (right, its 10 Gbps layout) of every MoE layer of `graph` (``zoo.MoELayer``, mesh (1, n)) as
    a ``build_structure(force=)`` pattern: the gating matmul replicated (``RR``: computed on every device from the
    unpartitioned MoE input), the experts' ``w_in`` / ``w_out`` sharded on the expert dim (``RS(0)``), and the
    combine (the layer's last forward bmm) contracting the expert-sharded outputs into a Partial (``RP``). The
    search places the rest (docs/hidup.md, "Fig. 11 and Fig. 12"; ``benchmarks/bench_hidup_fig12.py``)."""
    force: dict[str, str] = {}
    combine: dict[str, str] = {}
    for n in graph.nodes:
        module = n.module or ""
        if n.kind == NodeKind.PARAM and (n.fqn or "").endswith((".moe.w_in", ".moe.w_out")):
            force[n.fqn] = "RS(0)"
        elif n.phase != Phase.FWD:
            continue
        elif n.target == "aten.mm.default" and module.endswith(".moe.gate"):
            force[n.name] = "RR"
            combine[module.removesuffix(".moe.gate")] = ""
        elif n.target == "aten.bmm.default" and module in combine:
            combine[module] = n.name
    force.update({name: "RP" for name in combine.values() if name})
    return force


# ------------------------------------------------------------------------------------------ searchers


class ParetoSearcher:
    """HiDup's duplex-aware Pareto DP (module docstring) behind ``search.Searcher``; `seed` keeps the ILP's
    plan as the incumbent path (module docstring, "Bounds")."""

    name = "pareto"

    def __init__(self, beam: int = BEAM, seed: bool = True):
        self.beam, self.seed = beam, seed

    def search(self, task, incumbent=None):  # -> search.Candidate
        """The duplex-aware plan of `task`; `incumbent` is a ``search.Candidate`` to seed with (the ILP's is
        solved when `seed` and none is given)."""
        from meshpilot.planner.search import Candidate, ILPSearcher

        shape = task.shape
        ilp_s = 0.0
        if self.seed and incumbent is None:
            try:
                incumbent = ILPSearcher().search(task)
                ilp_s = incumbent.build_s + incumbent.solve_s + incumbent.post_s
            except PlanError:
                incumbent = None
        pricer = Pricer(task.struct.table, task.resharder)
        compute = ComputeCost(task.resharder.cost_model, shape, task.graph)
        res = pareto_search(
            task.graph, task.struct, pricer, compute, self.beam, incumbent.chosen if incumbent is not None else None
        )
        t1 = time.perf_counter()
        acct = account(task.graph, res.chosen, task.resharder, compute, task.microbatches)
        usage = memory_use(task.graph, res.chosen, shape, task.capacity, on_cpu=task.resharder.cost_model.device.is_cpu)
        if usage.total > task.capacity * (1 + 1e-9):
            if incumbent is not None:
                return incumbent
            raise PlanError(
                f"the Pareto search's plan on mesh {shape} peaks at {fmt_size(usage.total)} per device, over the "
                f"{fmt_size(task.capacity)} a device holds (its DP has no memory term); use --searcher ilp",
                mesh_shape=shape,
                need_bytes=usage.total,
                capacity_bytes=task.capacity,
            )
        serial2 = account(task.graph, res.chosen, task.resharder, compute, 2).time.total_s
        return Candidate(
            shape,
            task.mapping,
            res.chosen,
            acct.time.total_s,
            usage,
            note=f"pareto: duplex {res.psi_s * 1e3:.1f} ms vs {serial2 * 1e3:.1f} ms serial (2 microbatches)",
            status=f"pareto beam {self.beam}, {res.states:,} states expanded"
            + (" seeded by the ILP" if res.seeded else ""),
            objective_s=res.psi_s,
            num_vars=incumbent.num_vars if incumbent is not None else 0,
            num_constraints=incumbent.num_constraints if incumbent is not None else 0,
            num_groups=incumbent.num_groups if incumbent is not None else 0,
            build_s=0.0,
            solve_s=res.search_s + ilp_s,
            post_s=time.perf_counter() - t1,
            solves=1 + (incumbent.solves if incumbent is not None else 0),
        )


class BestSearcher:
    """Runs the ILP and the Pareto DP (seeded by that ILP plan) and keeps the candidate the one accounting prices
    faster; the note gives both."""

    name = "best"

    def search(self, task):  # -> search.Candidate
        from meshpilot.planner.search import ILPSearcher

        ilp = ILPSearcher().search(task)
        try:
            dp = ParetoSearcher().search(task, incumbent=ilp)
        except PlanError:
            return ilp
        found = [("ilp", ilp), ("pareto", dp)]
        name, best = min(found, key=lambda t: t[1].time_s)
        others = ", ".join(f"{n} {c.time_s * 1e3:.1f} ms" for n, c in found)
        best.note = f"best of {others}: {name}; duplex {dp.objective_s * 1e3:.1f} ms (pareto)"
        best.solve_s = ilp.solve_s + dp.solve_s
        best.build_s = ilp.build_s
        best.post_s = ilp.post_s + dp.post_s
        best.solves = ilp.solves + 1
        return best
