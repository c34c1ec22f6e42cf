"""Re-packing onto fewer ranks, end to end: the released ranks exit 0, the others train on with
the same loss trajectory, torchrun exits 0."""

import math

import pytest
import torch

from tests.conftest import metrics, run_train
from tests.reference import reference_run, tiny_config
from tests.test_pipeline_dist import final_weights

pytestmark = pytest.mark.dist

STEPS = 8


@pytest.fixture(scope="module")
def reference():
    return reference_run(tiny_config("--train.steps", str(STEPS)), STEPS)


def test_forced_repack_three_ranks_to_two(tmp_path, reference):
    p = run_train(tmp_path, "--steps", str(STEPS), "--parallel.relayout", "3:0,3,6", "--checkpoint.final", "true",
                  nproc=3)
    recs = metrics(tmp_path)
    ref_losses, ref_weights = reference
    assert [r["loss"] for r in recs] == ref_losses  # bitwise, before and after the re-pack
    assert [r["workers"] for r in recs] == [3] * 3 + [2] * 5
    ev = recs[3]["events"][0]
    assert ev["repacked"] and ev["stages"] == [3, 2] and ev["released_ranks"] == [2]
    assert ev["bytes"] > 0 and ev["layers_moved"] >= 1
    assert all(len(r["stage_compute_s"]) == 2 for r in recs[3:])
    assert "rank 2 released" in p.stdout + p.stderr
    got = final_weights(tmp_path / "checkpoint-final", tmp_path)  # saved by the 2 remaining ranks
    for k in ref_weights:
        assert torch.equal(got[k], ref_weights[k]), k


def test_checkpoint_after_a_repack_resumes_on_fewer_ranks(tmp_path, reference):
    # Train on 3 ranks, re-pack onto 2 at step 2, checkpoint at step 4; then restart the job on
    # 2 ranks from that checkpoint (what a user does to give the released machine back for good).
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(a, "--steps", str(STEPS), "--parallel.relayout", "2:0,3,6", "--checkpoint.every", "4", nproc=3)
    run_train(b, "--steps", str(STEPS), "--checkpoint.resume", str(a / "checkpoint-4"), "--parallel.layout", "0,3,6")
    ref_losses, _ = reference
    assert [r["loss"] for r in metrics(a)] == ref_losses
    resumed = metrics(b)
    assert [r["step"] for r in resumed] == list(range(4, STEPS))
    assert [r["loss"] for r in resumed] == pytest.approx(ref_losses[4:], rel=1e-6)


def test_controller_repacks_two_ranks_to_one_once_the_model_shrank(tmp_path):
    # Structured pruning at step 3 removes 90% of every MLP and the one decision, at step 6,
    # re-packs: the controller's path. It must train exactly as a forced re-pack to its layout.
    # Nothing here may hang on this machine's timing: a tolerance of 10 accepts any step time up
    # to 11x the 2-rank one, and repack_shrink 0 makes "the model has shrunk" hold whatever the
    # measured totals (a tiny model's costs are mostly overhead; the gate itself is tested on
    # forced costs in test_controller).
    prune = ["--prune.enabled", "true", "--prune.structured", "true", "--prune.start_step", "3",
             "--prune.every", "1", "--prune.times", "1", "--prune.final_sparsity", "0.9"]
    run_train(tmp_path / "auto", "--steps", str(STEPS), "--balance.when", "every", "--balance.every", "6",
              "--balance.repack", "true", "--balance.repack_tolerance", "10", "--balance.repack_shrink", "0", *prune)
    recs = metrics(tmp_path / "auto")
    assert [r["workers"] for r in recs] == [2] * 6 + [1] * (STEPS - 6)
    ev = next(e for e in recs[6]["events"] if e["type"] == "migration")
    assert ev["repacked"] and ev["new"] == [0, 6] and ev["released_ranks"] == [1]
    assert ev["reason"] == "balance.when=every" and ev["decision"] == "repack"
    assert ev["predicted_step_s"] > 0 and ev["current_step_s"] > 0
    assert ev["predicted_step_s"] <= ev["best_step_s"] * (1 + ev["repack_tolerance"])
    assert all(len(r["stage_compute_s"]) == 1 for r in recs[6:])
    run_train(tmp_path / "forced", "--steps", str(STEPS), "--parallel.relayout", "6:0,6", *prune)
    assert [r["loss"] for r in recs] == [r["loss"] for r in metrics(tmp_path / "forced")]


def test_repack_retunes_microbatches(tmp_path, reference):
    run_train(tmp_path, "--steps", str(STEPS), "--parallel.relayout", "2:0,6",
              "--balance.retune_microbatches", "true")
    recs = metrics(tmp_path)
    # 2 stages x 4 microbatches -> 1 stage: 2 microbatches keep the in-flight activations
    assert [r["microbatches"] for r in recs] == [4, 4] + [2] * (STEPS - 2)
    assert recs[2]["events"][0]["microbatches"] == [4, 2]
    # the same batch in fewer, larger microbatches: the same mean loss up to rounding
    for got, want in zip([r["loss"] for r in recs], reference[0]):
        assert math.isclose(got, want, rel_tol=1e-5)


def test_repack_with_data_parallel_shrinks_every_replica(tmp_path):
    steps = 5
    ref_losses, _ = reference_run(tiny_config("--train.steps", str(steps)), steps, dp=2)
    run_train(tmp_path, "--steps", str(steps), "--parallel.dp", "2", "--parallel.relayout", "2:0,6", nproc=4)
    recs = metrics(tmp_path)
    assert [r["workers"] for r in recs] == [4, 4, 2, 2, 2]
    assert recs[2]["events"][0]["released_ranks"] == [1, 3]
    for got, want in zip([r["loss"] for r in recs], ref_losses):
        assert math.isclose(got, want, rel_tol=1e-6)


def test_relayout_cannot_grow_or_repack_interleaved(tmp_path):
    p = run_train(tmp_path, "--parallel.relayout", "2:0,2,4,6", check=False)
    assert p.returncode == 2 and "cannot grow" in p.stderr
    p = run_train(tmp_path, "--parallel.schedule", "interleaved1f1b", "--parallel.virtual_stages", "2",
                  "--parallel.relayout", "2:0,6", check=False)
    assert p.returncode == 2 and "one stage per rank" in p.stderr
