"""A layer's auxiliary loss (MoE balance loss, MoD predictor loss, early-exit classifier loss).

The loss exists only on the last pipeline stage, so a layer elsewhere cannot add its auxiliary
loss to it. Instead the layer returns its output through an identity autograd Function whose
backward also seeds the auxiliary loss with gradient `coef` (Megatron-Core's
MoEAuxLossAutoScaler). The parameter gradients then equal those of
`(main_loss + coef * aux_loss).backward()`.
"""

from __future__ import annotations

import torch

from dynmo.model.consts import full


def seed(ctx, device: torch.device) -> torch.Tensor:
    """The gradient `coef` of the auxiliary loss, a constant made once per coefficient, shape,
    dtype and device (`dynmo.model.consts.full`: no fill launched per microbatch). Nothing
    writes into a gradient it is handed, and the kept reference stops autograd from reusing it."""
    return full(ctx.coef, ctx.aux_shape, ctx.aux_dtype, device)


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
        aux_grad = seed(ctx, grad.device)
        return grad, aux_grad, None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    """Return `x` unchanged, carrying `coef * aux` into the backward pass.

    Gradient scaling: each microbatch back-propagates its loss unscaled and the runtime divides
    the summed gradients by the number of microbatches in one place (`dynmo.runtime.grads.scale_grads`).
    The auxiliary gradient is seeded per microbatch with `coef` and divided the same way, so
    the objective is the microbatch mean of `main + coef * aux`, exactly as a single process
    that averages `main + coef * aux` over the same microbatches.
    """
    if not carries(aux, coef):
        return x
    return _AuxLossScaler.apply(x, aux, float(coef))


class _AddWithAux(torch.autograd.Function):
    """a + b (same shape); backward also sends gradient `coef` into the scalar `aux`: the sum is
    a new tensor, so it needs no copy to carry the loss (`_AuxLossScaler`'s clone)."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, aux: torch.Tensor, coef: float):
        ctx.coef, ctx.aux_shape, ctx.aux_dtype = coef, aux.shape, aux.dtype
        ctx.dtypes = a.dtype, b.dtype
        return a + b

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        aux_grad = seed(ctx, grad.device)
        return grad.to(ctx.dtypes[0]), grad.to(ctx.dtypes[1]), aux_grad, None


def carries(aux: torch.Tensor, coef: float) -> bool:
    """Whether `aux` has a gradient to receive: a nonzero coefficient, in a graph."""
    return coef != 0.0 and torch.is_grad_enabled() and aux.requires_grad


def add_with_aux(a: torch.Tensor, b: torch.Tensor, aux: torch.Tensor, coef: float) -> torch.Tensor:
    """`attach_aux_loss(a + b, aux, coef)` in one operator forward (no copy)."""
    if not carries(aux, coef) or a.shape != b.shape or a.dtype != b.dtype:
        return attach_aux_loss(a + b, aux, coef)
    return _AddWithAux.apply(a, b, aux, float(coef))
