"""The features of a sparse tensor: how its nonzeros spread over the slices and fibers of every
mode, FeaTensor's whole set, computed exactly.

Words (for an order-N tensor, modes 0..N-1):
- a **fiber** of free mode `a` fixes every index but mode `a`'s; there are prod(sizes) / size_a.
- a **slice** of free modes `(a, b)` fixes every index but those two.
- three distributions for each kind: nonzeros per slice (every pair of modes), nonzeros per
  fiber (every mode) and fibers per slice: in a slice of free modes (a, b) with a > b, the
  nonempty fibers of free mode `a` it holds (FeaTensor's pairing, kept so numbers carry over).

Each distribution gets the fifteen statistics `STATS`, with FeaTensor's code's definitions (its
README differs on `imbal`): over all `all_cnt` slices or fibers, empty ones included, and over the
nonempty ones (`_onlynz`); `min` is over the nonempty ones; standard deviations are population ones
(divided by the count). Empty slices and fibers are never materialised: a distribution is the
sorted list of its nonempty groups' counts, and the empty ones enter the statistics as a count.

How: for each pair (a, b) the nonzeros are keyed by the tuple of their indices in every mode but
`a` (mode `b` last) and the keys sorted once; the runs of equal keys are the fibers of free mode
`a`, and dividing a fiber's key by size_b gives its slice of free modes (a, b). One sort per pair
and one more of the full coordinates (the fibers of free mode 0 and the check that no coordinate
repeats): C(N, 2) + 1 sorts of nnz int64 keys in all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dynmo.tensor.coo import SparseTensor, TensorError, locate_duplicate, mixed_key

STATS = ("all_cnt", "nz_cnt", "nz_density", "max", "min", "dev", "sum", "avg", "imbal", "stDev", "cv",
         "avg_onlynz", "imbal_onlynz", "stDev_onlynz", "cv_onlynz")
KINDS = ("nnz_per_slice", "nnz_per_fiber", "fibers_per_slice")
# The general features, FeaTensor's names (sparsity is its word for density) -> ours (snake case);
# its sizes are dim_0, dim_1, ... where ours are one list, `sizes`.
GENERAL = {"order": "order", "nnz": "nnz", "sparsity": "density", "sliceCnt": "slice_cnt",
           "fiberCnt": "fiber_cnt", "nnzSliceCnt": "nnz_slice_cnt", "nnzFiberCnt": "nnz_fiber_cnt",
           "slice_sparsity": "slice_density", "fiber_sparsity": "fiber_density"}


class DuplicateError(TensorError):
    """A coordinate appears twice; `entries` are the two positions in coords."""

    def __init__(self, msg: str, entries: tuple[int, int]):
        super().__init__(msg)
        self.entries = entries


def distribution_stats(counts: np.ndarray, all_cnt: int) -> dict[str, float | int]:
    """The fifteen statistics of a distribution: `counts` of its nonempty groups, `all_cnt` groups
    in all (the rest empty)."""
    c = np.asarray(counts)
    nz = int(c.size)
    if nz == 0:
        raise ValueError("a distribution needs at least one nonempty group")
    mx, mn, total = int(c.max()), int(c.min()), int(c.sum())
    cf = c.astype(np.float64)
    avg = total / all_cnt
    d = cf - avg
    var = (float(np.dot(d, d)) + (all_cnt - nz) * avg * avg) / all_cnt
    std = math.sqrt(var)
    avg_nz = total / nz
    d = cf - avg_nz
    std_nz = math.sqrt(float(np.dot(d, d)) / nz)
    return {"all_cnt": all_cnt, "nz_cnt": nz, "nz_density": nz / all_cnt, "max": mx, "min": mn, "dev": mx - mn,
            "sum": total, "avg": avg, "imbal": mx / avg - 1.0, "stDev": std, "cv": std / avg,
            "avg_onlynz": avg_nz, "imbal_onlynz": mx / avg_nz - 1.0, "stDev_onlynz": std_nz, "cv_onlynz": std_nz / avg_nz}


@dataclass
class Distribution:
    """One kind over one choice of free modes: the counts of its nonempty groups."""

    kind: str  # one of KINDS
    free_modes: tuple[int, ...]  # 0-based, ascending: the modes that vary inside the slice or fiber
    all_cnt: int
    counts: np.ndarray  # nonempty groups' counts (int32 below 2**31 nonzeros), in key order
    fiber_mode: int | None = None  # fibers_per_slice: the free mode of the fibers counted

    def stats(self) -> dict[str, float | int]:
        return distribution_stats(self.counts, self.all_cnt)

    def entry(self) -> dict:
        out: dict = {"free_modes": list(self.free_modes)}
        if self.fiber_mode is not None:
            out["fiber_mode"] = self.fiber_mode
        return out | self.stats()


@dataclass
class TensorFeatures:
    name: str
    order: int
    sizes: tuple[int, ...]
    nnz: int
    density: float
    slice_cnt: int
    fiber_cnt: int
    nnz_slice_cnt: int
    nnz_fiber_cnt: int
    slice_density: float
    fiber_density: float
    distributions: list[Distribution] = field(default_factory=list)

    def of(self, kind: str) -> list[Distribution]:
        return [d for d in self.distributions if d.kind == kind]

    def to_dict(self) -> dict:
        """The JSON document: general features at the top, one list per kind."""
        out = {"name": self.name, "order": self.order, "sizes": list(self.sizes), "nnz": self.nnz,
               "density": self.density, "slice_cnt": self.slice_cnt, "fiber_cnt": self.fiber_cnt,
               "nnz_slice_cnt": self.nnz_slice_cnt, "nnz_fiber_cnt": self.nnz_fiber_cnt,
               "slice_density": self.slice_density, "fiber_density": self.fiber_density}
        for kind in KINDS:
            out[kind] = [d.entry() for d in self.of(kind)]
        return out


def _runs(sorted_key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values, how many times each occurs) of a sorted array."""
    n = sorted_key.size
    starts = np.flatnonzero(np.concatenate(([True], sorted_key[1:] != sorted_key[:-1])))
    counts = np.diff(np.append(starts, n))
    return sorted_key[starts], counts.astype(np.int32) if n < 2**31 else counts


def _prod(xs) -> int:
    return math.prod(int(x) for x in xs)  # Python ints: counts of all slices can pass 2**64


def features(t: SparseTensor, progress: Callable[[str], None] | None = None) -> TensorFeatures:
    """Every feature of `t` (order >= 2). DuplicateError if a coordinate appears twice."""
    n_modes, sizes, idx = t.order, t.sizes, t.coords
    if n_modes < 2:
        raise TensorError(f"a tensor of order {n_modes} has no slices; features need at least 2 modes")
    if t.nnz == 0:
        raise TensorError("the tensor has no nonzeros")
    say = progress or (lambda msg: None)
    fibers: dict[int, Distribution] = {}

    # The full coordinates, mode 0 last: duplicates, and the fibers of free mode 0.
    order0 = list(range(n_modes - 1, 0, -1)) + [0]
    key = mixed_key([idx[m] for m in order0], [sizes[m] for m in order0])
    full = np.sort(key)
    if np.any(full[1:] == full[:-1]):
        a, b = locate_duplicate(key)
        coord = tuple(int(x) + 1 for x in idx[:, b])
        raise DuplicateError(f"coordinate {coord} (1-based) appears twice", (a, b))
    del key
    full //= sizes[0]
    _, per_fiber0 = _runs(full)
    del full
    fibers[0] = Distribution("nnz_per_fiber", (0,), _prod(sizes[1:]), per_fiber0)

    slices: list[Distribution] = []
    fps: list[Distribution] = []
    pairs = [(a, b) for a in range(1, n_modes) for b in range(a)]  # FeaTensor's order
    for k, (a, b) in enumerate(pairs, 1):
        rest = [m for m in range(n_modes) if m not in (a, b)]
        slice_all = _prod(sizes[m] for m in rest)
        key = mixed_key([idx[m] for m in rest] + [idx[b]], [sizes[m] for m in rest] + [sizes[b]])
        key.sort()
        fiber_keys, per_fiber = _runs(key)  # fibers of free mode a
        del key
        if a not in fibers:
            fibers[a] = Distribution("nnz_per_fiber", (a,), slice_all * sizes[b], per_fiber)
        fiber_keys //= sizes[b]  # each fiber's slice of free modes (a, b), sorted
        starts = np.flatnonzero(np.concatenate(([True], fiber_keys[1:] != fiber_keys[:-1])))
        free = (b, a)
        slices.append(Distribution("nnz_per_slice", free, slice_all, np.add.reduceat(per_fiber, starts)))
        fps.append(Distribution("fibers_per_slice", free, slice_all, np.diff(np.append(starts, fiber_keys.size)),
                                fiber_mode=a))
        say(f"features: slices of modes ({b}, {a}) done, {k} of {len(pairs)}")

    fiber_list = [fibers[m] for m in range(n_modes)]
    slice_cnt = sum(d.all_cnt for d in slices)
    fiber_cnt = sum(d.all_cnt for d in fiber_list)
    nnz_slice_cnt = sum(int(d.counts.size) for d in slices)
    nnz_fiber_cnt = sum(int(d.counts.size) for d in fiber_list)
    return TensorFeatures(
        name=t.name, order=n_modes, sizes=tuple(sizes), nnz=t.nnz, density=t.density,
        slice_cnt=slice_cnt, fiber_cnt=fiber_cnt, nnz_slice_cnt=nnz_slice_cnt, nnz_fiber_cnt=nnz_fiber_cnt,
        slice_density=nnz_slice_cnt / slice_cnt, fiber_density=nnz_fiber_cnt / fiber_cnt,
        distributions=slices + fiber_list + fps,
    )
