"""A routed block's chosen rows: taken out of the hidden state and put back, as one pair of
autograd Functions whose backward costs two operators instead of five.

    xp, rows = take_rows(x, index)       # xp: x passed through; rows: x.gather(1, index)
    ...                                  # the block computes `new` from rows
    out = put_rows(xp, index, new)       # xp.scatter(1, index, new)

Autograd's gather and scatter cost five operators backward: the scatter's gradient with zeros
written over the rows, the new rows' gradient gathered, and for the gather a zero tensor, a
scatter-add into it and the sum of x's two gradients. The pair costs two: `put_rows` hands its
gradient on unchanged for `xp` (not zeroed at the rows) and gathers the new rows' gradient;
`take_rows` writes the taken rows' gradient over those rows of it. So x's gradient is the
output's off the rows and the rows' on them, as autograd's. That holds only because `xp`
reaches nothing but the `put_rows` that overwrites the same rows: the two are used as a pair,
with the same index, and `xp` is never read otherwise.

`put_rows` may carry an auxiliary loss into the backward (`dynmo.model.aux_loss`): its backward
also seeds `aux` with gradient `coef`, so it needs no copy of the output to carry it.
"""

from __future__ import annotations

import torch

from dynmo.model.aux_loss import carries, seed


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor):
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        return x, x.gather(1, index)  # x as it is: autograd hands it out as a view

    @staticmethod
    def backward(ctx, gx: torch.Tensor | None, grows: torch.Tensor | None):
        (index,) = ctx.saved_tensors
        if grows is None:
            return gx, None
        if gx is None:
            return torch.zeros(ctx.shape, dtype=grows.dtype, device=grows.device).scatter(1, index, grows), None
        return gx.scatter(1, index, grows), None


class _PutRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xp: torch.Tensor, index: torch.Tensor, new: torch.Tensor, aux, coef: float):
        ctx.save_for_backward(index)
        ctx.coef = coef
        ctx.aux_shape, ctx.aux_dtype = (aux.shape, aux.dtype) if aux is not None else (None, None)
        return xp.scatter(1, index, new)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        gnew = grad.gather(1, index) if ctx.needs_input_grad[2] else None
        gaux = seed(ctx, grad.device) if ctx.aux_shape is not None and ctx.needs_input_grad[3] else None
        return grad, None, gnew, gaux, None


def take_rows(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x passed through for `put_rows`, x.gather(1, index)); see the module docstring."""
    if not torch.is_grad_enabled() or not x.requires_grad:
        return x, x.gather(1, index)
    xp, rows = _TakeRows.apply(x, index)
    return xp, rows


def put_rows(xp: torch.Tensor, index: torch.Tensor, new: torch.Tensor, aux: torch.Tensor | None = None,
             coef: float = 0.0) -> torch.Tensor:
    """xp.scatter(1, index, new) for the `xp` of `take_rows(x, index)`, carrying `coef * aux`
    into the backward when given."""
    if not torch.is_grad_enabled():
        return xp.scatter(1, index, new)
    return _PutRows.apply(xp, index, new, aux if aux is not None and carries(aux, coef) else None, float(coef))
