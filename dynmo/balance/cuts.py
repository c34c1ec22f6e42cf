"""`optimal` when a link's time depends on where its cut falls (`Problem.cut_factor`).

Stage j of a layout holds layers [a, b) and carries

    L_j(a, b) = (P[b] - P[a]) / s_j + (f_j x r[b] + g_j x r[a])

with f_j its activation send (0 on the last stage), g_j = b_(j-1) its gradient send (0 on the
first) and r the cut factors (problem.py). The r terms are not monotone in a and b: a stage
that ends one layer earlier may cost more (its cut then falls between a block's halves), so
the interval reachability of optimal.py, which rests on "a sub-range of a fitting range
fits", does not hold. Two dynamic programs over (stage, boundary) do, each O(p n^2) in numpy:

    min-max      D_0 = [0, inf, ...], D_(j+1)(b) = min over a < b of max(D_j(a), L_j(a, b))
                 over the a whose range fits stage j's memory (M[b] <= M[a] + cap_j, the
                 test optimal.py uses); B* = D_p(n), exact: the least bottleneck over every
                 contiguous layout, loads written as above.
    fewest moves among the layouts whose every L_j <= B* + tol (tol = EPS x the largest
                 possible load, as optimal.py), K_(j+1)(b) = max over those a of K_j(a) +
                 |[a, b) ∩ current range of stage j| (moves.py's objective); ties go to the
                 latest boundaries, as moves.py's backtrack picks them.

A layout that already fits B* + tol is kept (no move).

Windows. The link terms are >= 0, so no range whose compute alone, (P[b] - P[a]) / s_j, exceeds
an upper bound U on B* belongs to an optimal layout or to one within B* + tol: each b reads only
the a from about P[b] - U s_j on (a superset, one position and a relative 1e-9 wider, so the
rounding of that search never drops a range the exact test would keep). U is the largest load
of any layout the caller has (optimal.py: the interval solver's layout for the problem without
the factors, and the current one), so with stages that are not too uneven each b reads about
2 n / p positions and a program costs O(n^2) rather than O(p n^2). Rows are processed in
blocks so memory stays bounded (`CELLS`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .problem import EPS, Problem

CELLS = 1 << 22  # (a, b) cells evaluated at once


class CutSolver:
    """The two dynamic programs of the module docstring for one `Problem` with cut factors;
    `starts`: layouts whose largest load bounds B* from above (with none that fits memory, every
    window spans every range)."""

    def __init__(self, problem: Problem, starts: Sequence[Sequence[int]]):
        if problem.r is None:
            raise ValueError("CutSolver is for problems with cut factors; use optimal.Solver")
        pr = self.problem = problem
        self.n, self.p = pr.num_layers, pr.stages
        self.P = np.concatenate(([0.0], np.cumsum(pr.c)))
        self.M = np.concatenate(([0.0], np.cumsum(pr.m)))
        self.r = pr.r
        p = self.p
        self.f = np.zeros(p)
        self.f[: p - 1] = pr.tf
        self.g = np.zeros(p)
        self.g[1:] = pr.tb
        worst = float(self.P[-1]) / float(pr.s.min()) + float((self.f + self.g).max()) * float(self.r.max())
        self.btol = EPS * max(worst, 1e-300)
        mtol = EPS * max(float(self.M[-1]), 1e-300)
        self.mcap = pr.cap + mtol
        self.upper = min((self.bottleneck_of(b) for b in starts), default=math.inf)

    # ---- the load of one stage, for many (a, b) at once ----------------------------------
    def _loads(self, j: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """L_j(a, b) elementwise (broadcast), inf where the range is empty or over the stage's
        memory cap."""
        s = float(self.problem.s[j])
        L = (self.P[b] - self.P[a]) / s + (self.f[j] * self.r[b] + self.g[j] * self.r[a])
        bad = b <= a
        if self.mcap[j] != math.inf:
            bad = bad | ~(self.M[b] <= self.M[a] + self.mcap[j])
        return np.where(bad, math.inf, L)

    def bottleneck_of(self, bnd: Sequence[int]) -> float:
        """The largest stage load of layout `bnd` (inf when a stage is over its memory cap)."""
        b = np.asarray(bnd)
        return float(max(self._loads(j, b[j], b[j + 1]) for j in range(self.p)))

    def _windows(self, j: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Stage j's candidate ranges, in blocks of rows: (b, A), A[row] = the a that b reads
        (window offsets; -1 past the window's end, read as no range)."""
        n, p = self.n, self.p
        amin, amax = (j, n - (p - j)) if j > 0 else (0, 0)  # every stage before holds a layer
        b = np.arange(j + 1, n - (p - 1 - j) + 1) if j < p - 1 else np.full(1, n)
        lo = np.full(len(b), amin)
        if self.upper != math.inf:  # the module docstring's window, one position and 1e-9 wider
            reach = (self.upper * (1 + 1e-9) + self.btol) * float(self.problem.s[j])
            lo = np.maximum(np.searchsorted(self.P, self.P[b] - reach, side="left") - 1, amin)
        hi = np.minimum(b - 1, amax)
        width = np.maximum(hi - lo + 1, 1)
        out = []
        start = 0
        while start < len(b):  # a block: as many rows as keep rows x its widest window <= CELLS
            cells = np.maximum.accumulate(width[start:]) * np.arange(1, len(b) - start + 1)
            sl = slice(start, start + max(1, int(np.searchsorted(cells, CELLS, side="right"))))
            A = lo[sl, None] + np.arange(int(width[sl].max()))[None, :]
            out.append((b[sl], np.where(A <= hi[sl, None], A, -1)))
            start = sl.stop
        return out

    def _stage_loads(self, j: int, b: np.ndarray, A: np.ndarray) -> np.ndarray:
        """L_j over a block of windows; inf where the window has no range."""
        L = self._loads(j, np.maximum(A, 0), b[:, None])
        return np.where(A < 0, math.inf, L)

    def min_bottleneck(self) -> tuple[float, list[int] | None]:
        """(B*, a layout achieving it); (inf, None) when no layout fits the memory caps."""
        n, p = self.n, self.p
        D = np.full(n + 1, math.inf)
        D[0] = 0.0
        arg = np.zeros((p, n + 1), dtype=np.int64)
        for j in range(p):
            new = np.full(n + 1, math.inf)
            for b, A in self._windows(j):
                V = np.maximum(np.where(A < 0, math.inf, D[np.maximum(A, 0)]), self._stage_loads(j, b, A))
                k = A.shape[1] - 1 - np.argmin(V[:, ::-1], axis=1)  # the latest a among equal values
                rows = np.arange(len(b))
                new[b] = V[rows, k]
                arg[j, b] = A[rows, k]
            D = new
        B = float(D[n])
        if B == math.inf:
            return B, None
        out = [n]
        for j in range(p - 1, -1, -1):
            out.append(int(arg[j, out[-1]]))
        return B, out[::-1]

    def fits(self, bnd: Sequence[int], B: float) -> bool:
        """Does layout `bnd` fit every stage at bottleneck B (the tests of the search)?"""
        return self.bottleneck_of(bnd) <= B + self.btol

    def fewest_moves(self, B: float, cur: Sequence[tuple[int, int]]) -> list[int] | None:
        """A layout with every stage load <= B + tol keeping the most layers on their stage
        (`cur[j]`: the layers stage j's worker holds today); None when none fits. B must not
        exceed the solver's upper bound (the windows assume it)."""
        n, p = self.n, self.p
        lim = B + self.btol
        K = np.full(n + 1, -math.inf)
        K[0] = 0.0
        arg = np.zeros((p, n + 1), dtype=np.int64)
        for j in range(p):
            u, v = cur[j]
            new = np.full(n + 1, -math.inf)
            for b, A in self._windows(j):
                ok = self._stage_loads(j, b, A) <= lim
                kept = np.maximum(0, np.minimum(b[:, None], v) - np.maximum(A, u))
                V = np.where(ok, K[np.maximum(A, 0)] + kept, -math.inf)
                k = A.shape[1] - 1 - np.argmax(V[:, ::-1], axis=1)  # the latest a among equal values
                rows = np.arange(len(b))
                new[b] = V[rows, k]
                arg[j, b] = A[rows, k]
            K = new
        if K[n] == -math.inf:
            return None
        out = [n]
        for j in range(p - 1, -1, -1):
            out.append(int(arg[j, out[-1]]))
        return out[::-1]
