"""Sparsity masks with the features of real ones, at their size or another: a pruned weight's
nonzeros per row and per column (`dynmo.tensor.matrix.MATRIX_STATS`) carried to a matrix of
other dimensions.

What a mask of shape (rows, cols) keeps when its dimensions are multiplied (`mask_spec`): its
density (nonzeros / entries), on each side the share of nonempty rows or columns, the cv of
nonzeros per nonempty one, and its largest count relative to the other dimension (a row's
largest count grows with the number of columns). So a mask of a small model's Linear whose rows
hold 30 % of the weights on average with a cv of 0.2 gives a mask of a wide Linear whose rows do
the same.

How (`generate_mask`): each nonempty row gets a whole-number count shaped to its cv (the
generator's `counts_with_cv`, capped at the largest count), each nonempty column a target the
same way. Every row then keeps its count of columns, drawn without replacement with
probabilities in proportion to column weights (Gumbel top-k: a row keeps the columns whose
log-weight plus a Gumbel draw are its largest), and the weights are re-fitted a few rounds
(`ROUNDS`) so that each column's expected count meets its target. Exact: the nonzero count and
every row's count, so the rows' statistics; approximate (a draw's spread, and saturation in
rows that keep most columns): the columns'. `mask_error` measures both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynmo.tensor.generate import GenerateError, counts_with_cv
from dynmo.tensor.matrix import matrix_features

ROUNDS = 6  # re-fits of the column weights; the best round is kept


@dataclass(frozen=True)
class SideSpec:
    nonempty: int  # rows (or columns) with a nonzero
    cv: float  # of nonzeros per nonempty one
    max: int  # nonzeros in the fullest


@dataclass(frozen=True)
class MaskSpec:
    rows: int
    cols: int
    nnz: int
    row: SideSpec
    col: SideSpec


def mask_spec(features: dict[str, dict[str, float]], rows: int, cols: int, scale: float = 1.0) -> MaskSpec:
    """The mask to generate for a real mask of shape (rows, cols) whose `matrix_features` are
    `features`, with both dimensions multiplied by `scale`."""
    if not (rows >= 1 and cols >= 1 and scale > 0):
        raise GenerateError(f"a mask needs rows, cols >= 1 and scale > 0, got {rows}, {cols}, {scale}")
    try:
        r, c = features["rows"], features["cols"]
        side = [(float(f["nz_density"]), float(f["max"]), float(f["cv"]), float(f["imbal"])) for f in (r, c)]
    except (KeyError, TypeError, ValueError) as e:
        raise GenerateError(f"mask features need rows and cols, each with nz_density, max, cv, imbal ({e})") from None
    nz_r, max_r, cv_r, imbal_r = side[0]
    # imbal = max / mean - 1 over every row, empty ones included: the nonzero count follows
    nnz_small = max_r * rows / (1.0 + imbal_r)
    density = nnz_small / (rows * cols)
    if not 0 < density <= 1 + 1e-9:
        raise GenerateError(f"the features say {nnz_small:.0f} nonzeros, which does not fit in a "
                            f"{rows} x {cols} matrix: features of another shape?")
    R, C = max(1, round(rows * scale)), max(1, round(cols * scale))
    nnz = min(R * C, max(1, round(density * R * C)))

    def one(nz, mx, cv, size, other, other_small):
        nonempty = min(size, max(1, round(nz * size)))
        # cv over every row -> over the nonempty ones: f (1 + cv^2) = 1 + cv_nz^2
        cv_nz = math.sqrt(max(0.0, nz * (1.0 + cv * cv) - 1.0))
        hi = min(other, max(-(-nnz // nonempty), round(mx * other / other_small)))
        return SideSpec(nonempty, cv_nz, hi)

    row = one(nz_r, max_r, cv_r, R, C, cols)
    col = one(side[1][0], side[1][1], side[1][2], C, R, rows)
    if row.max > col.nonempty or col.max > row.nonempty or row.max * row.nonempty < nnz or col.max * col.nonempty < nnz:
        raise GenerateError(f"a row of {row.max} or a column of {col.max} nonzeros does not fit in "
                            f"{col.nonempty} nonempty columns / {row.nonempty} nonempty rows")
    return MaskSpec(R, C, nnz, row, col)


def generate_mask(spec: MaskSpec, seed: int = 1) -> np.ndarray:
    """A boolean (rows, cols) mask of `spec` (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    row_counts = np.zeros(spec.rows, dtype=np.int64)
    row_counts[rng.choice(spec.rows, spec.row.nonempty, replace=False)] = counts_with_cv(
        spec.row.nonempty, spec.nnz, spec.row.max, spec.row.cv, rng)
    target = np.zeros(spec.cols, dtype=np.float64)
    target[rng.choice(spec.cols, spec.col.nonempty, replace=False)] = counts_with_cv(
        spec.col.nonempty, spec.nnz, spec.col.max, spec.col.cv, rng)
    live = target > 0
    logw = np.where(live, np.log(np.maximum(target, 1.0)), -np.inf).astype(np.float32)
    # one Gumbel draw per entry, kept over the rounds: a re-fit moves the weights, not the luck; the round whose column counts are
    # nearest their targets (least squares) is kept
    noise = rng.gumbel(size=(spec.rows, spec.cols)).astype(np.float32)
    best, best_err = None, math.inf
    for _ in range(ROUNDS):
        mask = _top_k(logw[None, :] + noise, row_counts)
        got = mask.sum(0)
        err = float(np.sum((got[live] - target[live]) ** 2))
        if err < best_err:
            best, best_err = mask, err
        # a column short of its target gains weight, one over it loses some
        logw[live] += np.log(np.maximum(target[live], 0.5) / np.maximum(got[live], 0.5)).astype(np.float32)
    return best


def _top_k(keys: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per row i, True at exactly k[i] of its largest keys (ties broken by position)."""
    rows, cols = keys.shape
    order = np.argsort(keys, axis=1, kind="stable")  # ascending: a row keeps its last k[i]
    mask = np.zeros((rows, cols), dtype=bool)
    keep = np.arange(cols)[None, :] >= (cols - k)[:, None]
    np.put_along_axis(mask, order, keep, axis=1)
    return mask


def mask_error(mask: np.ndarray, spec: MaskSpec) -> dict[str, float]:
    """Relative error of a mask's density and of each side's nonempty share, cv (over the
    nonempty ones) and largest count, against the spec."""
    f = matrix_features(mask.sum(1), mask.sum(0))
    out = {"nnz": abs(int(mask.sum()) - spec.nnz) / spec.nnz}
    for side, s, size in (("rows", spec.row, spec.rows), ("cols", spec.col, spec.cols)):
        g = f[side]
        nz = g["nz_density"]
        cv_nz = math.sqrt(max(0.0, nz * (1.0 + g["cv"] ** 2) - 1.0))
        out[f"{side}_nonempty"] = abs(nz * size - s.nonempty) / s.nonempty
        out[f"{side}_cv"] = abs(cv_nz - s.cv) / s.cv if s.cv > 0 else cv_nz
        out[f"{side}_max"] = abs(g["max"] - s.max) / s.max
    return out
