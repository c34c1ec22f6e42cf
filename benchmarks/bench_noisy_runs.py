"""Real 2-rank runs of the controller under the seeded noise injector (configs/noisy.toml's noise).

Produces the runs in docs/bench/controller-noisy-runs.md (linked from docs/controller.md).

    python benchmarks/bench_noisy_runs.py [--seeds 10] [--steps 40] [--balanced-steps 0]

1. skew + noise: the default model with the injector on and the skew of configs/skewed.toml
   (blocks 0-2 do 4x the MLP work) from step 20, `balance.when = auto`, 60 steps: the step of
   the first migration, and tokens/s from 2 steps after it to the end against the same run
   forced onto the layout that is optimal for a static run's measured costs.
2. seeds: configs/skewed.toml under `auto` with the injector on, seeds 0..N-1: the final layout
   of each against that optimal layout, and the migrations of each.
3. with --balanced-steps S: configs/noisy.toml (the balanced model, injector on, auto) for S
   steps: its migrations (0 is right).
The optimal layout comes from a static run of configs/skewed.toml without noise: the median of
`layer_cost_s` over its steps after the skew, balanced with `optimal` on 2 stages.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from dynmo.bench.run import train
from dynmo.balance import Problem, balance
from dynmo.config import load_config

NOISE = ["--noise.enabled", "true", "--noise.jitter", "0.3", "--noise.straggler_prob", "0.05",
         "--noise.straggler_factor", "3", "--noise.slow_rank", "1", "--noise.slow_factor", "1.5",
         "--noise.slow_every", "50", "--noise.slow_steps", "3"]


def migrations(recs: list[dict]) -> list[int]:
    return [r["step"] for r in recs if any(e["type"] == "migration" for e in r["events"])]


def part1(auto: list[dict], forced: list[dict], best) -> None:
    moved = migrations(auto)
    first = next((s for s in moved if s >= 20), None)
    since = (first or 20) + 2
    tps_auto = statistics.median(r["tokens_per_s"] for r in auto[since:])
    tps_forced = statistics.median(r["tokens_per_s"] for r in forced[since:])
    print("| run | migrations (steps) | first after the skew at 20 | final layout | tokens/s from 2 steps after it | vs forced optimal |")
    print("|---|---|---:|---|---:|---:|")
    print(f"| skew at 20 + noise, auto | {moved} | {first} | {auto[-1]['layout']} | {tps_auto:.0f} | "
          f"{tps_auto / tps_forced:.3f} |")
    print(f"| the same, forced onto {list(best)} | - | - | {forced[-1]['layout']} | {tps_forced:.0f} | 1.000 |\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--balanced-steps", type=int, default=0)
    ap.add_argument("--no-skew-run", action="store_true", help="skip part 1 (skew at step 20)")
    args = ap.parse_args(argv)
    noisy = load_config("configs/noisy.toml").noise
    assert noisy.enabled and noisy.jitter == 0.3 and noisy.slow_steps == 3, "NOISE above mirrors configs/noisy.toml"
    skew_start = load_config("configs/skewed.toml").skew.start_step
    print(f"python benchmarks/bench_noisy_runs.py --seeds {args.seeds} --steps {args.steps} "
          f"--balanced-steps {args.balanced_steps}" + (" --no-skew-run" if args.no_skew_run else "") + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)

        def run(name: str, config: str, *extra: str) -> list[dict]:
            print(f"  {name} ...", file=sys.stderr, flush=True)
            return train(out / name, config, "--train.eval_every", "0", *extra)

        static = run("static", "configs/skewed.toml", "--steps", str(args.steps))
        costs = [statistics.median(col) for col in zip(*(r["layer_cost_s"] for r in static[skew_start + 2:]))]
        best = balance(Problem(costs=costs, stages=2), "optimal").boundaries
        print(f"optimal layout for the static run's measured costs: {best}\n")

        skew = ["--skew.blocks", "0;1;2", "--skew.factor", "4", "--skew.start_step", "20"]
        auto = [] if args.no_skew_run else run("skew-auto", "configs/noisy.toml", "--steps", "60", *skew)
        forced = [] if args.no_skew_run else run("skew-forced", "configs/noisy.toml", "--steps", "60", *skew, "--balance.when", "never",
                     "--parallel.layout", ",".join(map(str, best)))
        if not args.no_skew_run:
            part1(auto, forced, best)

        print(f"| seed | migrations (steps) | final layout | optimal? |")
        print("|---:|---|---|---|")
        hits = 0
        for seed in range(args.seeds):
            recs = run(f"seed{seed}", "configs/skewed.toml", "--steps", str(args.steps), "--balance.when", "auto",
                       *NOISE, "--noise.seed", str(seed))
            ok = recs[-1]["layout"] == list(best) and len(migrations(recs)) <= 2
            hits += ok
            print(f"| {seed} | {migrations(recs)} | {recs[-1]['layout']} | {'yes' if ok else 'NO'} |", flush=True)
        print(f"\n{hits} of {args.seeds} seeded runs end on {best} with at most 2 migrations")

        if args.balanced_steps:
            recs = run("balanced", "configs/noisy.toml", "--steps", str(args.balanced_steps))
            print(f"\nconfigs/noisy.toml, {args.balanced_steps} steps: migrations at {migrations(recs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
