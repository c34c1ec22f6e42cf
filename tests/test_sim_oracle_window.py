"""The replay's oracle-window bound, where the dynamic policies start (--start), the second-half
speedups and the share of each oracle's gain a dynamic policy captures. Nothing here depends on
this machine's speed: decide time is never charged where totals are compared."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dynmo.cli import main as dynmo_main
from dynmo.layout import Layout
from dynmo.sim.replay import (
    CAPTURE_MIN_GAIN, DEFAULT_POLICIES, STARTS, STATIC, ReplayOptions, capture, default_oracle_window,
    default_start, replay, replay_balance, summary_table,
)
from dynmo.sim.trace import TraceWriter
from tests.test_sim_replay import FREE, drifting, make_trace

PAID = dict(migration_bandwidth=1e8, migration_fixed_s=0.02, charge_decide=False)
EPS = 1 + 1e-12


def by_policy(results) -> dict:
    return {r.policy: r for r in results}


def windows_of(n_steps: int, w: int) -> list[list[int]]:
    return [list(range(a, min(a + w, n_steps))) for a in range(0, n_steps, w)]


def check_migrations_charged(ow, trace, window: int, fixed: float, bandwidth: float) -> None:
    """One layout per window; a change between windows is charged fixed + moved bytes / bandwidth
    before the window's first step, and nothing else is charged."""
    n = len(ow.layouts)
    starts = {w[0] for w in windows_of(n, window)}
    migrations, seconds = 0, 0.0
    for k in range(n):
        if k and ow.layouts[k] != ow.layouts[k - 1]:
            assert k in starts, "oracle-window changed its layout inside a window"
            moved = Layout(tuple(ow.layouts[k - 1])).moves_to(Layout(tuple(ow.layouts[k])))
            want = fixed + sum(trace.header.layer_bytes[m.layer] for m in moved) / bandwidth
            assert ow.overhead_s[k] == pytest.approx(want, rel=1e-12)
            migrations, seconds = migrations + 1, seconds + want
        else:
            assert ow.overhead_s[k] == 0.0
    assert ow.migrations == migrations and ow.migration_s == pytest.approx(seconds, rel=1e-12)
    assert ow.decide_s == 0.0 and ow.total_s == pytest.approx(sum(ow.iteration_s) + seconds, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 4), st.integers(6, 12), st.integers(6, 14), st.integers(1, 6),
       st.sampled_from(["1f1b", "gpipe"]), st.booleans(), st.integers(0, 2**31))
def test_oracle_window_is_between_the_best_static_layout_and_the_per_step_oracle(stages, n, steps, window, schedule,
                                                                               free, seed):
    """On random drifting traces: oracle-window's total is at most every static layout's (with
    free migrations, and with paid ones too, since holding a static layout is one of its paths),
    and at least the per-step oracle's, which is no slower at any step."""
    rng = np.random.default_rng(seed)
    n = max(n, stages + 1)
    t = make_trace(drifting(rng, steps, n), schedule)
    cost = FREE if free else PAID
    opts = ReplayOptions(oracle_window=window, **cost)
    res = by_policy(replay(t, stages, 1, [*STATIC, "optimal", "oracle-window", "oracle"], opts))
    ow, orc = res["oracle-window"], res["oracle"]
    for s in STATIC:
        assert ow.total_s <= res[s].total_s * EPS
    assert ow.speedup_vs_best_static >= 1 - 1e-12
    assert orc.total_s <= ow.total_s * EPS
    for k in range(steps):
        assert orc.iteration_s[k] <= ow.iteration_s[k] * EPS
    check_migrations_charged(ow, t, window, cost["migration_fixed_s"], cost["migration_bandwidth"])


def test_one_step_windows_with_free_migrations_are_the_per_step_oracle():
    """W = 1 and free migrations: each window is one step, its candidates include the per-step
    oracle's, and the per-step oracle takes oracle-window's where faster: the two run the same steps."""
    rng = np.random.default_rng(4)
    t = make_trace(drifting(rng, 12, 12))
    res = by_policy(replay(t, 3, 1, ["optimal", "oracle-window", "oracle"], ReplayOptions(oracle_window=1, **FREE)))
    assert res["oracle-window"].iteration_s == res["oracle"].iteration_s
    assert res["oracle-window"].total_s == pytest.approx(res["oracle"].total_s, rel=1e-12)


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 4), st.integers(6, 12), st.integers(1, 5), st.integers(0, 2**31))
def test_on_costs_that_never_change_oracle_window_holds_one_layout(stages, n, window, seed):
    """Constant costs: every window has the same candidates, so oracle-window runs one layout for
    the whole run, never migrates, is at most the best static layout, and equals it wherever the
    per-step oracle does (oracle-window lies between the two)."""
    rng = np.random.default_rng(seed)
    n = max(n, stages + 1)
    t = make_trace(np.tile(rng.uniform(0.2, 3.0, n), (8, 1)) * 0.01)
    res = by_policy(replay(t, stages, 1, [*STATIC, "oracle-window", "oracle"],
                           ReplayOptions(oracle_window=window, **PAID)))
    ow, orc = res["oracle-window"], res["oracle"]
    best = res[ow.best_static]
    assert all(lay == ow.layouts[0] for lay in ow.layouts) and ow.migrations == 0
    assert orc.total_s <= ow.total_s * EPS and ow.total_s <= best.total_s * EPS
    if orc.total_s == best.total_s:
        assert ow.total_s == pytest.approx(best.total_s, rel=1e-12)


def test_equal_layers_oracle_window_equals_the_best_static_layout():
    """Equal per-layer costs, never changing, on a layer count the stages divide: the uniform layout
    is perfectly balanced and nothing runs faster; oracle-window runs exactly the best static layout."""
    t = make_trace(np.ones((10, 12)) * 0.01)
    res = by_policy(replay(t, 4, 1, [*STATIC, "optimal", "oracle-window", "oracle"], ReplayOptions(**PAID)))
    ow, best = res["oracle-window"], res[res["uniform"].best_static]
    assert ow.total_s == best.total_s and ow.iteration_s == best.iteration_s
    assert ow.migrations == 0 and ow.speedup_vs_best_static == 1.0
    assert res["oracle"].total_s == best.total_s


def test_oracle_window_moves_when_the_costs_change_and_pays_for_it():
    """A skew from step 6 on: oracle-window moves once, at a window boundary, and is charged the
    dynamic policies' migration cost for the layers whose worker changes; with a migration that
    costs more than the whole gain it holds its layout instead (and is the best static layout)."""
    costs = np.ones((20, 10)) * 0.01
    costs[6:, 1:4] *= 4
    t = make_trace(costs, microbatches=8)
    res = by_policy(replay(t, 2, 1, [*STATIC, "oracle-window"], ReplayOptions(oracle_window=5, **PAID)))
    ow = res["oracle-window"]
    assert ow.migrations == 1 and ow.layouts[4] != ow.layouts[5]  # windows 0-4, 5-9 (4 of its steps skewed), ...
    check_migrations_charged(ow, t, 5, PAID["migration_fixed_s"], PAID["migration_bandwidth"])
    assert ow.migration_s > 0 and ow.total_s < min(res[s].total_s for s in STATIC)
    gain = min(res[s].total_s for s in STATIC) - ow.total_s
    dear = dict(PAID, migration_fixed_s=10 * (gain + ow.migration_s))
    res = by_policy(replay(t, 2, 1, [*STATIC, "oracle-window"], ReplayOptions(oracle_window=5, **dear)))
    ow = res["oracle-window"]
    assert ow.migrations == 0 and ow.total_s <= min(res[s].total_s for s in STATIC) * EPS


def test_oracle_window_defaults_to_the_controllers_window_and_confirmation():
    bal = replay_balance(window=4, confirm=3)
    assert default_oracle_window(bal) == 7 and ReplayOptions(balance=bal).window_steps == 7
    assert ReplayOptions().window_steps == default_oracle_window(replay_balance()) == 5
    assert ReplayOptions(oracle_window=2).window_steps == 2
    assert "oracle-window" in DEFAULT_POLICIES
    costs = np.ones((20, 10)) * 0.01
    costs[6:, 1:4] *= 4
    t = make_trace(costs, microbatches=8)
    (ow,) = replay(t, 2, 1, ["oracle-window"], ReplayOptions(balance=bal, **FREE))
    assert all(ow.layouts[k] == ow.layouts[k - 1] for k in range(1, 20) if k % 7)  # changes only at 7, 14
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="oracle_window"):
            replay(t, 2, 1, ["oracle-window"], ReplayOptions(oracle_window=bad))


def test_the_start_reaches_the_dynamic_policies():
    """Each start puts the dynamic policies' first step on that static layout; default is the
    layout a training run starts on (parallel.layout's default, the FLOP model's layout)."""
    rng = np.random.default_rng(11)
    costs = np.tile(rng.uniform(0.2, 3.0, 12), (8, 1)) * 0.01
    costs[:, 1] *= 5  # profile-once moves away from uniform
    t = make_trace(costs)
    statics = by_policy(replay(t, 5, 1, [*STATIC, "flops"], ReplayOptions(**FREE)))
    assert len({tuple(statics[s].layouts[0]) for s in STATIC}) == 3  # three different starts
    assert default_start() == "flops" and set(STARTS) == {*STATIC, "flops", "default"}
    for start in STARTS:
        opts = ReplayOptions(initial=start, balance=replay_balance(when="every", every=1, window=1, min_gain=0.0),
                             **FREE)
        res = by_policy(replay(t, 5, 1, ["optimal", "deepspeed+repack"], opts))
        for r in res.values():
            assert r.layouts[0] == statics[default_start() if start == "default" else start].layouts[0]
    with pytest.raises(ValueError, match="initial"):
        replay(t, 5, 1, ["optimal"], ReplayOptions(initial="bogus"))


def test_second_half_figures_count_the_last_half_of_the_steps():
    """Costs that change halfway: the first half favours a skewed layout, the second half the
    uniform one. The second-half figures are the totals of steps n//2.. (what was charged before
    them included), against static uniform and the static layout best over those steps."""
    for steps in (10, 11):
        costs = np.ones((steps, 12)) * 0.01
        costs[: steps // 2, 1:3] *= 6  # the early heavy region profile-once sees
        t = make_trace(costs)
        res = replay(t, 3, 1, [*STATIC, "optimal", "oracle-window", "oracle"], ReplayOptions(**PAID))
        by = by_policy(res)
        h = steps // 2
        half = {r.policy: sum(r.iteration_s[h:]) + sum(r.overhead_s[h:]) for r in res}
        best_half = min(STATIC, key=lambda s: half[s])
        assert best_half == "uniform" and by["uniform"].best_static == "profile-once"
        for r in res:
            assert r.second_half_s == pytest.approx(half[r.policy], rel=1e-12)
            assert r.speedup_second_half == pytest.approx(half["uniform"] / half[r.policy], rel=1e-12)
            assert r.speedup_vs_best_static_second_half == pytest.approx(half[best_half] / half[r.policy], rel=1e-12)
            assert r.best_static_second_half == best_half
            d = r.as_dict(per_step=False)
            for key in ("speedup_second_half", "speedup_vs_best_static_second_half", "best_static_second_half"):
                assert d[key] == getattr(r, key)
        # profile-once: the best static layout over the run, not over its second half
        assert by["profile-once"].speedup_vs_best_static == 1.0 and by["profile-once"].speedup_vs_best_static_second_half < 1


def test_capture_of_each_oracles_gain():
    assert capture(1.02, 1.04) == pytest.approx(0.5)
    assert capture(0.99, 1.1) == pytest.approx(-0.1)
    assert capture(1.0, 1 + CAPTURE_MIN_GAIN * 0.99) is None and capture(None, 1.1) is None and capture(1.0, None) is None
    rng = np.random.default_rng(7)
    t = make_trace(drifting(rng, 12, 12))
    res = replay(t, 3, 1, None, ReplayOptions(**FREE))
    by = by_policy(res)
    for r in res:
        d = r.as_dict(per_step=False)
        if r.policy in (*STATIC, "oracle", "oracle-window"):
            assert r.capture_oracle is None and r.capture_oracle_window is None
            continue
        for bound, key in (("oracle", "capture_oracle"), ("oracle-window", "capture_oracle_window")):
            gain = by[bound].speedup_vs_best_static - 1
            want = (r.speedup_vs_best_static - 1) / gain if gain >= CAPTURE_MIN_GAIN else None
            assert getattr(r, key) == pytest.approx(want) and d[key] == getattr(r, key)
    assert "cap orc" in summary_table(res) and "cap ow" in summary_table(res)
    # without the bounds asked for there is nothing to capture
    (alone,) = replay(t, 3, 1, ["optimal"], ReplayOptions(**FREE))
    assert alone.capture_oracle is None and alone.capture_oracle_window is None


def write(t, path):
    with TraceWriter(path, t.header) as w:
        for s in t.steps:
            w.write_trace_step(s)
    return str(path)


def test_cli_start_oracle_window_and_the_new_fields(tmp_path, capsys):
    rng = np.random.default_rng(11)
    costs = np.tile(rng.uniform(0.2, 3.0, 12), (10, 1)) * 0.01
    costs[:, 1] *= 5
    path = write(make_trace(costs), tmp_path / "t.jsonl")
    base = ["simulate", "--trace", path, "--stages", "5", "--no-decide-time", "--json", "--indent", "0"]
    assert dynmo_main([*base, "--policies", "params,optimal,oracle-window,oracle", "--start", "params",
                       "--oracle-window", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    pol = {p["policy"]: p for p in doc["policies"]}
    assert pol["optimal"]["layouts"][0] == pol["params"]["layouts"][0] != [0, 3, 6, 8, 10, 12]  # not uniform
    ow = pol["oracle-window"]["layouts"]
    assert all(ow[k] == ow[k - 1] for k in range(1, 10) if k % 3)
    for key in ("speedup_second_half", "speedup_vs_best_static_second_half", "best_static_second_half",
                "capture_oracle", "capture_oracle_window"):
        assert all(key in p for p in doc["policies"])
    assert dynmo_main([*base[:-3], "--policies", "uniform,optimal,oracle-window,oracle"]) == 0
    out = capsys.readouterr().out
    assert "\noracle-window " in out and "2nd best" in out and "cap ow" in out
    for bad, words in ((["--start", "bogus"], "--start"), (["--start", ""], "--start"),
                       (["--oracle-window", "0"], "--oracle-window"), (["--oracle-window", "1.5"], "--oracle-window"),
                       (["--policies", "oracle-window+repack"], "cannot re-pack")):
        assert dynmo_main([*base, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dynmo simulate: error:") and words in err and err.count("\n") == 1, err
