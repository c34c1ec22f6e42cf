"""CSF MTTKRP: compressed sparse fibers, one tree per mode (SPLATT's `--csf=all`).

Mode n's tree has n at its root and the other modes below it, shortest first (as SPLATT orders
them). Level L holds one node per distinct prefix of the sorted coordinates: its index
(`fids`) and, above the leaves, where its children start (`fptr`); the leaves hold the values.
Levels are stored one after another in one array each, with offsets, so one compiled kernel
serves any order.

Mode n's MTTKRP walks each root slice depth first: a leaf adds value x A_leaf[row] into its
parent's accumulator; a finished inner node multiplies its accumulator by its own factor row
and adds it into its parent's; the root's sum is the output row. Tasks own runs of root slices,
so every output row is written once, by one task, in one order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from dynmo.tensor.kernels.common import tasks


class Tree:
    """One CSF tree: the levels' modes, node indices, child pointers and the leaves' values."""

    def __init__(self, coords: np.ndarray, values: np.ndarray, sizes: tuple[int, ...], root: int, dtype):
        order = len(sizes)
        rest = sorted((m for m in range(order) if m != root), key=lambda m: (sizes[m], m))
        self.modes = np.array([root, *rest], dtype=np.int64)
        sort = np.lexsort(tuple(coords[m] for m in reversed(self.modes)))
        s = coords[self.modes][:, sort]
        nnz = s.shape[1]
        idx = np.int32 if max(sizes) < 2**31 else np.int64
        new = np.zeros(nnz, dtype=bool)
        new[0] = True
        starts = []
        for level in range(order):
            if level == order - 1:
                new[:] = True
            else:
                new[1:] |= s[level, 1:] != s[level, :-1]
            starts.append(np.flatnonzero(new))
        self.fids_off = np.zeros(order + 1, dtype=np.int64)
        self.fids_off[1:] = np.cumsum([st.size for st in starts])
        self.fids = np.concatenate([s[level, st] for level, st in enumerate(starts)]).astype(idx)
        ptrs = [np.append(np.searchsorted(starts[level + 1], starts[level]), starts[level + 1].size)
                for level in range(order - 1)]
        self.fptr_off = np.zeros(order, dtype=np.int64)
        self.fptr_off[1:] = np.cumsum([p.size for p in ptrs])
        self.fptr = np.concatenate(ptrs).astype(np.int64)
        self.values = np.ascontiguousarray(values[sort], dtype=dtype)
        roots = starts[0].size
        leaf_ptr = np.append(starts[0], nnz).astype(np.int64)  # nonzeros under each root, as prefix sums
        self.bounds = tasks(leaf_ptr)
        self.roots = roots

    @property
    def nbytes(self) -> int:
        return int(self.fids.nbytes + self.fptr.nbytes + self.values.nbytes + self.bounds.nbytes)


class CSF:
    name = "csf"

    def __init__(self, coords: np.ndarray, values: np.ndarray, sizes: tuple[int, ...], dtype):
        self.sizes, self.order = tuple(sizes), len(sizes)
        self.trees = [Tree(coords, values, self.sizes, m, dtype) for m in range(self.order)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.trees)

    def mttkrp(self, f: np.ndarray, offsets: np.ndarray, mode: int, out: np.ndarray) -> None:
        t = self.trees[mode]
        out[:] = 0
        _csf_root(t.modes, t.fids, t.fids_off, t.fptr, t.fptr_off, t.values, t.bounds, f, offsets, out)


@njit(parallel=True, cache=True)
def _csf_root(modes, fids, fids_off, fptr, fptr_off, vals, bounds, f, offs, out):
    order = modes.size
    rank = f.shape[1]
    leaf = order - 1
    leaf_off = fids_off[leaf]
    leaf_row = offs[modes[leaf]]
    for t in prange(bounds.size - 1):
        acc = np.zeros((order, rank), dtype=out.dtype)
        idx = np.zeros(order, dtype=np.int64)
        end = np.zeros(order, dtype=np.int64)
        for root in range(bounds[t], bounds[t + 1]):
            acc[0, :] = 0
            idx[1] = fptr[fptr_off[0] + root]
            end[1] = fptr[fptr_off[0] + root + 1]
            level = 1
            while True:
                if idx[level] == end[level]:
                    if level == 1:
                        break
                    level -= 1  # the node idx[level] is finished: scale by its row, add to its parent
                    node = idx[level]
                    row = offs[modes[level]] + fids[fids_off[level] + node]
                    for r in range(rank):
                        acc[level - 1, r] += acc[level, r] * f[row, r]
                    idx[level] += 1
                elif level == leaf:
                    for j in range(idx[level], end[level]):
                        v = vals[j]
                        row = leaf_row + fids[leaf_off + j]
                        for r in range(rank):
                            acc[level - 1, r] += v * f[row, r]
                    idx[level] = end[level]
                else:
                    node = idx[level]
                    acc[level, :] = 0
                    idx[level + 1] = fptr[fptr_off[level] + node]
                    end[level + 1] = fptr[fptr_off[level] + node + 1]
                    level += 1
            out_row = fids[fids_off[0] + root]
            for r in range(rank):
                out[out_row, r] = acc[0, r]
