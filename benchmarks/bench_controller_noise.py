"""The controller under seeded noise: false migrations against reaction time (no model runs).

Produces the table in docs/bench/controller-noise-tradeoff.md (linked from docs/controller.md).

    python benchmarks/bench_controller_noise.py [--seeds 20] [--steps 200]

A 2-stage pipeline of the default model's shape as measured (configs/default.toml on 2 ranks:
embedding 0.03, 8 blocks of 1.0, head 0.65 per microbatch, relative to a block) on its
optimal layout E t t t t | t t t t L, and the shape configs/noisy.toml injects (embedding
0.03, blocks 1.0, head 0.5: two layouts within 0.3 % of each other). Each step's per-layer
cost is what the profiler reports: the median over 4 microbatches of a cost drawn like
`[noise]` draws it -- jitter U(0, 2 x 0.3) per layer per microbatch, a 3x straggler
microbatch on a rank with probability 0.05, a 1.5x slow phase of rank 1 for 3 steps every 50
-- and the measured step time is the controller's step-time model (1F1B, simulated) on the
step's mean microbatch costs. The run starts on the layout of least simulated step time for
the noise-free costs. Per seed:
  balanced  200 steps of noise only, on each shape: every migration is a false one;
  change    blocks 0-2 cost 2.5x from step 20 (configs/skewed.toml's skew as measured): the
            step of the first migration, with the change unannounced (as MoE routing or a
            slower machine change costs) and announced by a dynamism event on step 20 (as the
            skew, pruning or freezing announce theirs).
A last column replays the shipped configs/noisy.toml itself on its injected costs
(DYNMO_COSTS="0:0.3,10,10,10,10,10,10,10,10,5") through the injector's own draws
(`dynmo.dynamics.noise.decisions_under_noise`), noise seeds 0..seeds-1.
Rows: `balance.confidence` x `balance.confirm` (window 3, horizon 50, `min_gain` at its
default), and the default with no `min_gain` floor.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from dataclasses import replace
from pathlib import Path

from dynmo.config import BalanceConfig, load_config
from dynmo.controller import Controller, candidates
from dynmo.layout import Layout

BASE = [0.03] + [1.0] * 8 + [0.65]
NOISY_MS = [0.3] + [10.0] * 8 + [5.0]  # configs/noisy.toml's injected costs (ms per microbatch)
NOISY = [c / 10.0 for c in NOISY_MS]  # relative to a block
MICROBATCHES = 4


def draw(rng: random.Random, base: list[float], layout: Layout, step: int) -> tuple[list[float], float]:
    """One step: the per-layer medians the profiler reports, and the measured step time."""
    owner = layout.owner()
    slow = 1.5 if step % 50 < 3 else 1.0
    per_mb = []
    for _ in range(MICROBATCHES):
        strag = [3.0 if rng.random() < 0.05 else 1.0 for _ in range(layout.num_stages)]
        per_mb.append([c * (1 + rng.uniform(0, 0.6)) * strag[owner[i]] * (slow if owner[i] == 1 else 1.0)
                       for i, c in enumerate(base)])
    costs = [statistics.median(col) for col in zip(*per_mb)]
    mean = [statistics.fmean(col) for col in zip(*per_mb)]
    model = Controller(BalanceConfig(), MICROBATCHES)
    return costs, model.step_s(model.problem(mean, layout.num_stages), layout)


def start_layout(base: list[float]) -> Layout:
    """The layout of least simulated step time for the noise-free costs."""
    c = Controller(BalanceConfig(), MICROBATCHES)
    pr = c.problem(base, 2)
    return candidates.best_layout(pr, "optimal", None, c.steps_s)[0]


def run(knobs: dict, seed: int, steps: int, change_at: int | None, announce: bool = False,
        base_costs: list[float] = BASE) -> list[int]:
    """Steps at which the controller migrated."""
    rng = random.Random(seed)
    c = Controller(BalanceConfig(when="auto", window=3, horizon=50, **knobs), MICROBATCHES, fixed_s=0.0)
    layout = start_layout(base_costs)
    moved = []
    for step in range(steps):
        d = c.decide(step, layout, [0] * len(base_costs), steps - step)
        if d is not None and d.layout != layout:
            moved.append(step)
            layout = d.layout
            c.applied(MICROBATCHES)
        base = list(base_costs)
        if change_at is not None and step >= change_at:
            for i in (1, 2, 3):
                base[i] *= 2.5
        costs, t = draw(rng, base, layout, step)
        c.observe(costs, t, layout=layout, changed=announce and step == change_at)
    return moved


def noisy_toml(knobs: dict, seeds: int, steps: int) -> int:
    """Runs of configs/noisy.toml on its injected costs, noise seeds 0..seeds-1, that migrated."""
    from dynmo.dynamics.noise import decisions_under_noise  # torch, for the injector's module

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "noisy.toml")
    cfg.balance = replace(cfg.balance, **knobs)
    moved = 0
    for seed in range(seeds):
        cfg.noise = replace(cfg.noise, seed=seed)
        moved += bool(decisions_under_noise(cfg, [c / 1e3 for c in NOISY_MS], steps))
    return moved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    print(f"python benchmarks/bench_controller_noise.py --seeds {args.seeds} --steps {args.steps}\n")
    print(f"| confidence | confirm | min_gain | false migrations / {args.steps} steps, default shape (mean, max; runs with any) "
          "| the same, noisy.toml's shape | first migration after a change at step 20 (median, max; never) "
          "| the same change announced (median, max) | configs/noisy.toml injected: runs with a migration |")
    print("|---:|---:|---:|---|---|---|---|---:|")
    d = BalanceConfig()
    rows = [(conf, confirm, d.min_gain) for conf in (0.9, 0.95, 0.99) for confirm in (1, 2, 3)]
    rows.append((d.confidence, d.confirm, 0.0))
    for conf, confirm, floor in rows:
        knobs = {"confidence": conf, "confirm": confirm, "min_gain": floor}
        cells = []
        for base in (BASE, NOISY):
            false = [len(run(knobs, s, args.steps, None, base_costs=base)) for s in range(args.seeds)]
            cells.append(f"{statistics.fmean(false):.2f}, {max(false)}; {sum(f > 0 for f in false)}/{args.seeds}")
        for announce in (False, True):
            react = [run(knobs, 1000 + s, 60, 20, announce=announce) for s in range(args.seeds)]
            first = [next((m for m in r if m >= 20), None) for r in react]
            seen = [f - 20 for f in first if f is not None]
            never = sum(f is None for f in first)
            cells.append(f"{statistics.median(seen):.0f}, {max(seen)} steps; {never}" if seen else f"never; {never}")
        cells.append(f"{noisy_toml(knobs, args.seeds, args.steps)}/{args.seeds}")
        mark = " (default)" if (conf, confirm, floor) == (d.confidence, d.confirm, d.min_gain) else ""
        print(f"| {conf}{mark} | {confirm} | {floor} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
