"""How long one controller decision takes: the balancer generating, the simulated step time scoring.

Produces the table in docs/bench/controller-decide-time.md (linked from docs/controller.md).

    python benchmarks/bench_decide.py [--repeats 3] [--replays dense-60,dense-moe-80]

For each shape (layers x stages, microbatches = 4 x stages), a controller with `when = every`
observes a window of drifting per-layer costs and decides once from the uniform layout; the
table gives the wall time of `decide` (median of --repeats), how many batched simulation passes
it made and how many layouts they scored, and whether the running schedule was simulated (the event-driven engine) or, beyond
`dynmo.controller.steptime.MAX_SIM_OPS`, the closed form stood in. With --replays, `auto`'s
decisions over whole runs too: each named committed trace (docs/bench/traces/<name>.jsonl)
scaled to 48 blocks and replayed noise-free from uniform on 24 stages x 30 replicas with 96
microbatches, the replay's measured decide time in all, per step and as a share of the run.
Pure; no torch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from dynmo.config import BalanceConfig
from dynmo.controller import Controller
from dynmo.controller.steptime import MAX_SIM_OPS
from dynmo.layout import Layout

SHAPES = ((50, 24), (98, 24), (500, 100), (10_000, 1_000))  # (layers, stages); 24 stages x 30 dp at paper scale


def one(layers: int, stages: int, seed: int) -> tuple[float, int, bool]:
    rng = np.random.default_rng(seed)
    m = 4 * stages
    c = Controller(BalanceConfig(when="every", every=1, window=3), m, fixed_s=0.0)
    base = rng.uniform(0.5, 1.5, layers)
    for _ in range(3):
        c.observe((base * rng.lognormal(0, 0.05, layers)).tolist())
    calls = [0, 0]  # passes, layouts scored
    steps_s = c.model.steps_s

    def counted(problems, layouts, *args):
        calls[0] += 1
        calls[1] += len(layouts)
        return steps_s(problems, layouts, *args)

    c.model.steps_s = counted
    c.model.plan(stages, m)  # the schedule's graph is built once per shape, not per decision
    t = time.perf_counter()
    c.decide(1, Layout.uniform(layers, stages), [0] * layers, 100)
    return time.perf_counter() - t, calls, 2 * stages * m <= MAX_SIM_OPS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replays", default="", help="comma-separated trace names in --traces to replay with auto")
    ap.add_argument("--traces", default="docs/bench/traces")
    args = ap.parse_args(argv)
    print(f"python benchmarks/bench_decide.py --repeats {args.repeats}"
          + (f" --replays {args.replays}" if args.replays else "") + "\n")
    print("| layers | stages | microbatches | decide s (median) | simulation passes | layouts scored | objective |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for layers, stages in SHAPES:
        runs = [one(layers, stages, s) for s in range(args.repeats)]
        secs = statistics.median(r[0] for r in runs)
        print(f"| {layers:,} | {stages:,} | {4 * stages:,} | {secs:.3f} | {runs[0][1][0]} | {runs[0][1][1]} | "
              f"{'simulated' if runs[0][2] else 'closed form'} |", flush=True)
    names = [n.strip() for n in args.replays.split(",") if n.strip()]
    if names:
        print("\n| trace | steps | decide s | per step | share of the run |\n|---|---:|---:|---:|---:|")
    for name in names:
        r = replayed(Path(args.traces) / f"{name}.jsonl")
        print(f"| {name} | {r.steps} | {r.decide_s:.3f} | {1000 * r.decide_s / r.steps:.1f} ms | "
              f"{100 * r.decide_s / r.total_s:.2f} % |", flush=True)
    return 0


def replayed(path: Path):
    """`auto` from uniform over the whole trace at 24 x 30, noise-free (the replay's result)."""
    from dynmo.sim import load_trace, scale_trace
    from dynmo.sim.replay import ReplayOptions, replay, replay_balance

    trace = scale_trace(load_trace(path), 48)
    (r,) = replay(trace, 24, 30, ["optimal"], ReplayOptions(microbatches=96, balance=replay_balance(when="auto")))
    return r


if __name__ == "__main__":
    sys.exit(main())
