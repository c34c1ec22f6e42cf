"""The features of a sparse matrix (a pruned weight's mask), and a model of its kernels' times.

A matrix is an order-2 tensor: its nonzeros per row are the nonzeros per fiber of free mode 1,
per column those of free mode 0 (`dynmo.tensor.features`); the statistics are the same
functions (`distribution_stats`). `MATRIX_STATS` are the four a pruning run records per
pruned Linear and per side.

`KernelModel` predicts the seconds of one forward + backward of a Linear under its sparsity
mask, for the masked dense kernel and the CSR kernel (`dynmo.model.sparse`), from the mask's
features and the tokens it runs on. It is fitted by least squares on relative error to the
times `prune.kernel = auto` measures at every pruning step; terms (all times tokens T unless
said, each coefficient >= 0):

    dense: c0 + c1 * rows * cols * T                     (three GEMMs of the full matrix)
    csr:   c0 + c1 * nnz * T + c2 * rows * cols + c3 * rows * row_max * T

(`rows * cols`: the dense gradient the sparse one is scattered into; the last term: the
busiest row, what a row-parallel sparse product waits for.) The fit is exact non-negative least
squares: every subset of the terms solved, the best one with no negative coefficient kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dynmo.tensor.features import distribution_stats

MATRIX_STATS = ("nz_density", "max", "cv", "imbal")
KERNEL_TERMS = {"dense": ("1", "rows*cols*T"), "csr": ("1", "nnz*T", "rows*cols", "rows*row_max*T")}


def matrix_features(row_counts: np.ndarray, col_counts: np.ndarray) -> dict[str, dict[str, float]]:
    """{"rows": stats, "cols": stats} of a matrix from its nonzeros per row and per column
    (every row and column, empty ones included), each with `MATRIX_STATS`."""
    out = {}
    for side, c in (("rows", np.asarray(row_counts)), ("cols", np.asarray(col_counts))):
        nonzero = c[c > 0]
        if nonzero.size == 0:
            out[side] = {"nz_density": 0.0, "max": 0.0, "cv": 0.0, "imbal": 0.0}
            continue
        s = distribution_stats(nonzero, int(c.size))
        out[side] = {k: float(s[k]) for k in MATRIX_STATS}
    return out


@dataclass(frozen=True)
class KernelSample:
    rows: int  # output features
    cols: int  # input features
    nnz: int
    row_max: int  # nonzeros in the fullest row
    tokens: int
    seconds: dict[str, float] = field(default_factory=dict)  # kernel -> measured fwd+bwd seconds

    def terms(self, kernel: str) -> np.ndarray:
        t, r, c = float(self.tokens), float(self.rows), float(self.cols)
        if kernel == "dense":
            return np.array([1.0, r * c * t])
        return np.array([1.0, self.nnz * t, r * c, r * self.row_max * t])


class KernelModel:
    """Kernel times from mask features: fitted on measured samples, per kernel."""

    def __init__(self):
        self.samples: list[KernelSample] = []
        self.coef: dict[str, np.ndarray] = {}

    def add(self, samples: list[KernelSample]) -> None:
        self.samples.extend(s for s in samples if s.seconds)
        self.fit()

    def fit(self) -> None:
        for kernel in KERNEL_TERMS:
            rows = [(s.terms(kernel), s.seconds[kernel]) for s in self.samples if s.seconds.get(kernel, 0) > 0]
            if len(rows) < 2 * len(KERNEL_TERMS[kernel]):
                continue  # too few to fit: no prediction yet
            x = np.array([r[0] for r in rows])
            y = np.array([r[1] for r in rows])
            self.coef[kernel] = _nnls_relative(x, y)

    def ready(self, kernel: str) -> bool:
        return kernel in self.coef

    def predict(self, sample: KernelSample, kernel: str) -> float | None:
        c = self.coef.get(kernel)
        return None if c is None else float(sample.terms(kernel) @ c)


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min sum(((x @ c) - y) / y)^2 over c >= 0, exactly: least squares on every subset of the
    columns (a handful of terms), the best subset whose solution has no negative entry."""
    a = x / y[:, None]
    b = np.ones_like(y)
    n = a.shape[1]
    best, best_err = np.zeros(n), float(b @ b)
    for subset in range(1, 1 << n):
        cols = [j for j in range(n) if subset >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (sol < 0).any():
            continue
        err = float(np.sum((a[:, cols] @ sol - b) ** 2))
        if err < best_err:
            best, best_err = np.zeros(n), err
            best[cols] = sol
    return best
