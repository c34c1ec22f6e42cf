"""CP-ALS on a sparse tensor: the rank-R canonical polyadic decomposition by alternating least
squares, with MTTKRP over the nonzeros only (never a dense tensor).

For each mode n in turn: M = X_(n) (the Khatri-Rao product of the other factors), computed as,
for every nonzero, its value times the elementwise product of the other factors' rows, summed
into row i_n (one `np.bincount` per column); then A_n = M V^+ with V the Hadamard product of the
other factors' Gram matrices; columns normalised into the weights. The fit is
1 - ||X - X_hat|| / ||X||, from the last MTTKRP and the Gram matrices (no dense tensor either).
MTTKRP is what decomposition papers time; each iteration's seconds are reported.

With `layout` (a layout of `dynmo.tensor.kernels.convert`) the MTTKRP is the compiled kernel of
that format, timed per mode (`CPResult.mttkrp_seconds`); `init` starts from given factors (CP of a
relabeled tensor started from the relabeled factors gives the relabeled result).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dynmo.tensor.coo import SparseTensor


@dataclass
class CPResult:
    weights: np.ndarray  # (R,)
    factors: list[np.ndarray]  # one (size_n, R) per mode
    fits: list[float] = field(default_factory=list)  # after each iteration
    seconds: list[float] = field(default_factory=list)  # each iteration's wall time
    mttkrp_seconds: list[list[float]] = field(default_factory=list)  # per iteration, each mode's MTTKRP

    @property
    def fit(self) -> float:
        return self.fits[-1] if self.fits else 0.0


def mttkrp(t: SparseTensor, factors: list[np.ndarray], n: int, values: np.ndarray) -> np.ndarray:
    """X_(n) times the Khatri-Rao product of every factor but the n-th, over the nonzeros."""
    rank = factors[0].shape[1]
    prod = np.repeat(values[:, None], rank, axis=1)
    for k, a in enumerate(factors):
        if k != n:
            prod *= a[t.coords[k]]
    out = np.empty((t.sizes[n], rank))
    for r in range(rank):
        out[:, r] = np.bincount(t.coords[n], weights=prod[:, r], minlength=t.sizes[n])
    return out


def cp_als(t: SparseTensor, rank: int, iters: int = 20, seed: int = 0, tol: float = 0.0,
           progress=None, init: list[np.ndarray] | None = None, layout=None) -> CPResult:
    """Rank-`rank` CP of `t` by `iters` ALS sweeps (fewer if the fit improves by less than `tol`)."""
    if rank < 1:
        raise ValueError("rank must be >= 1")
    values = t.values if t.values is not None else np.ones(t.nnz)
    rng = np.random.default_rng(seed)
    if init is not None:
        factors = [np.array(a, dtype=np.float64) for a in init]
    else:
        factors = [rng.random((s, rank)) for s in t.sizes]
    grams = [a.T @ a for a in factors]
    weights = np.ones(rank)
    norm_x = float(np.sqrt(np.dot(values, values)))
    res = CPResult(weights, factors)
    for it in range(iters):
        t0 = time.perf_counter()
        per_mode = []
        for n in range(t.order):
            t1 = time.perf_counter()
            if layout is None:
                m = mttkrp(t, factors, n, values)
            else:
                from dynmo.tensor.kernels import mttkrp as kernel

                m = kernel(layout, factors, n).astype(np.float64, copy=False)
            per_mode.append(time.perf_counter() - t1)
            v = np.ones((rank, rank))
            for k, g in enumerate(grams):
                if k != n:
                    v *= g
            a = m @ np.linalg.pinv(v)
            weights = np.linalg.norm(a, axis=0)
            weights[weights == 0] = 1.0
            factors[n] = a / weights
            grams[n] = factors[n].T @ factors[n]
        # ||X_hat||^2 = w^T (hadamard of grams) w ; <X, X_hat> = sum_r w_r <M_n[:, r], A_n[:, r]>
        v = np.ones((rank, rank))
        for g in grams:
            v *= g
        norm_hat2 = float(weights @ v @ weights)
        inner = float(np.sum(weights * np.sum(m * factors[-1], axis=0)))
        resid = np.sqrt(max(0.0, norm_x ** 2 + norm_hat2 - 2 * inner))
        res.fits.append(1.0 - resid / norm_x if norm_x > 0 else 0.0)
        res.seconds.append(time.perf_counter() - t0)
        res.mttkrp_seconds.append(per_mode)
        if progress:
            progress(it, res.fits[-1], res.seconds[-1])
        if tol and it > 0 and abs(res.fits[-1] - res.fits[-2]) < tol:
            break
    res.weights, res.factors = weights, factors
    return res
