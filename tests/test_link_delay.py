"""The injected link delay (`noise.link_delay_ms`, dynmo/dynamics/noise.py `LinkDelay`): real
waiting in the pipeline's send path that changes no number of the training, that the start-up
link probe sees, that the profiler does not book as compute, and that the link-aware
controller answers in the expected direction.

Timing assertions are inequalities on injected sleeps (a sleep lasts at least what it was
asked), so a loaded machine cannot break them; the decision tests use forced costs."""

from __future__ import annotations

import re
import statistics
from concurrent.futures import ThreadPoolExecutor

import pytest

from dynmo.config import BalanceConfig, ConfigError, NoiseConfig
from dynmo.controller import Controller
from dynmo.dynamics.noise import LinkDelay, check_options
from dynmo.layout import Layout
from tests.conftest import metrics, run_train

DELAY_MS = 50.0
MICROBATCHES = 4  # TINY's


def link_ms(stdout: str) -> list[tuple[float, float]]:
    """The probe's link times per link, (forward, backward), from the trainer's start-up line
    `link ms/microbatch forward/backward [f/b, f/b]`."""
    m = re.search(r"link ms/microbatch forward/backward \[([^\]]*)\]", stdout)
    assert m, f"no probe line in:\n{stdout[-2000:]}"
    return [tuple(float(y) for y in x.split("/")) for x in m.group(1).split(",") if x.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 3 steps without and with a 50 ms delay on the one link (both directions), run
    side by side; `balance.when = auto` so the links are probed (3 steps are too few to move)."""
    base = tmp_path_factory.mktemp("link-delay")
    common = ["--steps", "3", "--balance.when", "auto"]
    delayed = ["--noise.enabled", "true", "--noise.link_delay_ms", str(DELAY_MS)]
    with ThreadPoolExecutor(2) as pool:
        plain = pool.submit(run_train, base / "plain", *common)
        slow = pool.submit(run_train, base / "delayed", *common, *delayed)
        plain, slow = plain.result(), slow.result()
    return {"plain": (plain, metrics(base / "plain")), "delayed": (slow, metrics(base / "delayed"))}


@pytest.mark.dist
def test_a_link_delay_changes_no_number_of_the_training(runs):
    plain, delayed = runs["plain"][1], runs["delayed"][1]
    assert len(plain) == len(delayed) == 3
    assert [r["loss"] for r in delayed] == [r["loss"] for r in plain]
    assert [r["grad_norm"] for r in delayed] == [r["grad_norm"] for r in plain]


@pytest.mark.dist
def test_the_probe_sees_the_delay_and_the_profiler_does_not(runs):
    (plain, _), (slow, recs) = runs["plain"], runs["delayed"]
    [plain_ms], [slow_ms] = link_ms(plain.stdout), link_ms(slow.stdout)
    # the probe waits on both ends of the link, as the pipeline's sends do, and books each wait
    # to its direction: the activation's sender and the gradient's
    for fwd_or_back in (0, 1):
        assert slow_ms[fwd_or_back] >= DELAY_MS
        assert slow_ms[fwd_or_back] > plain_ms[fwd_or_back] + DELAY_MS / 2
    # the waits sit outside the profiler's spans: no layer got them, nor any stage's compute
    # (booked, each stage would carry at least one wait per microbatch)
    for i, costs in enumerate(zip(*(r["layer_cost_s"] for r in recs))):
        assert statistics.median(costs) < DELAY_MS / 1e3, f"layer {i} booked the link delay"
    for s, compute in enumerate(zip(*(r["stage_compute_s"] for r in recs))):
        assert statistics.median(compute) < MICROBATCHES * DELAY_MS / 1e3, f"stage {s} booked the link delay"
    # the step waited for it: at least one delayed send per microbatch on each rank
    assert min(r["step_s"] for r in recs) > MICROBATCHES * DELAY_MS / 1e3


def decide_auto(transfer: list[float] | None, costs: list[float], layout: Layout,
                back: list[float] | None = None) -> Layout | None:
    """Drive `auto` with the same costs every step until it moves (window + confirming steps)."""
    c = Controller(BalanceConfig(when="auto", window=3, horizon=100), microbatches=MICROBATCHES,
                   transfer=transfer, transfer_back=back, fixed_s=0.0)
    for step in range(10):
        c.observe(list(costs))
        d = c.decide(step, layout, [0] * len(costs), 100)
        if d is not None:
            return d.layout
    return None


def simulated_best(transfer, back, costs: list[float], stages: int) -> Layout:
    """The layout of least simulated step time among every contiguous layout (brute force)."""
    from itertools import combinations

    c = Controller(BalanceConfig(when="auto"), microbatches=MICROBATCHES, transfer=transfer, transfer_back=back)
    n = len(costs)
    layouts = [Layout((0, *cut, n)) for cut in combinations(range(1, n), stages - 1)]
    return min(layouts, key=lambda lay: c.step_s(c.problem(costs, stages, lay), lay))


def test_link_aware_layout_moves_work_off_the_stages_that_send_on_the_slow_link():
    # 8 equal layers on 2 stages. A send occupies its sender: a delay d on activations weighs on
    # stage 0, on gradients on stage 1. The controller moves to the layout of least simulated
    # 1F1B step time (4 microbatches) when it is not the current one.
    costs, uniform = [1.0] * 8, Layout((0, 4, 8))
    assert decide_auto(None, costs, uniform) is None  # compute only: balanced already
    assert decide_auto([0.0], costs, uniform, [0.0]) is None  # an undelayed link: the same
    for fwd, back in (([2.0], [0.0]), ([4.0], [0.0]), ([2.0], [2.0]), ([0.0], [2.0])):
        best = simulated_best(fwd, back, costs, 2)
        assert decide_auto(fwd, costs, uniform, back) == (None if best == uniform else best), (fwd, back)
    assert decide_auto([4.0], costs, uniform, [0.0]) == Layout((0, 2, 8))  # activations: stage 0 sheds
    assert decide_auto([0.0], costs, uniform, [2.0]) == Layout((0, 5, 8))  # gradients only: stage 1 sheds
    assert decide_auto([2.0], costs, uniform, [2.0]) is None  # both ways: no layout escapes it
    # 3 stages, 9 layers, a slow link 1 <-> 2 in both directions: both of its ends shed work
    nine = Layout((0, 3, 6, 9))
    assert decide_auto(None, [1.0] * 9, nine) is None
    moved = decide_auto([0.0, 3.0], [1.0] * 9, nine, [0.0, 3.0])
    assert moved == Layout((0, 5, 7, 9)), moved  # 5 | 2 + 3 | 2 + 3


def test_which_sends_wait():
    links = LinkDelay()
    assert links.delay_s(0, 1, "forward") == 0.0 and links.wait(0, 1, "forward") == 0.0  # nothing configured
    links.configure([10.0, 0.0, 30.0])
    assert links.delay_s(0, 1, "forward") == links.delay_s(1, 0, "backward") == 0.010
    assert links.delay_s(1, 2, "forward") == 0.0
    assert links.delay_s(3, 2, "backward") == 0.030
    assert links.delay_s(3, 0, "forward") == 0.0  # not neighbours (an interleaved wrap-around)
    assert links.delay_s(2, 2, "forward") == 0.0
    links.configure([10.0], "forward")
    assert links.delay_s(0, 1, "forward") == 0.010 and links.delay_s(1, 0, "backward") == 0.0
    links.configure([10.0], "backward")
    assert links.delay_s(0, 1, "forward") == 0.0 and links.delay_s(1, 0, "backward") == 0.010
    assert links.wait(1, 0, "backward") >= 0.010  # a real wait, measured


@pytest.mark.parametrize("ms, direction, pp, words", [
    ([10.0, 10.0], "both", 2, "one per link"),
    ([10.0], "both", 1, "one per link"),
    ([-1.0], "both", 2, "link_delay_ms[0]"),
    ([float("nan")], "both", 2, "link_delay_ms[0]"),
    ([float("inf")], "both", 2, "link_delay_ms[0]"),
    ([0.0, 1e9], "both", 3, "link_delay_ms[1]"),
    ([10.0], "sideways", 2, "link_delay_direction"),
])
def test_bad_link_delays_fail_with_one_line(ms, direction, pp, words):
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        check_options(NoiseConfig(enabled=True, link_delay_ms=ms, link_delay_direction=direction), pp)
    assert "\n" not in str(e.value)
    check_options(NoiseConfig(enabled=True, link_delay_ms=[0.0] * (pp - 1)), pp)  # the fix passes
