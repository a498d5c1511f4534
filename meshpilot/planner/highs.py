"""One mixed-integer solve with HiGHS through ``highspy``, the way ``scipy.optimize.milp`` makes it.

The ILP of :mod:`meshpilot.planner.ilp` is::

    min  cᵀ x   s.t.  row_lower ≤ A x ≤ row_upper,   0 ≤ x ≤ 1,   x_j integer where integrality[j] = 1

:func:`solve_milp` hands HiGHS the same model scipy's ``milp`` hands it — the column-wise (CSC) matrix
``A.indptr / A.indices / A.data`` as ``a_matrix_.start_ / index_ / value_``, the bounds as given (HiGHS reads
``±inf`` as unbounded), ``integrality`` as ``HighsVarType`` — with scipy's options (``log_to_console`` off,
``mip_max_nodes``, ``mip_rel_gap``, ``time_limit``, ``presolve`` on; every other option HiGHS' default), and
reads the answer as scipy does: a solution exists when the model status is *optimal*, or a limit (time,
iterations, solutions) was reached with a finite objective. ``highspy`` 1.12 is the HiGHS 1.12.0 that
scipy 1.17 vendors, so a solve is the same solve; what the swap saves is the import: ``scipy.optimize`` costs
≈0.3 s of CPU on import (``scipy.linalg``, ``scipy.optimize._optimize`` and the rest of the package), ``highspy``
≈0.01 s once numpy is in, and :meth:`Csc.from_entries` builds the matrix ``scipy.sparse`` built (≈0.13 s of
import) with numpy (docs/benchmarks.md, issue 33 item 4). ``tests/test_ilp.py`` holds both to scipy's.

The message keeps scipy's form, ``"<what it means>. (HiGHS Status <n>: <HiGHS' status>)"``, which the plan
prints and stores (``Plan.solver.status``; ``plan.py`` reads the part after ``HiGHS Status <n>:``); where no
solution came back, scipy's ``"model_status is <status>; primal_status is <status>"`` after the number is
left out (the primal status says nothing more then).

A model solved to the end (optimal, or proved infeasible) is remembered by a digest of everything HiGHS is
given (:data:`_ANSWERS`): the same model posed again gets that answer without a second solve. The planner poses
the same ILP more than once — a pipeline's stages of identical blocks on one mesh shape, each planned on its own
(``Plan.with_intra``: GPT-39B's ten three-block stages on 4x1 of ``alpa-p3x8``), and the searches that try one
slice again — and HiGHS (one thread) answers a model the same way every time, so the plan is the one a second
solve would give. An answer stopped by a limit (time, nodes) is not remembered: it depends on the machine.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Csc:
    """A sparse matrix column by column (compressed sparse columns): column ``j``'s rows are
    ``indices[indptr[j]:indptr[j + 1]]`` (ascending) and its values ``data[…]`` at the same places."""

    indptr: np.ndarray
    indices: np.ndarray
    data: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def from_entries(cls, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray, shape: tuple[int, int]) -> Csc:
        """The matrix whose entry ``(rows[i], cols[i])`` is ``vals[i]``, entries at one place summed (what
        ``scipy.sparse.coo_matrix(…).tocsc()`` makes, without importing ``scipy.sparse``: ≈0.13 s of CPU)."""
        order = np.lexsort((rows, cols))
        r, c, v = rows[order], cols[order], np.asarray(vals, dtype=np.float64)[order]
        first = np.ones(len(r), dtype=bool)
        first[1:] = (r[1:] != r[:-1]) | (c[1:] != c[:-1])
        starts = np.flatnonzero(first)
        v = np.add.reduceat(v, starts) if len(v) else v
        r, c = r[starts], c[starts]
        indptr = np.zeros(shape[1] + 1, dtype=np.int32)
        np.cumsum(np.bincount(c, minlength=shape[1]), out=indptr[1:])
        return cls(indptr, r.astype(np.int32), v, shape)


@dataclass(frozen=True)
class MilpAnswer:
    """What one solve returned: the solution (None when HiGHS has none), its message, the MIP gap reached,
    and whether HiGHS proved the model infeasible (not: stopped by a limit before finding a solution)."""

    x: np.ndarray | None
    message: str
    mip_gap: float
    infeasible: bool
    final: bool = False
    """Solved to the end (optimal, or proved infeasible), not stopped by a limit: what may be remembered."""


def solve_milp(
    c: np.ndarray,
    A: Csc,
    row_lower: np.ndarray,
    row_upper: np.ndarray,
    integrality: np.ndarray,
    *,
    time_limit: float,
    node_limit: int,
    mip_rel_gap: float,
    col_lower: np.ndarray | None = None,
    col_upper: np.ndarray | None = None,
) -> MilpAnswer:
    """``min cᵀx`` over ``row_lower ≤ A x ≤ row_upper``, ``0 ≤ x ≤ 1``, ``x_j`` integer where
    ``integrality[j]`` is 1 (module docstring: scipy's ``milp`` model and options; a model solved to the end
    before is answered from :data:`_ANSWERS`). `col_lower` / `col_upper` narrow the columns' bounds inside
    ``[0, 1]`` (None: 0 and 1), e.g. to fix some of them."""
    options = (float(time_limit), int(node_limit), float(mip_rel_gap))
    n = A.shape[1]
    lo = np.zeros(n) if col_lower is None else np.asarray(col_lower, dtype=np.float64)
    hi = np.ones(n) if col_upper is None else np.asarray(col_upper, dtype=np.float64)
    arrays = (c, A.indptr, A.indices, A.data, row_lower, row_upper, integrality)
    arrays += () if col_lower is None and col_upper is None else (lo, hi)  # the keys of plain models as before
    key = _digest(arrays, A.shape, options)
    known = _ANSWERS.get(key)
    if known is not None:
        _ANSWERS.move_to_end(key)
        return replace(known, x=None if known.x is None else known.x.copy())
    ans = _solve(c, A, row_lower, row_upper, integrality, *options, lo, hi)
    if ans.final:
        _ANSWERS[key] = replace(ans, x=None if ans.x is None else ans.x.copy())
        while len(_ANSWERS) > REMEMBERED:
            _ANSWERS.popitem(last=False)
    return ans


REMEMBERED = 256
"""How many answers :data:`_ANSWERS` keeps (the least recently used go first)."""

_ANSWERS: OrderedDict[bytes, MilpAnswer] = OrderedDict()
"""Answers of models solved to the end, by :func:`_digest` of the model and options (module docstring)."""


def _digest(arrays, shape: tuple[int, int], options: tuple) -> bytes:
    """A digest of a model: every array's dtype, length and bytes, the matrix shape and the solve's options."""
    h = hashlib.blake2b(digest_size=20)
    h.update(repr((shape, options)).encode())
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.size};".encode())
        h.update(a.data)
    return h.digest()


def _solve(
    c, A: Csc, row_lower, row_upper, integrality, time_limit: float, node_limit: int, mip_rel_gap: float, lo, hi
):
    """One solve of the model by HiGHS (:func:`solve_milp` without the memory), columns within ``[lo, hi]``."""
    import highspy

    h = highspy.Highs()
    for key, value in (
        ("log_to_console", False),
        ("mip_max_nodes", int(node_limit)),
        ("time_limit", float(time_limit)),
        ("mip_rel_gap", float(mip_rel_gap)),
        ("presolve", "on"),
    ):
        h.setOptionValue(key, value)
    h.passModel(_lp(highspy, c, A, row_lower, row_upper, integrality, lo, hi))
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    S = highspy.HighsModelStatus
    is_mip = bool(np.any(integrality))
    limits = (S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit)
    stopped_with_one = is_mip and status in limits and info.objective_function_value != highspy.kHighsInf
    solved = status == S.kOptimal or stopped_with_one
    message = f"{_MEANING.get(status.name, '')}(HiGHS Status {int(status)}: {h.modelStatusToString(status)})"
    x = np.array(h.getSolution().col_value) if solved else None
    gap = float(info.mip_gap) if solved and is_mip else 0.0
    infeasible = status == S.kInfeasible
    return MilpAnswer(x, message, gap, infeasible, final=status == S.kOptimal or infeasible)


def _lp(highspy, c, A: Csc, row_lower, row_upper, integrality, lo=None, hi=None):
    """The ``HighsLp`` of the model (column-wise matrix; the column bounds `lo` and `hi`, None: 0 and 1)."""
    n_rows, n_cols = A.shape
    lp = highspy.HighsLp()
    lp.num_col_ = n_cols
    lp.num_row_ = n_rows
    lp.a_matrix_.num_col_ = n_cols
    lp.a_matrix_.num_row_ = n_rows
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.col_cost_ = np.asarray(c, dtype=np.float64)
    lp.col_lower_ = np.zeros(n_cols) if lo is None else lo
    lp.col_upper_ = np.ones(n_cols) if hi is None else hi
    lp.row_lower_ = np.asarray(row_lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(row_upper, dtype=np.float64)
    lp.a_matrix_.start_ = A.indptr
    lp.a_matrix_.index_ = A.indices
    lp.a_matrix_.value_ = np.asarray(A.data, dtype=np.float64)
    lp.integrality_ = _var_types(highspy, integrality)
    return lp


def _var_types(highspy, integrality) -> list:
    """``integrality`` as the ``HighsVarType`` list ``HighsLp.integrality_`` takes (it refuses a numpy array):
    one enum object per distinct value, shared by every column that has it. Made per column, as before, the
    list was ≈0.02 s of a planning benchmark's ``plan()`` (16,883 columns, one ``HighsVarType(int)`` call each;
    issue 33 item 4)."""
    values = np.asarray(integrality).tolist()
    kinds = {v: highspy.HighsVarType(int(v)) for v in set(values)}
    return [kinds[v] for v in values]


_MEANING = {
    "kOptimal": "Optimization terminated successfully. ",
    "kTimeLimit": "Time limit reached. ",
    "kIterationLimit": "Iteration limit reached. ",
    "kInfeasible": "The problem is infeasible. ",
    "kUnbounded": "The problem is unbounded. ",
    "kUnboundedOrInfeasible": "The problem is unbounded or infeasible. ",
}
"""The first part of scipy's message for a HiGHS model status (``scipy.optimize._linprog_highs``)."""
