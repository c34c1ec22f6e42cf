"""A Mixture of Depths block's predictor loss, in one autograd Function: the sum over tokens
of the binary cross-entropy of the predictor's logit of each token against whether the router
chose it, and how many tokens the predictor got wrong.

    logits = x W^T + b                (x detached: the loss trains the predictor only)
    loss   = sum BCE(logits, chosen)
    wrong  = #{tokens: (logits > 0) != chosen}

Autograd's composition costs seven operators forward (the product, the target's zeros and
scatter, the loss, a comparison, its agreement with the target, the count) and seven backward
(the loss's sigmoid, difference and product, the weight's and bias's products, their two
accumulations). Here the target is scattered into a zero tensor made once (`consts.full`), the
loss's gradient with respect to the logits, `sigmoid(logits) - chosen`, is made in the forward
where its rounding to 0 or +-1 also counts the wrong predictions (it is 0 exactly where the
prediction agrees, +-1 where it does not: one `round` and one `count_nonzero`), so the
backward is the product with the incoming gradient and the weight's and bias's products.
A logit within rounding of 0 (|logit| < 1e-7 in float32) may count as agreeing either way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dynmo.model.consts import full
from dynmo.model.gated import compute_dtype


class _PredictorLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top: torch.Tensor, T: int):
        B = top.shape[0]
        logits = torch.addmm(bias, x, weight.t()).view(B, T)
        # the loss and the difference in float32 whatever the compute dtype (autocast computes
        # the loss so): a bf16 sigmoid near 0.5 would round small logits to the wrong side
        logits = logits.to(torch.float32)
        target = full(0.0, (B, T), torch.float32, x.device).scatter(1, top, 1.0)
        loss = F.binary_cross_entropy_with_logits(logits, target, reduction="sum")
        diff = torch.sigmoid(logits).sub_(target)  # d loss / d logits
        wrong = torch.count_nonzero(torch.round(diff))
        ctx.save_for_backward(x, diff)
        ctx.mark_non_differentiable(wrong)
        ctx.set_materialize_grads(False)  # no zero gradient made for the count
        return loss, wrong

    @staticmethod
    def backward(ctx, gloss: torch.Tensor, _):
        if gloss is None:
            return None, None, None, None, None
        x, diff = ctx.saved_tensors
        g = (diff * gloss).view(-1, 1).to(x.dtype)
        return None, torch.mm(g.t(), x), g.sum(0), None, None


def predictor_loss(x: torch.Tensor, predictor: nn.Linear, top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed BCE of `predictor`'s logits of x [B, T, D] (detached) against the router's
    choice `top` [B, k] (positions, any order), the number of wrong predictions) (module docstring)."""
    B, T, D = x.shape
    dtype = compute_dtype(x, predictor.weight)
    if x.dtype != dtype or predictor.bias is None:
        pred = predictor(x.detach()).squeeze(-1)
        target = torch.zeros_like(pred).scatter_(1, top, 1.0)
        loss = F.binary_cross_entropy_with_logits(pred, target, reduction="sum")
        return loss, ((pred > 0) != target).sum()
    return _PredictorLoss.apply(x.detach().reshape(-1, D), predictor.weight.to(dtype), predictor.bias.to(dtype), top, T)
