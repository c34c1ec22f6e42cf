"""What finer placement units buy: one sublayer trace replayed with block units and with sublayer units.

Produces the tables in docs/bench/simulator-sublayer-units.md (linked from docs/simulator.md,
"Sublayer traces"); tests/test_sim_units.py imports it.

    python benchmarks/replay_units.py TRACE.jsonl [TRACE2.jsonl ...] [--blocks 48 --stages 24 --dp 30 --microbatches 96]

Each trace comes from a run with `parallel.unit = "sublayer"`; it is scaled to --blocks blocks and
replayed with sublayer units and, merged, with whole blocks by `dynmo.sim.replay.replay_units`
(whose module doc says what each column is). One row per trace and unit kind: the best static
layout and its total seconds, the balance gap, dynmo's (`optimal`, `balance.when = auto`) total
seconds and migrations, the oracle's total seconds, and the sublayer row's best static, dynmo and
oracle totals over the block row's (< 1: the finer units are faster). `dynmo bench` puts the same
replay of every trace in OUT/traces/sublayer/ in bench.md ("Whole blocks against half blocks").

Pure; no torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dynmo.balance import BalanceError
from dynmo.engine import SimInputError
from dynmo.sim.replay import load_sublayer_trace, replay_units
from dynmo.sim.trace import TraceError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path, help="traces of runs with parallel.unit = \"sublayer\"")
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--stages", type=int, default=24)
    ap.add_argument("--dp", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=96)
    args = ap.parse_args(argv)
    print(f"python benchmarks/replay_units.py {' '.join(map(str, args.traces))} --blocks {args.blocks} "
          f"--stages {args.stages} --dp {args.dp} --microbatches {args.microbatches}\n")
    print("| trace | units | layers | best static | best static s | balance gap | dynmo s | dynmo migrations "
          "| oracle s | sublayer / block (best static, dynmo, oracle) |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---|")
    for path in args.traces:
        t0 = time.perf_counter()
        try:
            rows = replay_units(load_sublayer_trace(path), args.blocks, args.stages, args.dp, args.microbatches)
        except (TraceError, SimInputError, BalanceError) as e:
            print(f"replay_units: {e}", file=sys.stderr)
            return 2
        for units, r in rows.items():
            vs = "reference" if units == "block" else ", ".join(
                "n/a" if x is None else f"{x:.3f}" for x in r["vs_block"].values())
            print(f"| {path.stem} | {units} | {r['layers']} | {r['best_static']} | {r['best_static_s']:.4g} | "
                  f"{r['gap']:.3f} | {r['dynmo_s']:.4g} | {r['migrations']} | {r['oracle_s']:.4g} | {vs} |", flush=True)
        print(f"replay_units: {path.stem} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
