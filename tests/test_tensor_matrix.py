"""A pruned weight's features (dynmo.tensor.matrix) are the order-2 tensor features, and the
kernel-time model recovers the times of a known cost model."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo.tensor import features, from_coo
from dynmo.tensor.matrix import MATRIX_STATS, KernelModel, KernelSample, matrix_features


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.floats(0.05, 1.0), st.integers(0, 2**16))
def test_matrix_features_are_the_fibers_of_the_order_2_tensor(rows, cols, density, seed):
    mask = np.random.default_rng(seed).random((rows, cols)) < density
    if not mask.any():
        mask[0, 0] = True
    f = matrix_features(mask.sum(1), mask.sum(0))
    t = features(from_coo(np.array(np.nonzero(mask)), None, sizes=(rows, cols)))
    per_row, per_col = t.of("nnz_per_fiber")[1].stats(), t.of("nnz_per_fiber")[0].stats()  # free mode 1: a row
    for k in MATRIX_STATS:
        assert f["rows"][k] == pytest.approx(per_row[k]) and f["cols"][k] == pytest.approx(per_col[k])


def test_kernel_model_recovers_a_known_cost_model_and_waits_for_enough_samples():
    rng = np.random.default_rng(0)
    truth = {"dense": np.array([1e-4, 2e-11]), "csr": np.array([3e-4, 5e-10, 0.0, 4e-11])}
    model = KernelModel()
    shapes = [(768, 256), (256, 256), (1024, 256), (256, 1024)]
    samples = []
    for k in range(12):
        r, c = shapes[k % 4]
        nnz = int(r * c * rng.uniform(0.05, 0.6))
        s = KernelSample(r, c, nnz, min(c, nnz // r + int(rng.integers(1, 30))), 512)
        samples.append(KernelSample(**{**s.__dict__, "seconds": {k2: float(s.terms(k2) @ v) for k2, v in truth.items()}}))
    model.add(samples[:3])
    assert not model.ready("dense") and not model.ready("csr")
    model.add(samples[3:])
    test = KernelSample(512, 512, 20_000, 80, 512)
    for kernel, coef in truth.items():
        assert model.predict(test, kernel) == pytest.approx(float(test.terms(kernel) @ coef), rel=1e-3)
        assert (model.coef[kernel] >= 0).all()
