"""MoE block: both expert dispatches (grouped, the default, and padded) equal a plain per-expert
loop on many random inputs, forward and backward, and each other; the capacity factor is
honoured; the grouped one reads no device value and computes the kept rows only, the padded one
pads to the busiest expert; routing changes during training, and the auxiliary loss reaches the
gradients.

Tolerances (float32): outputs within 1e-6 of the reference loop, gradients within 1e-5;
grouped vs padded: outputs and gradients within 1e-6."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from dynmo.config import ModelConfig
from dynmo.model.aux_loss import attach_aux_loss
from dynmo.model.grouped import HAS_GROUPED_MM
from dynmo.model.moe import MoEBlock, MoEOptions
from dynmo.model.layers import BLOCKS, LayerSpec, build_layer
from dynmo.model.stats import as_numbers

B, T, D = 3, 16, 32


def make(**opts) -> MoEBlock:
    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2, mlp_ratio=2, block="moe")
    cfg.moe = MoEOptions(**{"num_experts": 4, **opts})  # the config field the runtime adds later
    return MoEBlock(cfg)


def stats(block: MoEBlock) -> dict:
    """The block's step statistics as numbers (they are kept as tensors)."""
    return as_numbers([block.last_stats])[0]


def perturb(block: MoEBlock, seed: int = 0) -> None:
    """Non-trivial biases and a sharper router, so the test sees real gate weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        block.moe.router.weight.mul_(20)


def reference_moe(block: MoEBlock, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Plain loop: route each token, run each expert on exactly its tokens with its own weights."""
    o = block.opts
    N = h.shape[0]
    probs = F.softmax(logits, dim=-1)
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
    h = block.ln2(x).reshape(-1, x.shape[-1])
    active = mask.reshape(-1).nonzero().squeeze(1)
    y = torch.zeros_like(h)
    y[active] = reference_moe(block, h[active], block.moe.router(h)[active])  # the router's bits, row for row
    return x + y.view(x.shape)


@pytest.mark.parametrize("dispatch", ["grouped", "padded"])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.75])
@pytest.mark.parametrize("partial_mask", [False, True])
def test_equals_per_expert_loop(capacity_factor, partial_mask, dispatch):
    torch.manual_seed(0)
    block = make(capacity_factor=capacity_factor, dispatch=dispatch)
    perturb(block)
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    if partial_mask:  # a block told that tokens may be inactive routes the active ones only
        block.skip_inactive = True
        mask[1, 5:] = False
    with torch.no_grad():
        out, m = block(x, mask)
        ref = reference_block(block, x, mask)
    assert m is mask
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    s = stats(block)
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


def skewed(block: MoEBlock, x: torch.Tensor):
    """Routers pushed towards experts 0 and 1 by growing skews: the busiest expert's load grows."""
    with torch.no_grad():
        w0 = block.moe.router.weight.clone() * 5  # a random, roughly balanced router
        shared = block.ln2(x).mean((0, 1))
    for skew in [0.0, 2.0, 8.0, 64.0]:
        with torch.no_grad():
            block.moe.router.weight.copy_(w0)
            block.moe.router.weight[:2] += shared * skew
        block.reset_stats()
        yield skew


def test_padded_compute_follows_routing_imbalance():
    torch.manual_seed(1)
    block = make(dispatch="padded")
    E, H = block.opts.num_experts, 2 * D
    x = torch.randn(B, T, D) + 0.3 * torch.randn(D)  # tokens share a direction the router can favour
    mask = torch.ones(B, T, dtype=torch.bool)
    rows = []
    for _ in skewed(block, x):
        f = bmm_flops(block, x, mask)
        s = stats(block)
        C = max(s["tokens_per_expert"])
        assert s["expert_rows"] == E * C  # padded to the busiest expert
        assert f == 2 * 2 * E * C * D * H  # two batched matmuls over the padded buffer
        assert s["routing_imbalance"] == pytest.approx(C / (B * T * 2 / E))
        rows.append(s["expert_rows"])
    # A skewed routing makes every expert pay (nearly) the busiest expert's N rows.
    assert rows == sorted(rows) and rows[-1] > 1.25 * rows[0] and rows[-1] > 0.9 * E * B * T


class GroupedCalls(TorchDispatchMode):
    """The shapes and computed rows of every `_grouped_mm` call, and the batched matmuls."""

    def __init__(self):
        super().__init__()
        self.grouped, self.bmm = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            offs = kwargs["offs"] if "offs" in kwargs else args[2]
            self.grouped.append((tuple(args[0].shape), tuple(args[1].shape), int(offs[-1])))
        if "bmm" in str(func):
            self.bmm += 1
        return func(*args, **kwargs)


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no grouped matmul (before 2.9)")
def test_grouped_computes_the_kept_rows_whatever_the_skew():
    torch.manual_seed(1)
    block = make()
    x = torch.randn(B, T, D) + 0.3 * torch.randn(D)
    mask = torch.ones(B, T, dtype=torch.bool)
    block(x, mask)  # the first call may probe torch's grouped matmul once
    imbalance = []
    for _ in skewed(block, x):
        with GroupedCalls() as calls:
            block(x, mask)
        s = stats(block)
        assert s["expert_rows"] == s["useful_rows"] == B * T * 2  # dropless: every assignment, once
        assert calls.bmm == 0 and [c[2] for c in calls.grouped] == [B * T * 2] * 2  # fc and proj, all rows
        imbalance.append(s["routing_imbalance"])
    assert imbalance[-1] > 1.25 * imbalance[0]  # the routing was skewed; the rows stayed


@pytest.mark.parametrize("dispatch", ["grouped", "padded"])
def test_capacity_is_honoured(dispatch):
    torch.manual_seed(2)
    block = make(capacity_factor=1.0, dispatch=dispatch)
    perturb(block)
    block(torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool))
    s = stats(block)
    cap = math.ceil(1.0 * B * T * 2 / 4)
    kept = sum(min(cap, n) for n in s["tokens_per_expert"])
    assert s["dropped"] > 0 and s["useful_rows"] == kept and s["useful_rows"] + s["dropped"] == B * T * 2
    if dispatch == "padded":
        assert s["expert_rows"] == 4 * min(cap, max(s["tokens_per_expert"]))
    else:
        assert s["expert_rows"] == kept


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="the per-expert loop (before torch 2.9) reads the offsets")
def test_grouped_reads_no_device_value(monkeypatch):
    """Routing, grouped expert compute, stats and backward never read a device value (on a GPU,
    each read would wait for the device), capacity factor and a partial mask included."""
    torch.manual_seed(7)
    block = make(capacity_factor=0.75)
    block.skip_inactive = True
    perturb(block)
    x, mask = torch.randn(B, T, D), torch.rand(B, T) > 0.3

    def forbidden(*a, **kw):
        raise AssertionError("read a device value")

    class NoSync(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            assert func not in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default), func
            return func(*args, **(kwargs or {}))

    block(x, mask)  # the first call may probe torch's grouped matmul once
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    with NoSync():
        out, _ = block(x, mask)
        out.square().sum().backward()
    monkeypatch.undo()
    assert stats(block)["forwards"] == 2


def grads_of(block: MoEBlock, x: torch.Tensor, mask: torch.Tensor, fn) -> list[torch.Tensor]:
    """The block's output and the gradients of a fixed random objective of it (params, then x)."""
    block.zero_grad()
    xi = x.clone().requires_grad_()
    out = fn(xi)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(11))
    (out * w).sum().backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in block.parameters()]
    return [out.detach()] + grads + [xi.grad.clone()]


@settings(max_examples=40, deadline=None)
@given(experts=st.integers(1, 6), k=st.integers(1, 6), cf=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
       norm=st.booleans(), t=st.integers(1, T), keep=st.sampled_from([1.0, 0.6, 0.0]), seed=st.integers(0, 2**31 - 1))
def test_grouped_equals_a_brute_force_loop_forward_and_backward(experts, k, cf, norm, t, keep, seed):
    """On random sizes, routings, capacities and masks: the grouped dispatch's output and every
    gradient equal a per-token, per-expert loop's; rows nobody computes (capacity) are filled
    with NaN by torch's deterministic mode, so a leak of them would show."""
    k = min(k, experts)
    torch.manual_seed(seed)
    block = make(num_experts=experts, top_k=k, capacity_factor=cf, norm_topk_prob=norm, aux_loss_coef=0.0)
    perturb(block, seed)
    block.skip_inactive = keep < 1.0  # every token active: the block does not read the mask
    x = torch.randn(2, t, D)
    mask = torch.rand(2, t) < keep
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # and fill uninitialised memory with NaN
    try:
        got = grads_of(block, x, mask, lambda xi: block(xi, mask)[0])
    finally:
        torch.use_deterministic_algorithms(was)
    ref = grads_of(block, x, mask, lambda xi: reference_block(block, xi, mask))
    torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=0)
    for a, b in zip(got[1:], ref[1:]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("inactive", [False, True], ids=["all-active", "inactive"])
@pytest.mark.parametrize("cf", [0.0, 4.0])  # dropless, and a capacity that drops nothing
def test_grouped_equals_padded_forward_and_backward(cf, inactive):
    torch.manual_seed(8)
    grouped = make(capacity_factor=cf)
    perturb(grouped)
    padded = make(capacity_factor=cf, dispatch="padded")
    padded.load_state_dict(grouped.state_dict())
    x, mask = torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool)
    if inactive:
        grouped.skip_inactive = padded.skip_inactive = True
        mask[0, 3:] = False

    def with_aux(block):
        def fn(xi):
            out, aux = block.forward_with_aux(xi, mask)
            return out + aux  # the balance loss's gradient too
        return fn

    a, b = grads_of(grouped, x, mask, with_aux(grouped)), grads_of(padded, x, mask, with_aux(padded))
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, atol=1e-6, rtol=0)
    sa, sb = stats(grouped), stats(padded)
    assert sa["dropped"] == sb["dropped"] == 0 and sa["tokens_per_expert"] == sb["tokens_per_expert"]
    assert sa["expert_rows"] == sa["useful_rows"] < sb["expert_rows"]


def test_stats_accumulate_over_microbatches_and_reset():
    torch.manual_seed(3)
    block = make()
    mask = torch.ones(B, T, dtype=torch.bool)
    block(torch.randn(B, T, D), mask)
    first = list(stats(block)["tokens_per_expert"])
    block(torch.randn(B, T, D), mask)
    assert stats(block)["forwards"] == 2
    assert sum(stats(block)["tokens_per_expert"]) == 2 * sum(first)
    assert isinstance(block.last_stats["expert_rows"], torch.Tensor)  # kept where it is until the metrics read it
    block.reset_stats()
    assert block.last_stats == {}


def toy_model(block):
    torch.manual_seed(4)
    head = torch.nn.Linear(D, 5)
    x = torch.randn(B, T, D)
    y = torch.randint(0, 5, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    return head, x, y, mask


def test_routing_changes_during_training_and_padded_cost_follows():
    torch.manual_seed(5)
    block = make(aux_loss_coef=0.01, dispatch="padded")
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
        s = stats(block)
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


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no grouped matmul (before 2.9)")
def test_grouped_matmul_equals_the_per_expert_loop_bitwise():
    """torch's grouped matmul (where it runs) and the fallback loop: the same bits, forward and
    backward, empty groups and uncomputed rows past the last offset included."""
    from dynmo.model.grouped import grouped_mm, loop_mm, uses_grouped_mm

    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(40, 16, generator=g), torch.randn(4, 16, 24, generator=g)
    offs = torch.tensor([7, 7, 20, 33], dtype=torch.int32)
    assert uses_grouped_mm(x, w)
    upstream = torch.randn(40, 24, generator=g)
    upstream[33:] = 0  # what a caller gives the uncomputed rows
    outs = []
    for fn in (grouped_mm, loop_mm):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, offs)
        y.backward(upstream)
        outs.append((y[:33], xi.grad[:33], wi.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_the_per_expert_loop_fallback_gives_the_grouped_block(monkeypatch):
    """Where torch has no grouped matmul (before 2.9) the block runs the per-expert loop: the same
    output and gradients, a capacity and inactive tokens included."""
    import dynmo.model.grouped as grouped

    torch.manual_seed(10)
    block = make(capacity_factor=0.75)
    block.skip_inactive = True
    perturb(block)
    x, mask = torch.randn(B, T, D), torch.rand(B, T) > 0.2
    got = grads_of(block, x, mask, lambda xi: block(xi, mask)[0])
    monkeypatch.setattr(grouped, "HAS_GROUPED_MM", False)
    loop = grads_of(block, x, mask, lambda xi: block(xi, mask)[0])
    for a, b in zip(got, loop):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
