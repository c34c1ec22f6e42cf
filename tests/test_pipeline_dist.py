"""End to end through the real launcher: `dynmo train` -> torchrun -> gloo ranks."""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import metrics, run_train
from tests.reference import reference_run, reference_val_loss, tiny_config

pytestmark = pytest.mark.dist

STEPS = 10


def final_weights(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(ckpt), str(tmp / "flat.pt"))
    sd = torch.load(tmp / "flat.pt")
    return {k: v for k, v in sd.items() if not k.startswith("optim.")}


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config("--train.steps", str(STEPS)), STEPS)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_two_rank_pipeline_equals_single_process(tmp_path, reference, schedule):
    run_train(tmp_path, "--steps", str(STEPS), "--parallel.schedule", schedule, "--checkpoint.final", "true")
    ref_losses, ref_weights = reference
    losses = [r["loss"] for r in metrics(tmp_path)]
    assert losses == ref_losses  # bitwise: same microbatches, same update, same order
    got = final_weights(tmp_path / "checkpoint-final", tmp_path)
    assert got.keys() == ref_weights.keys()
    for k in got:
        assert torch.equal(got[k], ref_weights[k]), k


def test_forced_relayouts_leave_training_unchanged(tmp_path, reference):
    # multi-layer moves, moves next to E (layer 0) and L (layer 5), there and back
    relayouts = "2:0,1,6;4:0,5,6;6:0,2,6;8:0,4,6"
    run_train(tmp_path, "--steps", str(STEPS), "--parallel.relayout", relayouts, "--checkpoint.final", "true")
    recs = metrics(tmp_path)
    ref_losses, ref_weights = reference
    assert [r["loss"] for r in recs] == ref_losses
    moved = {r["step"]: r["events"][0] for r in recs if r["events"]}
    assert sorted(moved) == [2, 4, 6, 8]
    assert moved[2]["layers_moved"] == 2 and moved[4]["layers_moved"] == 4
    assert all(ev["bytes"] > 0 for ev in moved.values())
    assert [r["layout"] for r in recs if r["step"] in (1, 2, 4, 9)] == [[0, 3, 6], [0, 1, 6], [0, 5, 6], [0, 4, 6]]
    got = final_weights(tmp_path / "checkpoint-final", tmp_path)
    for k in got:
        assert torch.equal(got[k], ref_weights[k]), k
    check_metric_invariants(tmp_path, recs)


def check_metric_invariants(out: Path, recs: list[dict]) -> None:
    n_mb = 4
    for r in recs:
        assert 0.0 <= r["bubble_ratio"] < 1.0 and r["imbalance"] >= 0.0 and r["tokens_per_s"] > 0
        b = r["layout"]
        assert len(r["stage_compute_s"]) == len(b) - 1 and len(r["layer_fwd_s"]) == b[-1]
        for j in range(len(b) - 1):
            # per-layer times are sub-intervals of the stage's compute intervals: never more
            layer_sum = n_mb * sum(r["layer_fwd_s"][i] + r["layer_bwd_s"][i] for i in range(b[j], b[j + 1]))
            assert 0.0 < layer_sum <= r["stage_compute_s"][j] + 1e-6
            assert r["stage_compute_s"][j] <= r["iteration_s"] + 1e-6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_layout"] == recs[-1]["layout"] and summary["final_loss"] == recs[-1]["loss"]
    assert (out / "config.toml").is_file()


def test_checkpoint_resumes_under_another_layout_and_stage_count(tmp_path, reference):
    a = tmp_path / "a"
    run_train(a, "--steps", str(STEPS), "--checkpoint.every", "3")
    # resume at step 3 with 4 virtual stages on 2 ranks (interleaved 1F1B), another layout
    b = tmp_path / "b"
    run_train(
        b, "--steps", str(STEPS), "--checkpoint.resume", str(a / "checkpoint-3"),
        "--parallel.schedule", "interleaved1f1b", "--parallel.virtual_stages", "2", "--parallel.layout", "0,1,3,4,6",
    )
    ref_losses, _ = reference
    assert [r["loss"] for r in metrics(a)] == ref_losses
    resumed = metrics(b)
    assert [r["step"] for r in resumed] == list(range(3, STEPS))
    assert [r["loss"] for r in resumed] == pytest.approx(ref_losses[3:], rel=1e-6)


def test_pipeline_times_data_parallel(tmp_path):
    # both replicas re-layout alike at step 2 (layers move inside each replica's pipeline)
    run_train(tmp_path, "--steps", "4", "--parallel.dp", "2", "--parallel.relayout", "2:0,1,6", nproc=4)
    ref_losses, _ = reference_run(tiny_config("--train.steps", "4"), 4, dp=2)
    recs = metrics(tmp_path)
    assert [r["loss"] for r in recs] == pytest.approx(ref_losses, rel=1e-6)
    assert len(recs[0]["stage_compute_s"]) == 2
    assert recs[2]["events"][0]["layers_moved"] == 2 and recs[3]["layout"] == [0, 1, 6]


@pytest.mark.parametrize("schedule,extra", [
    ("interleaved1f1b", ["--parallel.virtual_stages", "2"]),
    ("interleavedzb", ["--parallel.virtual_stages", "2"]),
    ("zbv", ["--parallel.virtual_stages", "2"]),
])
def test_multi_stage_schedules_match_reference(tmp_path, reference, schedule, extra):
    """Training and the validation after the last step (the forward-only pass of a schedule
    that trains; zbv's V hands its backward over locally and needs its plan without it)."""
    run_train(tmp_path, "--steps", str(STEPS), "--parallel.schedule", schedule, *extra, "--parallel.relayout", "2:0,2,3,5,6",
              "--train.eval_every", str(STEPS))
    ref_losses, ref_weights = reference
    recs = metrics(tmp_path)
    assert [r["loss"] for r in recs] == pytest.approx(ref_losses, rel=1e-6)
    assert [r["step"] for r in recs if r.get("val_loss") is not None] == [STEPS - 1]
    assert recs[-1]["val_loss"] == pytest.approx(reference_val_loss(tiny_config("--train.steps", str(STEPS)), ref_weights),
                                                 rel=1e-5)
    assert recs[2]["layout"] == [0, 2, 3, 5, 6]
    check_metric_invariants(tmp_path, recs)
