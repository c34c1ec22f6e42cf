"""HiCOO MTTKRP: blocked COO, one copy for every mode (as ParTI's HiCOO lays it out).

The index space is cut into cubes of 2^b per side. The nonzeros are sorted block by block, the
blocks in Morton (Z) order of their block coordinates, and each nonzero keeps only its offsets
inside its block (one byte per mode) and its value; each block keeps its block coordinates and
where its nonzeros start. b is 7 (128-wide blocks) unless the shortest mode would then have
fewer than 4 blocks along it (then smaller, down to 4).

Mode n's MTTKRP: the blocks are grouped by their block index along n (a block row, 2^b output
rows; a small per-mode permutation of the blocks, not of the nonzeros), and each task owns a
run of block rows, so every output row is written by one task, in block order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from dynmo.tensor.coo import mixed_key
from dynmo.tensor.kernels.common import tasks, times_row


def block_bits(sizes: tuple[int, ...]) -> int:
    """7, or less (down to 4) so that the shortest mode spans at least 4 blocks."""
    b = 7
    while b > 4 and -(-min(sizes) // (1 << b)) < 4:
        b -= 1
    return b


def morton(block: np.ndarray) -> np.ndarray | None:
    """The Z-order key of each column of `block` (order x n), or None when it would not fit 63 bits."""
    order = block.shape[0]
    bits = max(1, int(block.max()).bit_length())
    if bits * order > 63:
        return None
    key = np.zeros(block.shape[1], dtype=np.int64)
    cols = block.astype(np.int64)
    for bit in range(bits):
        for m in range(order):
            key |= ((cols[m] >> bit) & 1) << (bit * order + (order - 1 - m))
    return key


class HiCOO:
    name = "hicoo"

    def __init__(self, coords: np.ndarray, values: np.ndarray, sizes: tuple[int, ...], dtype):
        self.sizes, self.order = tuple(sizes), len(sizes)
        self.bits = b = block_bits(self.sizes)
        c = coords.astype(np.int64)
        block = c >> b
        key = morton(block)
        if key is None:
            key = mixed_key(list(block), [-(-s >> b) + 1 for s in sizes])
        inner = mixed_key(list(c & ((1 << b) - 1)), [1 << b] * self.order)
        sort = np.lexsort((inner, key))
        key = key[sort]
        new = np.ones(key.size, dtype=bool)
        new[1:] = key[1:] != key[:-1]
        starts = np.flatnonzero(new)
        self.bptr = np.append(starts, key.size).astype(np.int64)
        idx = np.int32 if max(sizes) < 2**31 else np.int64
        self.bcoord = np.ascontiguousarray(block[:, sort][:, starts], dtype=idx)
        self.eoff = np.ascontiguousarray((c[:, sort] & ((1 << b) - 1)).astype(np.uint8))
        self.values = np.ascontiguousarray(values[sort], dtype=dtype)
        sizes_b = np.diff(self.bptr)
        self.bperm, self.brow_ptr, self.bounds = [], [], []
        for m in range(self.order):
            rows = -(-sizes[m] >> b)
            perm = np.argsort(self.bcoord[m], kind="stable").astype(np.int64)
            ptr = np.zeros(rows + 1, dtype=np.int64)
            ptr[1:] = np.cumsum(np.bincount(self.bcoord[m], minlength=rows))
            nnz_ptr = np.zeros(rows + 1, dtype=np.int64)  # nonzeros per block row, for the tasks' balance
            nnz_ptr[1:] = np.cumsum(np.bincount(self.bcoord[m], weights=sizes_b, minlength=rows)).astype(np.int64)
            self.bperm.append(perm)
            self.brow_ptr.append(ptr)
            self.bounds.append(tasks(nnz_ptr))

    @property
    def blocks(self) -> int:
        return int(self.bptr.size - 1)

    @property
    def nbytes(self) -> int:
        per_mode = sum(p.nbytes for p in self.bperm) + sum(p.nbytes for p in self.brow_ptr)
        return int(self.bptr.nbytes + self.bcoord.nbytes + self.eoff.nbytes + self.values.nbytes + per_mode
                   + sum(b.nbytes for b in self.bounds))

    def mttkrp(self, f: np.ndarray, offsets: np.ndarray, mode: int, out: np.ndarray) -> None:
        out[:] = 0
        _hicoo_mode(self.bptr, self.bcoord, self.eoff, self.values, self.bperm[mode], self.brow_ptr[mode],
                    self.bounds[mode], self.bits, f, offsets, mode, out)


@njit(parallel=True, cache=True)
def _hicoo_mode(bptr, bcoord, eoff, vals, bperm, brow_ptr, bounds, bits, f, offs, mode, out):
    order = bcoord.shape[0]
    rank = f.shape[1]
    for t in prange(bounds.size - 1):
        tmp = np.empty(rank, dtype=out.dtype)
        base = np.empty(order, dtype=np.int64)
        for brow in range(bounds[t], bounds[t + 1]):
            for q in range(brow_ptr[brow], brow_ptr[brow + 1]):
                blk = bperm[q]
                for k in range(order):
                    base[k] = offs[k] + (np.int64(bcoord[k, blk]) << bits)
                out_base = np.int64(bcoord[mode, blk]) << bits
                for j in range(bptr[blk], bptr[blk + 1]):
                    tmp[:] = vals[j]
                    for k in range(order):
                        if k != mode:
                            times_row(tmp, f, base[k] + eoff[k, j])
                    i = out_base + eoff[mode, j]
                    for r in range(rank):
                        out[i, r] += tmp[r]
