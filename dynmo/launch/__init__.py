"""`dynmo train`: validate, prepare the data once, then launch torchrun on `dynmo.train`.

    dynmo train --nproc 2 --config configs/default.toml --steps 50 --out runs/default \
        [--section.field VALUE ...]

`--steps`, `--out`, `--trace` and `--overwrite` are shorthands for `--train.steps`, `--out`, `--log.trace`
and `--overwrite true`. Everything after the known flags is passed on as config overrides.
`--max-restarts`, `--nnodes`, `--node-rank`, `--rdzv-endpoint` and `--rdzv-id` go to torchrun
(docs/failures.md: restarts, elastic jobs, several machines, SLURM).

Bad input the checks can see is one line and exit status 2 before anything starts. torchrun's
agent runs in a process of its own (`dynmo.launch.agent`) that reports a worker's failure as one line
too, the first failing rank's, instead of torchrun's report; it starts the workers from a fork
server that imported `dynmo.train` once.

A run that grows back onto ranks a re-pack released ends with every worker at exit status 0
and, as the newest checkpoint of its run folder, one saved for the grow (`grow` in its
`dynmo.json`); `grow_restart` tells it from a finished run, and the job is launched again, with
the same --nproc and --nnodes, resuming from that checkpoint (docs/failures.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dynmo import rundir
from dynmo.config import ConfigError, load_config

STOP_GRACE_S = 20  # after a forwarded signal, how long torchrun gets to stop its workers
# Set for the workers of `dynmo train`: its agent prints the first failing rank's line, so they do not.
LAUNCHED = "DYNMO_LAUNCHED"
# How torchrun starts the workers: `dynmo/train.py` run as __main__ in a process forked from the
# agent's fork server, which imported `dynmo.train` once (`dynmo.launch.agent.WORKER_PRELOAD`); a fresh
# interpreter per worker would import torch and dynmo again, about 3 s of CPU each.
WORKER_ARGS = ["--start-method=forkserver", "--run-path", str(Path(__file__).parents[1] / "train.py")]


def _term_with_parent() -> None:
    """In torchrun's process, before exec: SIGTERM when the launcher dies, even by SIGKILL, so
    torchrun stops its workers instead of leaving them to train on (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _run_forwarding_signals(cmd: list[str], env: dict) -> int:
    """Run torchrun; SIGINT, SIGTERM and SIGHUP sent to the launcher go to torchrun, which
    stops its workers (they live in their own sessions, out of reach of the terminal)."""
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_term_with_parent)
    got: list[int] = []

    def forward(sig, _frame):
        got.append(sig)
        proc.send_signal(sig)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                rc = proc.wait(timeout=STOP_GRACE_S if got else None)
                break
            except subprocess.TimeoutExpired:
                proc.kill()  # torchrun did not stop in time
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return 128 + got[0] if got else rc


def _node_args(args) -> list[str]:
    """torchrun's node and rendezvous flags: standalone on one machine, c10d rendezvous across
    machines (or several agents on one), elastic when --nnodes is MIN:MAX."""
    if args.nnodes == "1" and not args.rdzv_endpoint:
        return ["--standalone"]
    if not args.rdzv_endpoint:
        raise ConfigError("--nnodes needs --rdzv-endpoint HOST:PORT (the machine that hosts the rendezvous)")
    out = [f"--nnodes={args.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}",
           f"--rdzv-id={args.rdzv_id}"]
    if args.node_rank is not None:
        out.append(f"--node-rank={args.node_rank}")
    return out


def grow_restart(status: int, meta: dict | None, launched_at: float, resumed_step: int | None) -> bool:
    """Whether a job that ended with `status` asks to be launched again on its whole world:
    it ended well (every worker exit 0, so torchrun spent none of --max-restarts on it), and
    `meta` (the `dynmo.json` of the newest complete checkpoint in the run folder) records a
    grow saved by this job: after it was launched (`launched_at`, epoch seconds) and past the
    step it resumed from (`resumed_step`, None for a fresh start). A failed or stopped job
    never restarts this way, nor does a run whose newest checkpoint is an older grow's."""
    if status != 0 or not isinstance(meta, dict):
        return False
    grow, step = meta.get("grow"), meta.get("step")
    if not isinstance(grow, dict) or type(step) is not int:
        return False
    saved_at = grow.get("saved_at")
    if not isinstance(saved_at, (int, float)) or saved_at < launched_at:
        return False
    return resumed_step is None or step > resumed_step


def _checkpoint_step(path: str | None) -> int | None:
    """The step of the checkpoint a job resumes from, None for a fresh start (or unreadable)."""
    try:
        step = json.loads((Path(path) / "dynmo.json").read_text())["step"] if path else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if type(step) is int else None


def _newest_meta(out: str) -> tuple[Path | None, dict | None]:
    """The newest complete checkpoint of a run folder and its `dynmo.json`."""
    latest = rundir.latest_checkpoint(Path(out))
    if latest is None:
        return None, None
    try:
        return latest, json.loads((latest / "dynmo.json").read_text())
    except (OSError, ValueError):
        return latest, None


def _run_growing(cmd: list[str], env: dict, out: str, resume: str | None, nproc: int, machines: bool) -> int:
    """Run the job; while it ends asking to grow back (`grow_restart`), launch it again with the
    same torchrun flags (--nproc, --nnodes), resuming from the grow's checkpoint."""
    resumed = _checkpoint_step(resume)
    while True:
        launched_at = time.time()
        status = _run_forwarding_signals(cmd, env)
        latest, meta = _newest_meta(out)
        if not grow_restart(status, meta, launched_at, resumed):
            return status
        stages = meta["grow"].get("stages") or ["?"]
        ranks = f"{nproc} ranks per machine" if machines else f"{nproc} ranks"
        print(f"dynmo: restarting the job on its {ranks} from {latest} (the grow to {stages[-1]} pipeline "
              f"ranks at step {meta['step']})", flush=True)
        # later overrides win: resume from the grow's checkpoint, and never clear the run folder again
        cmd = [*cmd, "--checkpoint.resume", str(latest), "--overwrite", "false"]
        resumed = meta["step"]


def _worlds(args) -> list[int]:
    """The world sizes the job may run at: nproc x each node count --nnodes allows."""
    try:
        lo, _, hi = args.nnodes.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--nnodes {args.nnodes!r}: give a node count N or MIN:MAX") from None
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes {args.nnodes!r}: need 1 <= MIN <= MAX")
    return sorted({args.nproc * lo, args.nproc * hi})


EXAMPLES = """\
examples:
  dynmo train --nproc 2 --config configs/default.toml --steps 50 --out runs/default
  dynmo train --nproc 2 --config configs/skewed.toml --out runs/skewed --trace runs/skewed.trace.jsonl \\
      --balance.when auto
  dynmo train --nproc 4 --config configs/moe.toml --out runs/moe-ep --parallel.dp 2 --parallel.ep 2 \\
      --balance.experts auto
"""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="dynmo train",
        description="Train a pipeline-parallel model; extra --section.field VALUE flags override the config.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--nproc", type=int, default=2, help="processes (ranks) on this machine (default 2)")
    ap.add_argument("--config", default=None, help="TOML config file, e.g. configs/default.toml")
    ap.add_argument("--steps", type=int, default=None, help="training steps (= --train.steps)")
    ap.add_argument("--out", default=None, help="run folder for metrics, checkpoints, TensorBoard")
    ap.add_argument("--trace", default=None, help="write a per-layer cost trace (JSON Lines, docs/simulator.md) here (= --log.trace)")
    ap.add_argument("--overwrite", nargs="?", const="true", default=None, choices=["true", "false"],
                    help="replace the run in a non-empty --out (= --overwrite true)")
    ap.add_argument("--max-restarts", type=int, default=0,
                    help="restart the job up to N times when a worker fails; it resumes from the newest complete "
                         "checkpoint in --out (set --checkpoint.every)")
    ap.add_argument("--nnodes", default="1", help="machines in the job, or MIN:MAX for an elastic job (default 1)")
    ap.add_argument("--node-rank", type=int, default=None, help="this machine's rank (optional with c10d rendezvous)")
    ap.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous, on one of the machines")
    ap.add_argument("--rdzv-id", default="dynmo", help="a job id shared by every machine's launcher (default dynmo)")
    args, overrides = ap.parse_known_args(argv)
    if args.steps is not None:
        overrides += ["--train.steps", str(args.steps)]
    if args.out is not None:
        overrides += ["--out", args.out]
    if args.trace is not None:
        overrides += ["--log.trace", str(Path(args.trace).resolve())]
    if args.overwrite is not None:
        overrides += ["--overwrite", args.overwrite]
    if args.nproc < 1 or args.max_restarts < 0:
        print("dynmo train: error: --nproc must be >= 1 and --max-restarts >= 0", file=sys.stderr)
        return 2
    try:
        worlds = _worlds(args)
        node = _node_args(args)
        cfg = load_config(args.config, overrides)
        from dynmo import checks  # here, not at the top: the agent imports this package and needs none of it
        notes = [note for world in worlds for note in checks.validate(cfg, world)]
        from dynmo.checks.memory import check_memory

        for world in worlds:  # the estimate against what the machine has: before anything is written
            check_memory(cfg, world, args.nproc)
        if node == ["--standalone"]:  # with several machines, rank 0 checks the shared run folder
            rundir.check_run_folder(cfg.out, cfg.checkpoint.resume, cfg.overwrite)
    except ConfigError as e:
        print(f"dynmo train: error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"dynmo: {note}", file=sys.stderr, flush=True)
    if cfg.checkpoint.resume:  # the workers resume from the checkpoint chosen here (`latest` resolved)
        overrides += ["--checkpoint.resume", cfg.checkpoint.resume]
    # Prepared folders are checked (manifest, tokenizer, checksums); data.paths is tokenized once
    # here, so the ranks find the cache ready.
    from dynmo.data import DataError, check_prepared, prepare

    try:
        if cfg.data.prepared:
            check_prepared(cfg.data.prepared, cfg.data.weights, cfg.model.vocab_size, cfg.model.hf_path)
        else:
            prepare(cfg.data.paths, cfg.model.vocab_size, cfg.data.cache_dir, cfg.model.hf_path)
    except DataError as e:
        print(f"dynmo train: error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "dynmo.launch.agent", cfg.out, *node, f"--nproc-per-node={args.nproc}",
           f"--max-restarts={args.max_restarts}", *WORKER_ARGS]
    if args.config:
        cmd += ["--config", args.config]
    cmd += overrides
    env = dict(os.environ, **{LAUNCHED: "1"})  # the workers leave their failure lines to the agent
    # One thread per rank unless told otherwise: ranks share the cores.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    # Workers of each (re)start get a fresh key-value store on rank 0. torchrun's default shares
    # the rendezvous store across restarts without a per-attempt prefix, and gloo then reads its
    # peers' addresses from the failed attempt and cannot connect.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return _run_growing(cmd, env, cfg.out, cfg.checkpoint.resume or None, args.nproc, node != ["--standalone"])
