"""Workers that come back: after a re-pack, the controller takes the released workers back when
the model has grown so that they pay for their restart (`dynmo.controller.repack.grow`)."""

from __future__ import annotations

import pytest

from dynmo.config import BalanceConfig
from dynmo.controller import Controller
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.record import StepRecord

FOUR = Layout((0, 1, 2, 3, 5))


def shrink_then_grow(when: str, restart_s: float, horizon: int = 100, steps: int = 40):
    """Costs of 5 layers: the model shrinks at step 5 and grows back at step 20."""
    c = Controller(BalanceConfig(when=when, every=1, window=3, repack=True, repack_tolerance=0.3, horizon=horizon),
                   fixed_s=0.0)
    c.restart_s = restart_s
    layout, decided = FOUR, []
    for step in range(steps):
        costs = [4.0, 1.0, 1.0, 1.0, 1.0] if 5 <= step < 20 else [4.0, 4.0, 4.0, 4.0, 4.0]
        d = c.decide(step, layout, [0] * 5, 1000)
        if d is not None:
            decided.append((step, d.reason, d.layout.boundaries))
            layout = d.layout
            c.applied(4)
        c.observe(costs, layout=layout)
    return decided


@pytest.mark.parametrize("when", ["every", "auto"])
def test_released_workers_come_back_when_the_model_grows(when):
    decided = shrink_then_grow(when, restart_s=10.0)
    reasons = [r for _, r, _ in decided]
    assert "repack" in reasons and "grow" in reasons
    step_pack = next(s for s, r, _ in decided if r == "repack")
    step_grow, _, grown = next(d for d in decided if d[1] == "grow")
    assert 5 < step_pack < 20 < step_grow
    assert len(grown) - 1 == 4  # every worker the run started with


def test_a_restart_that_does_not_repay_keeps_the_run_packed():
    # the packed run loses (t_now - t_wide) per step; over a horizon of 10 steps it does not
    # repay an hour's restart
    decided = shrink_then_grow("every", restart_s=3600.0, horizon=10)
    assert "repack" in [r for _, r, _ in decided] and "grow" not in [r for _, r, _ in decided]


def test_a_measured_restart_prices_the_next_one():
    lp = DynmoLoop(BalanceConfig(when="auto", repack=True), microbatches=4, schedule="1f1b", layer_params=[1] * 5)
    lp.observe(StepRecord(step=0, layout=[0, 2, 5], layer_cost_s=[1.0] * 5,
                          events=[{"type": "grow", "restart_s": 12.5}]))
    assert lp.controller.restart_s == 12.5
