"""Replay the committed bench traces under every policy dynmo offers, at the traced shape and at
paper scale, and check the controller's promises.

Produces the tables in docs/bench/controller-replay-traces.md (linked from docs/controller.md);
--link-delays prints the replayed link-delay table docs/simulator.md describes.

    python benchmarks/replay_traces.py [--traces docs/bench/traces] [--paper-only]
                                       [--link-delays CASE [--link-base-s S] [--links 0,1]]

For every `<case>-static.jsonl` in the folder (static runs of `configs/<case>.toml` on 2 ranks;
`dynmo train --nproc 2 --config configs/<case>.toml --balance.when never --trace FILE`) it
replays uniform, params, profile-once, optimal, deepspeed, diffusion-contiguous, optimal+repack
and the oracle with `dynmo.sim.replay` -- the DynMo loop the trainer drives, on the traced costs --
at the traced shape (2 stages) and scaled to the paper's shapes (the `dynmo bench` cases). It
prints per policy the speedup over static uniform and over the best static layout (the fastest
of uniform, params and profile-once: what a careful user could pick without run-time balancing;
total time, migrations included), the workers at the end, the worker-seconds the run used and
its tokens/s per worker (re-packing: the same training on fewer workers), migrations, and for
optimal+repack its step time on the workers it kept over optimal's; and it flags a dynamic
policy below 0.99x of uniform, or a re-pack beyond its tolerance.

--link-delays CASE adds the paper's network experiment on that case at paper scale: a delay of
0x, 1x, 2x, 4x `--link-base-s` per transfer on `--links` (default: every link), link-aware
(`balance.links = measure`) against compute-only (`free`) balancing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from dynmo.bench import CASES
from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import ReplayOptions, link_delay_table, replay, replay_balance, replay_link_delays

POLICIES = ["uniform", "params", "profile-once", "optimal", "deepspeed", "diffusion-contiguous", "optimal+repack",
            "oracle"]
DYNAMIC = ("optimal", "deepspeed", "diffusion-contiguous", "optimal+repack")
HEADER = ("| case | stages x dp | policy | speedup vs uniform | best static | speedup vs best static | workers (final) "
          "| worker-s | tokens/s per worker | migrations | repack step time / optimal | |")


def rows(name: str, trace, stages: int, dp: int, microbatches: int | None, when: str) -> list[str]:
    opts = ReplayOptions(microbatches=microbatches, balance=replay_balance(when=when))
    res = {r.policy: r for r in replay(trace, stages=stages, dp=dp, policies=POLICIES, options=opts)}
    tol = opts.balance.repack_tolerance
    out = []
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
        per_worker = r.tokens_per_s_per_worker
        pw = f"{per_worker:.2f}" if per_worker is not None else f"{r.steps_per_worker_s:.3g} steps"
        out.append(f"| {name} | {stages}x{dp} | {p} | {r.speedup:.3f} | {r.best_static} | {r.speedup_vs_best_static:.3f} "
                   f"| {r.workers_final} | {r.worker_s:.1f} | {pw} | {r.migrations} | {extra} | {flag} |")
    return out


def link_delays(folder: Path, case_name: str, base_s: float | None, links: list[int] | None) -> None:
    case = {c.name: c for c in CASES}[case_name]
    trace = scale_trace(load_trace(folder / f"{case.name}-static.jsonl"), case.blocks, noise=0.05)
    m = 4 * case.stages
    if base_s is None:  # default: a tenth of the mean stage's compute per microbatch
        base_s = round(float(trace.costs().sum(axis=1).mean()) / case.stages / 10, 4)
    opts = ReplayOptions(microbatches=m, balance=replay_balance(when=case.when), charge_decide=False)
    res = replay_link_delays(trace, base_s, case.stages, case.dp, links=links, options=opts)
    where = "every link" if links is None else f"links {','.join(map(str, links))}"
    print(f"\nlink delays: {case.name}, {case.blocks} blocks, {case.stages} stages x {case.dp} dp, {m} microbatches, "
          f"when={case.when}, delay on {where}, base {base_s * 1e3:.1f} ms per transfer, decide time not charged\n")
    print(link_delay_table(res), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", default="docs/bench/traces")
    ap.add_argument("--paper-only", action="store_true")
    ap.add_argument("--link-delays", metavar="CASE", help="also run the link-delay experiment on this case")
    ap.add_argument("--link-base-s", type=float, help="base delay per transfer, seconds (default: 10%% of a stage)")
    ap.add_argument("--links", help="comma-separated indices of the delayed links (default: all)")
    args = ap.parse_args(argv)
    folder = Path(args.traces)
    print(f"python benchmarks/replay_traces.py --traces {folder}" + (" --paper-only" if args.paper_only else "") + "\n")
    print(HEADER)
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|")
    flagged = 0
    for case in CASES:
        path = folder / f"{case.name}-static.jsonl"
        if not path.is_file():
            print(f"| {case.name} | | no trace at {path} | | | | | | | | | |")
            continue
        trace = load_trace(path)
        lines = [] if args.paper_only else rows(case.name, trace, 2, 1, None, case.when)
        scaled = scale_trace(trace, case.blocks, noise=0.05)
        lines += rows(case.name, scaled, case.stages, case.dp, 4 * case.stages, case.when)
        flagged += sum("BELOW" in ln or "REPACK >" in ln for ln in lines)
        print("\n".join(lines), flush=True)
    print(f"\n{flagged} flagged")
    if args.link_delays:
        links = [int(x) for x in args.links.split(",")] if args.links else None
        link_delays(folder, args.link_delays, args.link_base_s, links)
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
