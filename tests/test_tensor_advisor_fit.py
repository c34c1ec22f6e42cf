"""The advisor's fit: it learns a choice the features decide, and falls back to the best fixed choice
when they decide nothing (no kernel is timed: the labels are made up)."""

from __future__ import annotations

import numpy as np

from dynmo.tensor.advise_fit import candidates, evaluate, fit


def _inputs(rng, nnz: int) -> dict:
    order = int(rng.integers(3, 6))
    modes = []
    for _ in range(order):
        size = int(rng.integers(50, 5000))
        modes.append({"size": size, "nz_cnt": int(rng.integers(1, size + 1)), "cv_onlynz": float(rng.random() * 2),
                      "max": int(rng.integers(1, nnz)),
                      "heavy_first": float(rng.uniform(-0.2, 1.0))})
    return {"order": order, "nnz": nnz, "modes": modes}


def _rows(seed: int, n: int, rule) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        nnz = int(10 ** rng.uniform(4, 7))
        secs = {c: nnz * 1e-8 * rng.uniform(1.5, 3.0) for c in candidates()}
        rows.append({"file": f"t{i}.tns", "inputs": _inputs(rng, nnz), "seconds": rule(nnz, secs)})
    return rows


def _big_hicoo_small_csf(nnz, secs):
    fast = ("hicoo", "none") if nnz > 10**5.5 else ("csf", "none")
    secs[fast] = nnz * 1e-8
    return secs


def test_learns_a_choice_the_features_decide():
    model = fit(_rows(1, 40, _big_hicoo_small_csf), rank=16, threads=2)
    held = evaluate(model, _rows(2, 20, _big_hicoo_small_csf))
    exact = sum(r["ratio"] == 1.0 for r in held["tensors"])
    assert exact >= 15  # wrong only near the threshold, where a straight line cannot follow the step
    assert held["geomean"] < 1.2 < held["best_fixed_geomean"]


def test_falls_back_to_the_best_fixed_choice_when_features_decide_nothing():
    def coo_lexi(nnz, secs):
        secs[("coo", "lexi")] = nnz * 1e-8
        return secs

    model = fit(_rows(3, 30, coo_lexi), rank=16, threads=2)
    assert model["ridge"] > 0 and 1.0 <= model["leave_one_out_geomean"] < 1.01
    held = evaluate(model, _rows(4, 15, coo_lexi))
    assert held["geomean"] == held["best_fixed_geomean"] == 1.0 and held["best_fixed"] == "coo+lexi"


def test_a_tensor_beyond_the_training_range_is_taken_at_its_edge():
    from dynmo.tensor.advise import predict, vector

    rows = _rows(5, 30, _big_hicoo_small_csf)
    model = fit(rows, rank=16, threads=2)
    big = max(rows, key=lambda r: r["inputs"]["nnz"])["inputs"]
    huge = dict(big, nnz=big["nnz"] * 1000)
    x_big, x_huge = vector(big), vector(huge)
    edge = np.clip(x_huge, model["low"], model["high"])
    assert np.all(edge <= np.array(model["high"])) and not np.array_equal(x_huge, edge)
    assert predict(model, x_huge) == predict(model, edge)
    assert min(predict(model, x_huge), key=lambda c: c["predicted_seconds"])["format"] == "hicoo"
    assert x_big[0] < x_huge[0]
