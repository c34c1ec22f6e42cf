"""Layer freezing: the plasticity measure, and end to end through the real launcher: blocks
freeze front to back, a frozen block's weights never change again (also after it migrates),
it computes no weight gradients, and the zero-bubble schedules train with frozen blocks."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dynmo.config import ConfigError, FreezeConfig, ModelConfig
from dynmo.dynamics.freeze import check_options, plasticity
from dynmo.model.layers import LayerSpec, build_layer
from tests.conftest import metrics, run_train


def test_plasticity_is_zero_for_an_unchanged_block_and_grows_with_the_change():
    cfg = ModelConfig(d_model=32, n_heads=2, seq_len=8, n_layers=2)
    block = build_layer(LayerSpec("t", 1), cfg, seed=3)
    x, mask = torch.randn(2, 8, 32), torch.ones(2, 8, dtype=torch.bool)
    ref = {k: v.clone() for k, v in block.state_dict().items()}
    assert plasticity(block, ref, x, mask) == 0.0
    moved = []
    for eps in (1e-3, 1e-2):
        with torch.no_grad():
            for k, p in block.named_parameters():
                p.copy_(ref[k] + eps * torch.ones_like(p))
        moved.append(plasticity(block, ref, x, mask))
    assert 0 < moved[0] < moved[1]
    from dynmo.config import EarlyExitConfig
    from dynmo.dynamics.earlyexit import install_gate

    gate = install_gate(block, EarlyExitConfig(), can_exit=False)
    block(x, mask)
    plasticity(block, ref, x, mask)  # the probe forwards are not counted as training work
    assert gate.summary()["active_tokens"] == 2 * 8
    with pytest.raises(ConfigError, match="max_frozen"):
        check_options(FreezeConfig(max_frozen=9), 4)


def flat(ckpt, tmp):
    dcp_to_torch_save(str(ckpt), str(tmp / (ckpt.name + ".pt")))
    return {k: v for k, v in torch.load(tmp / (ckpt.name + ".pt")).items() if not k.startswith("optim.")}


# a tolerance no plasticity reaches: blocks 0 and 1 freeze at the first check (step 4)
FREEZE = ["--freeze.enabled", "true", "--freeze.start_step", "4", "--freeze.every", "2",
          "--freeze.tolerance", "1e9", "--freeze.max_frozen", "2", "--freeze.max_per_check", "0"]


@pytest.mark.dist
def test_frozen_blocks_never_change_skip_weight_grads_and_stay_frozen_after_migration(tmp_path):
    # step 7 moves the frozen blocks 0 and 1 from rank 0 to rank 1
    run_train(tmp_path, "--steps", "10", *FREEZE, "--parallel.relayout", "7:0,1,6",
              "--checkpoint.every", "5", "--checkpoint.final", "true")
    recs = metrics(tmp_path)
    dyn = [(r["step"], e) for r in recs for e in r["events"] if e["type"] == "dynamism"]
    assert [(s, e["frozen_blocks"]) for s, e in dyn] == [(4, [0, 1])]
    assert all(p >= 0 for p in dyn[0][1]["plasticity"])
    at5, final = flat(tmp_path / "checkpoint-5", tmp_path), flat(tmp_path / "checkpoint-final", tmp_path)
    for k in at5:
        if k.startswith(("block0.", "block1.")):
            assert torch.equal(at5[k], final[k]), k  # bitwise: no update after freezing
    for b in ("block2", "block3", "embed", "head"):
        assert any(not torch.equal(at5[k], final[k]) for k in at5 if k.startswith(b + ".")), b
    for r in recs:
        frozen = r["step"] > 4  # decided after step 4's update (its record already says so)
        assert r["freeze_frozen"] == [None, *[float(r["step"] >= 4)] * 2, 0.0, 0.0, None]
        w = r["freeze_wgrad_elems"]
        assert w[3] > 0 and w[4] > 0
        assert (w[1], w[2]) == ((0, 0) if frozen else (w[3], w[4]))  # counted weight-gradient work
    assert recs[-1]["layout"] == [0, 1, 6]
    assert all(p is not None for p in recs[-1]["freeze_progress"][1:3])


@pytest.mark.dist
@pytest.mark.parametrize("schedule", ["zbv"])
def test_zero_bubble_schedule_trains_with_frozen_blocks(tmp_path, schedule):
    run_train(tmp_path, "--steps", "7", *FREEZE, "--parallel.schedule", schedule, "--parallel.virtual_stages", "2",
              "--checkpoint.every", "5", "--checkpoint.final", "true")
    recs = metrics(tmp_path)
    assert recs[-1]["freeze_frozen"][1:3] == [1.0, 1.0]
    at5, final = flat(tmp_path / "checkpoint-5", tmp_path), flat(tmp_path / "checkpoint-final", tmp_path)
    assert all(torch.equal(at5[k], final[k]) for k in at5 if k.startswith(("block0.", "block1.")))
    assert any(not torch.equal(at5[k], final[k]) for k in at5 if k.startswith("block3."))


def test_resume_keeps_frozen_blocks_frozen_and_the_trajectory(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(a, "--steps", "9", *FREEZE, "--checkpoint.every", "6")
    run_train(b, "--steps", "9", *FREEZE, "--checkpoint.resume", str(a / "checkpoint-6"), "--checkpoint.final", "true")
    full, resumed = metrics(a), metrics(b)
    assert [r["step"] for r in resumed] == [6, 7, 8]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full[6:]], rel=1e-6)
    assert all(r["freeze_frozen"][1:3] == [1.0, 1.0] for r in resumed)  # still frozen, no re-decision
    assert not any(e["type"] == "dynamism" for r in resumed for e in r["events"])
    at6, final = flat(a / "checkpoint-6", tmp_path), flat(b / "checkpoint-final", tmp_path)
    assert all(torch.equal(at6[k], final[k]) for k in at6 if k.startswith(("block0.", "block1.")))


# A run in a process of its own, through `dynmo.train.main` (world of one), then what is left.
AFTER_A_RUN = """
import gc, json, os, socket, sys
import torch
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
from dynmo import train
status = train.main(sys.argv[1:])
gc.collect()
alive = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
print(json.dumps({"status": status, "parameters": sum(isinstance(t, torch.nn.Parameter) for t in alive),
                  "elements": sum(t.numel() for t in alive)}))
"""


def test_a_finished_freezing_run_leaves_its_model_and_optimizer_to_be_freed(tmp_path):
    """Freezing counts weight gradients with tensor hooks, which Python's garbage collector
    cannot see through: a hook holding the case kept the model, its gradients and the optimizer
    alive after the run (on a GPU, gigabytes a later run in the process counted as its own).
    After a run that froze blocks, no parameter is left and at most a few scalars."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, TINY

    args = [*TINY, "--train.steps", "7", "--out", str(tmp_path / "run"), "--parallel.pp", "1",
            "--freeze.enabled", "true", "--freeze.start_step", "2", "--freeze.every", "2", "--freeze.tolerance", "1e9"]
    p = subprocess.run([sys.executable, "-c", AFTER_A_RUN, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    left = json.loads(p.stdout.strip().splitlines()[-1])
    assert left["status"] == 0
    events = [e for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              for e in json.loads(line).get("events", [])]
    assert any(e.get("frozen_blocks") for e in events), events  # blocks did freeze
    assert left["parameters"] == 0 and left["elements"] < 16, left
