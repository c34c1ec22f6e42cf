"""`dynmo tensor generate`: every target met within 2 % as the features read it back, on random
feasible requests; reproducible by seed; distinct coordinates in range; infeasible requests and
bad flags one line with exit 2; the fast .tns writer reads back exactly."""

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dynmo.cli import main as dynmo_main
from dynmo.tensor import features, from_coo, read_tns, write_tns
from dynmo.tensor.generate import GenerateError, Request, counts_with_cv, cv_range, distinct_per_group, generate, plan


def measured(t) -> dict:
    """The five targets as the features read them."""
    f = features(t)
    m = t.order
    last2 = (m - 2, m - 1)
    sl = next(d for d in f.of("nnz_per_slice") if d.free_modes == last2).stats()
    fps = next(d for d in f.of("fibers_per_slice") if d.free_modes == last2).stats()
    fib = f.of("nnz_per_fiber")[m - 1].stats()
    return {"density": f.density, "slice_density": sl["nz_density"], "fiber_density": fib["nz_density"],
            "cv_fibers_per_slice": fps["cv_onlynz"], "cv_nnz_per_fiber": fib["cv_onlynz"]}


@st.composite
def requests(draw):
    order = draw(st.integers(3, 5))
    top = {3: 60, 4: 25, 5: 14}[order]  # at most ~1M nonzeros, so an example takes under a second
    sizes = tuple(draw(st.lists(st.integers(10, top), min_size=order, max_size=order)))
    cells = math.prod(sizes)
    slices_all = math.prod(sizes[:-2])
    slice_density = draw(st.floats(0.3, 1.0))
    slices = max(1, round(slice_density * slices_all))
    per_slice = draw(st.floats(1.5, sizes[-2] / 2))
    fiber_density = slices * per_slice / (slices_all * sizes[-2])
    per_fiber = draw(st.floats(1.5, sizes[-1] / 3))
    density = fiber_density * per_fiber / sizes[-1]
    return Request(sizes, density, slice_density, fiber_density, draw(st.floats(0.3, 1.2)), draw(st.floats(0.3, 1.2)),
                   seed=draw(st.integers(0, 2**20)))


@settings(max_examples=40, deadline=None)
@given(requests())
def test_every_target_is_met_within_2_percent_when_feasible(req):
    try:
        p = plan(req)
    except GenerateError:
        assume(False)
    # the counts are whole, so a target is met at the nearest whole count; cvs only where the
    # counts are enough to shape a distribution
    assume(p.slices >= 30)
    t = generate(req)
    got = measured(t)
    assert t.nnz == p.nnz
    for k in ("density", "slice_density", "fiber_density"):
        assert got[k] == pytest.approx(getattr(req, k), rel=0.02, abs=0.51 / {"density": math.prod(req.sizes),
                                       "slice_density": p.slices_all, "fiber_density": p.fibers_all}[k])
    # a cv of whole counts moves in steps: one unit moved changes the sum of squares by 2 at least,
    # the cv by ~1 / (n mean^2 cv); within 2 % or half a step, whichever is larger
    for k, n, total in (("cv_fibers_per_slice", p.slices, p.fibers), ("cv_nnz_per_fiber", p.fibers, p.nnz)):
        want, mean = getattr(req, k), total / n
        step = 1 / (n * mean * mean * want)
        assert abs(got[k] - want) <= max(0.02 * want, 0.55 * step), (k, got[k], want, step)
    assert (t.coords >= 0).all() and (t.coords < np.array(req.sizes)[:, None]).all()


def test_same_seed_same_tensor_other_seed_other_tensor():
    req = Request((30, 40, 50), 0.01, 0.9, 0.1, 0.8, 0.6, seed=7)
    a, b = generate(req), generate(req)
    assert np.array_equal(a.coords, b.coords) and np.array_equal(a.values, b.values)
    c = generate(Request(**{**req.__dict__, "seed": 8}))
    assert not np.array_equal(a.coords, c.coords)
    from_coo(a.coords, a.values, a.sizes)  # no repeated coordinate


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 400), st.integers(1, 30), st.floats(0.0, 3.0), st.integers(0, 2**16))
def test_counts_are_whole_in_range_sum_exactly_and_reach_any_cv_in_range(n, hi, cv, seed):
    total = min(n * hi, n + seed % (n * hi))
    lo_cv, hi_cv = cv_range(n, total, hi)
    x = counts_with_cv(n, total, hi, cv, np.random.default_rng(seed))
    assert x.sum() == total and x.min() >= 1 and x.max() <= hi
    # whole counts reach a cv only in steps: moving one unit changes their sum of squares by an
    # even number, so the cv moves in steps of about 1 / (n * mean^2 * cv); with a mean of 2 or
    # more and 50 counts that step is small, and the cv lands within 2 % or one step of the target
    if n >= 50 and total >= 2 * n and lo_cv * 1.05 < cv < hi_cv * 0.9:
        step = 1.0 / (n * (total / n) ** 2 * cv)
        assert abs(x.std() / x.mean() - cv) <= max(0.02 * cv, step) * 1.01


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=40), st.integers(1, 25), st.integers(0, 2**16))
def test_distinct_per_group_draws_distinct_values_in_range(counts, size, seed):
    counts = np.minimum(np.array(counts), size)
    out = distinct_per_group(counts, size, np.random.default_rng(seed))
    assert out.size == counts.sum() and ((out >= 0) & (out < size)).all()
    for g, part in enumerate(np.split(out, np.cumsum(counts)[:-1])):
        assert len(set(part.tolist())) == counts[g]


@pytest.mark.parametrize("args,message", [
    (["--sizes", "10,10,10", "--density", "1.5"], "density = 1.5: a density must be in (0, 1]"),
    (["--sizes", "10,10", "--density", "0.1"], "needs at least 3 modes"),
    (["--sizes", "10,10,10", "--density", "0.001", "--fiber-density", "0.5"], "fewer than the 50 nonempty fibers"),
    (["--sizes", "10,10,10", "--density", "0.5", "--fiber-density", "0.01", "--slice-density", "0.1"],
     "do not fit in 1 fibers of 10"),
    (["--sizes", "10,10,10", "--density", "0.02", "--fiber-density", "0.1", "--cv-nnz-per-fiber", "9",
      "--cv-fibers-per-slice", "0"],
     "cv_nnz_per_fiber = 9.0 is beyond the"),
    (["--sizes", "10,10,10", "--density", "0.015", "--fiber-density", "0.1", "--cv-nnz-per-fiber", "0.1",
      "--cv-fibers-per-slice", "0"],
     "cv_nnz_per_fiber = 0.1 is below the 0.3333 that 10 whole counts summing to 15 must have"),
    (["--sizes", "10,10,10", "--density", "0.1", "--fiber-density", "0.05", "--slice-density", "0.9"],
     "fewer than the 9 nonempty slices"),
    (["--sizes", "10,10,10", "--density", "0.01", "--values", "gamma"], "values 'gamma': choose one of"),
    (["--sizes", "10,x,10", "--density", "0.01"], "--sizes '10,x,10': give whole numbers"),
    (["--sizes", "10,10,10", "--density", "0.01", "--out", "old.tns"], "--out old.tns exists; pass --overwrite"),
])
def test_infeasible_requests_and_bad_flags_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.tns").write_text("keep")
    argv = ["tensor", "generate", *args] + ([] if "--out" in args else ["--out", "new.tns"])
    assert dynmo_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "new.tns").exists() and (tmp_path / "old.tns").read_text() == "keep"


def test_generate_command_writes_a_tensor_that_reads_back(tmp_path, capsys):
    out = tmp_path / "g.tns.gz"
    assert dynmo_main(["tensor", "generate", "--sizes", "40,50,60", "--density", "0.002", "--fiber-density", "0.05",
                       "--values", "normal", "--out", str(out), "--header"]) == 0
    t = read_tns(out)
    assert t.sizes == (40, 50, 60) and t.nnz == 240
    ref = generate(Request((40, 50, 60), 0.002, 1.0, 0.05, values="normal"))
    assert np.array_equal(t.coords, ref.coords)
    assert np.allclose(t.values, ref.values, rtol=5e-7, atol=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from(["whole", "real", "tiny"]))
def test_the_writer_reads_back(tmp_path_factory, seed, kind):
    rng = np.random.default_rng(seed)
    sizes = tuple(int(s) for s in rng.integers(1, 5000, size=3))
    n = int(rng.integers(1, 200))
    coords = np.stack([rng.integers(0, s, n) for s in sizes])
    coords = np.unique(coords, axis=1)
    v = {"whole": rng.integers(-10**6, 10**6, coords.shape[1]).astype(float),
         "real": rng.standard_normal(coords.shape[1]) * 10.0 ** rng.integers(-30, 30, coords.shape[1]),
         "tiny": rng.random(coords.shape[1])}[kind]
    t = from_coo(coords, v, sizes)
    path = tmp_path_factory.mktemp("w") / "t.tns"
    write_tns(t, path)
    back = read_tns(path, sizes=sizes)
    assert np.array_equal(back.coords, t.coords)
    if kind == "whole":
        assert np.array_equal(back.values, v)
    else:
        assert np.allclose(back.values, v, rtol=5.1e-7, atol=0)


# ---- CP-ALS -------------------------------------------------------------------------------------


def test_mttkrp_and_fit_equal_the_dense_computation():
    from dynmo.tensor.cp import cp_als, mttkrp

    rng = np.random.default_rng(0)
    sizes = (6, 5, 4)
    dense = np.where(rng.random(sizes) < 0.4, rng.standard_normal(sizes), 0.0)
    nz = np.nonzero(dense)
    t = from_coo(np.array(nz), dense[nz], sizes)
    factors = [rng.random((s, 3)) for s in sizes]
    want = np.einsum("ijk,jr,kr->ir", dense, factors[1], factors[2])
    assert np.allclose(mttkrp(t, factors, 0, t.values), want)
    res = cp_als(t, rank=3, iters=5)
    approx = np.einsum("r,ir,jr,kr->ijk", res.weights, *res.factors)
    assert res.fit == pytest.approx(1 - np.linalg.norm(dense - approx) / np.linalg.norm(dense), abs=1e-9)
    assert len(res.seconds) == 5


def test_cp_recovers_a_low_rank_tensor_and_the_command_reports_it(tmp_path, capsys):
    from dynmo.tensor.cp import cp_als

    rng = np.random.default_rng(1)
    a, b, c = (rng.random((s, 2)) + 0.1 for s in (8, 7, 6))
    dense = np.einsum("ir,jr,kr->ijk", a, b, c)  # rank 2, every entry nonzero
    nz = np.nonzero(dense)
    t = from_coo(np.array(nz), dense[nz], dense.shape)
    assert cp_als(t, rank=2, iters=200, tol=1e-12).fit > 0.999
    write_tns(t, tmp_path / "t.tns")
    assert dynmo_main(["tensor", "cp", str(tmp_path / "t.tns"), "--rank", "2", "--iters", "3",
                       "--json", str(tmp_path / "cp.json")]) == 0
    assert "s per iteration" in capsys.readouterr().out
    assert dynmo_main(["tensor", "cp", str(tmp_path / "t.tns"), "--rank", "0"]) == 2


# ---- siblings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_a_sibling_keeps_every_modes_spread_exactly_or_to_the_solver(tmp_path, scale):
    from dynmo.tensor.sibling import sibling, spread_of

    real = read_tns(Path(__file__).parent / "data" / "featensor" / "skew4-10k.tns.gz")
    want = spread_of(real)
    t, dropped = sibling(want, scale, seed=3)
    got = spread_of(t)
    # this tensor packs its heaviest slices of every mode into one corner: a few repeats are dropped
    assert t.nnz + dropped == round(real.nnz * scale) and dropped <= 0.001 * t.nnz
    from_coo(t.coords, t.values, t.sizes)  # distinct coordinates, in range
    for w, g in zip(want.modes, got.modes):
        assert g.size == round(w.size * scale)
        assert g.nonempty == pytest.approx(min(g.size, round(w.nonempty * scale)), abs=dropped)
        assert g.cv == pytest.approx(w.cv, rel=0.02)


def test_sibling_from_a_features_document_and_the_command(tmp_path, capsys):
    real = tmp_path / "r.tns"
    write_tns(generate(Request((60, 70, 80), 0.004, 0.9, 0.05, 0.8, 0.7, seed=2)), real)
    assert dynmo_main(["tensor", "features", str(real), "--json", str(tmp_path / "f.json"), "--quiet"]) == 0
    for src in (real, tmp_path / "f.json"):
        out = tmp_path / f"s-{src.suffix}.tns"
        assert dynmo_main(["tensor", "generate", "--like", str(src), "--scale", "2", "--out", str(out)]) == 0
        assert read_tns(out).nnz == 2 * read_tns(real).nnz
    assert dynmo_main(["tensor", "generate", "--like", str(real), "--density", "0.1", "--out", str(tmp_path / "x")]) == 2
    assert "leave out --sizes and --density" in capsys.readouterr().err
