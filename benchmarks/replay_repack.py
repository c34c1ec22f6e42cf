"""Re-packing against keeping every worker, replayed at paper scale (pure, no torch).

Produces the table in docs/bench/controller-repack.md (linked from docs/controller.md,
"Re-packing").

    python benchmarks/replay_repack.py [--traces docs/bench/traces] [--cases mod,hashattn,moe,earlyexit]

`dynmo bench`'s static traces of the shrinking and MoE-family cases, scaled to its shapes (16 x 8
with 32 blocks for MoE/MoD, 24 x 30 with 48 for the others, 4 microbatches per stage), replayed
under `optimal` and `optimal+repack` with `balance.when = auto` and the default 5 % tolerance.
Per case: the workers the re-packed run ends on, its step time over `optimal`'s on the last 10
steps and on the second half, the worst single step, and the total time. The tolerance is on
the predicted step time when a re-pack is decided; the rows show what it came to afterwards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dynmo.bench.cases import CASES
from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import ReplayOptions, replay, replay_balance


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="docs/bench/traces")
    ap.add_argument("--cases", default="mod,hashattn,moe,earlyexit")
    args = ap.parse_args(argv)
    print(f"python benchmarks/replay_repack.py --traces {args.traces} --cases {args.cases}\n")
    print("| case | shape | workers (start → end) | last 10 steps / optimal | second half / optimal | worst step | total / optimal |")
    print("|---|---|---|---:|---:|---:|---:|")
    shapes = {c.name: (c.stages, c.dp, c.blocks) for c in CASES}  # dynmo bench's paper-scale shapes
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        path = Path(args.traces) / f"{name}-static.jsonl"
        if name not in shapes or not path.is_file():
            print(f"replay_repack: no case {name!r} with a trace {path}", file=sys.stderr)
            return 2
        stages, dp, blocks = shapes[name]
        opts = ReplayOptions(microbatches=4 * stages, balance=replay_balance(when="auto"))
        res = {r.policy: r for r in replay(scale_trace(load_trace(path), blocks), stages, dp,
                                           ["optimal", "optimal+repack"], opts)}
        o, r = res["optimal"], res["optimal+repack"]
        half = len(o.iteration_s) // 2
        worst = max(b / a for a, b in zip(o.iteration_s, r.iteration_s))
        print(f"| {name} | {stages}x{dp} | {r.workers[0]} → {r.workers[-1]} | "
              f"{sum(r.iteration_s[-10:]) / sum(o.iteration_s[-10:]):.3f} | "
              f"{sum(r.iteration_s[half:]) / sum(o.iteration_s[half:]):.3f} | {worst:.3f} | {r.total_s / o.total_s:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
