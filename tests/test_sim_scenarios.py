"""The scenario generator's invariants: seeded, change sizes in range, the trace's own costs kept
underneath (dynmo.sim.scenarios; benchmarks/replay_scenarios.py replays the family)."""

from __future__ import annotations

import numpy as np
import pytest

from dynmo.sim import load_trace, scale_trace
from dynmo.sim.scenarios import FIRST, KINDS, MIN_STEPS, SIZES, Change, Scenario, apply, generate
from dynmo.sim.trace.kinds import block_groups
from tests.conftest import ROOT

TRACES = ROOT / "docs" / "bench" / "traces"


def test_the_same_seed_gives_the_same_scenario_and_trace():
    base = scale_trace(load_trace(TRACES / "dense-60.jsonl"), 16)
    for seed in range(8):
        a, b = generate(seed, 60, 16), generate(seed, 60, 16)
        assert a == b
        assert np.array_equal(apply(base, a).costs(), apply(base, b).costs())
    assert len({generate(seed, 60, 16) for seed in range(30)}) == 30


@pytest.mark.parametrize("steps,blocks", [(60, 48), (150, 32), (MIN_STEPS, 4)])
def test_changes_are_in_range(steps, blocks):
    kinds = set()
    for seed in range(300):
        sc = generate(seed, steps, blocks)
        kinds.add(sc.kind)
        assert 1 <= len(sc.changes) <= (3 if sc.kind == "steps" else 1)
        for c in sc.changes:
            assert SIZES[0] - 1e-12 <= c.size <= SIZES[1] + 1e-12
            assert c.kind == sc.kind and c.factor > 0
            assert FIRST <= c.start < steps - steps // 8
            assert c.blocks and len(set(c.blocks)) == len(c.blocks) and 0 <= min(c.blocks) and max(c.blocks) < blocks
            if c.kind in ("reversal", "ramp"):
                assert c.start < c.end <= steps - 1
            if c.kind == "hot":
                assert c.factor > 1 and c.period >= 5 and 1 <= c.shift <= len(c.blocks)
        f = sc.factors(steps, blocks)
        assert np.all(f[:FIRST] == 1.0)  # profile-once's steps see the traced model
    assert kinds == set(KINDS)


def test_each_family_moves_its_blocks_as_described():
    f = Scenario(0, "reversal", (Change("reversal", (2, 3), 0.5, 10, 20),)).factors(30, 8)
    assert np.all(f[10:20, 2:4] == 0.5) and np.all(f[:10] == 1) and np.all(f[20:] == 1) and np.all(f[:, [0, 1, 4]] == 1)
    f = Scenario(0, "ramp", (Change("ramp", (0,), 1.6, 10, 20),)).factors(30, 8)[:, 0]
    assert f[10] == 1 and f[20] == pytest.approx(1.6) and f[29] == pytest.approx(1.6) and np.all(np.diff(f) >= 0)
    f = Scenario(0, "steps", (Change("steps", (1, 2), 0.5, 10), Change("steps", (2, 3), 1.5, 20))).factors(30, 8)
    assert f[25, 1] == 0.5 and f[25, 2] == pytest.approx(0.75) and f[25, 3] == 1.5 and f[15, 3] == 1
    hot = Change("hot", (0, 1, 2), 1.5, 5, period=5, shift=2)
    f = Scenario(0, "hot", (hot,)).factors(60, 8)
    for k in range(5, 60):  # the region keeps its width and stays in the model, bouncing at its ends
        assert sorted(np.flatnonzero(f[k] > 1)) == list(range(int(np.argmax(f[k] > 1)), int(np.argmax(f[k] > 1)) + 3))
    firsts = [int(np.argmax(f[k] > 1)) for k in range(5, 60, 5)]
    assert firsts == [0, 2, 4, 4, 2, 0, 2, 4, 4, 2, 0]


@pytest.mark.parametrize("name,blocks", [("dense-80", 48), ("sublayer/dense-80", 8)])
def test_apply_scales_the_blocks_and_keeps_the_noise_underneath(name, blocks):
    path = TRACES / f"{name}.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is not committed")
    base = scale_trace(load_trace(path), blocks)
    sc = generate(3, len(base.steps), blocks)
    out = apply(base, sc)
    f = sc.factors(len(base.steps), blocks)
    ratio = out.costs() / base.costs()
    for g in block_groups(base.header.kinds, "test"):  # every unit of a block changes with it
        assert np.allclose(ratio[:, g], f)
    assert np.allclose(ratio[:, [0, -1]], 1.0)  # E and L as traced
    assert out.header == base.header
    assert np.allclose(out.controller_costs() / base.controller_costs(), ratio)


def test_too_short_a_run_is_refused():
    with pytest.raises(ValueError):
        generate(0, MIN_STEPS - 1, 48)
