"""Unseen dynamics: dynmo from every start over a seeded family of cost changes no shipped case produces.

Produces the tables in docs/bench/controller-scenarios.md (linked from docs/controller.md).

    python benchmarks/replay_scenarios.py [--count 200] [--first 0] [--cases dense-60,dense-80,dense-120,dense-150]
        [--shapes 24x30,16x8] [--compare] [--confidence 0.95] [--jobs 2] [--json out.json] [--jsonl resumable.jsonl]
    python benchmarks/replay_scenarios.py --committed [--compare]     # the committed traces as they are

The committed traces hold the dynamics the shipped cases produce; dynmo's promise (never slower
than the layout it started on) has to hold for dynamics nobody traced too. Scenario i (seed
first + i, `dynmo.sim.scenarios.generate`: one to three step changes of 30-80 % on random block
groups, a change that reverses, a ramp, or a hot region that moves) changes the block costs of
a committed dense trace (the i-th of `--cases`, in turn), whose real step-to-step noise stays
underneath, scaled to the paper's shapes (the shape in turn after every case had it: 24 stages x
30 replicas, 48 blocks, 96 microbatches; 16 x 8, 32 blocks, 64 microbatches). It is replayed
from every start S (uniform, params, profile-once, flops) under `optimal` with
`balance.when = auto`, decide time left out so that the table repeats. Per start: the
distribution over the scenarios (min, 5th percentile, median) of static S's total time over
dynmo's (`whole`), and of the best static layout's time over the second half (the fastest of
uniform, params and profile-once there, as `replay` defines it) over dynmo's (`second half`),
and how many scenarios fall below the promise's floors (0.98 of the start; 0.975 of the best
static layout over the second half).
`--compare` also replays the controller without its pre-registered fallbacks
(`ReplayOptions.fallback = False`: the controller before they came in), scenario for scenario.
`--committed` replays the committed traces unchanged the same way, one row per trace and
shape (benchmarks/replay_starts.py's promise, with the second half against the best static
layout from every start). Pure; no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from dynmo.sim import load_trace, scale_trace
from dynmo.sim.replay import STATIC, PolicyResult, ReplayOptions, replay_balance
from dynmo.sim.replay.policies import run_dynamic, run_static, static_layout
from dynmo.sim.replay.runner import Runner
from dynmo.sim.scenarios import apply, generate
from replay_headline import MOE_FAMILY, SHAPES  # run as a script: benchmarks/ is on the path

STARTS = ("uniform", "params", "profile-once", "flops")
CASES = ("dense-60", "dense-80", "dense-120", "dense-150")
FLOOR, FLOOR_SHARE, WORST = 0.995, 0.95, 0.98  # dynmo >= FLOOR x its start in FLOOR_SHARE of the scenarios, >= WORST in all
HALF = 0.975  # the second half against the best static layout, in all


class MemoRunner(Runner):
    """The replay's step simulation, once per (step, layout, microbatches): the static layouts and
    the dynamic runs sitting on them replay the same steps."""

    def __init__(self, *args):
        super().__init__(*args)
        self.memo: dict = {}

    def simulate(self, k, layout, m=None):
        key = (k, layout.boundaries, m or self.m)
        if key not in self.memo:
            self.memo[key] = super().simulate(k, layout, m)
        return self.memo[key]


def one(job: tuple) -> dict:
    """Scenario `seed` on trace `path` at `shape`: per variant and start, whole and second-half ratios."""
    seed, path, shape, variants, knobs = job
    stages, dp, blocks, m = SHAPES[shape]
    trace = scale_trace(load_trace(path), blocks)
    sc = None if seed is None else generate(seed, len(trace.steps), blocks)  # None: the trace as committed
    if sc is not None:
        trace = apply(trace, sc)
    opts = ReplayOptions(microbatches=m, balance=replay_balance(when="auto", **knobs), charge_decide=False)
    runner = MemoRunner(trace, dp, opts, stages)
    static, layouts = {}, {}
    for name in STARTS:
        layouts[name] = static_layout(name, trace, stages, runner)
        static[name] = PolicyResult(name)
        run_static(trace, runner, layouts[name], static[name])
    best_half = min(static[n].second_half_s for n in STATIC)
    out = {"seed": seed, "trace": Path(path).stem, "shape": shape, "scenario": sc.describe() if sc else "as committed",
           "knobs": knobs, "runs": {}}
    for variant in variants:
        done: dict[tuple, PolicyResult] = {}  # starts on the same layout decide the same (no decide time)
        for start in STARTS:
            res = done.get(layouts[start].boundaries)
            if res is None:
                res = done[layouts[start].boundaries] = PolicyResult("optimal")
                run_dynamic(trace, runner, stages, "optimal", False,
                            replace(opts, initial=start, fallback=variant == "after"), res)
            out["runs"][f"{variant} {start}"] = {
                "whole": static[start].total_s / res.total_s, "second_half": best_half / res.second_half_s,
                "migrations": res.migrations}
    return out


def pct(x: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(x), q, method="lower"))


def table(results: list[dict], variant: str) -> list[str]:
    lines = [f"| start | whole vs the start left static: min, 5th pct, median | share >= {FLOOR} | below {WORST} | "
             f"second half vs the best static: min, 5th pct, median | below {HALF} | migrations: median, max |",
             "|---|---|---:|---:|---|---:|---|"]
    for start in STARTS:
        runs = [r["runs"][f"{variant} {start}"] for r in results]
        w = [x["whole"] for x in runs]
        h = [x["second_half"] for x in runs]
        mig = [x["migrations"] for x in runs]
        share = sum(v >= FLOOR for v in w) / len(w)
        lines.append(f"| {start} | {min(w):.3f}, {pct(w, 5):.3f}, {float(np.median(w)):.3f} | {share:.1%} | "
                     f"{sum(v < WORST for v in w)} | {min(h):.3f}, {pct(h, 5):.3f}, {float(np.median(h)):.3f} | "
                     f"{sum(v < HALF for v in h)} | {int(np.median(mig))}, {max(mig)} |")
    return lines


def verdict(results: list[dict], variant: str) -> list[str]:
    out = []
    for start in STARTS:
        runs = [(r, r["runs"][f"{variant} {start}"]) for r in results]
        share = sum(x["whole"] >= FLOOR for _, x in runs) / len(runs)
        worst = min(runs, key=lambda t: t[1]["whole"])
        worst_half = min(runs, key=lambda t: t[1]["second_half"])
        ok = share >= FLOOR_SHARE and worst[1]["whole"] >= WORST and worst_half[1]["second_half"] >= HALF
        out.append(f"{variant}, from {start}: {'met' if ok else 'NOT met'}; worst whole {worst[1]['whole']:.3f} "
                   f"(seed {worst[0]['seed']}, {worst[0]['trace']} {worst[0]['shape']}: {worst[0]['scenario']}); "
                   f"worst second half {worst_half[1]['second_half']:.3f} (seed {worst_half[0]['seed']}, "
                   f"{worst_half[0]['trace']} {worst_half[0]['shape']}: {worst_half[0]['scenario']})")
    return out


def committed(folder: Path, variants: tuple[str, ...], workers: int, knobs: dict) -> int:
    """Every committed trace as it is, from every start: whole, second half against the best static
    layout, migrations, per variant (the check that the fallbacks change nothing they should not)."""
    jobs = [(None, str(p), shape, variants, knobs) for p in sorted(folder.glob("*.jsonl"))
            for shape in ["24x30"] + (["16x8"] if p.stem.startswith(MOE_FAMILY) else [])]
    if not jobs:
        print(f"replay_scenarios: no traces in {folder}", file=sys.stderr)
        return 2
    print("python benchmarks/replay_scenarios.py --committed" + (" --compare" if len(variants) > 1 else "")
          + knob_flags(knobs) + "\n")
    print("| trace | shape | " + " | ".join(f"from {s}: whole, second half vs best static, migrations" for s in STARTS)
          + " |")
    print("|---|---|" + "---|" * len(STARTS))
    worst = {v: (9.0, "") for v in variants}
    with ProcessPoolExecutor(max(1, workers)) as pool:
        for r in pool.map(one, jobs):
            cells = []
            for start in STARTS:
                got = [r["runs"][f"{v} {start}"] for v in variants]
                text = [f"{x['whole']:.3f}, {x['second_half']:.3f}, {x['migrations']}" for x in got]
                cells.append(" → ".join(dict.fromkeys(text)))  # one entry where the variants agree
                for v, x in zip(variants, got):
                    if x["whole"] < worst[v][0]:
                        worst[v] = (x["whole"], f"{r['trace']} {r['shape']} from {start}")
            print(f"| {r['trace'].removesuffix('-static')} | {r['shape']} | " + " | ".join(cells) + " |", flush=True)
    for v in variants:
        print(f"\n{v}: worst whole {worst[v][0]:.3f} ({worst[v][1]})")
    return 0


def knob_flags(knobs: dict) -> str:
    """The command line's part that set `knobs` (empty for the defaults)."""
    return "".join(f" --{k} {v}" for k, v in knobs.items())


def kept_results(path: Path, variants: tuple[str, ...], knobs: dict) -> dict[tuple, dict]:
    """The scenarios `--jsonl` already holds, by (seed, trace, shape), those with every variant
    asked, replayed with the same knobs."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("knobs", {}) == knobs and all(f"{v} {s}" in r["runs"] for v in variants for s in STARTS):
                out[(r["seed"], r["trace"], r["shape"])] = r
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--first", type=int, default=0, help="seed of the first scenario")
    ap.add_argument("--traces", default="docs/bench/traces")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--shapes", default="24x30,16x8")
    ap.add_argument("--compare", action="store_true", help="also replay the controller without its fallbacks")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", default="", help="write every scenario's ratios here")
    ap.add_argument("--jsonl", default="",
                    help="append each scenario's ratios here as it finishes, and take those already there "
                         "(same seed, trace, shape and variants) instead of replaying them: a long run resumes")
    ap.add_argument("--confidence", type=float, default=None,
                    help="the controller's balance.confidence (default: the config's): what the knob does "
                         "on dynamics nobody traced, against what it does under noise "
                         "(benchmarks/bench_controller_noise.py)")
    ap.add_argument("--committed", action="store_true",
                    help="replay every committed trace as it is instead (the MoE family also on 16x8), one row each")
    args = ap.parse_args(argv)
    variants = ("before", "after") if args.compare else ("after",)
    knobs = {} if args.confidence is None else {"confidence": args.confidence}
    if knobs and not 0.0 < args.confidence < 1.0:
        print(f"replay_scenarios: --confidence {args.confidence} must lie strictly between 0 and 1", file=sys.stderr)
        return 2
    if args.committed:
        return committed(Path(args.traces), variants, args.jobs, knobs)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    paths = [Path(args.traces) / f"{c}.jsonl" for c in cases]
    missing = [str(p) for p in paths if not p.exists()]
    bad = [s for s in shapes if s not in SHAPES]
    if missing or bad or not paths or not shapes or args.count < 1:
        print(f"replay_scenarios: no such traces {missing} or shapes {bad}, or nothing to replay", file=sys.stderr)
        return 2
    jobs = [(args.first + i, str(paths[i % len(paths)]), shapes[(i // len(paths)) % len(shapes)], variants, knobs)
            for i in range(args.count)]
    print(f"python benchmarks/replay_scenarios.py --count {args.count} --first {args.first} --cases {','.join(cases)} "
          f"--shapes {','.join(shapes)}" + (" --compare" if args.compare else "") + knob_flags(knobs) + "\n")
    t0 = time.perf_counter()
    kept = kept_results(Path(args.jsonl), variants, knobs) if args.jsonl else {}
    results = {job[0]: kept[key] for job in jobs if (key := (job[0], Path(job[1]).stem, job[2])) in kept}
    todo = [job for job in jobs if job[0] not in results]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for r in pool.map(one, todo):
            results[r["seed"]] = r
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(r) + "\n")
            worst = min(x["whole"] for x in r["runs"].values())
            print(f"replay_scenarios: {len(results)}/{len(jobs)} seed {r['seed']} {r['trace']} {r['shape']} worst "
                  f"whole {worst:.3f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    results = [results[job[0]] for job in jobs]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    for variant in variants:
        name = {"before": "without the fallbacks (the controller before them)", "after": "with the fallbacks"}[variant]
        print(f"dynmo {name}, {len(results)} scenarios:\n")
        print("\n".join(table(results, variant)) + "\n")
        print("\n".join(verdict(results, variant)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
