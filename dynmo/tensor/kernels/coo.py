"""COO MTTKRP: the nonzeros once, in their given order, plus per mode a permutation that sorts
them by that mode's index (stable) and the rows' offsets into it.

Mode n's MTTKRP: each task owns a run of rows; for every row it sums, over the row's nonzeros in
file order, the value times the elementwise product of the other modes' factor rows, and writes
the row once. Memory: the coordinates, the values, one 8-byte permutation entry per mode.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from dynmo.tensor.kernels.common import tasks, times_row


class COO:
    name = "coo"

    def __init__(self, coords: np.ndarray, values: np.ndarray, sizes: tuple[int, ...], dtype):
        self.sizes, self.order = tuple(sizes), len(sizes)
        idx = np.int32 if max(sizes) < 2**31 else np.int64
        self.coords = np.ascontiguousarray(coords, dtype=idx)
        self.values = np.ascontiguousarray(values, dtype=dtype)
        self.perm, self.ptr, self.bounds = [], [], []
        for m in range(self.order):
            perm = np.argsort(self.coords[m], kind="stable").astype(np.int64)
            ptr = np.zeros(sizes[m] + 1, dtype=np.int64)
            ptr[1:] = np.cumsum(np.bincount(self.coords[m], minlength=sizes[m]))
            self.perm.append(perm)
            self.ptr.append(ptr)
            self.bounds.append(tasks(ptr))

    @property
    def nbytes(self) -> int:
        return int(self.coords.nbytes + self.values.nbytes + sum(p.nbytes for p in self.perm)
                   + sum(p.nbytes for p in self.ptr) + sum(b.nbytes for b in self.bounds))

    def mttkrp(self, f: np.ndarray, offsets: np.ndarray, mode: int, out: np.ndarray) -> None:
        _coo_mode(self.coords, self.values, self.perm[mode], self.ptr[mode], self.bounds[mode], f, offsets,
                  mode, out)


@njit(parallel=True, cache=True)
def _coo_mode(coords, vals, perm, row_ptr, bounds, f, offs, mode, out):
    order = coords.shape[0]
    rank = f.shape[1]
    for t in prange(bounds.size - 1):
        acc = np.empty(rank, dtype=out.dtype)
        tmp = np.empty(rank, dtype=out.dtype)
        for i in range(bounds[t], bounds[t + 1]):
            acc[:] = 0
            for p in range(row_ptr[i], row_ptr[i + 1]):
                j = perm[p]
                tmp[:] = vals[j]
                for k in range(order):
                    if k != mode:
                        times_row(tmp, f, offs[k] + coords[k, j])
                for r in range(rank):
                    acc[r] += tmp[r]
            for r in range(rank):
                out[i, r] = acc[r]
