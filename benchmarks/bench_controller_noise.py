"""The controller under seeded noise: false migrations against reaction time (pure, no torch).

    python benchmarks/bench_controller_noise.py [--seeds 20] [--steps 200] [--confirm 2]

A 2-stage pipeline of the default model's shape as measured (configs/default.toml on 2 ranks:
embedding 0.03, 8 blocks of 1.0, head 0.65 per microbatch, relative to a block) on its
optimal layout E t t t t | t t t t L. Each step's per-layer cost is what the
profiler reports: the median over 4 microbatches of a cost drawn like `[noise]` draws it --
jitter U(0, 2 x 0.3) per layer per microbatch, a 3x straggler microbatch on a rank with
probability 0.05, a 1.5x slow phase of rank 1 for 3 steps every 50 -- and the measured step
time is the controller's step-time model (1F1B, simulated) on the step's mean microbatch costs.
The run starts on the layout of least simulated step time for the noise-free costs. Two runs
per seed:
  balanced  200 steps of noise only: every migration is a false one;
  change    blocks 0-2 cost 2.5x from step 20 (configs/skewed.toml's skew as measured): the
            step of the first migration, with the change unannounced (as MoE routing or a
            slower machine change costs) and, for the controller's rule, announced by a
            dynamism event on step 20 (as the skew, pruning or freezing announce theirs).
Evidence rules compared (`balance.when = auto`, horizon 50), each with the controller's other
defences (a proposed move confirmed on 2 fresh steps, no return within the horizon without
twice the gain, each migration judged by its measured step time):
  t-test    the controller's: the mean per-step gain beats its noise bound (one-sided 97.5%
            Student t on the window's steps, or on up to 20 observed steps), no floor
            (min_gain 0), and still does with the fresh steps;
  80%/5%    the previous rule: the gain clears a fixed 5% on 80% of the window's steps;
  median/5% the one before: the window's median per-step gain clears 5%;
with windows of 3 (the default) and 5 steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from dynmo.config import BalanceConfig
from dynmo.controller import Controller, candidates, evidence
from dynmo.layout import Layout

BASE = [0.03] + [1.0] * 8 + [0.65]
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


SUPPORTED = evidence.supported
RULES = {  # name: (the evidence test on the per-step gains, oldest first, min_gain)
    "t-test": (SUPPORTED, 0.0),
    "80%/5%": (lambda gains, window, margin: sum(g >= margin for g in gains[-window:]) >= -(-window * 4 // 5), 0.05),
    "median/5%": (lambda gains, window, margin: statistics.median(gains[-window:] or [0.0]) >= margin, 0.05),
}


def start_layout() -> Layout:
    """The layout of least simulated step time for the noise-free costs."""
    c = Controller(BalanceConfig(), MICROBATCHES)
    pr = c.problem(BASE, 2)
    return candidates.best_layout(pr, "optimal", None, c.steps_s)[0]


def run(rule: str, window: int, seed: int, steps: int, change_at: int | None, announce: bool = False) -> list[int]:
    """Steps at which the controller migrated."""
    rng = random.Random(seed)
    test, min_gain = RULES[rule]
    c = Controller(BalanceConfig(when="auto", window=window, min_gain=min_gain, horizon=50), MICROBATCHES, fixed_s=0.0)
    evidence.supported = test  # the rule that judges the per-step gains
    layout = start_layout()
    moved = []
    for step in range(steps):
        d = c.decide(step, layout, [0] * len(BASE), steps - step)
        if d is not None and d.layout != layout:
            moved.append(step)
            layout = d.layout
            c.applied(MICROBATCHES)
        base = list(BASE)
        if change_at is not None and step >= change_at:
            for i in (1, 2, 3):
                base[i] *= 2.5
        costs, t = draw(rng, base, layout, step)
        c.observe(costs, t, layout=layout, changed=announce and step == change_at)
    return moved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--confirm", type=int, default=evidence.CONFIRM, help="fresh steps that confirm a move")
    args = ap.parse_args(argv)
    evidence.CONFIRM = args.confirm
    print(f"python benchmarks/bench_controller_noise.py --seeds {args.seeds} --steps {args.steps} --confirm {args.confirm}\n")
    print("| rule | window | false migrations / 200 steps (mean, max) | runs with any | first migration after a change at step 20 (median, max) | runs that never reacted | the same change announced (median, max) |")
    print("|---|---:|---|---:|---|---:|---|")
    for rule in RULES:
        for window in (3, 5):
            false = [len(run(rule, window, s, args.steps, None)) for s in range(args.seeds)]
            react = [run(rule, window, 1000 + s, 60, 20) for s in range(args.seeds)]
            first = [next((m for m in r if m >= 20), None) for r in react]
            seen = [f - 20 for f in first if f is not None]
            told = "n/a"
            if rule == "t-test":  # the announced change's fast path reads the controller's own test
                firsts = [next((m for m in run(rule, window, 1000 + s, 60, 20, announce=True) if m >= 20), None)
                          for s in range(args.seeds)]
                told_seen = [f - 20 for f in firsts if f is not None]
                told = f"{statistics.median(told_seen):.0f}, {max(told_seen)} steps" if told_seen else "never"
            print(f"| {rule} | {window} | {statistics.fmean(false):.2f}, {max(false)} | {sum(f > 0 for f in false)}/{args.seeds} | "
                  f"{statistics.median(seen) if seen else float('nan'):.0f}, {max(seen) if seen else float('nan')} steps | "
                  f"{sum(f is None for f in first)}/{args.seeds} | {told} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
