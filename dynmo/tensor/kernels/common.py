"""What every MTTKRP layout shares: the owners' split of the work, the stacked factors, threads.

Owner-computes: each output row of the mode is written by exactly one task, which adds its
nonzeros' contributions in a fixed order, so the result is the same bit for bit whatever the
number of threads (no atomics, no privatised copies summed in a thread-dependent order).
`tasks` cuts the rows into runs of about equal nonzeros; the cut depends on the tensor only.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

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


# Factor rows a kernel reads at random, in bytes, past which it asks for them ahead of use
# (`prefetch_row`): more than a core's L2 holds, so without the hint each row is a wait on L3 or
# memory. Below it the rows stay in cache and the hints only cost instructions (measured: 1.2-1.4x
# slower on a 5-mode tensor of 60-140 rows a mode, against 1.3-2x faster on word n-gram tensors of
# 52,566 rows a mode).
PREFETCH_BYTES = 2 << 20
PREFETCH_AHEAD = 4  # fibers ahead: the best of 2, 3, 4, 8 and 16 on those n-gram tensors


def prefetch_ahead(rows: int, rank: int, itemsize: int) -> int:
    """How many fibers ahead a kernel reading `rows` factor rows at random asks for them: 0 (not
    at all) while they fit in cache."""
    return PREFETCH_AHEAD if rows * rank * itemsize > PREFETCH_BYTES else 0


@intrinsic
def prefetch_row(typingctx, arr, row):
    """Ask the cache for row `row` of the C-ordered 2D array `arr` (its first 128 bytes: a rank-16
    row of float64), to be read soon and kept: LLVM's `llvm.prefetch`, which never faults, so a
    row past the end is harmless. Changes no value."""
    sig = types.void(arr, row)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
        start = builder.add(builder.ptrtoint(a.data, i64),
                            builder.mul(args[1], builder.extract_value(a.strides, 0)))
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        for line in (0, 64):  # read, keep in all levels, data cache
            ptr = builder.inttoptr(builder.add(start, ir.Constant(i64, line)), i8p)
            builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
