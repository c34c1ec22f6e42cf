"""Validate the simulator against real 2-rank runs: measured vs simulated iteration time.

Produces the tables in docs/bench/simulator-validation.md (linked from docs/simulator.md,
"Validation against real 2-rank runs").

    OMP_NUM_THREADS=1 python benchmarks/validate_sim.py [--steps 12] [--out runs/validate-sim] [--reuse]

For each configuration (d_model 256, so compute dominates; GPipe, 1F1B, 1F1B with an injected
imbalance, Interleaved1F1B with 2 virtual stages) it runs `dynmo train --nproc 2`, then for
every step after the first (which pays one-off set-up) simulates the iteration from that
step's measured costs and compares with the measured `iteration_s` (wall time inside
`schedule.step`, max over ranks). Stage times per microbatch, two variants:

  layers  sum of the per-layer forward / backward times (`layer_fwd_s`, `layer_bwd_s`);
  stage   `stage_compute_s / microbatches`: the stage's whole forward_one_chunk /
          backward_one_chunk time, i.e. the layers plus torch's per-chunk overhead
          (split into forward and backward in the layers' proportion).
  +op     `stage` plus a fixed overhead per op, fitted (bisection) so that the 1F1B run's
          mean error is zero, then applied unchanged to the other configurations.

Transfers: the one-way time of one activation ([microbatch, seq, d_model] fp32) between the
two ranks, measured here with gloo send/recv ping-pong (median of 30). Both transfer models
of the engine are reported (eager, rendezvous). The machine is shared: the load average is
printed before and after, and timings are disturbed by whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from dynmo.engine import predict_iteration_time
from dynmo.layout import Layout
from dynmo.sim.trace import trace_from_metrics

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["--config", "configs/default.toml"]
COMMON = ["--log.tensorboard", "false", "--log.progress", "false",
          "--train.eval_every", "0"]
CONFIGS = [
    ("gpipe", DEFAULT + ["--parallel.schedule", "gpipe"]),
    ("1f1b", DEFAULT + ["--parallel.schedule", "1f1b"]),
    ("1f1b-skewed", DEFAULT + ["--parallel.schedule", "1f1b", "--skew.blocks", "0;1;2", "--skew.factor", "4",
                     "--skew.start_step", "3"]),
    ("interleaved1f1b-v2", DEFAULT + ["--parallel.schedule", "interleaved1f1b", "--parallel.virtual_stages", "2"]),
]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- transfer time between the two ranks ------------------------------------------------------


def _pingpong(rank: int, port: int, shape: tuple[int, ...], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.randn(shape)
    times = []
    for i in range(reps + 3):
        dist.barrier()
        t = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        else:
            dist.recv(x, 0)
            dist.send(x, 0)
        if i >= 3:
            times.append((time.perf_counter() - t) / 2)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure_comm(shape: tuple[int, ...], reps: int = 30) -> float:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ROOT / "runs" / "validate-sim-comm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(_pingpong, args=(port, shape, reps, str(out)), nprocs=2, join=True)
    return float(statistics.median(json.loads(out.read_text())))


# ---- runs and simulation --------------------------------------------------------------------


def run(name: str, extra: list[str], steps: int, out: Path) -> Path:
    run_dir = out / name
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", "2", "--steps", str(steps),
           "--out", str(run_dir), *COMMON, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{name}: dynmo train failed:\n{p.stderr[-3000:]}")
    return run_dir


def stage_mb_times(step, layout: Layout, m: int, rec: dict | None, variant: str) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(layout.boundaries[:-1])
    f = np.add.reduceat(np.asarray(step.fwd), b)
    bw = np.add.reduceat(np.asarray(step.bwd), b)
    if variant == "stage":
        total = np.asarray(rec["stage_compute_s"]) / m
        scale = total / (f + bw)
        f, bw = f * scale, bw * scale
    return f, bw


def _errors(run_dir: Path, variant: str, p2p: str, comm: float, overhead: float = 0.0) -> list[float]:
    """(simulated - measured) / measured iteration time of every step but the first."""
    trace = trace_from_metrics(run_dir)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    h = trace.header
    m, v = h.microbatches, h.virtual_stages
    errs = []
    for st, rec in list(zip(trace.steps, recs))[1:]:
        f, bw = stage_mb_times(st, Layout(tuple(st.layout)), m, rec, variant)
        sim = predict_iteration_time((f + overhead).tolist(), (bw + overhead).tolist(), h.schedule, m, comm=comm,
                                     stages_per_rank=v if v > 1 else None, p2p=p2p)
        errs.append((sim - st.iteration_s) / st.iteration_s)
    return errs


def fit_overhead(run_dir: Path, comm: float) -> float:
    """Seconds per compute op that make the mean error of one run zero (bisection): the time a
    rank spends in `schedule.step` outside its ops (posting and waiting on send/recv, Python)."""
    lo, hi = 0.0, 0.05
    if np.mean(_errors(run_dir, "stage", "rendezvous", comm)) >= 0:
        return 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if np.mean(_errors(run_dir, "stage", "rendezvous", comm, mid)) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def validate(run_dir: Path, comm: float, overhead: float) -> dict:
    trace = trace_from_metrics(run_dir)
    rows = {}
    for variant, p2p, c, o in (("layers", "eager", 0.0, 0.0), ("stage", "eager", comm, 0.0),
                               ("stage", "rendezvous", comm, 0.0), ("stage", "rendezvous", comm, overhead)):
        errs = _errors(run_dir, variant, p2p, c, o)
        key = f"{variant}{'+comm' if c else ''}{'+op' if o else ''} {p2p}"
        rows[key] = {"mean_err": float(np.mean(errs)), "mean_abs_err": float(np.mean(np.abs(errs))),
                     "max_abs_err": float(np.max(np.abs(errs)))}
    measured = float(np.mean([s.iteration_s for s in trace.steps[1:]]))
    return {"schedule": trace.header.schedule, "virtual_stages": trace.header.virtual_stages,
            "steps": len(trace.steps) - 1, "mean_iteration_s": measured, "variants": rows}


SKEW = ["--config", "configs/skewed.toml", "--skew.start_step", "3"]  # skew blocks 0-2 x4, all on stage 0
AB_FIRST, AB_PERIOD, AB_STEPS = 4, 4, 28  # A/B run: layouts switch every 4 steps from step 4


def _migration_s(rec: dict) -> float:
    return sum(e.get("seconds", 0.0) for e in rec["events"] if e["type"] == "migration")


def validate_policy(out: Path, steps: int, reuse: bool) -> dict:
    """The replayed controller against the real one, and the predicted gain of its layout
    against the gain measured in one run that alternates the two layouts.

    1. static run of configs/skewed.toml -> trace -> replay with the controller (optimal,
       when=auto): the layout B it moves to and its predicted speedup;
    2. a real balance.when=auto run: does the real controller make the same move?
    3. an A/B run: forced re-layouts switch between the uniform layout A and B every
       AB_PERIOD steps, so both layouts run under the same load (two separate runs made one
       after the other on a shared machine do not). Measured: mean iteration time on A /
       on B (the step after each switch, which rebuilds the schedule, left out). Predicted:
       the same ratio simulated from each step's own per-layer costs."""
    from dynmo.sim.replay import ReplayOptions, replay

    static, auto, ab = out / "skewed-static", out / "skewed-auto", out / "skewed-ab"
    if not reuse:
        run("skewed-static", SKEW, steps, out)
        run("skewed-auto", SKEW + ["--balance.when", "auto"], steps, out)
    trace = trace_from_metrics(static)
    uni, opt = replay(trace, None, None, ["uniform", "optimal"], ReplayOptions())
    A, B = Layout(tuple(uni.layouts[0])), Layout(tuple(opt.layouts[-1]))
    if not reuse:
        switches = [f"{k}:{','.join(map(str, (B if n % 2 == 0 else A).boundaries))}"
                    for n, k in enumerate(range(AB_FIRST, AB_STEPS, AB_PERIOD))]
        run("skewed-ab", SKEW + ["--parallel.relayout", ";".join(switches)], AB_STEPS, out)
    real_auto = [json.loads(x) for x in (auto / "metrics.jsonl").read_text().splitlines()]
    ab_trace = trace_from_metrics(ab)
    h = ab_trace.header
    measured = {A.boundaries: [], B.boundaries: []}
    sim_ratio = []
    for k, st in enumerate(ab_trace.steps):
        if k < AB_FIRST or (k - AB_FIRST) % AB_PERIOD == 0:
            continue  # before the skew settles, and the rebuild step after each switch
        measured[tuple(st.layout)].append(st.iteration_s)
        f, b = np.asarray(st.fwd), np.asarray(st.bwd)
        t = [predict_iteration_time(np.add.reduceat(f, lay.boundaries[:-1]).tolist(),
                                    np.add.reduceat(b, lay.boundaries[:-1]).tolist(), h.schedule, h.microbatches)
             for lay in (A, B)]
        sim_ratio.append(t[0] / t[1])
    sim_static = sum(uni.iteration_s[1:])
    real_static = sum(s.iteration_s for s in trace.steps[1:])
    return {
        "layout_A": list(A.boundaries), "layout_B": list(B.boundaries),
        "replayed_migrations": [(k, opt.layouts[k]) for k in range(1, len(opt.layouts))
                                if opt.layouts[k] != opt.layouts[k - 1]],
        "real_migrations": [(r["step"], e["new"]) for r in real_auto for e in r["events"] if e["type"] == "migration"],
        "predicted_run_speedup": sim_static / sum(t + o for t, o in zip(opt.iteration_s[1:], opt.overhead_s[1:])),
        "separate_runs_speedup": real_static / sum(r["iteration_s"] + _migration_s(r) for r in real_auto[1:]),
        "static_time_err": sim_static / real_static - 1,
        "ab_measured_speedup": float(np.mean(measured[A.boundaries]) / np.mean(measured[B.boundaries])),
        "ab_predicted_speedup": float(np.mean(sim_ratio)),
        "ab_steps": [len(measured[A.boundaries]), len(measured[B.boundaries])],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "runs" / "validate-sim"))
    ap.add_argument("--reuse", action="store_true", help="simulate existing runs in --out, do not train")
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args()
    out = Path(args.out)
    before = load()
    print(f"load average before: {before}  (2 cores, shared: other jobs disturb the timings)")
    # activation of one microbatch: global_batch 16 / 4 microbatches = 4 sequences x 128 x 256 fp32
    comm = measure_comm((4, 128, 256))
    print(f"gloo one-way transfer of a 4x128x256 fp32 activation (512 KiB): {comm * 1e3:.2f} ms (median of 30)")
    dirs = {name: out / name if args.reuse else run(name, extra, args.steps, out) for name, extra in CONFIGS}
    # per-op overhead fitted on the 1F1B run only, then applied to the other configurations
    overhead = fit_overhead(dirs["1f1b"], comm)
    print(f"per-op overhead fitted on the 1f1b run: {overhead * 1e3:.2f} ms per forward or backward op")
    results = {name: validate(d, comm, overhead) for name, d in dirs.items()}
    policy = validate_policy(out, max(args.steps, 16), args.reuse)
    after = load()
    print(f"load average after:  {after}")
    keys = list(next(iter(results.values()))["variants"])
    print()
    print(f"{'config':<20} {'measured s':>10} " + " ".join(f"{k:>22}" for k in keys))
    print(f"{'':<20} {'per step':>10} " + " ".join(f"{'mean err / mean |err|':>22}" for _ in keys))
    for name, r in results.items():
        cells = [f"{r['variants'][k]['mean_err'] * 100:+6.1f}% / {r['variants'][k]['mean_abs_err'] * 100:5.1f}%"
                 for k in keys]
        print(f"{name:<20} {r['mean_iteration_s']:>10.3f} " + " ".join(f"{c:>22}" for c in cells))
    overall = {k: float(np.mean([r["variants"][k]["mean_abs_err"] for r in results.values()])) for k in keys}
    print(f"{'mean |err| over all':<31} " + " ".join(f"{overall[k] * 100:>21.1f}%" for k in keys))
    print("\nerr = (simulated - measured) / measured iteration time, per step (step 0 left out), then averaged; "
          "+op: with the per-op overhead fitted on 1f1b (so 1f1b's mean err is 0 by construction)")
    p = policy
    print(f"\nreplayed controller vs the real one (configs/skewed.toml, skew from step 3, balance.when=auto):\n"
          f"  replay (optimal, auto) of the static run's trace moves before steps "
          f"{[k for k, _ in p['replayed_migrations']]} to {[b for _, b in p['replayed_migrations']]}; "
          f"the real auto run moved before steps {[k for k, _ in p['real_migrations']]} to "
          f"{[b for _, b in p['real_migrations']]}\n"
          f"  static run's total iteration time, simulated vs measured: {p['static_time_err'] * 100:+.1f}%\n"
          f"  speedup of layout {p['layout_B']} over {p['layout_A']} in one run alternating them every "
          f"{AB_PERIOD} steps ({p['ab_steps'][0]} + {p['ab_steps'][1]} steps): measured {p['ab_measured_speedup']:.3f}, "
          f"simulated from the same steps' costs {p['ab_predicted_speedup']:.3f}\n"
          f"  (whole-run speedup predicted by the replay {p['predicted_run_speedup']:.3f}; two separate runs "
          f"measured {p['separate_runs_speedup']:.3f}, but they ran under different load)")
    if args.json:
        Path(args.json).write_text(json.dumps({"comm_s": comm, "op_overhead_s": overhead, "load_before_after": [before, after], "results": results, "policy": policy,
                                               "overall_mean_abs_err": overall}, indent=2))


if __name__ == "__main__":
    main()
