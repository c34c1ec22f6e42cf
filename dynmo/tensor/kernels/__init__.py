"""Compiled MTTKRP kernels (numba) over three layouts of a sparse tensor:

- `coo`:   the nonzeros once plus a sorting permutation per mode (kernels/coo.py);
- `csf`:   compressed sparse fibers, one tree per mode (kernels/csf.py);
- `hicoo`: blocked COO, one copy for every mode (kernels/hicoo.py).

Every kernel is owner-computes: each output row is summed by one task in a fixed order, so the
result is the same for any number of threads. float64 and float32, any order >= 2.

    lay = convert(t, "csf", "float64")           # once per tensor
    m = mttkrp(lay, factors, mode)               # (sizes[mode], R)
"""

from __future__ import annotations

import time

import numpy as np

from dynmo.tensor.coo import SparseTensor
from dynmo.tensor.kernels.common import DTYPES, set_threads, stacked

FORMATS = ("coo", "csf", "hicoo")

__all__ = ["FORMATS", "DTYPES", "convert", "mttkrp", "set_threads", "time_mttkrp"]


def convert(t: SparseTensor, fmt: str, dtype: str = "float64"):
    """The layout `fmt` of `t`, its values as `dtype` ("float64" or "float32")."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: give one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: give float64 or float32")
    values = t.values if t.values is not None else np.ones(t.nnz)
    if fmt == "coo":
        from dynmo.tensor.kernels.coo import COO as cls
    elif fmt == "csf":
        from dynmo.tensor.kernels.csf import CSF as cls
    else:
        from dynmo.tensor.kernels.hicoo import HiCOO as cls
    lay = cls(t.coords, values, t.sizes, DTYPES[dtype])
    lay.dtype = DTYPES[dtype]
    return lay


def mttkrp(lay, factors: list[np.ndarray], mode: int, out: np.ndarray | None = None,
           stacked_factors: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """X_(mode) times the Khatri-Rao product of every factor but `mode`'s, on layout `lay`."""
    f, offsets = stacked_factors if stacked_factors is not None else stacked(factors, lay.dtype)
    rank = f.shape[1]
    if out is None:
        out = np.empty((lay.sizes[mode], rank), dtype=lay.dtype)
    lay.mttkrp(f, offsets, mode, out)
    return out


def time_mttkrp(lay, rank: int, modes: list[int], repeats: int, seed: int = 0) -> list[float]:
    """The median seconds of each mode's MTTKRP over `repeats` runs (after one untimed run)."""
    rng = np.random.default_rng(seed)
    factors = [rng.random((s, rank)) for s in lay.sizes]
    st = stacked(factors, lay.dtype)
    outs = {m: np.empty((lay.sizes[m], rank), dtype=lay.dtype) for m in modes}
    for m in modes:
        mttkrp(lay, factors, m, outs[m], st)  # compiles (or loads the cache), warms the caches
    times = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:
            t0 = time.perf_counter()
            mttkrp(lay, factors, m, outs[m], st)
            times[m].append(time.perf_counter() - t0)
    return [float(np.median(times[m])) for m in modes]
