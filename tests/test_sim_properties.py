"""Properties of the simulator on many random pipelines (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo.sim import StageTimes, build_plan, lower_bound, simulate_plan

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def pipelines(draw):
    name = draw(st.sampled_from(
        ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]))
    p = draw(st.integers(1, 4))
    v = 1 if name in ("GPipe", "1F1B") else (2 if name == "ZBVZeroBubble" else draw(st.integers(1, 3)))
    m = draw(st.integers(1, 9))
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // p)
        m = rounds * (m // rounds)  # torch needs m % rounds == 0
    S = p * v
    t = st.floats(0.0, 5.0, allow_nan=False)
    seeds = draw(st.lists(t, min_size=3 * S * m + 2 * S + S, max_size=3 * S * m + 2 * S + S))
    a = np.asarray(seeds)
    fwd = a[: S * m].reshape(S, m)
    bwd = a[S * m: 2 * S * m].reshape(S, m)
    wgrad = np.minimum(a[2 * S * m: 3 * S * m].reshape(S, m), bwd)
    rest = a[3 * S * m:]
    comm = {"fwd": rest[: S - 1] / 5, "bwd": rest[S - 1: 2 * S - 2] / 5}
    allreduce = rest[2 * S - 2: 3 * S - 2] if draw(st.booleans()) else 0.0
    mode = draw(st.sampled_from(["overlap", "blocking"]))
    plan = build_plan(name, p, m, stages_per_rank=v)
    times = StageTimes.build(fwd, bwd, m, wgrad=wgrad, comm=comm, allreduce=allreduce)
    return plan, times, mode


@SETTINGS
@given(pipelines())
def test_iteration_time_bounds_and_accounting(case):
    plan, times, mode = case
    r = simulate_plan(plan, times, allreduce_mode=mode)
    T = r.iteration_time
    assert T >= max(r.busy_s) - 1e-9
    assert T >= lower_bound(times, plan) - 1e-9
    assert T >= r.compute_time - 1e-9
    for busy, idle in zip(r.busy_s, r.idle_s):
        assert abs(busy + idle - T) <= 1e-9 * max(1.0, T)
        assert idle >= -1e-9
    assert 0.0 <= r.bubble_ratio <= 1.0 + 1e-12
    assert abs(r.bubble_ratio - r.bubble_inherent - r.bubble_imbalance) < 1e-12


@SETTINGS
@given(pipelines(), st.integers(0, 10**6), st.floats(0.01, 3.0), st.sampled_from(["eager", "rendezvous"]))
def test_monotone_in_every_op_time(case, pick, delta, p2p):
    """Making any one op or transfer slower never makes the iteration faster."""
    plan, times, mode = case
    base = simulate_plan(plan, times, allreduce_mode=mode, p2p=p2p, split_bubble=False).iteration_time
    f, b, w = times.fwd.copy(), times.bwd.copy(), times.wgrad.copy()
    cf, cb, ar = times.comm_fwd.copy(), times.comm_bwd.copy(), times.allreduce.copy()
    S, m = f.shape
    which = pick % 6
    i = (pick // 6) % (S * m)
    if which == 0:
        f.flat[i] += delta
    elif which == 1:  # the B op, or the I op of split schedules (wgrad unchanged)
        b.flat[i] += delta
    elif which == 2:  # the W op: weight gradient and hence bwd both grow
        w.flat[i] += delta
        b.flat[i] += delta
    elif which == 3 and S > 1:
        cf[i % (S - 1)] += delta
    elif which == 4 and S > 1:
        cb[i % (S - 1)] += delta
    else:
        ar[i % S] += delta
    slower = StageTimes(f, b, w, cf, cb, ar)
    again = simulate_plan(plan, slower, allreduce_mode=mode, p2p=p2p, split_bubble=False)
    assert again.iteration_time >= base - 1e-9


@SETTINGS
@given(pipelines())
def test_rendezvous_transfers_are_never_faster_than_eager(case):
    plan, times, mode = case
    eager = simulate_plan(plan, times, allreduce_mode=mode, split_bubble=False)
    rdv = simulate_plan(plan, times, allreduce_mode=mode, p2p="rendezvous", split_bubble=False)
    assert rdv.iteration_time >= eager.iteration_time - 1e-9


@SETTINGS
@given(pipelines())
def test_balanced_pipeline_has_no_imbalance_bubble(case):
    plan, times, mode = case
    r = simulate_plan(plan, times.balanced(), allreduce_mode=mode)
    assert abs(r.bubble_imbalance) < 1e-9


@SETTINGS
@given(pipelines())
def test_trace_respects_dependencies(case):
    plan, times, mode = case
    r = simulate_plan(plan, times, allreduce_mode=mode, split_bubble=False, keep_trace=True)
    S = plan.num_stages
    span = {}
    for ops in r.trace:
        prev = 0.0
        for name, a, b in ops:
            assert a >= prev - 1e-9
            prev = b
            span[name] = (a, b)
    owner = plan.stage_rank
    bk = "I" if plan.split_backward else "B"
    for s in range(S):
        for k in range(plan.microbatches):
            if s > 0:
                link = times.comm_fwd[s - 1] if owner[s] != owner[s - 1] else 0.0
                assert span[f"{s}F{k}"][0] >= span[f"{s - 1}F{k}"][1] + link - 1e-9
            if s < S - 1:
                link = times.comm_bwd[s] if owner[s] != owner[s + 1] else 0.0
                assert span[f"{s}{bk}{k}"][0] >= span[f"{s + 1}{bk}{k}"][1] + link - 1e-9
            assert span[f"{s}{bk}{k}"][0] >= span[f"{s}F{k}"][1] - 1e-9
            if plan.split_backward:
                assert span[f"{s}W{k}"][0] >= span[f"{s}I{k}"][1] - 1e-9


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pipelines(), st.integers(0, 2**31), st.sampled_from(["eager", "rendezvous"]))
def test_link_delay_is_added_to_both_directions_of_its_link(case, seed, p2p):
    """A delay d_j on link j is the same as d_j more transfer time on it, activation and
    gradient alike; it never makes the iteration faster."""
    plan, times, mode = case
    S = plan.num_stages
    d = np.random.default_rng(seed).uniform(0.0, 1.0, max(S - 1, 0))
    delayed = StageTimes.build(times.fwd, times.bwd, wgrad=times.wgrad, allreduce=times.allreduce,
                               comm={"fwd": times.comm_fwd, "bwd": times.comm_bwd}, link_delay=d)
    moved = StageTimes.build(times.fwd, times.bwd, wgrad=times.wgrad, allreduce=times.allreduce,
                             comm={"fwd": times.comm_fwd + d, "bwd": times.comm_bwd + d})
    a = simulate_plan(plan, delayed, allreduce_mode=mode, p2p=p2p, split_bubble=False).iteration_time
    b = simulate_plan(plan, moved, allreduce_mode=mode, p2p=p2p, split_bubble=False).iteration_time
    base = simulate_plan(plan, times, allreduce_mode=mode, p2p=p2p, split_bubble=False).iteration_time
    assert a == b
    assert a >= base - 1e-9
