"""Real 2-rank runs on this machine: static uniform layout vs dynmo on the skewed model.

Produces the table in docs/bench/controller-skewed-2ranks.md (linked from docs/controller.md).

    python benchmarks/bench_dynmo.py [--steps 40] [--repeats 2] [--config configs/skewed.toml]

Each repeat trains the same model three times through the real launcher (`dynmo train
--nproc 2`), in turn so that machine noise hits all variants alike:
  static      balance.when = never, the uniform layout throughout
  no-profile  the same with the per-layer profiler off (balance.profile = false): what
              profiling costs end to end
  dynmo       balance.when = auto (median forecast, cost/benefit trigger)
It prints, over the steady state (from `--settle` steps after the skew switches on):
tokens/s, bubble ratio before the skew and in the steady state, the speedup of dynmo over
static and the oracle bound (static bottleneck / best contiguous bottleneck, from the
per-layer costs measured in the static run), and dynmo's overhead (profiler bookkeeping +
deciding + migrating) as % of its training time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from dynmo.bench.measures import overhead_s
from dynmo.bench import run as bench_run
from dynmo.balance import Problem, balance
from dynmo.layout import Layout

def train(out: Path, config: str, steps: int, *extra: str) -> list[dict]:
    return bench_run.train(out, config, "--steps", str(steps), *extra)


def med(xs) -> float:
    return statistics.median(list(xs))


def summarize(recs: list[dict], skew_start: int, settle: int) -> dict:
    before = [r for r in recs if 1 <= r["step"] < skew_start]
    steady = [r for r in recs if r["step"] >= skew_start + settle]
    migrations = [e for r in recs for e in r["events"] if e["type"] == "migration"]
    train_s = sum(r["step_s"] for r in recs)
    overhead = overhead_s(recs)
    return {
        "tokens_per_s": med(r["tokens_per_s"] for r in steady),
        "bubble_before": med(r["bubble_ratio"] for r in before) if before else float("nan"),
        "bubble_steady": med(r["bubble_ratio"] for r in steady),
        "imbalance_steady": med(r["imbalance"] for r in steady),
        "layout": steady[-1]["layout_str"],
        "boundaries": steady[-1]["layout"],
        "migrations": len(migrations),
        "first_migration": next((r["step"] for r in recs if any(e["type"] == "migration" for e in r["events"])), None),
        "overhead_pct": 100 * overhead / train_s,
        "profile_s": sum(r["profile_s"] for r in recs),
        "train_s": train_s,
        "costs": [med(col) for col in zip(*(r["layer_cost_s"] for r in steady))] if "layer_cost_s" in steady[0] else None,
        "compute": [med(col) for col in zip(*(r["stage_compute_s"] for r in steady))],
        "static_layout": recs[0]["layout"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/skewed.toml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skew-start", type=int, default=5, help="the config's skew.start_step")
    ap.add_argument("--settle", type=int, default=5, help="steps after the skew before the steady state")
    ap.add_argument("--json", action="store_true", help="print the raw summaries as JSON too")
    args = ap.parse_args()
    variants = {
        "static": ["--balance.when", "never"],
        "no-profile": ["--balance.when", "never", "--balance.profile", "false"],
        "dynmo": ["--balance.when", "auto"],
    }
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, extra in variants.items():
                print(f"repeat {rep + 1}/{args.repeats}: {name} ...", file=sys.stderr, flush=True)
                recs = train(Path(tmp) / f"{name}-{rep}", args.config, args.steps, *extra)
                runs[name].append(summarize(recs, args.skew_start, args.settle))

    def agg(name: str, key: str) -> float:
        return med(s[key] for s in runs[name])

    # oracle bound from the static runs' measured per-layer costs
    static_costs = [med(col) for col in zip(*(s["costs"] for s in runs["static"]))]
    lay = Layout(tuple(runs["static"][0]["static_layout"]))
    static_bottleneck = max(lay.stage_loads(static_costs))
    best = balance(Problem(costs=static_costs, stages=lay.num_stages), "optimal")
    oracle = static_bottleneck / best.bottleneck
    compute_static = max(med(col) for col in zip(*(s["compute"] for s in runs["static"])))
    compute_dynmo = max(med(col) for col in zip(*(s["compute"] for s in runs["dynmo"])))
    speedup = agg("dynmo", "tokens_per_s") / agg("static", "tokens_per_s")
    prof_cost = 1 - agg("static", "tokens_per_s") / agg("no-profile", "tokens_per_s")

    print(f"\n## dynmo vs static on {args.config} (2 ranks, {args.steps} steps, median of {args.repeats} runs)\n")
    print("| variant | tokens/s (steady) | bubble before skew | bubble steady | imbalance steady | layout (steady) | migrations | overhead % |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for name in variants:
        print(f"| {name} | {agg(name, 'tokens_per_s'):,.0f} | {agg(name, 'bubble_before'):.3f} | "
              f"{agg(name, 'bubble_steady'):.3f} | {agg(name, 'imbalance_steady'):.3f} | {runs[name][-1]['boundaries']} | "
              f"{agg(name, 'migrations'):.0f} | {agg(name, 'overhead_pct'):.2f} |")
    print()
    print(f"- oracle bound (static bottleneck / best contiguous, measured per-layer costs): {oracle:.3f}x "
          f"(best layout {best.boundaries})")
    print(f"- dynmo speedup, tokens/s: {speedup:.3f}x = {100 * (speedup - 1) / max(oracle - 1, 1e-9):.0f}% of the "
          f"bound's gain, {100 * speedup / oracle:.1f}% of the bound")
    print(f"- slowest stage compute per step: static {compute_static * 1e3:.1f} ms, dynmo {compute_dynmo * 1e3:.1f} ms "
          f"({compute_static / compute_dynmo:.3f}x)")
    print(f"- dynmo overhead (profiler bookkeeping + deciding + migrating) / training time: "
          f"{agg('dynmo', 'overhead_pct'):.2f}%; first migration at step {runs['dynmo'][-1]['first_migration']}")
    print(f"- profiler on vs off, static layout, tokens/s: {100 * prof_cost:+.1f}% "
          f"(positive = profiling costs throughput; noise on a shared machine is a few %)")
    if args.json:
        print(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
