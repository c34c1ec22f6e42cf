"""The controller's policy (pure) and the DynMo loop end to end on the skewed model."""

import random
from statistics import median

import pytest
from hypothesis import assume, given, settings, strategies as st

from dynmo.balance import Problem, balance
from dynmo.config import BalanceConfig, NoiseConfig
from dynmo.controller import CONFIRM, Controller, candidates
from dynmo.dynamics.noise import Draws, recorded_costs
from dynmo.layout import Layout
from dynmo.sim.replay import ReplayOptions, replay, replay_balance
from dynmo.sim.trace import load_trace
from tests.conftest import SKEWED_COSTS, metrics, run_train


def test_auto_follows_a_step_change_within_a_window():
    c = Controller(BalanceConfig(when="auto", window=3, horizon=100), fixed_s=0.0)
    lay = Layout((0, 3, 6))
    for _ in range(5):
        c.observe([1.0] * 6)
        assert c.decide(10, lay, [1] * 6, 100) is None  # balanced: nothing to gain
    for _ in range(2):  # one or two steps of change: could be a spike, or a slow phase
        c.observe([1.0, 4.0, 4.0, 1.0, 1.0, 1.0])
        assert c.decide(10, lay, [1] * 6, 100) is None
    assert c.forecast() == [1.0, 4.0, 4.0, 1.0, 1.0, 1.0]  # the median follows in two steps
    c.observe([1.0, 4.0, 4.0, 1.0, 1.0, 1.0])  # every step of the window shows it: a proposal
    assert c.decide(10, lay, [1] * 6, 100) is None
    c.observe([1.0, 4.0, 4.0, 1.0, 1.0, 1.0])  # confirmed on two fresh steps
    assert c.decide(11, lay, [1] * 6, 100) is None
    c.observe([1.0, 4.0, 4.0, 1.0, 1.0, 1.0])
    d = c.decide(12, lay, [1] * 6, 100)
    assert d is not None and d.layout == Layout((0, 2, 6)) and d.predicted_bottleneck == 7.0


@pytest.mark.parametrize("event_runs_the_old_model", [False, True])
def test_an_announced_change_moves_on_its_first_window(event_runs_the_old_model):
    """A dynamism event says what changed and when: its first window's steps are the evidence
    (the paper's profile, then rebalance), with no fresh steps to wait for, 2 steps before the
    same change unannounced (above). Whether the event's step runs the old model or the new
    one, the move comes `window` steps after the change took effect."""
    def first_move(announce: bool) -> int | None:
        c = Controller(BalanceConfig(when="auto", window=3, horizon=100), fixed_s=0.0)
        lay, changed = Layout((0, 3, 6)), [1.0, 4.0, 4.0, 1.0, 1.0, 1.0]
        for _ in range(5):
            c.observe([1.0] * 6)
            assert c.decide(10, lay, [1] * 6, 100) is None
        if event_runs_the_old_model:
            c.observe([1.0] * 6, changed=announce)
            assert c.decide(10, lay, [1] * 6, 100) is None
        for k in range(8):
            c.observe(changed, changed=announce and not event_runs_the_old_model and k == 0)
            d = c.decide(10, lay, [1] * 6, 100)
            if d is not None:
                assert d.layout == Layout((0, 2, 6)) and d.reason == "rebalance"
                return k + 1  # steps of the changed model observed
        return None

    assert first_move(announce=True) == 3
    assert first_move(announce=False) == 3 + CONFIRM


def test_an_announced_change_still_needs_its_window_to_show_the_gain():
    """The fast path reads the window's steps with the same test: a change whose first window is
    noisy waits for more evidence like any other (the same change, clean, moves at once)."""
    def first_move(noise: float) -> int | None:
        rng = random.Random(0)
        c = Controller(BalanceConfig(when="auto", window=3, horizon=100), fixed_s=0.0)
        lay = Layout((0, 3, 6))
        for _ in range(4):
            c.observe([1.0] * 6)
        for k in range(12):
            c.observe([rng.uniform(1 - noise, 1 + noise) * x for x in (1.0, 4.0, 4.0, 1.0, 1.0, 1.0)], changed=k == 0)
            if c.decide(10, lay, [1] * 6, 100) is not None:
                return k + 1
        return None

    assert first_move(0.0) == 3
    assert (first_move(0.3) or 99) > 3  # +-30% per layer: not within the first window


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 6), st.integers(6, 30), st.floats(0.0, 0.03), st.integers(0, 2**31))
def test_auto_ignores_noise(stages, n, noise, seed):
    """Balanced costs with up to ±3% noise never beat the 5% hysteresis."""
    rng = random.Random(seed)
    layout = Layout.uniform(n, stages)
    if n % stages:
        return  # uniform is only balanced when stages divide the layers
    c = Controller(BalanceConfig(when="auto", window=3, min_gain=0.05), fixed_s=0.0)
    for step in range(20):
        c.observe([1.0 + rng.uniform(-noise, noise) for _ in range(n)])
        assert c.decide(step, layout, [0] * n, 100) is None


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31))
def test_history_times_simulate_each_step_once_with_its_own_forward_backward_split(seed):
    """The evidence's step times on the history, cached across decisions, are what simulating
    each step afresh gives, split forward/backward as measured on that step, for any layouts,
    as steps enter and leave the history."""
    rng = random.Random(seed)
    n, stages = rng.randint(4, 9), rng.randint(2, 3)
    c = Controller(BalanceConfig(when="auto", window=3), rng.choice([2, 4, 8]), fixed_s=0.0)
    layouts = [Layout.uniform(n, stages), candidates.generated(Problem(costs=[rng.random() + 0.1 for _ in range(n)],
                                                                       stages=stages), "optimal")]
    shares = []
    for _ in range(rng.randint(3, 30)):
        fwd = [rng.uniform(0.1, 1.0) for _ in range(n)]
        bwd = [2 * f * rng.uniform(0.5, 1.5) for f in fwd]
        c.model.observe_shares(fwd, bwd, None)
        c.observe([f + b for f, b in zip(fwd, bwd)])
        shares = (shares + [(c.model.fwd_share, c.model.wgrad_share)])[-len(c.history):]
        got = c.history_times(layouts)
        steps = [list(h) for h in c.history]
        for lay, times in zip(layouts, got):
            want = c.model.steps_s([c.problem(s, stages, lay) for s in steps], [lay] * len(steps), c.microbatches,
                                   shares)
            assert times == pytest.approx(want.tolist(), rel=1e-12)


def test_auto_ignores_a_forecast_gain_no_observed_step_shows():
    """The per-layer median can favour a layout that loses on most of the steps it came from
    (per-step noise, the winner's curse): forecast [2, 3, 2, 1, 1, 1] says (0, 2, 6) cuts the
    bottleneck 7 -> 5, but on two of the three steps themselves it loses."""
    c = Controller(BalanceConfig(when="auto", window=3), fixed_s=0.0)
    lay = Layout((0, 3, 6))
    for costs in ([1, 1, 2, 1, 2, 1], [2, 3, 3, 1, 1, 1], [2, 3, 1, 3, 1, 3]):
        c.observe([float(x) for x in costs])
    assert c.forecast() == [2, 3, 2, 1, 1, 1]
    gains = c.per_step_gains(lay, Layout((0, 2, 6)))
    assert gains[0] < 0 and gains[1] > 0.05 and gains[2] < 0
    assert c.decide(3, lay, [0] * 6, 100) is None


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 4), st.integers(2, 5), st.floats(0.0, 0.03), st.floats(2.0, 6.0), st.integers(0, 2**31))
def test_auto_follows_a_clean_step_change_within_a_window_after_noise(stages, per_stage, noise, factor, seed):
    """After 10 steps of noisy balanced costs, one layer becoming `factor` times dearer is
    proposed once a window of 3 steps shows it and acted on after two fresh steps confirm it,
    not before (when rebalancing the noise-free costs saves >= 10% of the simulated step time of
    the schedule, 1F1B with 8 microbatches: clear of the 5% floor and of what ±3% noise does)."""
    rng = random.Random(seed)
    n = stages * per_stage
    layout = Layout.uniform(n, stages)
    hot = rng.randrange(n)
    clean = [factor if i == hot else 1.0 for i in range(n)]
    c = Controller(BalanceConfig(when="auto", window=3, min_gain=0.05), 8, fixed_s=0.0)
    # rebalancing the noise-free costs saves >= 10% of the simulated step time
    problem = c.problem(clean, stages, layout)
    _, t_best = candidates.best_layout(problem, "optimal", layout, c.steps_s)
    assume(t_best <= 0.9 * c.step_s(problem, layout))

    def step(changed: bool) -> list[float]:
        return [(factor if changed and i == hot else 1.0) * (1.0 + rng.uniform(-noise, noise)) for i in range(n)]

    for s in range(10):
        c.observe(step(False))
        assert c.decide(s, layout, [0] * n, 100) is None
    for s in (10, 11, 12, 13):
        c.observe(step(True))
        assert c.decide(s, layout, [0] * n, 100) is None  # a spike, a slow phase, or unconfirmed
    c.observe(step(True))
    d = c.decide(14, layout, [0] * n, 100)
    assert d is not None and d.predicted_step_s < d.current_step_s


def test_auto_waits_when_migration_costs_more_than_it_saves():
    # layout (0,3,4) has loads [4, 1], (0,2,4) has [3, 2]: with 4 microbatches of 1F1B (a third
    # of each cost forward) the simulated steps take 16 s and 13 s: saves 3 s x 10 steps = 30 s
    lay = Layout((0, 3, 4))
    c = Controller(BalanceConfig(when="auto", window=1, horizon=10), fixed_s=5.0)
    c.observe([1.0, 2.0, 1.0, 1.0])
    assert c.decide(0, lay, [0] * 4, 10) is None  # proposed; a window of 1 needs 1 fresh step
    c.observe([1.0, 2.0, 1.0, 1.0])
    d = c.decide(1, lay, [0] * 4, 10)
    assert d is not None and d.layout == Layout((0, 2, 4)) and d.predicted_gain_s == pytest.approx(30.0)
    assert (d.current_step_s, d.predicted_step_s) == (pytest.approx(16.0), pytest.approx(13.0))
    c = Controller(BalanceConfig(when="auto", window=1, horizon=10), fixed_s=100.0)  # a 100 s migration is not worth it
    c.observe([1.0, 2.0, 1.0, 1.0])
    assert c.decide(0, lay, [0] * 4, 10) is None


def test_every_n_steps():
    c = Controller(BalanceConfig(when="every", every=4))
    c.observe([1.0, 3.0, 1.0, 1.0])
    lay = Layout((0, 3, 4))  # loads [5, 1]; (0, 2, 4) gives [4, 2]
    assert [s for s in range(1, 13) if c.decide(s, lay, [0] * 4, 100)] == [4, 8, 12]


SKEWED = ["--steps", "20", "--skew.blocks", "0", "--skew.factor", "16", "--skew.start_step", "3",
          "--parallel.layout", "0,3,6"]


@pytest.fixture(scope="module")
def static_skewed(tmp_path_factory) -> list[dict]:
    """Block 0 does 16x the MLP work from step 3, under `E t t | t t L`: the static run's metrics
    (a balanced run's losses must be its losses, bit for bit)."""
    out = tmp_path_factory.mktemp("skewed") / "static"
    run_train(out, *SKEWED)
    return metrics(out)


def balanced_skewed(out, when: str, *extra: str) -> list[dict]:
    """The skewed run with `balance.when = when`. It decides on injected costs (SKEWED_COSTS:
    moving block 1 to stage 1 cuts the slowest stage from 19 to 15 ms) and free links, so what
    it decides does not depend on this machine's load; the skew's compute and its dynamism
    event are real."""
    run_train(out, *SKEWED, "--balance.when", when, "--balance.links", "free", *extra, env=SKEWED_COSTS)
    return metrics(out)


@pytest.mark.dist
def test_skewed_model_is_rebalanced_within_a_window_trains_the_same_and_its_trace_replays_the_move(tmp_path, static_skewed):
    trace_path = tmp_path / "run.trace.jsonl"
    auto = balanced_skewed(tmp_path / "auto", "auto", "--trace", str(trace_path))
    assert [r["loss"] for r in auto] == [r["loss"] for r in static_skewed]  # bitwise
    moves = [r for r in auto if any(e["type"] == "migration" for e in r["events"])]
    seen = "\n".join(f"step {r['step']} {r['layout']}: {[round(c * 1e3, 2) for c in r['layer_cost_s']]} ms" for r in auto[:10])
    # the skew announces itself (a dynamism event at step 3), so its first window of 3 skewed
    # steps (3, 4, 5) is the evidence and the move is applied before step 6, with no fresh
    # steps to wait for (what the run does once measured step times judge the move is this
    # machine's business, and not asserted)
    assert moves and moves[0]["step"] == 3 + 3, f"per-layer costs:\n{seen}"
    # the chosen layout is the optimum of the forecast that proposed it (median of 3 steps' costs)
    first = moves[0]["step"]
    window = [r["layer_cost_s"] for r in auto[3:first]]  # every post-skew step before the move
    forecast = [median(col) for col in zip(*window)]
    ev = next(e for e in moves[0]["events"] if e["type"] == "migration")
    speeds, transfer, back = ev["speeds"], ev["transfer_s"], ev["transfer_back_s"]  # measured at start-up
    forecast = [c * speeds[s] for c, s in zip(forecast, Layout((0, 3, 6)).owner())]
    best = balance(Problem(costs=forecast, stages=2, current=[0, 3, 6], speeds=speeds, transfer=transfer,
                           transfer_back=back), "optimal")
    assert moves[0]["layout"] == best.boundaries
    assert ev["predicted_bottleneck_s"] < ev["current_bottleneck_s"]
    assert ev["measured_bottleneck_s"] > 0 and ev["decide_s"] >= 0 and ev["profile_s"] >= 0

    # The replay of the run's trace at the traced shape, with the same [balance] section, decides
    # the same first migration at the same step. (Later decisions may differ only through the
    # migration cost model, which the run refits from measured seconds and the replay from
    # simulated ones, and through the judge, which reads measured step times.) Links are free in
    # both: the replay has no measured link times.
    opts = ReplayOptions(balance=replay_balance(when="auto"), initial="uniform", charge_decide=False)
    (res,) = replay(load_trace(trace_path), None, None, ["optimal"], opts)
    assert res.layouts[0] == [0, 3, 6]  # uniform, for 6 layers on 2 stages, is the run's layout
    changes = [(k, res.layouts[k]) for k in range(1, len(res.layouts)) if res.layouts[k] != res.layouts[k - 1]]
    assert changes and changes[0] == (first, moves[0]["layout"]), f"replay {changes} vs run at {first}"


def best_by_brute_force(c: Controller, costs: list[float], stages: int) -> Layout:
    """The layout of least simulated step time among every contiguous layout."""
    from itertools import combinations

    n = len(costs)
    layouts = [Layout((0, *cut, n)) for cut in combinations(range(1, n), stages - 1)]
    return min(layouts, key=lambda lay: c.step_s(c.problem(costs, stages, lay), lay))


def test_slow_worker_and_slow_link_get_less_work():
    # 9 equal layers; worker 1 runs at half speed: it gets fewer layers than worker 0, and the
    # layout is the best of all layouts in the schedule's simulated step time
    c = Controller(BalanceConfig(when="every", every=1), speeds=[1.0, 0.5])
    c.observe([1.0] * 9)
    d = c.decide(1, Layout((0, 5, 9)), [0] * 9, 100)
    assert d.layout.boundaries[1] >= 6 and d.layout == best_by_brute_force(c, [1.0] * 9, 2)
    # a slow link (2 s per microbatch each way) between two stages of equal layers: whatever
    # the controller picks is the simulated optimum
    c = Controller(BalanceConfig(when="every", every=1), transfer=[2.0], transfer_back=[2.0])
    c.observe([1.0] * 8)
    d = c.decide(1, Layout((0, 4, 8)), [0] * 8, 100)
    assert (d.layout if d else Layout((0, 4, 8))) == best_by_brute_force(c, [1.0] * 8, 2)


def test_memory_cap_is_respected():
    # the cheapest split (0, 5, 6) puts 5 layers on worker 0, which can hold only 3
    c = Controller(BalanceConfig(when="every", every=1), memory=[1.0] * 6, capacity=3.0)
    c.observe([1.0, 1.0, 1.0, 1.0, 1.0, 5.0])
    assert c.decide(1, Layout((0, 3, 6)), [0] * 6, 100) is None  # (0, 3, 6) is the best that fits
    c.capacity = None
    assert c.decide(2, Layout((0, 3, 6)), [0] * 6, 100).layout.boundaries == (0, 5, 6)


def test_repack_decision_and_microbatch_retuning():
    from dynmo.controller import retune_microbatches

    c = Controller(BalanceConfig(when="every", every=1, window=1, repack=True, repack_tolerance=0.3))
    four = Layout((0, 1, 2, 3, 5))
    c.observe([4.0, 4.0, 4.0, 4.0, 4.0])
    d = c.decide(1, four, [0] * 5, 100)
    assert d is None or d.reason == "rebalance"  # the model has not shrunk: keep every worker
    c.observe([4.0, 1.0, 1.0, 1.0, 1.0])  # it shrank; layer 0 bounds any layout
    d = c.decide(2, four, [0] * 5, 100)
    # simulated 1F1B, 4 microbatches: 4 stages [4, 1, 1, 2] take 16 s, the best 4-stage layout
    # too; 2 stages [4, 4] take 20 s (25% more, within the 30% tolerance); 1 stage 32 s
    assert d.released == 2 and d.layout.boundaries == (0, 1, 5) and d.predicted_bottleneck == 4.0
    assert d.predicted_step_s == pytest.approx(20.0) and d.best_step_s == pytest.approx(16.0) and d.reason == "repack"
    assert retune_microbatches(8, 4, 2, 1) == 2  # keeps the in-flight activations of 2 stages
    assert retune_microbatches(16, 8, 4, 2) == 4  # bubble 3/11 -> 1/5, in flight 4/8 -> 2/4
    assert retune_microbatches(6, 3, 3, 3) == 3


def test_re_packing_reads_every_observed_step_not_only_the_window():
    """Released workers never come back: a model whose last layers were heavy on most of the
    evidence's steps keeps its workers, though its last window alone would re-pack it (two
    stages, 25% slower than four, within the 30% tolerance), until 80% of the observed steps
    show the re-pack fits."""
    c = Controller(BalanceConfig(when="auto", window=3, repack=True, repack_tolerance=0.3))
    four, heavy, light = Layout((0, 1, 2, 3, 5)), [1.0, 1.0, 1.0, 8.0, 8.0], [4.0, 1.0, 1.0, 1.0, 1.0]
    for _ in range(7):
        c.observe(heavy)
    decided = []
    for step in range(7, 40):
        c.observe(light)
        d = c.decide(step + 1, four, [0] * 5, 100)
        if d is not None:
            decided.append((step + 1, d.reason, d.layout.boundaries))
            break
    # the history holds 20 steps: at most 4 of them heavy once 16 light ones were observed
    assert decided == [(7 + 16, "repack", (0, 1, 5))]


@pytest.mark.dist
def test_auto_does_not_migrate_a_balanced_model_under_noise(tmp_path):
    # E t t t | t t t L: both stages hold three blocks, and with the head half a block's cost
    # this layout runs the fastest simulated 1F1B step, by 1.4% (with a heavier head, one more
    # block on stage 0 would): only noise could say otherwise. The injector adds seeded noise
    # as a loaded machine would (every layer +0..60% per microbatch, straggler microbatches, a
    # 3-step slow phase of rank 1): real work in the run, and, on the injected costs, the costs
    # the controller reads, so that what it decides does not depend on this machine's load.
    run_train(tmp_path, "--steps", "60", "--model.n_layers", "6", "--balance.when", "auto", "--balance.links", "free",
              "--noise.enabled", "true", "--noise.seed", "7", "--noise.jitter", "0.3", "--noise.straggler_prob", "0.05",
              "--noise.slow_rank", "1", "--noise.slow_every", "25", "--noise.slow_steps", "3",
              env={"DYNMO_COSTS": "0:0.3,10,10,10,10,10,10,5"})
    recs = metrics(tmp_path)
    assert len(recs) == 60
    assert not [r["step"] for r in recs if any(e["type"] == "migration" for e in r["events"])]
    # the controller read the injected costs through the noise's own draws
    draws = Draws(NoiseConfig(enabled=True, seed=7, jitter=0.3, straggler_prob=0.05, slow_rank=1, slow_every=25,
                              slow_steps=3))
    base, ranks = [c / 1e3 for c in (0.3, 10, 10, 10, 10, 10, 10, 5)], [0, 0, 0, 0, 1, 1, 1, 1]
    for r in recs:
        assert r["layer_cost_s"] == recorded_costs(draws, r["step"], base, ranks, r["microbatches"])


@pytest.mark.dist
def test_dynamism_trigger_rebalances_after_profiling_the_change(tmp_path, static_skewed):
    # the paper's Algorithm 1: profile the changed model (a window of 3 steps), then rebalance
    static, dyn = static_skewed, balanced_skewed(tmp_path, "dynamism")
    assert [r["loss"] for r in dyn] == [r["loss"] for r in static]
    moved = [r["step"] for r in dyn if any(e["type"] == "migration" for e in r["events"])]
    assert moved[:1] == [6]  # a later revert would be the judge's reading of this machine's step times
    # the layout is the optimum of the profiled window's forecast (asserted on the recorded
    # costs, not on this machine's timing of the steps after the move)
    ev = next(e for e in dyn[6]["events"] if e["type"] == "migration")
    forecast = [median(col) for col in zip(*(r["layer_cost_s"] for r in dyn[3:6]))]
    forecast = [c * ev["speeds"][s] for c, s in zip(forecast, Layout((0, 3, 6)).owner())]
    best = balance(Problem(costs=forecast, stages=2, current=[0, 3, 6], speeds=ev["speeds"],
                           transfer=ev["transfer_s"], transfer_back=ev["transfer_back_s"]), "optimal")
    assert dyn[6]["layout"] == list(best.boundaries) != [0, 3, 6]


def test_re_packs_keep_their_tolerance_against_the_run_s_first_workers():
    """Six equal layers, 16 microbatches: 3 stages run 4% slower than 4, and 2 stages 42% slower
    than 3 but 47% slower than 4. With a 45% tolerance the run re-packs 4 -> 3 and then stays:
    measured against today's 3 workers, a second re-pack would have looked within tolerance and
    the two would have cost more than the tolerance together."""
    from dynmo.controller.repack import repack

    cfg = BalanceConfig(when="every", every=1, window=1, repack=True, repack_tolerance=0.45, repack_shrink=0.0)
    c = Controller(cfg, microbatches=16)
    costs = [1.0] * 6
    c.observe(costs)
    d = c.decide(1, Layout.uniform(6, 4), [0] * 6, 100)
    assert d is not None and d.reason == "repack" and d.layout == Layout.uniform(6, 3)
    c.applied(16)
    c.observe(costs)
    assert c.decide(2, Layout.uniform(6, 3), [0] * 6, 100) is None
    # what today's workers alone would have allowed
    r = repack(cfg, costs, Layout.uniform(6, 3), sum(costs), c.problem, c.steps_s, [costs], 16)
    assert r is not None and r.layout.num_stages == 2
    assert r.step_s > (1 + cfg.repack_tolerance) * d.best_step_s
