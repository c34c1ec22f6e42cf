"""torchrun's elastic agent for `dynmo train`, in a process of its own:

    python -m dynmo.launch.agent RUN_FOLDER TORCHRUN-ARGS     (`dynmo train` starts it; dynmo.launch)

It runs torchrun's own `run` on the arguments, with two differences a user sees only as speed
and quieter failures: the workers are forked from a fork server that imported `dynmo.train`
(and torch) once for the agent's lifetime (`WORKER_PRELOAD`; `dynmo.launch.WORKER_ARGS` asks
torchrun for `--start-method forkserver --run-path dynmo/train.py`), not each a fresh
interpreter importing them again, also at every restart; and a failed job is reported as the
line of the rank that failed first (`agent`), not as torchrun's report. At the end the fork
server is stopped and this process exits without the interpreter's teardown of torch (`_exit`),
which took over a second of every launch and did nothing. Import-light, and imported by no
other module: multiprocessing runs it again (as `__mp_main__`) in each worker.
"""

from __future__ import annotations

import collections
import logging
import sys

# What the fork server imports before it forks a worker (`dynmo.launch.WORKER_ARGS` makes
# torchrun start the workers this way).
WORKER_PRELOAD = ["dynmo.train"]


class _HeldLogs(logging.Handler):
    """Keeps torchrun's last log lines instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: collections.deque[str] = collections.deque(maxlen=200)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _hold_torch_logs() -> _HeldLogs:
    """Route torch.distributed's log records (torchrun's "Sending process ... SIGTERM", "failed
    (exitcode: 1)", ...) into a buffer: this process runs no training, only torchrun."""
    held = _HeldLogs()
    logger = logging.getLogger("torch.distributed")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.addHandler(held)
    logger.propagate = False
    return held


def _short_socket_folder() -> None:
    """The fork server listens on a Unix socket in multiprocessing's temporary folder, made once
    per process under TMPDIR; a socket's path holds at most 107 bytes, which a long TMPDIR passes
    ("AF_UNIX path too long"). Make that folder under /tmp then. The workers keep TMPDIR."""
    import os
    import tempfile
    from multiprocessing import util

    if len(tempfile.gettempdir()) <= 64 or not os.access("/tmp", os.W_OK):
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        util.get_temp_dir()  # kept for the process's life, removed at its exit
    finally:
        tempfile.tempdir = saved


def agent(argv: list[str]) -> int:
    """torchrun's elastic agent, run in this process: `python -m dynmo.launch.agent RUN_FOLDER
    TORCHRUN-ARGS`, which `dynmo train` starts instead of `python -m torch.distributed.run`.

    torchrun reports a failed worker with its own log lines and a ChildFailedError block of
    tracebacks, whatever the worker said. Here a failed job is reported as the line of the rank
    that failed first, from the record it left in torchrun's error file
    (`dynmo.runtime.failures.first_failure`), with that rank's exit status: 2 for bad input, 1
    for a failed run. torchrun's log lines are held back and shown only if torchrun itself
    fails (a rendezvous that cannot start, say), before its traceback."""
    import multiprocessing.forkserver
    import shutil
    import tempfile

    _short_socket_folder()
    multiprocessing.forkserver.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts
    # Start it now: it imports dynmo.train (and torch) while this process imports torchrun's
    # agent (torch too), one launch's two imports side by side instead of one after the other.
    multiprocessing.forkserver.ensure_running()

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    run_folder, rest = argv[0], argv[1:]
    held = _hold_torch_logs()
    logs = tempfile.mkdtemp(prefix="dynmo-torchrun-")  # the workers' error files; removed at the end
    try:
        torchrun.run(torchrun.parse_args([f"--log-dir={logs}", *rest]))
    except ChildFailedError as e:
        from dynmo.runtime.failures import first_failure

        text, status = first_failure(e.failures, run_folder)
        print(text, end="", file=sys.stderr, flush=True)
        return status
    except SignalException as e:  # a signal the launcher forwarded: the workers are stopped
        return 128 + int(e.sigval)
    except BaseException:
        print("\n".join(held.lines), file=sys.stderr)
        raise
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        _stop_fork_server()
    return 0


def _stop_fork_server() -> None:
    """End the fork server once torchrun has stopped the workers. Left to notice the agent's exit
    it would run the interpreter's teardown of everything `dynmo.train` imported (torch: most of
    a second), holding the job's stdout and stderr open all the while; it has nothing to clean up."""
    import os
    import signal
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _exit(status: int) -> None:
    """Exit with `status` after the exit handlers (multiprocessing's clean-up, logging's flush)
    but without the interpreter's teardown of torch's modules (about half a second), unless a
    thread is left that a normal exit would wait for."""
    import atexit
    import os
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: what a normal exit would only warn about
            pass
    os._exit(status)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m dynmo.launch.agent RUN_FOLDER TORCHRUN-ARGS (dynmo train starts it)")
    _exit(agent(sys.argv[1:]))
