"""What a worker does when the run fails or restarts: every failure path of `dynmo.train` in one place.

- a worker dies with its launcher (`die_with_parent`), so a killed `dynmo train` leaves no
  worker training on alone;
- a job restarted by torchrun resumes from the newest complete checkpoint (`restart_resume`);
- rank 0 decides whether the run folder may be written and tells every rank (`folder_verdict`);
- a non-finite loss stops every rank at the same step (`Diverged`);
- a peer that died or stopped answering is named in one line (`peer_failure_message`).

Fault injection for the tests lives beside this in `dynmo.runtime.faults`, the heartbeat that
names a silent peer in `dynmo.runtime.watch`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from dynmo import rundir
from dynmo.config import Config, ConfigError
from dynmo.runtime import checkpoint, faults
from dynmo.runtime.dist import DistContext
from dynmo.runtime.watch import Heartbeat


class Diverged(RuntimeError):
    """The loss or the gradient norm is not finite."""


def die_with_parent() -> None:
    """Linux: this worker gets SIGKILL when its parent (torchrun's agent) dies, however it
    dies, so a killed launcher never leaves workers training on their own."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the line above
        os._exit(1)


def restart_resume(cfg: Config) -> int:
    """After torchrun restarted the job (`dynmo train --max-restarts N`), resume from the
    newest complete checkpoint in the run folder, if any. Returns the restart count."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart:
        latest = rundir.latest_checkpoint(Path(cfg.out))
        if latest is not None:
            cfg.checkpoint.resume = str(latest)
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"dynmo: restart {restart}: resuming from {latest}", flush=True)
    return restart


def folder_verdict(cfg: Config, ctx: DistContext, restart: int) -> str:
    """Rank 0 checks the run folder (a new run never writes over an old one) and tells all."""
    verdict = [""]
    if ctx.rank == 0 and not restart:
        try:
            rundir.check_run_folder(cfg.out, cfg.checkpoint.resume, cfg.overwrite)
            if cfg.overwrite:
                rundir.clear_run(cfg.out)
        except ConfigError as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def last_checkpoint(out: Path) -> str:
    """One sentence naming the newest complete checkpoint, for error messages."""
    latest = rundir.latest_checkpoint(out)
    return f"The last complete checkpoint is {latest}." if latest else "No checkpoint was saved yet."


def is_peer_failure(e: BaseException) -> bool:
    """A collective or point-to-point operation failed because a peer died or stopped answering
    (also inside a checkpoint save, which DCP reports as its own exception)."""
    return isinstance(e, dist.DistError) or any(s in str(e) for s in checkpoint.PEER_FAILURES)


def peer_failure_message(e: BaseException, ctx: DistContext, cfg: Config, heartbeat: Heartbeat | None) -> str:
    """The one line a rank prints when a peer failed: who went silent, at which step, where to resume."""
    silent = heartbeat.diagnose() if heartbeat else ""
    who = f"{silent} stopped responding" if silent else f"a peer failed ({str(e).splitlines()[0][:200]})"
    return (f"rank {ctx.rank} at step {faults.current_step()}: {who}; the job stops "
            f"(parallel.timeout_s = {cfg.parallel.timeout_s:g}). " + last_checkpoint(Path(cfg.out)))
