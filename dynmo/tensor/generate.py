"""Sparse tensors with the features asked for.

A request gives the sizes and five targets, with GenTensor's meanings (M modes, 0-based):

    density          nnz / prod(sizes)
    slice_density    nonempty slices of free modes (M-2, M-1) / all of them
    fiber_density    nonempty fibers of free mode M-1 / all of them
    cv_fibers_per_slice   cv over the nonempty (M-2, M-1) slices of the mode-(M-1) fibers each holds
    cv_nnz_per_fiber      cv over the nonempty mode-(M-1) fibers of the nonzeros each holds

(the `cv_onlynz` of `dynmo tensor features`' fibers_per_slice entry (M-2, M-1) and of its
nnz_per_fiber entry M-1). The three counts follow exactly from the densities (rounded to whole
slices, fibers and nonzeros). The two cvs are met by construction: the counts per slice and per
fiber are integers in [1, the mode's size] summing exactly to the fibers and the nonzeros,
shaped as a log-normal law whose spread is solved for (bisection) so that the integers
themselves, after clipping and rounding, have the cv asked for. Which slices are nonempty, and
which indices a slice's fibers and a fiber's nonzeros take, are drawn uniformly without
repetition from a generator seeded by `seed`, so a request and a seed give the same tensor on
every machine with the same numpy.

A request the sizes cannot hold is refused with `GenerateError` saying why: a density above 1,
more fibers than the slices can hold, a cv beyond what integers in the allowed range can reach.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dynmo.tensor.coo import SparseTensor

VALUES = ("uniform", "normal", "ones")  # (0, 1] uniform, standard normal, all 1
CV_TOL = 0.005  # the cvs are solved to within 0.5 % of the target


class GenerateError(ValueError):
    """A request that cannot be met; the message is one line and says why."""


@dataclass(frozen=True)
class Request:
    sizes: tuple[int, ...]
    density: float
    slice_density: float = 1.0
    fiber_density: float = 0.01
    cv_fibers_per_slice: float = 0.5
    cv_nnz_per_fiber: float = 0.5
    seed: int = 1
    values: str = "uniform"


@dataclass(frozen=True)
class Plan:
    """The counts a request comes to."""

    slices_all: int
    fibers_all: int
    nnz: int
    slices: int  # nonempty (M-2, M-1) slices
    fibers: int  # nonempty mode-(M-1) fibers


def plan(r: Request) -> Plan:
    """The whole counts of a request, or GenerateError if the sizes cannot hold them."""
    sizes = tuple(int(s) for s in r.sizes)
    if len(sizes) < 3:
        raise GenerateError(f"{len(sizes)} sizes: a generated tensor needs at least 3 modes")
    if any(s < 1 for s in sizes):
        raise GenerateError(f"sizes {list(sizes)}: every size must be >= 1")
    for name in ("density", "slice_density", "fiber_density"):
        v = getattr(r, name)
        if not (0 < v <= 1):
            raise GenerateError(f"{name} = {v}: a density must be in (0, 1]")
    for name in ("cv_fibers_per_slice", "cv_nnz_per_fiber"):
        v = getattr(r, name)
        if not (v >= 0 and math.isfinite(v)):
            raise GenerateError(f"{name} = {v}: a cv must be a finite number >= 0")
    if r.values not in VALUES:
        raise GenerateError(f"values {r.values!r}: choose one of {', '.join(VALUES)}")
    slices_all = math.prod(sizes[:-2])
    fibers_all = slices_all * sizes[-2]
    cells = fibers_all * sizes[-1]
    nnz, fibers, slices = (max(1, round(d * n)) for d, n in ((r.density, cells), (r.fiber_density, fibers_all),
                                                               (r.slice_density, slices_all)))
    if fibers < slices:
        raise GenerateError(f"fiber_density {r.fiber_density} gives {fibers} nonempty fibers, fewer than the "
                            f"{slices} nonempty slices slice_density asks for (each holds at least one); raise "
                            f"fiber_density to >= {slices / fibers_all:.3g} or lower slice_density")
    if fibers > slices * sizes[-2]:
        raise GenerateError(f"{fibers} nonempty fibers do not fit in {slices} slices of {sizes[-2]} fibers each; "
                            f"lower fiber_density to <= {slices * sizes[-2] / fibers_all:.3g} or raise slice_density")
    if nnz < fibers:
        raise GenerateError(f"density {r.density} gives {nnz} nonzeros, fewer than the {fibers} nonempty fibers "
                            f"(each holds at least one); raise density to >= {fibers / cells:.3g} or lower fiber_density")
    if nnz > fibers * sizes[-1]:
        raise GenerateError(f"{nnz} nonzeros do not fit in {fibers} fibers of {sizes[-1]} entries each; "
                            f"lower density to <= {fibers * sizes[-1] / cells:.3g} or raise fiber_density")
    p = Plan(slices_all, fibers_all, nnz, slices, fibers)
    for name, n, total, hi in (("cv_fibers_per_slice", slices, fibers, sizes[-2]),
                               ("cv_nnz_per_fiber", fibers, nnz, sizes[-1])):
        lo_cv, hi_cv = cv_range(n, total, hi)
        want = getattr(r, name)
        if want > hi_cv * (1 + CV_TOL):
            raise GenerateError(f"{name} = {want} is beyond the {hi_cv:.4g} that {n} counts in [1, {hi}] summing to "
                                f"{total} can reach")
        if want < lo_cv * (1 - CV_TOL) - 1e-12:
            raise GenerateError(f"{name} = {want} is below the {lo_cv:.4g} that {n} whole counts summing to {total} "
                                f"must have")
    return p


def _cv(x: np.ndarray) -> float:
    m = x.mean()
    return float(x.std() / m) if m > 0 else 0.0


def cv_range(n: int, total: int, hi: int) -> tuple[float, float]:
    """The least and the greatest cv of n integers in [1, hi] that sum to total."""
    mean = total / n
    frac = mean - math.floor(mean)  # as even as integers get: floor and ceil
    lo = math.sqrt(frac * (1 - frac)) / mean
    # as spread as they get: as many at hi as fit, the rest at 1, one in between
    k = (total - n) // (hi - 1) if hi > 1 else 0
    rest = total - k * hi - (n - k - 1) if k < n else 0
    # their cv in exact integers (no array of n counts: n may be far beyond memory)
    ones = max(0, n - k - 1)
    count, s1, s2 = k + ones + (k < n), k * hi + rest + ones, k * hi * hi + rest * rest + ones
    return lo, math.sqrt(max(0, s2 * count - s1 * s1)) / s1 if s1 > 0 else 0.0


def _shaped(z: np.ndarray, sigma: float, total: int, hi: int) -> np.ndarray:
    """Integers in [1, hi] summing to total (<= n * hi), shaped as exp(sigma * z) (z sorted
    ascending normals)."""
    n = z.size
    q = np.exp(sigma * (z - z.max()))[::-1]  # descending, <= 1: no overflow
    extra = float(total - n)  # above the floor of 1 each
    cap = hi - 1.0
    # water-filling, exactly: the k largest are clipped at the cap and the rest share what is
    # left in proportion; k is the least for which the largest of the rest fits
    k = np.arange(n)
    rest = np.cumsum(q[::-1])[::-1]  # sum of q[k:]
    left = extra - k * cap
    fits = (q * left <= cap * rest) | (left <= 0)
    first = int(np.argmax(fits)) if fits.any() else n
    v = np.full(n, cap)
    if first < n and left[first] > 0:
        v[first:] = np.minimum(cap, q[first:] * (left[first] / rest[first]))
    elif first < n:
        v[first:] = 0.0
    base = np.floor(v).astype(np.int64)
    short = int(total - n - base.sum())
    if short > 0:  # the largest remainders get the units rounding left out
        order = np.argsort(-(v - base), kind="stable")
        room = np.flatnonzero(base[order] < hi - 1)
        base[order[room[:short]]] += 1
    return (base + 1)[::-1]  # ascending again, as z


def counts_with_cv(n: int, total: int, hi: int, cv: float, rng: np.random.Generator) -> np.ndarray:
    """n integers in [1, hi], summing to total, whose cv is `cv` (within CV_TOL where integers
    allow), in random order."""
    z = np.sort(rng.standard_normal(n))
    if n == 1:
        return np.array([total], dtype=np.int64)
    lo_s, hi_s = 0.0, 1.0
    while _cv(_shaped(z, hi_s, total, hi)) < cv and hi_s < 64:
        hi_s *= 2
    best = _shaped(z, hi_s, total, hi)
    for _ in range(60):
        mid = (lo_s + hi_s) / 2
        x = _shaped(z, mid, total, hi)
        got = _cv(x)
        if abs(got - cv) < abs(_cv(best) - cv):
            best = x
        if abs(got - cv) <= CV_TOL * cv:
            break
        lo_s, hi_s = (mid, hi_s) if got < cv else (lo_s, mid)
    return rng.permutation(_refine(best, cv, hi))


def _refine(x: np.ndarray, cv: float, hi: int, moves: int = 10_000) -> np.ndarray:
    """Move single units between counts (the sum stays, every count in [1, hi]) while that brings
    the cv closer: the log-normal's shape gets the cv to within what its discrete steps allow,
    this gets it to within one unit's move. Works on the histogram of the counts."""
    if hi > 10_000_000 or x.size < 2:
        return x
    n, total = x.size, int(x.sum())
    want = n * (total / n) ** 2 * (1 + cv * cv)  # the sum of squares the target cv means
    h = np.bincount(x, minlength=hi + 2).astype(np.int64)
    s2 = float(np.dot(x.astype(np.float64), x))
    for _ in range(moves):
        gap = want - s2
        present = np.flatnonzero(h)
        src = present[present >= 2]  # a unit leaves a count of u_a (-> u_a - 1) ...
        dst = present[present <= hi - 1]  # ... and joins a count of u_b (-> u_b + 1)
        if not src.size or not dst.size:
            break
        # the sum of squares changes by 2 (u_b - u_a + 1): want u_b near u_a - 1 + gap / 2
        ideal = src - 1 + gap / 2
        k = np.clip(np.searchsorted(dst, ideal), 0, dst.size - 1)
        best = None
        for kk in (k, np.maximum(k - 1, 0)):
            u_a, u_b = src, dst[kk]
            ok = (u_a != u_b) | (h[u_a] >= 2)  # the same value needs two counts to move between
            change = 2.0 * (u_b - u_a + 1)
            err = np.where(ok, np.abs(gap - change), np.inf)
            j = int(np.argmin(err))
            if best is None or err[j] < best[0]:
                best = (err[j], int(u_a[j]), int(u_b[j]), change[j])
        err, u_a, u_b, change = best
        if not err < abs(gap):
            break
        h[u_a] -= 1
        h[u_a - 1] += 1
        h[u_b] -= 1
        h[u_b + 1] += 1
        s2 += change
    return np.repeat(np.arange(h.size), h)


def distinct_per_group(counts: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """For each group g, counts[g] distinct integers in [0, size), drawn uniformly; flattened in
    group order. Groups filling more than half of `size` draw the entries they leave out."""
    counts = np.asarray(counts, dtype=np.int64)
    out = np.empty(int(counts.sum()), dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    dense = counts * 2 > size
    sparse_groups = np.flatnonzero(~dense)
    if sparse_groups.size:
        vals = _rejection(counts[sparse_groups], size, rng)
        pos = np.repeat(starts[sparse_groups], counts[sparse_groups]) + _ranks(counts[sparse_groups])
        out[pos] = vals
    dense_groups = np.flatnonzero(dense)
    if dense_groups.size:
        holes = size - counts[dense_groups]
        left = _rejection(holes, size, rng)
        keep = np.ones((dense_groups.size, size), dtype=bool)
        keep[np.repeat(np.arange(dense_groups.size), holes), left] = False
        g, idx = np.nonzero(keep)  # row-major: each group's entries together, ascending
        pos = np.repeat(starts[dense_groups], counts[dense_groups]) + _ranks(counts[dense_groups])
        out[pos] = idx
    return out


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, .., c-1 for each count c, concatenated."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total) - starts


def _rejection(counts: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """counts[g] distinct values in [0, size) per group (each count <= size), each group's in
    ascending order, flattened in group order: draw them all, keep each group's distinct ones,
    draw again only what is missing (checked against what is kept), until nothing is."""
    n_groups = counts.size
    if n_groups * size >= 2**62:  # the (group, value) key would overflow int64: group by group
        return np.concatenate([np.sort(rng.choice(size, int(c), replace=False)) for c in counts])
    if int(counts.sum()) == 0:
        return np.zeros(0, dtype=np.int64)
    keys = np.repeat(np.arange(n_groups, dtype=np.int64) * size, counts)  # (group, value) as one int64
    keys += rng.integers(0, size, keys.size, dtype=np.uint32 if size < 2**32 else np.int64)
    keys.sort()
    same = keys[1:] == keys[:-1]
    missing = np.bincount(keys[1:][same] // size, minlength=n_groups)  # repeats are few: count them alone
    if not missing.any():
        return keys % size
    kept = keys[np.concatenate(([True], ~same))]
    del keys, same
    extra: list[np.ndarray] = []
    while missing.any():
        new = np.repeat(np.arange(n_groups, dtype=np.int64) * size, missing)
        new += rng.integers(0, size, new.size)
        new.sort()
        ok = np.concatenate(([True], new[1:] != new[:-1]))
        for k in [kept, *extra]:
            if k.size:
                ok &= k[np.minimum(np.searchsorted(k, new), k.size - 1)] != new
        extra.append(new[ok])
        missing -= np.bincount(extra[-1] // size, minlength=n_groups)
    more = np.sort(np.concatenate(extra))
    out = np.insert(kept, np.searchsorted(kept, more), more)  # a merge: the extras are few
    return out % size


def _values(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "ones":
        return np.ones(n)
    if kind == "normal":
        return rng.standard_normal(n)
    v = rng.random(n)
    return np.subtract(1.0, v, out=v)  # (0, 1]: never an explicit zero


def generate(r: Request) -> SparseTensor:
    """A tensor meeting the request (see the module's docstring)."""
    p = plan(r)
    sizes = tuple(int(s) for s in r.sizes)
    rng = np.random.default_rng(r.seed)
    fps = counts_with_cv(p.slices, p.fibers, sizes[-2], r.cv_fibers_per_slice, rng)
    npf = counts_with_cv(p.fibers, p.nnz, sizes[-1], r.cv_nnz_per_fiber, rng)
    slice_ids = np.sort(distinct_per_group(np.array([p.slices]), p.slices_all, rng))
    fiber_mode = distinct_per_group(fps, sizes[-2], rng)  # each fiber's index in mode M-2
    last = distinct_per_group(npf, sizes[-1], rng)  # each nonzero's index in mode M-1
    fiber_slice = np.repeat(slice_ids, fps)
    coords = np.empty((len(sizes), p.nnz), dtype=np.int32 if max(sizes) < 2**31 else np.int64)
    head = np.unravel_index(fiber_slice, sizes[:-2])  # per fiber, then repeated per nonzero
    for m, c in enumerate(head):
        coords[m] = np.repeat(c.astype(coords.dtype), npf)
    coords[-2] = np.repeat(fiber_mode.astype(coords.dtype), npf)
    coords[-1] = last
    return SparseTensor(coords, _values(r.values, p.nnz, rng), sizes, "generated")
