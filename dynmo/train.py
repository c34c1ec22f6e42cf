"""Training entry point run on every rank: `torchrun --nproc-per-node N -m dynmo.train ...`.

`dynmo train --nproc N ...` validates the config, prepares the data once and launches this.
Here: read and check the config, join the process group, let rank 0 judge the run folder, run
the `Trainer` (`dynmo.trainer`), and turn a failure into one line and an exit status
(`dynmo.runtime.failures`).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dynmo import checks, plan, rundir
from dynmo.config import ConfigError, load_config
from dynmo.runtime import checkpoint, failures
from dynmo.runtime import dist as rdist
from dynmo.runtime.watch import Heartbeat
from dynmo.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="dynmo.train", add_help=True)
    ap.add_argument("--config", default=None)
    known, overrides = ap.parse_known_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    failures.die_with_parent()
    try:
        cfg = load_config(known.config, overrides)
        restart = failures.restart_resume(cfg)
        cfg.checkpoint.resume = rundir.resolve_resume(cfg.checkpoint.resume, cfg.out)
        checks.validate(cfg, world)
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dynmo: error: {e}", file=sys.stderr)
        return 2
    cfg.parallel.pp = plan.resolve_pp(cfg, world)
    ctx = rdist.init(cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.backend, cfg.parallel.timeout_s)
    heartbeat = None
    try:
        problem = failures.folder_verdict(cfg, ctx, restart)
        if problem:
            if ctx.rank == 0:
                print(f"dynmo: error: {problem}", file=sys.stderr)
            return 2
        heartbeat = Heartbeat(ctx.rank, ctx.world)
        trainer = Trainer(cfg, ctx)
        summary = trainer.run()
        if summary.get("released"):
            return 0  # nothing left to do here; the others train on (no collective with them)
        # Meet before tearing down: a rank that destroys its gloo groups while a peer still has
        # traffic in flight can abort ("terminate called without an active exception").
        dist.barrier(group=trainer.ctx.active_group)
    except (failures.Diverged, checkpoint.CheckpointWriteError) as e:
        print(f"dynmo: error: rank {ctx.rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        if not failures.is_peer_failure(e):
            raise
        print(f"dynmo: error: {failures.peer_failure_message(e, ctx, cfg, heartbeat)}", file=sys.stderr, flush=True)
        return 1
    finally:
        if heartbeat:
            heartbeat.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
