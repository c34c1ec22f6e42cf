"""What a stage's data-parallel replicas shard: the AdamW state (`parallel.shard = "optimizer"`,
the same training bit for bit, a quarter less state per worker at dp = 2) or everything
(`"full"`, FSDP2: half the state at dp = 2, the same training to float32 rounding); layers
that still migrate and re-pack, and checkpoints that reshard on load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dynmo.checks import validate
from dynmo.config import ConfigError
from dynmo.loop import bytes_per_param
from dynmo.runtime.zero import shard_rows
from tests.conftest import metrics, run_train
from tests.reference import tiny_config

LLAMA = ["--model.family", "llama", "--model.n_kv_heads", "1"]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), dp=st.integers(1, 9))
def test_the_replicas_rows_are_torch_chunks_in_order(n, dp):
    """Disjoint, in replica order, covering every row: torch.chunk's split (DTensor's Shard(0))."""
    rows = [shard_rows(n, dp, r) for r in range(dp)]
    assert rows[0][0] == 0 and rows[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    chunks = [c.numel() for c in torch.arange(n).chunk(dp)] if n else []
    assert [hi - lo for lo, hi in rows if hi > lo] == chunks


def test_a_worker_holds_a_quarter_less_with_sharded_moments_and_half_with_everything_sharded():
    assert bytes_per_param() == bytes_per_param("optimizer", 1) == 16
    assert bytes_per_param("optimizer", 2) == 12 and bytes_per_param("optimizer", 8) == 9
    assert bytes_per_param("full", 2) == 8 and bytes_per_param("full", 1) == 16


@pytest.mark.parametrize("args,match", [
    (["--parallel.shard", "zero"], "parallel.shard = 'zero': choose one of none, optimizer, full"),
    (["--parallel.shard", "optimizer"], "parallel.dp = 1: set parallel.dp >= 2"),
    (["--parallel.shard", "full", "--parallel.dp", "2", "--parallel.schedule", "zbv", "--parallel.virtual_stages", "2"],
     "does not work with zero-bubble schedules"),
    (["--parallel.shard", "full", "--parallel.dp", "2", "--freeze.enabled", "true"], "does not work with freezing yet"),
    (["--parallel.shard", "full", "--parallel.dp", "2", "--model.tie_embeddings", "true"], "tie_embeddings yet"),
    (["--parallel.shard", "optimizer", "--parallel.dp", "2", "--prune.enabled", "true"], "does not work with pruning"),
])
def test_bad_shard_settings_are_refused_before_launch(args, match):
    with pytest.raises(ConfigError, match=match):
        validate(tiny_config(*args), 4)


def flat(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{ckpt.parent.name}-{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out)


@pytest.mark.dist
def test_sharded_state_trains_as_unsharded_migrates_repacks_and_reshards_on_load(tmp_path):
    """dp 2 x pp 2 with a re-layout and a re-pack onto one stage. Optimizer state sharded: the
    losses and every weight and AdamW tensor of the unsharded run, bit for bit, a quarter less
    state per worker, less shipped per move; everything sharded (FSDP2): the same to 1e-6, half
    the state. Each setting's checkpoint resumes unsharded on one replica; one chain goes on
    fully sharded; the fully sharded checkpoint exports."""
    steps = 10
    common = ["--steps", str(steps), *LLAMA, "--parallel.dp", "2", "--parallel.relayout", "2:0,2,6;5:0,6",
              "--checkpoint.final", "true"]
    sharded, whole, full = tmp_path / "sharded", tmp_path / "whole", tmp_path / "full"
    run_train(sharded, *common, "--parallel.shard", "optimizer", "--checkpoint.every", "4", nproc=4)
    run_train(whole, *common, nproc=4)
    run_train(full, *common, "--parallel.shard", "full", "--checkpoint.every", "4", nproc=4)
    f, w = metrics(full), metrics(whole)
    assert [r["loss"] for r in f] == pytest.approx([r["loss"] for r in w], abs=1e-6)
    for rf, rw in zip(f[1:], w[1:]):
        assert sum(rf["layer_state_bytes"]) == pytest.approx(0.5 * sum(rw["layer_state_bytes"]), rel=1e-2)
    ff, fw = flat(full / "checkpoint-final", tmp_path), flat(whole / "checkpoint-final", tmp_path)
    assert ff.keys() == fw.keys() and all(torch.allclose(ff[k], fw[k], rtol=0, atol=1e-5) for k in ff)
    a, b = metrics(sharded), metrics(whole)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [e["new"] for r in a for e in r["events"] if e["type"] == "migration"] == [[0, 2, 6], [0, 6]]
    # weights and gradients whole, the two moments halved: 12 bytes a parameter instead of 16
    for ra, rb in zip(a[1:], b[1:]):
        assert sum(ra["layer_state_bytes"]) == pytest.approx(0.75 * sum(rb["layer_state_bytes"]), rel=1e-3)
    shipped = [e["bytes"] for r in a for e in r["events"] if e["type"] == "migration"]
    assert all(x < y for x, y in zip(shipped, [e["bytes"] for r in b for e in r["events"] if e["type"] == "migration"]))
    fa, fb = flat(sharded / "checkpoint-final", tmp_path), flat(whole / "checkpoint-final", tmp_path)
    assert fa.keys() == fb.keys() and any(k.startswith("optim.") for k in fa)
    assert all(torch.equal(fa[k], fb[k]) for k in fa)

    # resharded on load, on another layout each time: optimizer-sharded (dp 2) -> one replica
    # unsharded -> fully sharded (dp 2): both kinds store the same unsharded keys, so one chain
    # reads each kind's checkpoint and writes the other's
    one, again = tmp_path / "one", tmp_path / "again"
    run_train(one, "--steps", str(steps), *LLAMA, "--checkpoint.resume", str(sharded / "checkpoint-4"),
              "--parallel.layout", "0,4,6", "--checkpoint.every", "6")
    run_train(again, "--steps", str(steps), *LLAMA, "--parallel.dp", "2", "--parallel.shard", "full",
              "--checkpoint.resume", str(one / "checkpoint-6"), "--parallel.layout", "0,3,6", nproc=4)
    resumed = metrics(one)[:2] + metrics(again)
    assert [r["step"] for r in resumed] == list(range(4, steps))
    # one replica sums the gradient in another order than two: equal to float32 rounding
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in a[4:]], abs=1e-6)
    # and the fully sharded checkpoint, on one replica unsharded
    run_train(tmp_path / "one-full", "--steps", str(steps), *LLAMA, "--checkpoint.resume", str(full / "checkpoint-4"),
              "--parallel.layout", "0,4,6")
    assert [r["loss"] for r in metrics(tmp_path / "one-full")] == pytest.approx([r["loss"] for r in f[4:]], abs=1e-6)

    out = tmp_path / "hf"
    p = run_export(full / "checkpoint-final", out)  # the optimizer-sharded one's weights are the whole run's
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def run_export(ckpt: Path, out: Path):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "dynmo.cli", "export", str(ckpt), "--hf", str(out)],
                          capture_output=True, text=True, timeout=300)
