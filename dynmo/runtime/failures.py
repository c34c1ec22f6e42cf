"""What a worker does when the run fails or restarts: every failure path of `dynmo.train` in one place.

- a worker dies with its launcher (`die_with_parent`), so a killed `dynmo train` leaves no
  worker training on alone;
- a job restarted by torchrun resumes from the newest complete checkpoint that passes the
  checks (`restart_resume`, `restart_line`);
- rank 0 decides whether the run folder may be written and tells every rank (`folder_verdict`);
  `--overwrite` clears the old run only once the new one has loaded what it needs
  (`replace_old_run`), so a run refused while loading leaves the folder as it was;
- a non-finite loss stops every rank at the same step (`Diverged`);
- a peer that died or stopped answering is named in one line (`peer_failure_message`);
- any failure becomes one line naming the rank and what to do (`describe`) and is reported
  (`report`): the full traceback goes to a file (`RUN/errors/rank-N.txt` once the run writes its
  folder; a temporary file before that, so a refused run changes nothing in `--out`), and a
  record to torchrun's error file (`TORCHELASTIC_ERROR_FILE`). Under `dynmo train` the workers
  print nothing: the launcher's agent prints the line of the rank that failed first
  (`first_failure`). Exit status 2 for bad input (a file or setting to fix), 1 for a failed run.

Fault injection for the tests lives beside this in `dynmo.runtime.faults`, the heartbeat that
names a silent peer in `dynmo.runtime.watch`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dynmo import rundir
from dynmo.config import Config, ConfigError
from dynmo.data import DataError
from dynmo.model.hf import HFCheckpointError
from dynmo.runtime import checkpoint, faults
from dynmo.runtime.dist import DistContext
from dynmo.runtime.safeload import CheckpointError
from dynmo.runtime.watch import Heartbeat

BAD_INPUT, FAILED = 2, 1  # exit statuses: a file or setting the user can fix; the run itself failed


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


def detach(rank: int) -> None:
    """A worker of `dynmo train` (forked from its agent's fork server): a session of its own, as
    torchrun gives the workers it starts as commands, so a terminal's ^C reaches the launcher
    (which stops the job in order) and not every worker at once; and the process name
    `dynmo-rank<N>` (Linux: what `top`, `ps -o comm` and `pgrep` show)."""
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(15, f"dynmo-rank{rank}".encode()[:15])  # PR_SET_NAME
        except (OSError, AttributeError):
            pass


def restart_resume(cfg: Config) -> int:
    """After torchrun restarted the job (`dynmo train --max-restarts N`), resume from the newest
    complete checkpoint in the run folder that passes the checks (`checkpoint.resume = latest`,
    which `dynmo.checks.validate` resolves), if there is one. Returns the restart count."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and rundir.latest_checkpoint(Path(cfg.out)) is not None:
        cfg.checkpoint.resume = rundir.LATEST
    return restart


def restart_line(restart: int, cfg: Config) -> str:
    """What rank 0 says after a restart: where it resumes, and why the last attempt stopped."""
    where = f"resuming from {cfg.checkpoint.resume}" if cfg.checkpoint.resume else "starting over from step 0"
    cause = _previous_failure(restart)
    return f"restart {restart}: {where}" + (f" (the last attempt stopped: {cause})" if cause else "")


def _previous_failure(restart: int) -> str:
    """The line of the first failing rank of the attempt before this one, from torchrun's error
    files on this machine (`<log dir>/<run>/attempt_<k>/<local rank>/error.json`); "" if none."""
    mine = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not mine or restart < 1:
        return ""
    previous = Path(mine).parent.parent.with_name(f"attempt_{restart - 1}")
    records = [r for f in sorted(previous.glob("*/error.json")) if (r := _record(_read_json(f)))]
    return min(records, key=lambda r: r["time_ns"])["line"] if records else ""


def folder_verdict(cfg: Config, ctx: DistContext, restart: int) -> str:
    """Rank 0 checks the run folder (a new run never writes over an old one) and tells all."""
    verdict = [""]
    if ctx.rank == 0 and not restart:
        try:
            rundir.check_run_folder(cfg.out, cfg.checkpoint.resume, cfg.overwrite)
        except ConfigError as e:
            verdict = [str(e)]
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def replace_old_run(cfg: Config, ctx: DistContext, restart: int) -> None:
    """`--overwrite`: rank 0 removes what the earlier run wrote, once this run has loaded its
    checkpoint and weights; a run refused while loading leaves the folder as it was. The other
    ranks write nothing into the folder before rank 0 does (a save starts with a barrier)."""
    if cfg.overwrite and not restart and ctx.rank == 0:
        rundir.clear_run(cfg.out)


def last_checkpoint(out: Path) -> str:
    """One sentence naming the newest complete checkpoint, for error messages."""
    latest = rundir.latest_checkpoint(out)
    return f"The last complete checkpoint is {latest}." if latest else "No checkpoint was saved yet."


def is_peer_failure(e: BaseException) -> bool:
    """A collective or point-to-point operation failed because a peer died or stopped answering
    (also inside a checkpoint save, which DCP reports as its own exception)."""
    return isinstance(e, dist.DistError) or any(s in str(e) for s in checkpoint.PEER_FAILURES)


def peer_failure_message(e: BaseException, rank: int, cfg: Config, heartbeat: Heartbeat | None) -> str:
    """The one line a rank prints when a peer failed: who went silent, at which step, where to resume."""
    silent = heartbeat.diagnose() if heartbeat else ""
    who = f"{silent} stopped responding" if silent else f"a peer failed ({_first_line(e)})"
    return (f"rank {rank} at step {faults.current_step()}: {who}; the job stops "
            f"(parallel.timeout_s = {cfg.parallel.timeout_s:g}). " + last_checkpoint(Path(cfg.out)))


# ---- one line per failure --------------------------------------------------------------------
@dataclass
class Failure:
    status: int  # BAD_INPUT or FAILED
    line: str  # one line: the rank, what happened, what to do
    expected: bool = True  # one of dynmo's own errors; an unexpected one shows its traceback


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def describe(e: BaseException, rank: int, cfg: Config | None = None, heartbeat: Heartbeat | None = None) -> Failure:
    """The failure `e` of rank `rank` as an exit status and one line. Bad input (status 2): the
    config, a checkpoint or Hugging Face file that cannot be read, the data. A failed run
    (status 1): divergence, a checkpoint that cannot be written, a peer that died or went
    silent, and anything unexpected (whose traceback is shown)."""
    if isinstance(e, ConfigError):
        return Failure(BAD_INPUT, str(e))  # the same config on every rank: no rank to name
    if isinstance(e, CheckpointError):
        return Failure(BAD_INPUT, f"rank {rank}: {e}; resume from another checkpoint, or copy this one again")
    if isinstance(e, (HFCheckpointError, DataError)):
        return Failure(BAD_INPUT, f"rank {rank}: {e}")
    if isinstance(e, (Diverged, checkpoint.CheckpointWriteError)):
        return Failure(FAILED, f"rank {rank}: {e}")
    if cfg is not None and is_peer_failure(e):
        return Failure(FAILED, peer_failure_message(e, rank, cfg, heartbeat))
    return Failure(FAILED, f"rank {rank}: unexpected {type(e).__name__}: {_first_line(e)}; please report it with "
                           "its traceback", expected=False)


def report(e: BaseException, failure: Failure, rank: int, run_folder: Path | None = None, show: bool = True) -> int:
    """Keep the traceback, leave the record the launcher reads, and print the line if `show`
    (no dynmo launcher will print it) or if no record could be written; returns the exit status.

    The traceback goes into `run_folder/errors/rank-N.txt` for a failed run whose folder is in
    use (`run_folder`), else into a temporary file: a refused run (status 2) changes nothing
    in `--out`. A config error has no traceback worth keeping."""
    text = "".join(traceback.format_exception(e))
    kept = None if isinstance(e, ConfigError) else keep_traceback(
        text, rank, run_folder if failure.status == FAILED else None)
    line = failure.line + (f" (traceback: {kept})" if kept else "")
    shown_traceback = None if failure.expected else text
    temporary = kept if kept is not None and kept.parent == Path(tempfile.gettempdir()) else None
    recorded = _write_record(failure.status, line, shown_traceback, temporary)
    if show or not recorded:
        print(f"{shown_traceback or ''}dynmo: error: {line}\n", end="", file=sys.stderr, flush=True)
    return failure.status


def keep_traceback(text: str, rank: int, run_folder: Path | None) -> Path | None:
    """Write `text` to `run_folder/errors/rank-N.txt`, or to a temporary file without a run
    folder or when that fails (a full disk); the path, or None if nothing could be written."""
    if run_folder is not None:
        try:
            path = run_folder / "errors" / f"rank-{rank}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return path
        except OSError:
            pass
    try:
        fd, name = tempfile.mkstemp(prefix=f"dynmo-rank{rank}-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    except OSError:
        return None


def _write_record(status: int, line: str, shown_traceback: str | None, temporary: Path | None) -> bool:
    """torchrun's error file for this worker, in torchrun's format (its own report shows the
    line, or the traceback of an unexpected error) plus dynmo's record under "dynmo" (with the
    temporary traceback file, which the launcher removes unless it names it). Written whole and
    renamed into place: torchrun reads it as soon as this process exits, and may stop a
    process mid-write. False without an error file (not under torchrun) or when it fails."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    now = time.time_ns()
    data = {"message": {"message": line, "extraInfo": {"py_callstack": shown_traceback or line,
                                                       "timestamp": str(now // 10**9)}},
            "dynmo": {"status": status, "line": line, "traceback": shown_traceback, "time_ns": now,
                      "temporary": str(temporary) if temporary else None}}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        Path(tmp).write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        return False
    return True


# ---- the launcher's side ---------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _record(data: Any) -> dict | None:
    """dynmo's record in a torchrun error file, or None (no file, or not written by dynmo)."""
    rec = data.get("dynmo") if isinstance(data, dict) else None
    ok = (isinstance(rec, dict) and isinstance(rec.get("line"), str) and rec.get("status") in (BAD_INPUT, FAILED)
          and type(rec.get("time_ns")) is int and isinstance(rec.get("traceback"), (str, type(None))))
    return rec if ok else None


def _discard(temporary: Any) -> None:
    """Remove a temporary traceback file no line names (one of a rank that failed after the first)."""
    if isinstance(temporary, str) and Path(temporary).parent == Path(tempfile.gettempdir()) \
            and Path(temporary).name.startswith("dynmo-rank"):
        Path(temporary).unlink(missing_ok=True)


def _sibling_records(failed: dict[int, Any]) -> list[dict]:
    """dynmo's records in the error files of this attempt's other workers on this machine
    (`<log dir>/<run>/attempt_<n>/<local rank>/error.json`). torchrun lists every worker that
    failed when it starts them as commands, but only the first it joined when it forks them
    (multiprocessing), though another may have failed first and left its record."""
    named = {str(Path(f.error_file)) for f in failed.values() if getattr(f, "error_file", None)}
    found = []
    for attempt in {Path(path).parent.parent for path in named}:
        for path in sorted(attempt.glob("*/error.json")):
            if str(path) not in named and (rec := _record(_read_json(path))):
                found.append(rec)
    return found


def first_failure(failed: dict[int, Any], run_folder: str | None = None) -> tuple[str, int]:
    """What `dynmo train` prints when torchrun's job failed, and its exit status. `failed`:
    global rank -> torchrun's `ProcessFailure` (its `error_file_data` is the rank's error file).

    The rank whose record is oldest failed first: its line, after its traceback for an
    unexpected error, and its status; the other ranks' temporary traceback files are removed.
    The ranks torchrun stopped after it (SIGTERM) left no record. Without any record (a rank
    killed by a signal, or crashed in native code), the first failure torchrun saw that it
    did not cause itself is named, status 1."""
    records = [(rec["time_ns"], rank, rec) for rank, f in failed.items() if (rec := _record(f.error_file_data))]
    records += [(rec["time_ns"], -1, rec) for rec in _sibling_records(failed)]
    if records:
        _, _, rec = min(records)
        for _, _, other in records:
            if other is not rec:
                _discard(other.get("temporary"))
        return f"{rec['traceback'] or ''}dynmo: error: {rec['line']}\n", rec["status"]
    # torchrun SIGTERMs the others once one failed; of the rest, the first it saw (dict order)
    own = {r: f for r, f in failed.items() if f.exitcode != -signal.SIGTERM} or failed
    rank = min(own, key=lambda r: own[r].timestamp)
    f = failed[rank]
    how = f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit status {f.exitcode}"
    where = f" {last_checkpoint(Path(run_folder))}" if run_folder else ""
    line = (f"dynmo: error: rank {rank} ended with {how} without a message (killed from outside, out of memory, "
            f"or a crash in native code); the job stops.{where}\n")
    return line, FAILED
