"""The batched engine (`Wavefronts`) gives the event-driven engine's iteration times exactly,
for every schedule, shape and set of times, many at once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo.engine import SCHEDULES, ScheduleError, StageTimes, Wavefronts, build_plan, default_stages_per_rank, execute


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SCHEDULES), st.integers(1, 4), st.integers(1, 9), st.integers(1, 4), st.integers(0, 2**31),
       st.booleans())
def test_wavefronts_equal_the_event_driven_engine(name, ranks, m, K, seed, links):
    v = default_stages_per_rank(name)
    try:
        plan = build_plan(name, ranks, m, stages_per_rank=v)
    except ScheduleError:
        return  # a shape the schedule does not support
    S = plan.num_stages
    rng = np.random.default_rng(seed)
    f, b = rng.uniform(0, 1, (K, S)), rng.uniform(0, 2, (K, S))
    w = b * rng.uniform(0, 1, (K, S))
    cf = rng.uniform(0, 0.5, (K, S - 1)) if links else np.zeros((K, S - 1))
    cb = rng.uniform(0, 0.5, (K, S - 1)) if links else np.zeros((K, S - 1))
    got = Wavefronts(plan).iteration_times(f, b, w, cf, cb)
    want = [execute(plan, StageTimes.build(f[k], b[k], m, wgrad=w[k], comm={"fwd": cf[k], "bwd": cb[k]}))[0]
            for k in range(K)]
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_times_of_the_wrong_shape_are_refused():
    with pytest.raises(ValueError, match="shape"):
        Wavefronts(build_plan("1F1B", 2, 4)).iteration_times(np.ones((1, 3)), np.ones((1, 3)))
