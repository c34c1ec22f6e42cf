"""The routed blocks' fused autograd Functions equal autograd's composition of the same
operators: `routed_add` (router weight and weighted update), `take_rows` / `put_rows` (the
chosen rows out and back, with an auxiliary loss carried), `predictor_loss` (the MoD predictor's
loss and its count of wrong predictions); values and every gradient, on random inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dynmo.model.aux_loss import attach_aux_loss
from dynmo.model.gated import gated_add, routed_add
from dynmo.model.predictor import predictor_loss
from dynmo.model.rows import put_rows, take_rows


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [False, True])
def test_routed_add_is_the_router_sigmoid_and_gated_add(seed, dtype, bias):
    g = torch.Generator().manual_seed(seed)
    B, T, D = 2, 7, 5
    router = torch.nn.Linear(D, 1, bias=bias).to(dtype)
    x = torch.randn(B, T, D, generator=g, dtype=dtype, requires_grad=True)
    a = torch.randn(B, T, D, generator=g, dtype=dtype, requires_grad=True)
    m = torch.randn(B, T, D, generator=g, dtype=dtype)
    leaves = [x, a, *router.parameters()]
    for second in (False, True):  # w also weights a second update, or only this one
        h, w = routed_add(x, a, router)
        w_ref = torch.sigmoid(router(x))
        h_ref = gated_add(x, w_ref, a)
        assert torch.equal(h, h_ref) and torch.equal(w, w_ref)
        out, ref = (gated_add(h, w, h * m), gated_add(h_ref, w_ref, h_ref * m)) if second else (h, h_ref)
        got, want = grads((out * m).sum(), leaves), grads((ref * m).sum(), leaves)
        for u, v in zip(got, want):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_take_and_put_rows_are_gather_and_scatter_and_carry_the_aux_loss(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, D, k = 3, 9, 4, 4
    x = torch.randn(B, T, D, generator=g, requires_grad=True)
    idx = torch.rand(B, T, generator=g).argsort(1)[:, :k].sort(1).values
    gi = idx.unsqueeze(-1).expand(-1, -1, D)
    scale = torch.randn(B, k, D, generator=g)
    p = torch.randn(3, generator=g, requires_grad=True)
    outer = torch.randn(B, T, D, generator=g)
    xp, rows = take_rows(x, gi)
    assert torch.equal(rows, x.gather(1, gi))
    aux = (p * p).sum()
    out = put_rows(xp, gi, torch.tanh(rows) * scale, aux, 0.3)
    ref = attach_aux_loss(x.scatter(1, gi, torch.tanh(x.gather(1, gi)) * scale), (p * p).sum(), 0.3)
    assert torch.equal(out, ref)
    for u, v in zip(grads((out * outer).sum(), [x, p]), grads((ref * outer).sum(), [x, p])):
        assert torch.equal(u, v)


@pytest.mark.parametrize("seed", range(6))
def test_predictor_loss_is_bce_against_the_choice_and_counts_the_wrong_predictions(seed):
    g = torch.Generator().manual_seed(seed)
    B, T, D, k = 3, 16, 8, 5
    pred = torch.nn.Linear(D, 1)
    with torch.no_grad():
        pred.weight.normal_(0, 1, generator=g)
        pred.bias.normal_(0, 1, generator=g)
    x = torch.randn(B, T, D, generator=g, requires_grad=True)
    top = torch.rand(B, T, generator=g).argsort(1)[:, :k]  # any order
    loss, wrong = predictor_loss(x, pred, top)
    logits = pred(x.detach()).squeeze(-1)
    target = torch.zeros_like(logits).scatter_(1, top, 1.0)
    ref = F.binary_cross_entropy_with_logits(logits, target, reduction="sum")
    torch.testing.assert_close(loss, ref)
    assert int(wrong) == int(((logits > 0) != target).sum())
    for u, v in zip(grads(2.5 * loss, list(pred.parameters())), grads(2.5 * ref, list(pred.parameters()))):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    assert not loss.grad_fn is None and x.grad is None  # the input is detached: the loss trains the predictor only
