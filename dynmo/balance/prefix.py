"""The problem as the exact solver reads it: prefix sums of cost and memory, each stage's speed,
transfer cost and memory cap as Python floats, and the tolerances every fit test uses.

`PrefixSums` is a base class of `Solver` (optimal.py), like `IdenticalStages` and
`Reachability`: it holds the numbers, the solver's methods hold the tests. The definitions
(P, M, the fit test `P[b] <= P[a] + cap`) and the floating-point rule are in optimal.py's
module docstring.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .problem import EPS, Problem


class PrefixSums:
    """Prefix sums, per-stage figures and tolerances of one `Problem` (see the module docstring)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        c, m = problem.c, problem.m
        self.n, self.p = len(c), problem.stages
        self.P = np.concatenate(([0.0], np.cumsum(c)))
        self.M = np.concatenate(([0.0], np.cumsum(m)))
        self.Pl, self.Ml = self.P.tolist(), self.M.tolist()
        self.s = problem.s.tolist()
        self.t = problem.t.tolist()
        total, smin = self.Pl[-1], float(problem.s.min())
        # tolerance in load units (see optimal.py's module docstring)
        self.btol = EPS * max(total / smin + float(problem.t.max()), 1e-300)
        self.mtol = EPS * max(self.Ml[-1], 1e-300)
        self.mcap = [float(x) + self.mtol for x in problem.cap]
        self.dmax_c = float(np.max(np.diff(self.P)))
        self.dmax_m = float(np.max(np.diff(self.M)))
        # margin for the "nothing is blocked" shortcut, so it never disagrees with the exact test
        self.rnd_c = 8 * float(np.spacing(max(total, 1.0)))
        self.rnd_m = 8 * float(np.spacing(max(self.Ml[-1], 1.0)))
        self.smin = smin
        # suffix memory capacity of stages j..p-1 (for the cut-below in forward)
        suf = np.concatenate((np.cumsum(problem.cap[::-1])[::-1], [0.0]))
        self.suf_m = (suf + self.mtol).tolist()
        self.mtot_finite = np.isfinite(suf).tolist()

    def bottleneck_of(self, bnd: Sequence[int]) -> float:
        """The largest stage load of layout `bnd`."""
        b = np.asarray(bnd)
        loads = (self.P[b[1:]] - self.P[b[:-1]]) / self.problem.s + self.problem.t
        return float(loads.max())
