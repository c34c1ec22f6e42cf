"""`dynmo bench`: the headline benchmark.

    dynmo bench --out bench/ [--cases skewed,moe,...] [--steps N] [--pairs P] [--no-real] [--no-sim]
                [--dense-only]

1. Real runs on this machine, 2 pipeline ranks, for each dynamic-model case, long enough for
   the case's dynamism to develop (`BenchCase.steps`: pruning through its whole schedule,
   freezing until most blocks are frozen, early exit after its classifiers trained):
     - `uniform`, `params`: static layouts (Megatron's equal layers, DeepSpeed's parameter
       partition), `balance.when = never`;
     - `profile-once`: the optimal layout for the costs the uniform run measured over its first
       steps after warm-up (`PROFILE_STEPS`, step 0 left out), never changed: the best a
       careful user could do statically;
     - `dynmo`: from uniform, the controller on (`auto`, or `dynamism` for cases that change on
       their own schedule);
     - `repack` (shrinking cases): dynmo with `balance.repack = true`, reported per worker;
     - the dense model (the config without the technique: the same config with dense blocks, or
       the default config for the cases that switch a technique on in it) at the same step
       count, once per dense model (`--dense-only` trains only these).
   Each variant runs once: these runs give the per-variant tokens/s (all steps but the first,
   migrations included) and pick the best of the three static layouts. The headline comes
   from `--pairs P` (default 6) further pairs of that best static layout and dynmo, run in
   alternating order so slow drift of the machine hits both alike: the median of the pairs'
   tokens/s ratios with a distribution-free 95% interval, and a verdict -- faster, slower, or
   no measurable difference when the interval holds 1.0. Also: dynmo over uniform; the
   technique alone (uniform) and with dynmo over the dense model, beside the DynMo paper's
   figure for the case; the oracle bound (from the uniform run's measured costs); final
   validation losses; for re-packing, workers, worker-seconds and tokens/s per worker.
2. Simulated runs at the paper's scale from the uniform runs' traces: the trace scaled to a
   paper-sized model (`dynmo.sim.scale_trace`) and replayed (`dynmo.sim.replay.replay`) on 16
   stages x 8 data-parallel replicas for MoE and MoD, 24 stages x 30 for the others, under the
   static policies (profile-once among them) and the dynamic ones, with and without re-packing;
   and the dense model's trace (`traces/dense-<steps>.jsonl`), scaled and replayed alike, for
   the technique alone and with dynmo against the dense model at that scale.
3. Whole blocks against half blocks: every sublayer trace in OUT/traces/sublayer/ (a run recorded
   with `--parallel.unit sublayer`, each block's attention and MLP halves as two placement units;
   the repository's are docs/bench/traces/sublayer/) scaled noise-free to 48 blocks and replayed
   at 24 stages x 30 with 96 microbatches, as half blocks and merged into whole blocks
   (`dynmo.sim.replay.replay_units`): per trace and unit kind the best static layout's time, the
   balance gap, dynmo and the oracle. Replayed by every invocation that simulates, whatever
   `--cases`; a folder without traces leaves a one-line note.

Writes `OUT/bench.md` (all tables and the commands), `OUT/bench.json`, the traces, and PNG
plots per case (`OUT/plots/<case>/`: the replay's, and the real runs' stage loads, layouts and
per-worker throughput over the steps). Results are written after every case, so an
interrupted run keeps what it measured. Rows an invocation does not measure again (the cases
not in `--cases`; every real row with `--no-real`; the simulated rows, those of whole against half
blocks included, with `--no-sim`) are kept from OUT/bench.json, and the output
names the invocation that measured them: one case can be measured again alone. What a case lacks (a config that does not exist, a run
that failed) is said in the output, not hidden.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from dynmo.bench.cases import CASES, PAIRS, ROOT
from dynmo.bench.render import render
from dynmo.bench.run import dense_name, dense_run, real_row
from dynmo.bench.sim import expert_rows, sim_rows, units_rows
from dynmo.sim.replay import PROFILE_STEPS


def _latest_dense(rows: list[dict], measured: dict) -> list[dict]:
    """Rows measured at different times may carry different measurements of the same dense run:
    every row gets the latest (this invocation's, else the latest kept one), and its ratios."""
    known = {c.name: c for c in CASES}
    latest: dict[str, tuple[str, dict]] = {}
    for r in rows:
        if r.get("dense"):
            name = r["dense"].get("name") or f"dense-{r['steps']}"
            when = (r.get("run") or {}).get("started") or ""
            if name not in latest or when > latest[name][0]:
                latest[name] = (when, r["dense"])
    out = []
    for r in rows:
        case = known.get(r["case"])
        if case is not None and case.dense is not None and "tokens_per_s" in r:
            name = dense_name(case, r["steps"])
            dn = measured.get(name) or latest.get(name, (None, None))[1]
            if dn is None:  # measured before dense runs were named per case: not this case's dense model
                r = {k: v for k, v in r.items() if k not in ("dense", "technique_alone", "technique_dynmo")}
            elif dn is not r.get("dense"):
                r = r | {"dense": dn, "technique_alone": r["tokens_per_s"]["uniform"] / dn["tokens_per_s"],
                         "technique_dynmo": r["tokens_per_s"]["dynmo"] / dn["tokens_per_s"]}
        out.append(r)
    return out


EXAMPLES = """\
examples:
  dynmo bench --out bench/
  dynmo bench --out bench/ --cases skewed --steps 20 --pairs 2 --no-sim
  dynmo bench --out docs/bench --cases moe,mixtral --no-real
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="dynmo bench", description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench", help="output folder (default bench/)")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated cases")
    ap.add_argument("--steps", type=int, default=None, help="steps per real run (default: each case's, BenchCase.steps)")
    ap.add_argument("--pairs", type=int, default=PAIRS,
                    help=f"alternating pairs of the best static layout and dynmo per case (default {PAIRS}; 0: none)")
    ap.add_argument("--no-real", action="store_true", help="skip the real runs, simulate from traces already in OUT/traces")
    ap.add_argument("--no-sim", action="store_true", help="skip the paper-scale simulation")
    ap.add_argument("--dense-only", action="store_true",
                    help="of the real runs, train only the cases' dense models (the other rows are kept)")
    ap.add_argument("--unit", choices=("block", "sublayer"), default="block",
                    help="what every real run places (parallel.unit; default block); an OUT holds one kind")
    args = ap.parse_args(argv)
    if args.pairs < 0 or (args.steps is not None and args.steps < PROFILE_STEPS + 2):
        ap.error(f"--pairs must be >= 0 and --steps >= {PROFILE_STEPS + 2}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    known = {c.name: c for c in CASES}
    bad = [w for w in wanted if w not in known]
    if bad:
        print(f"dynmo bench: unknown case(s) {bad}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    real, sim, experts, missing, dense = [], [], [], [], {}
    run = {"command": argv, "started": started}  # stamped on every row this invocation measures
    # rows this invocation does not measure again (other cases, or all real rows with --no-real)
    # are kept from OUT/bench.json, each with the invocation that measured it
    kept_real, kept_sim, kept_experts = [], [], []
    units = None  # whole against half blocks: kept until this invocation replays them; None: never replayed
    if (out / "bench.json").is_file():
        try:
            old = json.loads((out / "bench.json").read_text())
            if old.get("unit", "block") != args.unit:
                print(f"dynmo bench: {out} holds runs with parallel.unit = {old.get('unit', 'block')!r}; give "
                      f"--unit {old.get('unit', 'block')} or another --out for {args.unit!r} units", file=sys.stderr)
                return 2
            old_run = {"command": old.get("command"), "started": old.get("started")}
            kept_real = [r | {"run": r.get("run") or old_run} for r in old.get("real", [])
                         if args.no_real or args.dense_only or r["case"] not in wanted]
            kept_sim = [r | {"run": r.get("run") or old_run} for r in old.get("sim", [])
                        if args.no_sim or r["case"] not in wanted]
            kept_experts = [r | {"run": r.get("run") or old_run} for r in old.get("experts") or []
                            if args.no_sim or r["case"] not in wanted]
            if old.get("units") is not None:
                units = [r | {"run": r.get("run") or old_run} for r in old["units"]]
        except (OSError, ValueError, AttributeError, TypeError, KeyError) as e:
            print(f"dynmo bench: {out / 'bench.json'} is not readable ({e}); move it away to start afresh",
                  file=sys.stderr)
            return 2
    order = {c.name: i for i, c in enumerate(CASES)}

    def write() -> str:
        all_real = _latest_dense(sorted(kept_real + real, key=lambda r: order.get(r["case"], len(order))), dense)
        all_sim = sorted(kept_sim + sim, key=lambda r: order.get(r["case"], len(order)))
        all_experts = sorted(kept_experts + experts, key=lambda r: order.get(r["case"], len(order)))
        (out / "bench.json").write_text(json.dumps({"command": argv, "started": started, "unit": args.unit,
                                                    "duration_s": round(time.perf_counter() - t0),
                                                    "real": all_real, "sim": all_sim, "units": units,
                                                    "experts": all_experts,
                                                    "missing": missing}, indent=1) + "\n")
        text = render(all_real, all_sim, missing, argv, started, time.perf_counter() - t0, units=units,
                      experts=all_experts)
        (out / "bench.md").write_text(text)
        return text

    for name in wanted:
        case = known[name]
        if args.unit != "block":  # every run of the case, its dense model's too, places these units
            unit = ("--parallel.unit", args.unit)
            case = dataclasses.replace(case, extra=case.extra + unit, dense_extra=case.dense_extra + unit)
        if not (ROOT / case.config).is_file():
            missing.append(f"{name}: {case.config} does not exist")
            continue
        if args.dense_only and case.dense is not None:
            print(f"dynmo bench: {name} (its dense model, 2 ranks)", file=sys.stderr, flush=True)
            try:
                dense_run(case, out, args.steps or case.steps, dense)
            except RuntimeError as e:
                missing.append(f"{name}: dense run failed: {str(e).splitlines()[0]}")
        elif not args.no_real and not args.dense_only:
            print(f"dynmo bench: {name} (real, 2 ranks)", file=sys.stderr, flush=True)
            try:
                real.append(real_row(case, out, args.steps, args.pairs, dense) | {"run": run})
            except RuntimeError as e:
                missing.append(f"{name}: real run failed: {str(e).splitlines()[0]}")
                write()
                continue
        if not args.no_sim:
            if not (out / "traces" / f"{name}-static.jsonl").is_file():
                missing.append(f"{name}: no static trace to simulate from (run without --no-real first)")
                continue
            sim += [r | {"run": run} for r in sim_rows(case, out)]
            found, why = expert_rows(case, out)
            experts += [r | {"run": run} for r in found]
            missing += why
        write()
    if not args.no_sim:
        print("dynmo bench: whole blocks against half blocks (replay)", file=sys.stderr, flush=True)
        found, lost = units_rows(out / "traces" / "sublayer")
        units = [r | {"run": run} for r in found]
        missing += lost
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
