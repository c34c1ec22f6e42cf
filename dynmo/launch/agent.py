"""torchrun's elastic agent for `dynmo train`, in a process of its own:

    python -m dynmo.launch.agent RUN_FOLDER TORCHRUN-ARGS     (`dynmo train` starts it; dynmo.launch)

It runs torchrun's own `run` on the arguments, with two differences a user sees only as speed
and quieter failures: the workers are forked from a fork server that holds `dynmo.train`
(and torch) imported for the agent's lifetime (`WORKER_PRELOAD`; `dynmo.launch.WORKER_ARGS` asks
torchrun for `--start-method forkserver --run-path dynmo/train.py`), not each a fresh
interpreter importing them again, also at every restart; the fork server is itself a fork of
this process once it has imported them (`_start_fork_server`), so a launch imports torch once,
not in the agent and again in a fresh fork server; and a failed job is reported as the line of
the rank that failed first (`agent`), not as torchrun's report. At the end the fork server is
stopped and this process exits without the interpreter's teardown of torch (`_exit`), which
took over a second of every launch and did nothing. Imported by no other module:
multiprocessing runs it again (as `__mp_main__`) in a worker whose fork server it did not start.
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
    import shutil
    import tempfile

    _short_socket_folder()
    _start_fork_server()

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


def _start_fork_server() -> None:
    """Start the workers' fork server as a fork of this process after it has imported
    `WORKER_PRELOAD`, before torchrun starts any thread here: multiprocessing's own start runs a
    fresh interpreter that imports them again (torch: 2-3 s of CPU, a second import beside the one
    torchrun's agent needs here). multiprocessing still does the rest (its socket, the pipe that
    tells the server its clients are gone, the resource tracker, which is forked too): only its
    `spawnv_passfds` is replaced, for this call, by `_fork_running`. Where the import fails, or
    the process's open files cannot be listed (no /proc), the fork server starts as
    multiprocessing starts it, and imports what it can."""
    import importlib
    import multiprocessing.forkserver
    from multiprocessing import util

    multiprocessing.forkserver.set_forkserver_preload(WORKER_PRELOAD)  # read when the server starts
    try:
        for name in WORKER_PRELOAD:
            importlib.import_module(name)
        inherited = _open_descriptors()
    except (ImportError, OSError):  # a worker reports a failed import; no /proc: start it afresh
        multiprocessing.forkserver.ensure_running()
        return
    started = util.spawnv_passfds
    util.spawnv_passfds = lambda path, args, passfds: _fork_running(args, passfds, inherited)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        util.spawnv_passfds = started


def _fork_running(args: list[str], passfds, inherited: set[int]) -> int:
    """What `multiprocessing.util.spawnv_passfds(exe, args, passfds)` does for `python -c CODE`,
    in a fork of this process instead of a new interpreter: the child keeps the descriptors
    `passfds` and those open before multiprocessing made its own (`inherited`: stdio and what
    the imports opened), closes the others as an exec'd child's would be (the "alive" pipe's
    write end among them: the fork server must see it close when this process dies), and runs
    CODE. Returns the child's pid."""
    import os
    import warnings

    code = args[args.index("-c") + 1]
    with warnings.catch_warnings():  # 3.12+ warns of fork in a threaded process (BLAS's pool: fork-safe)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        import threading
        from multiprocessing import forkserver

        # Taken by the ensure_running that forked this child, which will not release it here: a
        # worker that starts a process by forkserver (a data loader's, say) would wait on it.
        forkserver._forkserver._lock = threading.Lock()
        keep = inherited | set(passfds)
        for fd in _open_descriptors() - keep:
            os.close(fd)
        exec(code, {"__name__": "__main__"})
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(status)


def _open_descriptors() -> set[int]:
    """This process's open file descriptors (Linux): the listing's own one is closed again by the
    time it is read, and left out, so that a pipe opened later under its number is not taken for
    one open before."""
    import os

    listed = {int(fd) for fd in os.listdir("/proc/self/fd")}
    out = set()
    for fd in listed:
        try:
            os.fstat(fd)
        except OSError:
            continue
        out.add(fd)
    return out


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
