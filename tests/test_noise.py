"""The seeded noise injector (`[noise]`, dynmo/dynamics/noise.py): its draws are reproducible,
follow the config and do not depend on the layout; its hooks change no output, add work only
on training forwards and follow layers that move; end to end it trains bitwise like the run
without noise; bad values fail before any work with one line.

No assertion reads the wall clock: the burned time is asserted on what the case reports
(`noise_extra_s`, the requested work), so no test depends on the machine's speed."""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo.config import Config, ConfigError, NoiseConfig, load_config
from dynmo.dynamics.noise import Burner, Draws, Noise, check_options, recorded_costs
from dynmo.dynamics.registry import CASES
from dynmo.model import stats
from dynmo.model.layers import build_layer, layer_specs
from tests.conftest import ROOT, metrics, run_train
from tests.test_bad_input import dynmo_train

keys = st.integers(min_value=0, max_value=10_000)


def draws(**kw) -> Draws:
    return Draws(NoiseConfig(enabled=True, **kw))


# ---- the draws -------------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(seed=keys, step=keys, layer=st.integers(0, 100), mb=st.integers(0, 64), process=st.integers(0, 7))
def test_draws_are_reproducible_and_depend_on_the_seed(seed, step, layer, mb, process):
    kw = dict(jitter=0.3, straggler_prob=0.5, slow_rank=1, slow_every=4, slow_steps=2)
    a, b, other = draws(seed=seed, **kw), draws(seed=seed, **kw), draws(seed=seed + 1, **kw)
    assert a.extra(step, layer, mb, process, 1) == b.extra(step, layer, mb, process, 1)
    assert a.straggler(step, process, mb) == b.straggler(step, process, mb)
    assert 0.0 <= a.jitter(step, layer, mb) <= 0.6
    assert a.jitter(step, layer, mb) != other.jitter(step, layer, mb)  # continuous draws: equal only by accident


def test_recorded_costs_are_the_median_of_each_layers_draws():
    """What runs with injected costs record under noise: per layer, its cost times the median
    of its factors over the step's microbatches, on the rank that holds it."""
    slow = Draws(NoiseConfig(enabled=True, seed=1, slow_rank=1, slow_factor=1.5, slow_every=10, slow_steps=2))
    assert recorded_costs(slow, 11, [1.0, 2.0, 2.0], [0, 0, 1], 4) == [1.0, 2.0, 3.0]  # rank 1's slow phase
    assert recorded_costs(slow, 12, [1.0, 2.0, 2.0], [0, 0, 1], 4) == [1.0, 2.0, 2.0]
    noisy = Draws(NoiseConfig(enabled=True, seed=3, jitter=0.3, straggler_prob=0.2))
    got = recorded_costs(noisy, 5, [1.0, 2.0], [0, 1], 5)
    assert got == [c * statistics.median(noisy.factor(5, i, mb, r, r) for mb in range(5))
                   for i, (c, r) in enumerate(zip([1.0, 2.0], [0, 1]))]
    assert got == recorded_costs(noisy, 5, [1.0, 2.0], [0, 1], 5) != recorded_costs(noisy, 6, [1.0, 2.0], [0, 1], 5)


def test_draws_differ_across_seeds_as_a_whole():
    grid = [(s, i, m) for s in range(5) for i in range(10) for m in range(4)]
    first, second = draws(seed=0, jitter=0.3), draws(seed=1, jitter=0.3)
    assert all(first.jitter(*k) != second.jitter(*k) for k in grid)
    strag0 = [draws(seed=0, straggler_prob=0.5).straggler(s, 0, m) for s in range(50) for m in range(4)]
    strag1 = [draws(seed=1, straggler_prob=0.5).straggler(s, 0, m) for s in range(50) for m in range(4)]
    assert strag0 != strag1


@settings(max_examples=30, deadline=None)
@given(seed=keys, step=keys, layer=st.integers(0, 100), mb=st.integers(0, 64),
       here=st.tuples(st.integers(0, 7), st.integers(0, 3)), there=st.tuples(st.integers(0, 7), st.integers(0, 3)))
def test_a_layers_draw_does_not_depend_on_the_rank_that_holds_it(seed, step, layer, mb, here, there):
    # without the per-process parts a layer's factor is the same on any rank
    d = draws(seed=seed, jitter=0.5)
    assert d.extra(step, layer, mb, *here) == d.extra(step, layer, mb, *there)
    # with them, the per-layer part stays the same: the factors differ only by the per-rank slowdowns
    o = dict(seed=seed, jitter=0.5, straggler_prob=0.5, straggler_factor=3.0, slow_rank=1, slow_factor=1.5,
             slow_every=2, slow_steps=1)
    d = draws(**o)
    per_rank = {1.0, 3.0, 1.5, 4.5}
    ratio_a = d.factor(step, layer, mb, *here) / (1 + d.jitter(step, layer, mb))
    ratio_b = d.factor(step, layer, mb, *there) / (1 + d.jitter(step, layer, mb))
    assert min(per_rank, key=lambda r: abs(r - ratio_a)) == pytest.approx(ratio_a)
    assert min(per_rank, key=lambda r: abs(r - ratio_b)) == pytest.approx(ratio_b)


@settings(max_examples=5, deadline=None)
@given(seed=keys, jitter=st.sampled_from([0.05, 0.3, 1.0]))
def test_jitter_has_the_configured_mean_and_spread(seed, jitter):
    d = draws(seed=seed, jitter=jitter)
    xs = [d.jitter(step, layer, mb) for step in range(50) for layer in range(10) for mb in range(8)]  # 4000 draws
    assert all(0.0 <= x <= 2 * jitter for x in xs)
    # U(0, 2j): mean j, standard deviation 2j / sqrt(12); the mean of 4000 draws is within 6 sigma
    assert statistics.fmean(xs) == pytest.approx(jitter, abs=6 * 2 * jitter / 12**0.5 / 4000**0.5)
    assert statistics.pstdev(xs) == pytest.approx(2 * jitter / 12**0.5, rel=0.1)


@settings(max_examples=5, deadline=None)
@given(seed=keys, prob=st.sampled_from([0.05, 0.2, 0.7]))
def test_straggler_frequency_matches_the_probability(seed, prob):
    d = draws(seed=seed, straggler_prob=prob)
    hits = [d.straggler(step, process, mb) for step in range(200) for process in range(2) for mb in range(10)]
    n = len(hits)  # 4000
    assert sum(hits) / n == pytest.approx(prob, abs=6 * (prob * (1 - prob) / n) ** 0.5)


def test_no_stragglers_at_probability_zero_and_all_at_one():
    assert not any(draws(straggler_prob=0.0).straggler(s, 0, m) for s in range(100) for m in range(4))
    assert all(draws(straggler_prob=1.0).straggler(s, 0, m) for s in range(100) for m in range(4))


def test_a_straggler_slows_every_layer_of_its_process_on_that_microbatch():
    d = draws(seed=3, straggler_prob=0.3, straggler_factor=3.0)
    for step in range(20):
        for mb in range(4):
            factors = {d.factor(step, layer, mb, 1, 1) for layer in range(6)}
            assert factors == ({3.0} if d.straggler(step, 1, mb) else {1.0})


@settings(max_examples=30, deadline=None)
@given(every=st.integers(1, 20), data=st.data())
def test_the_slow_phase_is_exactly_on_the_configured_steps_and_rank(every, data):
    steps = data.draw(st.integers(1, every))
    d = draws(slow_rank=1, slow_factor=1.5, slow_every=every, slow_steps=steps)
    for step in range(3 * every + 2):
        in_phase = any(start <= step < start + steps for start in range(0, step + 1, every))
        assert d.slow(step, 1) == in_phase
        assert d.factor(step, 4, 0, 1, 1) == (1.5 if in_phase else 1.0)
        assert not d.slow(step, 0) and d.factor(step, 4, 0, 0, 0) == 1.0


def test_the_configured_noisy_phase_of_the_shipped_config():
    d = Draws(load_config(ROOT / "configs" / "noisy.toml").noise)
    slow = [s for s in range(120) if d.slow(s, 1)]
    assert slow == [0, 1, 2, 50, 51, 52, 100, 101, 102]
    assert not any(d.slow(s, 0) for s in range(120))


def test_defaults_do_nothing():
    cfg = Config()
    assert not Noise.enabled(cfg)
    d = Draws(cfg.noise)
    assert all(d.extra(s, i, m, r, r) == 0.0 for s in range(5) for i in range(4) for m in range(3) for r in range(2))


def test_noise_runs_after_the_skew_in_the_case_order():
    names = [c.name for c in CASES]
    assert names.index("noise") == names.index("skew") + 1


# ---- the hooks on real layers ----------------------------------------------------------------

class FakeHost:
    """The slice of `Host` the noise case reads: the config, the device, the layers."""

    def __init__(self, cfg: Config, layers: dict):
        self.cfg = cfg
        self._layers = layers
        self.model_group = None

    @property
    def device(self):
        return torch.device("cpu")

    def layers(self):
        return self._layers


def tiny_model(seed: int = 7) -> tuple[Config, dict]:
    cfg = Config()
    cfg.model = dataclasses.replace(cfg.model, n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab_size=64)
    return cfg, {s.index: build_layer(s, cfg.model, seed) for s in layer_specs(cfg.model)}


def run(layers: dict, tokens: torch.Tensor) -> torch.Tensor:
    out = (tokens,)
    for i in sorted(layers):
        out = layers[i](*out)
        out = out if isinstance(out, tuple) else (out,)
    return out[0]


def noisy_case(monkeypatch, cfg: Config, layers: dict, **opts) -> tuple[Noise, list[float]]:
    """A noise case on `layers` whose burner records what it is asked to burn (and burns nothing)."""
    cfg.noise = NoiseConfig(enabled=True, **opts)
    case = Noise(FakeHost(cfg, layers))
    asked: list[float] = []
    monkeypatch.setattr(case.burner, "burn", asked.append)
    return case, asked


def test_hooks_return_the_output_bitwise_and_report_the_requested_work(monkeypatch):
    cfg, layers = tiny_model()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = run(layers, tokens)
    plain_grads = torch.autograd.grad(plain.sum(), list(layers[1].parameters()))
    case, asked = noisy_case(monkeypatch, cfg, layers, jitter=0.5, straggler_prob=0.5, slow_rank=0,
                             slow_every=2, slow_steps=1)
    assert case.before_step(4) == []  # no dynamism events
    for _ in range(3):  # three microbatches
        out = run(layers, tokens)
        assert torch.equal(out, plain)
    assert torch.equal(torch.autograd.grad(out.sum(), list(layers[1].parameters()))[0], plain_grads[0])
    extra = case.layer_stats()["noise_extra_s"]
    assert set(extra) == set(layers)
    assert all(v > 0 for v in extra.values())  # jitter > 0: every layer got work on every microbatch
    assert len(asked) == 3 * len(layers) and sum(asked) == pytest.approx(sum(extra.values()))
    assert case.forwards == {i: 3 for i in layers}


def test_work_is_e_times_three_forward_times(monkeypatch):
    cfg, layers = tiny_model()
    case, _ = noisy_case(monkeypatch, cfg, layers, jitter=0.4, seed=5)
    case.before_step(2)
    e = case.draws.extra(2, 1, 0, 0, 0)
    assert e > 0 and case.burn_seconds(1, 0, 0.01) == pytest.approx(e * 3 * 0.01)


def test_no_work_without_noise_or_outside_training_forwards(monkeypatch):
    cfg, layers = tiny_model()
    tokens = torch.zeros(2, 16, dtype=torch.long)
    case, asked = noisy_case(monkeypatch, cfg, layers)  # enabled, every field at its default: e = 0
    case.before_step(0)
    run(layers, tokens)
    assert asked and not any(asked) and not any(case.layer_stats()["noise_extra_s"].values())

    case, asked = noisy_case(monkeypatch, cfg, layers, jitter=1.0)
    case.before_step(0)
    with torch.no_grad():  # evaluation, probes
        run(layers, tokens)
    with stats.paused():  # a checkpointed block's recomputation
        run(layers, tokens)
    assert asked == [] and case.forwards == {}


def test_the_microbatch_count_restarts_each_step(monkeypatch):
    cfg, layers = tiny_model()
    tokens = torch.zeros(2, 16, dtype=torch.long)
    case, _ = noisy_case(monkeypatch, cfg, layers, jitter=0.3)
    drawn: list[tuple] = []
    real = case.draws.extra
    monkeypatch.setattr(case.draws, "extra", lambda *k: drawn.append(k) or real(*k))
    for step in (0, 1):
        case.before_step(step)
        run(layers, tokens)
        run(layers, tokens)
    assert sorted({(s, m) for s, _, m, _, _ in drawn}) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {i for _, i, _, _, _ in drawn} == set(layers)


def test_hooks_follow_layers_that_leave_arrive_or_are_rebuilt(monkeypatch):
    cfg, layers = tiny_model()
    tokens = torch.zeros(2, 16, dtype=torch.long)
    case, asked = noisy_case(monkeypatch, cfg, layers, jitter=0.3)
    case.before_step(0)
    old_block = layers[1]
    layers[1] = build_layer(layer_specs(cfg.model)[1], cfg.model, 7)  # a migration rebuilt it
    gone = layers.pop(3)  # the head left for another rank
    case.before_step(1)
    assert set(case.hooked) == {0, 1, 2} and case.hooked[1][0] is layers[1]
    for module in (old_block, gone):  # nothing left behind on modules this rank gave away
        assert not module._forward_hooks and not module._forward_pre_hooks
    run({i: layers[i] for i in (0, 1, 2)}, tokens)
    assert len(asked) == 3 and set(case.layer_stats()["noise_extra_s"]) == {0, 1, 2}


def test_the_burner_does_real_work_for_at_least_the_time_asked():
    burner = Burner(torch.device("cpu"))
    t = time.perf_counter()
    burner.burn(0.02)
    assert time.perf_counter() - t >= 0.02  # a busy loop until the deadline: never shorter
    burner.burn(0.0)
    burner.burn(-1.0)


# ---- bad values ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "opts,message",
    [
        (dict(jitter=-0.1), "noise.jitter=-0.1 must be in [0, 10]"),
        (dict(jitter=float("nan")), "noise.jitter=nan must be in [0, 10]"),
        (dict(straggler_prob=1.5), "noise.straggler_prob=1.5 must be in [0, 1]"),
        (dict(straggler_factor=0.5), "noise.straggler_factor=0.5 must be in [1, 100]"),
        (dict(slow_factor=0.9), "noise.slow_factor=0.9 must be in [1, 100]"),
        (dict(slow_rank=2), "noise.slow_rank=2 must be a pipeline rank in 0..1, or -1"),
        (dict(slow_rank=-2), "noise.slow_rank=-2 must be a pipeline rank in 0..1, or -1"),
        (dict(slow_rank=1), "noise.slow_rank=1 needs a slow phase: set noise.slow_every >= 1"),
        (dict(slow_rank=1, slow_every=5, slow_steps=6), "1 <= noise.slow_steps <= noise.slow_every"),
        (dict(slow_every=-1), "noise.slow_every=-1 and noise.slow_steps=0 must be >= 0"),
    ],
)
def test_check_options_names_the_field_and_the_fix(opts, message):
    with pytest.raises(ConfigError) as e:
        check_options(NoiseConfig(enabled=True, **opts), pp=2)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_valid_options_pass():
    check_options(NoiseConfig(), pp=1)
    check_options(NoiseConfig(enabled=True, jitter=10, straggler_prob=1, straggler_factor=100, slow_rank=0,
                              slow_factor=1, slow_every=3, slow_steps=3), pp=1)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--noise.jitter", "-1"], "noise.jitter=-1.0 must be in [0, 10]"),
        (["--noise.slow_rank", "2", "--noise.slow_every", "5", "--noise.slow_steps", "1"],
         "noise.slow_rank=2 must be a pipeline rank in 0..1"),
    ],
)
def test_bad_noise_values_exit_2_with_one_line(tmp_path, args, message):
    p, _ = dynmo_train(tmp_path, "--noise.enabled", "true", *args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


# ---- end to end ------------------------------------------------------------------------------

STEPS = 6
NOISY = ["--noise.enabled", "true", "--noise.seed", "3", "--noise.jitter", "0.3", "--noise.straggler_prob", "0.2",
         "--noise.slow_rank", "1", "--noise.slow_every", "3", "--noise.slow_steps", "1"]


@pytest.mark.dist
def test_noise_changes_no_loss_and_reports_the_extra_work_per_layer(tmp_path):
    # a forced migration at step 3 moves blocks between the ranks: the arriving layers get noise too
    common = ["--steps", str(STEPS), "--parallel.relayout", "3:0,2,6"]
    run_train(tmp_path / "plain", *common)
    run_train(tmp_path / "noisy", *common, *NOISY)
    plain, noisy = metrics(tmp_path / "plain"), metrics(tmp_path / "noisy")
    assert [r["loss"] for r in noisy] == [r["loss"] for r in plain]  # bitwise: the math is unchanged
    assert noisy[3]["layout"] == [0, 2, 6] and noisy[3]["events"][0]["layers_moved"] == 1
    for r in noisy:
        extra = r["noise_extra_s"]
        assert len(extra) == 6 and all(x is not None and x > 0 for x in extra), (r["step"], extra)
        assert not [e for e in r["events"] if e["type"] == "dynamism"]
    assert "noise_extra_s" not in plain[0]
