"""What was known before step 0 stays a candidate: the layouts of uniform, of the parameter
counts and of the FLOP model are judged beside the balancer's on measured steps."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from dynmo.config import BalanceConfig
from dynmo.controller import Controller
from dynmo.layout import Layout
from dynmo.loop import DynmoLoop
from dynmo.plan import named_layout
from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import ReplayOptions, replay, replay_balance
from dynmo.sim.replay.policies import trace_flops

REPO = Path(__file__).resolve().parents[1]

COSTS = [0.5] + [8.0] * 6 + [1.0] * 12 + [3.0]  # six heavy blocks, twelve light ones


def run(priors: dict, steps: int = 30, seed: int = 0) -> tuple[list, Layout, Controller]:
    """`balancer = uniform` generates only the uniform layout, and the local search moves one
    boundary a round: what the candidates reach beyond that is the priors' doing."""
    c = Controller(BalanceConfig(when="auto", balancer="uniform"), fixed_s=0.0, priors=priors)
    n = len(COSTS)
    layout, decided = Layout.uniform(n, 4), []
    rng = random.Random(seed)
    for step in range(steps):
        d = c.decide(step, layout, [0] * n, 1000)
        if d is not None:
            decided.append((step, d.layout.boundaries))
            layout = d.layout
            c.applied(4)
        c.observe([x * (1 + 0.01 * rng.random()) for x in COSTS], layout=layout)
    return decided, layout, c


@pytest.mark.parametrize("seed", range(3))
def test_a_prior_layout_far_from_the_balancers_is_reached_in_one_move(seed):
    flops = named_layout("flops", len(COSTS), 4, flops=COSTS)
    with_prior, lay, c = run({"flops": COSTS}, seed=seed)
    without, lay0, _ = run({}, seed=seed)
    problem = c.problem(COSTS, 4, lay)
    assert lay == flops and len(with_prior) == 1
    assert c.step_s(problem, lay) < c.step_s(problem, lay0)


def test_prior_layouts_hold_the_memory_cap_and_skip_what_does_not_fit():
    c = Controller(BalanceConfig(when="auto"), priors={"params": [1] * 20, "flops": COSTS, "short": [1.0] * 3})
    problem = c.problem(COSTS, 4, Layout.uniform(20, 4))
    lays = c.prior_layouts(problem, 4)
    assert Layout.uniform(20, 4) in lays and named_layout("flops", 20, 4, flops=COSTS) in lays
    assert all(lay.num_stages == 4 for lay in lays) and len(set(lays)) == len(lays)
    # a memory cap that only the balanced layouts keep: the others are no candidates
    c.memory, c.capacity = COSTS, 16.5
    capped = c.prior_layouts(c.problem(COSTS, 4, Layout.uniform(20, 4)), 4)
    assert named_layout("flops", 20, 4, flops=COSTS) in capped and Layout.uniform(20, 4) not in capped


def test_the_loop_hands_its_flops_to_the_controller():
    lp = DynmoLoop(BalanceConfig(when="auto"), microbatches=4, schedule="1f1b", layer_params=[1] * 20,
                   layer_flops=COSTS)
    assert lp.controller.priors == {"params": [1] * 20, "flops": COSTS}


@pytest.mark.parametrize("name", ["mod-static", "sublayer/moe-static"])
def test_a_traces_flops_follow_its_blocks_through_scaling(name):
    trace = load_trace(REPO / "docs/bench/traces" / f"{name}.jsonl")
    flops, scaled = trace_flops(trace), trace_flops(scale_trace(trace, 32))
    assert len(scaled) == scale_trace(trace, 32).num_layers
    assert scaled[0] == flops[0] == 0 and scaled[-1] == flops[-1]
    per = len(flops) - 2  # units of the traced blocks
    assert sorted(set(scaled[1:-1])) == sorted(set(flops[1:-1]))
    assert sum(scaled[1:-1]) == pytest.approx(sum(flops[1:-1]) * (len(scaled) - 2) / per)


def test_the_replay_starts_on_and_replays_the_flops_layout():
    trace = scale_trace(load_trace(REPO / "docs/bench/traces/mod-static.jsonl"), 16)
    opts = ReplayOptions(microbatches=16, balance=replay_balance(when="auto"), charge_decide=False)
    (static,) = replay(trace, 8, 1, ["flops"], opts)
    assert static.layouts[0] == list(named_layout("flops", trace.num_layers, 8, flops=trace_flops(trace)).boundaries)
    assert static.migrations == 0 and static.best_static in ("uniform", "params", "profile-once")
    (dyn,) = replay(trace, 8, 1, ["optimal"], replace(opts, initial="flops"))
    assert dyn.layouts[0] == static.layouts[0]
