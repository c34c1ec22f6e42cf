"""auto's pre-registered fallbacks (dynmo.controller.fallback): the test fires on a lasting change
beyond the noise and not on noise alone, transients or a run of steps that agree by chance, on
synthetic gains over many seeds; and the controller moves to its start at once when the costs
come back to it, and not under the noise injector with a fallback within 0.3 % of its layout.
Nothing here reads this machine's timing."""

from __future__ import annotations

import numpy as np
import pytest

from dynmo.config import BalanceConfig, load_config
from dynmo.controller import Controller, evidence, fallback
from dynmo.dynamics.noise import Draws, recorded_costs
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.plan import layer_flops
from dynmo.record import StepRecord
from tests.conftest import ROOT, load_benchmark

SHORT = fallback.short_steps(3)  # the default window's
MARGIN = 0.01


def scan(gains: np.ndarray, confidence: float = 0.95) -> int | None:
    """The first step at which some fallback passes, as the controller looks: every step, on the
    last EVIDENCE_STEPS steps, at its confidence for the block (gains: fallbacks x steps)."""
    f, steps = gains.shape
    for k in range(SHORT, steps + 1):
        blocks = -(-k // evidence.EVIDENCE_STEPS)
        alpha = fallback.level(1 - (1 - confidence) / blocks, f)
        for row in gains:
            if fallback.faster(row[max(0, k - evidence.EVIDENCE_STEPS):k].tolist(), SHORT, MARGIN, alpha):
                return k
    return None


def test_a_lasting_change_far_beyond_the_noise_passes_on_the_shortest_run():
    for seed in range(50):
        rng = np.random.default_rng(seed)
        g = np.concatenate([rng.normal(-0.02, 0.02, 12), rng.normal(0.3, 0.02, 12)])
        assert scan(g[None, :]) == 12 + SHORT


def test_a_modest_lasting_gain_passes_once_enough_steps_carry_it():
    firsts = []
    for seed in range(30):
        rng = np.random.default_rng(seed)
        g = np.concatenate([rng.normal(-0.01, 0.02, 10), rng.normal(0.05, 0.02, 30)])
        firsts.append(scan(g[None, :]))
    assert all(k is not None and 10 + SHORT <= k <= 10 + 4 * SHORT for k in firsts)


def test_the_lengths_scanned_and_their_shares_of_alpha():
    """Every short run up to 2 short - 1 steps at the share it has among every length, the longer
    ones on a doubling grid at larger shares, all of them summing to at most 1 (Bonferroni); with
    `whole`, every step there is is the last length, the shares still summing to at most 1."""
    for short in range(1, 8):
        for total in range(short, 64):
            n, a = evidence.scanned(short, total), evidence.shares(short, total)
            assert n[0] == short and n[-1] <= total and list(n) == sorted(set(n.tolist()))
            assert set(range(short, min(2 * short, total + 1))) <= set(n.tolist())
            grid = [k // short for k in n if k >= 2 * short]
            assert all(k % short == 0 for k in n if k >= 2 * short) and grid == [2 ** j for j in range(1, len(grid) + 1)]
            assert a.sum() <= 1 + 1e-12 and len(a) == len(n)
            each = 1 / (total - short + 1)
            assert np.allclose(a[n < 2 * short], each) and np.all(a[n >= 2 * short] >= each - 1e-12)
            w, b = evidence.scanned(short, total, whole=True), evidence.shares(short, total, whole=True)
            assert w[-1] == total and set(n.tolist()) <= set(w.tolist()) and list(w) == sorted(set(w.tolist()))
            assert b.sum() <= 1 + 1e-12 and len(b) == len(w) and np.all(b > 0)


@pytest.mark.parametrize("mean,most", [(0.0, 0.0), (MARGIN, 0.15)])
def test_noise_alone_passes_within_the_budget(mean, most):
    """Three fallbacks, 200 steps, gains of spread 3 %: never where they are no faster than the
    current layout; where they are exactly the margin faster, within (1 - confidence) x H_10."""
    runs = 40
    hits = sum(scan(np.random.default_rng(seed).normal(mean, 0.03, (3, 200))) is not None for seed in range(runs))
    assert hits <= most * runs


def test_a_transient_as_long_as_the_window_rarely_passes():
    """Three steps of 5 times the gains' spread (the noise injector's slow phases) on noise."""
    runs, hits = 60, 0
    for seed in range(runs):
        g = np.random.default_rng(1000 + seed).normal(0.0, 0.03, 40)
        g[20:23] += 0.15
        hits += scan(g[None, :]) is not None
    assert hits <= 0.03 * runs


def test_a_run_cannot_claim_less_noise_than_the_steps_before_it_showed():
    close = [0.0305, 0.0384, 0.0374, 0.0339, 0.0339]  # five noisy steps that agreed by chance
    noisy = np.random.default_rng(3).normal(0.0, 0.04, 15).tolist()
    calm = np.random.default_rng(3).normal(0.0, 0.002, 15).tolist()
    alpha = fallback.level(0.95, 1)
    assert not fallback.faster(noisy + close, SHORT, MARGIN, alpha)
    assert fallback.faster(calm + close, SHORT, MARGIN, alpha)  # after calm steps the same run is a change


def test_an_earlier_change_among_the_steps_before_is_not_noise():
    """The steps before a run set its noise from their successive differences: two calm regimes 8 %
    apart before it (an earlier change) leave a lasting 6 % gain as clear as one calm regime does,
    where their spread about one mean (5 %) hid it; a noisy regime before it still does."""
    rng = np.random.default_rng(5)
    run = rng.normal(0.06, 0.01, 8).tolist()
    two = np.concatenate([rng.normal(-0.10, 0.01, 8), rng.normal(-0.02, 0.01, 8)]).tolist()
    one = rng.normal(-0.02, 0.01, 16).tolist()
    noisy = rng.normal(-0.02, 0.05, 16).tolist()
    alpha = fallback.level(0.95, 1)
    assert np.std(two) > 0.035  # about one mean, the earlier change looks like noise
    assert fallback.faster(one + run, SHORT, MARGIN, alpha)
    assert fallback.faster(two + run, SHORT, MARGIN, alpha)
    assert not fallback.faster(noisy + run, SHORT, MARGIN, alpha)


def test_the_shortest_run_needs_every_step_beyond_the_margin():
    before = [0.0] * 8
    alpha = fallback.level(0.95, 1)
    assert fallback.faster(before + [0.2, 0.2, 0.2, 0.2], SHORT, MARGIN, alpha)
    assert not fallback.faster(before + [0.2, 0.2, 0.2, MARGIN], SHORT, MARGIN, alpha)
    # with nothing before it to show the noise (right after a migration), a run is held to a
    # level EVIDENCE_STEPS times stricter
    run = [0.055, 0.035, 0.045, 0.065]
    assert fallback.faster(before + run, SHORT, MARGIN, alpha)
    assert not fallback.faster(run, SHORT, MARGIN, alpha)


def test_two_steps_far_beyond_the_noise_move_at_once():
    """A saving of a quarter or more on each of the last two steps is enough; one such step, or a
    second one below it, is not."""
    assert fallback.FAR_GAIN == 0.25
    assert fallback.far_faster([0.0] * 5 + [0.3, 0.26])
    assert not fallback.far_faster([0.0] * 5 + [0.3, 0.2])
    assert not fallback.far_faster([0.4])


def test_a_layout_a_rebalance_chose_is_left_after_one_step_far_beyond_the_noise():
    """One step on which a fallback saved FAR_ONE (0.4) or more is enough to leave a layout a
    rebalance chose (its pattern may just have ended), not one fixed before any cost was seen."""
    assert fallback.FAR_ONE == 0.4
    assert fallback.far_faster([0.0] * 5 + [0.45], chosen=True) == 1
    assert not fallback.far_faster([0.0] * 5 + [0.45])
    assert not fallback.far_faster([0.0] * 5 + [0.35], chosen=True)
    assert fallback.far_faster([0.0] * 5 + [0.3, 0.45], chosen=True) == 2  # the two-step rule as before
    assert not fallback.far_faster([0.45], chosen=True)  # the move's first step: its warm-up


def test_the_far_rules_stand_well_above_what_the_noise_injector_shows():
    """The reason the far rules' thresholds give, checked: under configs/noisy.toml's injected
    costs and noise (12 of the benchmark's 48 seeds), no fixed layout saves FAR_ONE / 1.7 of the
    shipped one's step time on one step, nor FAR_GAIN / 1.6 on each of two in a row; and the
    benchmark's runs of k steps are the brute force's."""
    bench = load_benchmark("bench_far_noise")
    rng = np.random.default_rng(0)
    for _ in range(50):
        x = rng.normal(0.0, 0.1, int(rng.integers(1, 30)))
        want = [max((min(x[i:i + k]) for i in range(len(x) - k + 1)), default=float("-inf")) for k in range(1, 5)]
        assert bench.longest_runs(x, 4) == pytest.approx(want)
    one, two = bench.injector(12, 200, 2)[0]
    assert 0.1 < one < fallback.FAR_ONE / 1.7 and 0.05 < two < fallback.FAR_GAIN / 1.6
    assert bench.main(["--seeds", "0"]) == 2


# ms per microbatch: E, 8 blocks, the head at half a block (the injected costs of configs/noisy.toml)
INJECTED = [0.3] + [10.0] * 8 + [5.0]


def _moves(costs_at, steps: int, fallbacks: bool = True) -> list[tuple[int, tuple[int, ...], str]]:
    c = Controller(BalanceConfig(when="auto"), 4, fixed_s=0.0, fallback=fallbacks)
    lay, moves = Layout((0, 5, 10)), []
    for step in range(steps):
        d = c.decide(step, lay, [0] * 10, steps - step)
        if d is not None:
            moves.append((step, d.layout.boundaries, d.reason))
            lay = d.layout
            c.applied(4)
        c.observe(costs_at(step), layout=lay)
    return moves


def test_the_controller_falls_back_to_its_start_when_the_costs_return():
    """Blocks 4-7 cost 3x until step 40 (the controller moves work off them), then as before: the
    start is 10 % faster, and the controller goes back to it `SHORT` steps after the change, where
    the window's optimum waits for the window and two confirming steps."""
    rng = np.random.default_rng(0)
    noise = rng.lognormal(0.0, 0.01, (60, 10))

    def costs(step):
        return [(x * (3.0 if step < 40 and 5 <= i <= 8 else 1.0)) * n / 1e3
                for i, (x, n) in enumerate(zip(INJECTED, noise[step]))]

    with_fb = _moves(costs, 60)
    assert with_fb[0][0] < 10 and with_fb[0][1] != (0, 5, 10)  # it followed the first costs
    after = [m for m in with_fb if m[0] >= 40]
    assert after[0] == (40 + SHORT, (0, 5, 10), "fallback")
    without = [m for m in _moves(costs, 60, fallbacks=False) if m[0] >= 40]
    assert without[0][0] > 40 + SHORT and without[0][2] == "rebalance"


@pytest.mark.parametrize("seed", range(2))
def test_no_fallback_under_the_noise_injector(seed):
    """configs/noisy.toml on its injected costs, read through the noise's draws, with a params
    prior whose layout (E + 5 blocks | 3 blocks + L) is within 0.3 % of the shipped one: slow
    phases of rank 1 make it 13 % faster for 3 steps every 50, and the per-step gains spread 3 %."""
    cfg = load_config(ROOT / "configs" / "noisy.toml")
    cfg.noise.seed = seed
    draws, m = Draws(cfg.noise), cfg.train.microbatches
    loop = DynmoLoop(cfg.balance, microbatches=m, schedule=cfg.parallel.schedule,
                     layer_params=[0] + [1] * 8 + [2], layer_flops=layer_flops(cfg))
    layout = Layout((0, 5, 10))
    assert Layout((0, 6, 10)) in loop.controller.prior_layouts(loop.controller.problem(INJECTED, 2), 2)
    for step in range(200):
        assert loop.decide(step, layout, 200 - step) is None
        seen = recorded_costs(draws, step, [c / 1e3 for c in INJECTED], list(layout.owner()), m)
        loop.observe(StepRecord(step=step, layout=list(layout.boundaries), layer_cost_s=seen, microbatches=m))
