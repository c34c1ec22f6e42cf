"""bf16 mixed precision, activation checkpointing, explicit gradient scaling, measured memory.

Single-process tests run a `StageModule` over every layer of a tiny model of each family and
block variant; the distributed ones go through the real launcher.
"""

import math

import pytest
import torch

from dynmo.config import BalanceConfig, ConfigError, load_config
from dynmo.loop import DynmoLoop
from dynmo.model.gpt import loss_fn
from dynmo.model.layers import FAMILIES, build_layer, layer_specs
from dynmo.model.moe import MoEBlock
from dynmo.plan import recompute_blocks
from dynmo.record import StepRecord
from dynmo.runtime.stage import StageModule
from tests.conftest import metrics, run_train
from tests.reference import reference_run, tiny_config

VARIANTS = [(fam, block) for fam, f in FAMILIES.items() for block in f.blocks]


def tiny_model(family: str, block: str):
    cfg = load_config(None, [
        "--model.family", family, "--model.block", block, "--model.n_layers", "3", "--model.d_model", "32",
        "--model.n_heads", "2", "--model.seq_len", "16", "--model.vocab_size", "64",
        "--model.moe.num_experts", "4", "--model.hashattn.chunk", "4", "--model.mod.capacity", "0.5",
    ])
    return cfg, [build_layer(s, cfg.model, 7) for s in layer_specs(cfg.model)]


def batch(cfg, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, cfg.model.vocab_size, (n, cfg.model.seq_len + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def stage(layers, dtype=torch.float32, recompute=frozenset(), profile=True):
    idx = list(range(len(layers)))
    return StageModule([f"l{i}" for i in idx], layers, idx, profile=profile, dtype=dtype, recompute=recompute)


def step(module, x, y) -> tuple[float, list[torch.Tensor]]:
    for p in module.parameters():
        p.grad = None
    loss = loss_fn(module(x), y)
    loss.backward()
    return loss.item(), [p.grad for p in module.parameters()]


@pytest.mark.parametrize("family,block", VARIANTS)
def test_bf16_computes_in_bf16_over_fp32_parameters(family, block):
    cfg, layers = tiny_model(family, block)
    x, y = batch(cfg)
    seen = []
    for layer in layers[1:-1]:
        layer.register_forward_hook(lambda m, a, out: seen.append(a[0].dtype))
    module = stage(layers, torch.bfloat16)
    logits = module(x)
    assert logits.dtype == torch.bfloat16
    assert seen and all(d == torch.bfloat16 for d in seen)  # what crosses every layer boundary
    loss = loss_fn(logits, y)
    loss.backward()
    assert math.isfinite(loss.item())
    params = list(module.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    grads = [p.grad for p in params if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    # close to the fp32 model: bf16 keeps about 3 significant digits
    ref = loss_fn(stage(layers)(x), y).item()
    assert abs(loss.item() - ref) < 0.02 * ref


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_bf16_active_token_path(family):
    """Early exit's path (only the active tokens computed) under bf16."""
    cfg, layers = tiny_model(family, "dense")
    for layer in layers[1:-1]:
        layer.skip_inactive = True
    x, _ = batch(cfg)
    h, mask = stage(layers[:1], torch.bfloat16)(x)
    mask = mask.clone()
    mask[:, ::3] = False
    out, out_mask = stage(layers[1:-1], torch.bfloat16)(h.detach().requires_grad_(), mask)
    assert out.dtype == torch.bfloat16 and torch.equal(out_mask, mask)
    assert torch.equal(out[~mask], h[~mask])  # inactive tokens pass bit for bit
    out.float().sum().backward()


@pytest.mark.parametrize("family,block", VARIANTS)
def test_activation_checkpointing_is_bitwise_and_keeps_only_inputs(family, block):
    cfg, layers = tiny_model(family, block)
    x, y = batch(cfg)
    blocks = frozenset(range(1, len(layers) - 1))
    plain, ckpt = stage(layers), stage(layers, recompute=blocks)
    calls = {i: 0 for i in blocks}
    for i in blocks:
        # a pre-hook: the recomputation stops as soon as it has what backward needs (early stop),
        # before a forward hook would run
        layers[i].register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    loss_a, grads_a = step(plain, x, y)
    grads_a = [None if g is None else g.clone() for g in grads_a]
    assert set(calls.values()) == {1}
    loss_b, grads_b = step(ckpt, x, y)
    assert set(calls.values()) == {3}  # forward, then the recomputation inside backward
    assert loss_a == loss_b
    for a, b in zip(grads_a, grads_b):
        assert (a is None and b is None) or torch.equal(a, b)
    kept_a, kept_b = plain.layer_act_bytes(), ckpt.layer_act_bytes()
    for i in blocks:
        assert 0 < kept_b[i] < kept_a[i]
    # a checkpointed block keeps exactly its inputs: the hidden state (and the token mask)
    B, T, D = x.shape[0], cfg.model.seq_len, cfg.model.d_model
    assert kept_b[2] == B * T * D * 4  # the mask is the same storage block 1 already counted
    assert kept_b[1] == B * T * D * 4 + B * T  # block 1 counts the mask once


@pytest.mark.parametrize("family", [fam for fam, f in FAMILIES.items() if "moe" in f.blocks])
def test_the_grouped_products_first_probe_inside_a_checkpointed_block(family, monkeypatch):
    """`grouped_mm` probes once per shape whether torch's grouped product runs; where that first
    call falls inside a checkpointed block's forward, the probe's own tensors are not what the
    checkpoint saved (the recomputation, which finds the answer known, must save the same: it
    failed with "a different number of tensors was saved") nor activations the profiler counts."""
    from dynmo.model import grouped

    cfg, layers = tiny_model(family, "moe")
    x, y = batch(cfg)
    blocks = frozenset(range(1, len(layers) - 1))
    monkeypatch.setattr(grouped, "_WORKS", {})  # nothing probed yet: the first forward probes
    cold = stage(layers)
    loss_a, grads_a = step(cold, x, y)
    grads_a = [None if g is None else g.clone() for g in grads_a]
    warm = stage(layers)
    step(warm, x, y)
    assert cold.layer_act_bytes() == warm.layer_act_bytes()
    monkeypatch.setattr(grouped, "_WORKS", {})
    loss_b, grads_b = step(stage(layers, recompute=blocks), x, y)
    assert grouped._WORKS  # it did probe, inside the checkpointed forward
    assert loss_a == loss_b
    for a, b in zip(grads_a, grads_b):
        assert (a is None and b is None) or torch.equal(a, b)


def test_recomputation_is_not_counted_as_a_forward_in_step_statistics():
    cfg, layers = tiny_model("gpt", "moe")
    x, y = batch(cfg)
    step(stage(layers, recompute=frozenset({1, 2, 3})), x, y)
    moe = [layer for layer in layers if isinstance(layer, MoEBlock)]
    assert moe and all(layer._stats.forwards == 1 for layer in moe)


def test_checkpointed_backward_contains_the_recomputation():
    """The recomputed forward runs between the block's backward boundaries, so the profiler books
    it to that block's backward span (the benchmark shows the time)."""
    cfg, layers = tiny_model("gpt", "dense")
    x, y = batch(cfg)
    module = stage(layers, recompute=frozenset({2}))
    order = []
    layers[2].register_forward_pre_hook(lambda *a: order.append(("forward", len(module.spans))))
    module.reset_timers()
    module.begin_backward()
    loss_fn(module(x), y).backward()
    module.end_backward()
    recompute_at = order[1][1]
    spans = [(b, k) for b, k, *_ in module.spans]
    # the span booked when the recomputation ran is block 2's backward (layer 2)
    after = [sp for sp in spans[recompute_at:] if sp[0] == "b"]
    assert after[0] == ("b", 2)


@pytest.mark.parametrize("text,blocks", [("none", []), ("all", [0, 1, 2, 3]), ("1-2", [1, 2]), ("0,3", [0, 3]),
                                         (" 2 , 0-1 ", [0, 1, 2])])
def test_checkpointing_list(text, blocks):
    assert recompute_blocks(tiny_config("--train.activation_checkpointing", text)) == blocks


@pytest.mark.parametrize("text", ["4", "2-1", "x", "1-", "-1"])
def test_bad_checkpointing_list_is_refused(text):
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        recompute_blocks(tiny_config("--train.activation_checkpointing", text))


# ---- through the launcher --------------------------------------------------------------------

STEPS = 10
RELAYOUTS = "3:0,1,6;6:0,5,6"


@pytest.mark.dist
def test_bf16_trains_and_relayouts_keep_its_trajectory_bitwise(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    run_train(a, "--steps", str(STEPS), "--train.dtype", "bf16")
    run_train(b, "--steps", str(STEPS), "--train.dtype", "bf16", "--parallel.relayout", RELAYOUTS)
    la, lb = [r["loss"] for r in metrics(a)], [r["loss"] for r in metrics(b)]
    assert la == lb
    assert la[-1] < la[0]
    ref, _ = reference_run(tiny_config("--train.steps", str(STEPS)), STEPS)
    assert max(abs(p - q) for p, q in zip(la, ref)) < 0.02  # bf16 rounding, not another model
    recs = metrics(b)
    # migrations ship fp32 master weights and AdamW moments: per layer bytes as in fp32
    assert all(all(isinstance(x, float) for x in r["layer_act_bytes"]) for r in recs)
    assert recs[-1]["worker_peak_memory_bytes"] and min(recs[-1]["worker_peak_memory_bytes"]) > 0


@pytest.mark.dist
def test_checkpointing_keeps_fp32_losses_bitwise_and_travels_with_a_migrated_block(tmp_path):
    # block 1 (layer 2) checkpointed; the re-layout at step 3 moves it to stage 1, at 6 back
    run_train(tmp_path, "--steps", str(STEPS), "--train.activation_checkpointing", "1",
              "--parallel.relayout", RELAYOUTS)
    recs = metrics(tmp_path)
    ref, _ = reference_run(tiny_config("--train.steps", str(STEPS)), STEPS)
    assert [r["loss"] for r in recs] == ref
    for r in recs:
        act = r["layer_act_bytes"]
        # block 1 keeps its input only; block 0 and 2 (same shape, not checkpointed) keep more
        if r["layout"][1] not in (2, 3):  # block 1 is not its stage's first layer
            assert act[2] < act[1] and act[2] < act[3]
    # the balancer's memory model takes in what was really kept
    loop = DynmoLoop(BalanceConfig(memory_gb=1.0), microbatches=4, schedule="1f1b", layer_params=[1] * 6)
    loop.observe(StepRecord.from_json(recs[-1]))
    mem = loop.controller.memory
    state = recs[-1]["layer_state_bytes"]
    assert mem[2] - state[2] < mem[1] - state[1]


def test_sparse_kernel_and_freeze_probe_under_bf16():
    """The CSR kernel (no bf16 product on CPU) computes in fp32 and hands back bf16; the freeze
    probe measures in fp32 from a bf16 input."""
    from dynmo.dynamics.freeze import plasticity
    from dynmo.model.sparse import set_mask, time_kernels

    cfg, layers = tiny_model("gpt", "dense")
    block = layers[1]
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(block.mlp.fc.weight.shape, generator=g) > 0.7
    set_mask(block, "mlp.fc", mask, "csr")
    x, y = batch(cfg)
    module = stage(layers, torch.bfloat16)
    loss, grads = step(module, x, y)
    assert math.isfinite(loss) and block.mlp.fc.weight.grad.dtype == torch.float32
    ref = loss_fn(stage(layers)(x), y).item()
    assert abs(loss - ref) < 0.02 * ref
    times = time_kernels(block.mlp.fc, mask, rows=8, dtype=torch.bfloat16)
    assert set(times) == {"dense", "csr"} and all(t > 0 for t in times.values())
    h, m = layers[0](x)
    ref_state = {k: v.clone() for k, v in layers[2].state_dict().items()}
    assert plasticity(layers[2], ref_state, h.to(torch.bfloat16), m) == 0.0
