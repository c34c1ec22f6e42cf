"""A step's gradients after the schedule ran: scaled for the microbatches, summed over the
data-parallel replicas, and clipped on the norm of the whole model.

The gradient norm is summed per layer in layer order, not per stage, so it does not depend on
the layout: one reason training after a re-layout is the same computation (bitwise on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dynmo.runtime import optim
from dynmo.runtime.dist import DistContext


def local_grads(layers: dict[int, nn.Module]) -> list[torch.Tensor]:
    """This rank's gradients, in layer order."""
    return [p.grad for i in sorted(layers) for p in layers[i].parameters() if p.grad is not None]


def scale_grads(layers: dict[int, nn.Module], microbatches: int) -> None:
    """The one place gradients are scaled for the microbatches. The objective of a step is
    the mean over its microbatches (and data-parallel replicas) of each microbatch's loss
    plus its auxiliary losses. Each microbatch back-propagates its loss unscaled, and each
    auxiliary loss seeds its own gradient with its coefficient (`dynmo.model.aux_loss`), so
    no layer needs to know the microbatch count; the summed gradients are divided here by
    the number of microbatches, and by the number of replicas in the data-parallel
    reduction (`sync_data_parallel`)."""
    for g in local_grads(layers):
        g.div_(microbatches)


def sync_data_parallel(layers: dict[int, nn.Module], ctx: DistContext) -> None:
    """Average the gradients over the data-parallel replicas (one flat all-reduce)."""
    if ctx.dp_group is None:
        return
    grads = local_grads(layers)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=ctx.dp_group)
    flat.div_(ctx.dp)
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


def clip_grads(layers: dict[int, nn.Module], num_layers: int, tie, ctx: DistContext, max_norm: float) -> tuple[float, float]:
    """(the whole model's gradient norm, the clipping scale applied). `tie`: the tied
    embeddings' bookkeeping, or None (a tied tensor counts once)."""
    sq = torch.zeros(num_layers, dtype=torch.float32, device=ctx.device)
    for i, layer in layers.items():
        skip = tie.norm_skip(i) if tie is not None else ()
        sq[i] = optim.layer_sq_norm(layer, skip).to(ctx.device)
    if ctx.pp > 1:
        # each entry is non-zero on exactly one rank, so the sum is exact
        dist.all_reduce(sq, group=ctx.pp_group)
    total, scale = optim.clip_coefficient(sq.cpu(), max_norm)
    if scale != 1.0:
        for g in local_grads(layers):
            g.mul_(scale)
    return total, scale
