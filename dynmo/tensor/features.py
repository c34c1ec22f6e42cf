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
    """A coordinate appears twice; `entries` are the two positions in coords (None where the
    count that found it does not know them)."""

    def __init__(self, msg: str, entries: tuple[int, int] | None):
        super().__init__(msg)
        self.entries = entries


@dataclass(frozen=True)
class Moments:
    """What the statistics of a distribution need of its nonempty groups' counts: how many,
    their sum, largest, smallest and sum of squares (Python ints: exact at any size). Counts seen
    in parts (an out-of-core pass) combine with `+`."""

    nz: int
    total: int
    max: int
    min: int
    sumsq: int

    @classmethod
    def of(cls, counts: np.ndarray) -> "Moments":
        c = np.asarray(counts)
        if c.size == 0:
            raise ValueError("a distribution needs at least one nonempty group")
        c64 = c.astype(np.int64)
        return cls(int(c.size), int(c64.sum()), int(c.max()), int(c.min()), int(np.dot(c64, c64)))

    def __add__(self, other: "Moments") -> "Moments":
        return Moments(self.nz + other.nz, self.total + other.total, max(self.max, other.max),
                       min(self.min, other.min), self.sumsq + other.sumsq)


def moments_stats(m: Moments, all_cnt: int) -> dict[str, float | int]:
    """The fifteen statistics of a distribution from its nonempty groups' moments, `all_cnt`
    groups in all (the rest empty). The variances are exact rationals rounded once (Python
    integers), so every way of counting the groups gives the same numbers."""
    nz, total, mx, mn = m.nz, m.total, m.max, m.min
    avg = total / all_cnt
    std = math.sqrt((all_cnt * m.sumsq - total * total) / (all_cnt * all_cnt))
    avg_nz = total / nz
    std_nz = math.sqrt((nz * m.sumsq - total * total) / (nz * nz))
    return {"all_cnt": all_cnt, "nz_cnt": nz, "nz_density": nz / all_cnt, "max": mx, "min": mn, "dev": mx - mn,
            "sum": total, "avg": avg, "imbal": mx / avg - 1.0, "stDev": std, "cv": std / avg,
            "avg_onlynz": avg_nz, "imbal_onlynz": mx / avg_nz - 1.0, "stDev_onlynz": std_nz, "cv_onlynz": std_nz / avg_nz}


def distribution_stats(counts: np.ndarray, all_cnt: int) -> dict[str, float | int]:
    """The fifteen statistics of a distribution: `counts` of its nonempty groups, `all_cnt` groups
    in all (the rest empty)."""
    return moments_stats(Moments.of(counts), all_cnt)


@dataclass
class Distribution:
    """One kind over one choice of free modes: the counts of its nonempty groups."""

    kind: str  # one of KINDS
    free_modes: tuple[int, ...]  # 0-based, ascending: the modes that vary inside the slice or fiber
    all_cnt: int
    # nonempty groups' counts (int32 below 2**31 nonzeros), in key order; None where only their
    # moments were kept (computed out of core)
    counts: np.ndarray | None
    fiber_mode: int | None = None  # fibers_per_slice: the free mode of the fibers counted
    moments: Moments | None = None  # of the counts; derived from them when not given

    def __post_init__(self) -> None:
        if self.moments is None:
            self.moments = Moments.of(self.counts)

    @property
    def nz_cnt(self) -> int:
        return self.moments.nz

    def stats(self) -> dict[str, float | int]:
        return moments_stats(self.moments, self.all_cnt)

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


def count_product(xs) -> int:
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
    fibers[0] = Distribution("nnz_per_fiber", (0,), count_product(sizes[1:]), per_fiber0)

    slices: list[Distribution] = []
    fps: list[Distribution] = []
    pairs = [(a, b) for a in range(1, n_modes) for b in range(a)]  # FeaTensor's order
    for k, (a, b) in enumerate(pairs, 1):
        rest = [m for m in range(n_modes) if m not in (a, b)]
        slice_all = count_product(sizes[m] for m in rest)
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

    return assemble(t.name, tuple(sizes), t.nnz, slices, [fibers[m] for m in range(n_modes)], fps)


def assemble(name: str, sizes: tuple[int, ...], nnz: int, slices: list[Distribution], fibers: list[Distribution],
             fps: list[Distribution]) -> TensorFeatures:
    """The features from the distributions (slices of every pair of modes in FeaTensor's order,
    fibers of every mode, fibers per slice), however they were counted."""
    slice_cnt = sum(d.all_cnt for d in slices)
    fiber_cnt = sum(d.all_cnt for d in fibers)
    nnz_slice_cnt = sum(d.nz_cnt for d in slices)
    nnz_fiber_cnt = sum(d.nz_cnt for d in fibers)
    density = float(nnz)
    for size in sizes:  # one division per mode, as FeaTensor divides (`SparseTensor.density`)
        density /= size
    return TensorFeatures(
        name=name, order=len(sizes), sizes=tuple(sizes), nnz=nnz, density=density,
        slice_cnt=slice_cnt, fiber_cnt=fiber_cnt, nnz_slice_cnt=nnz_slice_cnt, nnz_fiber_cnt=nnz_fiber_cnt,
        slice_density=nnz_slice_cnt / slice_cnt, fiber_density=nnz_fiber_cnt / fiber_cnt,
        distributions=slices + fibers + fps,
    )
