"""A layer's auxiliary loss (MoE balance loss, MoD predictor loss, early-exit classifier loss).

The loss exists only on the last pipeline stage, so a layer elsewhere cannot add its auxiliary
loss to it. Instead the layer returns its output through an identity autograd Function whose
backward also seeds the auxiliary loss with gradient `coef` (Megatron-Core's
MoEAuxLossAutoScaler). The parameter gradients then equal those of
`(main_loss + coef * aux_loss).backward()`.
"""

from __future__ import annotations

import torch


class _AuxLossScaler(torch.autograd.Function):
    """Identity on `x`; backward also sends gradient `coef` into the scalar `aux`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, coef: float):
        ctx.coef = coef
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        # A copy, not `x` itself: an output aliasing an input would be a view that autograd
        # forbids modifying in place, and later code (or a schedule) may do that.
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = torch.full(ctx.aux_shape, ctx.coef, dtype=ctx.aux_dtype, device=grad.device)
        return grad, aux_grad, None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    """Return `x` unchanged, carrying `coef * aux` into the backward pass.

    Gradient scaling: each microbatch back-propagates its loss unscaled and the runtime divides
    the summed gradients by the number of microbatches in one place (`dynmo.runtime.grads.scale_grads`).
    The auxiliary gradient is seeded per microbatch with `coef` and divided the same way, so
    the objective is the microbatch mean of `main + coef * aux`, exactly as a single process
    that averages `main + coef * aux` over the same microbatches.
    """
    if coef == 0.0 or not torch.is_grad_enabled() or not aux.requires_grad:
        return x
    return _AuxLossScaler.apply(x, aux, float(coef))
