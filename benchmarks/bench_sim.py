"""Simulator speed: seconds per simulated iteration at cluster scale (prints a table).

    python benchmarks/bench_sim.py

Each row simulates one iteration twice (the real stage times and the balanced ones, for
the bubble split) with random per-stage, per-microbatch times and a data-parallel ring
all-reduce. Data-parallel replicas are identical, so their count changes only the
all-reduce cost, not the work of the simulator.
"""

from __future__ import annotations

import time

import numpy as np

from dynmo.sim import simulate

CASES = [
    # schedule, pipeline ranks, stages per rank, dp, microbatches
    ("GPipe", 24, 1, 30, 64),
    ("1F1B", 24, 1, 30, 64),
    ("Interleaved1F1B", 24, 2, 30, 72),
    ("InterleavedZeroBubble", 24, 2, 30, 72),
    ("ZBVZeroBubble", 24, 2, 30, 64),
    ("1F1B", 64, 1, 30, 256),
]


def main() -> None:
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
