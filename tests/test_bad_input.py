"""Bad input gets a clear error before any work (the launcher never starts torchrun).

Most cases call the launcher's `main` in this process (it returns before torchrun would
start, so a subprocess adds only Python's start-up); `test_the_launcher_process_rejects_bad_input`
runs the real `dynmo train` process on a few of them.
"""

import contextlib
import io
import json
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, TINY, run_train


def dynmo_train(tmp_path, *args, nproc=2, process=False):
    argv = ["train", "--nproc", str(nproc), "--out", str(tmp_path), *TINY, *args]
    t = time.perf_counter()
    if process:
        p = subprocess.run([sys.executable, "-m", "dynmo.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    else:
        from dynmo import cli

        out, err = io.StringIO(), io.StringIO()
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
        p = subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    return p, time.perf_counter() - t


@pytest.mark.parametrize("args,message", [
    (["--parallel.layout", "0,3,9"], "covers 9 layers but the model has 6"),
    (["--train.lr", "nan"], "train.lr=nan is not a finite number"),
    (["--checkpoint.resume", "/no/such/ckpt"], "not a dynmo checkpoint"),
])
def test_the_launcher_process_rejects_bad_input(tmp_path, args, message):
    p, _ = dynmo_train(tmp_path, *args, process=True)
    assert_rejected(p, tmp_path, message)


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
        (["--model.block", "hashattn", "--model.hashattn.kernel", "fast"], 2, "is not one of auto, staircase, flex"),
        (["--model.block", "hashattn", "--model.hashattn.kernel", "flex", "--parallel.backend", "gloo"], 2,
         "cannot train on cpu: FlexAttention has no backward there; use kernel='staircase' or 'auto'"),
        (["--model.block", "hashattn", "--model.hashattn.kernel", "staircase", "--parallel.backend", "nccl"], 2,
         "'staircase' runs on CPU only"),
        (["--model.block", "moe", "--model.moe.top_k", "9"], 2, "must be in 1..model.moe.num_experts"),
        (["--model.block", "moe", "--model.moe.dispatch", "sorted"], 2,
         "model.moe.dispatch='sorted' is not one of grouped, padded"),
        (["--balance.repack", "true"], 2, "needs a controller"),
        (["--balance.speeds", "1.0"], 2, "one positive speed per pipeline rank"),
        (["--balance.when", "dynamism"], 2, "none is enabled; use balance.when = auto"),
        # numbers: finite and in their range
        (["--train.lr", "nan"], 2, "train.lr=nan is not a finite number"),
        (["--train.lr", "-1"], 2, "train.lr=-1 must be >= 0"),
        (["--train.grad_clip", "nan"], 2, "train.grad_clip=nan is not a finite number"),
        (["--train.grad_clip", "-1"], 2, "train.grad_clip=-1 must be >= 0"),
        (["--train.warmup_steps", "-1"], 2, "train.warmup_steps=-1 must be >= 0"),
        (["--train.min_lr", "0.01"], 2, "train.min_lr=0.01 must be in [0, 0.0003]"),
        (["--train.weight_decay", "-0.1"], 2, "train.weight_decay=-0.1 must be >= 0"),
        (["--train.beta1", "1"], 2, "train.beta1=1 must be in [0, 1)"),
        (["--train.beta2", "inf"], 2, "train.beta2=inf is not a finite number"),
        (["--train.eval_every", "-1"], 2, "train.eval_every=-1 must be >= 0"),
        (["--train.eval_batches", "0"], 2, "train.eval_batches=0 must be >= 1"),
        (["--train.seed", "-1"], 2, "train.seed=-1 must be in [0, 4294967295]"),
        (["--data.val_fraction", "2"], 2, "data.val_fraction=2 must be in [0, 1)"),
        (["--model.dropout", "1"], 2, "model.dropout=1 must be in [0, 1)"),
        (["--model.block", "moe", "--model.moe.aux_loss_coef", "-1"], 2, "model.moe.aux_loss_coef=-1 must be >= 0"),
        (["--model.block", "mod", "--model.mod.predictor_loss_coef", "nan"], 2,
         "model.mod.predictor_loss_coef=nan is not a finite number"),
        (["--log.every", "0"], 2, "log.every=0 must be >= 1"),
        (["--balance.min_gain", "1.5"], 2, "balance.min_gain=1.5 must be in [0, 1)"),
        (["--balance.horizon", "0"], 2, "balance.horizon=0 must be >= 1"),
        (["--balance.memory_gb", "nan"], 2, "balance.memory_gb=nan is not a finite number"),
        (["--balance.speeds", "1;nan"], 2, "balance.speeds=[1.0, nan]: nan is not a finite number"),
        (["--skew.factor", "0"], 2, "skew.factor=0 must be >= 1"),
        (["--prune.enabled", "true", "--prune.final_sparsity", "1"], 2, "must be in [0, 1)"),
        (["--noise.enabled", "true", "--noise.jitter", "nan"], 2, "noise.jitter=nan is not a finite number"),
        (["--freeze.enabled", "true", "--freeze.tolerance", "inf"], 2, "freeze.tolerance=inf is not a finite number"),
        (["--parallel.pp", "-2"], 2, "parallel.pp=-2 must be >= 0"),
        (["--parallel.backend", "mpi"], 2, "unknown parallel.backend 'mpi'"),
        (["--parallel.timeout_s", "0"], 2, "parallel.timeout_s=0 must be > 0"),
        (["--parallel.timeout_s", "nan"], 2, "parallel.timeout_s=nan is not a finite number"),
        (["--checkpoint.keep", "-1"], 2, "checkpoint.keep=-1 must be >= 0"),
        (["--checkpoint.every", "-1"], 2, "checkpoint.every=-1 must be >= 0"),
        # forced re-layouts: one per step, at a step the run trains
        (["--parallel.relayout", "2:0,2,6;2:0,4,6"], 2, "step 2 already has a re-layout"),
        (["--steps", "4", "--parallel.relayout", "4:0,2,6"], 2, "step 4 is not a step of the run (steps 0..3"),
        (["--parallel.relayout", "-1:0,2,6"], 2, "step -1 is not a step of the run"),
    ],
)
def test_bad_input_fails_fast_with_a_clear_message(tmp_path, args, nproc, message):
    p, seconds = dynmo_train(tmp_path, *args, nproc=nproc)
    assert_rejected(p, tmp_path, message)


def assert_rejected(p, out, message):
    """Exit 2 with one line naming the problem, before torchrun started (no metrics)."""
    assert p.returncode == 2, p.stderr
    assert message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (out / "metrics.jsonl").exists()


def test_out_naming_an_existing_file(tmp_path):
    f = tmp_path / "run.txt"
    f.write_text("not a folder")
    p, _ = dynmo_train(tmp_path, "--out", str(f))
    assert_rejected(p, tmp_path, f"out={str(f)!r} is an existing file, not a folder")
    p, _ = dynmo_train(tmp_path, "--out", str(f / "run"))
    assert_rejected(p, tmp_path, f"{f} is a file, so nothing can be created under it")


def test_new_options_are_accepted(tmp_path):
    """Valid values of the newer options pass the checks (shown by failing on a later, unrelated check)."""
    p, _ = dynmo_train(tmp_path, "--parallel.timeout_s", "60", "--checkpoint.keep", "2", "--train.global_batch", "10")
    assert_rejected(p, tmp_path, "not divisible into train.microbatches=4")


def test_missing_config_file(tmp_path):
    p, _ = dynmo_train(tmp_path, "--config", "configs/nope.toml")
    assert p.returncode == 2 and "config file 'configs/nope.toml' not found" in p.stderr


def test_torchrun_entry_rejects_bad_input_without_hanging(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "dynmo.train", *TINY, "--out", str(tmp_path), "--train.global_batch", "10"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "not divisible into train.microbatches=4" in p.stderr


# ---- checkpoints ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One real checkpoint of the tiny dense GPT, at step 2."""
    out = tmp_path_factory.mktemp("ckpt-run")
    run_train(out, "--steps", "2", "--checkpoint.final", "true")
    return out / "checkpoint-final"


def edited(checkpoint, folder, edit=None, text=None):
    """A copy of the checkpoint's records (dynmo.json, config.toml; the launcher reads no shards)
    with dynmo.json edited: `edit(meta)` changes the dict in place, `text` replaces the file."""
    folder.mkdir(parents=True)
    for name in ("dynmo.json", "config.toml"):
        shutil.copy(checkpoint / name, folder / name)
    if text is not None:
        (folder / "dynmo.json").write_text(text)
    if edit is not None:
        meta = json.loads((checkpoint / "dynmo.json").read_text())
        edit(meta)
        (folder / "dynmo.json").write_text(json.dumps(meta))
    return folder


@pytest.mark.dist
def test_checkpoint_of_a_different_model_shape(tmp_path, checkpoint):
    p, _ = dynmo_train(tmp_path, "--checkpoint.resume", str(checkpoint), "--model.d_model", "32")
    assert_rejected(p, tmp_path, "model.d_model: checkpoint 64 vs config 32")
    assert "different shape" in p.stderr


@pytest.mark.dist
@pytest.mark.parametrize("args,message", [
    (["--model.block", "hashattn"], "model.block: checkpoint dense vs config hashattn"),
    (["--model.block", "moe"], "model.block: checkpoint dense vs config moe"),
    (["--model.block", "mod"], "model.block: checkpoint dense vs config mod"),
    (["--model.family", "llama"], "model.family: checkpoint gpt vs config llama"),
    (["--model.family", "mixtral", "--model.block", "moe"], "model.family: checkpoint gpt vs config mixtral"),
    (["--model.tie_embeddings", "true"], "model.tie_embeddings: checkpoint false vs config true"),
    (["--model.n_layers", "6"], "model.n_layers: checkpoint 4 vs config 6"),
])
def test_checkpoint_of_different_blocks(tmp_path, checkpoint, args, message):
    p, _ = dynmo_train(tmp_path, "--checkpoint.resume", str(checkpoint), *args)
    assert_rejected(p, tmp_path, message)


def _as(**model):
    def edit(meta):
        for k, v in model.items():
            if isinstance(v, dict):
                meta["model"][k].update(v)
            else:
                meta["model"][k] = v
    return edit


@pytest.mark.dist
@pytest.mark.parametrize("saved,args,message", [
    (dict(block="moe"), ["--model.block", "moe", "--model.moe.num_experts", "4"],
     "model.moe.num_experts: checkpoint 8 vs config 4"),
    (dict(block="hashattn"), ["--model.block", "hashattn", "--model.hashattn.n_buckets", "2"],
     "model.hashattn.n_buckets: checkpoint 4 vs config 2"),
    (dict(family="llama"), ["--model.family", "llama", "--model.n_kv_heads", "1"],
     "model.n_kv_heads: checkpoint 2 vs config 1"),
    (dict(family="llama", head_dim=16), ["--model.family", "llama"], "model.head_dim: checkpoint 16 vs config 32"),
    (dict(family="llama"), ["--model.family", "llama", "--model.intermediate_size", "128"],
     "model.intermediate_size: checkpoint 256 vs config 128"),
    (dict(family="llama"), ["--model.family", "llama", "--model.attention_bias", "true"],
     "model.attention_bias: checkpoint false vs config true"),
    (dict(family="mixtral", block="moe", moe={"num_experts": 4}), ["--model.family", "mixtral", "--model.block", "moe"],
     "model.moe.num_experts: checkpoint 4 vs config 8"),
])
def test_checkpoint_with_other_block_options(tmp_path, checkpoint, saved, args, message):
    ckpt = edited(checkpoint, tmp_path / "ckpt", _as(**saved))
    p, _ = dynmo_train(tmp_path, "--checkpoint.resume", str(ckpt), *args)
    assert_rejected(p, tmp_path, message)


@pytest.mark.dist
def test_checkpoint_with_other_layer_names(tmp_path, checkpoint):
    ckpt = edited(checkpoint, tmp_path / "ckpt", lambda m: m["layer_names"].__setitem__(2, "blockX"))
    p, _ = dynmo_train(tmp_path, "--checkpoint.resume", str(ckpt))
    assert_rejected(p, tmp_path, "the checkpoint's layers are not the model's: layer 2 is 'blockX' in the checkpoint "
                                 "and 'block1' in the model")
    assert str(ckpt / "dynmo.json") in p.stderr


@pytest.mark.dist
@pytest.mark.parametrize("text,message", [
    (lambda t: t[: len(t) // 2], "is not valid JSON"),  # truncated
    (lambda t: "", "is not valid JSON"),
    (lambda t: "step: 2\n", "is not valid JSON"),
    (lambda t: "[1, 2]", "holds a JSON list, not an object"),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "step"}), "lacks 'step'"),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "model"}), "lacks 'model'"),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k not in ("layer_names", "layout")}),
     "lacks 'layer_names', 'layout'"),
    (lambda t: json.dumps(json.loads(t) | {"step": "2"}), "'step' should be a step number >= 0"),
    (lambda t: json.dumps(json.loads(t) | {"model": {"family": "llama", "n_heads": "two"}}), "its 'model' section is malformed"),
])
def test_damaged_checkpoint_record(tmp_path, checkpoint, text, message):
    ckpt = edited(checkpoint, tmp_path / "ckpt", text=text((checkpoint / "dynmo.json").read_text()))
    p, _ = dynmo_train(tmp_path, "--checkpoint.resume", str(ckpt))
    assert_rejected(p, tmp_path, message)
    assert str(ckpt / "dynmo.json") in p.stderr


@pytest.mark.dist
def test_checkpoint_past_train_steps(tmp_path, checkpoint):
    ckpt = edited(checkpoint, tmp_path / "checkpoint-8", lambda m: m.update(step=8))
    p, _ = dynmo_train(tmp_path, "--checkpoint.resume", str(ckpt), "--steps", "4")
    assert_rejected(p, tmp_path, f"checkpoint {ckpt} is at step 8, past train.steps=4; raise --steps")


@pytest.mark.dist
def test_checkpoint_at_train_steps_trains_nothing_and_succeeds(tmp_path, checkpoint):
    p = run_train(tmp_path, "--checkpoint.resume", str(checkpoint), "--steps", "2")
    assert p.returncode == 0
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == 2


@pytest.mark.dist
@pytest.mark.parametrize("cases,args,message", [
    ({}, ["--early_exit.enabled", "true"], "was saved without early exit, so its blocks have no exit classifiers"),
    ({"early-exit": {}}, ["--early_exit.enabled", "true", "--early_exit.first_block", "1"],
     "has exit classifiers from block 2 on; resume with early_exit.first_block >= 2"),
    ({"freeze": {"frozen": [1, 2]}}, [], "has frozen layers (block0, block1), saved without optimizer state"),
    ({"prune": {"hidden": [128, 128, 128, 128]}}, [], "holds structurally pruned blocks"),
])
def test_checkpoint_of_other_dynamic_cases(tmp_path, checkpoint, cases, args, message):
    ckpt = edited(checkpoint, tmp_path / "ckpt", lambda m: m.update(cases=cases))
    p, _ = dynmo_train(tmp_path, "--checkpoint.resume", str(ckpt), *args)
    assert_rejected(p, tmp_path, message)
