"""`x + w * a` with w one weight per row ([..., 1], broadcast over the features), in fewer operators.

A routed block weights its updates by the router's score of each row (Mixture of Depths) and
adds them to the residual stream. Autograd's product with a broadcast weight costs three
operators backward (the update's gradient, the product with the update, its sum over the
features) and the sum two forward; `gated_add` is one operator forward (`addcmul`) and two
backward: `g * w`, and the weight's gradient as one batched dot product of each row's
gradient with its update (`einsum`, a `bmm`), with the residual's gradient passed as it came.
"""

from __future__ import annotations

import torch


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
