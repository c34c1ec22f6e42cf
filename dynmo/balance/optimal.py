"""`optimal`: the exact minimum bottleneck over contiguous layouts, then the fewest moves.

Definitions. Prefix sums P (cost) and M (memory) over the layers. For a candidate bottleneck
B, stage j may hold layers [a, b) iff b > a, (P[b]-P[a]) / s_j + t_j <= B and
M[b]-M[a] <= cap_j. Both tests are monotone: a sub-range of a range that fits also fits.

Feasibility for a given B (`_forward`). R_j = boundary positions b such that stages 0..j-1
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
backward passes and the move DP agree bit for bit.

Identical stages (fast path, `_homogeneous_probe`). With one speed, one memory cap (or none)
and one transfer cost on every sending stage, the caps never grow in the order stage p-1,
p-2, ..., 0, and then "each stage, from the back, takes the longest suffix that fits, leaving
>= 1 layer for every earlier stage" is exact (exchange argument in `_homogeneous_probe`). A
probe is one np.searchsorted over all positions plus an O(p) walk; the search starts from
lo = max(average load, largest layer) and gallops up to the first feasible B. The reachable
sets are then single intervals given by the forward and backward greedy
(`_homogeneous_fsets`) unless some layer alone is too big for a stage. `Solver(general=True)`
turns the fast path off (the tests compare both).

Fewest moves (`min_moves`). Among layouts with bottleneck <= B*, maximize the layers kept on
their current stage. Boundary k may only sit in F_k = R_k (forward reachable) intersected
with Q_k (the rest [b, n) fits stages k..p-1, computed by the mirror pass). A DP over
(k, b in F_k) takes the best predecessor a in F_{k-1} with [a, b) fitting stage k-1; the
candidates for b are a window [near(b), b-1]. Cost O(sum_k |F_k| * window_k): at the optimum
the F_k are narrow (most stages are tight), so this is far below the naive O(n^2 p).
`_dp_bulk` builds the candidate table for all stages at once and runs the stage loop with four
numpy calls per stage; `_dp_stagewise` (same result) is used when that table would be large.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

import numpy as np

from .problem import EPS, BalanceError, Problem

Intervals = list[tuple[int, int]]


class Solver:
    def __init__(self, problem: Problem, general: bool = False):
        """`general=True` disables the identical-stage fast path (tests compare the two)."""
        self.problem = problem
        c, m = problem.c, problem.m
        self.n, self.p = len(c), problem.stages
        self.P = np.concatenate(([0.0], np.cumsum(c)))
        self.M = np.concatenate(([0.0], np.cumsum(m)))
        self.Pl, self.Ml = self.P.tolist(), self.M.tolist()
        self.s = problem.s.tolist()
        self.t = problem.t.tolist()
        total, smin = self.Pl[-1], float(problem.s.min())
        # tolerance in load units (see module docstring)
        self.btol = EPS * max(total / smin + float(problem.t.max()), 1e-300)
        self.mtol = EPS * max(self.Ml[-1], 1e-300)
        self.mcap = [float(x) + self.mtol for x in problem.cap]
        self.dmax_c = float(np.max(np.diff(self.P)))
        self.dmax_m = float(np.max(np.diff(self.M)))
        # margin for the "nothing is blocked" shortcut, so it never disagrees with the exact test
        self.rnd_c = 8 * float(np.spacing(max(total, 1.0)))
        self.rnd_m = 8 * float(np.spacing(max(self.Ml[-1], 1.0)))
        self.smin = smin
        # range-max tables over single-layer cost / memory (an O(1) "anything blocked in
        # [l, h]?" test before the O(h - l) scan) are built on first use: see _clear
        self._sp: tuple[list[list[float]], list[list[float]]] | None = None
        # suffix memory capacity of stages j..p-1 (for the cut-below in forward)
        suf = np.concatenate((np.cumsum(problem.cap[::-1])[::-1], [0.0]))
        self.suf_m = (suf + self.mtol).tolist()
        self.mtot_finite = np.isfinite(suf).tolist()
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

    def load(self, a: int, b: int, j: int) -> float:
        return (self.Pl[b] - self.Pl[a]) / self.s[j] + self.t[j]

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

    def _image(self, l: int, h: int, ccap: float, mcap: float, j: int, fast: bool,
               lim: int) -> tuple[Intervals, float]:
        """{b : a in [l, h], a < b <= far_j(a)} as intervals, and the smallest flip load."""
        Pl, Ml, n = self.Pl, self.Ml, self.n
        ev = math.inf
        out: Intervals = []
        x = l
        if not fast and not self._clear(l, h, ccap, mcap):
            idx, ev = self._blocked(l, h, ccap, mcap, j)
            if len(idx):
                # interior runs x..a-1 (a blocked) map to [x+1, a]
                starts = np.concatenate(([l], idx + 1))
                ends = np.concatenate((idx - 1, [h]))
                keep = starts[:-1] <= ends[:-1]
                out = [(a + 1, min(b + 1, lim)) for a, b in zip(starts[:-1][keep].tolist(), ends[:-1][keep].tolist())
                       if a + 1 <= lim]
                x = int(starts[-1])
                if x > h:
                    return out, ev
        y = h
        cf = bisect.bisect_right(Pl, Pl[y] + ccap, y) - 1
        mf = n if mcap == math.inf else bisect.bisect_right(Ml, Ml[y] + mcap, y) - 1
        f = cf if cf < mf else mf
        if cf < mf and cf < lim:
            e = (Pl[cf + 1] - Pl[y]) / self.s[j] + self.t[j]
            if e < ev:
                ev = e
        hb = f if f < lim else lim
        if x + 1 <= hb:
            out.append((x + 1, hb))
        return out, ev

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

    def bottleneck_of(self, bnd: Sequence[int]) -> float:
        b = np.asarray(bnd)
        loads = (self.P[b[1:]] - self.P[b[:-1]]) / self.problem.s + self.problem.t
        return float(loads.max())

    # ---- backward reachability (mirror of forward, in the same coordinates) -----------
    def backward(self, B: float) -> list[Intervals]:
        """Q_0..Q_p: Q_j = positions a such that layers [a, n) fit stages j..p-1."""
        n, p = self.n, self.p
        Q: Intervals = [(n, n)]
        out: list[Intervals] = [Q]
        for j in range(p - 1, -1, -1):
            ccap, mcap = self.ccap(B, j), self.mcap[j]
            fast = self._fast(ccap, mcap)
            new: Intervals = []
            for l, h in Q:
                # b is usable iff layer b-1 alone fits: runs over b-1 in [l-1, h-1]
                runs, _ = self._runs(l - 1, h - 1, ccap, mcap, j, fast)
                for x1, y1 in runs:
                    x = x1 + 1  # smallest b of the run
                    na = self._near(x, ccap, mcap)
                    la = max(na, j)
                    ha = y1  # = y - 1
                    if la > ha:
                        continue
                    if new and la <= new[-1][1] + 1:
                        if ha > new[-1][1]:
                            new[-1] = (new[-1][0], ha)
                    else:
                        new.append((la, ha))
            Q = new
            out.append(Q)
            if not Q:
                break
        out.reverse()  # out[k] = Q_k for k = p - len(out) + 1 .. p
        return out

    def _near(self, b: int, ccap: float, mcap: float) -> int:
        """Smallest a with [a, b) fitting (cost and memory), using the exact fit expression."""
        Pl, Ml = self.Pl, self.Ml
        a = bisect.bisect_left(Pl, Pl[b] - ccap, 0, b)
        while a > 0 and Pl[b] <= Pl[a - 1] + ccap:
            a -= 1
        while a < b and not (Pl[b] <= Pl[a] + ccap):
            a += 1
        if mcap != math.inf:
            am = bisect.bisect_left(Ml, Ml[b] - mcap, 0, b)
            while am > 0 and Ml[b] <= Ml[am - 1] + mcap:
                am -= 1
            while am < b and not (Ml[b] <= Ml[am] + mcap):
                am += 1
            a = max(a, am)
        return a

    # ---- identical stages: greedy from the back ---------------------------------------
    def _homogeneous_probe(self, B: float) -> tuple[bool, list[int] | None, float]:
        """Exact feasibility of B for identical stages: (ok, boundaries g_0..g_p, next event).

        Greedy from the back: stage p-1 takes the longest suffix that fits, then stage p-2,
        ..., each leaving >= 1 layer for every earlier stage: g_p = n and
        g_k = max(near_k(g_{k+1}), k), where near_k(b) is the smallest a with [a, b) fitting
        stage k. B is feasible iff this reaches g_0 = 0 with every stage non-empty.

        Why greedy is exact here (exchange argument). Stages 0..p-2 have the same cost cap
        (B - t) s and memory cap; stage p-1 sends nothing, so its cost cap B s is at least as
        large: in the order the greedy visits stages (p-1 first) the caps never grow. Let b*
        be any feasible layout; by induction g_k <= b*_k for k = p..1 and every greedy stage
        fits. Step k (given g_{k+1} <= b*_{k+1}):
          - if b*_k < g_{k+1}: [b*_k, g_{k+1}) is a sub-range of b*'s stage k, so it fits and
            near_k(g_{k+1}) <= b*_k; also k <= b*_k, hence g_k <= b*_k < g_{k+1}.
          - if b*_k >= g_{k+1} (then k <= p-2, since b*_{p-1} < n = g_p): b* puts layer
            g_{k+1}-1 on some stage j < k, so that layer alone fits stage j and hence stage k
            (same caps), so near_k(g_{k+1}) <= g_{k+1}-1; with k < g_{k+1} (the clamp at
            step k+1) g_k < g_{k+1} <= b*_k.
        At k = 0, [0, g_1) is a sub-range of b*'s stage 0, so near_0(g_1) = 0. Conversely a
        run reaching 0 is a layout. With heterogeneous stages the caps are not ordered and
        this fails (see the module docstring); there the interval sets are needed.
        All fit tests are the exact expressions of the general path (`P[b] <= P[a] + ccap`),
        evaluated by np.searchsorted on P + ccap (elementwise the same floats), so both paths
        take the same decisions.

        Next event (when infeasible): the run is a function of the near_k values it looked
        at; near_k(b) (cost part) only moves when [near_k(b)-1, b) starts to fit, i.e. at
        that range's load. Stages where the memory cap or the clamp k decides cannot change.
        """
        n, p, Pl = self.n, self.p, self.Pl
        cl = self.ccap(B, p - 1)
        nm = self._near_m
        nc_last = self._near(n, cl, math.inf)
        nm_last = 0 if nm is None else int(nm[n])
        g = max(nc_last, nm_last, p - 1)
        gs = [n]
        ok = g < n
        m = 0  # stages 0..p-2 visited (the failing one included)
        near_c = None
        if ok:
            gs.append(g)
            if p > 1:
                cc = self.ccap(B, 0)
                near_c = np.searchsorted(self.P + cc, self.P, side="left")
                nl = (near_c if nm is None else np.maximum(near_c, nm)).tolist()
                for k in range(p - 2, -1, -1):
                    m += 1
                    a = nl[g]
                    if a < k:
                        a = k
                    if a >= g:
                        ok = False
                        break
                    g = a
                    gs.append(g)
            ok = ok and g == 0
        if ok:
            gs.reverse()
            return True, gs, math.inf
        # next event
        ev = math.inf
        s, t = self.s[p - 1], self.t[p - 1]
        if nc_last - 1 >= max(nm_last, p - 1):
            ev = (Pl[n] - Pl[nc_last - 1]) / s + t
        if m:
            gn = np.asarray(gs[1 : 1 + m])  # g_{k+1} for k = p-2, p-3, ...
            ks = p - 2 - np.arange(m)
            nc = near_c[gn]
            floor = ks if nm is None else np.maximum(nm[gn], ks)
            sel = nc - 1 >= floor
            if sel.any():
                gb, ga = gn[sel], nc[sel] - 1
                e = float(((self.P[gb] - self.P[ga]) / self.s[0] + self.t[0]).min())
                ev = min(ev, e)
        return False, None, ev

    def _min_bottleneck_homogeneous(self) -> tuple[float, list[int], int]:
        p, pr = self.p, self.problem
        s, t = self.s[0], self.t[0] if p > 1 else 0.0
        cmax = float(pr.c.max())
        # lower bound: the average load, and the largest layer on any stage
        lo = max(self.Pl[-1] / (p * s) + t * (p - 1) / p, cmax / s)
        # upper bound: without memory caps the greedy is feasible at lo + cmax / s + t (each
        # stage but the last is filled to more than its cap - cmax). B* is usually much
        # closer to lo, so gallop up from lo + (top - lo) / 32; a failure raises lo to its event
        top = lo + cmax / s + t
        delta = max((top - lo) / 32, self.btol)
        probes = 0
        while True:
            B = lo + delta if lo + delta < top else top
            ok, best, ev = self._homogeneous_probe(B)
            probes += 1
            if ok:
                break
            lo = max(lo, ev)
            if B >= top:
                ok, best, _ = self._homogeneous_probe(math.inf)  # memory caps decide
                probes += 1
                if not ok:
                    _, hist, _ = self.forward(math.inf, cut=False)
                    raise BalanceError(explain_memory(self.problem, hist))
                break
            delta *= 2

        def probe(B: float) -> tuple[bool, list[int] | None, float, bool]:
            ok, bnd, ev = self._homogeneous_probe(B)
            return ok, bnd, ev, True

        return self._search(lo, best, probe, probes)

    # ---- search --------------------------------------------------------------------------
    def min_bottleneck(self) -> tuple[float, list[int], int]:
        """(B*, a layout achieving it, number of probes)."""
        if self.homog:
            return self._min_bottleneck_homogeneous()
        ok, hist, _ = self.forward(math.inf)
        if not ok:
            _, hist, _ = self.forward(math.inf, cut=False)
            raise BalanceError(explain_memory(self.problem, hist))
        best = self.backtrack(hist)
        pr = self.problem
        lo = max(self.Pl[-1] / float(pr.s.sum()), float(pr.c.max()) / float(pr.s.max()), float(pr.t.max()))

        def probe(B: float) -> tuple[bool, list[int] | None, float, bool]:
            ok, hist, ev = self.forward(B)
            return ok, (self.backtrack(hist) if ok else None), ev, self.last_event_achievable

        return self._search(lo, best, probe, 1)

    def _search(self, lo: float, best: list[int], probe, probes: int) -> tuple[float, list[int], int]:
        """Bisection between achievable bounds (module docstring); `best` is feasible."""
        hi = self.bottleneck_of(best)

        def improves(bnd: list[int]) -> bool:
            """Keep `bnd` if it beats the best so far."""
            nonlocal hi, best
            L = self.bottleneck_of(bnd)
            if L < hi:
                hi, best = L, bnd
                return True
            return False

        while hi - lo > self.btol:
            mid = lo + (hi - lo) / 2
            ok, bnd, ev, achievable = probe(mid)
            probes += 1
            if ok:
                if not improves(bnd):  # hi is already within tolerance of mid: nothing better exists
                    break
            else:
                lo = max(ev, mid)
                if lo <= hi and achievable:  # a lower bound that is an achievable value: try it directly
                    ok, bnd, ev2, _ = probe(lo)
                    probes += 1
                    if ok:
                        improves(bnd)
                        break
                    lo = max(ev2, lo)
        return hi, best, probes

    # ---- fewest moves --------------------------------------------------------------------
    def min_moves(self, B: float, cur: Sequence[tuple[int, int]]) -> list[int] | None:
        """Among layouts with bottleneck <= B, one keeping the most layers on their stage.

        cur[j] = (u, v): the layers [u, v) that the worker of stage j holds today.
        """
        p = self.p
        Fs = self._homogeneous_fsets(B) if self.homog else None
        if Fs is None:
            ok, R, _ = self.forward(B)
            if not ok:
                return None
            Q = self.backward(B)
            if len(Q) != p + 1:
                return None
            Fs = [_intersect(R[k], Q[k]) for k in range(p + 1)]
        if not all(Fs):
            return None
        out = self._dp_bulk(B, Fs, cur)
        if out is False:
            out = self._dp_stagewise(B, Fs, cur)
        return out

    def _homogeneous_fsets(self, B: float) -> list[Intervals] | None:
        """F_0..F_p for identical stages when no single layer is too big for any stage.

        Then R_k = [k, y_k] with y_k = min(far(y_{k-1}), n-(p-k)) (forward greedy) and
        Q_k = [x_k, n-(p-k)] with x_k the backward greedy of `_homogeneous_probe`, so
        F_k = [x_k, y_k]: the same sets the general passes compute, in O(p) after one
        vectorized far() per position. None: use the general passes; [] : infeasible.
        """
        n, p, P, M = self.n, self.p, self.P, self.M
        cc, mcap = self.ccap(B, 0), self.mcap[0]
        # stage 0's caps are the smallest: a layer fitting it alone fits every stage
        if not bool(np.all(P[1:] <= P[:-1] + cc)):
            return None
        if mcap != math.inf and not bool(np.all(M[1:] <= M[:-1] + mcap)):
            return None
        ok, g, _ = self._homogeneous_probe(B)
        if not ok:
            return []
        far = np.searchsorted(P, P + cc, side="right") - 1
        if mcap != math.inf:
            far = np.minimum(far, np.searchsorted(M, M + mcap, side="right") - 1)
        fl = far.tolist()
        Fs: list[Intervals] = [[(0, 0)]]
        y = 0
        for k in range(1, p):
            lim = n - (p - k)
            y = fl[y]
            if y > lim:
                y = lim
            if g[k] > y:
                return []
            Fs.append([(g[k], y)])
        Fs.append([(n, n)])  # the probe reached n from F_{p-1}
        return Fs

    def _dp_bulk(self, B: float, Fs: list[Intervals], cur: Sequence[tuple[int, int]]) -> list[int] | None | bool:
        """The fewest-moves DP with every K-independent array built at once for all stages.

        Same recurrence, candidates and tie-breaking (the largest a among equal values) as
        `_dp_stagewise`, so the same layout; the per-stage loop is four numpy calls. Returns
        False when the candidate table would be too large (then the caller goes stage-wise).
        """
        n, p, P, M = self.n, self.p, self.P, self.M
        C0 = np.array([f[0][0] for f in Fs])
        C1 = np.array([f[-1][1] for f in Fs])
        doff = np.concatenate(([0], np.cumsum(C1 - C0 + 1)))
        sentinel = int(doff[-1])
        # rows: every position b of F_k, k = 1..p, in order of k
        ivs = [(k, l, h) for k in range(1, p + 1) for l, h in Fs[k]]
        iv = np.array(ivs, dtype=np.int64)
        lens = iv[:, 2] - iv[:, 1] + 1
        nrows = int(lens.sum())
        first = np.repeat(np.cumsum(lens) - lens, lens)
        rb = np.repeat(iv[:, 1], lens) + np.arange(nrows) - first
        rk = np.repeat(iv[:, 0], lens)
        A0, A1 = C0[rk - 1], C1[rk - 1]
        # smallest fitting start for each row (stage j = k-1), clipped to the cover of F_{k-1}
        # like the stage-wise searchsorted over P[A0..A1] + ccap; stages with equal caps share
        # one call
        ccaps = [self.ccap(B, j) for j in range(p)]
        near = np.empty(nrows, dtype=np.int64)
        rstart = np.searchsorted(rk, np.arange(1, p + 2), side="left")
        j0 = 0
        while j0 < p:
            j1 = j0 + 1
            while j1 < p and ccaps[j1] == ccaps[j0] and self.mcap[j1] == self.mcap[j0]:
                j1 += 1
            r0, r1 = rstart[j0], rstart[j1]
            b = rb[r0:r1]
            nr = np.searchsorted(P + ccaps[j0], P[b], side="left")
            if self.mcap[j0] != math.inf:
                nr = np.maximum(nr, np.searchsorted(M + self.mcap[j0], M[b], side="left"))
            near[r0:r1] = nr
            j0 = j1
        lo_a = np.clip(near, A0, A1 + 1)
        hi_a = np.minimum(rb - 1, A1)
        W = max(int((hi_a - lo_a + 1).max()), 1)
        if nrows * W > 4_000_000:
            return False
        a = hi_a[:, None] - np.arange(W)[None, :]
        valid = a >= lo_a[:, None]
        gidx = np.where(valid, (doff[rk - 1] - A0)[:, None] + a, sentinel)
        U = np.array([u for u, _ in cur], dtype=np.int64)[rk - 1]
        V = np.array([v for _, v in cur], dtype=np.int64)[rk - 1]
        ov = np.maximum(0, np.minimum(rb, V)[:, None] - np.maximum(a, U[:, None])).astype(np.float64)
        dpos = doff[rk] + rb - C0[rk]
        Kall = np.full(sentinel + 1, -np.inf)
        Kall[0] = 0.0  # F_0 = {0}
        for k in range(1, p + 1):
            r0, r1 = rstart[k - 1], rstart[k]
            Kall[dpos[r0:r1]] = (Kall[gidx[r0:r1]] + ov[r0:r1]).max(axis=1)
        if C0[p] != n or not np.isfinite(Kall[doff[p]]):
            return None
        bi = np.argmax(Kall[gidx] + ov, axis=1)
        par = np.full(sentinel, -1, dtype=np.int64)
        par[dpos] = a[np.arange(nrows), bi]
        parl, doffl, C0l = par.tolist(), doff.tolist(), C0.tolist()
        out = [n]
        b = n
        for k in range(p, 0, -1):
            b = parl[doffl[k] + b - C0l[k]]
            out.append(b)
        out.reverse()
        if out[0] != 0:
            return None
        return out

    def _dp_stagewise(self, B: float, Fs: list[Intervals], cur: Sequence[tuple[int, int]]) -> list[int] | None:
        n, p = self.n, self.p
        P, M = self.P, self.M
        # K over the cover range of F_0 = {0}
        A0, A1 = 0, 0
        K = np.zeros(1)
        parents: list[tuple[int, np.ndarray]] = []
        for k in range(1, p + 1):
            j = k - 1
            F = Fs[k]
            if not F:
                return None
            bs = np.concatenate([np.arange(l, h + 1) for l, h in F])
            ccap, mcap = self.ccap(B, j), self.mcap[j]
            Pa = P[A0 : A1 + 1] + ccap
            near = np.searchsorted(Pa, P[bs], side="left") + A0
            if mcap != math.inf:
                Ma = M[A0 : A1 + 1] + mcap
                near = np.maximum(near, np.searchsorted(Ma, M[bs], side="left") + A0)
            lo_a = near
            hi_a = np.minimum(bs - 1, A1)
            u, v = cur[j]
            newK = np.full(len(bs), -np.inf)
            par = np.full(len(bs), -1, dtype=np.int64)
            width = np.maximum(hi_a - lo_a + 1, 0)
            w = int(width.max()) if len(width) else 0
            if w > 0:
                step = max(1, 4_000_000 // w)
                for r0 in range(0, len(bs), step):
                    r1 = min(len(bs), r0 + step)
                    a = hi_a[r0:r1, None] - np.arange(w)[None, :]
                    okm = a >= lo_a[r0:r1, None]
                    ai = np.clip(a - A0, 0, A1 - A0)
                    b2 = bs[r0:r1, None]
                    ov = np.maximum(0, np.minimum(b2, v) - np.maximum(a, u))
                    val = np.where(okm, K[ai], -np.inf) + ov
                    bi = np.argmax(val, axis=1)
                    rows = np.arange(r1 - r0)
                    newK[r0:r1] = val[rows, bi]
                    par[r0:r1] = a[rows, bi]
            # dense arrays over the cover range of F_k for the next stage
            C0, C1 = int(bs[0]), int(bs[-1])
            Kd = np.full(C1 - C0 + 1, -np.inf)
            Kd[bs - C0] = newK
            pd = np.full(C1 - C0 + 1, -1, dtype=np.int64)
            pd[bs - C0] = par
            parents.append((C0, pd))
            K, A0, A1 = Kd, C0, C1
        if A0 != n or not np.isfinite(K[0]):
            return None
        out = [n]
        b = n
        for k in range(p, 0, -1):
            C0, pd = parents[k - 1]
            b = int(pd[b - C0])
            out.append(b)
        out.reverse()
        if out[0] != 0:
            return None
        return out


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


def _intersect(x: Intervals, y: Intervals) -> Intervals:
    out: Intervals = []
    i = k = 0
    while i < len(x) and k < len(y):
        lo = max(x[i][0], y[k][0])
        hi = min(x[i][1], y[k][1])
        if lo <= hi:
            out.append((lo, hi))
        if x[i][1] < y[k][1]:
            i += 1
        else:
            k += 1
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
    sol = Solver(problem, general=_general)
    B, best, _ = sol.min_bottleneck()
    cur = problem.current_layout.boundaries
    if max_load_ok(sol, cur, B):
        return list(cur)
    ranges = [(cur[j], cur[j + 1]) for j in range(problem.stages)]
    out = sol.min_moves(B, ranges)
    return best if out is None else out


def optimal_with(problem: Problem, ranges: Sequence[tuple[int, int]]) -> tuple[list[int], float]:
    """Like `optimal` with explicit current ranges per stage (re-packing); also returns B*."""
    sol = Solver(problem)
    B, best, _ = sol.min_bottleneck()
    out = sol.min_moves(B, ranges)
    return (best if out is None else out), B


def max_load_ok(sol: Solver, bnd: Sequence[int], B: float) -> bool:
    """Does layout `bnd` fit every stage at bottleneck B (same tests as the search)?"""
    Pl, Ml = sol.Pl, sol.Ml
    for j in range(sol.p):
        a, b = bnd[j], bnd[j + 1]
        if not (Pl[b] <= Pl[a] + sol.ccap(B, j)) or not (Ml[b] <= Ml[a] + sol.mcap[j]):
            return False
    return True
