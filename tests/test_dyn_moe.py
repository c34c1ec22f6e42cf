"""MoE block: equals a plain per-expert loop, routing changes during training, the counted
expert compute follows the routing imbalance, and the auxiliary loss reaches the gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dynmo.config import ModelConfig
from dynmo.model.aux_loss import attach_aux_loss
from dynmo.model.moe import MoEBlock, MoEOptions
from dynmo.model.layers import BLOCKS, LayerSpec, build_layer

B, T, D = 3, 16, 32


def make(**opts) -> MoEBlock:
    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2, mlp_ratio=2, block="moe")
    cfg.moe = MoEOptions(**{"num_experts": 4, **opts})  # the config field the runtime adds later
    return MoEBlock(cfg)


def perturb(block: MoEBlock, seed: int = 0) -> None:
    """Non-trivial biases and a sharper router, so the test sees real gate weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        block.moe.router.weight.mul_(20)


def reference_moe(block: MoEBlock, h: torch.Tensor) -> torch.Tensor:
    """Plain loop: route each token, run each expert on exactly its tokens with its own weights."""
    o = block.opts
    N = h.shape[0]
    probs = F.softmax(h @ block.moe.router.weight.t(), dim=-1)
    top_p, top_e = probs.topk(o.top_k, dim=-1)
    if o.norm_topk_prob:
        top_p = top_p / top_p.sum(-1, keepdim=True)
    cap = math.ceil(o.capacity_factor * N * o.top_k / o.num_experts) if o.capacity_factor > 0 else N * o.top_k
    count = [0] * o.num_experts
    chosen = {e: [] for e in range(o.num_experts)}  # expert -> [(token, weight)]
    for j in range(o.top_k):  # first choices before second choices, earlier tokens first
        for n in range(N):
            e = int(top_e[n, j])
            if count[e] < cap:
                chosen[e].append((n, top_p[n, j]))
            count[e] += 1
    fc, proj = block.moe.experts.fc, block.moe.experts.proj
    out = torch.zeros_like(h)
    for e, pairs in chosen.items():
        for n, w in pairs:
            y = F.gelu(h[n] @ fc.weight[e] + fc.bias[e]) @ proj.weight[e] + proj.bias[e]
            out[n] = out[n] + w * y
    return out


def reference_block(block: MoEBlock, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    x = x + block.attn(block.ln1(x))
    h = block.ln2(x).reshape(B * T, D)
    active = mask.reshape(-1).nonzero().squeeze(1)
    y = torch.zeros_like(h)
    y[active] = reference_moe(block, h[active])
    return x + y.view(B, T, D)


@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
@pytest.mark.parametrize("partial_mask", [False, True])
def test_equals_per_expert_loop(capacity_factor, partial_mask):
    torch.manual_seed(0)
    block = make(capacity_factor=capacity_factor)
    perturb(block)
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    if partial_mask:
        mask[1, 5:] = False
    with torch.no_grad():
        out, m = block(x, mask)
        ref = reference_block(block, x, mask)
    assert m is mask
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    s = block.last_stats
    assert sum(s["tokens_per_expert"]) == int(mask.sum()) * block.opts.top_k
    assert s["active_tokens"] == int(mask.sum())
    if capacity_factor:
        assert s["dropped"] > 0  # the sharp router overloads some expert past its capacity
    else:
        assert s["dropped"] == 0


def test_registered_and_built_by_spec():
    assert BLOCKS["moe"] is MoEBlock
    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2, block="moe")
    layer = build_layer(LayerSpec("t", 1), cfg, seed=1)
    assert isinstance(layer, MoEBlock) and layer.opts == MoEOptions()  # defaults without the config field
    out, _ = layer(torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool))
    assert out.shape == (B, T, D)


def bmm_flops(block, x, mask) -> int:
    with FlopCounterMode(display=False) as counter:
        block(x, mask)
    counts = counter.get_flop_counts()["Global"]
    return sum(v for op, v in counts.items() if "bmm" in str(op))


def test_expert_compute_follows_routing_imbalance():
    torch.manual_seed(1)
    block = make()
    E, H = block.opts.num_experts, 2 * D
    x = torch.randn(B, T, D) + 0.3 * torch.randn(D)  # tokens share a direction the router can favour
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        w0 = block.moe.router.weight.clone() * 5  # a random, roughly balanced router
        shared = block.ln2(x).mean((0, 1))
    rows, flops = [], []
    for skew in [0.0, 2.0, 8.0, 64.0]:
        # Push the router towards experts 0 and 1 by `skew`: the busiest expert's load grows.
        with torch.no_grad():
            block.moe.router.weight.copy_(w0)
            block.moe.router.weight[:2] += shared * skew
        block.reset_stats()
        f = bmm_flops(block, x, mask)
        s = block.last_stats
        C = max(s["tokens_per_expert"])
        assert s["expert_rows"] == E * C  # padded to the busiest expert
        assert f == 2 * 2 * E * C * D * H  # two batched matmuls over the padded buffer
        assert s["routing_imbalance"] == pytest.approx(C / (B * T * 2 / E))
        rows.append(s["expert_rows"])
        flops.append(f)
    # A skewed routing makes every expert pay (nearly) the busiest expert's N rows.
    assert rows == sorted(rows) and rows[-1] > 1.25 * rows[0] and rows[-1] > 0.9 * E * B * T


def test_capacity_caps_the_padded_rows():
    torch.manual_seed(2)
    block = make(capacity_factor=1.0)
    perturb(block)
    x = torch.randn(B, T, D)
    block(x, torch.ones(B, T, dtype=torch.bool))
    s = block.last_stats
    cap = math.ceil(1.0 * B * T * 2 / 4)
    assert s["expert_rows"] == 4 * min(cap, max(s["tokens_per_expert"]))
    assert s["useful_rows"] + s["dropped"] == B * T * 2


def test_stats_accumulate_over_microbatches_and_reset():
    torch.manual_seed(3)
    block = make()
    mask = torch.ones(B, T, dtype=torch.bool)
    block(torch.randn(B, T, D), mask)
    first = list(block.last_stats["tokens_per_expert"])
    block(torch.randn(B, T, D), mask)
    assert block.last_stats["forwards"] == 2
    assert sum(block.last_stats["tokens_per_expert"]) == 2 * sum(first)
    block.reset_stats()
    assert block.last_stats == {}


def toy_model(block):
    torch.manual_seed(4)
    head = torch.nn.Linear(D, 5)
    x = torch.randn(B, T, D)
    y = torch.randint(0, 5, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    return head, x, y, mask


def test_routing_changes_during_training_and_cost_follows():
    torch.manual_seed(5)
    block = make(aux_loss_coef=0.01)
    head, x, y, mask = toy_model(block)
    params = list(block.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=3e-2)
    loads, rows, losses = [], [], []
    for step in range(8):
        block.reset_stats()
        xb = x + 0.1 * torch.randn(B, T, D)  # a new microbatch each step
        out, _ = block(xb, mask)
        loss = F.cross_entropy(head(out).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        for p in params:
            assert p.grad is not None and torch.isfinite(p.grad).all()
        opt.step()
        s = block.last_stats
        loads.append(tuple(s["tokens_per_expert"]))
        rows.append(s["expert_rows"])
        assert s["expert_rows"] == block.opts.num_experts * max(s["tokens_per_expert"])
        losses.append(loss.item())
    assert len(set(loads)) > 1  # routing changes step to step
    assert len(set(rows)) > 1  # and so does the layer's counted expert compute
    assert losses[-1] < losses[0]


def test_aux_loss_gradients_equal_summed_objective():
    torch.manual_seed(6)
    coef = 0.3
    block = make(aux_loss_coef=coef)
    perturb(block)
    head, x, y, mask = toy_model(block)

    def grads(fn):
        block.zero_grad()
        head.zero_grad()
        xi = x.clone().requires_grad_()
        fn(xi).backward()
        return [p.grad.clone() for p in block.parameters()] + [xi.grad.clone()]

    def via_attach(xi):  # the pipeline path: the loss never sees the aux loss
        out, _ = block(xi, mask)
        return F.cross_entropy(head(out).flatten(0, 1), y.flatten())

    def summed(xi):  # the single-process objective
        out, aux = block.forward_with_aux(xi, mask)
        return F.cross_entropy(head(out).flatten(0, 1), y.flatten()) + coef * aux

    def without(xi):
        out, _ = block.forward_with_aux(xi, mask)
        return F.cross_entropy(head(out).flatten(0, 1), y.flatten())

    a, b, c = grads(via_attach), grads(summed), grads(without)
    for ga, gb in zip(a, b):
        torch.testing.assert_close(ga, gb, atol=1e-7, rtol=1e-6)
    router = [n for n, _ in block.named_parameters()].index("moe.router.weight")
    assert not torch.allclose(a[router], c[router])  # the aux loss really contributes


def test_attach_aux_loss_is_identity_forward_and_seeds_coef():
    w = torch.tensor([2.0, -1.0], requires_grad=True)
    x = torch.ones(3, requires_grad=True)
    aux = (w**2).sum()
    out = attach_aux_loss(x * 1.0, aux, 0.5)
    assert torch.equal(out, x)
    out.add_(0.0)  # the output is a tensor of its own: in-place use is allowed
    out.sum().backward()
    torch.testing.assert_close(w.grad, 0.5 * 2 * w.detach())
    torch.testing.assert_close(x.grad, torch.ones(3))
    with torch.no_grad():  # no graph, nothing to attach
        assert attach_aux_loss(x, aux, 0.5) is x
