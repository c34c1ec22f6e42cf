"""Decision time and bottleneck / optimum of every balancer, 48x8 up to 10,000x1,000 layers x stages.

Produces the speed table in docs/bench/balancer-speed.md (linked from docs/balancers.md, "Speed").

    python benchmarks/bench_balance.py [--repeats 5] [--hetero] [--dominant]

Costs are log-normal per layer (a dynamic model: pruned, frozen or MoE layers differ widely);
the current layout is uniform. --hetero adds per-stage speeds (0.5x..2x), memory caps and a
transfer cost. --dominant gives one layer the cost of all others together: that layer alone
sets the optimal bottleneck and every other stage has slack, so `optimal`'s fewest-moves step
has wide candidate sets (its hardest case). A balancer whose estimated time exceeds --budget
seconds is skipped and says so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dynmo.balance import Problem, balance

SIZES = [(48, 8), (128, 16), (1000, 100), (10_000, 1_000)]
NAMES = ["uniform", "deepspeed", "diffusion", "diffusion-contiguous", "optimal"]


def make(n: int, p: int, hetero: bool, seed: int = 0, dominant: bool = False) -> Problem:
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(0.0, 0.75, n)
    if dominant:
        costs[n // 3] = costs.sum()
    kw: dict = {"costs": costs.tolist(), "stages": p}
    if hetero:
        mem = rng.uniform(1, 2, n)
        kw["memory"] = mem.tolist()
        kw["capacity"] = (mem.sum() / p * rng.uniform(1.5, 3.0, p)).tolist()
        kw["speeds"] = rng.choice([0.5, 1.0, 1.0, 1.0, 2.0], p).tolist()
        kw["transfer"] = 0.05
    return Problem(**kw)


def estimate(name: str, n: int, p: int) -> float:
    """Rough seconds, to skip hopeless runs instead of hanging."""
    if name == "deepspeed":
        return n * n * p * 2e-9 + n * p * 8e-6  # O(n^2 p) DP, one numpy call per cell
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=60.0)
    ap.add_argument("--hetero", action="store_true")
    ap.add_argument("--dominant", action="store_true")
    args = ap.parse_args()
    print(f"costs lognormal(0, 0.75){', one layer = all others' if args.dominant else ''}, current = uniform, "
          f"{'heterogeneous' if args.hetero else 'identical'} workers; time = median of {args.repeats} (1 run when > 1 s)")
    print(f"{'layers x stages':>16} {'balancer':>22} {'time':>12} {'bottleneck/opt':>15} {'imbalance':>10} {'moves':>7}")
    for n, p in SIZES:
        pr = make(n, p, args.hetero, dominant=args.dominant)
        opt = balance(pr, "optimal").bottleneck
        for name in NAMES:
            est = estimate(name, n, p)
            if est > args.budget:
                print(f"{f'{n}x{p}':>16} {name:>22} {'skipped':>12}   (O(n^2 p): ~{est:.0f} s > --budget {args.budget:.0f} s)")
                continue
            times = []
            r = None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                try:
                    r = balance(pr, name)
                except ValueError as e:
                    r = e
                times.append(time.perf_counter() - t0)
                if times[-1] > 1.0:
                    break
            t = statistics.median(times)
            ts = f"{t * 1e3:.3f} ms" if t < 1 else f"{t:.2f} s"
            if isinstance(r, Exception):
                print(f"{f'{n}x{p}':>16} {name:>22} {ts:>12}   error: {r}")
                continue
            ratio = r.bottleneck / opt
            note = "" if r.contiguous else "  (non-contiguous)"
            print(f"{f'{n}x{p}':>16} {name:>22} {ts:>12} {ratio:>15.4f} {r.imbalance:>10.3f} {len(r.moves):>7}{note}")


if __name__ == "__main__":
    main()
