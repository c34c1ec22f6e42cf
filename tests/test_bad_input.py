"""Bad input gets a clear error before any work (the launcher never starts torchrun)."""

import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, TINY, run_train


def dynmo_train(tmp_path, *args, nproc=2):
    cmd = [sys.executable, "-m", "dynmo.cli", "train", "--nproc", str(nproc), "--out", str(tmp_path), *TINY, *args]
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return p, time.perf_counter() - t


@pytest.mark.parametrize(
    "args,nproc,message",
    [
        (["--parallel.layout", "0,3,9"], 2, "covers 9 layers but the model has 6"),  # misses a layer
        (["--parallel.layout", "0,3,3,6"], 3, "stage 1 of layout [0, 3, 3, 6] is empty"),  # empty stage
        (["--parallel.layout", "0,4,3,6"], 3, "empty or reversed"),  # repeats layer 3
        (["--parallel.layout", "3+4"], 2, "covers 7 layers"),  # repeats a layer via sizes
        (["--parallel.layout", "0,6"], 2, "has 1 stages but the pipeline has 2"),
        (["--parallel.layout", "zero,six"], 2, "cannot parse layout"),
        ([], 7, "7 pipeline stages but only 6 layers"),
        (["--train.global_batch", "10"], 2, "not divisible into train.microbatches=4"),
        (["--parallel.dp", "2", "--train.global_batch", "9"], 2, "not divisible by parallel.dp=2"),
        (["--parallel.schedule", "pipedream"], 2, "unknown schedule 'pipedream'"),
        (["--data.paths", "/no/such/file.txt"], 2, "data path '/no/such/file.txt' does not exist"),
        (["--parallel.schedule", "zbv"], 2, "zbv needs parallel.virtual_stages = 2"),
        (["--parallel.virtual_stages", "2"], 2, "runs one stage per rank"),
        (["--parallel.relayout", "5-0,3,6"], 2, "must look like STEP:LAYOUT"),
        (["--model.d_model", "65"], 2, "divisible by model.n_heads"),
        (["--train.stepz", "3"], 2, "unknown field train.stepz"),
        (["--checkpoint.resume", "/no/such/ckpt"], 2, "not a dynmo checkpoint"),
        (["--model.block", "mod", "--model.mod.capacities", "1;0.5"], 2, "give one per block"),
        (["--model.block", "hashattn", "--model.hashattn.chunk", "5"], 2, "must divide model.seq_len"),
        (["--model.block", "moe", "--model.moe.top_k", "9"], 2, "must be in 1..model.moe.num_experts"),
        (["--balance.repack", "true"], 2, "needs a controller"),
        (["--balance.speeds", "1.0"], 2, "one positive speed per pipeline rank"),
        (["--balance.when", "dynamism"], 2, "none is enabled; use balance.when = auto"),
    ],
)
def test_bad_input_fails_fast_with_a_clear_message(tmp_path, args, nproc, message):
    p, seconds = dynmo_train(tmp_path, *args, nproc=nproc)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_config_file(tmp_path):
    p, _ = dynmo_train(tmp_path, "--config", "configs/nope.toml")
    assert p.returncode == 2 and "config file 'configs/nope.toml' not found" in p.stderr


def test_torchrun_entry_rejects_bad_input_without_hanging(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dynmo.train", *TINY, "--out", str(tmp_path), "--train.global_batch", "10"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "not divisible into train.microbatches=4" in p.stderr


@pytest.mark.dist
def test_checkpoint_of_a_different_model_shape(tmp_path):
    run_train(tmp_path / "a", "--steps", "1", "--checkpoint.final", "true")
    p, _ = dynmo_train(tmp_path / "b", "--checkpoint.resume", str(tmp_path / "a" / "checkpoint-final"),
                       "--model.d_model", "32")
    assert p.returncode == 2
    assert "different shape" in p.stderr and "model.d_model: checkpoint 64 vs config 32" in p.stderr
