"""`x + w * a` with w one weight per row ([..., 1], broadcast over the features), in fewer operators.

A routed block weights its updates by the router's score of each row (Mixture of Depths) and
adds them to the residual stream. Autograd's product with a broadcast weight costs three
operators backward (the update's gradient, the product with the update, its sum over the
features) and the sum two forward; `gated_add` is one operator forward (`addcmul`) and two
backward: `g * w`, and the weight's gradient as one batched dot product of each row's
gradient with its update (`einsum`, a `bmm`), with the residual's gradient passed as it came.

`routed_add` also computes the weight, `w = sigmoid(router(x))` for a Linear router of one
output, and returns it for the block's second update. Its backward takes that update's
gradient of w in the same batched product (`baddbmm`), and adds the router's gradient of x to
the residual's in the same matrix product (`addmm`): two operators fewer than the Linear,
the sigmoid and `gated_add` each on their own, the same values.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class _GatedAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w, a)
        return torch.addcmul(x, w, a)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        w, a = ctx.saved_tensors
        ga = g * w if ctx.needs_input_grad[2] else None
        gw = torch.einsum("...d,...d->...", g, a).unsqueeze(-1) if ctx.needs_input_grad[1] else None
        return g, gw, ga


def gated_add(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x + w * a for x, a [..., D] and w [..., 1] of one dtype; the gradients autograd's would be
    (the weight's summed in another order)."""
    if x.shape != a.shape or w.shape != (*a.shape[:-1], 1) or not x.dtype == w.dtype == a.dtype:
        return x + w * a
    return _GatedAdd.apply(x, w, a)


class _RoutedAdd(torch.autograd.Function):
    """(x + w * a, w) with w = sigmoid(x W^T + b), x and a [N, D], W [1, D] and b [1] in x's dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        z = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
        w = torch.sigmoid(z)
        ctx.save_for_backward(x, a, weight, w)
        ctx.has_bias = bias is not None
        return torch.addcmul(x, w, a), w

    @staticmethod
    def backward(ctx, g: torch.Tensor | None, gw_out: torch.Tensor | None):
        x, a, weight, w = ctx.saved_tensors
        N = x.shape[0]
        if g is None:
            g = torch.zeros_like(x)
        dot = (g.view(N, 1, -1), a.view(N, -1, 1))  # each row's gradient . its update
        gw = torch.bmm(*dot) if gw_out is None else torch.baddbmm(gw_out.view(N, 1, 1), *dot)
        gz = torch.ops.aten.sigmoid_backward(gw.view(N, 1), w)
        ga = g * w
        gx = torch.addmm(g, gz, weight)  # the residual's gradient plus the router's
        gweight = torch.mm(gz.t(), x)
        gbias = gz.sum(0) if ctx.has_bias else None
        return gx, ga, gweight, gbias


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a Linear of `weight` computes x in: autocast's where it is on, else the weight's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.dtype


def routed_add(x: torch.Tensor, a: torch.Tensor, router: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + w * a, w) with w = sigmoid(router(x)) [..., 1], for x, a [..., D] and a Linear router
    of one output; as `gated_add(x, torch.sigmoid(router(x)), a)` with fewer operators
    backward. Under autocast the router computes in x's dtype, as autocast would run it."""
    w_dtype = compute_dtype(x, router.weight)
    if (type(router) is not nn.Linear or router.out_features != 1 or x.shape != a.shape
            or not x.dtype == a.dtype == w_dtype or not torch.is_grad_enabled()):
        w = torch.sigmoid(router(x))
        return gated_add(x, w, a), w
    shape = x.shape
    bias = None if router.bias is None else router.bias.to(x.dtype)
    h, w = _RoutedAdd.apply(x.reshape(-1, shape[-1]), a.reshape(-1, shape[-1]), router.weight.to(x.dtype), bias)
    return h.view(shape), w.view(*shape[:-1], 1)
