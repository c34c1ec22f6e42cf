"""`dynmo bench`: the headline benchmark.

    dynmo bench --out bench/ [--cases skewed,moe,...] [--steps N] [--repeats R] [--no-real] [--no-sim]

1. Real runs on this machine, 2 pipeline ranks, for each dynamic-model case: the case's config
   trained twice through the real launcher, static (uniform layout, `balance.when = never`)
   and with dynmo (`auto`, or `dynamism` for cases that change on their own schedule), each
   writing a per-layer cost trace. Reported: end-to-end tokens/s of both (all steps but the
   first, migrations included), the speedup, the oracle bound (sum over steps of the static
   layout's bottleneck / the best contiguous layout's, from the static run's measured
   per-layer costs), dynmo's overhead (profiler bookkeeping + deciding + migrating, % of its
   training time) and its bubble ratio against static's. With `--repeats R` (default 2) the
   two runs alternate R times (static, dynmo, static, dynmo, ...) so slow drift of the
   machine hits both alike; the table gives medians and the range of the R paired speedups,
   which is the run-to-run noise a reader needs to judge a speedup by.
2. Simulated runs at the paper's scale from the static runs' traces: the trace scaled to a
   paper-sized model (`dynmo.sim.scale_trace`) and replayed (`dynmo.sim.replay.replay`) on 16
   stages x 8 data-parallel replicas for MoE and MoD, 24 stages x 30 for the others, under the
   static policies and the dynamic ones, with and without re-packing.

Writes `OUT/bench.md` (both tables and the commands), `OUT/bench.json`, the traces, and PNG
plots per case (`OUT/plots/<case>/`). What a case lacks (a config that does not exist, a run
that failed) is said in the output, not hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dynmo.balance import Problem, balance
from dynmo.layout import Layout

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class BenchCase:
    name: str
    config: str
    when: str  # the controller trigger dynmo uses for this case
    stages: int  # paper-scale simulation
    dp: int
    blocks: int


CASES = [
    BenchCase("skewed", "configs/skewed.toml", "auto", 24, 30, 48),
    BenchCase("moe", "configs/moe.toml", "auto", 16, 8, 32),
    BenchCase("mod", "configs/mod.toml", "auto", 16, 8, 32),
    BenchCase("hashattn", "configs/hashattn.toml", "auto", 24, 30, 48),
    BenchCase("pruning", "configs/pruning.toml", "dynamism", 24, 30, 48),
    BenchCase("freezing", "configs/freezing.toml", "dynamism", 24, 30, 48),
    BenchCase("earlyexit", "configs/earlyexit.toml", "auto", 24, 30, 48),
    BenchCase("mixtral", "configs/mixtral.toml", "auto", 16, 8, 32),
]
SIM_POLICIES = ["uniform", "params", "optimal", "optimal+repack", "deepspeed", "diffusion-contiguous", "oracle"]


def train(out: Path, config: str, *extra: str, nproc: int = 2) -> list[dict]:
    """Run `dynmo train` in a subprocess; return its metrics records."""
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", str(nproc), "--config", config,
           "--out", str(out), "--log.tensorboard", "false", "--log.progress", "false", *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def overhead_s(recs: list[dict]) -> float:
    """Profiler bookkeeping + deciding + migrating, seconds."""
    mig = [e for r in recs for e in r["events"] if e["type"] == "migration"]
    return sum(r.get("profile_s", 0.0) for r in recs) + sum(e.get("decide_s", 0.0) + e["seconds"] for e in mig)


def throughput(recs: list[dict]) -> float:
    """Tokens/s over all steps but the first (one-off set-up), migrations included."""
    rest = recs[1:] or recs
    tokens = sum(r["tokens_per_s"] * r["step_s"] for r in rest)
    return tokens / sum(r["step_s"] for r in rest)


def oracle_bound(recs: list[dict]) -> float:
    """Sum over steps of the run's bottleneck / the best contiguous bottleneck (measured costs)."""
    static, best = 0.0, 0.0
    for r in recs[1:] or recs:
        costs = r["layer_cost_s"]
        lay = Layout(tuple(r["layout"]))
        static += max(lay.stage_loads(costs))
        best += balance(Problem(costs=costs, stages=lay.num_stages), "optimal").bottleneck
    return static / best if best > 0 else float("nan")


def real_row(case: BenchCase, out: Path, steps: int | None, repeats: int = 1) -> dict:
    extra = ["--steps", str(steps)] if steps else []
    runs: dict[str, list[list[dict]]] = {"static": [], "dynmo": []}
    for rep in range(repeats):
        for variant, when in (("static", "never"), ("dynmo", case.when)):
            name = f"{case.name}-{variant}" + (f"-{rep}" if rep else "")  # the first repeat's trace feeds the simulation
            t = time.perf_counter()
            recs = train(out / "runs" / name, case.config, "--balance.when", when, "--trace", str(out / "traces" / f"{name}.jsonl"), *extra)
            runs[variant].append(recs)
            print(f"  {case.name} {variant} ({rep + 1}/{repeats}): {len(recs)} steps in {time.perf_counter() - t:.0f} s, "
                  f"{throughput(recs):,.0f} tok/s", file=sys.stderr, flush=True)
    med = statistics.median
    static_tps = [throughput(s) for s in runs["static"]]
    dynmo_tps = [throughput(d) for d in runs["dynmo"]]
    paired = [d / s for s, d in zip(static_tps, dynmo_tps)]
    d = runs["dynmo"][0]
    return {
        "case": case.name,
        "when": case.when,
        "steps": len(d),
        "repeats": repeats,
        "static_tokens_per_s": med(static_tps),
        "dynmo_tokens_per_s": med(dynmo_tps),
        "speedup": med(dynmo_tps) / med(static_tps),
        "speedup_min": min(paired),
        "speedup_max": max(paired),
        "oracle_bound": med(oracle_bound(s) for s in runs["static"]),
        "static_bubble": med(statistics.fmean(r["bubble_ratio"] for r in s[1:]) for s in runs["static"]),
        "dynmo_bubble": med(statistics.fmean(r["bubble_ratio"] for r in x[1:]) for x in runs["dynmo"]),
        "migrations": med(sum(e["type"] == "migration" for r in x for e in r["events"]) for x in runs["dynmo"]),
        "overhead_pct": med(100 * overhead_s(x) / sum(r["step_s"] for r in x) for x in runs["dynmo"]),
        "final_layout": d[-1]["layout"],
    }


def sim_rows(case: BenchCase, out: Path) -> list[dict]:
    from dynmo.sim import load_trace, scale_trace
    from dynmo.sim.plots import write_plots
    from dynmo.sim.replay import ReplayOptions, replay, replay_balance

    trace = scale_trace(load_trace(out / "traces" / f"{case.name}-static.jsonl"), case.blocks, noise=0.05)
    # 4 microbatches per stage (as benchmarks/bench_sim.py), as large runs use to keep the
    # fill/drain bubble small; the real run's trigger (a trace's dynamism events drive `dynamism`)
    opts = ReplayOptions(microbatches=4 * case.stages, balance=replay_balance(when=case.when))
    results = replay(trace, stages=case.stages, dp=case.dp, policies=SIM_POLICIES, options=opts)
    write_plots(results, out / "plots" / case.name, title=f"{case.name}: {case.blocks} blocks, {case.stages} stages x {case.dp} dp")
    return [{"case": case.name, "shape": f"{case.blocks + 2} layers, {case.stages}x{case.dp}", **r.as_dict(per_step=False)}
            for r in results]


def fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def render(real: list[dict], sim: list[dict], missing: list[str], argv: list[str]) -> str:
    lines = ["# dynmo bench\n", f"Command: `dynmo bench {' '.join(argv)}`\n"]
    if real:
        lines += [
            "## Real runs, this machine (2 ranks, gloo, CPU)\n",
            f"Medians of {real[0].get('repeats', 1)} alternating static/dynmo pairs; the range is that of the paired speedups.\n",
            "| case | trigger | steps | static tok/s | dynmo tok/s | speedup | range | oracle bound | bubble static → dynmo | migrations | overhead % | final layout (boundaries) |",
            "|---|---|---:|---:|---:|---:|---|---:|---|---:|---:|---|",
        ]
        for r in real:
            lines.append(
                f"| {r['case']} | {r['when']} | {r['steps']} | {r['static_tokens_per_s']:,.0f} | {r['dynmo_tokens_per_s']:,.0f} | "
                f"{r['speedup']:.3f} | {r['speedup_min']:.3f}–{r['speedup_max']:.3f} | {r['oracle_bound']:.3f} | "
                f"{r['static_bubble']:.3f} → {r['dynmo_bubble']:.3f} | "
                f"{r['migrations']:g} | {r['overhead_pct']:.2f} | {r['final_layout']} |"
            )
        lines.append("")
    if sim:
        lines += [
            "## Simulated at paper scale (static traces above, scaled; `dynmo.sim.replay`)\n",
            "Microbatches per replica = 4 x stages; migrations charged at the controller's cost model.\n",
            "| case | shape | policy | speedup vs uniform | mean bubble | workers (final) | migrations |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for r in sim:
            lines.append(
                f"| {r['case']} | {r['shape']} | {r['policy']} | {fmt(r.get('speedup'), '.3f')} | "
                f"{fmt(r.get('mean_bubble'), '.3f')} | {r.get('workers_final', 'n/a')} | {r.get('migrations', 0)} |"
            )
        lines.append("")
    if missing:
        lines += ["## Missing\n"] + [f"- {m}" for m in missing] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="dynmo bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench", help="output folder (default bench/)")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated cases")
    ap.add_argument("--steps", type=int, default=None, help="steps per real run (default: each config's)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating static/dynmo pairs per case (default 2); medians reported")
    ap.add_argument("--no-real", action="store_true", help="skip the real runs, simulate from traces already in OUT/traces")
    ap.add_argument("--no-sim", action="store_true", help="skip the paper-scale simulation")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    known = {c.name: c for c in CASES}
    bad = [w for w in wanted if w not in known]
    if bad:
        print(f"dynmo bench: unknown case(s) {bad}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    real, sim, missing = [], [], []
    for name in wanted:
        case = known[name]
        if not (ROOT / case.config).is_file():
            missing.append(f"{name}: {case.config} does not exist")
            continue
        if not args.no_real:
            print(f"dynmo bench: {name} (real, 2 ranks)", file=sys.stderr, flush=True)
            try:
                real.append(real_row(case, out, args.steps, args.repeats))
            except RuntimeError as e:
                missing.append(f"{name}: real run failed: {str(e).splitlines()[0]}")
                continue
        if not args.no_sim:
            if not (out / "traces" / f"{name}-static.jsonl").is_file():
                missing.append(f"{name}: no static trace to simulate from (run without --no-real first)")
                continue
            sim += sim_rows(case, out)
    (out / "bench.json").write_text(json.dumps({"real": real, "sim": sim, "missing": missing}, indent=1) + "\n")
    text = render(real, sim, missing, argv)
    (out / "bench.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
