"""Placement units finer than a block (`parallel.unit = "sublayer"`): each block's attention
half and MLP half are units a stage boundary may fall between. The same model, the same
training: bitwise on CPU, through re-layouts that split blocks, and across checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dynmo.checks import validate
from dynmo.config import ConfigError
from dynmo.layout import Layout
from dynmo.model.layers import build_layer, layer_param_counts, layer_specs
from tests.conftest import metrics, run_train
from tests.reference import reference_run, tiny_config

STEPS = 6
LLAMA = ["--model.family", "llama", "--model.n_kv_heads", "1"]
MIXTRAL = ["--model.family", "mixtral", "--model.block", "moe", "--model.n_kv_heads", "1",
           "--model.moe.num_experts", "4", "--model.moe.top_k", "2"]


def test_units_are_the_embedding_two_halves_per_block_and_the_head():
    cfg = tiny_config("--parallel.unit", "sublayer")
    specs = layer_specs(cfg.model, "sublayer")
    assert "".join(s.letter for s in specs) == "E" + "am" * cfg.model.n_layers + "L"
    assert [s.name for s in specs[1:3]] == ["block0_attn", "block0_mlp"] and specs[2].prefix == "block0"
    assert [s.block for s in specs] == [None, 0, 0, 1, 1, 2, 2, 3, 3, None]
    # a block's halves hold its parameters, under its names, with its initial weights
    whole = build_layer(layer_specs(cfg.model)[2], cfg.model, seed=3)
    halves = [build_layer(s, cfg.model, seed=3) for s in specs[3:5]]
    got = {k: v for h in halves for k, v in h.state_dict().items()}
    assert list(got) == list(whole.state_dict())
    assert all(torch.equal(got[k], v) for k, v in whole.state_dict().items())
    counts = layer_param_counts(cfg.model, "sublayer")
    assert [counts[0], counts[1] + counts[2], counts[-1]] == [layer_param_counts(cfg.model)[i] for i in (0, 1, -1)]
    assert Layout((0, 4, 10)).format([s.letter for s in specs]) == "E a m a | m a m a m L"


@pytest.mark.parametrize("args,match", [
    (["--parallel.unit", "layer"], "parallel.unit = 'layer': choose one of block, sublayer"),
    (["--parallel.unit", "sublayer", "--parallel.layout", "0,5,6"], "covers 6 layers"),
])
def test_bad_unit_combinations_are_refused_before_launch(args, match):
    with pytest.raises(ConfigError, match=match):
        validate(tiny_config(*args), 2)


def final_weights(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(str(ckpt), str(tmp / "flat.pt"))
    return {k: v for k, v in torch.load(tmp / "flat.pt").items() if not k.startswith("optim.")}


@pytest.mark.dist
@pytest.mark.parametrize("family,nproc,relayout", [
    ([], 2, "2:0,4,10;4:0,6,10"),
    (LLAMA, 3, "2:0,2,7,10;4:0,5,8,10"),
    (MIXTRAL, 2, "2:0,3,10;4:0,8,10"),
    (["--model.block", "hashattn"], 2, "3:0,6,10"),
    (["--model.block", "moe"], 2, "2:0,5,10"),
], ids=["gpt", "llama-3-ranks", "mixtral", "hashattn", "moe"])
def test_sublayer_units_train_bitwise_as_the_single_model_through_relayouts_that_split_blocks(
        tmp_path, family, nproc, relayout):
    """The pipeline on half-block units, moved mid-block with its weights and AdamW state,
    gives the single-process reference's losses and final weights bit for bit, saved under
    the blocks' own parameter names."""
    run_train(tmp_path, "--steps", str(STEPS), *family, "--parallel.unit", "sublayer", "--parallel.relayout",
              relayout, "--checkpoint.final", "true", nproc=nproc)
    ref_losses, ref_weights = reference_run(tiny_config("--train.steps", str(STEPS), *family), STEPS)
    recs = metrics(tmp_path)
    assert [r["loss"] for r in recs] == ref_losses
    assert sum(e["type"] == "migration" for r in recs for e in r["events"]) == relayout.count(":")
    last = relayout.rsplit(":", 1)[1]
    assert recs[-1]["layout"] == [int(x) for x in last.split(",")]
    got = final_weights(tmp_path / "checkpoint-final", tmp_path)
    assert got.keys() == ref_weights.keys()
    assert all(torch.equal(got[k], ref_weights[k]) for k in got)


@pytest.mark.dist
def test_a_sublayer_checkpoint_resumes_on_whole_blocks_and_back(tmp_path):
    """Saved with half-block units, resumed with whole blocks on another layout, and saved
    again and resumed with half blocks: the losses of one uninterrupted run."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    run_train(a, "--steps", str(STEPS), "--parallel.unit", "sublayer", "--parallel.layout", "0,3,10",
              "--checkpoint.every", "2")
    run_train(b, "--steps", str(STEPS), "--checkpoint.resume", str(a / "checkpoint-2"), "--parallel.layout", "0,2,6",
              "--checkpoint.every", "2")
    run_train(c, "--steps", str(STEPS), "--checkpoint.resume", str(b / "checkpoint-4"), "--parallel.unit", "sublayer",
              "--parallel.layout", "0,6,10")
    ref_losses, _ = reference_run(tiny_config("--train.steps", str(STEPS)), STEPS)
    losses = [r["loss"] for r in metrics(a)[:2] + metrics(b)[:2] + metrics(c)]
    assert [r["step"] for r in metrics(c)] == [4, 5]
    assert losses == ref_losses


SPLIT = "2:0,4,10;4:0,7,10"  # boundaries after block 1's and then block 2's attention half
EXIT = ["--early_exit.enabled", "true", "--early_exit.first_block", "1", "--early_exit.threshold", "0.5",
        "--early_exit.start_step", "2"]
PRUNE = ["--prune.enabled", "true", "--prune.start_step", "0", "--prune.every", "3", "--prune.times", "2",
         "--prune.final_sparsity", "0.8", "--prune.scoring", "magnitude", "--prune.min_density", "0"]


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out)]


@pytest.mark.dist
@pytest.mark.parametrize("case", [
    [*EXIT, *PRUNE, "--prune.kernel", "csr"],
    ["--model.block", "mod", *PRUNE, "--prune.structured", "true", "--prune.kernel", "dense"],
], ids=["earlyexit+pruning", "mod+structured-pruning"])
def test_dynamic_cases_on_half_blocks_train_bitwise_as_on_whole_blocks(tmp_path, case):
    """Early exit decides after a block's MLP half with the block's input handed on from its
    attention half; Mixture of Depths hands its routing decision on; pruning cuts the halves'
    Linears as the blocks' -- across stage boundaries inside blocks, moved with their state:
    the losses of whole blocks placed once, bit for bit."""
    halves, whole = tmp_path / "halves", tmp_path / "whole"
    run_train(halves, "--steps", "7", *case, "--parallel.unit", "sublayer", "--parallel.relayout", SPLIT)
    run_train(whole, "--steps", "7", *case)
    assert losses(halves) == losses(whole)
    recs = metrics(halves)
    assert sum(e["type"] == "migration" for r in recs for e in r["events"]) == 2
    assert sum(e["type"] == "dynamism" for r in recs for e in r["events"]) >= 2  # it pruned (and exited)
    last = recs[-1]
    if "--early_exit.enabled" in case:  # exits are decided on MLP halves only
        assert sum(last["exit_tokens"][i] or 0 for i in range(2, 9, 2)) > 0
        assert all(last["exit_tokens"][i] is None for i in range(1, 9, 2))
    else:  # structured pruning narrowed the MLP halves
        assert all(last["prune_hidden"][i] < 128 for i in range(2, 9, 2))


@pytest.mark.dist
def test_mixture_of_depths_on_half_blocks_over_three_ranks_is_the_single_model(tmp_path):
    """A llama MoD model split inside blocks on 3 ranks and moved: the single-process model."""
    args = ["--model.block", "mod", *LLAMA]
    run_train(tmp_path, "--steps", str(STEPS), *args, "--parallel.unit", "sublayer", "--parallel.relayout",
              "2:0,2,7,10;4:0,5,8,10", nproc=3)
    ref_losses, _ = reference_run(tiny_config("--train.steps", str(STEPS), *args), STEPS)
    assert losses(tmp_path) == ref_losses


@pytest.mark.dist
def test_halves_freeze_front_to_back_and_a_move_changes_nothing(tmp_path):
    """Freezing works per half (a MoD MLP half probed with its routing): the halves freeze
    front to back, and moving them mid-run gives the same losses and the same frozen halves."""
    freeze = ["--model.block", "mod", "--parallel.unit", "sublayer", "--freeze.enabled", "true",
              "--freeze.start_step", "4", "--freeze.every", "2", "--freeze.tolerance", "1e9",
              "--freeze.max_frozen", "3", "--freeze.max_per_check", "0"]
    moved, placed = tmp_path / "moved", tmp_path / "placed"
    run_train(moved, "--steps", "7", *freeze, "--parallel.relayout", "2:0,4,10;5:0,7,10")
    run_train(placed, "--steps", "7", *freeze)
    assert losses(moved) == losses(placed)
    for out in (moved, placed):
        last = metrics(out)[-1]
        assert last["freeze_frozen"][1:9] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]  # block 0, block 1's attention
