"""Parameters, gradients and optimizer state sharded over a stage's data-parallel replicas
(`parallel.shard = "full"`), with PyTorch's own FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each placement unit (embedding, block or half block, head) is sharded on its own, on the
stage's data-parallel group as a 1-D DeviceMesh: its parameters are DTensors holding this
replica's rows of dimension 0 (`Shard(0)`), gathered for its forward and again for its
backward, and its gradients are reduce-scattered and averaged over the replicas by FSDP, so
dynmo's own data-parallel all-reduce is skipped. AdamW over the sharded parameters keeps its
moments sharded alike. The stage module is not sharded as a whole: FSDP cannot put a unit that
already ran under one sharded root under another, and a migration changes what a stage holds;
a unit of its own can move (the cost: gradients reduce-scattered per microbatch).

A migrating unit ships this replica's shard of its weights and moments to the same replica of
its new stage; the receiver builds it on the meta device, shards it on its own group, gives it
storage and copies the shard in (`empty_sharded`, `load_local`). Nothing is gathered to move
it. The gradient norm sums each replica's squared shard norms over the replicas.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from dynmo.config import ModelConfig
from dynmo.model.layers import LayerSpec, empty_layer


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This replica's shard of a sharded tensor; any other tensor as it is."""
    return t.to_local() if is_sharded(t) else t


def mesh_of(group: dist.ProcessGroup, device: torch.device):
    """The data-parallel group as the 1-D DeviceMesh FSDP shards over (one per group)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(group), device.type)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh.from_group(group, device.type)
    return _MESHES[key]


_MESHES: dict = {}


def shard(layer: nn.Module, mesh) -> nn.Module:
    """Shard `layer` over `mesh` in place (its parameters become DTensors), gathered for its
    forward and freed after it, gathered again for its backward."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    return layer


def empty_sharded(spec: LayerSpec, model: ModelConfig, device: torch.device, mesh) -> nn.Module:
    """Unit `spec` sharded over `mesh` with uninitialised storage for this replica's shards only,
    for a shard about to arrive (`load_local`)."""
    layer = empty_layer(spec, model, "meta")
    shard(layer, mesh)
    return layer.to_empty(device=device)


@torch.no_grad()
def load_local(layer: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy this replica's shards (by state-dict key, as `local_state` gave them) into a sharded
    layer's parameters and buffers."""
    for k, v in layer.state_dict().items():
        local(v).copy_(weights[k])


def local_state(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's state dict as this replica's shards."""
    return {k: local(v) for k, v in layer.state_dict().items()}


def as_sharded_state(layer: nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict]:
    """AdamW state that arrived as this replica's shards, as DTensors shaped like the layer's
    sharded parameters (the step count stays a plain number)."""
    from torch.distributed.tensor import DTensor

    params = dict(layer.named_parameters())
    out = {}
    for name, st in state.items():
        p = params[name]
        out[name] = {k: (DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride()) if v.dim() else v) for k, v in st.items()}
    return out
