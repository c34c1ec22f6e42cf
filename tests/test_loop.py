"""The DynMo loop (dynmo.loop): what it observes from a step record, and that the trainer and
the simulator's replay, which both drive it, make the same decisions from the same costs."""

from __future__ import annotations

import pytest

from dynmo.config import BalanceConfig, ConfigError
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop, check_balance
from dynmo.record import StepRecord


def loop(**knobs) -> DynmoLoop:
    return DynmoLoop(BalanceConfig(**knobs), microbatches=4, schedule="1f1b", layer_params=[100, 10, 10, 10, 100])


def test_observe_reads_costs_memory_microbatches_and_refits_migrations():
    lp = loop(when="every", every=1, window=1)
    lp.controller.speeds = [1.0, 0.5]
    rec = StepRecord(step=0, layout=[0, 2, 5], microbatches=2, layer_cost_s=[1.0, 2.0, 3.0, 4.0, 5.0],
                     layer_state_bytes=[10.0] * 5, layer_act_bytes=[1.0] * 5, profile_s=0.25,
                     events=[{"type": "migration", "bytes": 2_000_000, "seconds": 0.02}, {"type": "dynamism"}])
    lp.observe(rec)
    ctl = lp.controller
    # time on a worker of speed 0.5 is twice the worker-free cost: layers 2..4 run on worker 1
    assert list(ctl.history[-1]) == [1.0, 2.0, 1.5, 2.0, 2.5]
    assert ctl.microbatches == 2 and lp.layer_bytes == [10] * 5 and lp.profile_s == 0.25
    # 1F1B on 2 stages with 2 microbatches holds at most 2 in flight
    assert ctl.memory == [12.0] * 5
    assert ctl.bandwidth == pytest.approx(2_000_000 / (0.02 - ctl.fixed_s))


def test_params_cost_follows_pruning_density():
    lp = loop(when="every", every=1, window=1, cost="params")
    lp.observe(StepRecord(step=0, layout=[0, 2, 5], stats={"prune_density": [None, 0.5, 0.25, 1.0, None]}))
    assert list(lp.controller.history[-1]) == [100, 5.0, 2.5, 10.0, 100]


def test_applied_drops_the_forecast_and_resets_profile_time():
    lp = loop(when="auto", window=2)
    for k in range(4):  # a window of 2, then 2 fresh steps confirm the proposal
        if k == 2:
            assert lp.decide(k, Layout((0, 2, 5)), 100) is None
        lp.observe(StepRecord(step=k, layout=[0, 2, 5], layer_cost_s=[5.0, 1.0, 1.0, 1.0, 1.0], profile_s=0.1))
    d = lp.decide(4, Layout((0, 2, 5)), 100)
    assert d is not None and d.layout.boundaries == (0, 1, 5)
    assert lp.event(d, 0.001)["profile_s"] == pytest.approx(0.4)
    lp.applied(4)
    assert not lp.controller.history and lp.profile_s == 0.0 and lp.decide(3, d.layout, 100) is None


@pytest.mark.parametrize("field,value,match", [
    ("when", "sometimes", "balance.when"), ("cost", "flops", "balance.cost"), ("balancer", "diffusion", "contiguity"),
    ("window", 0, "window"), ("repack_tolerance", -0.1, "repack_tolerance"), ("links", "slow", "balance.links"),
    ("memory_gb", -1.0, "memory_gb"), ("speeds", [1.0, 0.0], "speeds"),
])
def test_one_validation_of_the_balance_section(field, value, match):
    with pytest.raises(ConfigError, match=match):
        check_balance(BalanceConfig(**{field: value}))
    with pytest.raises(ConfigError, match=match):  # the loop and the replay use the same check
        DynmoLoop(BalanceConfig(**{field: value}), microbatches=4, schedule="1f1b", layer_params=[1, 1])


def test_injected_costs_replace_the_measured_ones_from_their_step(monkeypatch):
    """DYNMO_COSTS (the tests' way to drive the controller without this machine's timing): the
    record of a step keeps its measured costs before the first segment, takes each segment's
    from its step on, a third forward; a malformed value or a wrong layer count is refused."""
    from dynmo.runtime.faults import injected_costs

    rec = StepRecord(step=0, layer_fwd_s=[0.1, 0.2], layer_bwd_s=[0.2, 0.4], layer_cost_s=[0.3, 0.6],
                     layer_wgrad_s=[0.1, 0.1])
    monkeypatch.setenv("DYNMO_COSTS", "2:3,6;5:30,60")
    assert injected_costs(rec) is rec
    for step, want in ((2, [0.003, 0.006]), (4, [0.003, 0.006]), (5, [0.03, 0.06]), (99, [0.03, 0.06])):
        got = injected_costs(StepRecord(**{**rec.__dict__, "step": step}))
        assert got.layer_cost_s == pytest.approx(want)
        assert got.layer_fwd_s == pytest.approx([c / 3 for c in want])
        assert got.layer_bwd_s == pytest.approx([2 * c / 3 for c in want])
        assert got.layer_wgrad_s == pytest.approx([b / 2 if i == 0 else b / 4 for i, b in enumerate(got.layer_bwd_s)])
    for bad in ("2:3,x", "3", "5:1,1;2:1,1", "1:0,1"):
        monkeypatch.setenv("DYNMO_COSTS", bad)
        with pytest.raises(ValueError, match="DYNMO_COSTS"):
            injected_costs(StepRecord(step=9, layer_cost_s=[1.0, 1.0], layer_bwd_s=[1.0, 1.0]))
    monkeypatch.setenv("DYNMO_COSTS", "0:1,2,3")
    with pytest.raises(ValueError, match="3 layer costs; the model has 2 layers"):
        injected_costs(rec)
