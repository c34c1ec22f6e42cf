"""`dynmo tensor generate --memory-gb`: a tensor written block by block meets every target
exactly as the in-memory generator does (its counts are the same arrays), has no repeated
coordinate, in blocks of any size; a budget too small for the counts is one line and exit 2."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo.cli import main as dynmo_main
from dynmo.tensor import features, read_tns
from dynmo.tensor import stream
from dynmo.tensor.generate import Request, generate, plan

SHAPES = [(20, 30, 40), (6, 7, 8, 9), (50, 4, 60)]


@settings(max_examples=20, deadline=None)
@given(shape=st.sampled_from(SHAPES), density=st.sampled_from([0.05, 0.1]), cv=st.sampled_from([0.5, 0.8]),
       seed=st.integers(0, 1000), block=st.sampled_from([1, 37, 1 << 21]), values=st.sampled_from(["uniform", "ones"]),
       gz=st.booleans())
def test_blocks_meet_the_targets_the_whole_tensor_meets(tmp_path_factory, shape, density, cv, seed, block, values, gz):
    tmp = tmp_path_factory.mktemp("gen")
    req = Request(shape, density, fiber_density=0.3, cv_nnz_per_fiber=cv, seed=seed, values=values)
    plan(req)  # every combination here is one the sizes can hold
    old = stream.BLOCK_NNZ
    stream.BLOCK_NNZ = block
    try:
        path = tmp / ("t.tns.gz" if gz else "t.tns")
        stream.generate_to(req, path, 1.0, header=True)
    finally:
        stream.BLOCK_NNZ = old
    t = read_tns(path)  # (features below refuses a repeated coordinate)
    got, want = features(t).to_dict(), features(generate(req)).to_dict()
    for key in ("sizes", "nnz", "density"):
        assert got[key] == want[key], key
    # the generator's targets: the slices of the last two modes, the fibers of the last one
    m = len(shape) - 1
    for kind, modes in (("nnz_per_fiber", [m]), ("fibers_per_slice", [m - 1, m]), ("nnz_per_slice", [m - 1, m])):
        a = next(d for d in got[kind] if d["free_modes"] == modes)
        b = next(d for d in want[kind] if d["free_modes"] == modes)
        assert a == b, kind  # the counts are the same arrays: every statistic equal
    if values == "ones":
        assert np.all(t.values == 1)
    else:
        assert np.all((t.values > 0) & (t.values <= 1))
    assert sorted(p.name for p in tmp.iterdir()) == [path.name]


def test_a_budget_too_small_for_the_counts_is_one_line(tmp_path, capsys):
    out = tmp_path / "t.tns"
    assert dynmo_main(["tensor", "generate", "--sizes", "1000,1000,1000", "--density", "1e-4",
                       "--memory-gb", "0.01", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory-gb 0.01: the" in err[0] and "give more" in err[0], err
    assert not out.exists()
    assert dynmo_main(["tensor", "generate", "--sizes", "10,10,10", "--density", "0.1", "--memory-gb", "0",
                       "--out", str(out)]) == 2
    assert "give a positive number of GB" in capsys.readouterr().err
