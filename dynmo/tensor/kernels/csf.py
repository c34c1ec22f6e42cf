"""CSF MTTKRP: compressed sparse fibers, one tree per mode (SPLATT's `--csf=all`), or a tiled copy of
another mode's tree.

Mode n's tree has n at its root and the other modes below it, shortest first (as SPLATT orders
them). Level L holds one node per distinct prefix of the sorted coordinates: its index
(`fids`) and, above the leaves, where its children start (`fptr`); the leaves hold the values.
Levels are stored one after another in one array each, with offsets, so one compiled kernel
serves any order.

Mode n's MTTKRP walks each root slice depth first. The last two levels are fused, as SPLATT
does: a fiber sums value x A_leaf[row] over its leaves into one rank-long buffer, then adds that
times its own row into its parent's accumulator; a finished node above multiplies its
accumulator by its own row and adds it into its parent's; the root's sum is written to the
output row once. The buffers are allocated once per task, the rank is the innermost loop over
C-ordered factor rows. Tasks own runs of root slices, so every output row is written once, by
one task, in one order; only the rows of empty root slices are zeroed apart.

A mode whose own tree is poorly compressed (short fibers) but that sits at the leaves of another
mode's tree (long fibers along it) is served by a copy of that other tree cut into tiles: runs of
the mode's rows of about equal nonzeros, each tile a forest of its own nonzeros. A task walks one
tile, multiplying the rows down the path and adding value x that product into the leaf's output
row: only that tile's rows, so again one writer per row, in tree order, for any thread count
(SPLATT's leaf kernel on a tiled tree, without locks). The tiled copy replaces the mode's own
tree when it has at most `LEAF_TREE_SHARE` of its nodes.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from dynmo.tensor.kernels.common import prefetch_ahead, prefetch_row, tasks

TILES = 16  # the leaf-mode tree's tiles: runs of the mode's rows of about equal nonzeros, a task each
# The tiled copy serves a mode only with at most this share of the nodes of the mode's own tree:
# its walk writes a row per leaf where the root walk sums in registers, so at equal size the own
# tree is faster (a 4-mode tensor's last mode: 0.99 of the nodes, 1.5x the time); at 0.81 and 0.65
# the tiled copy took 0.58x and 0.35x the time (interleaved runs of the two kernels).
LEAF_TREE_SHARE = 0.9


class Tree:
    """One CSF tree: the levels' modes, node indices, child pointers and the leaves' values."""

    def __init__(self, coords: np.ndarray, values: np.ndarray, sizes: tuple[int, ...], root: int, dtype,
                 tiles: np.ndarray | None = None):
        order = len(sizes)
        rest = sorted((m for m in range(order) if m != root), key=lambda m: (sizes[m], m))
        self.modes = np.array([root, *rest], dtype=np.int64)
        keys = tuple(coords[m] for m in reversed(self.modes))
        sort = np.lexsort(keys if tiles is None else (*keys, tiles))  # tiles, when given, split the tree first
        s = coords[self.modes][:, sort]
        nnz = s.shape[1]
        idx = np.int32 if max(sizes) < 2**31 else np.int64
        new = np.zeros(nnz, dtype=bool)
        new[0] = True
        if tiles is not None:
            tile_sorted = tiles[sort]
            new[1:] = tile_sorted[1:] != tile_sorted[:-1]
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
        if tiles is not None:  # a task per tile: the runs of roots of each tile
            self.bounds = np.searchsorted(tile_sorted[starts[0]], np.arange(int(tiles.max()) + 2)).astype(np.int64)
        self.roots = roots
        # Fibers of 2 or more leaves on average: the root walk sums them 4 leaves a pass (`_csf_root`)
        self.long_fibers = bool(nnz >= 2 * starts[order - 2].size)
        present = np.zeros(sizes[root], dtype=bool)
        present[s[0, starts[0]]] = True
        self.empty = np.flatnonzero(~present)  # the root mode's empty slices: output rows of zeros

    @property
    def nbytes(self) -> int:
        return int(self.fids.nbytes + self.fptr.nbytes + self.values.nbytes + self.bounds.nbytes + self.empty.nbytes)


class CSF:
    name = "csf"

    def __init__(self, coords: np.ndarray, values: np.ndarray, sizes: tuple[int, ...], dtype):
        self.sizes, self.order = tuple(sizes), len(sizes)
        self.trees = [Tree(coords, values, self.sizes, m, dtype) for m in range(self.order)]
        self.leaf = [False] * self.order  # mode m's tree has m at its leaves, cut into tiles of m's rows
        for m in range(self.order):
            other = [r for r in range(self.order) if r != m and self.trees[r].modes[-1] == m]
            if not other:
                continue
            r = min(other, key=lambda r: self.trees[r].fids.size)
            if self.trees[r].fids.size > LEAF_TREE_SHARE * self.trees[m].fids.size:
                continue
            per_row = np.zeros(self.sizes[m] + 1, dtype=np.int64)
            per_row[1:] = np.cumsum(np.bincount(coords[m], minlength=self.sizes[m]))
            cuts = tasks(per_row, TILES)
            tiled = Tree(coords, values, self.sizes, r, dtype,
                         tiles=np.searchsorted(cuts, coords[m], side="right").astype(np.int64) - 1)
            if tiled.fids.size <= LEAF_TREE_SHARE * self.trees[m].fids.size:
                self.trees[m], self.leaf[m] = tiled, True

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.trees)

    def mttkrp(self, f: np.ndarray, offsets: np.ndarray, mode: int, out: np.ndarray) -> None:
        t = self.trees[mode]
        if self.leaf[mode]:
            out[:] = 0
            _csf_leaf(t.modes, t.fids, t.fids_off, t.fptr, t.fptr_off, t.values, t.bounds, f, offsets, out)
            return
        out[t.empty] = 0  # rows without a root slice; every other row is written whole
        ahead = prefetch_ahead(f.shape[0] - self.sizes[mode], f.shape[1], f.itemsize)
        _csf_root(t.modes, t.fids, t.fids_off, t.fptr, t.fptr_off, t.values, t.bounds, f, offsets, out, ahead,
                  t.long_fibers)


@njit(cache=True)
def _children(fptr, fptr_off, level, node):
    """(first, end) of the children of node `node` of level `level`."""
    at = fptr_off[level] + node
    return fptr[at], fptr[at + 1]


@njit(cache=True)
def _times_row(prod, level, f, row):
    """prod[level] = prod[level - 1] times factor row `row`: the product of the rows down an open path."""
    for r in range(f.shape[1]):
        prod[level, r] = prod[level - 1, r] * f[row, r]


@njit(parallel=True, cache=True)
def _csf_root(modes, fids, fids_off, fptr, fptr_off, vals, bounds, f, offs, out, ahead, long_fibers):
    order = modes.size
    rank = f.shape[1]
    leaf = order - 1
    fib = order - 2  # the fibers' level, just above the leaves: fused with them
    leaf_off, leaf_row = fids_off[leaf], offs[modes[leaf]]
    fib_off, fib_row, fib_ptr = fids_off[fib], offs[modes[fib]], fptr_off[fib]
    fibers = fids_off[fib + 1] - fib_off
    for t in prange(bounds.size - 1):
        acc = np.empty((max(1, fib), rank), dtype=out.dtype)  # acc[l]: the open node of level l's sum
        tmp = np.empty(rank, dtype=out.dtype)  # one fiber's sum over its leaves
        idx = np.empty(order, dtype=np.int64)
        end = np.empty(order, dtype=np.int64)
        for root in range(bounds[t], bounds[t + 1]):
            for r in range(rank):
                acc[0, r] = 0.0
            level = 0
            idx[0] = root
            while True:
                if level < fib - 1:  # open the next node one level down
                    level += 1
                    idx[level], end[level] = _children(fptr, fptr_off, level - 1, idx[level - 1])
                    for r in range(rank):
                        acc[level, r] = 0.0
                    continue
                # the fibers under the open node of level fib - 1 (under the root itself when fib is 0)
                qa, qb = (root, root + 1) if fib == 0 else _children(fptr, fptr_off, level, idx[level])
                for q in range(qa, qb):
                    if ahead > 0 and q + ahead < fibers:
                        # the rows `ahead` fibers on: its first leaf's, its own, and on each level
                        # above the node as far on (one per fiber where fibers are short)
                        prefetch_row(f, leaf_row + fids[leaf_off + fptr[fib_ptr + q + ahead]])
                        prefetch_row(f, fib_row + fids[fib_off + q + ahead])
                        for lv in range(1, fib):
                            if idx[lv] + ahead < fids_off[lv + 1] - fids_off[lv]:
                                prefetch_row(f, offs[modes[lv]] + fids[fids_off[lv] + idx[lv] + ahead])
                    j0, j1 = fptr[fib_ptr + q], fptr[fib_ptr + q + 1]
                    v = vals[j0]
                    row = leaf_row + fids[leaf_off + j0]
                    for r in range(rank):
                        tmp[r] = v * f[row, r]
                    if long_fibers:  # 4 leaves a pass, summed in pairs: a shorter chain of adds
                        j = j0 + 1
                        while j + 3 < j1:
                            v0, v1, v2, v3 = vals[j], vals[j + 1], vals[j + 2], vals[j + 3]
                            r0, r1 = leaf_row + fids[leaf_off + j], leaf_row + fids[leaf_off + j + 1]
                            r2, r3 = leaf_row + fids[leaf_off + j + 2], leaf_row + fids[leaf_off + j + 3]
                            for r in range(rank):
                                tmp[r] += (v0 * f[r0, r] + v1 * f[r1, r]) + (v2 * f[r2, r] + v3 * f[r3, r])
                            j += 4
                        while j < j1:
                            v = vals[j]
                            row = leaf_row + fids[leaf_off + j]
                            for r in range(rank):
                                tmp[r] += v * f[row, r]
                            j += 1
                    else:  # kept apart: short fibers run this loop as it was, one leaf a pass
                        for j in range(j0 + 1, j1):
                            v = vals[j]
                            row = leaf_row + fids[leaf_off + j]
                            for r in range(rank):
                                tmp[r] += v * f[row, r]
                    if fib == 0:
                        for r in range(rank):
                            acc[0, r] += tmp[r]
                    else:
                        row = fib_row + fids[fib_off + q]
                        for r in range(rank):
                            acc[fib - 1, r] += tmp[r] * f[row, r]
                # close finished nodes upward: scale by their own row, add into the parent
                while level > 0:
                    node = idx[level]
                    row = offs[modes[level]] + fids[fids_off[level] + node]
                    for r in range(rank):
                        acc[level - 1, r] += acc[level, r] * f[row, r]
                    idx[level] += 1
                    if idx[level] < end[level]:
                        for r in range(rank):
                            acc[level, r] = 0.0
                        break
                    level -= 1
                if level == 0:
                    break
            out_row = fids[root]
            for r in range(rank):
                out[out_row, r] = acc[0, r]


@njit(parallel=True, cache=True)
def _csf_leaf(modes, fids, fids_off, fptr, fptr_off, vals, bounds, f, offs, out):
    order = modes.size
    rank = f.shape[1]
    leaf = order - 1
    fib = order - 2
    leaf_off = fids_off[leaf]
    fib_off, fib_row, fib_ptr = fids_off[fib], offs[modes[fib]], fptr_off[fib]
    for t in prange(bounds.size - 1):
        prod = np.empty((max(1, fib), rank), dtype=out.dtype)  # prod[l]: the open path's rows multiplied
        tmp = np.empty(rank, dtype=out.dtype)
        idx = np.empty(order, dtype=np.int64)
        end = np.empty(order, dtype=np.int64)
        for root in range(bounds[t], bounds[t + 1]):
            prod[0, :] = f[offs[modes[0]] + fids[root], :]
            level, idx[0] = 0, root
            while True:
                if level < fib - 1:  # open the first node one level down
                    level += 1
                    idx[level], end[level] = _children(fptr, fptr_off, level - 1, idx[level - 1])
                    _times_row(prod, level, f, offs[modes[level]] + fids[fids_off[level] + idx[level]])
                    continue
                qa, qb = (root, root + 1) if fib == 0 else _children(fptr, fptr_off, level, idx[level])
                for q in range(qa, qb):
                    if fib == 0:
                        for r in range(rank):
                            tmp[r] = prod[0, r]
                    else:
                        row = fib_row + fids[fib_off + q]
                        for r in range(rank):
                            tmp[r] = prod[fib - 1, r] * f[row, r]
                    # Two leaves a pass: their rows differ (a fiber's leaves are distinct indices),
                    # so the two updates overlap instead of waiting on each other; each row still
                    # gets its sums in tree order.
                    j, j1 = fptr[fib_ptr + q], fptr[fib_ptr + q + 1]
                    while j + 1 < j1:
                        v0, v1 = vals[j], vals[j + 1]
                        o0, o1 = fids[leaf_off + j], fids[leaf_off + j + 1]
                        for r in range(rank):
                            out[o0, r] += v0 * tmp[r]
                            out[o1, r] += v1 * tmp[r]
                        j += 2
                    if j < j1:
                        v, o = vals[j], fids[leaf_off + j]
                        for r in range(rank):
                            out[o, r] += v * tmp[r]
                while level > 0:  # the next sibling, or up
                    idx[level] += 1
                    if idx[level] < end[level]:
                        _times_row(prod, level, f, offs[modes[level]] + fids[fids_off[level] + idx[level]])
                        break
                    level -= 1
                if level == 0:
                    break
