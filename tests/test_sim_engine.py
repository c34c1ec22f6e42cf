"""Analytic checks of the pipeline simulator: known closed forms for balanced pipelines."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dynmo.sim import (
    Op,
    Plan,
    ScheduleError,
    SimInputError,
    StageTimes,
    build_plan,
    predict_iteration_time,
    ring_allreduce_time,
    simulate,
    simulate_plan,
)

TF, TB = 1.0, 2.0


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 2), (2, 8), (4, 4), (4, 16), (6, 9), (8, 8)])
def test_balanced_single_stage_closed_form(schedule, p, m):
    r = simulate([TF] * p, [TB] * p, schedule, m)
    assert r.iteration_time == pytest.approx((m + p - 1) * (TF + TB))
    assert r.bubble_ratio == pytest.approx((p - 1) / (m + p - 1))
    assert r.bubble_inherent == pytest.approx(r.bubble_ratio)
    assert r.bubble_imbalance == pytest.approx(0.0, abs=1e-12)
    for busy, idle in zip(r.busy_s, r.idle_s):
        assert busy == pytest.approx(m * (TF + TB))
        assert busy + idle == pytest.approx(r.iteration_time)


@pytest.mark.parametrize("p,m,c", [(2, 4, 0.25), (4, 8, 0.1), (5, 3, 1.0)])
def test_gpipe_with_link_time(p, m, c):
    # fill: (p-1)(f+c), the last stage streams m forwards and m backwards, drain: (p-1)(b+c)
    r = simulate([TF] * p, [TB] * p, "GPipe", m, comm=c)
    assert r.iteration_time == pytest.approx((m + p - 1) * (TF + TB) + 2 * (p - 1) * c)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS"])
@pytest.mark.parametrize("p,v,k", [(2, 2, 1), (2, 3, 2), (3, 2, 3), (4, 2, 1), (4, 3, 2)])
def test_balanced_interleaved_bubble_is_one_chunk_round_trip(schedule, p, v, k):
    # with m a multiple of p, v chunks per rank shrink the bubble to (p-1)(f+b) of one chunk
    m = k * p
    r = simulate([TF] * (p * v), [TB] * (p * v), schedule, m, stages_per_rank=v)
    assert r.iteration_time == pytest.approx(v * m * (TF + TB) + (p - 1) * (TF + TB))


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble"])
@pytest.mark.parametrize("p,k", [(2, 1), (2, 3), (3, 2), (4, 2)])
def test_zero_bubble_with_equal_f_i_w(schedule, p, k):
    # F = I = W = 1: the weight passes fill the drain; only (p-1) F of fill remains,
    # a third of 1F1B's (p-1)(F+I+W) bubble (the ZB-H1 result)
    m = max(k * p, 2 * p - 1) if schedule == "ZBVZeroBubble" else k * p
    S = 2 * p
    r = simulate([1.0] * S, [2.0] * S, schedule, m, wgrad=[1.0] * S, stages_per_rank=2)
    assert r.iteration_time == pytest.approx(2 * m * 3.0 + (p - 1) * 1.0)
    one_f_one_b = simulate([1.0] * S, [2.0] * S, "Interleaved1F1B", m, stages_per_rank=2)
    assert r.iteration_time < one_f_one_b.iteration_time


@pytest.mark.parametrize("schedule,v", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2),
                                         ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)])
def test_imbalance_part_is_zero_when_balanced_and_positive_with_a_slow_stage(schedule, v):
    S, m = 4 * v, 8
    even = simulate([TF] * S, [TB] * S, schedule, m, stages_per_rank=v)
    assert even.bubble_imbalance == pytest.approx(0.0, abs=1e-12)
    slow = simulate([TF] * (S - 1) + [2 * TF], [TB] * (S - 1) + [2 * TB], schedule, m,
                    stages_per_rank=v)
    assert slow.bubble_imbalance > 0.01
    assert slow.bubble_ratio == pytest.approx(slow.bubble_inherent + slow.bubble_imbalance)
    assert slow.iteration_time > slow.balanced_iteration_time


def test_slow_stage_sets_the_1f1b_steady_state():
    # the slowest stage (2) never waits: its inputs arrive after the stages before it
    # forward once, then it works m (f+b), then the gradient drains through stages 1, 0
    f, b, m = [1.0, 1.0, 3.0, 1.0], [2.0, 2.0, 6.0, 2.0], 16
    r = simulate(f, b, "1F1B", m)
    assert r.iteration_time == pytest.approx(f[0] + f[1] + m * (f[2] + b[2]) + b[1] + b[0])
    assert r.idle_s[2] == pytest.approx(f[0] + f[1] + b[1] + b[0])


def test_data_parallel_allreduce_overlaps_except_on_the_last_stage_to_finish():
    p, m, dp = 4, 8, 8
    ar = ring_allreduce_time([4e8] * p, dp, bandwidth=1e9, latency=0.01)
    assert ar[0] == pytest.approx(2 * 7 / 8 * 0.4 + 0.01)
    base = simulate([TF] * p, [TB] * p, "1F1B", m)
    r = simulate([TF] * p, [TB] * p, "1F1B", m, dp=dp, grad_bytes=[4e8] * p, bandwidth=1e9, latency=0.01)
    # stage 0 runs the last backward of a 1F1B step; its all-reduce is fully exposed
    assert r.iteration_time == pytest.approx(base.iteration_time + ar[0])
    assert r.compute_time == pytest.approx(base.iteration_time)
    assert r.workers == p * dp
    one = simulate([TF] * p, [TB] * p, "1F1B", m, dp=1, grad_bytes=[4e8] * p, bandwidth=1e9)
    assert one.iteration_time == pytest.approx(base.iteration_time)


def test_blocking_allreduce_delays_later_compute_on_multi_stage_ranks():
    S, m = 4, 4
    kw = dict(stages_per_rank=2, dp=2, allreduce=[1.0] * S)
    ov = simulate([TF] * S, [TB] * S, "Interleaved1F1B", m, allreduce_mode="overlap", **kw)
    bl = simulate([TF] * S, [TB] * S, "Interleaved1F1B", m, allreduce_mode="blocking", **kw)
    assert bl.iteration_time >= ov.iteration_time
    assert bl.iteration_time > bl.compute_time - 1e-12


def test_predict_iteration_time_is_the_simulated_iteration_time():
    f, b = [0.011, 0.019], [0.023, 0.041]
    assert predict_iteration_time(f, b, "1F1B", 8) == simulate(f, b, "1F1B", 8).iteration_time
    # per-microbatch measurements work too
    fm = [[0.01] * 4, [0.02] * 4]
    # GPipe: stage 1 (the slower) streams 4 F then 4 B; stage 0 adds one F before, one B after
    assert predict_iteration_time(fm, fm, "GPipe", 4) == pytest.approx(0.01 + 8 * 0.02 + 0.01)


def test_trace_respects_order_and_dependencies():
    r = simulate([1.0, 2.0, 1.5], [2.0, 1.0, 3.0], "1F1B", 5, comm=0.3, keep_trace=True)
    plan = build_plan("1F1B", 3, 5)
    end = {}
    for rank, ops in enumerate(r.trace):
        assert [o for o, _, _ in ops] == [str(op) for op in plan.rank_ops[rank]]
        t = 0.0
        for name, a, b in ops:
            assert a >= t - 1e-12 and b >= a
            t = b
            end[name] = (a, b)
        assert sum(b - a for _, a, b in ops) == pytest.approx(r.busy_s[rank])
    for k in range(5):
        for s in (1, 2):
            assert end[f"{s}F{k}"][0] >= end[f"{s - 1}F{k}"][1] + 0.3 - 1e-12
        for s in (0, 1):
            assert end[f"{s}B{k}"][0] >= end[f"{s + 1}B{k}"][1] + 0.3 - 1e-12


def test_deadlocking_order_is_reported():
    # rank 0 waits for a backward that rank 1 only runs after a forward rank 0 never sent
    plan = Plan("custom", 2, 2, 1, (0, 1),
                ((Op("B", 0, 0), Op("F", 0, 0)), (Op("F", 1, 0), Op("B", 1, 0))), False)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_plan(plan, StageTimes.build([1.0, 1.0], [1.0, 1.0], 1))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fwd=[1, 1], bwd=[1], microbatches=2), "stages"),
        (dict(fwd=[1, -1], bwd=[1, 1], microbatches=2), ">= 0"),
        (dict(fwd=[1, 1], bwd=[1, 1]), "microbatches must be given"),
        (dict(fwd=[1, 1], bwd=[1, 1], microbatches=2, wgrad=[2, 2]), "<= bwd"),
        (dict(fwd=[1, 1], bwd=[1, 1], microbatches=2, comm=[1, 2]), "link"),
        (dict(fwd=[1, 1, 1], bwd=[1, 1, 1], microbatches=2, schedule="Interleaved1F1B"), "multiple of 2"),
    ],
)
def test_bad_input_explains_itself(kwargs, match):
    with pytest.raises((SimInputError, ScheduleError), match=match):
        simulate(**kwargs)


def test_bubble_ratio_is_spec_definition():
    r = simulate([1.0, 2.0], [1.0, 2.0], "GPipe", 3)
    workers = len(r.busy_s)
    assert r.bubble_ratio == pytest.approx(sum(r.idle_s) / (workers * r.iteration_time))
    assert math.isclose(sum(r.stage_busy_s), sum(r.busy_s))


def test_stage_times_from_layer_times_and_layout():
    from dynmo.layout import Layout
    from dynmo.sim import stage_times

    layout = Layout((0, 2, 5, 6))
    assert stage_times([1, 2, 3, 4, 5, 6], layout).tolist() == layout.stage_loads([1, 2, 3, 4, 5, 6])
    per_mb = stage_times([[1, 2]] * 6, layout)
    assert per_mb.tolist() == [[2, 4], [3, 6], [1, 2]]
    assert stage_times([2] * 6, layout, speeds=[1, 2, 1]).tolist() == [4, 3, 2]


@pytest.mark.parametrize("m,c", [(1, 0.5), (4, 0.1), (8, 0.25)])
def test_gpipe_rendezvous_transfers_do_not_overlap_the_receivers_previous_op(m, c):
    # 2 ranks: each transfer starts only when the receiver finished its previous op, so
    # every one of the m forward and m backward transfers is exposed on the receiver
    r = simulate([TF, TF], [TB, TB], "GPipe", m, comm=c, p2p="rendezvous")
    assert r.iteration_time == pytest.approx((m + 1) * (TF + TB) + 2 * m * c)
    eager = simulate([TF, TF], [TB, TB], "GPipe", m, comm=c)
    assert eager.iteration_time == pytest.approx((m + 1) * (TF + TB) + 2 * c)
    assert predict_iteration_time([TF, TF], [TB, TB], "GPipe", m, comm=c, p2p="rendezvous") == r.iteration_time


# ---- injected link delay ------------------------------------------------------------------

# iteration and balanced-iteration times of the engine before link delays existed (float.hex),
# for seeded random pipelines with per-link transfer times
BEFORE_LINK_DELAY = {
    ("1F1B", "eager"): ("0x1.59814244e4a38p-2", "0x1.288a66e9ba33cp-2"),
    ("1F1B", "rendezvous"): ("0x1.5e8e83f67df35p-2", "0x1.2b401245dcfc2p-2"),
    ("GPipe", "eager"): ("0x1.a55b94f5f9047p-3", "0x1.85dc7d83560d1p-3"),
    ("GPipe", "rendezvous"): ("0x1.b3c60d7cc84abp-3", "0x1.911bca94ffaa1p-3"),
    ("Interleaved1F1B", "eager"): ("0x1.12f702bc49e73p-2", "0x1.fe0a009f6538ap-3"),
    ("Interleaved1F1B", "rendezvous"): ("0x1.26ce5b0631df8p-2", "0x1.11e3f0da22faap-2"),
    ("ZBVZeroBubble", "eager"): ("0x1.7509613c31002p-3", "0x1.2fe11c318ccf7p-3"),
    ("ZBVZeroBubble", "rendezvous"): ("0x1.886ac9c62fbc2p-3", "0x1.4014539a006c9p-3"),
}


def test_zero_link_delay_is_bitwise_the_engine_without_it():
    rng = np.random.default_rng(2024)
    for schedule, p, v, m in [("1F1B", 4, 1, 6), ("GPipe", 3, 1, 5), ("Interleaved1F1B", 2, 2, 4),
                              ("ZBVZeroBubble", 2, 2, 3)]:
        S = p * v
        f = rng.uniform(0.001, 0.02, (S, m))
        b = rng.uniform(0.002, 0.04, (S, m))
        comm = rng.uniform(0, 0.003, S - 1).tolist()
        for p2p in ("eager", "rendezvous"):
            want = BEFORE_LINK_DELAY[(schedule, p2p)]
            for delay in (None, 0.0, [0.0] * (S - 1)):
                r = simulate(f, b, schedule, m, comm=comm, link_delay=delay, stages_per_rank=v, p2p=p2p)
                assert (r.iteration_time.hex(), r.balanced_iteration_time.hex()) == want, (schedule, p2p, delay)


@pytest.mark.parametrize("p2p", ["eager", "rendezvous"])
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_link_delay_on_the_critical_path_two_stages_one_microbatch(schedule, p2p):
    """One microbatch through 2 stages is one chain: F0, the activation over the link, F1, B1,
    the gradient back over the link, B0. A delay d on the link adds exactly 2d."""
    f, b, c, d = [0.010, 0.012], [0.020, 0.030], 0.001, 0.004
    base = simulate(f, b, schedule, 1, comm=c, p2p=p2p).iteration_time
    slow = simulate(f, b, schedule, 1, comm=c, link_delay=[d], p2p=p2p).iteration_time
    assert base == pytest.approx(sum(f) + sum(b) + 2 * c, rel=1e-12)
    assert slow == pytest.approx(sum(f) + sum(b) + 2 * (c + d), rel=1e-12)
    assert slow - base >= 2 * d - 1e-12
    assert predict_iteration_time(f, b, schedule, 1, comm=c, link_delay=d, p2p=p2p) == slow


def test_link_delay_adds_to_both_directions_of_its_link_only():
    t = StageTimes.build([1.0] * 3, [2.0] * 3, 2, comm={"fwd": [0.1, 0.2], "bwd": 0.3}, link_delay=[0.0, 0.5])
    assert t.comm_fwd.tolist() == [0.1, 0.7] and t.comm_bwd.tolist() == [0.3, 0.8]
    for bad in ([0.1], [0.1, -0.1], [0.1, float("nan")]):
        with pytest.raises(SimInputError, match="link_delay"):
            StageTimes.build([1.0] * 3, [2.0] * 3, 2, link_delay=bad)
