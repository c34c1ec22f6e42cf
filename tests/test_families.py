"""Model families through the runtime: migration stays bitwise for llama and mixtral, the cases
that apply to them run, and what they do not implement is refused before work starts."""

from __future__ import annotations

import pytest

from dynmo.checks import validate
from dynmo.config import ConfigError
from tests.conftest import metrics, run_train
from tests.reference import tiny_config

LLAMA = ["--model.family", "llama", "--model.n_kv_heads", "1"]
MIXTRAL = ["--model.family", "mixtral", "--model.block", "moe", "--model.n_kv_heads", "1",
           "--model.moe.num_experts", "4", "--model.moe.top_k", "2"]


@pytest.mark.dist
def test_forced_relayouts_keep_the_mixtral_loss_trajectory_bitwise(tmp_path):
    """(The llama block's migrations are checked bitwise with each of its dynamic variants in
    tests/test_llama_dynamic.py.)"""
    family = MIXTRAL
    common = ["--steps", "6", *family]
    run_train(tmp_path / "static", *common)
    run_train(tmp_path / "moved", *common, "--parallel.relayout", "2:0,2,6;4:0,4,6")
    static, moved = metrics(tmp_path / "static"), metrics(tmp_path / "moved")
    assert [r["loss"] for r in moved] == [r["loss"] for r in static]
    assert moved[-1]["layout"] == [0, 4, 6] and static[-1]["layout"] == [0, 3, 6]
    assert sum(e["type"] == "migration" for r in moved for e in r["events"]) == 2
    # the MoE statistics of the GPT MoE block apply to the mixtral block
    assert all(len(v) == 4 for v in moved[-1]["moe_tokens_per_expert"][1:-1])


@pytest.mark.dist
def test_pruning_and_freezing_run_on_llama_blocks(tmp_path):
    run_train(tmp_path / "run", "--steps", "6", *LLAMA, "--prune.enabled", "true", "--prune.start_step", "1",
              "--prune.every", "2", "--prune.times", "2", "--prune.final_sparsity", "0.5", "--prune.kernel", "dense",
              "--freeze.enabled", "true", "--freeze.start_step", "1", "--freeze.every", "2", "--freeze.tolerance", "10",
              "--parallel.relayout", "4:0,2,6")
    recs = metrics(tmp_path / "run")
    density = recs[-1]["prune_density"][1:-1]
    assert all(d == pytest.approx(0.5, abs=0.25) for d in density) and sum(density) / 4 == pytest.approx(0.5, abs=0.01)
    # a tolerance of 10 freezes the first block at the first check; later checks freeze the next
    assert recs[-1]["freeze_frozen"][1] == 1.0


@pytest.mark.parametrize("extra,match", [
    (["--model.family", "llama", "--model.block", "moe"], "not a block of model.family 'llama'"),
    (["--model.family", "mixtral"], "not a block of model.family 'mixtral'"),
    (["--model.family", "falcon"], "unknown model.family"),
    (["--model.family", "llama", "--model.n_heads", "4", "--model.n_kv_heads", "3"], "multiple of model.n_kv_heads"),
    (["--model.family", "llama", "--model.dropout", "0.1"], "no dropout"),
    (["--model.family", "mixtral", "--model.block", "moe", "--early_exit.enabled", "true"], "early_exit"),
    (["--model.family", "llama", "--prune.enabled", "true", "--prune.structured", "true"], "structured"),
    (["--model.family", "mixtral", "--model.block", "moe", "--prune.enabled", "true"], "prunable"),
])
def test_what_a_family_does_not_implement_is_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        validate(tiny_config(*extra), 2)
