"""Siblings of real tensors: a tensor whose every mode spreads its nonzeros over its slices as the
real one's does, at the real sizes or scaled.

A mode-m slice here fixes the index of mode m (for a 3-mode tensor: FeaTensor's slice whose free
modes are the other two). What is taken from the real tensor, per mode: how many of its slices
are nonempty, the cv and the largest count of nonzeros per nonempty slice; and the nonzero count.
With `scale` X every size, the nonempty slices of every mode and the nonzeros are multiplied by
X, so each slice keeps its mean.

How: per mode, a whole-number count per nonempty slice is shaped to that cv (the generator's
`counts_with_cv`, capped at the largest count) on nonempty slices drawn at random; each mode's
indices, repeated by their counts, are shuffled and zipped into coordinates (a configuration
model), so every mode's counts are exact by construction. Coordinates that come out twice are
re-drawn by swapping one mode's index with a random other nonzero's where the swap makes no
coordinate that exists, which leaves every mode's counts unchanged; those still repeated when
`ROUNDS` rounds brought no fewer are dropped (reported; a few in 10,000 where the real tensor
packs its heaviest slices of every mode into one dense corner).

Matched exactly: the nonzero count (less any dropped), each mode's nonempty slices; to the
solver's tolerance: each mode's cv of nonzeros per slice. Not controlled: how the modes combine
(fibers, slices of two free modes), which follows from the zipping; measured in docs/tensors.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynmo.tensor.coo import SparseTensor, mixed_key
from dynmo.tensor.generate import VALUES, GenerateError, _values, counts_with_cv, distinct_per_group

ROUNDS = 400


@dataclass(frozen=True)
class ModeSpread:
    size: int
    nonempty: int  # slices with a nonzero
    cv: float  # of nonzeros per nonempty slice
    max: int  # nonzeros in the fullest slice


@dataclass(frozen=True)
class Spread:
    nnz: int
    modes: tuple[ModeSpread, ...]


def spread_of(t: SparseTensor) -> Spread:
    modes = []
    for m, size in enumerate(t.sizes):
        c = np.bincount(t.coords[m], minlength=size)
        c = c[c > 0]
        modes.append(ModeSpread(int(size), int(c.size), float(c.std() / c.mean()), int(c.max())))
    return Spread(t.nnz, tuple(modes))


def spread_from_features(doc: dict) -> Spread:
    """The spread of an order-3 tensor from its `dynmo tensor features --json` document (for
    higher orders the slices FeaTensor describes fix more than one mode: give the .tns)."""
    try:
        order, sizes, nnz = int(doc["order"]), [int(s) for s in doc["sizes"]], int(doc["nnz"])
        entries = {tuple(e["free_modes"]): e for e in doc["nnz_per_slice"]}
    except (KeyError, TypeError, ValueError) as e:
        raise GenerateError(f"not a features document of `dynmo tensor features --json` ({e})") from None
    if order != 3:
        raise GenerateError(f"a features document of an order-{order} tensor does not say how each mode's slices "
                            "fill (only order 3 does); give the .tns itself")
    modes = []
    for m in range(3):
        e = entries.get(tuple(k for k in range(3) if k != m))
        if e is None:
            raise GenerateError(f"the features document has no nnz_per_slice entry for mode {m}")
        modes.append(ModeSpread(sizes[m], int(e["nz_cnt"]), float(e["cv_onlynz"]), int(e["max"])))
    return Spread(nnz, tuple(modes))


def load_spread(path) -> Spread:
    """A real tensor's spread from its .tns (plain or gzip) or its features JSON."""
    p = Path(path)
    if p.suffix == ".json":
        try:
            return spread_from_features(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise GenerateError(f"{path}: {e}") from None
    from dynmo.tensor.tns import read_tns

    return spread_of(read_tns(p))


def sibling(s: Spread, scale: float = 1.0, seed: int = 1, values: str = "uniform") -> tuple[SparseTensor, int]:
    """(the sibling, how many repeated coordinates had to be dropped)."""
    if not scale > 0:
        raise GenerateError(f"scale {scale}: give a number > 0")
    if values not in VALUES:
        raise GenerateError(f"values {values!r}: choose one of {', '.join(VALUES)}")
    rng = np.random.default_rng(seed)
    nnz = max(1, round(s.nnz * scale))
    sizes = tuple(max(1, round(m.size * scale)) for m in s.modes)
    cells = 1
    for size in sizes:
        cells *= size
    if nnz > cells:
        raise GenerateError(f"{nnz} nonzeros do not fit in {cells} entries")
    cols = []
    for k, (m, size) in enumerate(zip(s.modes, sizes)):
        nonempty = min(size, max(1, round(m.nonempty * scale)))
        hi = max(-(-nnz // nonempty), min(nnz, round(m.max * scale)))  # room for the mean at least
        counts = counts_with_cv(nonempty, nnz, hi, m.cv, rng)
        which = distinct_per_group(np.array([nonempty]), size, rng)
        cols.append(rng.permutation(np.repeat(which, counts)))
    coords, dropped = _unrepeat(np.stack(cols), sizes, rng)
    return SparseTensor(coords, _values(values, coords.shape[1], rng), sizes, "sibling"), dropped


def _unrepeat(coords: np.ndarray, sizes, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Swap one mode's index between a repeated nonzero and a random other one, keeping only
    swaps that make no coordinate that exists already (every mode's counts stay as they are),
    until no coordinate repeats; drop the repeats left after ROUNDS rounds.
    (coords, how many were dropped)."""
    n_modes, n = coords.shape
    radices = list(sizes)
    fewest, since = n, 0
    for r in range(ROUNDS * 10):
        key = mixed_key(list(coords), radices)
        order = np.argsort(key, kind="stable")
        k = key[order]
        dup = order[1:][k[1:] == k[:-1]]
        if dup.size == 0:
            return coords, 0
        fewest, since = (dup.size, 0) if dup.size < fewest else (fewest, since + 1)
        if since >= ROUNDS:  # no progress in ROUNDS rounds: drop what is left
            break
        m = r % n_modes
        other = rng.integers(0, n, dup.size)
        new_dup, new_other = coords[:, dup].copy(), coords[:, other].copy()
        new_dup[m], new_other[m] = coords[m, other], coords[m, dup]
        kd, ko = mixed_key(list(new_dup), radices), mixed_key(list(new_other), radices)
        taken = lambda q: k[np.minimum(np.searchsorted(k, q), k.size - 1)] == q  # noqa: E731
        ok = ~taken(kd) & ~taken(ko) & (kd != ko)
        is_dup = np.zeros(n, dtype=bool)
        is_dup[dup] = True
        ok &= ~is_dup[other]
        # two accepted swaps must not touch the same nonzero, nor make the same coordinate
        for arr in (other, np.concatenate([kd, ko])):
            first = np.zeros(arr.size, dtype=bool)
            first[np.unique(arr, return_index=True)[1]] = True
            ok &= first[: ok.size] & (first[ok.size:] if arr.size > ok.size else True)
        coords[:, dup[ok]] = new_dup[:, ok]
        coords[:, other[ok]] = new_other[:, ok]
    dup = _repeats(coords, sizes)
    keep = np.ones(n, dtype=bool)
    keep[dup] = False
    return coords[:, keep], int(dup.size)


def _repeats(coords: np.ndarray, sizes) -> np.ndarray:
    """Positions of every coordinate that repeats an earlier one."""
    key = mixed_key(list(coords), list(sizes))
    order = np.argsort(key, kind="stable")
    k = key[order]
    return np.sort(order[1:][k[1:] == k[:-1]])
