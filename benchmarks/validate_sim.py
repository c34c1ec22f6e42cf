"""Validate the simulator against real 2-rank runs: measured vs simulated iteration time.

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

from dynmo.layout import Layout
from dynmo.sim.engine import predict_iteration_time
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


def validate(run_dir: Path, comm: float) -> dict:
    trace = trace_from_metrics(run_dir)
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    h = trace.header
    m, v = h.microbatches, h.virtual_stages
    rows = {}
    for variant, p2p, c in (("layers", "eager", 0.0), ("stage", "eager", comm), ("stage", "rendezvous", comm)):
        errs = []
        for st, rec in list(zip(trace.steps, recs))[1:]:
            f, bw = stage_mb_times(st, Layout(tuple(st.layout)), m, rec, variant)
            sim = predict_iteration_time(f.tolist(), bw.tolist(), h.schedule, m, comm=c,
                                         stages_per_rank=v if v > 1 else None, p2p=p2p)
            errs.append((sim - st.iteration_s) / st.iteration_s)
        key = f"{variant}{'+comm' if c else ''} {p2p}"
        rows[key] = {"mean_err": float(np.mean(errs)), "mean_abs_err": float(np.mean(np.abs(errs))),
                     "max_abs_err": float(np.max(np.abs(errs)))}
    measured = float(np.mean([s.iteration_s for s in trace.steps[1:]]))
    return {"schedule": h.schedule, "virtual_stages": v, "steps": len(trace.steps) - 1,
            "mean_iteration_s": measured, "variants": rows}


SKEW = ["--config", "configs/skewed.toml", "--skew.start_step", "3"]  # skew blocks 0-2 x4, all on stage 0


def validate_policy(out: Path, steps: int, reuse: bool) -> dict:
    """Replay the static skewed run's trace under the controller (when=auto, optimal) and compare
    the predicted speedup with a real run of that policy on the same model."""
    from dynmo.sim.replay import ReplayOptions, replay

    static, auto = out / "skewed-static", out / "skewed-auto"
    if not reuse:
        run("skewed-static", SKEW, steps, out)
        run("skewed-auto", SKEW + ["--balance.when", "auto"], steps, out)
    real_static = [json.loads(x) for x in (static / "metrics.jsonl").read_text().splitlines()]
    real_auto = [json.loads(x) for x in (auto / "metrics.jsonl").read_text().splitlines()]

    def real_time(recs):  # step 0 left out: one-off set-up
        return sum(r["iteration_s"] + sum(e.get("seconds", 0.0) for e in r["events"] if e["type"] == "migration")
                   for r in recs[1:])

    trace = trace_from_metrics(static)
    uni, opt = replay(trace, None, None, ["uniform", "optimal"], ReplayOptions(when="auto"))
    sim_uni = sum(uni.iteration_s[1:])
    sim_opt = sum(t + o for t, o in zip(opt.iteration_s[1:], opt.overhead_s[1:]))
    migr = [(r["step"], e["new"]) for r in real_auto for e in r["events"] if e["type"] == "migration"]
    return {
        "measured_speedup": real_time(real_static) / real_time(real_auto),
        "predicted_speedup": sim_uni / sim_opt,
        "real_migrations": migr,
        "replayed_migrations": [(k, opt.layouts[k]) for k in range(1, len(opt.layouts))
                                if opt.layouts[k] != opt.layouts[k - 1]],
        "static_time_err": sim_uni / real_time(real_static) - 1,
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
    results = {}
    for name, extra in CONFIGS:
        run_dir = out / name if args.reuse else run(name, extra, args.steps, out)
        results[name] = validate(run_dir, comm)
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
    print("\nerr = (simulated - measured) / measured iteration time, per step (step 0 left out), then averaged")
    print(f"\ntrace replay vs a real balanced run (configs/skewed.toml, skew from step 3, balance.when=auto):\n"
          f"  measured speedup of auto over static: {policy['measured_speedup']:.3f}  "
          f"(migrations at steps {[k for k, _ in policy['real_migrations']]}, to {[b for _, b in policy['real_migrations']]})\n"
          f"  predicted by replaying the static run's trace (policy optimal, when=auto): {policy['predicted_speedup']:.3f}  "
          f"(migrations before steps {[k for k, _ in policy['replayed_migrations']]}, "
          f"to {[b for _, b in policy['replayed_migrations']]})\n"
          f"  static run's total iteration time, simulated vs measured: {policy['static_time_err'] * 100:+.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"comm_s": comm, "load_before_after": [before, after], "results": results, "policy": policy,
                                               "overall_mean_abs_err": overall}, indent=2))


if __name__ == "__main__":
    main()
