"""Identical stages: the fast path of `Solver` (greedy from the back, exact).

With one speed, one memory cap (or none) and one transfer cost on every sending stage, the
caps never grow in the order stage p-1, p-2, ..., 0, and then "each stage, from the back,
takes the longest suffix that fits, leaving >= 1 layer for every earlier stage" is exact
(exchange argument in `_homogeneous_probe`). A probe is one np.searchsorted over all positions
plus an O(p) walk; the search starts from lo = max(average load, largest layer) and gallops up
to the first feasible B. The candidate boundaries of the fewest-moves step are then single
intervals given by the forward and backward greedy (`_homogeneous_fsets`) unless some layer
alone is too big for a stage. `Solver(general=True)` turns the fast path off (the tests
compare both).

`IdenticalStages` is a base class of `Solver`: its methods use the solver's prefix sums, caps,
fit tests (`ccap`, `_near`, defined in optimal.py and reach.py) and search (search.py).
"""

from __future__ import annotations

import math

import numpy as np

from .moves import Intervals
from .search import bisect_bottleneck


class IdenticalStages:
    """The identical-stage methods of `Solver` (see the module docstring)."""

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
                    raise self._memory_error()
                break
            delta *= 2

        def probe(B: float) -> tuple[bool, list[int] | None, float, bool]:
            ok, bnd, ev = self._homogeneous_probe(B)
            return ok, bnd, ev, True

        return bisect_bottleneck(lo, best, probe, probes, self.bottleneck_of, self.btol)

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
