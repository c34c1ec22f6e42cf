"""Trace replay: policies' invariants, equivalence to the simulator, the CLI end to end."""

from __future__ import annotations

import dataclasses
import json
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynmo.balance import Problem, balance
from dynmo.cli import main as dynmo_main
from dynmo.controller import step_time
from dynmo.engine import SimInputError
from dynmo.layout import Layout
from dynmo.sim import simulate, stage_times
from dynmo.sim.replay import (
    DEFAULT_POLICIES, LINK_DELAY_FACTORS, STATIC, ReplayOptions, default_policies, link_delay_table, parse_policy,
    profile_once_layout, replay, replay_balance, replay_link_delays, summary_table,
)
from dynmo.sim.trace import Trace, TraceHeader, TraceStep, TraceWriter
from tests.conftest import param_counts

FREE = dict(migration_bandwidth=float("inf"), migration_fixed_s=0.0, charge_decide=False)


def make_trace(costs: np.ndarray, schedule: str = "1f1b", microbatches: int = 4, dynamism=(), tokens=True) -> Trace:
    """A trace with the given per-step per-layer costs (fwd = 1/3, bwd = 2/3 of each)."""
    steps, n = costs.shape
    cfg = {"model": {"n_layers": n - 2, "d_model": 32, "seq_len": 16, "vocab_size": 64},
           "train": {"global_batch": 8 if tokens else 0, "microbatches": microbatches},
           "parallel": {"schedule": schedule, "virtual_stages": 2 if "interleaved" in schedule else 1}}
    header = TraceHeader.from_config(cfg, param_counts(cfg["model"]), 2, 1)
    out = [TraceStep(k, (c / 3).tolist(), (2 * c / 3).tolist(), events=[{"type": "dynamism"}] if k in dynamism else [])
           for k, c in enumerate(costs)]
    return Trace(header, out)


def drifting(rng, steps: int, n: int) -> np.ndarray:
    """Costs with step changes (a dynamic model): a random region gets heavier at random steps."""
    c = np.tile(rng.uniform(0.5, 1.5, n), (steps, 1))
    for _ in range(3):
        k, i, j = rng.integers(0, steps), rng.integers(0, n), rng.integers(1, 4)
        c[k:, i:i + j] *= rng.uniform(1.5, 4.0)
    return c * 0.01


@settings(max_examples=15, deadline=None)
@given(st.integers(3, 5), st.integers(7, 16), st.sampled_from(["1f1b", "gpipe", "interleaved1f1b"]),
       st.integers(0, 2**31))
def test_oracle_bound_and_static_uniform(stages, n, schedule, seed):
    rng = np.random.default_rng(seed)
    v = 2 if schedule == "interleaved1f1b" else 1
    stages = stages * v
    if n < stages:
        n = stages + 1
    costs = drifting(rng, 8, n)
    t = make_trace(costs, schedule)
    res = {r.policy: r for r in replay(t, stages, 1, default_policies(t), ReplayOptions())}
    oracle = res["oracle"]
    for r in res.values():
        assert len(r.iteration_s) == 8
        for k in range(8):  # the oracle's step is the fastest of every policy's, by construction
            assert oracle.iteration_s[k] <= r.iteration_s[k] * (1 + 1e-12)
            assert 0 <= r.bubble_ratio[k] < 1
        assert oracle.total_s <= r.total_s * (1 + 1e-12)
        # re-packing never uses more workers, and released workers never come back
        assert all(a >= b for a, b in zip(r.workers, r.workers[1:]))
        assert max(r.workers) <= stages // v
    for b in ("optimal", "deepspeed", "diffusion-contiguous"):
        if v == 1:
            assert all(x <= y for x, y in zip(res[f"{b}+repack"].workers, res[b].workers))
        else:
            assert f"{b}+repack" not in res  # the runtime re-packs only with one stage per rank
    # static uniform is exactly the simulator run on the summed layer costs
    lay = Layout.uniform(n, stages)
    for k in range(8):
        direct = simulate(stage_times(costs[k] / 3, lay), stage_times(2 * costs[k] / 3, lay), schedule, 4,
                          stages_per_rank=v, split_bubble=False)
        assert res["uniform"].iteration_s[k] == pytest.approx(direct.iteration_time, rel=1e-12)
        assert res["uniform"].bubble_ratio[k] == pytest.approx(direct.bubble_ratio, rel=1e-12)
    assert res["uniform"].speedup == pytest.approx(1.0)


def test_dynamic_optimal_with_free_migration_reaches_the_oracle():
    """Constant costs: once the controller has seen a step, it runs the oracle's layout (both
    take the least simulated step time among the same candidates)."""
    rng = np.random.default_rng(3)
    costs = np.tile(rng.uniform(0.2, 3.0, 14), (6, 1)) * 0.01
    t = make_trace(costs)
    opts = ReplayOptions(balance=replay_balance(when="every", every=1, window=1, min_gain=0.0), **FREE)
    dyn, orc = replay(t, 4, 1, ["optimal", "oracle"], opts)
    assert dyn.iteration_s[1:] == pytest.approx(orc.iteration_s[1:], rel=1e-12)
    assert dyn.bottleneck_s[1:] == pytest.approx(orc.bottleneck_s[1:], rel=1e-12)
    assert dyn.migration_s == 0.0 and dyn.total_s == pytest.approx(sum(dyn.iteration_s))


def test_auto_moves_back_from_a_layout_whose_measured_step_time_lost():
    """The profiler reports layers 0-2 at a quarter of what they really cost (its median
    microbatch, say, misses a slow one): on what it sees, moving a layer onto stage 0 saves
    time; the engine's step (the real costs) shows it lose. `auto` moves, judges the move by the
    measured step time after JUDGE windows, returns, and never tries that layout again."""
    n, steps = 8, 16
    cfg = {"model": {"n_layers": n - 2, "d_model": 32, "seq_len": 16, "vocab_size": 64},
           "train": {"global_batch": 8, "microbatches": 4}, "parallel": {"schedule": "1f1b"}}
    header = TraceHeader.from_config(cfg, param_counts(cfg["model"]), 2, 1)
    real = np.ones(n) * 0.01
    seen = real.copy()
    seen[:3] *= 0.25
    t = Trace(header, [TraceStep(k, (real / 3).tolist(), (2 * real / 3).tolist(), cost=seen.tolist()) for k in range(steps)])
    opts = ReplayOptions(balance=replay_balance(when="auto", window=1, min_gain=0.0), **FREE)
    dyn, uni = replay(t, 2, 1, ["optimal", "uniform"], opts)
    moved = [k for k, lay in enumerate(dyn.layouts) if lay != uni.layouts[k]]
    assert len(moved) == 3  # judged on 2 steps after the first on the other layout: it lost
    assert uni.iteration_s[0] < dyn.iteration_s[moved[1]]
    assert dyn.migrations == 2 and dyn.layouts[-1] == uni.layouts[-1]
    assert dyn.total_s <= uni.total_s + 3 * (dyn.iteration_s[moved[0]] - uni.iteration_s[0]) + 1e-12


def test_the_controller_does_not_take_a_layout_whose_simulated_step_is_slower():
    """These costs' bottleneck-optimal layout runs a slower 1F1B step than the uniform one (the
    schedule, not the bottleneck, sets the step): the controller compares layouts in the
    schedule's simulated step time, so it never moves there, and ends no slower than uniform."""
    rng = np.random.default_rng(3)
    costs = np.tile(rng.uniform(0.2, 3.0, 14), (12, 1)) * 0.01
    t = make_trace(costs)
    opts = ReplayOptions(balance=replay_balance(when="auto", window=1, min_gain=0.0), initial="uniform", **FREE)
    dyn, uni, orc = replay(t, 4, 1, ["optimal", "uniform", "oracle"], opts)
    minmax = balance(Problem(costs=costs[0].tolist(), stages=4), "optimal").boundaries
    assert list(minmax) not in dyn.layouts
    assert dyn.total_s <= uni.total_s and orc.total_s <= dyn.total_s


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 3), st.integers(4, 8), st.sampled_from(["1f1b", "gpipe"]), st.integers(0, 2**31))
def test_no_policy_beats_the_oracle_and_brute_force_bounds_it(stages, n, schedule, seed):
    """On small random problems: at every step the oracle's layout is at least as fast as every
    policy's, and never faster than the best of all contiguous layouts (brute force)."""
    from dynmo.sim.replay.runner import Runner

    rng = np.random.default_rng(seed)
    costs = drifting(rng, 6, n)
    t = make_trace(costs, schedule)
    opts = ReplayOptions(**FREE)
    res = {r.policy: r for r in replay(t, stages, 1, default_policies(t), opts)}
    runner = Runner(t, 1, opts, stages)
    every = [Layout((0, *cut, n)) for cut in combinations(range(1, n), stages - 1)]
    for k in range(6):
        brute = min(runner.iteration_s(k, lay) for lay in every)
        assert brute <= res["oracle"].iteration_s[k] * (1 + 1e-12)
        for r in res.values():
            assert res["oracle"].iteration_s[k] <= r.iteration_s[k] * (1 + 1e-12)


def test_migration_cost_is_charged_as_the_controller_models_it():
    costs = np.ones((6, 10)) * 0.01
    costs[2:, 1:4] *= 4  # a skew from step 2 on, announced as dynamism
    t = make_trace(costs, dynamism=(2,))
    opts = ReplayOptions(balance=replay_balance(when="dynamism"), migration_bandwidth=1e8, migration_fixed_s=0.05,
                         charge_decide=False)
    (r,) = replay(t, 2, 1, ["optimal"], opts)
    assert r.migrations == 1  # decided before step 5 from the window of steps 2-4
    assert r.layouts[4] == [0, 5, 10] and r.layouts[5] != [0, 5, 10]
    moved = Layout(tuple(r.layouts[4])).moves_to(Layout(tuple(r.layouts[5])))
    want = 0.05 + sum(t.header.layer_bytes[m.layer] for m in moved) / 1e8
    assert r.layers_moved == len(moved) and r.migration_s == pytest.approx(want)
    assert r.overhead_s[5] == pytest.approx(want) and r.total_s == pytest.approx(sum(r.iteration_s) + want)


def test_repack_releases_workers_when_the_work_shrinks():
    """Pruning-like: most blocks get ~free; the bottleneck is one heavy layer, so fewer stages do."""
    costs = np.ones((8, 12)) * 0.01
    costs[3:, 2:] *= 0.05
    costs[3:, 1] *= 3
    t = make_trace(costs, dynamism=(3,))
    opts = ReplayOptions(balance=replay_balance(when="dynamism", repack_tolerance=0.05), **FREE)
    plain, packed = replay(t, 4, 2, ["optimal", "optimal+repack"], opts)
    assert plain.workers == [8] * 8
    assert packed.workers[:4] == [8] * 4 and packed.workers[-1] < 8
    assert packed.bottleneck_s[-1] <= plain.bottleneck_s[-1] * 1.05 + 1e-12
    assert packed.speedup_per_worker > plain.speedup_per_worker


def test_allreduce_and_tokens():
    costs = np.ones((3, 6)) * 0.01
    t = make_trace(costs)
    (a,) = replay(t, 2, 4, ["uniform"], ReplayOptions())
    (b,) = replay(t, 2, 4, ["uniform"], ReplayOptions(allreduce_bandwidth=1e6))
    assert b.iteration_s[0] > a.iteration_s[0]
    assert a.tokens_per_step == t.header.tokens_per_microbatch * 4 * 4  # microbatches x dp
    assert a.workers == [8, 8, 8]


def test_bad_policies_and_shapes():
    assert parse_policy("deepspeed+repack") == ("deepspeed", True)
    for bad in ("diffusion", "oracle+repack", "optimal+foo", "nope"):
        with pytest.raises(SimInputError):
            parse_policy(bad)
    t = make_trace(np.ones((2, 6)))
    with pytest.raises(SimInputError, match="scale the trace"):
        replay(t, 7, 1)


def test_cli_replays_a_trace_file(tmp_path, capsys):
    rng = np.random.default_rng(5)
    t = make_trace(drifting(rng, 10, 10), dynamism=(4,))
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, t.header) as w:
        for s in t.steps:
            w.write_trace_step(s)
    assert dynmo_main(["simulate", "--trace", str(path), "--stages", "3", "--dp", "2", "--plots",
                       str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    for policy in DEFAULT_POLICIES:
        assert f"\n{policy} " in out
    assert "not modelled: data-parallel gradient all-reduce" in out
    assert (tmp_path / "p" / "layout.png").read_bytes()[:4] == b"\x89PNG"
    assert dynmo_main(["simulate", "--trace", str(path), "--json", "--indent", "0", "--scale-blocks", "30",
                       "--stages", "8", "--policies", "uniform,optimal+repack", "--when", "dynamism"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in doc["policies"]] == ["uniform", "optimal+repack"]
    assert doc["replay"]["stages"] == 8 and doc["trace"]["layers"] == 32
    assert len(doc["policies"][1]["layouts"]) == 10
    assert dynmo_main(["simulate", "--trace", str(path), "--policies", "bogus"]) == 2
    assert "unknown policy" in capsys.readouterr().err


def test_cli_link_delay_links_and_profile_steps(tmp_path, capsys):
    """--link-delay / --links / --profile-steps reach the replay: a slow link 0 in both
    directions moves work off both of its ends with links = measure, not with free; bad values
    are one line and exit 2 before the trace is replayed."""
    t = make_trace(np.ones((6, 12)) * 0.01)
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, t.header) as w:
        for s in t.steps:
            w.write_trace_step(s)
    base = ["simulate", "--trace", str(path), "--stages", "3", "--json", "--policies", "profile-once,optimal",
            "--when", "every", "--every", "1", "--window", "1", "--min-gain", "0"]
    layouts = {}
    for links in ("measure", "free"):
        assert dynmo_main([*base, "--link-delay", "0.03,0", "--comm", "0.001", "--links", links,
                           "--profile-steps", "2"]) == 0
        doc = json.loads(capsys.readouterr().out)
        layouts[links] = [p["layouts"][-1] for p in doc["policies"]]
    one_way = [0.031, 0.001]
    want = list(profile_once_layout(np.ones(12) * 0.01, 3, one_way, one_way).boundaries)
    # profile-once keeps the load model's layout; the controller, scoring by the simulated step,
    # also moves work off the slow link's ends; with links = free both stay compute-only
    assert layouts["measure"][0] == want and layouts["measure"][1] != [0, 4, 8, 12]
    assert layouts["free"] == [[0, 4, 8, 12]] * 2
    for bad, words in ((["--link-delay", "0.1,0.1,0.1"], "one per link"), (["--link-delay", "fast"], "not a number"),
                       (["--link-delay", "-1"], "--link-delay"), (["--link-delay", "nan"], "--link-delay"),
                       (["--links", "sometimes"], "--links"), (["--profile-steps", "0"], "--profile-steps")):
        assert dynmo_main([*base, *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_retuned_microbatches_after_a_repack():
    costs = np.ones((8, 12)) * 0.01
    costs[3:, 2:] *= 0.05
    costs[3:, 0] *= 0.05
    costs[3:, 1] *= 3  # from step 3 one layer dominates: 2 stages do as well as 4
    t = make_trace(costs, dynamism=(3,), microbatches=8)
    opts = ReplayOptions(balance=replay_balance(when="dynamism", retune_microbatches=True), **FREE)
    (r,) = replay(t, 4, 1, ["optimal+repack"], opts)
    assert r.microbatches[0] == 8 and r.workers[-1] == 2
    assert r.microbatches[-1] < 8  # fewer, larger microbatches for the shorter pipeline
    # the local batch is kept: a microbatch of twice the size costs twice as much, loads stay per traced size
    assert r.stage_loads[-1] == pytest.approx(
        Layout(tuple(r.layouts[-1])).stage_loads(costs[-1].tolist()), rel=1e-12)


def test_interleaved_schedules_have_no_repack():
    t = make_trace(np.ones((2, 10)), schedule="interleaved1f1b")
    assert not any(p.endswith("+repack") for p in default_policies(t))
    with pytest.raises(SimInputError, match="one stage per rank"):
        replay(t, 4, 1, ["optimal+repack"])


def test_steps_with_other_microbatch_counts_are_rescaled():
    """A step the traced run took with 2 microbatches (each twice the header's size) is halved."""
    t = make_trace(np.ones((2, 6)), microbatches=4)
    t.steps[1].microbatches = 2
    assert np.allclose(t.costs()[1], 0.5 * t.costs()[0])


def test_op_overhead_adds_to_every_op():
    """A per-op overhead o is the same as o more forward and backward time per stage and microbatch."""
    costs = np.ones((2, 6)) * 0.01
    t = make_trace(costs)
    (a,) = replay(t, 3, 1, ["uniform"], ReplayOptions(op_overhead=0.002))
    lay = Layout.uniform(6, 3)
    direct = simulate(stage_times(costs[0] / 3, lay) + 0.002, stage_times(2 * costs[0] / 3, lay) + 0.002, "1f1b", 4)
    assert a.iteration_s[0] == pytest.approx(direct.iteration_time, rel=1e-12)
    assert a.bottleneck_s[0] == pytest.approx(0.02)  # stage loads stay the layers' costs


def test_the_controller_sees_the_recorded_cost():
    """One slowed microbatch inflates the mean (fwd + bwd) but not the median `cost` the runtime
    balances on: the replayed controller, like the runtime's, does not move layers for it."""
    costs = np.ones((12, 8)) * 0.01
    costs[3:, 1] *= 5  # the means say layer 1 is slow from step 3 on
    t = make_trace(costs)
    (moved,) = replay(t, 2, 1, ["optimal"], ReplayOptions(**FREE))
    assert moved.migrations >= 1
    for s in t.steps:
        s.cost = [0.01] * 8  # ... the typical microbatch says nothing changed
    (kept,) = replay(t, 2, 1, ["optimal"], ReplayOptions(**FREE))
    assert kept.migrations == 0 and kept.layouts[-1] == [0, 4, 8]


# ---- profile-once, the best static layout, per-worker figures ------------------------------


def brute_force_bottleneck(costs: np.ndarray, stages: int, transfer: np.ndarray) -> float:
    """The smallest max stage load over every contiguous layout (load = layer costs + the
    stage's link time: what it sends forward and back)."""
    n = len(costs)
    best = np.inf
    for cuts in combinations(range(1, n), stages - 1):
        b = (0, *cuts, n)
        best = min(best, max(costs[b[j]:b[j + 1]].sum() + transfer[j] for j in range(stages)))
    return best


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 4), st.integers(4, 9), st.integers(1, 6), st.integers(1, 9),
       st.sampled_from([None, "measure", "free"]), st.integers(0, 2**31))
def test_profile_once_is_the_optimal_layout_of_the_median_early_costs(stages, n, profile, steps, links, seed):
    rng = np.random.default_rng(seed)
    n = max(n, stages)
    costs = rng.uniform(0.1, 2.0, (steps, n)) * 0.01
    t = make_trace(costs, microbatches=2)
    delay = None if links is None else rng.uniform(0.0, 0.01, stages - 1).tolist()
    comm = 0.0 if links is None else 0.002
    opts = ReplayOptions(profile_steps=profile, link_delay=delay, comm=comm,
                         balance=replay_balance(links=links or "measure"), **FREE)
    (r,) = replay(t, stages, 1, ["profile-once"], opts)
    # the median per layer of steps 1 .. profile (step 0 is the warm-up; it is used only when alone)
    early = t.costs()[1:1 + profile] if steps > 1 else t.costs()[:1]
    med = np.median(early, axis=0)
    transfer = np.zeros(stages)
    if links == "measure":  # each link's one-way time, charged to the activation's and the gradient's sender
        one_way = comm + np.asarray(delay)
        transfer[:-1] += one_way
        transfer[1:] += one_way
    lay = Layout(tuple(r.layouts[0]))
    got = max(np.add.reduceat(med, np.asarray(lay.boundaries[:-1])) + transfer)
    assert got <= brute_force_bottleneck(med, stages, transfer) * (1 + 1e-9)
    # never changed, never charged
    assert all(b == r.layouts[0] for b in r.layouts) and len(r.layouts) == steps
    assert r.migrations == 0 and r.migration_s == 0 and not any(r.overhead_s)


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 5), st.integers(5, 14), st.integers(0, 2**31))
def test_profile_once_never_loses_to_uniform_on_constant_costs_in_the_model(stages, n, seed):
    """Constant costs: profile-once's stages are never more loaded than uniform's, so the
    controller's step-time model never predicts it slower."""
    rng = np.random.default_rng(seed)
    costs = np.tile(rng.uniform(0.1, 3.0, n), (4, 1)) * 0.01
    t = make_trace(costs)
    uni, po = replay(t, stages, 1, ["uniform", "profile-once"], ReplayOptions(**FREE))
    for k in range(4):
        assert po.bottleneck_s[k] <= uni.bottleneck_s[k] * (1 + 1e-9)
        assert step_time(po.stage_loads[k], 4) <= step_time(uni.stage_loads[k], 4) * (1 + 1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_profile_once_total_time_is_at_most_uniform_on_constant_costs(schedule):
    costs = np.ones((6, 12)) * 0.01
    costs[:, 1:4] *= 3  # a heavy region that the uniform layout puts on the first stage
    t = make_trace(costs, schedule=schedule, microbatches=6)
    uni, po = replay(t, 3, 1, ["uniform", "profile-once"], ReplayOptions(**FREE))
    assert po.layouts[0] != uni.layouts[0]
    assert po.total_s <= uni.total_s
    assert po.speedup_vs_best_static == 1.0 and po.best_static == "profile-once"


def test_speedup_vs_best_static():
    rng = np.random.default_rng(7)
    t = make_trace(drifting(rng, 10, 12))
    res = replay(t, 3, 2, None, ReplayOptions(**FREE))
    by = {r.policy: r for r in res}
    assert set(STATIC) <= set(by) and "profile-once" in DEFAULT_POLICIES
    best = by[res[0].best_static]
    assert best.total_s == min(by[s].total_s for s in STATIC)
    assert best.speedup_vs_best_static == 1.0
    for r in res:
        assert r.best_static == best.policy
        assert r.speedup_vs_best_static == pytest.approx(best.total_s / r.total_s, rel=1e-12)
        assert r.speedup_vs_best_static <= r.speedup * (1 + 1e-12)  # the best static is at least as fast as uniform
        d = r.as_dict(per_step=False)
        assert d["speedup_vs_best_static"] == r.speedup_vs_best_static and d["best_static"] == best.policy
    # asked alone, the static policies are replayed for the comparison but not returned
    (alone,) = replay(t, 3, 2, ["optimal"], ReplayOptions(**FREE))
    assert alone.best_static == best.policy
    assert alone.speedup_vs_best_static == by["optimal"].speedup_vs_best_static
    assert "vs best" in summary_table(res) and f"best static layout ({best.policy}" in summary_table(res)


def test_repack_shows_as_fewer_worker_seconds_per_token():
    costs = np.ones((8, 12)) * 0.01
    costs[3:, 2:] *= 0.05
    costs[3:, 1] *= 3
    t = make_trace(costs, dynamism=(3,))
    opts = ReplayOptions(balance=replay_balance(when="dynamism", repack_tolerance=0.05), link_delay=[0.001] * 3, **FREE)
    plain, packed = replay(t, 4, 2, ["optimal", "optimal+repack"], opts)
    assert packed.workers[-1] < plain.workers[-1] == 8
    assert packed.worker_s < plain.worker_s
    for r in (plain, packed):
        d = r.as_dict(per_step=False)
        assert d["worker_s"] == r.worker_s
        assert d["tokens_per_s_per_worker"] == pytest.approx(r.tokens_per_step * r.steps / r.worker_s, rel=1e-12)
        assert d["workers_final"] == r.workers_final
    assert packed.tokens_per_s_per_worker / plain.tokens_per_s_per_worker == pytest.approx(
        packed.speedup_per_worker / plain.speedup_per_worker, rel=1e-12)
    table = summary_table([plain, packed])
    assert "worker-s" in table and "tok/s/wkr" in table and f"{packed.worker_s:.1f}" in table
    # without token counts: steps per worker-second
    (r,) = replay(make_trace(costs, tokens=False), 4, 2, ["optimal"], ReplayOptions(**FREE))
    assert r.tokens_per_s_per_worker is None and r.as_dict()["steps_per_worker_s"] == pytest.approx(r.steps / r.worker_s)
    assert "steps/wkr-s" in summary_table([r])


# ---- link delay: the paper's network experiment ---------------------------------------------


def test_zero_link_delay_replays_bitwise_as_without_it():
    rng = np.random.default_rng(11)
    t = make_trace(drifting(rng, 8, 12))
    for comm in (0.0, 0.002):
        base = replay(t, 4, 1, None, ReplayOptions(comm=comm, **FREE))
        zero = replay(t, 4, 1, None, ReplayOptions(comm=comm, link_delay=[0.0] * 3, **FREE))
        for a, b in zip(base, zero):
            assert a.iteration_s == b.iteration_s and a.layouts == b.layouts and a.total_s == b.total_s
    # no link time at all: link-aware and compute-only balancing are the same
    aware = replay(t, 4, 1, None, ReplayOptions(**FREE))
    free = replay(t, 4, 1, None, ReplayOptions(balance=replay_balance(links="free"), **FREE))
    for a, b in zip(aware, free):
        assert a.iteration_s == b.iteration_s and a.layouts == b.layouts


def test_link_delay_adds_its_transfers_on_the_critical_path():
    """2 stages, 1 microbatch: F0, activation over link 0, F1, B1, gradient back, B0 -- the
    delay is paid twice per step."""
    costs = np.array([[0.01, 0.02, 0.03, 0.04]] * 3)
    t = make_trace(costs, microbatches=1)
    d = 0.005
    (a,) = replay(t, 2, 1, ["uniform"], ReplayOptions(comm=0.001, **FREE))
    (b,) = replay(t, 2, 1, ["uniform"], ReplayOptions(comm=0.001, link_delay=[d], **FREE))
    for k in range(3):
        assert b.iteration_s[k] - a.iteration_s[k] >= 2 * d - 1e-12
        assert b.iteration_s[k] == pytest.approx(costs[k].sum() + 2 * (0.001 + d), rel=1e-12)


def test_the_controller_sees_the_link_times_the_engine_charges():
    """Constant costs, a slow link 0: with links = measure the dynamic optimal settles on a layout
    as fast as the oracle's (the simulated optimum with each link's per-microbatch time, comm +
    delay each way, charged to the activation's and the gradient's sender), faster than uniform;
    profile-once takes the load model's optimum. With links = free the controller balances compute
    only and keeps the compute-only layout, which the slow link makes slower than the oracle's."""
    costs = np.ones((6, 12)) * 0.01
    t = make_trace(costs)
    comm, delay = 0.001, [0.03, 0.0]
    every = dict(when="every", every=1, window=1, min_gain=0.0)
    one_way = [comm + delay[0], comm]
    for links in ("measure", "free"):
        opts = ReplayOptions(comm=comm, link_delay=delay, balance=replay_balance(links=links, **every), **FREE)
        dyn, po, orc, uni = replay(t, 3, 1, ["optimal", "profile-once", "oracle", "uniform"], opts)
        if links == "measure":
            assert po.layouts[0] == list(profile_once_layout(costs[0], 3, one_way, one_way).boundaries)
            assert dyn.iteration_s[-1] == pytest.approx(orc.iteration_s[-1]) and dyn.iteration_s[-1] < uni.iteration_s[-1]
        else:
            assert dyn.layouts[-1] == po.layouts[0] == [0, 4, 8, 12]
            assert orc.iteration_s[-1] < dyn.iteration_s[-1]


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(6, 30), st.integers(1, 16), st.integers(0, 2**31))
def test_link_aware_optimal_never_loses_to_compute_only_in_the_model(stages, n, m, seed):
    rng = np.random.default_rng(seed)
    costs = rng.uniform(0.0, 1.0, n) * 0.01
    transfer = (rng.uniform(0.0, 0.02, stages - 1) * rng.integers(0, 2, stages - 1)).tolist()
    back = (rng.uniform(0.0, 0.02, stages - 1) * rng.integers(0, 2, stages - 1)).tolist()
    aware = profile_once_layout(costs, stages, transfer, back)
    free = profile_once_layout(costs, stages, None)
    model = Problem(costs=costs.tolist(), stages=stages, transfer=transfer, transfer_back=back)
    la, lf = model.loads_of_assignment(aware.owner()), model.loads_of_assignment(free.owner())
    assert max(la) <= max(lf) * (1 + 1e-9)
    assert step_time(la, m) <= step_time(lf, m) * (1 + 1e-9)


def test_replay_link_delays_rows(tmp_path):
    rng = np.random.default_rng(5)
    t = make_trace(drifting(rng, 6, 10))
    rows = replay_link_delays(t, 0.004, stages=3, dp=1, links=[0], options=ReplayOptions(**FREE))
    assert len(rows) == len(LINK_DELAY_FACTORS) * 2 * 3
    assert {(r["factor"], r["links"]) for r in rows} == {(f, m) for f in LINK_DELAY_FACTORS for m in ("measure", "free")}
    by = {(r["factor"], r["links"], r["policy"]): r for r in rows}
    for f in LINK_DELAY_FACTORS:
        assert by[(f, "measure", "uniform")]["total_s"] == by[(f, "free", "uniform")]["total_s"]
        assert by[(f, "measure", "uniform")]["delay_s"] == f * 0.004
    for p in ("uniform", "profile-once", "optimal"):  # no delay, no link time: the same replay
        assert by[(0.0, "measure", p)]["total_s"] == by[(0.0, "free", p)]["total_s"]
    uni = [by[(f, "free", "uniform")]["mean_iteration_s"] for f in LINK_DELAY_FACTORS]
    assert uni == sorted(uni) and uni[-1] > uni[0]
    table = link_delay_table(rows)
    assert table.count("\n") == 1 + len(LINK_DELAY_FACTORS) * 3 and "| 4 | 0.016 | optimal |" in table
    with pytest.raises(SimInputError, match="links are indices"):
        replay_link_delays(t, 0.004, stages=3, links=[2])
    from dynmo.sim.plots import write_link_delay_plot

    assert write_link_delay_plot(rows, tmp_path / "link_delay.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_link_delay_and_profile_steps():
    t = make_trace(np.ones((3, 6)) * 0.01)
    with pytest.raises(SimInputError, match="link_delay needs one value per link"):
        replay(t, 3, 1, ["uniform"], ReplayOptions(link_delay=[0.1]))
    with pytest.raises(SimInputError, match="link_delay must be"):
        replay(t, 3, 1, ["uniform"], ReplayOptions(link_delay=[0.1, -1.0]))
    with pytest.raises(SimInputError, match="profile_steps"):
        replay(t, 3, 1, ["uniform"], ReplayOptions(profile_steps=0))


def test_released_workers_come_back_when_the_work_grows_again():
    """The same shrink, then the work comes back at step 16: the re-packed run takes its workers
    back (a checkpoint restart, charged `restart_s`) and ends within the re-pack's tolerance of
    the run that kept them; with a restart that cannot repay, it stays packed."""
    costs = np.ones((40, 12)) * 0.01
    costs[3:16, 2:] *= 0.05
    costs[3:16, 1] *= 3
    t = make_trace(costs, dynamism=(3, 16))
    opts = ReplayOptions(balance=replay_balance(when="dynamism", repack_tolerance=0.05, horizon=20), restart_s=0.05,
                         **FREE)
    plain, packed = replay(t, 4, 2, ["optimal", "optimal+repack"], opts)
    assert min(packed.workers) < 8 and packed.workers[-1] == 8 and packed.restarts == 1
    assert packed.bottleneck_s[-1] <= plain.bottleneck_s[-1] * 1.05 + 1e-12
    grew = packed.workers.index(8, packed.workers.index(min(packed.workers)))
    assert packed.overhead_s[grew] >= 0.05  # the restart is charged on the step it happens
    (stuck,) = replay(t, 4, 2, ["optimal+repack"], dataclasses.replace(opts, restart_s=1e6))
    assert stuck.restarts == 0 and stuck.workers[-1] < 8
