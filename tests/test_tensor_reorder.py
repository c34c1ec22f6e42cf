"""Reorderings are relabelings: every method gives permutations, the features stay equal, and CP of
the reordered tensor (from relabeled initial factors) maps back to CP of the original."""

from __future__ import annotations

import numpy as np
import pytest

from dynmo.tensor.coo import from_coo
from dynmo.tensor.cp import cp_als
from dynmo.tensor.features import features
from dynmo.tensor.reorder import METHODS, read_perms, relabel, reorder, write_perms


def _tensor(seed=0, sizes=(30, 40, 20, 25), nnz=1500):
    rng = np.random.default_rng(seed)
    c = [np.minimum(rng.zipf(1.8, nnz) - 1, s - 1) if m == 0 else rng.integers(0, s, nnz) for m, s in enumerate(sizes)]
    key = np.unique(np.ravel_multi_index(c, sizes))
    return from_coo(np.vstack(np.unravel_index(key, sizes)), rng.random(key.size), sizes)


@pytest.mark.parametrize("method", METHODS)
def test_a_relabeling_with_the_same_features(method):
    t = _tensor()
    new, perms = reorder(t, method)
    for p, s in zip(perms, t.sizes):
        assert np.array_equal(np.sort(p), np.arange(s))
    back = relabel(new, [np.argsort(p) for p in perms])
    assert np.array_equal(back.coords, t.coords) and np.array_equal(back.values, t.values)
    assert features(new).to_dict() == features(t).to_dict()


def test_degree_puts_the_heaviest_slices_first():
    t = _tensor(1)
    new, _ = reorder(t, "degree")
    for m in range(t.order):
        cnt = np.bincount(new.coords[m], minlength=t.sizes[m])
        assert np.all(np.diff(cnt) <= 0)


def test_cp_of_the_reordered_tensor_maps_back(tmp_path):
    t = _tensor(2, sizes=(15, 12, 10), nnz=400)
    new, perms = reorder(t, "lexi")
    rng = np.random.default_rng(3)
    init = [rng.random((s, 3)) for s in t.sizes]
    a = cp_als(t, 3, iters=4, init=init)
    b = cp_als(new, 3, iters=4, init=[f[p] for f, p in zip(init, perms)])
    for fa, fb, p in zip(a.factors, b.factors, perms):
        np.testing.assert_allclose(fb, fa[p], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(a.fits, b.fits, rtol=1e-9)
    paths = write_perms(perms, tmp_path / "r.tns")
    assert [p.name for p in paths] == ["r.mode0.perm", "r.mode1.perm", "r.mode2.perm"]
    assert all(np.array_equal(x, y) for x, y in zip(read_perms(tmp_path / "r.tns", 3), perms))
