"""Failures lose nothing: killed workers, hung ranks, full disks, signals, reused run folders.

Workers are killed for real (SIGKILL at a named point, `dynmo.runtime.faults`), stopped with
SIGSTOP, or cut off by killing a whole torchrun agent; every assertion is on what the run
leaves behind (losses, checkpoints, processes), never on how fast it ran.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, TINY, metrics, run_train

STEPS = 10
RUN = ["--steps", str(STEPS), "--checkpoint.every", "3", "--log.tensorboard", "false",
       "--parallel.relayout", "4:0,2,6", "--parallel.timeout_s", "30"]


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics(out)]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """The uninterrupted run every failure below must end up equal to."""
    out = tmp_path_factory.mktemp("reference")
    run_train(out, *RUN)
    return out


@pytest.fixture(scope="module")
def reference(reference_run) -> list[tuple[int, float]]:
    got = losses(reference_run)
    assert [s for s, _ in got] == list(range(STEPS))
    return got


class _Payload:
    """Unpickling this runs `open(marker, "w")`: what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_checkpoint_is_refused_before_launch_without_running_it(tmp_path, reference_run):
    import pickle
    import shutil

    ckpt = tmp_path / "downloaded"
    shutil.copytree(reference_run / "checkpoint-9", ckpt)
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    p = train(tmp_path / "run", "--checkpoint.resume", str(ckpt), "--steps", str(STEPS))
    assert p.returncode == 2, p.stderr[-2000:]
    assert "refusing to load it" in p.stderr and "Traceback" not in p.stderr
    assert not marker.exists()


def with_fault(spec: str) -> dict:
    return {"DYNMO_FAULT": spec}


def train(out: Path, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", "2", "--out", str(out), *TINY, *args]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                          capture_output=True, text=True, timeout=timeout)


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


# ---- automatic restart -----------------------------------------------------------------------

FAULTS = {
    # a worker dies at a step drawn from a fixed seed, mid-training
    "random-step": f"kill:step:{random.Random(14).randrange(4, STEPS)}:1",
    "migration": "kill:migration:4:0",  # the sender dies after shipping its first layer
    "checkpoint": "kill:checkpoint:6:0",  # shards written, completion marker not yet
}


@pytest.mark.parametrize("point", list(FAULTS))
def test_restart_finishes_with_the_losses_of_an_uninterrupted_run(tmp_path, reference, point):
    p = train(tmp_path, *RUN, "--max-restarts", "1", env=with_fault(FAULTS[point]))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "restart 1: resuming from" in p.stdout
    assert losses(tmp_path) == reference  # every step once, bitwise the same losses
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # the next save cleaned up


def test_without_restarts_a_kill_during_a_checkpoint_leaves_only_complete_ones(tmp_path, reference):
    p = train(tmp_path, *RUN, env=with_fault(FAULTS["checkpoint"]))
    assert p.returncode != 0
    assert checkpoints(tmp_path) == ["checkpoint-3"]  # checkpoint-6 was never put in place
    for name in checkpoints(tmp_path):
        assert (tmp_path / name / "dynmo.json").is_file()
    # a new run refuses the folder; resuming it continues the same trajectory
    refused = train(tmp_path, *RUN)
    assert refused.returncode == 2 and "--checkpoint.resume latest" in refused.stderr
    p = train(tmp_path, *RUN, "--checkpoint.resume", "latest")
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(tmp_path) == reference


# ---- run folders -------------------------------------------------------------------------------


def test_a_run_folder_is_never_overwritten_without_being_asked(tmp_path, reference_run):
    import shutil

    shutil.copytree(reference_run, tmp_path, dirs_exist_ok=True)  # a finished run with checkpoints
    assert checkpoints(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    before = (tmp_path / "metrics.jsonl").read_text()
    p = train(tmp_path, "--steps", "2")
    assert p.returncode == 2 and "is not empty" in p.stderr and "--overwrite" in p.stderr
    assert "Traceback" not in p.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == before
    p = train(tmp_path, "--steps", "2", "--overwrite", "--log.tensorboard", "false")
    assert p.returncode == 0, p.stderr[-3000:]
    assert [s for s, _ in losses(tmp_path)] == [0, 1]
    assert checkpoints(tmp_path) == []  # the old run's checkpoint went with it
    assert (tmp_path / "notes.txt").read_text() == "mine"  # files dynmo did not write stay


def test_resume_latest_needs_a_complete_checkpoint(tmp_path):
    (tmp_path / ".checkpoint-4.tmp").mkdir()
    p = train(tmp_path, "--checkpoint.resume", "latest")
    assert p.returncode == 2 and "holds no complete checkpoint" in p.stderr


def test_keep_removes_all_but_the_newest_checkpoints(tmp_path):
    run_train(tmp_path, "--steps", "6", "--checkpoint.every", "2", "--checkpoint.keep", "2",
              "--log.tensorboard", "false")
    assert checkpoints(tmp_path) == ["checkpoint-4", "checkpoint-6"]


# ---- bounded failure ---------------------------------------------------------------------------


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process (zombies aside): pid -> (parent pid, name)."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if rest[0] != "Z":
                found[int(d.name)] = (int(rest[1]), name)
    return found


def _job(launcher: int) -> dict[int, str]:
    """The launcher's process tree (launcher, torchrun's agent, its fork server, the workers):
    pid -> name. The workers live in sessions of their own, so the tree is the way to find them."""
    procs, job, todo = _processes(), {}, [launcher]
    while todo:
        pid = todo.pop()
        if pid in procs:
            job[pid] = procs[pid][1]
            todo += [child for child, (parent, _) in procs.items() if parent == pid]
    return job


def _rank_pid(launcher: int, rank: int) -> int | None:
    return next((pid for pid, name in _job(launcher).items() if name == f"dynmo-rank{rank}"), None)


def _start(out: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", "2", "--out", str(out), *TINY,
           "--log.tensorboard", "false", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_steps(out: Path, proc: subprocess.Popen, n: int, limit: float = 240) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps within {limit} s")


def _gone_within(pids, seconds: float) -> list[int]:
    """Those of `pids` still alive after up to `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end and set(pids) & set(_processes()):
        time.sleep(0.2)
    return sorted(set(pids) & set(_processes()))


@pytest.mark.parametrize("how", ["SIGTERM to the launcher", "SIGKILL to its process group"])
def test_no_process_outlives_a_killed_launcher(tmp_path, how):
    proc = _start(tmp_path, "--steps", "100000")
    job = {}
    try:
        _wait_for_steps(tmp_path, proc, 2)
        job = _job(proc.pid)
        assert sorted(n for n in job.values() if n.startswith("dynmo-rank")) == ["dynmo-rank0", "dynmo-rank1"]
        assert len(job) >= 5, job  # launcher, torchrun's agent, its fork server, two workers
        if how.startswith("SIGTERM"):
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGKILL)  # workers live in their own sessions: not in this group
        proc.wait(timeout=60)
        assert _gone_within(job, 30) == []
    finally:
        for pid in _gone_within(job, 0):
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_hung_rank_ends_the_job_naming_it(tmp_path):
    # the timeout is well above any healthy wait on a slow, busy machine; the stopped rank never answers
    proc = _start(tmp_path, "--steps", "100000", "--parallel.timeout_s", "15", "--checkpoint.every", "2")
    job = {}
    try:
        _wait_for_steps(tmp_path, proc, 3)
        job = _job(proc.pid)
        pid = _rank_pid(proc.pid, 1)
        assert pid is not None, job
        os.kill(pid, signal.SIGSTOP)
        _, err = proc.communicate(timeout=180)
        assert proc.returncode != 0
        assert re.search(r"rank 0 at step \d+: rank 1 stopped responding", err), err[-3000:]
        assert "The last complete checkpoint is" in err
        assert len(err.strip().splitlines()) <= 3 and "Traceback" not in err, err[-3000:]  # one line, not torchrun's
        assert _gone_within(job, 30) == []
    finally:
        for pid in _gone_within(job, 0):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_non_finite_loss_stops_training_with_the_checkpoints_intact(tmp_path):
    p = train(tmp_path, "--steps", "30", "--train.lr", "1e12", "--train.min_lr", "1e12", "--train.grad_clip", "0",
              "--train.warmup_steps", "0", "--checkpoint.every", "1", "--log.tensorboard", "false")
    assert p.returncode == 1, p.stderr[-3000:]  # the run failed (not bad input)
    # one line, from the first rank that stopped, not one per rank nor torchrun's report
    lines = p.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in lines if line.startswith("dynmo: error: rank ")]
    assert len(errors) == 1, p.stderr
    m = re.search(r"the loss is (nan|inf|-inf) \(gradient norm \S+\) at step (\d+)", errors[0])
    assert m, p.stderr[-3000:]
    step = int(m.group(2))
    assert checkpoints(tmp_path)[-1] == f"checkpoint-{step}"  # nothing saved from the bad step
    assert len(metrics(tmp_path)) == step
    kept = re.search(r"\(traceback: (\S+)\)$", errors[0])  # the full traceback, in the run folder
    assert kept and Path(kept.group(1)).parent == tmp_path / "errors", errors[0]
    assert "Diverged" in Path(kept.group(1)).read_text()


def test_a_full_disk_says_so_and_names_the_last_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        p = train(disk / "run", "--steps", "8", "--checkpoint.every", "1", "--log.tensorboard", "false")
        assert p.returncode != 0
        assert re.search(r"no space left on device while writing \S+checkpoint-\d+ \([\d.]+ MB free\); "
                         r"the last complete checkpoint is \S+checkpoint-\d+",
                         p.stderr), p.stderr[-3000:]
        for name in checkpoints(disk / "run"):
            assert json.loads((disk / "run" / name / "dynmo.json").read_text())["step"] == int(name.split("-")[1])
    finally:
        subprocess.run(["umount", "-l", str(disk)])


# ---- several agents: multi-node launch and elastic restart on fewer workers -----------------


def _agent(out: Path, nproc: int, port: int, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", str(nproc), "--nnodes", "1:2",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", out.name, "--out", str(out), *TINY,
           "--log.tensorboard", "false", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_listener(port: int, proc: subprocess.Popen, limit: float = 120) -> None:
    import socket

    end = time.monotonic() + limit
    while time.monotonic() < end:
        assert proc.poll() is None, proc.communicate()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port} after {limit} s")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_elastic_restart_on_the_surviving_agent(tmp_path):
    """Agents of 2 and 1 workers make a 3-stage pipeline; the second agent is killed for good
    after a checkpoint; the first restarts alone on 2 stages with a layout the balancer chose
    from the saved costs, and trains on the same trajectory as a resume from that checkpoint."""
    out, port = tmp_path / "run", _free_port()
    args = ["--steps", "16", "--checkpoint.every", "4", "--max-restarts", "2", "--parallel.timeout_s", "20"]
    first = _agent(out, 2, port, *args)
    _wait_for_listener(port, first)  # the first agent hosts the rendezvous: the one that survives
    second = _agent(out, 1, port, *args)
    try:
        end = time.monotonic() + 240
        while not (out / "checkpoint-4").is_dir():
            assert time.monotonic() < end and first.poll() is None, first.communicate()
            time.sleep(0.2)
        os.killpg(second.pid, signal.SIGKILL)  # the whole machine's agent, for good
        stdout, stderr = first.communicate(timeout=300)
    finally:
        for p in (first, second):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert first.returncode == 0, stderr[-3000:]
    assert "3 ranks (pp=3" in stdout
    resumed = re.search(r"restart \d+: resuming from (\S+)", stdout)
    assert resumed, stdout[-2000:]
    assert "resuming on 2 stages (saved on 3)" in stdout and "2 ranks (pp=2" in stdout
    start = json.loads((Path(resumed.group(1)) / "dynmo.json").read_text())["step"]
    got = losses(out)
    assert [s for s, _ in got] == list(range(16))
    # the same checkpoint resumed by a fresh 2-rank job gives the same losses
    ref = tmp_path / "ref"
    run_train(ref, "--steps", "16", "--checkpoint.resume", resumed.group(1), "--log.tensorboard", "false")
    assert [x for x in got if x[0] >= start] == losses(ref)
