"""Simulator speed at cluster scale, and replays of real traces at paper scale (prints tables).

Produces, with --trace, the replays in docs/bench/simulator-paper-scale-replays.md; without it, the
engine's speed at cluster scale that docs/simulator.md cites.

    python benchmarks/bench_sim.py                                   # speed table only
    python benchmarks/bench_sim.py --trace runs/skewed [--trace runs/moe.trace.jsonl ...] [--plots DIR]

With --trace (a trace file or a run folder), each trace is scaled to a paper-sized model and
replayed under every policy: MoE and MoD traces at 32 blocks on 16 stages x 8 dp, the others
at 48 blocks on 24 stages x 30 dp (the paper's 720 GPUs), 4 microbatches per stage.

Each row simulates one iteration twice (the real stage times and the balanced ones, for
the bubble split) with random per-stage, per-microbatch times and a data-parallel ring
all-reduce. Data-parallel replicas are identical, so their count changes only the
all-reduce cost, not the work of the simulator.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from dynmo.sim import simulate
from dynmo.sim.replay import ReplayOptions, replay, summary_table
from dynmo.sim.trace import load_trace, scale_trace

CASES = [
    # schedule, pipeline ranks, stages per rank, dp, microbatches
    ("GPipe", 24, 1, 30, 64),
    ("1F1B", 24, 1, 30, 64),
    ("Interleaved1F1B", 24, 2, 30, 72),
    ("InterleavedZeroBubble", 24, 2, 30, 72),
    ("ZBVZeroBubble", 24, 2, 30, 64),
    ("1F1B", 64, 1, 30, 256),
]


def paper_shape(case: str) -> tuple[int, int, int]:
    """(blocks, stages, dp) of the paper's setting for a case."""
    if any(c in ("moe", "mod") for c in case.split("+")):
        return 32, 16, 8
    return 48, 24, 30


def replay_at_scale(path: str, plots: str | None, opts: ReplayOptions) -> None:
    trace = load_trace(path)
    blocks, stages, dp = paper_shape(trace.header.case)
    big = scale_trace(trace, blocks)
    m = 4 * stages
    t0 = time.perf_counter()
    results = replay(big, stages, dp, None, ReplayOptions(**{**opts.__dict__, "microbatches": m}))
    dt = time.perf_counter() - t0
    print(f"\n{path}: case {trace.header.case}, {len(trace.steps)} steps, scaled {trace.num_layers - 2} -> "
          f"{blocks} blocks, {stages} stages x {dp} dp, {m} microbatches ({dt:.1f} s to replay)")
    print(summary_table(results))
    if plots:
        from dynmo.sim.plots import write_plots

        out = Path(plots) / Path(path).name.replace(".jsonl", "")
        write_plots(results, out, f"{trace.header.case}, {stages} stages x {dp} dp")
        print(f"plots in {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", action="append", default=[], help="trace file or run folder to replay at scale")
    ap.add_argument("--plots", help="write replay plots under this folder")
    ap.add_argument("--comm", type=float, default=0.0, help="seconds per stage-to-stage transfer")
    ap.add_argument("--allreduce-bandwidth", type=float, help="bytes/s of the dp all-reduce (default: off)")
    args = ap.parse_args()
    speed_table()
    opts = ReplayOptions(comm=args.comm, allreduce_bandwidth=args.allreduce_bandwidth)
    for path in args.trace:
        replay_at_scale(path, args.plots, opts)


def speed_table() -> None:
    rng = np.random.default_rng(0)
    print(f"{'schedule':<22} {'ranks':>5} {'v':>2} {'dp':>3} {'mb':>4} {'ops':>7} "
          f"{'sim s':>7} {'iter s':>8} {'bubble':>7} {'imbal':>7}")
    for name, p, v, dp, m in CASES:
        S = p * v
        fwd = rng.uniform(0.8, 1.2, size=(S, m)) * 0.01
        bwd = 2 * fwd
        t0 = time.perf_counter()
        r = simulate(fwd, bwd, name, m, stages_per_rank=v, wgrad=bwd / 2, comm=1e-4, dp=dp,
                     grad_bytes=[2e8] * S, bandwidth=1e10, latency=2e-5)
        dt = time.perf_counter() - t0
        ops = S * m * (3 if name.endswith("ZeroBubble") else 2)
        print(f"{name:<22} {p:>5} {v:>2} {dp:>3} {m:>4} {ops:>7} {dt:>7.3f} "
              f"{r.iteration_time:>8.3f} {r.bubble_ratio:>7.3f} {r.bubble_imbalance:>7.3f}")


if __name__ == "__main__":
    main()
