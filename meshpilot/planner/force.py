"""What a ``force=`` dict means: its layouts read, its patterns matched, and which pattern wins a name.

``force`` maps fnmatch patterns to layouts, ``{"blocks.*.fc.weight": "RS(0)", "input:*": "S(0)R"}``:

* a **layout** is one placement per mesh axis: ``R`` (replicated), ``P`` (partial sum) or ``S(d)`` (dim d
  sharded), e.g. ``S(0)R`` on a 2D mesh. Every layout is read before anything is planned, whether its pattern
  matches anything or not: ``XYZ`` or a layout of the wrong length is an error. ``S(d)`` on a tensor with d
  or fewer dims is an error once the pattern matches it, and on no tensor of the model when it matches none.
* a **pattern** names parameters and buffers by qualified name (``layers.0.weight``) and example inputs as
  ``input:<i>``. A pattern that names none of those names operator nodes of the captured graph by node name
  instead (``mm_3``, as ``planner.forced`` pins Megatron's matmul outputs; ``_native_batch_norm_legit_functional*``):
  so ``"*"`` pins every parameter, buffer and input, never the operators between them.
* **precedence**, when several patterns match one name: a pattern without wildcards (the exact name) wins;
  among wildcard patterns the one with more literal characters wins (``input:*`` over ``*``,
  ``blocks.*.fc.weight`` over ``blocks.*``); two equally specific patterns giving one name different layouts
  are an error. The order of the dict does not matter. So ``{"*": "RR", "input:*": "S(0)R"}`` is data
  parallelism: parameters replicated, inputs batch-sharded; the planner warns once per overriding pattern
  which one won where.
* a pin is a promise: the plan stores every pinned parameter and reads every pinned input in its pattern's
  layout (checked on the finished plan); a layout the tensor cannot take on the mesh (``S(0)`` of a batch the
  axis does not divide) is an error naming the layouts it can take.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshpilot.errors import UserError
from meshpilot.graph.capture import NodeKind, OpGraph, OpNode

LEAF_KINDS = (NodeKind.PARAM, NodeKind.BUFFER, NodeKind.INPUT)
"""The nodes a wildcard pattern can name (by their qualified name, ``input:<i>`` for inputs)."""
_PLACEMENT = re.compile(r"R|P|S\((\d+)\)")
_LAYOUT_HINT = "write one placement per mesh axis from R, P and S(d), e.g. 'S(0)R' or 'RS(1)'"


def parse_layout(text: str, where: str) -> tuple[str, ...]:
    """The placements of a layout text (``"S(0)R"`` -> ``("S(0)", "R")``); a UserError naming `where`."""
    out, pos = [], 0
    while pos < len(text):
        m = _PLACEMENT.match(text, pos)
        if m is None:
            raise UserError(f"{where}: layout {text!r} is not a layout (at {text[pos:]!r}); {_LAYOUT_HINT}")
        out.append(m.group())
        pos = m.end()
    if not out:
        raise UserError(f"{where}: the layout is empty; {_LAYOUT_HINT}")
    return tuple(out)


def literal(pattern: str) -> str | None:
    """The one name `pattern` matches when it has no wildcard (``[*]`` escapes count as the character), else
    None."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c in "*?":
            return None
        if c == "[":
            end = pattern.find("]", i + 2)  # fnmatch: a ']' right after '[' is part of the class
            if end == -1:
                out.append(c)  # an unclosed '[' is a literal
                i += 1
                continue
            if end != i + 2 or pattern[i + 1] in "!^":
                return None
            out.append(pattern[i + 1])
            i = end + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _literal_chars(pattern: str) -> int:
    """How many characters of `pattern` are not wildcards: the specificity of a wildcard pattern."""
    return len(re.sub(r"\[[!^]?\]?[^\]]*\]|[*?]", "", pattern))


@dataclass(frozen=True)
class ForceRule:
    """One ``pattern: layout`` entry of a force dict, read."""

    pattern: str
    layout: str
    placements: tuple[str, ...]
    exact: str | None
    """The name the pattern names when it has no wildcard."""
    literals: int
    where: str
    """How the user wrote it, for messages: ``--force 'input:0=S(0)R'`` or ``force['input:0'] = 'S(0)R'``."""

    @classmethod
    def read(cls, pattern: str, layout: str, flag: str | None) -> ForceRule:
        where = f"{flag} '{pattern}={layout}'" if flag else f"force[{pattern!r}] = {layout!r}"
        if not isinstance(pattern, str) or not isinstance(layout, str) or not pattern:
            raise UserError(f"{where}: give a non-empty name pattern and a layout string; e.g. 'input:*': 'S(0)R'")
        return cls(pattern, layout, parse_layout(layout, where), literal(pattern), _literal_chars(pattern), where)

    def sharded_dims(self) -> list[int]:
        return [int(p[2:-1]) for p in self.placements if p.startswith("S(")]


class _Matcher:
    """The precedence of a set of rules over names: exact, then more literal characters; ties refused."""

    def __init__(self, rules: Sequence[ForceRule]):
        self._exact: dict[str, ForceRule] = {}
        for r in rules:
            if r.exact is None:
                continue
            other = self._exact.get(r.exact)
            if other is not None and other.placements != r.placements:
                raise UserError(
                    f"{r.where} and {other.where} both name {r.exact!r} exactly with different layouts; keep one"
                )
            self._exact[r.exact] = r
        self.wild = sorted((r for r in rules if r.exact is None), key=lambda r: -r.literals)
        alts = "|".join(f"(?P<p{i}>{fnmatch.translate(r.pattern)})" for i, r in enumerate(self.wild))
        self._match = re.compile(alts, re.S).fullmatch if self.wild else None

    def winner(self, name: str) -> ForceRule | None:
        rule = self._exact.get(name)
        if rule is not None or self._match is None:
            return rule
        m = self._match(name)
        if m is None:
            return None
        best = self.wild[int(m.lastgroup[1:])]
        for other in self.wild:
            if (
                other is not best
                and other.literals == best.literals
                and other.placements != best.placements
                and fnmatch.fnmatchcase(name, other.pattern)
            ):
                raise UserError(
                    f"{best.where} and {other.where} both match {name!r}, equally specific, with different layouts; "
                    f"add an exact pattern for {name!r} or make one pattern more specific"
                )
        return best


class ForceSpec(Mapping[str, str]):
    """A force dict, read and checked (module docstring). A Mapping, so it goes wherever a ``force=`` dict goes;
    `flag` names the CLI option the patterns came from, for messages. ``spec.bind(graph)`` says which pattern
    pins each node of a captured graph."""

    def __init__(self, force: Mapping[str, str], flag: str | None = None):
        self._force = dict(force)
        self.flag = flag
        self.rules = tuple(ForceRule.read(p, lay, flag) for p, lay in self._force.items())
        self._leaves = _Matcher(self.rules)

    @classmethod
    def of(cls, force: Mapping[str, str] | None) -> ForceSpec | None:
        """`force` read (itself when it already is a ForceSpec; cached by its items)."""
        if force is None or isinstance(force, ForceSpec):
            return force
        if not all(isinstance(v, str) for v in force.values()):
            return cls(force)  # raises, naming the entry
        return _cached(tuple(force.items()))

    # Mapping
    def __getitem__(self, key: str) -> str:
        return self._force[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._force)

    def __len__(self) -> int:
        return len(self._force)

    def __repr__(self) -> str:
        return f"ForceSpec({self._force!r})"

    def check_mesh(self, ndim: int, mesh_shape: tuple[int, ...] | None = None) -> None:
        """Every layout has one placement per mesh axis (`ndim` of them; `mesh_shape` for the message)."""
        mesh = f"the {ndim}-D mesh {mesh_shape}" if mesh_shape else f"a {ndim}-D mesh"
        for r in self.rules:
            if len(r.placements) != ndim:
                raise UserError(
                    f"{r.where}: {len(r.placements)} placement(s) for {mesh}; give one per mesh axis, "
                    f"e.g. '{'S(0)' + 'R' * (ndim - 1)}'"
                )

    def winner(self, name: str) -> ForceRule | None:
        """The rule that pins the parameter, buffer or input called `name` (module docstring's precedence)."""
        return self._leaves.winner(name)

    def bind(self, graph: OpGraph) -> BoundForce:
        """Which pattern pins each node of `graph` (linear in the patterns: exact ones are looked up)."""
        return BoundForce(self, graph)


class BoundForce:
    """A :class:`ForceSpec` on one graph: patterns that match a parameter, buffer or input pin those leaves;
    the others (``mm_3``, ``_native_batch_norm_legit_functional*``) pin the operator nodes they match by name."""

    def __init__(self, spec: ForceSpec, graph: OpGraph):
        self.spec, self.graph = spec, graph
        self.leaves = [n.fqn for n in graph.nodes if n.kind in LEAF_KINDS and n.fqn]
        self.leaf_rules = {r.pattern for r in spec.rules if _matches(r, self.leaves, set(self.leaves))}
        self._ops = _Matcher([r for r in spec.rules if r.pattern not in self.leaf_rules])

    def rule_for(self, node: OpNode) -> ForceRule | None:
        """The rule that pins `node` (None when no pattern does)."""
        if node.kind in LEAF_KINDS and node.fqn:
            return self.spec.winner(node.fqn)
        return self._ops.winner(node.name)

    def check_dims(self, rule: ForceRule, node: OpNode) -> None:
        """`rule`'s S(d) fit the tensor it pins."""
        name = node.fqn or node.name
        if node.out is None:
            raise UserError(f"{rule.where}: {name} is not a tensor; pin parameters, buffers, inputs or tensor ops")
        nd = len(node.out.shape)
        for d in rule.sharded_dims():
            if d >= nd:
                dims = "no dims to shard, give R" if nd == 0 else f"give S(0) … S({nd - 1}) or R"
                raise UserError(
                    f"{rule.where}: {name} has {nd} dim(s) (shape {tuple(node.out.shape)}), so S({d}) cannot "
                    f"shard it; {dims}"
                )

    def check(self) -> None:
        """Before planning: a pattern that pins nothing still has layouts that fit some tensor of the graph (an
        S(7) on a model of 2-D tensors is refused whether or not its pattern matches)."""
        names = [n.name for n in self.graph.nodes]
        most = max((len(n.out.shape) for n in self.graph.nodes if n.out is not None), default=0)
        for r in self.spec.rules:
            if r.pattern in self.leaf_rules or _matches(r, names, self.graph.by_name):
                continue  # pins something: checked against each tensor it pins
            for d in r.sharded_dims():
                if d >= most:
                    raise UserError(
                        f"{r.where}: S({d}) shards dim {d}, but no tensor of the model has more than {most} "
                        f"dim(s); give S(0) … S({max(most - 1, 0)}) or R"
                    )

    def notes(self) -> list[str]:
        """One warning per pattern that pins nothing (it matches no name, or more specific patterns win every
        name it matches) and per pattern that overrides another on some leaves (which one won, where)."""
        spec, leaves, leaf_set = self.spec, self.leaves, set(self.leaves)
        won: dict[str, list[str]] = {r.pattern: [] for r in spec.rules}
        over: dict[tuple[str, str], list[str]] = {}
        wild = [r for r in spec.rules if r.exact is None]  # an exact pattern names one name: never overridden
        for name in leaves:
            rule = spec.winner(name)
            if rule is None:
                continue
            won[rule.pattern].append(name)
            for other in wild:
                if (
                    other is not rule
                    and other.placements != rule.placements
                    and fnmatch.fnmatchcase(name, other.pattern)
                ):
                    over.setdefault((rule.pattern, other.pattern), []).append(name)
        ops = [n.name for n in self.graph.nodes if n.kind not in LEAF_KINDS]
        out = []
        for r in spec.rules:
            if won[r.pattern]:
                continue
            matched = fnmatch.filter(leaves, r.pattern) if r.exact is None else [r.exact] * (r.exact in leaf_set)
            if matched:
                out.append(
                    f"force pattern {r.pattern!r} pins nothing: more specific patterns win every name it matches "
                    f"({_few(matched)}); remove it or narrow the others"
                )
            elif not _matches(r, ops, set(ops)):
                shown = ", ".join(leaves[:12]) + (f", … ({len(leaves)} in all)" if len(leaves) > 12 else "")
                out.append(
                    f"force pattern {r.pattern!r} matches nothing and pins nothing; the names it can match: {shown}"
                )
        by_pattern = {r.pattern: r for r in spec.rules}
        for (win, lose), names in over.items():
            w, lo = by_pattern[win], by_pattern[lose]
            out.append(
                f"force pattern {win!r} ({w.layout}) overrides {lose!r} ({lo.layout}) on {_few(names)}: "
                "the more specific pattern wins"
            )
        return out

    def check_plan(self, params: Any, inputs: Any) -> None:
        """Every pinned parameter and input of the finished plan is in its pattern's layout."""
        fqns = [n.fqn for n in self.graph.nodes if n.kind == NodeKind.INPUT]
        held = [(fqn, tuple(lay)) for fqn, lay in params] + [(f, tuple(lay)) for f, lay in zip(fqns, inputs)]
        for name, layout in held:
            rule = self.spec.winner(name)
            if rule is not None and layout != rule.placements:
                raise UserError(
                    f"{rule.where}: the plan holds {name} as {''.join(layout)}, not as pinned; "
                    "the planner broke a pin: report it with the model and the force patterns"
                )


def _matches(rule: ForceRule, names: list[str], name_set: Collection[str]) -> bool:
    """Whether `rule` matches one of `names` (`name_set`: the same names, for an exact rule's lookup)."""
    if rule.exact is not None:
        return rule.exact in name_set
    return bool(fnmatch.filter(names, rule.pattern))


@functools.lru_cache(maxsize=32)
def _cached(items: tuple[tuple[str, str], ...]) -> ForceSpec:
    return ForceSpec(dict(items))


def _few(names: list[str], k: int = 4) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


__all__ = ["BoundForce", "ForceRule", "ForceSpec", "LEAF_KINDS", "literal", "parse_layout"]
