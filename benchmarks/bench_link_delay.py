"""Injected link delay on 2 ranks: the link-aware balancer vs a compute-only one (the paper's
network experiment, its Figure 7, real on this machine).

Produces the table in docs/bench/controller-link-delay.md (linked from docs/controller.md, "Injected
link delay").

    python benchmarks/bench_link_delay.py [--config configs/default.toml] [--steps 20]
        [--multipliers 0,1,2,4] [--directions both,forward] [--base-ms MS] [--settle 10]
        [--keep DIR] [-- extra dynmo train options]

Every run is a real `python -m dynmo.cli train --nproc 2` on the config (1F1B, uniform
layout). Per delay k x base and per direction of the delay (`noise.link_delay_direction`:
`both` = every activation and every gradient send on the link waits, `forward` = only the
activation sends), three variants, run one after the other so machine load hits them alike:

  static    balance.when = never: the uniform layout throughout
  compute   balance.when = auto, balance.links = free: the balancer sees compute only
  link      balance.when = auto, balance.links = measure: the start-up probe measures the
            link (its sends wait the same delay) and the load model charges each
            direction to its sender (activations: stage 0, gradients: stage 1)

The base delay is one microbatch's stage compute on this machine, measured by the first run
(the undelayed static one): the median over its steps >= 1 of the slower stage's compute
(`stage_compute_s`) divided by the microbatches, rounded to 10 ms; `--base-ms` fixes it
instead. A delay of 0 runs each variant once (no direction).

It prints a markdown table: tokens/s over the steps from `--settle` on (after the
controller's window, confirmation and, for a migration that lost, its measured revert) and
over all steps but the first, the speedup of each over the static run of the same delay, the
probed link time, the migrations (each with its reason), the median step time on each layout
the run trained on (within one run, so less exposed to the machine's run-to-run noise), the
final layout, each stage's compute per microbatch and one block's cost per microbatch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "static": ["--balance.when", "never"],
    "compute": ["--balance.when", "auto", "--balance.links", "free"],
    "link": ["--balance.when", "auto", "--balance.links", "measure"],
}


def train(out: Path, config: str, steps: int, extra: list[str]) -> tuple[list[dict], str]:
    """One `dynmo train --nproc 2` run: its metrics records and its stdout."""
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", "2", "--config", config, "--out", str(out),
           "--steps", str(steps), "--log.tensorboard", "false", "--log.progress", "false",
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return recs, p.stdout


def tokens_per_s(recs: list[dict]) -> float:
    return sum(r["tokens_per_s"] * r["step_s"] for r in recs) / sum(r["step_s"] for r in recs)


def summarize(recs: list[dict], stdout: str, settle: int) -> dict:
    m = re.search(r"link ms/microbatch forward/backward \[([^\]]*)\]", stdout)
    migrations = [(r["step"], e) for r in recs for e in r["events"] if e["type"] == "migration"]
    steady = [r for r in recs if r["step"] >= settle] or recs[1:]
    # within the run (the same processes, minutes apart: less of the machine's run-to-run noise),
    # the median step time on each layout the run trained on, leaving out step 0 and the first
    # step after each migration (rebuilt stages warm up)
    cuts = [0] + [step for step, _ in migrations] + [len(recs)]
    phases = [statistics.median(r["step_s"] for r in recs[a + 1:b]) for a, b in zip(cuts, cuts[1:]) if b - a > 1]
    return {
        "steady": tokens_per_s(steady),
        "all": tokens_per_s(recs[1:] or recs),
        "link_ms": m.group(1) if m and m.group(1) else "",
        "migrations": [f"{step}:{e.get('decision') or 'forced'}" for step, e in migrations],
        "n_migrations": len(migrations),
        # one transformer block's cost per microbatch (the median block, median over the steady
        # steps): what a layer costs on this machine in the run's final layout
        "block_ms": statistics.median(statistics.median(col) for col in
                                      list(zip(*(r["layer_cost_s"] for r in steady)))[1:-1]) * 1e3,
        "phases": phases,
        "layout": recs[-1]["layout_str"],
        "boundaries": recs[-1]["layout"],
        "stage_ms": [statistics.median(r["stage_compute_s"][s] for r in recs[1:] or recs) / recs[-1]["microbatches"] * 1e3
                     for s in range(len(recs[-1]["stage_compute_s"]))],
    }


def base_ms(recs: list[dict]) -> float:
    """The slower stage's compute per microbatch, median over the steps after the first, in ms
    rounded to 10."""
    per_mb = [max(r["stage_compute_s"]) / r["microbatches"] for r in recs[1:] or recs]
    return max(10.0, round(statistics.median(per_mb) * 1e3 / 10) * 10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/default.toml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--multipliers", default="0,1,2,4", help="delays in units of the base, comma-separated")
    ap.add_argument("--directions", default="both,forward", help="noise.link_delay_direction values to run")
    ap.add_argument("--base-ms", type=float, default=0.0, help="the base delay in ms (0 = measure it)")
    ap.add_argument("--settle", type=int, default=10, help="first step of the steady state")
    ap.add_argument("--json", action="store_true", help="print the raw summaries as JSON too")
    ap.add_argument("--keep", default="", help="keep the runs' folders under this folder (default: a temporary one)")
    ap.add_argument("extra", nargs="*", help="more dynmo train options (after --)")
    args = ap.parse_args()
    mults = [float(x) for x in args.multipliers.split(",") if x.strip()]
    directions = [d.strip() for d in args.directions.split(",") if d.strip()]
    t0, started = time.perf_counter(), datetime.datetime.now()
    base = args.base_ms
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.keep or scratch
        n = 0

        def run(k: float, direction: str, variant: str) -> dict:
            nonlocal n
            n += 1
            extra = list(args.extra) + VARIANTS[variant]
            if k > 0:
                extra += ["--noise.enabled", "true", "--noise.link_delay_ms", f"{k * base:g}",
                          "--noise.link_delay_direction", direction]
            recs, out = train(Path(tmp) / f"run{n}", args.config, args.steps, extra)
            row = {"k": k, "delay_ms": k * base, "direction": direction if k > 0 else "-", "variant": variant,
                   **summarize(recs, out, args.settle)}
            print(f"# {row['k']:g}x {row['direction']} {variant}: {row['steady']:,.0f} tok/s steady, "
                  f"layout {row['layout']}, migrations {row['migrations']}, link ms [{row['link_ms']}]",
                  file=sys.stderr, flush=True)
            return {**row, "recs": recs}

        if 0 in mults or base <= 0:
            for variant in VARIANTS:
                row = run(0.0, "-", variant)
                if base <= 0 and variant == "static":
                    base = base_ms(row["recs"])
                    print(f"# base delay {base:g} ms (one microbatch's compute on the slower stage)",
                          file=sys.stderr, flush=True)
                if 0 in mults:
                    rows.append(row)
        for k in (x for x in mults if x > 0):
            for direction in directions:
                for variant in VARIANTS:
                    rows.append(run(k, direction, variant))
    duration = time.perf_counter() - t0
    static = {(r["k"], r["direction"]): r["steady"] for r in rows if r["variant"] == "static"}
    static_all = {(r["k"], r["direction"]): r["all"] for r in rows if r["variant"] == "static"}
    print(f"`python benchmarks/bench_link_delay.py {' '.join(sys.argv[1:])}`: {args.config}, {args.steps} steps, "
          f"2 ranks, base delay {base:g} ms; started {started:%Y-%m-%d %H:%M}, took {duration / 60:.1f} min; "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    print()
    print(f"| delay | ms per send | direction | balancer | probed link ms | tok/s (steps >= {args.settle}) | speedup | "
          "tok/s (steps >= 1) | speedup | migrations (step:decision) | step s per layout (within the run) | "
          f"final layout | stage compute ms/mb | block ms/mb (steps >= {args.settle}) |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---|---|---|---|---:|")
    for r in rows:
        key = (r["k"], r["direction"])
        print(f"| {r['k']:g}x | {r['delay_ms']:g} | {r['direction']} | {r['variant']} | {r['link_ms'] or '-'} | "
              f"{r['steady']:,.0f} | {r['steady'] / static[key]:.3f} | {r['all']:,.0f} | {r['all'] / static_all[key]:.3f} | "
              f"{', '.join(r['migrations']) or '0'} | {' -> '.join(f'{x:.2f}' for x in r['phases'])} | "
              f"{r['boundaries']} | "
              f"{' / '.join(f'{x:.0f}' for x in r['stage_ms'])} | {r['block_ms']:.0f} |")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "recs"} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
