import importlib.util
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI (CI=true) runs the property tests on a fixed sequence of examples, so a red CI is
# reproducible and not an unlucky draw; a developer's run keeps exploring new examples (and
# hypothesis saves any failure it finds to .hypothesis/ to replay next time).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")

ROOT = Path(__file__).resolve().parents[1]

# A tiny model that still exercises every mechanism; compute per step is milliseconds.
TINY = [
    "--model.n_layers", "4", "--model.d_model", "64", "--model.n_heads", "2", "--model.seq_len", "32",
    "--model.vocab_size", "512", "--train.global_batch", "8", "--train.microbatches", "4",
    "--train.warmup_steps", "2", "--log.tensorboard", "false", "--log.progress", "false",
]

# What a run of the tiny model with `--skew.blocks 0 --skew.factor 16 --skew.start_step 3`
# records, as injected costs (ms per microbatch, dynmo.runtime.faults): E t t t t L nearly
# balanced on `E t t | t t L` (9 vs 11 ms), then block 0 at ~3.5x a plain block from step 3,
# as a quiet machine measures it (19 vs 11 ms; `E t | t t t L` gives 15 vs 15). A test of what
# the controller decides on a skewed run reads these, never this machine's timing.
SKEWED_COSTS = {"DYNMO_COSTS": "0:1,4,4,4,4,3;3:1,14,4,4,4,3"}


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory, request):
    """One tokenizer cache per test session, shared with the torchrun subprocesses and, under
    pytest-xdist, among its workers (their base folders sit side by side; dynmo.data writes the
    cache by atomic renames, so workers preparing one corpus at once do not collide)."""
    if "DYNMO_CACHE" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        cache = (base.parent if hasattr(request.config, "workerinput") else base) / "dynmo-cache"
        cache.mkdir(exist_ok=True)
        os.environ["DYNMO_CACHE"] = str(cache)
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and "PYTHONPYCACHEPREFIX" not in os.environ:
        # Without written bytecode every process a test starts compiles dynmo's sources again (a
        # launch's launcher, agent and fork server: about 0.4 s of CPU); they share one cache for
        # the session instead, outside the checkout.
        base = tmp_path_factory.getbasetemp()
        os.environ.pop("PYTHONDONTWRITEBYTECODE")
        os.environ["PYTHONPYCACHEPREFIX"] = str((base.parent if hasattr(request.config, "workerinput") else base)
                                                / "pycache")
    yield


# Failures of the launcher or of gloo's sockets on a loaded machine, not of dynmo.
TRANSIENT = re.compile(r"Address already in use|EADDRINUSE|Connection reset by peer|Connection refused|"
                       r"RendezvousConnectionError|RendezvousTimeoutError|Socket Timeout")


def load_benchmark(name: str):
    """The script benchmarks/NAME.py as a module (registered, so its dataclasses find their module)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_train(out: Path, *args: str, nproc: int = 2, timeout: int = 300, check: bool = True,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`dynmo train` on the tiny model; `env` adds variables (the test injections of
    dynmo.runtime.faults, e.g. DYNMO_COSTS)."""
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", str(nproc), "--out", str(out), *TINY, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    fresh = not Path(out).exists() or not any(Path(out).iterdir())
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 and TRANSIENT.search(p.stderr):
        print(f"transient launcher failure, retrying once:\n{p.stderr[-2000:]}", file=sys.stderr)
        if fresh and Path(out).is_dir():
            shutil.rmtree(out)  # what the failed attempt wrote; a new run refuses a non-empty folder
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"dynmo train failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


# What the processes of `spawn` import before they fork: a fresh interpreter per process would
# import torch again (seconds each); the fork server does it once per test session, and it has
# run no torch op, so no OpenMP thread pool is copied into a child.
SPAWN_PRELOAD = ["torch", "torch.distributed", "dynmo.model.layers", "dynmo.runtime.experts"]


def spawn(fn, args: tuple, nprocs: int) -> None:
    """`torch.multiprocessing.spawn`, started from a fork server: each process runs
    fn(rank, *args) in a child of its own (gloo tests of a few processes)."""
    import multiprocessing.forkserver

    import torch.multiprocessing as mp

    multiprocessing.forkserver.set_forkserver_preload(SPAWN_PRELOAD)  # read when the server starts
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def param_counts(model: dict) -> list[int]:
    """Parameters per layer of the model a `[model]` config section (a dict) describes."""
    from dynmo.config import Config, apply_dict
    from dynmo.model.layers import layer_param_counts

    cfg = Config()
    apply_dict(cfg, {"model": model})
    return layer_param_counts(cfg.model)
