"""Whole blocks against half blocks as placement units, in real paired runs on this machine.

Produces the table in docs/bench/units.md ("Real 2-rank runs"; linked from docs/models.md,
"Placement units").

    python benchmarks/bench_units.py [--config configs/skewed.toml] [--pairs 6] [--steps 60]
                                     [--out runs/bench-units] [-- extra dynmo train overrides]

Runs `dynmo train` on 2 ranks with the config and `balance.when = auto`, alternately with
`parallel.unit = "block"` and `"sublayer"` (the order flips every pair, so slow drift of the
machine hits both alike), and prints per unit kind the median tokens/s (all steps but the
first, migrations included), the final layout and the migrations, then the median of the
pairs' ratios (sublayer / block) with a distribution-free interval
(`dynmo.bench.measures.median_interval`) and the verdict: faster, slower, or no measurable
difference when the interval holds 1.0. Both runs train the same model on the same data: the
losses are checked equal (bitwise) step for step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from dynmo.bench.measures import median_interval, throughput, verdict
from dynmo.bench.run import train

UNITS = ("block", "sublayer")


def migrations(recs: list[dict]) -> int:
    return sum(e["type"] == "migration" for r in recs for e in r["events"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/skewed.toml")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="runs/bench-units")
    ap.add_argument("extra", nargs="*", help="overrides passed to dynmo train (after --)")
    args = ap.parse_args(argv)
    print(f"python benchmarks/bench_units.py --config {args.config} --pairs {args.pairs} --steps {args.steps}"
          + (" -- " + " ".join(args.extra) if args.extra else "") + "\n", flush=True)
    common = ["--steps", str(args.steps), "--balance.when", "auto", *args.extra]
    runs: dict[str, list[list[dict]]] = {u: [] for u in UNITS}
    ratios = []
    for k in range(args.pairs):
        order = UNITS if k % 2 == 0 else UNITS[::-1]
        for unit in order:
            recs = train(Path(args.out) / f"{unit}-{k}", args.config, *common, "--parallel.unit", unit)
            runs[unit].append(recs)
            print(f"  pair {k} {unit}: {throughput(recs):,.0f} tok/s, {migrations(recs)} migrations, "
                  f"final layout {recs[-1]['layout_str']}", file=sys.stderr, flush=True)
        block, sub = runs["block"][-1], runs["sublayer"][-1]
        if [r["loss"] for r in block] != [r["loss"] for r in sub]:
            print(f"bench_units: pair {k}: the two runs' losses differ; the units must train the same model",
                  file=sys.stderr)
            return 1
        ratios.append(throughput(sub) / throughput(block))
    print("| unit | tok/s (median of runs) | migrations (median) | final layout (last run) |")
    print("|---|---:|---:|---|")
    for unit in UNITS:
        tps = statistics.median(throughput(r) for r in runs[unit])
        migs = statistics.median(migrations(r) for r in runs[unit])
        layout = runs[unit][-1][-1]["layout_str"].replace("|", "\\|")  # a stage boundary, not a column
        print(f"| {unit} | {tps:,.0f} | {migs:g} | {layout} |")
    med, low, high, cover = median_interval(ratios)
    print(f"\nsublayer / block, {len(ratios)} pairs: median {med:.3f}, interval [{low:.3f}, {high:.3f}] "
          f"({cover:.0%} coverage): {verdict(low, high)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
