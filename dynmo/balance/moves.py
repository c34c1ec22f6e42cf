"""Fewest moves: among the layouts whose bottleneck is at most B, one keeping the most layers.

cur[j] = (u_j, v_j) are the layers the worker of stage j holds today (the current layout, or
arbitrary disjoint ranges when re-packing). A layout b_0 = 0 < b_1 < ... < b_p = n keeps
sum_j ov_j(b_j, b_{j+1}) layers, ov_j(a, b) = |[a, b) ∩ [u_j, v_j)|; moves = n - kept. One
algorithm serves every problem: identical or heterogeneous stages, memory caps, transfer.

Candidate boundaries. Boundary k of a layout with bottleneck <= B lies in F_k = R_k ∩ Q_k:
its prefix fits stages 0..k-1 (`Solver.forward`) and its suffix fits stages k..p-1
(`Solver.backward`; both in one O(p) pass for identical stages, `_homogeneous_fsets`).
Conversely every chain of fitting steps through the F_k is a layout. At the optimum the F_k
are usually a few positions wide, but not always: when one layer alone sets B*, every other
stage has slack and F_k can span most of the layers.

DP. K_0(0) = 0 and K_k(b) = max over a in F_{k-1} with [a, b) fitting stage k-1 of
K_{k-1}(a) + ov_{k-1}(a, b); the answer is K_p(n). The fit tests are monotone (a sub-range
of a fitting range fits), so the a for one b form a window [near(b), b-1]. Reading every
candidate costs O(|F_k| x window) per stage: cheap for narrow windows, up to O(n^2) per stage
for wide ones. Since ov(a, b) = max(0, min(b, v) - max(a, u)),

    K_{k-1}(a) + ov(a, b) = max(K_{k-1}(a), G(a) + min(b, v)),  G(a) = K_{k-1}(a) - max(a, u),

so the best value over a window is also the larger of two range maxima, over K_{k-1} and over
G, which a sparse table answers (level t holds the maxima of 2^t consecutive entries; a window
is covered by ceil(w / 2^t) overlapping level-t blocks, and overlap is harmless for max). Level
0 is the plain candidate read, taken directly as K_{k-1}(a) + ov(a, b) without G. Each stage
picks its level with a cost model (reads against table passes): narrow windows stay at level 0,
wide ones cost O(|F_k| + |F_{k-1}| log window). Everything that does not depend on K (windows,
read indices) is built by vectorized code for a block of stages, so a level-0 stage costs four
numpy calls; blocks bound the memory when the F_k are wide.

The values are integers held in float64 (exact), so the backtrack re-derives each choice by
equality: from b = n, stage by stage, the largest a in the window that reaches K_k(b) (the
latest boundaries win ties). Scanning down from b - 1 stops there, so all scans together look
at no more than n positions.
"""

from __future__ import annotations

import bisect
import math
from typing import Protocol, Sequence

import numpy as np

from .problem import Problem

Intervals = list[tuple[int, int]]


class Solver(Protocol):
    """What the fewest-moves step reads of `dynmo.balance.optimal.Solver` (no import: the solver
    imports this module)."""

    p: int  # stages
    n: int  # layers
    homog: bool  # identical stages: the one-pass candidate sets apply
    btol: float
    problem: Problem
    mcap: list[float]  # memory cap per stage
    P: np.ndarray  # prefix sums of cost
    M: np.ndarray  # prefix sums of memory

    def forward(self, B: float, cut: bool = True) -> tuple[bool, list[Intervals], float]: ...

    def backward(self, B: float) -> list[Intervals]: ...

    def _homogeneous_fsets(self, B: float) -> list[Intervals] | None: ...

# Stages are processed in blocks of about this many positions (rows of F_k plus the table of
# F_{k-1}): one block for every benchmark size, and bounded memory for very wide F_k.
BLOCK = 1 << 18
# Level choice, in estimated ns (measured on the benchmark problems): per read (building its
# index, gather, add, max), for having a table at all (about ten numpy calls per stage), per
# level (one call) and per table entry a level pass touches.
READ_NS, TABLE_NS, LEVEL_NS, PASS_NS = 20.0, 15000.0, 1500.0, 1.0


def fewest_moves(sol: Solver, B: float, cur: Sequence[tuple[int, int]]) -> list[int] | None:
    """Boundaries of a layout with bottleneck <= B keeping the most layers on their stage.

    Ties go to the latest boundaries (from the last stage backwards). None when B is not
    feasible.
    """
    p = sol.p
    Fs = sol._homogeneous_fsets(B) if sol.homog else None
    if Fs is None:
        ok, R, _ = sol.forward(B)
        if not ok:
            return None
        Q = sol.backward(B)
        if len(Q) != p + 1:
            return None
        Fs = [_intersect(R[k], Q[k]) for k in range(p + 1)]
    if not all(Fs) or Fs[p][0][0] != sol.n:
        return None
    return _dp(sol, B, Fs, cur)


def _dp(sol: Solver, B: float, Fs: list[Intervals], cur: Sequence[tuple[int, int]]) -> list[int] | None:
    """K_1..K_p block by block, then the backtrack; None when n is not reachable."""
    p = sol.p
    iv = np.array([(k, l, h) for k in range(p + 1) for l, h in Fs[k]], dtype=np.int64)
    first = np.searchsorted(iv[:, 0], np.arange(p + 2))
    C0, C1 = iv[first[:-1], 1], iv[first[1:] - 1, 2]
    N = C1 - C0 + 1
    # K_k lives densely over the cover [C0_k, C1_k] of F_k (gaps between intervals stay -inf)
    # at the front of X, so one take() serves level-0 reads; behind it a scratch area for one
    # stage's sparse table (at most bit_length(nmax) levels of <= 2 nmax entries), then a -inf
    # sentinel that empty windows read
    doff = np.concatenate(([0], np.cumsum(N)))
    nmax = int(N.max())
    X = np.full(int(doff[-1]) + (nmax.bit_length() + 1) * (2 * nmax + 1) + 1, -np.inf)
    X[0] = 0.0
    U, V = np.array(cur, dtype=np.int64).reshape(p, 2).T
    # the solver's caps at B, elementwise the same floats as Solver.ccap
    cc = (B + sol.btol - sol.problem.t) * sol.problem.s
    mc = None if all(x == math.inf for x in sol.mcap) else np.array(sol.mcap)  # None: no caps
    # blocks of consecutive stages k with sum(|F_k| + |cover F_{k-1}|) <= BLOCK (at least one)
    size = np.bincount(iv[:, 0], weights=iv[:, 2] - iv[:, 1] + 1, minlength=p + 1)
    cum = np.concatenate(([0.0], np.cumsum(size[1:] + N[:-1]))).tolist()
    k0 = 1
    while k0 <= p:
        k1 = max(k0 + 1, bisect.bisect_right(cum, cum[k0 - 1] + BLOCK))
        _block(sol, iv[first[k0] : first[k1]], k0, k1, C0, C1, N, doff, X, U, V, cc, mc)
        k0 = k1
    if X[doff[p]] == -np.inf:
        return None
    return _backtrack(C0, C1, doff, X, U, V)


def _block(sol: Solver, iv: np.ndarray, k0: int, k1: int, C0: np.ndarray, C1: np.ndarray, N: np.ndarray,
           doff: np.ndarray, X: np.ndarray, U: np.ndarray, V: np.ndarray, cc: np.ndarray,
           mc: np.ndarray | None) -> None:
    """K_k for k in [k0, k1) from K_{k0-1}; iv: the intervals (k, l, h) of those F_k."""
    P, M = sol.P, sol.M
    # rows: every b in F_k, in order of k
    lens = iv[:, 2] - iv[:, 1] + 1
    nrows = int(lens.sum())
    rb = np.repeat(iv[:, 1] - (np.cumsum(lens) - lens), lens) + np.arange(nrows)
    rk = np.repeat(iv[:, 0], lens)
    rstart = np.searchsorted(rk, np.arange(k0, k1 + 1))
    A0, A1 = C0[rk - 1], C1[rk - 1]
    lo = np.maximum(_near(P, rb, cc[rk - 1]), A0)
    if mc is not None:
        lo = np.maximum(lo, _near(M, rb, mc[rk - 1]))
    hi = np.minimum(rb - 1, A1)
    # level per stage (module docstring): minimize the estimated time of its reads plus, with
    # any level, its table. A table saves at most rows x W reads; when that never pays for
    # one, every stage stays at level 0 without evaluating the model.
    rows = np.diff(rstart)
    W = np.maximum(np.maximum.reduceat(hi - lo + 1, rstart[:-1]), 1)
    Nin = N[k0 - 1 : k1 - 1]
    if READ_NS * int((rows * W).max()) <= TABLE_NS:
        lev, cnt = np.zeros(len(W), dtype=np.int64), W
    else:
        tl = np.arange(int(W.max()).bit_length())
        # at level t >= 1 a window takes ceil(W / 2^t) blocks (2 when narrower than 2^t: it
        # uses the largest level that fits), each read in K and in G
        reads = -(-W[:, None] // (1 << tl)[None, :])
        reads[:, 1:] = 2 * np.maximum(reads[:, 1:], 2)
        cost = READ_NS * rows[:, None] * reads + (tl > 0) * TABLE_NS + tl * (LEVEL_NS + 2 * Nin[:, None] * PASS_NS)
        cost[(1 << tl)[None, :] > W[:, None]] = np.inf
        lev = np.argmin(cost, axis=1)
        cnt = reads[np.arange(len(W)), lev]
    # the reads of each stage (rows x cnt), stage after stage in idx0 (level 0) or idx1 (the
    # others). The table of a levelled stage sits in X's scratch area: level t starts at
    # t (2N + 1) - (2^t - 1), N = |cover F_{k-1}|; level 0 is K_{k-1} then G, level t has
    # 2N - 2^t + 1 entries.
    q = rk - k0
    e = np.minimum(rb, V[rk - 1])
    sent = len(X) - 1
    scratch = int(doff[-1])
    flat = lev == 0
    nread = rows * cnt
    eoff = np.zeros(len(W), dtype=np.int64)
    idx0 = bias0 = idx1 = None
    if flat.any():
        eoff[flat] = np.cumsum(nread[flat]) - nread[flat]
        r = flat[q] if not flat.all() else slice(None)
        idx0, bias0 = _exact_reads(lo[r], hi[r], cnt[q][r], (doff[rk - 1] - A0)[r], e[r], U[rk - 1][r], sent)
    if not flat.all():
        eoff[~flat] = np.cumsum(nread[~flat]) - nread[~flat]
        r = ~flat[q]
        # a window narrower than its stage's level uses the largest level within it
        tr = np.minimum(lev[q][r], np.frexp(np.maximum(hi[r] - lo[r] + 1, 1))[1] - 1)
        nin = Nin[q][r]
        base = scratch + tr * (2 * nin + 1) - ((1 << tr) - 1) - A0[r]
        idx1 = _block_reads(lo[r], hi[r], cnt[q][r] // 2, tr, base, nin, sent)
    ef = None if idx1 is None else e.astype(np.float64)[:, None]
    dst = doff[rk] + rb - C0[rk]
    levl, cntl, Nl, rs, eo = lev.tolist(), cnt.tolist(), Nin.tolist(), rstart.tolist(), eoff.tolist()
    dl, ul = doff.tolist(), U.tolist()
    for k in range(k0, k1):
        i = k - k0
        r0, r1 = rs[i], rs[i + 1]
        e0, t = eo[i], levl[i]
        e1 = e0 + (r1 - r0) * cntl[i]
        if t == 0:
            vals = X.take(idx0[e0:e1]).reshape(r1 - r0, cntl[i])
            vals += bias0[e0:e1].reshape(r1 - r0, cntl[i])
        else:
            n_in, d = Nl[i], dl[k - 1]
            prev = X[d : d + n_in]
            T = X[scratch:]
            T[:n_in] = prev
            np.subtract(prev, np.maximum(np.arange(C0[k - 1], C1[k - 1] + 1), ul[k - 1]), out=T[n_in : 2 * n_in])
            o, ln = 0, 2 * n_in
            for j in range(1, t + 1):
                h, lt = 1 << (j - 1), 2 * n_in - (1 << j) + 1
                np.maximum(T[o : o + lt], T[o + h : o + h + lt], out=T[o + ln : o + ln + lt])
                o, ln = o + ln, lt
            vals = X.take(idx1[e0:e1]).reshape(r1 - r0, 2, cntl[i] // 2)
            vals[:, 1] += ef[r0:r1]
            vals = vals.reshape(r1 - r0, cntl[i])
        X[dst[r0:r1]] = vals.max(axis=1)


def _exact_reads(lo: np.ndarray, hi: np.ndarray, ne: np.ndarray, base: np.ndarray, e: np.ndarray,
                 u: np.ndarray, sent: int) -> tuple[np.ndarray, np.ndarray]:
    """Level 0: row r reads candidates a = min(lo + c, hi), c < ne, at X[base + a] with bias
    ov(a, b) = max(0, e - max(a, u)), e = min(b, v); empty windows read the sentinel."""
    m = int(ne.sum())
    col = np.arange(m) - np.repeat(np.cumsum(ne) - ne, ne)
    a = np.minimum(np.repeat(lo, ne) + col, np.repeat(hi, ne))
    idx = np.repeat(base, ne) + a
    bias = np.repeat(e, ne) - np.maximum(a, np.repeat(u, ne))
    np.maximum(bias, 0, out=bias)
    empty = hi < lo
    if empty.any():
        idx[np.repeat(empty, ne)] = sent
    return idx, bias.astype(np.float64)


def _block_reads(lo: np.ndarray, hi: np.ndarray, h: np.ndarray, tr: np.ndarray, base: np.ndarray,
                 nin: np.ndarray, sent: int) -> np.ndarray:
    """Level >= 1: row r reads h level-tr blocks starting at min(lo + c 2^tr, hi - 2^tr + 1)
    (together they cover [lo, hi]), first in K (at base + start), then the same blocks in G
    (nin further on); empty windows read the sentinel."""
    m = int(h.sum())
    hs = np.cumsum(h) - h
    step = 1 << tr
    col = np.arange(m) - np.repeat(hs, h)
    start = np.minimum(np.repeat(lo, h) + col * np.repeat(step, h), np.repeat(hi - step + 1, h))
    kidx = np.repeat(base, h) + start
    pos = np.repeat(hs, h) + np.arange(m)  # row r's reads start at 2 hs[r]
    idx = np.empty(2 * m, dtype=np.int64)
    idx[pos] = kidx
    idx[pos + np.repeat(h, h)] = kidx + np.repeat(nin, h)
    empty = hi < lo
    if empty.any():
        idx[np.repeat(empty, 2 * h)] = sent
    return idx


def _near(P: np.ndarray, b: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """For each row, the smallest a with P[b] <= P[a] + cap (finite): the solver's exact test.

    The a that pass form a suffix and the test depends on P[a] only, so start from the
    search for P[b] - cap (off by rounding at most) and step over whole runs of equal P
    values until the boundary is exact.
    """
    x = P[b]
    Pp = np.concatenate(([-np.inf], P, [np.inf]))  # Pp[a + 1] = P[a]; the ends stop both walks
    a = np.searchsorted(P, x - cap, side="left")
    while True:  # down while the run just below a passes too
        dn = x <= Pp[a] + cap
        if not dn.any():
            break
        a[dn] = np.searchsorted(P, Pp[a[dn]], side="left")
    while True:  # up while a fails
        up = ~(x <= Pp[a + 1] + cap)
        if not up.any():
            break
        a[up] = np.searchsorted(P, Pp[a[up] + 1], side="right")
    return a


def _backtrack(C0: np.ndarray, C1: np.ndarray, doff: np.ndarray, X: np.ndarray, U: np.ndarray,
               V: np.ndarray) -> list[int]:
    """From b = n back to 0, each time the largest a whose value reaches K_k(b)."""
    p = len(C0) - 1
    c0, c1, off, ul, vl = C0.tolist(), C1.tolist(), doff.tolist(), U.tolist(), V.tolist()
    K = memoryview(X)  # fast scalar reads as Python floats, no copy
    b = c0[p]
    out = [b]
    for k in range(p, 0, -1):
        want = K[off[k] + b - c0[k]]
        u, e = ul[k - 1], min(b, vl[k - 1])
        base = off[k - 1] - c0[k - 1]
        a = min(b - 1, c1[k - 1])
        while K[base + a] + max(0, e - max(a, u)) != want:  # -inf never equals want
            a -= 1
        out.append(a)
        b = a
    out.reverse()
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
