"""Fair to the start: dynmo started on a layout against that layout left static, replayed noise-free.

Produces the tables in docs/bench/controller-starts.md (linked from docs/controller.md).

    python benchmarks/replay_starts.py [--traces docs/bench/traces] [--cases moe,dense-60]

The promise a user needs before turning dynmo on: started on the layout they would have fixed
(uniform, as Megatron-LM; params, as DeepSpeed; profile-once, the optimum of the first steps'
costs; flops, dynmo's default, the partition of the FLOP model), dynmo is never slower than that
layout left alone; and from its default start, over the second half of the run, it is compared
with the best static layout (the fastest of uniform, params and profile-once in hindsight). Every committed trace is scaled to
a paper-sized model with no added noise and replayed on 24 stages x 30 replicas (48 blocks, 96
microbatches), the MoE family (moe, mixtral, their dense model) also on 16 x 8 (32 blocks, 64
microbatches), as benchmarks/replay_headline.py does. Per trace and start S: static S's total
time over dynmo's (`optimal`, `balance.when = auto`, started on S), over the whole run and over
its second half, and dynmo's migrations; from the default start also the bound of a controller
that follows lasting changes, `oracle-window` (one layout per window of balance.window +
balance.confirm steps, chosen in hindsight, migrations charged): its gain over the best static
layout and the share of it dynmo captures, where it gains 3 % or more (the controller's second
promise). The decisions' measured time is left out, so that the table repeats. Pure; no torch.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import ReplayOptions, default_start, replay, replay_balance
from replay_headline import MOE_FAMILY, SHAPES, traces  # run as a script: benchmarks/ is on the path

STARTS = ("uniform", "params", "profile-once", "flops")
FLOOR = 0.995  # the promise, within the replay's own rounding of a migration's cost
WINDOW_GAIN = 0.03  # where oracle-window gains this much over the best static layout, dynmo should capture
CAPTURE = 0.80  # ... this share of it


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
                    "migrations": dyn.migrations, "vs_best_second_half": dyn.speedup_vs_best_static_second_half})
        if start == default_start():
            got = {r.policy: r for r in replay(trace, stages, dp, [*STARTS, "optimal", "oracle-window"],
                                                replace(opts, initial=start))}
            out[-1] |= {"window_gain": got["oracle-window"].speedup_vs_best_static - 1.0,
                        "window_capture": got["optimal"].capture_oracle_window}
    return out


def main(argv: list[str] | None = None) -> int:
    paths = traces(argv, __doc__, "replay_starts")
    if paths is None:
        return 2
    print("| trace | shape | " + " | ".join(f"from {s}: whole, second half, migrations" for s in STARTS)
          + " | from the default start (flops), second half: vs best static | oracle-window over best static, "
          "dynmo's capture of it |")
    print("|---|---|" + "---|" * (len(STARTS) + 2))
    below, short, missed = [], [], []
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
            d = next(r for r in got if r["start"] == default_start())
            default = d["vs_best_second_half"]
            cells.append(f"{default:.3f}")
            if default < 1.0:
                short.append(f"{name} {shape}: {default:.3f}")
            cap = d["window_capture"]
            cells.append(f"{1 + d['window_gain']:.3f}, " + (f"{cap:.2f}" if cap is not None else "n/a"))
            if d["window_gain"] >= WINDOW_GAIN and (cap is None or cap < CAPTURE):
                missed.append(f"{name} {shape}: {cap:.2f} of {d['window_gain']:.1%}")
            print(f"| {name} | {shape} | " + " | ".join(cells) + " |", flush=True)
            print(f"replay_starts: {name} {shape} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"\nbelow {FLOOR} x the start left static: " + ("; ".join(below) if below else "none"))
    print("from the default start, below the best static layout over the second half: "
          + ("; ".join(short) if short else "none"))
    print(f"from the default start, under {CAPTURE:.0%} of oracle-window's gain where it is {WINDOW_GAIN:.0%} or more: "
          + ("; ".join(missed) if missed else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
