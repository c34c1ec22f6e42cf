"""Fair to the start: dynmo started on a layout against that layout left static, replayed noise-free.

    python benchmarks/replay_starts.py [--traces docs/bench/traces] [--cases moe,dense-60]

The promise a user needs before turning dynmo on: started on the layout they would have fixed
(uniform, as Megatron-LM; params, as DeepSpeed; profile-once, the optimum of the first steps'
costs), dynmo is never slower than that layout left alone. Every committed trace is scaled to
a paper-sized model with no added noise and replayed on 24 stages x 30 replicas (48 blocks, 96
microbatches), the MoE family (moe, mixtral, their dense model) also on 16 x 8 (32 blocks, 64
microbatches), as benchmarks/replay_headline.py does. Per trace and start S: static S's total
time over dynmo's (`optimal`, `balance.when = auto`, started on S), over the whole run and over
its second half, and dynmo's migrations. The decisions' measured time is left out, so that the
table repeats. Pure; no torch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import ReplayOptions, replay, replay_balance
from replay_headline import MOE_FAMILY, SHAPES, traces  # run as a script: benchmarks/ is on the path

STARTS = ("uniform", "params", "profile-once")
FLOOR = 0.995  # the promise, within the replay's own rounding of a migration's cost


def rows(path: Path, shape: str) -> list[dict]:
    stages, dp, blocks, m = SHAPES[shape]
    trace = scale_trace(load_trace(path), blocks)
    opts = ReplayOptions(microbatches=m, balance=replay_balance(when="auto"), charge_decide=False)
    static = {r.policy: r for r in replay(trace, stages, dp, list(STARTS), opts)}
    out = []
    for start in STARTS:
        (dyn,) = replay(trace, stages, dp, ["optimal"], replace(opts, initial=start))
        fixed = static[start]
        half = len(fixed.iteration_s) // 2

        def second(r) -> float:
            return sum(r.iteration_s[half:]) + sum(r.overhead_s[half:])

        out.append({"start": start, "whole": fixed.total_s / dyn.total_s, "second_half": second(fixed) / second(dyn),
                    "migrations": dyn.migrations})
    return out


def main(argv: list[str] | None = None) -> int:
    paths = traces(argv, __doc__, "replay_starts")
    if paths is None:
        return 2
    print("| trace | shape | " + " | ".join(f"from {s}: whole, second half, migrations" for s in STARTS) + " |")
    print("|---|---|" + "---|" * len(STARTS))
    below = []
    for path in paths:
        name = path.stem.removesuffix("-static")
        for shape in ["24x30"] + (["16x8"] if name.startswith(MOE_FAMILY) else []):
            t0 = time.perf_counter()
            got = rows(path, shape)
            cells = []
            for r in got:
                mark = " **below**" if r["whole"] < FLOOR else ""
                cells.append(f"{r['whole']:.3f}{mark}, {r['second_half']:.3f}, {r['migrations']}")
                if r["whole"] < FLOOR:
                    below.append(f"{name} {shape} from {r['start']}: {r['whole']:.3f}")
            print(f"| {name} | {shape} | " + " | ".join(cells) + " |", flush=True)
            print(f"replay_starts: {name} {shape} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"\nbelow {FLOOR} x the start left static: " + ("; ".join(below) if below else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
