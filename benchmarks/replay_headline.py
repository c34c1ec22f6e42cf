"""dynmo against the best static layout, replayed noise-free at the paper's shapes.

Produces the tables in docs/bench/controller-vs-best-static.md (linked from docs/controller.md).

    python benchmarks/replay_headline.py [--traces docs/bench/traces] [--cases moe,dense-60]

Every committed trace (a real 2-rank run's per-layer costs, `dynmo bench`'s static runs and the
dense models') is scaled to a paper-sized model with no added noise and replayed on 24 stages x
30 replicas (48 blocks, 96 microbatches), and the MoE-family traces (moe, mixtral, and their
dense model) also on 16 x 8 (32 blocks, 64 microbatches), under: the static layouts (uniform,
params, profile-once), dynmo (`optimal`, `balance.when = auto`) started from uniform and from
profile-once, and the oracle. Per row: the best static layout and the ratio of its total time to
each policy's (> 1: faster than the best static layout), the share of the oracle's gain over the
best static layout that dynmo captures, dynmo's migrations, and the settled ratio: the best static
layout's step time over the trace's second half against dynmo's (from uniform, from
profile-once), which leaves out what finding the layout cost at the start. Pure; no torch.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import ReplayOptions, replay, replay_balance

MOE_FAMILY = ("moe", "mixtral", "dense-moe")
SHAPES = {"24x30": (24, 30, 48, 96), "16x8": (16, 8, 32, 64)}  # stages, dp, blocks, microbatches


def row(name: str, path: Path, shape: str) -> dict:
    stages, dp, blocks, m = SHAPES[shape]
    trace = scale_trace(load_trace(path), blocks)
    opts = ReplayOptions(microbatches=m, balance=replay_balance(when="auto"))
    res = {r.policy: r for r in replay(trace, stages, dp, ["uniform", "params", "profile-once", "optimal", "oracle"], opts)}
    (warm,) = replay(trace, stages, dp, ["optimal"], replace(opts, initial="profile-once"))
    best = res["optimal"].best_static
    ref = {"uniform": res["uniform"], "params": res.get("params"), "profile-once": res["profile-once"]}[best].total_s

    def ratio(r) -> float:
        return ref / r.total_s

    oracle_gain = ratio(res["oracle"]) - 1
    half = len(res["uniform"].iteration_s) // 2
    best_rest = sum({"uniform": res["uniform"], "params": res.get("params"),
                     "profile-once": res["profile-once"]}[best].iteration_s[half:])

    def settled(r) -> float:
        return best_rest / sum(r.iteration_s[half:])

    return {"trace": name, "shape": shape, "best_static": best, "uniform": ratio(res["uniform"]),
            "dynmo": ratio(res["optimal"]), "dynmo_warm": ratio(warm), "oracle": ratio(res["oracle"]),
            "captured": (ratio(res["optimal"]) - 1) / oracle_gain if oracle_gain > 0 else None,
            "captured_warm": (ratio(warm) - 1) / oracle_gain if oracle_gain > 0 else None,
            "migrations": res["optimal"].migrations, "migrations_warm": warm.migrations,
            "settled": settled(res["optimal"]), "settled_warm": settled(warm)}


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def traces(argv: list[str] | None, doc: str, program: str) -> list[Path] | None:
    """The committed traces a replay benchmark's --traces and --cases select (None: none), the
    command line printed first."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--traces", default="docs/bench/traces")
    ap.add_argument("--cases", default="", help="comma-separated trace names (file names without .jsonl); default all")
    args = ap.parse_args(argv)
    paths = sorted(Path(args.traces).glob("*.jsonl"))
    wanted = {c.strip() for c in args.cases.split(",") if c.strip()}
    if wanted:
        paths = [p for p in paths if p.stem.removesuffix("-static") in wanted or p.stem in wanted]
    if not paths:
        print(f"{program}: no traces in {args.traces}", file=sys.stderr)
        return None
    print(f"python benchmarks/{program}.py --traces {args.traces}" + (f" --cases {args.cases}" if wanted else "") + "\n")
    return paths


def main(argv: list[str] | None = None) -> int:
    paths = traces(argv, __doc__, "replay_headline")
    if paths is None:
        return 2
    print("| trace | shape | best static | uniform | dynmo from uniform | dynmo from profile-once | oracle "
          "| oracle gain captured (uniform, profile-once) | migrations (uniform, profile-once) "
          "| settled, second half (uniform, profile-once) |")
    print("|---|---|---|---:|---:|---:|---:|---|---|---|")
    for path in paths:
        name = path.stem.removesuffix("-static")
        shapes = ["24x30"] + (["16x8"] if name.startswith(MOE_FAMILY) else [])
        for shape in shapes:
            t0 = time.perf_counter()
            r = row(name, path, shape)
            print(f"| {name} | {shape} | {r['best_static']} | {fmt(r['uniform'])} | {fmt(r['dynmo'])} | "
                  f"{fmt(r['dynmo_warm'])} | {fmt(r['oracle'])} | {fmt(r['captured'])}, {fmt(r['captured_warm'])} | "
                  f"{r['migrations']}, {r['migrations_warm']} | {fmt(r['settled'])}, {fmt(r['settled_warm'])} |",
                  flush=True)
            print(f"replay_headline: {name} {shape} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
