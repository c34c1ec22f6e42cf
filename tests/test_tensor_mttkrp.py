"""The compiled MTTKRP kernels equal a brute-force reference, in every format, mode and dtype,
and give the same bits for 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from dynmo.tensor.coo import from_coo  # noqa: E402
from dynmo.tensor.kernels import FORMATS, convert, mttkrp, set_threads  # noqa: E402

LETTERS = "abcde"


def _random(sizes, density, seed, empty_every=3):
    """A random tensor with some empty slices in every mode (every `empty_every`-th index unused)."""
    rng = np.random.default_rng(seed)
    dense = rng.random(sizes) * (rng.random(sizes) < density)
    for m, s in enumerate(sizes):
        sl = [slice(None)] * len(sizes)
        sl[m] = slice(1, s, empty_every)
        dense[tuple(sl)] = 0
    nz = np.nonzero(dense)
    if nz[0].size == 0:
        dense[(0,) * len(sizes)] = 1.0
        nz = np.nonzero(dense)
    return dense, from_coo(np.vstack(nz), dense[nz], sizes)


def _einsum(dense, factors, mode):
    n = dense.ndim
    ins = [LETTERS[k] + "r" for k in range(n) if k != mode]
    return np.einsum(f"{LETTERS[:n]},{','.join(ins)}->{LETTERS[mode]}r", dense, *[factors[k] for k in range(n) if k != mode])


def _brute(t, factors, mode):
    """Sum over the nonzeros one at a time (np.add.at): the reference for tensors too large to densify."""
    prod = t.values[:, None] * np.ones((1, factors[0].shape[1]))
    for k, a in enumerate(factors):
        if k != mode:
            prod = prod * a[t.coords[k]]
    out = np.zeros((t.sizes[mode], factors[0].shape[1]))
    np.add.at(out, t.coords[mode], prod)
    return out


CASES = [((6, 7, 5), 0.3, 1), ((9, 4, 6, 5), 0.15, 2), ((4, 5, 3, 6, 4), 0.1, 3), ((1, 8, 9), 0.5, 4),
         ((5, 5, 5), 0.02, 5)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("sizes,density,seed", CASES)
def test_equals_einsum_float64(fmt, sizes, density, seed):
    dense, t = _random(sizes, density, seed)
    rng = np.random.default_rng(seed + 100)
    factors = [rng.standard_normal((s, 4)) for s in sizes]
    lay = convert(t, fmt, "float64")
    for mode in range(len(sizes)):
        ref = _einsum(dense, factors, mode)
        np.testing.assert_allclose(mttkrp(lay, factors, mode), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fmt", FORMATS)
def test_equals_einsum_float32(fmt):
    dense, t = _random((7, 6, 8, 5), 0.2, 11)
    rng = np.random.default_rng(12)
    factors = [rng.random((s, 3)) for s in dense.shape]
    lay = convert(t, fmt, "float32")
    for mode in range(dense.ndim):
        got = mttkrp(lay, factors, mode)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, _einsum(dense, factors, mode), rtol=1e-5, atol=1e-5)


def _larger(order, seed):
    """Several HiCOO blocks and CSF tasks per mode; a skewed mode (most nonzeros in few slices)."""
    rng = np.random.default_rng(seed)
    sizes = (700, 300, 520, 90, 260)[:order]
    nnz = 20_000
    coords = [rng.integers(0, s, nnz) for s in sizes]
    coords[0] = np.minimum(rng.zipf(1.6, nnz) - 1, sizes[0] - 1)
    key = np.unique(np.ravel_multi_index(coords, sizes))
    c = np.vstack(np.unravel_index(key, sizes))
    return from_coo(c, rng.standard_normal(c.shape[1]), sizes)


@pytest.mark.parametrize("order", [3, 4, 5])
def test_larger_tensors_equal_brute_force(order):
    t = _larger(order, order)
    rng = np.random.default_rng(order)
    factors = [rng.standard_normal((s, 16)) for s in t.sizes]
    refs = [_brute(t, factors, m) for m in range(order)]
    for fmt in FORMATS:
        lay = convert(t, fmt)
        for m in range(order):
            np.testing.assert_allclose(mttkrp(lay, factors, m), refs[m], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_same_bits_for_one_and_two_threads(dtype):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba offers one thread here")
    t = _larger(4, 7)
    rng = np.random.default_rng(7)
    factors = [rng.standard_normal((s, 16)) for s in t.sizes]
    try:
        for fmt in FORMATS:
            lay = convert(t, fmt, dtype)
            for m in range(t.order):
                assert set_threads(1) == 1
                one = mttkrp(lay, factors, m)
                assert set_threads(2) == 2
                two = mttkrp(lay, factors, m)
                assert np.array_equal(one, two), (fmt, m)
    finally:
        set_threads(None)


def test_one_nonzero_and_unknown_format():
    t = from_coo(np.array([[2], [0], [4]]), [3.0], (3, 2, 5))
    factors = [np.full((s, 2), 2.0) for s in t.sizes]
    for fmt in FORMATS:
        m = mttkrp(convert(t, fmt), factors, 0)
        assert m.tolist() == [[0, 0], [0, 0], [12, 12]]
    with pytest.raises(ValueError, match="format 'dense'"):
        convert(t, "dense")


@pytest.mark.parametrize("order", [3, 4, 5])
def test_csf_leaf_mode_from_a_tiled_tree_equals_its_own_tree(order):
    """A mode with long fibers is summed at the leaves of another mode's tree, cut into tiles of its rows
    (a task each); it equals the brute force and the mode's own tree, for 1 and 2 threads alike."""
    import numba

    from dynmo.tensor.kernels import csf

    rng = np.random.default_rng(order)
    sizes = (40, 60, 30, 20, 900)[-order:]
    coords = [rng.integers(0, s, 30_000) for s in sizes[:-1]]
    coords = [np.repeat(c[:300], 100) for c in coords] + [rng.integers(0, sizes[-1], 30_000)]  # long fibers
    key = np.unique(np.ravel_multi_index(coords, sizes))
    t = from_coo(np.vstack(np.unravel_index(key, sizes)), rng.standard_normal(key.size), sizes)
    lay = convert(t, "csf")
    last = order - 1
    assert lay.leaf[last] and lay.trees[last].modes[-1] == last and lay.trees[last].bounds.size > 2
    factors = [rng.standard_normal((s, 16)) for s in sizes]
    via_leaf = mttkrp(lay, factors, last)
    np.testing.assert_allclose(via_leaf, _brute(t, factors, last), rtol=1e-10, atol=1e-10)
    own = csf.CSF.__new__(csf.CSF)
    own.sizes, own.order, own.leaf, own.dtype = lay.sizes, order, [False] * order, np.float64
    own.trees = [csf.Tree(t.coords, t.values, sizes, m, np.float64) for m in range(order)]
    np.testing.assert_allclose(mttkrp(own, factors, last), via_leaf, rtol=1e-12, atol=1e-12)
    if numba.config.NUMBA_NUM_THREADS >= 2:
        try:
            set_threads(1)
            one = mttkrp(lay, factors, last)
            set_threads(2)
            assert np.array_equal(one, mttkrp(lay, factors, last))
        finally:
            set_threads(None)


PREFETCHED = r'''
import sys
import numpy as np
from dynmo.tensor.kernels import common, convert, mttkrp
sys.path.insert(0, sys.argv[1])
from tests.test_tensor_mttkrp import CASES, _einsum, _random

common.PREFETCH_BYTES = -1  # every mode's rows asked for ahead, however few
for ahead in (1, 4, 64):  # 64: past the last fiber of most of these tensors
    common.PREFETCH_AHEAD = ahead
    for sizes, density, seed in CASES:
        dense, t = _random(sizes, density, seed)
        rng = np.random.default_rng(seed + 100)
        factors = [rng.standard_normal((s, 4)) for s in sizes]
        lay = convert(t, "csf", "float64")
        for mode in range(len(sizes)):
            np.testing.assert_allclose(mttkrp(lay, factors, mode), _einsum(dense, factors, mode), rtol=1e-12, atol=1e-12)
print("ok")
'''


def test_csf_asking_for_rows_ahead_reads_only_its_own_arrays_and_changes_no_value(tmp_path):
    """The root kernel's prefetch (on where the factor rows exceed the cache) looks `ahead` fibers
    on: compiled here with numba's bounds checks and forced on for small tensors, every index it
    reads is inside the tree and the results still equal einsum."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", PREFETCHED, str(ROOT)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
