"""Replay the committed bench traces under every policy dynmo offers, at the traced shape and at
paper scale, and check the controller's promises.

    python benchmarks/replay_traces.py [--traces docs/bench/traces] [--paper-only]

For every `<case>-static.jsonl` in the folder (static runs of `configs/<case>.toml` on 2 ranks;
`dynmo train --nproc 2 --config configs/<case>.toml --balance.when never --trace FILE`) it
replays uniform, params, optimal, deepspeed, diffusion-contiguous, optimal+repack and the
oracle with `dynmo.sim.replay` -- the DynMo loop the trainer drives, on the traced costs -- at
the traced shape (2 stages) and scaled to the paper's shapes (the `dynmo bench` cases). It
prints per policy the speedup over static uniform (total time, migrations included), the
workers at the end, migrations, and for optimal+repack its step time per worker count over
optimal's; and it flags a policy below 0.99x of uniform, or a re-pack beyond its tolerance.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from dynmo.bench import CASES
from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import ReplayOptions, replay, replay_balance

POLICIES = ["uniform", "params", "optimal", "deepspeed", "diffusion-contiguous", "optimal+repack", "oracle"]
DYNAMIC = ("optimal", "deepspeed", "diffusion-contiguous", "optimal+repack")


def rows(name: str, trace, stages: int, dp: int, microbatches: int | None, when: str) -> list[str]:
    opts = ReplayOptions(microbatches=microbatches, balance=replay_balance(when=when))
    res = {r.policy: r for r in replay(trace, stages=stages, dp=dp, policies=POLICIES, options=opts)}
    tol = opts.balance.repack_tolerance
    out, bad = [], []
    for p in POLICIES:
        r = res[p]
        flag = ""
        if p in DYNAMIC and r.speedup < 0.99:
            flag = "BELOW 0.99x"
        extra = ""
        if p == "optimal+repack":
            # step time on the workers it kept vs optimal's over the same steps
            ratio = float(np.mean(r.iteration_s) / np.mean(res["optimal"].iteration_s))
            extra = f"{ratio:.3f}"
            if ratio > 1 + tol + 1e-9:
                flag = (flag + " " if flag else "") + f"REPACK > {1 + tol:.2f}x STEP TIME"
        out.append(f"| {name} | {stages}x{dp} | {p} | {r.speedup:.3f} | {r.workers_final} | {r.migrations} | {extra} | {flag} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="docs/bench/traces")
    ap.add_argument("--paper-only", action="store_true")
    args = ap.parse_args(argv)
    folder = Path(args.traces)
    print(f"python benchmarks/replay_traces.py --traces {folder}" + (" --paper-only" if args.paper_only else "") + "\n")
    print("| case | stages x dp | policy | speedup vs uniform | workers (final) | migrations | repack step time / optimal | |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    flagged = 0
    for case in CASES:
        path = folder / f"{case.name}-static.jsonl"
        if not path.is_file():
            print(f"| {case.name} | | no trace at {path} | | | | | |")
            continue
        trace = load_trace(path)
        lines = [] if args.paper_only else rows(case.name, trace, 2, 1, None, case.when)
        scaled = scale_trace(trace, case.blocks, noise=0.05)
        lines += rows(case.name, scaled, case.stages, case.dp, 4 * case.stages, case.when)
        flagged += sum("BELOW" in ln or "REPACK >" in ln for ln in lines)
        print("\n".join(lines), flush=True)
    print(f"\n{flagged} flagged")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
