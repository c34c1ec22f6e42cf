"""A step's gradients after the schedule ran: scaled for the microbatches, summed over the
data-parallel replicas, and clipped on the norm of the whole model.

The gradient norm is summed per layer in layer order, not per stage, so it does not depend on
the layout: one reason training after a re-layout is the same computation (bitwise on CPU).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dynmo.config import ModelConfig
from dynmo.model.layers import LayerSpec, layer_class, tag_layer
from dynmo.runtime import optim
from dynmo.runtime.dist import DistContext
from dynmo.runtime.experts import first_rows, is_expert_param, module_of, num_experts, reduce_copies


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
    """Average the gradients over the data-parallel replicas (one flat all-reduce).

    With expert parallelism (`parallel.ep` > 1) the expert gradients are summed only over the
    replicas that hold the same experts (each already sums its expert-parallel group's
    contributions, `dynmo.runtime.experts`), and divided by dp as well: the mean over the
    replicas, as without it; then the copies of an expert sum theirs over the expert-parallel
    group (`experts.reduce_copies`). In that order because a copy sits at another offset of the
    flat buffer than its expert's other copies, and with three or more replicas a reduction's
    rounding depends on the offset: summed over the replicas first, each copy's rows come out the
    same in every group, and the group's all-reduce then gives every copy, in every group, the
    same bits. Every other gradient is averaged over the whole group."""
    if ctx.dp_group is None:
        if ctx.ep > 1:
            reduce_copies(layers)
        return
    if ctx.ep > 1:
        expert = [p.grad for i in sorted(layers) for n, p in layers[i].named_parameters()
                  if p.grad is not None and is_expert_param(n)]
        other = [p.grad for i in sorted(layers) for n, p in layers[i].named_parameters()
                 if p.grad is not None and not is_expert_param(n)]
        _average(other, ctx.dp_group, ctx.dp)
        _average(expert, ctx.ep_replica_group, ctx.dp)
        reduce_copies(layers)
        return
    _average(local_grads(layers), ctx.dp_group, ctx.dp)


def _average(grads: list[torch.Tensor], group, n: int) -> None:
    """Sum `grads` over `group` (no group: this rank's alone) in one flat all-reduce, divided by n."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.div_(n)
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


class NormSlots:
    """Where the squared gradient norms of the placement units go, so that the norm is summed
    per model layer (embedding, block, head) whatever the units: a whole unit's norm is its
    layer's (`optim.layer_sq_norm`); the two halves of a split block send each parameter's
    squared norm to its slot, and the block's is summed from them in the whole block's
    parameter order (attention half first), as `optim.layer_sq_norm` sums a whole block's.
    Built alike on every rank, from the units' specs."""

    def __init__(self, specs: list[LayerSpec], model: ModelConfig):
        self.unit_layer = [s.model_index for s in specs]
        self.num_layers = self.unit_layer[-1] + 1 if specs else 0
        self.slots: dict[int, dict[str, int]] = {}  # split unit -> {parameter: slot}
        self.size = 0
        with torch.device("meta"):
            for i, spec in enumerate(specs):
                if spec.part:
                    names = [n for n, _ in tag_layer(layer_class(spec, model)(model), spec).named_parameters()]
                    self.slots[i] = {n: self.size + k for k, n in enumerate(names)}
                    self.size += len(names)

    def add(self, unit: int, names: list[str]) -> None:
        """Parameters a dynamic case adds to split unit `unit` after it was built (an exit
        classifier), registered after the unit's own, as they are in the whole block. Called
        alike on every rank, for every unit, held or not."""
        if unit not in self.slots:
            return  # a whole unit's norm is its layer's, whatever it holds
        for n in names:
            if n not in self.slots[unit]:
                self.slots[unit][n] = self.size
                self.size += 1

    def layer_norms(self, layers: dict[int, nn.Module], tie, device: torch.device,
                    ep_group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """This rank's part of the per-model-layer squared norms; with split units, the
        per-parameter squared norms and whether each is present, appended (summed over the
        pipeline ranks, then folded by `fold`). `ep_group`: expert parallelism's group, over
        which each expert parameter's squared norm is summed first (each rank holds its rows)."""
        sq = torch.zeros(self.num_layers + 2 * self.size, dtype=torch.float32, device=device)
        if ep_group is not None:
            per_param = _expert_summed(layers, {i: optim.param_sq_norms(layer, tie.norm_skip(i) if tie is not None else ())
                                        for i, layer in layers.items()}, ep_group, device)
        for i, layer in layers.items():
            skip = tie.norm_skip(i) if tie is not None else ()
            if i not in self.slots:
                if ep_group is None:
                    sq[self.unit_layer[i]] = optim.layer_sq_norm(layer, skip).to(device)
                elif per_param[i]:
                    sq[self.unit_layer[i]] = torch.stack(list(per_param[i].values())).sum().to(device)
                continue
            norms = optim.param_sq_norms(layer, skip) if ep_group is None else per_param[i]
            for n, norm in norms.items():
                k = self.num_layers + 2 * self.slots[i][n]
                sq[k] = norm.to(device)
                sq[k + 1] = 1.0
        return sq

    def fold(self, sq: torch.Tensor) -> torch.Tensor:
        """The per-model-layer squared norms of the summed `layer_norms`."""
        out = sq[: self.num_layers].clone()
        per_layer: dict[int, list[torch.Tensor]] = {}
        for i, slots in self.slots.items():  # unit order: a block's attention half first
            for k in slots.values():
                k = self.num_layers + 2 * k
                if sq[k + 1] > 0:
                    per_layer.setdefault(self.unit_layer[i], []).append(sq[k])
        for layer, norms in per_layer.items():
            out[layer] = torch.stack(norms).sum()
        return out


def _expert_summed(layers: dict[int, nn.Module], norms: dict[int, dict[str, torch.Tensor]],
                   group: dist.ProcessGroup, device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    """`norms` ({layer: {parameter: squared norm}}) with every expert parameter's the sum over
    all its experts, in expert index order: each rank puts its rows' squared norms at their
    experts' indices (a copied expert's from its first copy only), one all-reduce fills every
    index (each is non-zero on one rank only, so the sum is exact), and the per-expert norms are
    summed in index order. So the norm, and the
    clipping, do not depend on which rank holds which expert (`experts.apply_placement`)."""
    keys = [(i, n) for i in sorted(norms) for n in norms[i] if is_expert_param(n)]
    if keys:
        rows = []
        for i, n in keys:
            p = layers[i].get_parameter(n)
            mod = module_of(layers[i], n)
            per = p.grad.detach().float().pow(2).reshape(p.shape[0], -1).sum(1)
            v = torch.zeros(num_experts(mod), dtype=torch.float32, device=per.device)
            mine, held = first_rows(mod)
            v[torch.tensor(held, dtype=torch.long, device=per.device)] = per[torch.tensor(mine, dtype=torch.long, device=per.device)]
            rows.append(v)
        v = torch.stack(rows).to(device)
        dist.all_reduce(v, group=group)
        for (i, n), x in zip(keys, v):
            norms[i][n] = x.sum()
    return norms


def clip_grads(layers: dict[int, nn.Module], slots: NormSlots, tie, ctx: DistContext, max_norm: float,
               sharded: bool = False) -> tuple[float, float]:
    """(the whole model's gradient norm, the clipping scale applied). `tie`: the tied
    embeddings' bookkeeping, or None (a tied tensor counts once). `sharded`: each data-parallel
    replica holds its shard of every gradient (`parallel.shard = "full"`), whose squared norms
    add up over the replicas."""
    sq = slots.layer_norms(layers, tie, ctx.device, ctx.ep_group if ctx.ep > 1 else None)
    if sharded and ctx.dp_group is not None:
        dist.all_reduce(sq, group=ctx.dp_group)
    if ctx.pp > 1:
        # each entry is non-zero on exactly one rank, so the sum is exact
        dist.all_reduce(sq, group=ctx.pp_group)
    total, scale = optim.clip_coefficient(slots.fold(sq.cpu()), max_norm)
    if scale != 1.0:
        for g in local_grads(layers):
            g.mul_(scale)
    return total, scale
