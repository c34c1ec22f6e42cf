"""Mixture of Depths block: unchosen tokens pass bit for bit, the chosen ones get the dense
block's update, compute scales with the capacity, and the predictor is trained via the aux loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from dynmo.config import ModelConfig
from dynmo.model.mod import MoDBlock, MoDOptions
from dynmo.model.gpt import Block
from dynmo.model.layers import BLOCKS, LayerSpec, build_layer
from tests.toy import train_block

B, T, D = 3, 16, 32


def cfg_with(**opts) -> ModelConfig:
    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2, mlp_ratio=2, block="mod")
    cfg.mod = MoDOptions(**opts)  # the config field the runtime adds later
    return cfg


def make(**opts) -> MoDBlock:
    block = MoDBlock(cfg_with(**opts))
    with torch.no_grad():  # non-trivial router scores, so top-k is well defined
        block.router.weight.normal_(0.0, 1.0)
    return block


def chosen_by_router(block, x, mask, k):
    with torch.no_grad():
        r = block.router(x).squeeze(-1).masked_fill(~mask, float("-inf"))
    return torch.zeros_like(mask).scatter(1, r.topk(k, dim=1).indices, True) & mask


@pytest.mark.parametrize("inactive", [False, True], ids=["all-active", "inactive"])
@pytest.mark.parametrize("capacity", [0.125, 0.5])
def test_unchosen_tokens_pass_bitwise(capacity, inactive):
    torch.manual_seed(0)
    block = make(capacity=capacity)
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    if inactive:  # a block told so never chooses an inactive token (even when fewer than k are active)
        block.skip_inactive = True
        mask[2, 3:] = False
    out, m = block(x, mask)
    assert m is mask
    chosen = chosen_by_router(block, x, mask, block.tokens_per_sequence(T))
    assert torch.equal(out[~chosen], x[~chosen])
    assert (out[chosen] != x[chosen]).any(-1).all()
    assert block.last_stats["tokens_processed"] == int(chosen.sum())


def dense_twin(block: MoDBlock, cfg: ModelConfig) -> Block:
    """A dense Block with the MoD block's attention and MLP weights."""
    dense = Block(cfg)
    dense.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith(("router", "predictor"))})
    return dense


def weighted(dense: Block, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The dense block's two residual updates, each weighted by w: h = x + w attn(x), h + w mlp(h)."""
    h = x + w * dense.attn_branch(x)
    return h + w * dense.mlp_branch(h)


def test_full_capacity_equals_dense_block_update():
    """capacity 1: each of the dense block's two residual updates weighted by sigmoid(r)."""
    torch.manual_seed(1)
    cfg = cfg_with(capacity=1.0)
    block = make(capacity=1.0)
    dense = dense_twin(block, cfg)
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        out, _ = block(x, mask)
        ref = weighted(dense, x, torch.sigmoid(block.router(x)))
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)


def test_chosen_tokens_equal_block_on_the_subsequence():
    """Chosen tokens attend causally among themselves only, in position order."""
    torch.manual_seed(2)
    cfg = cfg_with(capacity=0.25)
    block = make(capacity=0.25)
    dense = dense_twin(block, cfg)
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        out, _ = block(x, mask)
        chosen = chosen_by_router(block, x, mask, 4)
        for b in range(B):
            sub = x[b, chosen[b]].unsqueeze(0)  # boolean indexing keeps position order
            ref = weighted(dense, sub, torch.sigmoid(block.router(sub)))
            torch.testing.assert_close(out[b, chosen[b]], ref[0], atol=1e-6, rtol=0)


class SdpaShapes(TorchDispatchMode):
    """Records the query shape of every attention kernel call."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in str(func):
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("capacity", [0.125, 0.25, 0.5, 1.0])
def test_compute_scales_with_capacity(capacity):
    torch.manual_seed(3)
    block = make(capacity=capacity)
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    k = int(capacity * T)
    with FlopCounterMode(display=False) as flops, SdpaShapes() as sdpa:
        block(x, mask)
    # Linear layers: qkv 3D^2 + proj D^2 + fc 2D^2 + proj 2D^2 = 8D^2 MACs per chosen token,
    # plus router and predictor (D MACs each) on every token and the router again on the
    # chosen ones; at capacity 1.0 (no choice) the router alone.
    matmul = sum(v for op, v in flops.get_flop_counts()["Global"].items() if "mm" in str(op))
    routing = D * B * T if capacity == 1.0 else 2 * D * B * T + D * B * k
    assert matmul == 2 * 8 * D * D * B * k + 2 * routing
    assert sdpa.shapes == [(B, 2, k, D // 2)]  # attention over the k chosen tokens only
    assert block.last_stats["rows"] == B * k
    assert block.last_stats["attn_pairs"] == B * k * (k + 1) // 2


def test_per_block_capacities_need_the_index():
    cfg = cfg_with(capacities=[0.25, 0.5])
    a, b = MoDBlock(cfg), MoDBlock(cfg)
    x, mask = torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="layer.index"):
        a(x, mask)
    a.index, b.index = 0, 1
    a(x, mask)
    b(x, mask)
    assert (a.last_stats["rows"], b.last_stats["rows"]) == (B * 4, B * 8)
    assert (a.last_stats["capacity"], b.last_stats["capacity"]) == (0.25, 0.5)
    b.index = 2
    with pytest.raises(ValueError, match="no entry for block 2"):
        b(x, mask)
    with pytest.raises(ValueError, match="capacity"):
        MoDBlock(cfg_with(capacity=0.0))


def test_registered_and_built_by_spec():
    assert BLOCKS["mod"] is MoDBlock
    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2, block="mod")
    layer = build_layer(LayerSpec("t", 1), cfg, seed=1)
    assert isinstance(layer, MoDBlock) and layer.opts == MoDOptions()
    out, _ = layer(torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool))
    assert out.shape == (B, T, D) and layer.last_stats["rows"] == B * 2


def test_predictor_loss_gradients_equal_summed_objective():
    torch.manual_seed(4)
    coef = 0.5
    block = make(capacity=0.25, predictor_loss_coef=coef)
    head = torch.nn.Linear(D, 5)
    x, y = torch.randn(B, T, D), torch.randint(0, 5, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)

    def grads(with_attach: bool, add_aux: bool):
        block.zero_grad()
        xi = x.clone().requires_grad_()
        if with_attach:
            out, _ = block(xi, mask)
            loss = F.cross_entropy(head(out).flatten(0, 1), y.flatten())
        else:
            out, aux = block.forward_with_aux(xi, mask)
            loss = F.cross_entropy(head(out).flatten(0, 1), y.flatten()) + (coef * aux if add_aux else 0)
        loss.backward()
        return {n: p.grad.clone() if p.grad is not None else None for n, p in block.named_parameters()}, xi.grad

    (ga, xa), (gb, xb), (gc, _) = grads(True, False), grads(False, True), grads(False, False)
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(xa, xb, atol=1e-7, rtol=1e-6)
    assert gc["predictor.weight"] is None  # only the aux loss trains the predictor (input detached)
    assert ga["predictor.weight"].abs().sum() > 0
    assert ga["router.weight"].abs().sum() > 0  # the router learns through the weighted update


def test_training_toy_batch_and_predictor_learns():
    torch.manual_seed(5)
    block = make(capacity=0.25, predictor_loss_coef=1.0)
    losses, aux = train_block(block, 25, "aux_loss", B, T, D)
    assert losses[-1] < losses[0]
    assert aux[-1] < aux[0]


def test_predictor_routing_is_causal_and_bypasses_the_rest():
    torch.manual_seed(6)
    cfg = cfg_with(routing="predictor")
    block = make(routing="predictor")
    dense = dense_twin(block, cfg)
    with torch.no_grad():
        block.predictor.weight.normal_(0.0, 1.0)
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.bool)
    with torch.no_grad():
        out, _ = block(x, mask)
        accepted = block.predictor(x).squeeze(-1) > 0
        assert torch.equal(out[~accepted], x[~accepted])
        assert block.last_stats["tokens_processed"] == int(accepted.sum())
        assert block.last_stats["rows"] == B * int(accepted.sum(1).max())
        assert len(set(accepted.sum(1).tolist())) > 1  # sequences differ: the shorter ones are padded
        for b in range(B):  # accepted tokens see only accepted tokens, never the padding rows
            sub = x[b, accepted[b]].unsqueeze(0)
            ref = weighted(dense, sub, torch.sigmoid(block.router(sub)))
            torch.testing.assert_close(out[b, accepted[b]], ref[0], atol=1e-6, rtol=0)
        x2 = x.clone()
        x2[:, 9:] = torch.randn(B, T - 9, D)  # change the future
        out2, _ = block(x2, mask)
    torch.testing.assert_close(out2[:, :9], out[:, :9], atol=1e-6, rtol=0)


class _NoDeviceReads(TorchDispatchMode):
    """Fails on every op that reads a device value back to the host (on a GPU, a
    synchronisation): a scalar read (`item`, `int`, `float`, `bool`) or `nonzero`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero):
            raise AssertionError(f"{func} reads a device value")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("inactive", [False, True], ids=["all-active", "inactive"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("part", [None, "halves"])
def test_top_k_routing_never_reads_the_device(family, part, inactive):
    """Forward and backward of a top-k MoD block, whole or as its two halves, over two
    microbatches, every token active or some inactive: no host synchronisation; the stats,
    read once after, are the right numbers."""
    from dynmo.model.stats import as_numbers

    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2, mlp_ratio=2, block="mod", family=family,
                      mod=MoDOptions(capacity=0.25))
    block = build_layer(LayerSpec("t", 0), cfg, seed=0)
    k = block.tokens_per_sequence(T)
    mask = torch.ones(B, T, dtype=torch.bool)
    if inactive:
        block.skip_inactive = True
        mask[0, :3] = False
    with _NoDeviceReads():
        for _ in range(2):
            x = torch.randn(B, T, D, requires_grad=True)
            if part:
                y = block.mlp_half(*block.attn_half(x, mask))[0]
            else:
                y = block(x, mask)[0]
            y.square().sum().backward()
    (stats,) = as_numbers([block.last_stats])
    assert stats["rows"] == 2 * B * k and stats["forwards"] == 2
    assert stats["active_tokens"] == 2 * (B * T - 3 * inactive)
    assert 0 < stats["tokens_processed"] <= 2 * B * k and 0 <= stats["predictor_accuracy"] <= 1
    assert stats["tokens_processed"] == 2 * B * k or inactive


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("capacity", [1.0, 0.25])
def test_whole_block_is_its_two_halves_bitwise(family, capacity):
    """The whole block (the chosen rows gathered and scattered once; at capacity 1.0 every token
    in place) and its two halves (the routing handed over as the carry): the same output and the
    same gradients, bit for bit."""
    cfg = ModelConfig(d_model=D, n_heads=2, seq_len=T, n_layers=2, mlp_ratio=2, block="mod", family=family,
                      mod=MoDOptions(capacity=capacity, predictor_loss_coef=0.5))
    block = build_layer(LayerSpec("t", 0), cfg, seed=0)
    with torch.no_grad():
        block.router.weight.normal_(0.0, 1.0)
    x, mask = torch.randn(B, T, D), torch.ones(B, T, dtype=torch.bool)
    upstream = torch.randn(B, T, D)
    runs = []
    for whole in (True, False):
        block.zero_grad()
        xi = x.clone().requires_grad_()
        y = block(xi, mask)[0] if whole else block.mlp_half(*block.attn_half(xi, mask))[0]
        (y * upstream).sum().backward()
        runs.append([y.detach(), xi.grad] + [p.grad for p in block.parameters()])
    predictor = 2 + [n for n, _ in block.named_parameters()].index("predictor.weight")
    assert (runs[0][predictor] is None) == (capacity == 1.0)  # the predictor trains where there is a choice
    for a, b in zip(*runs):
        assert (a is None and b is None) or torch.equal(a, b)
