"""Training entry point run on every rank: `torchrun --nproc-per-node N -m dynmo.train ...`.

`dynmo train --nproc N ...` validates the config, prepares the data once and launches this.
Here: read and check the config, join the process group, let rank 0 judge the run folder, run
the `Trainer` (`dynmo.trainer`), and turn a failure into one line and an exit status (2: bad
input, 1: the run failed), its traceback kept in a file (`dynmo.runtime.failures`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dynmo import checks, plan
from dynmo.config import Config, ConfigError, load_config
from dynmo.launch import LAUNCHED
from dynmo.runtime import dist as rdist
from dynmo.runtime import failures
from dynmo.runtime.watch import Heartbeat
from dynmo.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="dynmo.train", add_help=True)
    ap.add_argument("--config", default=None)
    known, overrides = ap.parse_known_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    whole_lines()
    if os.environ.get(LAUNCHED) == "1":
        failures.detach(rank)
    failures.die_with_parent()
    try:
        cfg = load_config(known.config, overrides)
        restart = failures.restart_resume(cfg)
        notes = checks.validate(cfg, world)
    except ConfigError as e:  # the same on every rank: rank 0 says it where no launcher does
        return failures.report(e, failures.describe(e, rank), rank, show=_shows(rank, e))
    if rank == 0:
        if restart:
            print(f"dynmo: {failures.restart_line(restart, cfg)}", flush=True)
        for note in notes:
            print(f"dynmo: {note}", file=sys.stderr, flush=True)
    cfg.parallel.pp = plan.resolve_pp(cfg, world)
    return _run(cfg, rank, restart)


def whole_lines() -> None:
    """One write per printed line on stdout and stderr, which the ranks share: under
    PYTHONUNBUFFERED (common in CI and containers) `print` writes the text and its newline
    separately, and another rank's line can land between the two."""
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)


def _shows(rank: int, e: BaseException) -> bool:
    """Whether this rank prints its failure's line itself: not under `dynmo train`, whose agent
    prints the first failing rank's; a config error (the same everywhere) only on rank 0."""
    return os.environ.get(LAUNCHED) != "1" and (rank == 0 or not isinstance(e, ConfigError))


def _run(cfg: Config, rank: int, restart: int) -> int:
    """Join the job and train; any failure becomes one line and an exit status (`failures`)."""
    heartbeat = None
    writing = False  # the run folder is this run's: a failure's traceback may go into it
    try:
        ctx = rdist.init(cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.backend, cfg.parallel.timeout_s,
                          cfg.parallel.ep)
        problem = failures.folder_verdict(cfg, ctx, restart)
        if problem:
            raise ConfigError(problem)
        heartbeat = Heartbeat(ctx.rank, ctx.world)
        trainer = Trainer(cfg, ctx)
        failures.replace_old_run(cfg, ctx, restart)
        writing = True
        summary = trainer.run()
        if summary.get("released"):
            return 0  # nothing left to do here; the others train on (no collective with them)
        # Meet before tearing down: a rank that destroys its gloo groups while a peer still has
        # traffic in flight can abort ("terminate called without an active exception").
        dist.barrier(group=trainer.ctx.active_group)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        failure = failures.describe(e, rank, cfg, heartbeat)
        folder = Path(cfg.out) if writing else None
        return failures.report(e, failure, rank, folder, show=_shows(rank, e))
    finally:
        if heartbeat:
            heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
