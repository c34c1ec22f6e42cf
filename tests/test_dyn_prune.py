"""Gradual global magnitude pruning: the schedule, the distributed global mask against
torch.nn.utils.prune.global_unstructured (raw magnitudes, and the normalized and LAMP scores
with and without a per-tensor density floor), the CSR kernel against masked dense, and the
real launcher end to end (pruned weights stay zero through training and migration, densities
and counted per-layer work in the metrics, masks independent of the layout and rank count,
structured pruning shrinks the matrices)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as tprune
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dynmo.config import ConfigError, ModelConfig, PruneConfig
from dynmo.dynamics.prune import PRUNABLE, check_options, floor_count, keep_with_floor, scores, sparsity_at
from dynmo.dynamics.topk import global_keep
from dynmo.model.layers import LayerSpec, build_layer
from dynmo.model.sparse import Pattern, _CSRLinear
from tests.conftest import metrics, run_train


def test_cubic_schedule_reaches_the_papers_sparsities():
    p = PruneConfig(enabled=True, start_step=3000, every=1000, times=4, initial_sparsity=0.0, final_sparsity=0.9)
    got = {t: sparsity_at(t, p) for t in range(0, 9000, 500) if sparsity_at(t, p) is not None}
    assert sorted(got) == [3000, 4000, 5000, 6000, 7000]
    assert [round(got[t], 2) for t in sorted(got)] == [0.0, 0.52, 0.79, 0.89, 0.9]
    with pytest.raises(ConfigError, match="final_sparsity"):
        check_options(PruneConfig(final_sparsity=1.0))
    with pytest.raises(ConfigError, match="kernel"):
        check_options(PruneConfig(kernel="bsr"))
    with pytest.raises(ConfigError, match="prune.scoring='l2'"):
        check_options(PruneConfig(scoring="l2"))
    for bad in (-0.1, 1.0):
        with pytest.raises(ConfigError, match="min_density"):
            check_options(PruneConfig(min_density=bad))
    with pytest.raises(ConfigError, match="min_density=0.2 cannot hold at prune.final_sparsity=0.9"):
        check_options(PruneConfig(min_density=0.2, final_sparsity=0.9))
    check_options(PruneConfig(min_density=0.1, final_sparsity=0.9, scoring="lamp"))


def blocks(n=3, d=32):
    cfg = ModelConfig(d_model=d, n_heads=2, seq_len=16, n_layers=n, mlp_ratio=4)
    return [build_layer(LayerSpec("t", i + 1), cfg, seed=7) for i in range(n)]


def torch_global(model_blocks, amount):
    params = [(b.get_submodule(name), "weight") for b in model_blocks for name in PRUNABLE]
    tprune.global_unstructured(params, pruning_method=tprune.L1Unstructured, amount=amount)
    return [m.weight_mask.bool() for m, _ in params]


def test_global_keep_equals_global_unstructured_over_repeated_steps():
    ours, ref = blocks(), blocks()
    with torch.no_grad():  # layers of very different scale: global, not per-layer, pruning
        for k, b in enumerate(ours + ref):
            for name in PRUNABLE:
                b.get_submodule(name).weight.mul_(1 + (k % 3))
    lins = [b.get_submodule(name) for b in ours for name in PRUNABLE]
    total = sum(l.weight.numel() for l in lins)
    masks = None
    pruned_before = 0
    for s in (0.5, 0.8, 0.9):
        scores = [l.weight.detach().abs() if masks is None else l.weight.detach().abs().masked_fill(~m, -1.0)
                  for l, m in zip(lins, masks or [None] * len(lins))]
        masks = global_keep(scores, total - round(s * total))
        # torch prunes `amount` more of the still-unpruned entries (int amount = absolute count)
        want = torch_global(ref, round(s * total) - pruned_before)
        pruned_before = round(s * total)
        assert all(torch.equal(a, b) for a, b in zip(masks, want))
        assert sum(int(m.sum()) for m in masks) == total - round(s * total)
        densities = [float(m.float().mean()) for m in masks]
        assert max(densities) - min(densities) > 0.1  # global: layers differ


def test_global_keep_keeps_exactly_k_with_ties():
    scores = [torch.tensor([1.0, 2.0, 2.0, 2.0]), torch.tensor([[2.0, 0.5], [3.0, -1.0]])]
    m = global_keep(scores, 4)
    assert sum(int(x.sum()) for x in m) == 4 and bool(m[1][1, 0]) and not bool(m[1][1, 1])


def test_ties_at_the_threshold_follow_the_keys_not_the_list_order():
    a, b = torch.tensor([1.0, 2.0, 2.0]), torch.tensor([2.0, 3.0])
    ma, mb = global_keep([a, b], 3, keys=[1, 0], num_keys=2)  # b (key 0) gets the first tie
    assert ma.tolist() == [False, True, False] and mb.tolist() == [True, True]
    mb2, ma2 = global_keep([b, a], 3, keys=[0, 1], num_keys=2)
    assert torch.equal(ma, ma2) and torch.equal(mb, mb2)


# ---- scoring: the reference computations, written out independently -------------------------

def ref_normalized(w, live):
    """|w| over the RMS of the tensor's live entries, pruned ones counted as zeros."""
    m = torch.ones_like(w) if live is None else live.to(w.dtype)
    scale = float((w.double().square() * m.double()).sum().div(w.numel()).sqrt())
    return w.abs() / torch.tensor(scale or 1.0, dtype=torch.float32)


def ref_lamp(w, live):
    """LAMP: w_u^2 over the sum of w_v^2 of the live entries ranked at or above u."""
    a = w.abs().reshape(-1).tolist()
    alive = [True] * len(a) if live is None else live.reshape(-1).tolist()
    out, acc = [0.0] * len(a), 0.0
    for i in sorted((i for i in range(len(a)) if alive[i]), key=lambda i: (a[i], i), reverse=True):
        acc += a[i] * a[i]
        out[i] = a[i] * a[i] / acc if acc > 0 else 0.0
    return torch.tensor(out, dtype=torch.float64).float().view(w.shape)


REF = {"magnitude": lambda w, live: w.abs(), "normalized": ref_normalized, "lamp": ref_lamp}


def torch_global_scored(weights, ref_scores, amount, old):
    """torch.nn.utils.prune.global_unstructured over `weights` ranked by `ref_scores`."""
    lins = [torch.nn.Linear(1, 1) for _ in weights]
    for lin, w, m in zip(lins, weights, old):
        lin.weight = torch.nn.Parameter(w.clone())
        if m is not None:
            tprune.custom_from_mask(lin, "weight", m)
    tprune.global_unstructured([(l, "weight") for l in lins], tprune.L1Unstructured, amount=amount,
                               importance_scores={(l, "weight"): sc for l, sc in zip(lins, ref_scores)})
    return [l.weight_mask.bool() for l in lins]


def random_tensors(seed, shapes, scales):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*sh, generator=g) * sc for sh, sc in zip(shapes, scales)]


SHAPES = st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=6)
SCALES = st.floats(1e-3, 10.0)


@settings(max_examples=40, deadline=None)
@given(scoring=st.sampled_from(["magnitude", "normalized", "lamp"]), shapes=SHAPES, data=st.data(),
       seed=st.integers(0, 2**31 - 1), sparsities=st.lists(st.floats(0.05, 0.95), min_size=1, max_size=3))
def test_scored_global_keep_equals_global_unstructured_on_the_reference_scores(scoring, shapes, data, seed, sparsities):
    ws = random_tensors(seed, shapes, data.draw(st.lists(SCALES, min_size=len(shapes), max_size=len(shapes))))
    total = sum(w.numel() for w in ws)
    masks, pruned = [None] * len(ws), 0
    for s in sorted(sparsities):
        target = max(pruned, round(s * total))
        ref_sc = [REF[scoring](w, m) for w, m in zip(ws, masks)]
        ours = [scores(w.abs(), m, scoring) for w, m in zip(ws, masks)]
        for a, b, m in zip(ours, ref_sc, masks):  # the same scores on the candidates, -1 elsewhere
            assert torch.equal(a if m is None else a[m], b if m is None else b[m])
            assert m is None or bool((a[~m] == -1).all())
        # no exact tie at the cut (where torch's topk picks arbitrarily)
        cand = torch.cat([(b if m is None else b[m]).reshape(-1) for b, m in zip(ref_sc, masks)]).sort(descending=True).values
        k = total - target
        assume(k == 0 or k == cand.numel() or bool(cand[k - 1] != cand[k]))
        got = global_keep(ours, k)
        want = torch_global_scored(ws, ref_sc, target - pruned, masks)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        masks, pruned = got, target


@settings(max_examples=60, deadline=None)
@given(scoring=st.sampled_from(["magnitude", "normalized", "lamp"]), shapes=SHAPES, data=st.data(),
       seed=st.integers(0, 2**31 - 1), floor=st.floats(0.0, 0.5),
       sparsities=st.lists(st.floats(0.05, 0.99), min_size=1, max_size=3))
def test_density_floor_holds_and_the_rest_is_one_global_cut(scoring, shapes, data, seed, floor, sparsities):
    ws = random_tensors(seed, shapes, data.draw(st.lists(SCALES, min_size=len(shapes), max_size=len(shapes))))
    total = sum(w.numel() for w in ws)
    floors = [floor_count(floor, w.numel()) for w in ws]
    masks, prev = [None] * len(ws), None
    for s in sorted(sparsities):
        keep = total - round(s * total)
        sc = [scores(w.abs(), m, scoring) for w, m in zip(ws, masks)]
        got, kept = keep_with_floor(sc, keep, floors, keys=list(range(len(ws))), num_keys=len(ws))
        live = [int(m.sum()) for m in got]
        assert sum(live) == kept == max(keep, sum(min(f, w.numel() if m is None else int(m.sum()))
                                                 for f, w, m in zip(floors, ws, masks)))
        for n, f, w, m in zip(live, floors, ws, masks):  # the floor holds (as far as the live entries allow)
            assert n >= min(f, w.numel() if m is None else int(m.sum()))
            assert n >= math.ceil(floor * w.numel() - 1e-6) or (m is not None and n == int(m.sum()))
        if prev is not None:  # never revived
            assert all(not bool((g & ~p).any()) for g, p in zip(got, prev))
        # reference: each tensor's best `floor` candidates, then the best of all the others
        flat = torch.cat([x.reshape(-1) for x in sc])
        reserved = torch.zeros_like(flat, dtype=torch.bool)
        off = 0
        for x, f in zip(sc, floors):
            xs = x.reshape(-1).tolist()
            best = sorted((i for i in range(len(xs)) if xs[i] >= 0), key=lambda i: (-xs[i], i))[:f]
            reserved[[off + i for i in best]] = True
            off += x.numel()
        rest = flat.masked_fill(reserved | (flat < 0), -1.0)
        n_rest = max(0, min(keep - int(reserved.sum()), int((rest >= 0).sum())))
        order = rest.sort(descending=True, stable=True)
        assume(n_rest == 0 or n_rest == int((rest >= 0).sum()) or bool(order.values[n_rest - 1] != order.values[n_rest]))
        want = reserved.clone()
        want[order.indices[:n_rest]] = True
        assert torch.equal(torch.cat([g.reshape(-1) for g in got]), want)
        masks, prev = got, got


@pytest.mark.parametrize("density", [0.05, 0.3])
def test_csr_kernel_equals_masked_dense_and_leaves_pruned_grads_zero(density):
    torch.manual_seed(0)
    w = torch.randn(48, 32)
    mask = torch.rand(48, 32) < density
    b = torch.randn(48)
    x = torch.randn(2, 10, 32)
    outs = []
    for kernel in ("dense", "csr"):
        wi, bi, xi = (t.clone().requires_grad_(True) for t in (w * mask, b, x))
        y = F.linear(xi, wi * mask, bi) if kernel == "dense" else _CSRLinear.apply(xi, wi, bi, Pattern(mask))
        (y * torch.linspace(-1, 1, 48)).sum().backward()
        outs.append((y, xi.grad, wi.grad, bi.grad))
    for a, c in zip(*outs):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
    assert torch.equal(outs[1][2][~mask], torch.zeros(int((~mask).sum())))
    assert Pattern(mask).nnz == int(mask.sum())


# ---- end to end ---------------------------------------------------------------------------

def flat(ckpt, tmp):
    dcp_to_torch_save(str(ckpt), str(tmp / (ckpt.name + ".pt")))
    return {k: v for k, v in torch.load(tmp / (ckpt.name + ".pt")).items() if not k.startswith("optim.")}


PRUNE = ["--prune.enabled", "true", "--prune.start_step", "0", "--prune.every", "3", "--prune.times", "2",
         "--prune.final_sparsity", "0.8"]  # pruning steps 3 (70%) and 6 (80%); step 0 would prune 0%
MAGNITUDE = ["--prune.scoring", "magnitude", "--prune.min_density", "0"]  # torch's global_unstructured
NAMES = [f"block{b}.{n}.weight" for b in range(4) for n in PRUNABLE]


def reference_masks(weights, amount, old=None):
    """torch.nn.utils.prune.global_unstructured on the whole model's block weights."""
    lins = [torch.nn.Linear(1, 1) for _ in NAMES]
    for i, (lin, k) in enumerate(zip(lins, NAMES)):
        lin.weight = torch.nn.Parameter(weights[k].clone())
        if old is not None:
            tprune.custom_from_mask(lin, "weight", old[i])
    tprune.global_unstructured([(l, "weight") for l in lins], tprune.L1Unstructured, amount=amount)
    return [l.weight_mask.bool() for l in lins]


@pytest.mark.dist
def test_distributed_pruning_mask_is_global_unstructured_and_survives_training_and_migration(tmp_path):
    # checkpoint-k holds the weights before step k; a migration at step 5 moves pruned blocks
    run_train(tmp_path, "--steps", "9", *PRUNE, *MAGNITUDE, "--prune.kernel", "auto", "--parallel.relayout", "5:0,2,6",
              "--checkpoint.every", "3")
    recs = metrics(tmp_path)
    assert [r["step"] for r in recs if any(e["type"] == "dynamism" for e in r["events"])] == [3, 6]
    w3, w6, w9 = (flat(tmp_path / f"checkpoint-{s}", tmp_path) for s in (3, 6, 9))
    total = sum(w3[k].numel() for k in NAMES)
    m1 = reference_masks(w3, round(0.7 * total))
    # the distributed mask of step 3 is torch's, and training (and the migration) kept it
    assert all(torch.equal(w6[k] != 0, m) for k, m in zip(NAMES, m1))
    m2 = reference_masks(w6, round(0.8 * total) - round(0.7 * total), m1)
    assert all(torch.equal(w9[k] != 0, m) for k, m in zip(NAMES, m2))
    # E, L, norms and biases are never pruned
    assert (w9["embed.tok.weight"] != 0).all() and (w9["head.lm_head.weight"] != 0).all()
    per_block = total // 4
    dens = recs[-1]["prune_density"]
    assert dens[0] is None and dens[-1] is None
    assert dens[1:-1] == [sum(int((w9[f"block{b}.{n}.weight"] != 0).sum()) for n in PRUNABLE) / per_block
                          for b in range(4)]
    assert sum(d * per_block for d in dens[1:-1]) == pytest.approx(0.2 * total, abs=0.5)
    # one global threshold, not a per-layer quota: the residual projections (initialised
    # 1/sqrt(2 n_layers) smaller) lose far more weights than qkv
    d = {n: float((w9[f"block0.{n}.weight"] != 0).float().mean()) for n in PRUNABLE}
    assert d["attn.proj"] < 0.5 * d["attn.qkv"] and d["mlp.proj"] < 0.5 * d["mlp.fc"]
    assert [r["prune_density"][1:-1] for r in recs[:3]] == [[1.0] * 4] * 3
    assert all(k in (0.0, 1.0) for k in recs[-1]["prune_kernel"][1:-1])
    assert all(t > 0 for t in recs[-1]["prune_dense_ms"][1:-1] + recs[-1]["prune_csr_ms"][1:-1])
    # each pruned Linear's mask features, in PRUNABLE order, carried through the migration
    for b in range(4):
        masks = [w9[f"block{b}.{n}.weight"] != 0 for n in PRUNABLE]
        assert recs[-1]["prune_rows_max"][b + 1] == [float(m.sum(1).max()) for m in masks]
        assert recs[-1]["prune_cols_nz_density"][b + 1] == pytest.approx([float(m.any(0).float().mean()) for m in masks])
    # kernel times are priced from the features once a pruning step has been measured
    assert recs[3].get("prune_csr_pred_ms") is None
    assert all(t > 0 for t in recs[6]["prune_csr_pred_ms"][1:-1] + recs[6]["prune_dense_pred_ms"][1:-1])
    # resuming restores the masks from the saved zeros (then prunes again at step 6): same run
    run_train(tmp_path / "resumed", "--steps", "9", *PRUNE, *MAGNITUDE, "--prune.kernel", "csr",
              "--checkpoint.resume", str(tmp_path / "checkpoint-6"), "--parallel.layout", "0,2,6")
    assert [r["loss"] for r in metrics(tmp_path / "resumed")] == pytest.approx([r["loss"] for r in recs[6:]], rel=1e-5)


FLOORED = [*PRUNE, "--prune.scoring", "magnitude", "--prune.min_density", "0.15"]  # the floor binds here


def reference_floored_masks(weights, amount, floor, old=None, scoring="magnitude"):
    """global_unstructured on the scores, each tensor's best `floor` candidates forced in."""
    ws = [weights[k] for k in NAMES]
    ref = []
    for w, m in zip(ws, old or [None] * len(ws)):
        sc = REF[scoring](w, m).clone()
        cand = sc.reshape(-1) if m is None else sc.reshape(-1).masked_fill(~m.reshape(-1), -1.0)
        sc.view(-1)[torch.argsort(cand, descending=True, stable=True)[: floor_count(floor, w.numel())]] = float("inf")
        ref.append(sc)
    return torch_global_scored(ws, ref, amount, old or [None] * len(ws))


@pytest.mark.dist
def test_distributed_floored_masks_are_the_single_process_reference_on_any_layout_and_rank_count(tmp_path):
    # 2 ranks, blocks 0 | 1-3, block 1 moving to rank 0 between the two pruning steps (3 and 6)
    run_train(tmp_path / "a", "--steps", "7", *FLOORED, "--parallel.layout", "0,2,6", "--parallel.relayout", "5:0,3,6",
              "--checkpoint.every", "3", "--checkpoint.final", "true")
    w3, w6, w7 = (flat(tmp_path / "a" / f"checkpoint-{s}", tmp_path) for s in (3, 6, "final"))
    total = sum(w3[k].numel() for k in NAMES)
    m1 = reference_floored_masks(w3, round(0.7 * total), 0.15)
    assert all(torch.equal(w6[k] != 0, m) for k, m in zip(NAMES, m1))
    m2 = reference_floored_masks(w6, round(0.8 * total) - round(0.7 * total), 0.15, m1)
    assert all(torch.equal(w7[k] != 0, m) for k, m in zip(NAMES, m2))
    live = {k: int(m.sum()) for k, m in zip(NAMES, m2)}
    assert sum(live.values()) == total - round(0.8 * total)
    floors = {k: floor_count(0.15, w3[k].numel()) for k in NAMES}
    assert all(live[k] >= floors[k] for k in NAMES)
    # the floor is what keeps the residual projections (initialised 1/sqrt(2 n_layers) smaller)
    assert all(live[f"block{b}.attn.proj.weight"] == floors[f"block{b}.attn.proj.weight"] for b in range(4))
    assert all(live[f"block{b}.attn.qkv.weight"] > floors[f"block{b}.attn.qkv.weight"] for b in range(4))
    # the step-6 cut from the same weights on one rank holding all blocks: the same masks
    run_train(tmp_path / "b", "--steps", "7", *FLOORED, "--checkpoint.resume", str(tmp_path / "a" / "checkpoint-6"),
              "--checkpoint.final", "true", nproc=1)
    wb = flat(tmp_path / "b" / "checkpoint-final", tmp_path)
    assert all(torch.equal(wb[k] != 0, w7[k] != 0) for k in NAMES)


# ---- structured -----------------------------------------------------------------------------

def test_structured_shrink_removes_units_and_a_full_size_block_loads_the_smaller_weights():
    from dynmo.dynamics.prune import shrink_mlp, unit_scores

    torch.manual_seed(0)
    b = blocks(1)[0]
    x = torch.randn(2, 5, 32)
    keep = unit_scores(b.mlp).topk(40).indices.sort().values
    ref = b.mlp.proj.weight.detach().clone()
    with torch.no_grad():  # what removing the units means: their proj columns contribute nothing
        zeroed = torch.zeros_like(ref)
        zeroed[:, keep] = ref[:, keep]
        b.mlp.proj.weight.copy_(zeroed)
        want = b.mlp(x)
    shrink_mlp(b.mlp, keep)
    assert b.mlp.fc.weight.shape == (40, 32) and b.mlp.proj.weight.shape == (32, 40)
    torch.testing.assert_close(b.mlp(x), want, rtol=1e-5, atol=1e-6)
    fresh = blocks(1)[0]  # as a receiving rank rebuilds a migrated block: full size, then load
    fresh.load_state_dict(b.state_dict(), strict=True)
    assert fresh.mlp.fc.out_features == 40
    torch.testing.assert_close(fresh(x, None)[0], b(x, None)[0])


STRUCT = [*PRUNE, *MAGNITUDE, "--prune.structured", "true", "--steps", "9"]


@pytest.mark.dist
def test_structured_pruning_shrinks_blocks_globally_and_migrates_them_exactly(tmp_path):
    run_train(tmp_path / "moved", *STRUCT, "--parallel.relayout", "5:0,2,6;7:0,4,6", "--checkpoint.every", "3")
    run_train(tmp_path / "static", *STRUCT)
    moved, static = metrics(tmp_path / "moved"), metrics(tmp_path / "static")
    # shrunk blocks (weights, grads, AdamW moments) move both ways and train identically
    assert [r["loss"] for r in moved] == [r["loss"] for r in static]
    assert moved[-1]["layout"] == [0, 4, 6]
    h = 4 * 64
    hidden = [[int(v) for v in r["prune_hidden"][1:-1]] for r in moved]
    assert hidden[2] == [h] * 4
    assert sum(hidden[3]) == 4 * h - round(0.7 * 4 * h) and sum(hidden[-1]) == 4 * h - round(0.8 * 4 * h)
    # the units kept at step 3 are the global top-k by norm over the whole model
    w3, w6 = flat(tmp_path / "moved" / "checkpoint-3", tmp_path), flat(tmp_path / "moved" / "checkpoint-6", tmp_path)
    norms = torch.cat([(w3[f"block{b}.mlp.fc.weight"].pow(2).sum(1) + w3[f"block{b}.mlp.fc.bias"].pow(2)
                        + w3[f"block{b}.mlp.proj.weight"].pow(2).sum(0)).sqrt() for b in range(4)])
    keep = torch.zeros_like(norms, dtype=torch.bool)
    keep[norms.topk(sum(hidden[3])).indices] = True
    assert [int(k.sum()) for k in keep.split(h)] == hidden[3]
    assert [w6[f"block{b}.mlp.fc.weight"].shape[0] for b in range(4)] == hidden[3]
    dens = moved[-1]["prune_density"][1:-1]
    assert all(0 < d < 1 for d in dens) and moved[-1]["prune_macs_per_token"][1] < moved[2]["prune_macs_per_token"][1]
    # resuming the narrowed model (from the widths in dynmo.json) continues the same trajectory,
    # through the second pruning step at 6, on another layout
    run_train(tmp_path / "resumed", *STRUCT, "--checkpoint.resume", str(tmp_path / "moved" / "checkpoint-6"))
    resumed = metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [6, 7, 8]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in static[6:]], rel=1e-6)
    assert [[int(v) for v in r["prune_hidden"][1:-1]] for r in resumed] == hidden[6:]
