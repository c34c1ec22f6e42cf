"""What every MTTKRP layout shares: the owners' split of the work, the stacked factors, threads.

Owner-computes: each output row of the mode is written by exactly one task, which adds its
nonzeros' contributions in a fixed order, so the result is the same bit for bit whatever the
number of threads (no atomics, no privatised copies summed in a thread-dependent order).
`tasks` cuts the rows into runs of about equal nonzeros; the cut depends on the tensor only.
"""

from __future__ import annotations

import numpy as np
from numba import njit

DTYPES = {"float64": np.float64, "float32": np.float32}
TASKS = 512  # at most this many runs of rows per mode; many more than threads, for balance


def tasks(row_ptr: np.ndarray, most: int = TASKS) -> np.ndarray:
    """Boundaries (in rows) of up to `most` runs of consecutive rows holding about equal nonzeros.

    `row_ptr` is the rows' prefix sums of nonzeros (length rows + 1). A run holds whole rows."""
    rows = row_ptr.size - 1
    total = int(row_ptr[-1])
    if rows <= 0:
        return np.zeros(1, dtype=np.int64)
    n = max(1, min(most, rows))
    targets = (np.arange(1, n, dtype=np.float64) * total / n)
    cuts = np.searchsorted(row_ptr, targets, side="left")
    bounds = np.unique(np.concatenate(([0], cuts, [rows]))).astype(np.int64)
    return bounds


def stacked(factors: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """(every factor stacked into one C-ordered matrix, row offset of each mode's factor)."""
    offsets = np.zeros(len(factors) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.shape[0] for a in factors])
    f = np.ascontiguousarray(np.concatenate(factors, axis=0), dtype=dtype)
    return f, offsets


def set_threads(n: int | None) -> int:
    """Use `n` threads for the kernels (None: all numba offers); returns the number in use."""
    import numba

    top = numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(top if n is None else max(1, min(int(n), top)))
    return numba.get_num_threads()


@njit(cache=True)
def times_row(buf, f, row):
    """buf *= factor row `row`: one mode's part of a nonzero's Khatri-Rao product (COO, HiCOO)."""
    for r in range(buf.size):
        buf[r] *= f[row, r]
