"""`dynmo bench`: the headline benchmark.

    dynmo bench --out bench/ [--cases skewed,moe,...] [--steps N] [--repeats R] [--no-real] [--no-sim]
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
   Reported: tokens/s of each (all steps but the first, migrations included); the headline,
   dynmo over the best of the three static layouts; dynmo over uniform; the technique alone
   (uniform) and with dynmo over the dense model, beside the DynMo paper's figure for the case;
   the oracle bound (from the uniform run's measured costs); final validation losses; for
   re-packing, workers, worker-seconds and tokens/s per worker. With `--repeats R` the variants
   alternate R times so slow drift of the machine hits all alike; medians, and the range of
   the paired dynmo / best-static ratios.
2. Simulated runs at the paper's scale from the uniform runs' traces: the trace scaled to a
   paper-sized model (`dynmo.sim.scale_trace`) and replayed (`dynmo.sim.replay.replay`) on 16
   stages x 8 data-parallel replicas for MoE and MoD, 24 stages x 30 for the others, under the
   static policies (profile-once among them) and the dynamic ones, with and without re-packing;
   and the dense model's trace (`traces/dense-<steps>.jsonl`), scaled and replayed alike, for
   the technique alone and with dynmo against the dense model at that scale.

Writes `OUT/bench.md` (all tables and the commands), `OUT/bench.json`, the traces, and PNG
plots per case (`OUT/plots/<case>/`: the replay's, and the real runs' stage loads, layouts and
per-worker throughput over the steps). Results are written after every case, so an
interrupted run keeps what it measured. Rows an invocation does not measure again (the cases
not in `--cases`; every real row with `--no-real`) are kept from OUT/bench.json, and the output
names the invocation that measured them: one case can be measured again alone. What a case lacks (a config that does not exist, a run
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
from dataclasses import dataclass, replace
from pathlib import Path

from dynmo.balance import Problem, balance
from dynmo.layout import Layout
from dynmo.sim.replay import PROFILE_STEPS  # profile-once: the median cost of steps 1..5 (step 0 warms up)

ROOT = Path(__file__).resolve().parents[1]
DENSE = "configs/default.toml"


@dataclass(frozen=True)
class BenchCase:
    name: str
    config: str
    when: str  # the controller trigger dynmo uses for this case
    stages: int  # paper-scale simulation
    dp: int
    blocks: int
    steps: int = 60  # real runs: long enough for the case's dynamism to develop
    extra: tuple[str, ...] = ()  # overrides of the case's config for the benchmark
    dense: str | None = DENSE  # the model without the technique; None: no dense counterpart
    dense_extra: tuple[str, ...] = ()  # overrides that turn the technique off in `dense`
    repack: bool = False  # a shrinking model: also run dynmo with re-packing


CASES = [
    BenchCase("skewed", "configs/skewed.toml", "auto", 24, 30, 48, steps=60),
    # the dense counterpart of a block kind is the same config with dense blocks (same sizes, batch, data)
    BenchCase("moe", "configs/moe.toml", "auto", 16, 8, 32, steps=80,
              dense="configs/moe.toml", dense_extra=("--model.block", "dense")),
    BenchCase("mod", "configs/mod.toml", "auto", 16, 8, 32, steps=80,
              dense="configs/mod.toml", dense_extra=("--model.block", "dense")),
    BenchCase("hashattn", "configs/hashattn.toml", "auto", 24, 30, 48, steps=80,
              dense="configs/hashattn.toml", dense_extra=("--model.block", "dense")),
    # the whole cubic schedule (steps 10..50, to 90 %), then 70 steps at the final sparsity
    BenchCase("pruning", "configs/pruning.toml", "dynamism", 24, 30, 48, steps=120, repack=True),
    # the same schedule removing whole MLP units: the blocks' matrices really shrink
    BenchCase("pruning-structured", "configs/pruning.toml", "dynamism", 24, 30, 48, steps=120,
              extra=("--prune.structured", "true"), repack=True),
    # until all blocks but the last may freeze
    BenchCase("freezing", "configs/freezing.toml", "dynamism", 24, 30, 48, steps=150,
              extra=("--freeze.max_frozen", "-1"), repack=True),
    # exits from step 10 on, with the classifiers training from step 0
    BenchCase("earlyexit", "configs/earlyexit.toml", "auto", 24, 30, 48, steps=120, repack=True),
    BenchCase("mixtral", "configs/mixtral.toml", "auto", 16, 8, 32, steps=60, dense=None),
]
SIM_POLICIES = ["uniform", "params", "profile-once", "optimal", "optimal+repack", "deepspeed", "diffusion-contiguous",
                "oracle"]
STATIC_VARIANTS = ("uniform", "params", "profile-once")

# The DynMo paper's end-to-end speedup for each case, and what it is measured against.
PAPER = {
    "moe": (1.23, "static Megatron-LM / DeepSpeed layouts"),
    "pruning": (3.18, "static layouts, pruning 52 % -> 79 % -> 90 % every 1,000 iterations"),
    "freezing": (2.23, "static layouts, freezing checked every 50 iterations"),
    "hashattn": (4.02, "the dense-attention model"),
    "earlyexit": (4.52, "the model without early exit"),
    "mod": (1.17, "static layouts"),
}


def train(out: Path, config: str, *extra: str, nproc: int = 2) -> list[dict]:
    """Run `dynmo train` in a subprocess; return its metrics records."""
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", str(nproc), "--config", config,
           "--out", str(out), "--overwrite", "--log.tensorboard", "false", "--log.progress", "false", *extra]
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


def worker_seconds(recs: list[dict]) -> float:
    """Sum over steps (all but the first) of the step's wall time x its active workers."""
    return sum(r["step_s"] * r.get("workers", 2) for r in recs[1:] or recs)


def per_worker(recs: list[dict]) -> float:
    """Tokens per worker-second: the same training on fewer workers scores higher."""
    rest = recs[1:] or recs
    return sum(r["tokens_per_s"] * r["step_s"] for r in rest) / worker_seconds(recs)


def oracle_bound(recs: list[dict]) -> float:
    """Sum over steps of the run's bottleneck / the best contiguous bottleneck (measured costs)."""
    static, best = 0.0, 0.0
    for r in recs[1:] or recs:
        costs = r["layer_cost_s"]
        lay = Layout(tuple(r["layout"]))
        static += max(lay.stage_loads(costs))
        best += balance(Problem(costs=costs, stages=lay.num_stages), "optimal").bottleneck
    return static / best if best > 0 else float("nan")


def profile_once_layout(recs: list[dict]) -> list[int]:
    """The replay's profile-once policy on a real run: the optimal layout for the median per-layer
    costs of the first steps after warm-up."""
    from dynmo.sim.replay import profile_once_layout as optimal_for

    early = [r["layer_cost_s"] for r in recs[1 : 1 + PROFILE_STEPS]] or [recs[0]["layer_cost_s"]]
    costs = [statistics.median(col) for col in zip(*early)]
    return list(optimal_for(costs, Layout(tuple(recs[0]["layout"])).num_stages).boundaries)


def final_val(recs: list[dict]) -> float | None:
    vals = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    return vals[-1] if vals else None


def _variants(case: BenchCase) -> list[str]:
    return [*STATIC_VARIANTS, "dynmo"] + (["repack"] if case.repack else [])


def real_row(case: BenchCase, out: Path, steps: int | None, repeats: int = 1, dense: dict | None = None) -> dict:
    """Every variant of `case`, `repeats` times in alternation; medians and the paired range.
    `dense`: cache of dense-model runs by (config, steps), shared across cases."""
    n = steps or case.steps
    base = ["--steps", str(n), "--train.eval_every", str(n), *case.extra]
    runs: dict[str, list[list[dict]]] = {v: [] for v in _variants(case)}
    seconds: dict[str, float] = {}
    for rep in range(repeats):
        for variant in _variants(case):
            name = f"{case.name}-{variant}" + (f"-{rep}" if rep else "")
            args = list(base)
            if variant in ("uniform", "params"):
                args += ["--balance.when", "never", "--parallel.layout", variant]
            elif variant == "profile-once":
                lay = profile_once_layout(runs["uniform"][rep])
                args += ["--balance.when", "never", "--parallel.layout", ",".join(map(str, lay))]
            else:
                args += ["--balance.when", case.when] + (["--balance.repack", "true"] if variant == "repack" else [])
            if variant == "uniform" and rep == 0:  # the trace the simulation scales
                args += ["--trace", str((out / "traces" / f"{case.name}-static.jsonl").resolve())]
            t = time.perf_counter()
            recs = train(out / "runs" / name, case.config, *args)
            seconds[variant] = seconds.get(variant, 0.0) + time.perf_counter() - t
            runs[variant].append(recs)
            print(f"  {case.name} {variant} ({rep + 1}/{repeats}): {len(recs)} steps in {time.perf_counter() - t:.0f} s, "
                  f"{throughput(recs):,.0f} tok/s", file=sys.stderr, flush=True)
    med = statistics.median
    tps = {v: [throughput(r) for r in rs] for v, rs in runs.items()}
    best = max(STATIC_VARIANTS, key=lambda v: med(tps[v]))
    paired = [d / max(tps[v][i] for v in STATIC_VARIANTS) for i, d in enumerate(tps["dynmo"])]
    d = runs["dynmo"][0]
    row = {
        "case": case.name,
        "when": case.when,
        "steps": len(d),
        "repeats": repeats,
        "seconds": {v: round(s) for v, s in seconds.items()},
        "tokens_per_s": {v: med(x) for v, x in tps.items()},
        "best_static": best,
        "speedup_vs_best_static": med(tps["dynmo"]) / med(tps[best]),
        "speedup_vs_best_static_min": min(paired),
        "speedup_vs_best_static_max": max(paired),
        "speedup_vs_uniform": med(tps["dynmo"]) / med(tps["uniform"]),
        "oracle_bound": med(oracle_bound(s) for s in runs["uniform"]),
        "profile_once_layout": profile_once_layout(runs["uniform"][0]),
        "bubble": {v: med(statistics.fmean(r["bubble_ratio"] for r in x[1:]) for x in rs) for v, rs in runs.items()},
        "migrations": med(sum(e["type"] == "migration" for r in x for e in r["events"]) for x in runs["dynmo"]),
        "overhead_pct": med(100 * overhead_s(x) / sum(r["step_s"] for r in x) for x in runs["dynmo"]),
        "final_layout": d[-1]["layout"],
        "val_loss": {v: final_val(rs[0]) for v, rs in runs.items()},
        "worker_s": {v: med(worker_seconds(x) for x in rs) for v, rs in runs.items()},
        "tokens_per_worker_s": {v: med(per_worker(x) for x in rs) for v, rs in runs.items()},
        "workers_final": {v: rs[0][-1].get("workers", 2) for v, rs in runs.items()},
    }
    if case.dense is not None and dense is not None:
        dn = dense_run(case, out, n, dense)
        row["dense"] = dn
        row["technique_alone"] = med(tps["uniform"]) / dn["tokens_per_s"]
        row["technique_dynmo"] = med(tps["dynmo"]) / dn["tokens_per_s"]
    write_real_plots(case.name, runs, out / "plots" / case.name)
    return row


def dense_name(case: BenchCase, steps: int) -> str:
    """The run (and trace) name of a case's dense model: `dense-<steps>` for the default config,
    shared by the cases that use it, else `dense-<case>-<steps>`."""
    return f"{_dense_prefix(case)}{steps}"


def _dense_prefix(case: BenchCase) -> str:
    return "dense-" if case.dense == DENSE and not case.dense_extra else f"dense-{case.name}-"


def dense_run(case: BenchCase, out: Path, steps: int, cache: dict) -> dict:
    """Train the case's dense model for `steps` (once per invocation and name), traced."""
    name = dense_name(case, steps)
    if name not in cache:
        t = time.perf_counter()
        recs = train(out / "runs" / name, case.dense, *case.dense_extra, "--steps", str(steps),
                     "--train.eval_every", str(steps), "--balance.when", "never",
                     "--trace", str((out / "traces" / f"{name}.jsonl").resolve()))
        cache[name] = {"name": name, "tokens_per_s": throughput(recs), "val_loss": final_val(recs),
                       "seconds": round(time.perf_counter() - t)}
        print(f"  {name} ({case.dense} {' '.join(case.dense_extra)}): {cache[name]['tokens_per_s']:,.0f} tok/s",
              file=sys.stderr, flush=True)
    return cache[name]


def write_real_plots(name: str, runs: dict[str, list[list[dict]]], out_dir: Path) -> None:
    """The real runs over the steps: stage compute (uniform vs dynmo), dynmo's layout, and
    tokens/s per worker of every variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    shown = [v for v in ("uniform", "dynmo", "repack") if runs.get(v)]
    fig, axes = plt.subplots(1, len(shown), figsize=(4.5 * len(shown), 3.2), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, v in zip(axes.flat, shown):
        recs = runs[v][0]
        for j in range(max(len(r["stage_compute_s"]) for r in recs)):
            ax.plot([r["step"] for r in recs], [r["stage_compute_s"][j] if j < len(r["stage_compute_s"]) else float("nan")
                                                for r in recs], label=f"stage {j}", lw=1)
        ax.set_title(f"{name}: {v}", fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    axes.flat[0].set_ylabel("stage compute (s per step)")
    fig.savefig(out_dir / "real_stage_loads.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.2), layout="constrained")
    recs = runs["dynmo"][0]
    inner = max(len(r["layout"]) for r in recs) - 2
    for j in range(inner):
        ax.step([r["step"] for r in recs], [r["layout"][j + 1] if j + 1 < len(r["layout"]) - 1 else float("nan")
                                            for r in recs], where="post", label=f"boundary {j + 1}")
    ax.set_title(f"{name}: dynmo's layout", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("first layer of stage")
    ax.legend(fontsize=7)
    fig.savefig(out_dir / "real_layout.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.2), layout="constrained")
    for v, rs in runs.items():
        recs = rs[0][1:]
        ax.plot([r["step"] for r in recs], [r["tokens_per_s"] / r.get("workers", 2) for r in recs], label=v, lw=1)
    ax.set_title(f"{name}: tokens/s per worker", fontsize=9)
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.savefig(out_dir / "real_per_worker.png", dpi=110)
    plt.close(fig)


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
    # dynmo started from the best static layout a profile gives, rather than from uniform: what
    # run-time balancing adds to a careful static choice
    (warm,) = replay(trace, stages=case.stages, dp=case.dp, policies=["optimal"],
                     options=replace(opts, initial="profile-once"))
    warm.policy = "optimal from profile-once"
    results.append(warm)
    # the model without the technique, scaled and replayed alike on static uniform
    dense = None
    found = _dense_trace(out, case)
    if found is not None:
        dtrace = scale_trace(load_trace(found), case.blocks, noise=0.05)
        (dense,) = replay(dtrace, stages=case.stages, dp=case.dp, policies=["uniform"], options=opts)
    rows = []
    for r in results:
        row = {"case": case.name, "shape": f"{case.blocks + 2} layers, {case.stages}x{case.dp}", **r.as_dict(per_step=False)}
        if dense is not None:
            ours, theirs = (r.tokens_per_s, dense.tokens_per_s) if r.tokens_per_s and dense.tokens_per_s else \
                (r.steps_per_s, dense.steps_per_s)
            row["vs_dense"] = ours / theirs if theirs else None
            row["dense_trace"] = found.name
        rows.append(row)
    return rows


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


def _dense_trace(out: Path, case: BenchCase) -> Path | None:
    """A static trace of the case's dense model (`dense-<steps>.jsonl`, written by the real
    runs, or converted from a dense run's metrics.jsonl in OUT/runs): the one of the case's
    step count, else any; None for a case without a dense model."""
    from dynmo.sim import load_trace

    if case.dense is None:
        return None
    for run in sorted((out / "runs").glob("dense-*")):
        path = out / "traces" / f"{run.name}.jsonl"
        if not path.is_file() and (run / "metrics.jsonl").is_file():
            load_trace(run).write(path)
    exact = out / "traces" / f"{dense_name(case, case.steps)}.jsonl"
    if exact.is_file():
        return exact
    # another step count of the same dense model
    found = sorted((out / "traces").glob(f"{_dense_prefix(case)}[0-9]*.jsonl"))
    return found[0] if found else None


def fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def _f(x, spec: str = ".3f") -> str:
    return fmt(x, spec)


def render(real: list[dict], sim: list[dict], missing: list[str], argv: list[str], started: str = "",
           duration_s: float | None = None) -> str:
    lines = ["# dynmo bench\n", f"Command: `dynmo bench {' '.join(argv)}`"
             + (f" (started {started}" + (f", {duration_s / 60:.0f} min" if duration_s else "") + ")" if started else "")
             + "\n"]
    runs: dict[tuple, list[str]] = {}
    for kind, rows in (("real", real), ("simulated", sim)):
        for r in rows:
            ran = r.get("run") or {}
            if ran and (ran.get("command") != argv or ran.get("started") != started):
                key = (" ".join(ran.get("command") or ["..."]), ran.get("started") or "?")
                label = f"{r['case']} ({kind})"
                if label not in runs.setdefault(key, []):
                    runs[key].append(label)
    for (cmd, when), labels in runs.items():
        lines.append(f"Kept from an earlier invocation, `dynmo bench {cmd}` (started {when}): {', '.join(labels)}.\n")
    if real:
        reps = real[0].get("repeats", 1)
        lines += [
            "## Real runs, this machine (2 ranks, gloo, CPU)\n",
            "Tokens/s of every variant (all steps but the first, migrations included); the headline is dynmo over the "
            "best of the three static layouts (profile-once: the optimal layout for the uniform run's costs of steps "
            f"1..{PROFILE_STEPS}, kept)."
            + (f" Medians of {reps} alternating rounds; the range is that of the paired ratios." if reps > 1 else "")
            + "\n",
            "| case | trigger | steps | uniform | params | profile-once | dynmo | **dynmo / best static** | best static "
            "| dynmo / uniform | oracle bound | migrations | overhead % | final layout |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
        ]
        for r in real:
            t = r["tokens_per_s"]
            rng = (f" ({r['speedup_vs_best_static_min']:.3f}–{r['speedup_vs_best_static_max']:.3f})"
                   if r.get("repeats", 1) > 1 else "")
            lines.append(
                f"| {r['case']} | {r['when']} | {r['steps']} | {t['uniform']:,.0f} | {t['params']:,.0f} | "
                f"{t['profile-once']:,.0f} | {t['dynmo']:,.0f} | **{r['speedup_vs_best_static']:.3f}**{rng} | "
                f"{r['best_static']} | {r['speedup_vs_uniform']:.3f} | {r['oracle_bound']:.3f} | {r['migrations']:g} | "
                f"{r['overhead_pct']:.2f} | {r['final_layout']} |"
            )
        lines += [
            "",
            "### Technique alone and with dynmo, against the dense model and the paper\n",
            "Over the dense model (the same config without the technique, same steps): the technique on a static "
            "uniform layout, and with dynmo. Validation loss at the last step.\n",
            "| case | dense tok/s | technique alone | technique + dynmo | dynmo / best static | paper | paper compares against "
            "| val loss: dense → technique → + dynmo |",
            "|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in real:
            paper = PAPER.get(r["case"].split("-")[0])
            dn = r.get("dense") or {}
            v = r["val_loss"]
            lines.append(
                f"| {r['case']} | {_f(dn.get('tokens_per_s'), ',.0f')} | {_f(r.get('technique_alone'))} | "
                f"{_f(r.get('technique_dynmo'))} | {r['speedup_vs_best_static']:.3f} | "
                f"{f'{paper[0]:.2f}' if paper else 'n/a'} | {paper[1] if paper else 'n/a'} | "
                f"{_f(dn.get('val_loss'), '.3f')} → {_f(v.get('uniform'), '.3f')} → {_f(v.get('dynmo'), '.3f')} |"
            )
        packed = [r for r in real if "repack" in r["tokens_per_s"]]
        if packed:
            lines += [
                "",
                "### Re-packing: the same training on fewer workers\n",
                "Worker-seconds = sum over steps of the step's wall time x its active workers; tokens/s per worker is "
                "tokens over worker-seconds.\n",
                "| case | variant | workers (final) | tok/s | worker-seconds | tok/s per worker |",
                "|---|---|---:|---:|---:|---:|",
            ]
            for r in packed:
                for v in ("dynmo", "repack"):
                    lines.append(f"| {r['case']} | {'optimal' if v == 'dynmo' else 'optimal+repack'} | "
                                 f"{r['workers_final'][v]} | {r['tokens_per_s'][v]:,.0f} | {r['worker_s'][v]:,.0f} | "
                                 f"{r['tokens_per_worker_s'][v]:,.0f} |")
        lines.append("")
    if sim:
        lines += [
            "## Simulated at paper scale (uniform traces above, scaled; `dynmo.sim.replay`)\n",
            "Microbatches per replica = 4 x stages; migrations charged at the controller's cost model.\n",
            "Headline: total time of the best static layout (uniform, params or profile-once) over dynmo's, dynmo "
            "started from uniform and from profile-once, and over the oracle (the best contiguous layout of every "
            "step, free to change).\n",
            "| case | shape | best static | dynmo from uniform | dynmo from profile-once | oracle |",
            "|---|---|---|---:|---:|---:|",
        ]
        heads = {}
        for r in sim:
            heads.setdefault(r["case"], {})[r["policy"]] = r
        for c, pol in heads.items():
            anyrow = next(iter(pol.values()))
            lines.append(f"| {c} | {anyrow['shape']} | {anyrow.get('best_static') or 'n/a'} | "
                         f"{_f(pol.get('optimal', {}).get('speedup_vs_best_static'))} | "
                         f"{_f(pol.get('optimal from profile-once', {}).get('speedup_vs_best_static'))} | "
                         f"{_f(pol.get('oracle', {}).get('speedup_vs_best_static'))} |")
        lines += [
            "",
            "All policies:\n",
            "| case | shape | policy | vs uniform | **vs best static** | vs dense | mean bubble | workers (final) "
            "| worker-seconds | per worker vs uniform | migrations |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in sim:
            lines.append(
                f"| {r['case']} | {r['shape']} | {r['policy']} | {_f(r.get('speedup'))} | "
                f"{_f(r.get('speedup_vs_best_static'))} | {_f(r.get('vs_dense'))} | {_f(r.get('mean_bubble'))} | "
                f"{r.get('workers_final', 'n/a')} | {_f(r.get('worker_s'), ',.0f')} | {_f(r.get('speedup_per_worker'))} | "
                f"{r.get('migrations', 0)} |"
            )
        lines.append("")
        by = {(r["case"], r["policy"]): r for r in sim}
        cases = list(dict.fromkeys(r["case"] for r in sim))
        if any(r.get("vs_dense") is not None for r in sim):
            lines += [
                "### Technique alone and with dynmo at paper scale, against the dense model and the paper\n",
                "Tokens/s over the dense model's (its trace scaled and replayed alike, static uniform): the technique "
                "on static uniform, on the best static layout, and with dynmo (`optimal`, from uniform).\n",
                "| case | technique alone (uniform) | best static | technique + dynmo | dynmo from profile-once "
                "| paper | paper compares against |",
                "|---|---:|---:|---:|---:|---:|---|",
            ]
            for c in cases:
                u, o = by.get((c, "uniform"), {}), by.get((c, "optimal"), {})
                w = by.get((c, "optimal from profile-once"), {})
                if u.get("vs_dense") is None:
                    continue
                best = max((by[(c, p)].get("vs_dense") or 0.0 for p in STATIC_VARIANTS if (c, p) in by), default=None)
                paper = PAPER.get(c.split("-")[0])
                lines.append(f"| {c} | {_f(u.get('vs_dense'))} | {_f(best)} | {_f(o.get('vs_dense'))} | "
                             f"{_f(w.get('vs_dense'))} | "
                             f"{f'{paper[0]:.2f}' if paper else 'n/a'} | {paper[1] if paper else 'n/a'} |")
            lines.append("")
    if missing:
        lines += ["## Missing\n"] + [f"- {m}" for m in missing] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="dynmo bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench", help="output folder (default bench/)")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated cases")
    ap.add_argument("--steps", type=int, default=None, help="steps per real run (default: each case's, BenchCase.steps)")
    ap.add_argument("--repeats", type=int, default=1, help="alternating rounds of all variants per case (default 1)")
    ap.add_argument("--no-real", action="store_true", help="skip the real runs, simulate from traces already in OUT/traces")
    ap.add_argument("--no-sim", action="store_true", help="skip the paper-scale simulation")
    ap.add_argument("--dense-only", action="store_true",
                    help="of the real runs, train only the cases' dense models (the other rows are kept)")
    args = ap.parse_args(argv)
    if args.repeats < 1 or (args.steps is not None and args.steps < PROFILE_STEPS + 2):
        ap.error(f"--repeats must be >= 1 and --steps >= {PROFILE_STEPS + 2}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    known = {c.name: c for c in CASES}
    bad = [w for w in wanted if w not in known]
    if bad:
        print(f"dynmo bench: unknown case(s) {bad}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    started, t0 = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    real, sim, missing, dense = [], [], [], {}
    run = {"command": argv, "started": started}  # stamped on every row this invocation measures
    # rows this invocation does not measure again (other cases, or all real rows with --no-real)
    # are kept from OUT/bench.json, each with the invocation that measured it
    kept_real, kept_sim = [], []
    if (out / "bench.json").is_file():
        try:
            old = json.loads((out / "bench.json").read_text())
            old_run = {"command": old.get("command"), "started": old.get("started")}
            kept_real = [r | {"run": r.get("run") or old_run} for r in old.get("real", [])
                         if args.no_real or args.dense_only or r["case"] not in wanted]
            kept_sim = [r | {"run": r.get("run") or old_run} for r in old.get("sim", [])
                        if args.no_sim or r["case"] not in wanted]
        except (OSError, ValueError, AttributeError, TypeError, KeyError) as e:
            print(f"dynmo bench: {out / 'bench.json'} is not readable ({e}); move it away to start afresh",
                  file=sys.stderr)
            return 2
    order = {c.name: i for i, c in enumerate(CASES)}

    def write() -> str:
        all_real = _latest_dense(sorted(kept_real + real, key=lambda r: order.get(r["case"], len(order))), dense)
        all_sim = sorted(kept_sim + sim, key=lambda r: order.get(r["case"], len(order)))
        (out / "bench.json").write_text(json.dumps({"command": argv, "started": started,
                                                    "duration_s": round(time.perf_counter() - t0),
                                                    "real": all_real, "sim": all_sim, "missing": missing},
                                                   indent=1) + "\n")
        text = render(all_real, all_sim, missing, argv, started, time.perf_counter() - t0)
        (out / "bench.md").write_text(text)
        return text

    for name in wanted:
        case = known[name]
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
                real.append(real_row(case, out, args.steps, args.repeats, dense) | {"run": run})
            except RuntimeError as e:
                missing.append(f"{name}: real run failed: {str(e).splitlines()[0]}")
                write()
                continue
        if not args.no_sim:
            if not (out / "traces" / f"{name}-static.jsonl").is_file():
                missing.append(f"{name}: no static trace to simulate from (run without --no-real first)")
                continue
            sim += [r | {"run": run} for r in sim_rows(case, out)]
        write()
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
