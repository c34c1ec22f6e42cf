"""Expert parallelism (`parallel.ep` = P > 1): the experts of every MoE layer spread over the P
data-parallel replicas of a pipeline position that form one expert-parallel group (P
consecutive replicas; `dynmo.runtime.dist` makes the groups).

A layer is built whole, as without expert parallelism (same seeds, same weights), and then
keeps only this rank's experts: rank q of the group holds experts q*L .. (q+1)*L - 1, L =
num_experts / P, as rows of the stacked expert weights (`localize`). The experts module gets an
`ExpertGroup` handle as its `ep` attribute, through which the model's MoE forward
(`dynmo.model.moe.dispatch_ep`) exchanges tokens by all-to-all; the model never imports the
runtime.

Gradients: an expert's gradient on its rank already sums the contributions of the P replicas
of its group (the all-to-all's backward brought them back); `grads.sync_data_parallel` sums it
over the dp/P replicas that hold the same experts and divides by dp, so the update is the mean
over the replicas, as without expert parallelism. Every other gradient is averaged over the
whole data-parallel group as before.

Checkpoints store each expert parameter (and its AdamW state) under the whole tensor's key, as
a DTensor sharded by rows over the expert-parallel group (`stored`): DCP writes the whole
tensor once and reshards on load, so a checkpoint resumes under any `parallel.ep`, and
`dynmo export` reads the same keys as without expert parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dynmo.runtime.dist import DistContext


def is_expert_param(name: str) -> bool:
    """Whether parameter `name` (of a layer) is one of the stacked expert weights."""
    return ".experts." in f".{name}"


def expert_modules(layer: nn.Module) -> list[nn.Module]:
    """The stacked-experts modules of a layer (none for a layer without experts)."""
    return [m for n, m in layer.named_modules() if n.split(".")[-1] == "experts" and any(True for _ in m.parameters())]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with its transpose as the backward: rows `send[q]` go to rank q,
    `recv[q]` come from rank q."""

    @staticmethod
    def forward(ctx, x, send, recv, group, wire):
        ctx.send, ctx.recv, ctx.group, ctx.wire = send, recv, group, wire
        return _exchange(x, send, recv, group, wire)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.recv, ctx.send, ctx.group, ctx.wire), None, None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group, wire: torch.dtype | None) -> torch.Tensor:
    dtype = x.dtype
    if wire is not None and dtype != wire:
        x = x.to(wire)  # gloo's all-to-all takes no bfloat16: float32 carries it losslessly
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out.to(dtype)


class ExpertGroup:
    """What the MoE forward needs of the expert-parallel group: its size, this rank's index,
    every rank's per-expert counts, and an autograd all-to-all."""

    def __init__(self, size: int, rank: int, group: dist.ProcessGroup, backend: str):
        self.size, self.rank, self.group = size, rank, group
        self.wire = torch.float32 if backend == "gloo" else None

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[size, E]: every rank's `counts` [E] (an all-gather; no gradient)."""
        parts = [torch.empty_like(counts) for _ in range(self.size)]
        dist.all_gather(parts, counts.contiguous(), group=self.group)
        return torch.stack(parts).cpu()

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return _AllToAll.apply(x, send, recv, self.group, self.wire)


def group_of(ctx: DistContext) -> ExpertGroup | None:
    """This rank's expert-parallel handle, or None without expert parallelism."""
    if ctx.ep <= 1:
        return None
    return ExpertGroup(ctx.ep, ctx.ep_rank, ctx.ep_group, ctx.backend)


def localize(layer: nn.Module, ep: ExpertGroup | None) -> nn.Module:
    """Keep only this rank's experts of every MoE module of `layer` (rows of each stacked expert
    weight), in place, and hand the experts modules the group's handle. No-op when `ep` is None."""
    if ep is None:
        return layer
    for mod in expert_modules(layer):
        if getattr(mod, "ep", None) is not None:
            continue  # already this rank's experts
        for sub in mod.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                n = p.shape[0]
                if n % ep.size:
                    raise ValueError(f"{n} experts do not divide over parallel.ep={ep.size} ranks")
                k = n // ep.size
                rows = p.detach()[ep.rank * k : (ep.rank + 1) * k].clone()
                setattr(sub, name, nn.Parameter(rows, requires_grad=p.requires_grad))
        mod.ep = ep
    return layer


def rebind(layer: nn.Module, ep: ExpertGroup) -> None:
    """Hand a localized layer's experts modules a new group's handle (after a re-pack)."""
    for mod in expert_modules(layer):
        mod.ep = ep


_MESHES: dict = {}


def stored(ctx: DistContext, name: str, value: torch.Tensor) -> torch.Tensor:
    """How a checkpoint stores tensor `value` of parameter `name` (a weight or its AdamW state):
    of an expert parameter under expert parallelism, this rank's rows as one DTensor sharded by
    rows over the expert-parallel group (the whole tensor's key, shape and stride); anything
    else as it is."""
    if ctx.ep <= 1 or not is_expert_param(name) or value.dim() == 0:
        return value
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    key = (id(ctx.ep_group), value.device.type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(ctx.ep_group, value.device.type)
    shape = (value.shape[0] * ctx.ep, *value.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(value, _MESHES[key], [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
