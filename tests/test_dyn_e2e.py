"""The dynamic blocks (MoE, hash-sparse attention, Mixture of Depths) end to end through the
real launcher: they train on 2 pipeline ranks, their per-layer statistics reach
metrics.jsonl for every block, the counted per-layer work follows the routing / hashing /
capacity, and the pipeline (auxiliary losses included, across a migration, under 1F1B and
the zero-bubble schedules) trains exactly like the single-process reference."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tests.conftest import TINY, metrics, run_train
from tests.reference import reference_run, tiny_config
from tests.test_pipeline_dist import final_weights

pytestmark = pytest.mark.dist

STEPS = 6
N_BLOCKS = 4  # TINY: layers 0 (E), 1..4 (t), 5 (L)
BLOCK_LAYERS = range(1, N_BLOCKS + 1)
MICROBATCHES = 4
TOKENS = 8 * 32  # TINY: global_batch x seq_len per step


def _arg(name: str) -> str:
    return TINY[TINY.index(name) + 1]


assert int(_arg("--model.n_layers")) == N_BLOCKS and int(_arg("--train.microbatches")) == MICROBATCHES


def equals_reference(out, args: list[str], exact: bool = True) -> list[dict]:
    """Losses and final weights of the run in `out` equal the single-process reference."""
    ref_losses, ref_weights = reference_run(tiny_config("--train.steps", str(STEPS), *args), STEPS)
    recs = metrics(out)
    losses = [r["loss"] for r in recs]
    got = final_weights(out / "checkpoint-final", out)
    assert got.keys() == ref_weights.keys()
    if exact:
        assert losses == ref_losses
        for k in got:
            assert torch.equal(got[k], ref_weights[k]), k
    else:
        assert losses == pytest.approx(ref_losses, rel=1e-6)
        for k in got:
            torch.testing.assert_close(got[k], ref_weights[k], rtol=1e-5, atol=1e-7, msg=k)
    return recs


def per_block(rec: dict, key: str) -> list:
    """The block layers' values of a per-layer metric; E and L have none."""
    row = rec[key]
    assert len(row) == N_BLOCKS + 2 and row[0] is None and row[-1] is None, key
    assert all(row[i] is not None for i in BLOCK_LAYERS), key
    return [row[i] for i in BLOCK_LAYERS]


# ---- MoE -------------------------------------------------------------------------------------

MOE = ["--model.block", "moe", "--model.moe.num_experts", "4"]


def test_moe_trains_like_the_reference_across_a_migration_with_routing_stats(tmp_path):
    # 1F1B; at step 3 two MoE blocks move to stage 1 with their weights, grads and AdamW state
    run_train(tmp_path, "--steps", str(STEPS), *MOE, "--parallel.relayout", "3:0,1,6", "--checkpoint.final", "true")
    recs = equals_reference(tmp_path, MOE)  # the balance loss's gradient included, bitwise
    assert recs[3]["events"][0]["layers_moved"] == 2 and recs[3]["layout"] == [0, 1, 6]
    loads_by_step = []
    for r in recs:
        loads = per_block(r, "moe_tokens_per_expert")
        rows = per_block(r, "moe_expert_rows")
        useful = per_block(r, "moe_useful_rows")
        for L, R, U, imb, fw in zip(loads, rows, useful, per_block(r, "moe_routing_imbalance"), per_block(r, "moe_forwards")):
            assert len(L) == 4 and sum(L) == 2 * TOKENS  # top-2 over every token of the step
            assert fw == MICROBATCHES and U == 2 * TOKENS  # dropless
            assert R == U  # grouped experts (the default) compute the kept rows, nothing more
            assert 1.0 <= imb <= 4.0
        loads_by_step.append([tuple(L) for L in loads])
    # routing changes step to step in every block
    for b in range(N_BLOCKS):
        assert len({s[b] for s in loads_by_step}) > 1


# ---- Mixture of Depths -----------------------------------------------------------------------

CAPS = [1.0, 0.0625, 1.0, 0.0625]
MOD = ["--model.block", "mod", "--model.mod.capacities", ";".join(map(str, CAPS)),
       "--model.d_model", "128", "--model.seq_len", "128"]


def test_mod_per_block_capacity_sets_the_work_and_the_measured_time(tmp_path):
    # bigger than TINY so compute, not per-call overhead, dominates the layer time; the
    # migration at step 3 rebuilds blocks on the other rank, which must keep their capacity
    run_train(tmp_path, "--steps", str(STEPS), *MOD, "--parallel.relayout", "3:0,4,6", "--checkpoint.final", "true")
    recs = equals_reference(tmp_path, MOD)  # predictor loss included, bitwise
    seqs, T = 8, 128
    for r in recs:
        assert per_block(r, "mod_capacity") == CAPS
        rows = per_block(r, "mod_rows")
        # compute only on the chosen tokens: batch x ceil(capacity x T) rows per forward
        assert rows == [seqs * min(T, max(1, math.ceil(c * T))) for c in CAPS]
        assert per_block(r, "mod_tokens_processed") == rows and per_block(r, "mod_active_tokens") == [seqs * T] * 4
        chooses = [i for i, c in zip(BLOCK_LAYERS, CAPS) if c < 1.0]  # a block at capacity 1.0 has no predictor
        assert all(0.0 <= r["mod_predictor_accuracy"][i] <= 1.0 for i in chooses)
        assert all(r["mod_predictor_accuracy"][i] is None for i in BLOCK_LAYERS if i not in chooses)
    # measured per-layer cost follows the 16x capacity contrast: every full block is slower
    # than every 1/16 block (medians over the steps after the first; a wide margin, no threshold)
    cost = [statistics.median(r["layer_fwd_s"][i] + r["layer_bwd_s"][i] for r in recs[1:]) for i in BLOCK_LAYERS]
    full = [c for c, cap in zip(cost, CAPS) if cap == 1.0]
    low = [c for c, cap in zip(cost, CAPS) if cap < 1.0]
    assert min(full) > max(low), cost


# ---- auxiliary losses under the zero-bubble schedules -----------------------------------------

ZB_CAPS = [1.0, 0.25, 0.5, 0.125]


@pytest.mark.parametrize("block_args,schedule,extra", [
    (MOE, "interleavedzb", []),
    (["--model.block", "mod", "--model.mod.capacities", ";".join(map(str, ZB_CAPS))], "zbv",
     ["--train.activation_checkpointing", "1-2"]),
])
def test_aux_losses_under_zero_bubble_schedules_match_reference(tmp_path, block_args, schedule, extra):
    # zero bubble splits backward into input and weight gradients; the auxiliary loss's
    # gradient (router, MoD predictor) must land in the weight pass all the same. With blocks
    # checkpointed, each recomputes twice (for the input gradient, again for the weight
    # gradient): the losses stay the reference's and neither recomputation counts as a forward
    run_train(tmp_path, "--steps", str(STEPS), *block_args, "--parallel.schedule", schedule,
              "--parallel.virtual_stages", "2", "--parallel.relayout", "2:0,2,3,5,6", "--checkpoint.final", "true",
              *extra)
    recs = equals_reference(tmp_path, block_args, exact=False)
    assert recs[2]["layout"] == [0, 2, 3, 5, 6]
    if "mod" in block_args:
        seqs, T = 8, int(_arg("--model.seq_len"))
        for r in recs:
            assert per_block(r, "mod_rows") == [seqs * math.ceil(c * T) for c in ZB_CAPS]


# ---- hash-sparse attention -------------------------------------------------------------------

HASH = ["--model.block", "hashattn", "--model.hashattn.n_buckets", "4", "--model.hashattn.chunk", "4"]


def test_hashattn_skips_work_that_changes_with_the_hashes(tmp_path):
    run_train(tmp_path, "--steps", str(STEPS), *HASH, "--checkpoint.final", "true")
    recs = equals_reference(tmp_path, HASH)
    n = 32 // 4  # tiles per sequence
    causal = 8 * 2 * n * (n + 1) // 2  # sequences x heads x causal tiles, per step
    computed = []
    for r in recs:
        bc = per_block(r, "hashattn_blocks_computed")
        assert per_block(r, "hashattn_blocks_causal") == [causal] * N_BLOCKS
        for c, f in zip(bc, per_block(r, "hashattn_skipped_fraction")):
            assert 0 < c < causal and f == pytest.approx(1 - c / causal)
        for tpb in per_block(r, "hashattn_tokens_per_bucket"):
            assert len(tpb) == 4 and sum(tpb) == TOKENS * 2  # every query of every head, once
        computed.append(tuple(bc))
    # the hash distribution, and with it the work of each block, moves as the weights train
    assert len(set(computed)) > 1
    assert len({c for step in computed for c in step}) > N_BLOCKS
