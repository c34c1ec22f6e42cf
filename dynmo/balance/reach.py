"""Reachable boundary sets of `Solver`: the image of a run of positions under one stage (the
forward pass), and backward reachability (the fewest-moves step's Q_j), in interval form.

`Reachability` is a base class of `Solver`, like `IdenticalStages`: its methods use the
solver's prefix sums, caps and fit tests (`_clear`, `_blocked`, `_runs`, `_fast`, `ccap`),
defined in optimal.py; the module docstring there gives the definitions.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from .moves import Intervals


class Reachability:
    """The reachability methods of `Solver` (see the module docstring)."""

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

    # backward reachability: the mirror of forward, in the same coordinates
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
