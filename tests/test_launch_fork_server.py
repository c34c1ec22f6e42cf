"""The workers' fork server of `dynmo train`'s agent is a fork of the agent after its imports
(dynmo.launch.agent._start_fork_server): it must hold what a fresh one would (its socket, the
read end of the pipe that says its clients are gone, stdio) and nothing the agent opened for
multiprocessing after the imports, so that it ends when the agent dies; and what it forks must
have the imports and a usable multiprocessing."""

import subprocess
import sys
import time

from tests.conftest import ROOT

SCRIPT = r'''
import json, os, sys
import multiprocessing as mp
from multiprocessing import forkserver
from dynmo.launch import agent

def report(conn):
    conn.send({"preloaded": "dynmo.train" in sys.modules,
               "lock_free": not forkserver._forkserver._lock.locked(),
               "parent": os.getppid()})
    conn.close()

if __name__ == "__main__":
    agent._start_fork_server()
    server = forkserver._forkserver
    ctx = mp.get_context("forkserver")
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=report, args=(w,))
    p.start()
    got = r.recv()
    p.join()
    alive_w = os.readlink(f"/proc/self/fd/{server._forkserver_alive_fd}")
    held = sorted(os.readlink(f"/proc/{server._forkserver_pid}/fd/{fd}")
                  for fd in os.listdir(f"/proc/{server._forkserver_pid}/fd"))
    print(json.dumps({**got, "server": server._forkserver_pid, "alive_w": alive_w, "held": held,
                      "forked": got["parent"] == server._forkserver_pid}), flush=True)
    sys.stdin.read()  # held open until the test kills this process
'''


def test_the_fork_server_forked_from_the_agent_holds_only_its_own_ends_and_dies_with_it():
    import json

    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        got = json.loads(line)
        assert got["preloaded"] and got["lock_free"] and got["forked"], got
        # The agent's write end of the "alive" pipe is not held by the server (else it never
        # sees the agent go); the server holds the read end of that same pipe.
        assert got["alive_w"].startswith("pipe:") and got["alive_w"] in got["held"], got
        assert got["held"].count(got["alive_w"]) == 1, got  # its read end, the only end it holds
        server = got["server"]
        proc.kill()
        proc.wait(timeout=30)
        end = time.monotonic() + 30
        while time.monotonic() < end and _alive(server):
            time.sleep(0.1)
        assert not _alive(server), "the fork server outlived its agent"
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
