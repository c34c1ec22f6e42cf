"""How far noise alone takes a fixed layout's saving, k steps in a row: what the fallbacks' far rules stand on.

    python benchmarks/bench_far_noise.py [--seeds 48] [--steps 200] [--most 6]

`dynmo.controller.fallback` leaves the current layout at once for a fallback that saved
FAR_GAIN of its step time on each of the last two steps, and a layout a rebalance chose after
one step of FAR_ONE. Each threshold is set well above the largest such saving noise alone
showed. This prints that largest saving for runs of k = 1 .. `--most` steps (the minimum of
the k savings, maximised over every run of k steps in a row), under two kinds of noise:

  injector  configs/noisy.toml's injected costs read through its noise (jitter, stragglers,
            slow phases; `dynmo.dynamics.noise.recorded_costs`), noise seeds 0 .. seeds-1,
            `steps` steps each: the saving of every other split of 2 to 8 layers on the first
            stage over the shipped one, under each step's recorded costs (the controller's step
            model, as the fallbacks compute it);
  traces    the committed dense traces (docs/bench/traces/dense-*.jsonl) at the paper's shapes
            (`replay_headline.SHAPES`): the saving of each static layout (uniform, params, flops,
            profile-once) over each other, step by step (the step-to-step noise the generated
            scenarios of `replay_scenarios.py` carry).

No model runs and no timing is read: the figures are the same on every machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dynmo.config import load_config  # noqa: E402
from dynmo.controller import Controller, fallback  # noqa: E402
from dynmo.dynamics.noise import Draws, recorded_costs  # noqa: E402
from dynmo.layout import Layout  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
INJECTED_MS = [0.3] + [10.0] * 8 + [5.0]  # configs/noisy.toml's DYNMO_COSTS (ms per microbatch)
TRACES = ("dense-60", "dense-80", "dense-120", "dense-150")


def longest_runs(savings: np.ndarray, most: int) -> list[float]:
    """For k = 1 .. most: the largest minimum of `savings` over k steps in a row (-inf if fewer)."""
    out = []
    for k in range(1, most + 1):
        if len(savings) < k:
            out.append(float("-inf"))
            continue
        windows = np.lib.stride_tricks.sliding_window_view(savings, k)
        out.append(float(windows.min(axis=1).max()))
    return out


def injector(seeds: int, steps: int, most: int) -> tuple[list[float], int]:
    """The largest k-step savings of any other first-stage split over the shipped layout under
    configs/noisy.toml's injected costs and noise; and the number of (seed, layout) series."""
    cfg = load_config(ROOT / "configs" / "noisy.toml")
    costs = [c / 1e3 for c in INJECTED_MS]
    m = cfg.train.microbatches
    shipped = Layout.parse(cfg.parallel.layout, len(costs))
    others = [Layout((0, k, len(costs))) for k in range(2, 9) if (0, k, len(costs)) != shipped.boundaries]
    model = Controller(cfg.balance, m)
    best = [float("-inf")] * most
    for seed in range(seeds):
        cfg.noise.seed = seed
        draws = Draws(cfg.noise)
        owner = list(shipped.owner())
        times = []
        for step in range(steps):
            problem = model.problem(recorded_costs(draws, step, costs, owner, m), shipped.num_stages)
            times.append([model.step_s(problem, lay) for lay in [shipped, *others]])
        t = np.asarray(times)
        for j in range(1, t.shape[1]):
            best = np.maximum(best, longest_runs(1 - t[:, j] / t[:, 0], most)).tolist()
    return best, seeds * len(others)


def traces(most: int) -> tuple[list[float], int]:
    """The largest k-step savings of one static layout over another on the committed dense
    traces at the paper's shapes; and the number of (trace, shape, pair) series."""
    from replay_headline import SHAPES
    from replay_scenarios import STARTS, MemoRunner

    from dynmo.sim import load_trace, scale_trace
    from dynmo.sim.replay import PolicyResult, ReplayOptions, replay_balance
    from dynmo.sim.replay.policies import run_static, static_layout

    best, series = [float("-inf")] * most, 0
    for name in TRACES:
        for shape in ("24x30", "16x8"):
            stages, dp, blocks, m = SHAPES[shape]
            trace = scale_trace(load_trace(ROOT / "docs" / "bench" / "traces" / f"{name}.jsonl"), blocks)
            runner = MemoRunner(trace, dp, ReplayOptions(microbatches=m, balance=replay_balance(when="auto")), stages)
            t = {}
            for start in STARTS:
                r = PolicyResult(start)
                run_static(trace, runner, static_layout(start, trace, stages, runner), r)
                t[start] = np.asarray(r.iteration_s)
            for a in t:
                for b in t:
                    if a != b:
                        best = np.maximum(best, longest_runs(1 - t[b] / t[a], most)).tolist()
                        series += 1
    return best, series


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=48, help="noise seeds of configs/noisy.toml")
    ap.add_argument("--steps", type=int, default=200, help="steps per seed")
    ap.add_argument("--most", type=int, default=6, help="the longest run of steps")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.steps < 1 or args.most < 1:
        print("bench_far_noise: --seeds, --steps and --most must be 1 or more", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    inj, n_inj = injector(args.seeds, args.steps, args.most)
    tr, n_tr = traces(args.most)
    print(f"python benchmarks/bench_far_noise.py --seeds {args.seeds} --steps {args.steps} --most {args.most}")
    print(f"the largest saving a fixed layout showed on each of k steps in a row, noise alone "
          f"(injector: {n_inj} series of {args.steps} steps; traces: {n_tr} series)\n")
    print("| k | injector | traces | 1.7 x the larger |")
    print("|---:|---:|---:|---:|")
    for k in range(args.most):
        print(f"| {k + 1} | {inj[k]:.3f} | {tr[k]:.3f} | {1.7 * max(inj[k], tr[k]):.3f} |")
    print(f"\nthe rules now: FAR_ONE {fallback.FAR_ONE} on one step (a layout a rebalance chose), "
          f"FAR_GAIN {fallback.FAR_GAIN} on each of two ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
