"""`optimal`: the exact minimum bottleneck over contiguous layouts, then the fewest moves.

Definitions. Prefix sums P (cost) and M (memory) over the layers. For a candidate bottleneck
B, stage j may hold layers [a, b) iff b > a, (P[b]-P[a]) / s_j + t_j <= B and
M[b]-M[a] <= cap_j. Both tests are monotone: a sub-range of a range that fits also fits.

Feasibility for a given B (`forward`). R_j = boundary positions b such that stages 0..j-1
can hold exactly layers [0, b). R_0 = {0} and

    R_j = { b : exists a in R_{j-1} with a < b <= far_j(a) }

where far_j(a) is the last b with [a, b) fitting stage j (far_j(a) = a when layer a alone
does not fit: a is *blocked* for stage j). far_j is non-decreasing in a, so the image of a
run x..y of non-blocked positions is exactly the interval [x+1, far_j(y)], and blocked
positions only split runs. We keep every R_j as a sorted list of disjoint intervals, which
is exact; B is feasible iff n is in R_p. Without blocked layers every R_j is one interval
and a probe costs O(p log n). Why not "each stage takes as many layers as it can": with
heterogeneous stages that greedy is wrong (costs [1, 1, 100, 1] on capacities 200, 1, 200:
taking 2 layers on stage 0 leaves 100 for stage 1; taking 1 works). The interval sets keep
every reachable boundary, not just the furthest.

Search (exact). Every probe at B either succeeds, and the layout it returns has an achieved
bottleneck L <= B that becomes the new upper bound, or fails, and then it reports the
smallest load value B' > B at which any comparison it made would flip (a run end's far
growing by one layer, a blocked layer becoming unblocked). No B in [B, B') is feasible, so
B' is a valid lower bound. Lower and upper bounds are both achievable load values, so the
bisection stops on the optimum itself instead of on a float interval.

Floating point: loads within EPS x (largest possible load) of each other are equal (see
problem.EPS); every fit test uses the same expression `P[b] <= P[a] + cap` so forward and
backward passes and the fewest-moves DP agree bit for bit. The prefix sums, the per-stage
figures and these tolerances are computed once per problem (`PrefixSums`, prefix.py).

Identical stages (identical.py). With one speed, one memory cap and one transfer cost, a
greedy from the last stage is exact and much faster; `Solver(general=True)` turns that fast
path off (the tests compare both).

Fewest moves (moves.py). Among the layouts with bottleneck <= B*, one that moves the fewest
layers; it chooses boundaries from F_k = R_k ∩ Q_k, the positions reachable from both ends
(`forward`, `backward`, or `_homogeneous_fsets` for identical stages).

Cut factors (cuts.py). When a link's time depends on where its cut falls (`Problem.cut_factor`,
a boundary between a block's halves shipping more), the fit tests are no longer monotone and
`optimal`, `optimal_with` and `bottleneck_and_tolerance` hand the problem to `CutSolver`'s
dynamic programs, bounded by the layout this solver finds for the problem without the factors
(`cut_solver`); without factors nothing here changes.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np

from .cuts import CutSolver
from .identical import IdenticalStages
from .moves import Intervals, fewest_moves
from .prefix import PrefixSums
from .reach import Reachability
from .search import bisect_bottleneck
from .problem import BalanceError, Problem


class Solver(PrefixSums, IdenticalStages, Reachability):
    """The exact search: per-stage fit tests, forward reachability and the bisection (the
    numbers it reads come from `PrefixSums`, the identical-stage path from `IdenticalStages`,
    the image of a run and backward reachability from `Reachability`)."""

    def __init__(self, problem: Problem, general: bool = False):
        """`general=True` disables the identical-stage fast path (tests compare the two)."""
        super().__init__(problem)
        # range-max tables over single-layer cost / memory (an O(1) "anything blocked in
        # [l, h]?" test before the O(h - l) scan) are built on first use: see _clear
        self._sp: tuple[list[list[float]], list[list[float]]] | None = None
        # identical stages (see _homogeneous_probe): one speed, one memory cap, one transfer
        # cost on every sending stage (the last stage sends nothing, so its cost cap is larger)
        s_, cap_, t_ = problem.s, problem.cap, problem.t
        self.homog = (not general and bool(np.all(s_ == s_[0])) and bool(np.all(cap_ == cap_[0]))
                      and bool(np.all(t_[: self.p - 1] == t_[0])))
        self._near_m: np.ndarray | None = None
        if self.homog and self.mcap[0] != math.inf:
            # smallest a with [a, b) fitting the memory cap, for every b (independent of B);
            # M + mcap is elementwise the same float as the scalar test Ml[a] + mcap
            self._near_m = np.searchsorted(self.M + self.mcap[0], self.M, side="left")

    # ---- per-stage fit tests ----------------------------------------------------------
    def ccap(self, B: float, j: int) -> float:
        """Largest cost sum stage j may hold at bottleneck B (with the tolerance)."""
        return (B + self.btol - self.t[j]) * self.s[j]

    def _blocked(self, l: int, h: int, ccap: float, mcap: float, j: int) -> tuple[np.ndarray, float]:
        """Positions a in [l, h] whose single layer does not fit the stage; min unblock load."""
        P, M = self.P, self.M
        cb = P[l + 1 : h + 2] > P[l : h + 1] + ccap
        mb = M[l + 1 : h + 2] > M[l : h + 1] + mcap
        blk = cb | mb
        idx = np.flatnonzero(blk)
        ev = math.inf
        only_cost = cb & ~mb
        if only_cost.any():
            seg = (P[l + 1 : h + 2] - P[l : h + 1])[only_cost]
            ev = float(seg.min()) / self.s[j] + self.t[j]
        return idx + l, ev

    def _runs(self, l: int, h: int, ccap: float, mcap: float, j: int, fast: bool) -> tuple[Intervals, float]:
        if fast or self._clear(l, h, ccap, mcap):
            return [(l, h)], math.inf
        idx, ev = self._blocked(l, h, ccap, mcap, j)
        if len(idx) == 0:
            return [(l, h)], math.inf
        runs: Intervals = []
        x = l
        for a in idx.tolist():
            if a > x:
                runs.append((x, a - 1))
            x = a + 1
        if x <= h:
            runs.append((x, h))
        return runs, ev

    def _clear(self, l: int, h: int, ccap: float, mcap: float) -> bool:
        """True if no layer in [l, h] is blocked (conservative: False may still be clear)."""
        if self._sp is None:
            self._sp = (_sparse_table(np.diff(self.P)), _sparse_table(np.diff(self.M)))
        k = (h - l + 1).bit_length() - 1
        tc, tm = self._sp[0][k], self._sp[1][k]
        r = h - (1 << k) + 1
        cm = tc[l] if tc[l] > tc[r] else tc[r]
        mm = tm[l] if tm[l] > tm[r] else tm[r]
        return cm + self.rnd_c <= ccap and mm + self.rnd_m <= mcap

    def _fast(self, ccap: float, mcap: float) -> bool:
        return self.dmax_c + self.rnd_c <= ccap and self.dmax_m + self.rnd_m <= mcap

    # ---- forward reachability ---------------------------------------------------------
    def forward(self, B: float, cut: bool = True) -> tuple[bool, list[Intervals], float]:
        """(feasible, R_0..R_j as interval lists, next event load if infeasible).

        Two facts keep this fast. (1) Inside an interval [l, h] of R_{j-1}, a run x..y of
        non-blocked positions that ends just before a blocked one maps to [x+1, y+1] (a
        range through the blocked layer cannot fit), so only the run ending at h needs a
        far() search. (2) R_j is cut below at the first b whose remaining cost [b, n) or
        memory could still fit the total capacity of stages j..p-1 (a necessary condition,
        so exactness is kept); near the optimum that makes the sets short.
        """
        n, p, Pl, Ml = self.n, self.p, self.Pl, self.Ml
        s, t = self.s, self.t
        ccaps = [self.ccap(B, j) for j in range(p)]
        # suffix capacity sums: stages j..p-1 together
        suf_c = [0.0] * (p + 1)
        suf_s = [0.0] * (p + 1)
        suf_ts = [0.0] * (p + 1)
        for j in range(p - 1, -1, -1):
            suf_c[j] = suf_c[j + 1] + ccaps[j]
            suf_s[j] = suf_s[j + 1] + s[j]
            suf_ts[j] = suf_ts[j + 1] + t[j] * s[j]
        margin = self.btol * self.smin
        R: Intervals = [(0, 0)]
        hist = [R]
        ev = math.inf
        cut_ev = math.inf  # flips from the cut-below: lower bounds, but not achievable loads
        self.last_event_achievable = True
        for j in range(p):
            lim = n - (p - 1 - j)
            ccap, mcap = ccaps[j], self.mcap[j]
            fast = self._fast(ccap, mcap)
            new: Intervals = []
            for l, h in R:
                pieces, e = self._image(l, h, ccap, mcap, j, fast, lim)
                if e < ev:
                    ev = e
                for lb, hb in pieces:
                    if new and lb <= new[-1][1] + 1:
                        if hb > new[-1][1]:
                            new[-1] = (new[-1][0], hb)
                    else:
                        new.append((lb, hb))
            # (2) cut below: stages j+1.. must still be able to take [b, n)
            if cut and new and j + 1 < p:
                need = Pl[-1] - suf_c[j + 1] - margin
                low = bisect.bisect_left(Pl, need, 0, n + 1)
                if self.mtot_finite[j + 1]:
                    low = max(low, bisect.bisect_left(Ml, Ml[-1] - self.suf_m[j + 1], 0, n + 1))
                if low > new[0][0]:
                    if low - 1 >= 0 and Pl[low - 1] < need:
                        # position low-1 joins when the capacity sum grows enough
                        e = (Pl[-1] - Pl[low - 1] - margin + suf_ts[j + 1]) / suf_s[j + 1] - 2 * self.btol
                        if e < cut_ev:
                            cut_ev = max(e, B)
                    new = _cut_below(new, low)
            if not new:
                break
            R = new
            hist.append(R)
        ok = len(hist) == p + 1 and R[-1][1] == n
        if not ok and cut_ev < ev:
            ev = cut_ev
            self.last_event_achievable = False
        return ok, hist, ev

    def backtrack(self, hist: list[Intervals]) -> list[int]:
        """A layout through the reachable sets: each boundary as late as possible."""
        b = self.n
        out = [b]
        for j in range(self.p - 1, 0, -1):
            R = hist[j]
            starts = [iv[0] for iv in R]
            i = bisect.bisect_right(starts, b - 1) - 1
            a = min(R[i][1], b - 1)
            out.append(a)
            b = a
        out.append(0)
        out.reverse()
        return out

    # ---- search --------------------------------------------------------------------------
    def min_bottleneck(self) -> tuple[float, list[int], int]:
        """(B*, a layout achieving it, number of probes)."""
        if self.homog:
            return self._min_bottleneck_homogeneous()
        ok, hist, _ = self.forward(math.inf)
        if not ok:
            raise self._memory_error()
        best = self.backtrack(hist)
        pr = self.problem
        lo = max(self.Pl[-1] / float(pr.s.sum()), float(pr.c.max()) / float(pr.s.max()), float(pr.t.max()))

        def probe(B: float) -> tuple[bool, list[int] | None, float, bool]:
            ok, hist, ev = self.forward(B)
            return ok, (self.backtrack(hist) if ok else None), ev, self.last_event_achievable

        return bisect_bottleneck(lo, best, probe, 1, self.bottleneck_of, self.btol)

    def _memory_error(self) -> BalanceError:
        """The error for a problem no layout fits, naming the tightest memory constraint."""
        _, hist, _ = self.forward(math.inf, cut=False)
        return BalanceError(explain_memory(self.problem, hist))


def _sparse_table(x: np.ndarray) -> list[list[float]]:
    levels = [x]
    k = 1
    while (1 << k) <= len(x):
        prev = levels[-1]
        half = 1 << (k - 1)
        levels.append(np.maximum(prev[:-half], prev[half:]))
        k += 1
    return [lv.tolist() for lv in levels]


def _cut_below(x: Intervals, low: int) -> Intervals:
    out = [(max(a, low), b) for a, b in x if b >= low]
    return out


def explain_memory(problem: Problem, hist: list[Intervals]) -> str:
    """Name the tightest memory constraint of an infeasible problem."""
    m, cap, n, p = problem.m, problem.cap, problem.num_layers, problem.stages
    big = int(np.argmax(m))
    if m[big] > cap.max():
        return (f"infeasible: layer {big} needs {m[big]:g} of memory but the largest stage "
                f"capacity is {cap.max():g}; raise the capacity or split the layer")
    if m.sum() > cap.sum():
        return (f"infeasible: the layers need {m.sum():g} of memory in total but the {p} stages "
                f"hold {cap.sum():g}; add stages or capacity")
    j = len(hist) - 1  # stages 0..j-1 could be placed
    if j < p:
        R = hist[j]
        return (f"infeasible: no contiguous layout fits the memory caps; stage {j} (capacity "
                f"{cap[j]:g}) cannot start at any reachable boundary {R[:4]} because the next "
                f"layer alone does not fit it; raise capacity[{j}] or reorder workers")
    hi = hist[-1][-1][1]
    rest = float(m[hi:].sum())
    return (f"infeasible: no contiguous layout fits the memory caps; stages 0..{p - 2} can hold "
            f"at most layers 0..{hi - 1}, leaving layers {hi}..{n - 1} ({rest:g} of memory) for "
            f"stage {p - 1} with capacity {cap[p - 1]:g}; raise capacity[{p - 1}] or add a stage")


def optimal(problem: Problem, *, _general: bool = False) -> list[int]:
    """Boundaries of an exact min-bottleneck layout with the fewest moves from current.

    `_general=True` (tests only) skips the identical-stage fast path.
    """
    if problem.r is not None:
        cs = cut_solver(problem)
        B, best = cs.min_bottleneck()
        cur = problem.current_layout.boundaries
        if cs.fits(cur, B):
            return list(cur)
        out = cs.fewest_moves(B, [(cur[j], cur[j + 1]) for j in range(problem.stages)])
        return best if out is None else out
    sol = Solver(problem, general=_general)
    B, best, _ = sol.min_bottleneck()
    cur = problem.current_layout.boundaries
    if max_load_ok(sol, cur, B):
        return list(cur)
    ranges = [(cur[j], cur[j + 1]) for j in range(problem.stages)]
    out = fewest_moves(sol, B, ranges)
    return best if out is None else out


def optimal_with(problem: Problem, ranges: Sequence[tuple[int, int]]) -> tuple[list[int], float]:
    """Like `optimal` with explicit current ranges per stage (re-packing); also returns B*."""
    if problem.r is not None:
        cs = cut_solver(problem)
        B, best = cs.min_bottleneck()
        out = cs.fewest_moves(B, ranges)
        return (best if out is None else out), B
    sol = Solver(problem)
    B, best, _ = sol.min_bottleneck()
    out = fewest_moves(sol, B, ranges)
    return (best if out is None else out), B


def bottleneck_and_tolerance(problem: Problem) -> tuple[float, float]:
    """(B*, the solver's load tolerance) of `problem`, with or without cut factors."""
    if problem.r is not None:
        cs = cut_solver(problem)
        return cs.min_bottleneck()[0], cs.btol
    sol = Solver(problem)
    return sol.min_bottleneck()[0], sol.btol


def cut_solver(problem: Problem) -> CutSolver:
    """The exact solver of a problem with cut factors (cuts.py), its windows bounded by the
    better of the current layout and this solver's layout for the same problem without the
    factors (whose links cost as a cut between blocks). BalanceError when no layout fits the
    memory caps (the factors do not change which do)."""
    _, plain, _ = Solver(problem).min_bottleneck()  # raises, naming the tightest memory constraint
    return CutSolver(problem, [plain, problem.current_layout.boundaries])


def max_load_ok(sol: Solver, bnd: Sequence[int], B: float) -> bool:
    """Does layout `bnd` fit every stage at bottleneck B (same tests as the search)?"""
    Pl, Ml = sol.Pl, sol.Ml
    for j in range(sol.p):
        a, b = bnd[j], bnd[j + 1]
        if not (Pl[b] <= Pl[a] + sol.ccap(B, j)) or not (Ml[b] <= Ml[a] + sol.mcap[j]):
            return False
    return True
